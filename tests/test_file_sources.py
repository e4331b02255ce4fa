"""JSON / JSONL conversations (LLaVA, ShareGPT, OpenAI messages), Parquet files and ``save_to_disk`` folders as
pack sources: the same tokens as the equivalent Energon sample, a ledger row with its reason for every record,
resume and stale-input detection, the same bytes whatever the workers. Real files throughout: JPEG/PNG images on
disk, tars, Arrow and Parquet written by pyarrow, the demo tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packfixture as fx
from mediafixture import make_image, write_source
from packtool.errors import SourceError
from packtool.packer.pipeline import pack
from packtool.packer.sources.files import resolve_source
from packtool.settings import EncodeSettings, PackSettings, PlanSettings

PACK_SIZE = 1024
N = 12


def _question(i: int) -> str:
    return f"Question {i}: what does picture {i} show?" + " more words" * (i * 7)


def _answer(i: int) -> str:
    return f"It shows thing number {i}." * (1 + i % 3)


def _images(i: int) -> list[str]:
    return [f"pics/{i:03d}-{k}.{'jpg' if k == 0 else 'png'}" for k in range(i % 3)]


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """The image folder every variant names: record ``i`` uses ``i % 3`` images."""
    root = tmp_path_factory.mktemp("media")
    (root / "pics").mkdir()
    for i in range(N):
        for k, name in enumerate(_images(i)):
            (root / name).write_bytes(make_image(40 + 9 * i, 30 + 5 * k, seed=i * 3 + k,
                                                 fmt="JPEG" if name.endswith("jpg") else "PNG"))
    return root


def llava(i: int) -> dict:
    tags = "<image>\n" * len(_images(i))
    rec: dict = {"id": f"r{i}", "conversations": [{"from": "human", "value": tags + _question(i)},
                                                  {"from": "gpt", "value": _answer(i)}]}
    if _images(i):
        rec["image"] = _images(i)[0] if len(_images(i)) == 1 else _images(i)
    return rec


def sharegpt(i: int) -> dict:
    return {"messages": [{"role": "user", "content": "<image>\n" * len(_images(i)) + _question(i)},
                         {"role": "assistant", "content": _answer(i)}], "images": _images(i)}


def openai(i: int) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": name}} for name in _images(i)]
    parts = [p for name in parts for p in (name, {"type": "text", "text": "\n"})]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": _question(i)}]},
                         {"role": "assistant", "content": [{"type": "text", "text": _answer(i)}]}]}


def energon_equivalent(root: Path, media: Path) -> Path:
    """The same records as an Energon dataset: a json member and one member per image (``img<k>``)."""
    samples = {}
    for i in range(N):
        members = {f"img{k}.{name.rsplit('.', 1)[1]}": (media / name).read_bytes()
                   for k, name in enumerate(_images(i))}
        doc = {"conversations": llava(i)["conversations"]}
        samples[f"{i:09d}"] = {"json": json.dumps(doc).encode(), **members}
    return write_source(root, samples)


def run_pack(source: Path, out: Path, tokenizer: Path, *, media_dir: Path | None = None, workers: int = 1) -> Path:
    src = resolve_source(source, media_dir=media_dir)
    settings = PackSettings(EncodeSettings(tokenizer=str(tokenizer), pack_size=PACK_SIZE), PlanSettings(shard_size="4"))
    pack(src, out, settings, workers=workers, progress=False)
    return out


def tokens_by_key(out: Path) -> dict[str, tuple]:
    """Each sample's tokens and targets by its position (a record's key adds its own id: ``000000004:r4``)."""
    return {seg.key.split(":")[0]: (tuple(tokens.tolist()), tuple(targets.tolist()))
            for seg, tokens, targets, _ in fx.packed_segments(out)}


def digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.parts}


def ledger(out: Path) -> dict[str, tuple[str, str]]:
    t = pq.read_table(out / "ledger.parquet", columns=["key", "status", "reason"])
    return {k: (s, r) for k, s, r in zip(*(t.column(c).to_pylist() for c in ("key", "status", "reason")))}


def test_json_formats_give_the_tokens_of_the_energon_sample(demo_dir, media, tmp_path):
    tok = demo_dir / "tokenizer"
    (tmp_path / "llava.json").write_text(json.dumps([llava(i) for i in range(N)]))
    (tmp_path / "sharegpt.jsonl").write_text("\n".join(json.dumps(sharegpt(i)) for i in range(N)) + "\n")
    (tmp_path / "openai.jsonl").write_text("\n".join(json.dumps(openai(i)) for i in range(N)))
    reference = tokens_by_key(run_pack(energon_equivalent(tmp_path / "energon", media), tmp_path / "o-e", tok))
    assert len(reference) == N and sum(len(_images(i)) for i in range(N)) > 5
    for name in ("llava.json", "sharegpt.jsonl", "openai.jsonl"):
        got = tokens_by_key(run_pack(tmp_path / name, tmp_path / f"o-{name}", tok, media_dir=media))
        assert got == reference, name
    # Control: one word changed in one record gives other tokens.
    changed = [llava(i) for i in range(N)]
    changed[4]["conversations"][1]["value"] += " Extra."
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    other = tokens_by_key(run_pack(tmp_path / "changed.json", tmp_path / "o-c", tok, media_dir=media))
    assert other["000000004"] != reference["000000004"]
    assert {k: v for k, v in other.items() if k != "000000004"} == \
        {k: v for k, v in reference.items() if k != "000000004"}


def test_parquet_and_save_to_disk_give_the_same_tokens(demo_dir, media, tmp_path):
    tok = demo_dir / "tokenizer"
    (tmp_path / "llava.json").write_text(json.dumps([llava(i) for i in range(N)]))
    reference = tokens_by_key(run_pack(tmp_path / "llava.json", tmp_path / "o-j", tok, media_dir=media))
    # Hugging Face's Image feature: a struct of the file's bytes and its name (bytes only for some rows).
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = {"messages": [sharegpt(i)["messages"] for i in range(N)],
            "images": [[{"bytes": (media / n).read_bytes(), "path": None if i % 2 else n.rsplit("/", 1)[1]}
                        for n in _images(i)] for i in range(N)]}
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({"messages": pa.array(rows["messages"], pa.list_(message)),
                      "images": pa.array(rows["images"], pa.list_(image))})
    (tmp_path / "hub" / "data").mkdir(parents=True)
    pq.write_table(table.slice(0, 7), tmp_path / "hub" / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(7), tmp_path / "hub" / "data" / "train-00001-of-00002.parquet")
    assert tokens_by_key(run_pack(tmp_path / "hub", tmp_path / "o-p", tok)) == reference
    # save_to_disk's layout: state.json naming Arrow IPC stream files.
    disk = tmp_path / "disk"
    disk.mkdir()
    with pa.ipc.new_stream(disk / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (disk / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (disk / "dataset_info.json").write_text("{}")
    assert tokens_by_key(run_pack(disk, tmp_path / "o-a", tok)) == reference


def test_every_bad_record_gets_a_ledger_row_with_its_reason(demo_dir, media, tmp_path):
    records = [json.dumps(sharegpt(i)) for i in range(4)]
    records[1] = json.dumps({**sharegpt(1), "images": ["pics/nope.jpg"]})
    records[2] = json.dumps({**sharegpt(2), "images": ["../../etc/passwd", "pics/002-1.png"]})
    records.append(json.dumps({**sharegpt(5), "images": ["https://example.com/a.jpg"]}))
    records.append("{not json")
    records.append(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}))
    (tmp_path / "bad.jsonl").write_text("\n".join(records) + "\n\n")
    out = tmp_path / "out"
    pack(resolve_source(tmp_path / "bad.jsonl", media_dir=media), out,
         PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE)),
         workers=1, progress=False)
    rows = ledger(out)
    assert len(rows) == 7 and rows["000000000"][0] == "packed" and rows["000000003"][0] == "packed"
    assert rows["000000001"] == ("error", f"media file 'pics/nope.jpg' not found in {media} "
                                          f"(No such file or directory)")
    assert rows["000000002"] == ("error", f"media path '../../etc/passwd' leaves the media folder {media}")
    assert rows["000000004"][0] == "error" and "is a URL" in rows["000000004"][1]
    assert rows["000000005"][0] == "error" and "line 6 of bad.jsonl is not valid JSON" in rows["000000005"][1]
    assert rows["000000006"] == ("error", "no assistant turn")


def _encoded_at(out: Path) -> dict[str, int]:
    """When each encode range of OUTPUT was committed (its ``source.json``'s modification time)."""
    return {str(p.parent.relative_to(out / ".packtool" / "encode")): p.stat().st_mtime_ns
            for p in sorted((out / ".packtool" / "encode").glob("*/*/*/source.json"))}


def test_resume_and_stale_input(demo_dir, media, tmp_path, monkeypatch):
    """Read in place: a rerun reads and writes nothing again; a replaced image or an edited record re-encodes
    its chunk only, and the packs equal a fresh run's."""
    from packtool.packer.sources import files

    monkeypatch.setattr(files, "RECORDS_PER_CHUNK", 4)  # 12 records: 3 chunks
    tok = demo_dir / "tokenizer"
    pics = tmp_path / "media"
    pics.mkdir()
    (pics / "pics").mkdir()
    for i in range(N):
        for name in _images(i):
            (pics / name).write_bytes((media / name).read_bytes())
    source = tmp_path / "data.json"
    source.write_text(json.dumps([llava(i) for i in range(N)]))
    out = run_pack(source, tmp_path / "out", tok, media_dir=pics)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "media", "out"]  # nothing staged
    first, encoded, first_tokens = digest(out), _encoded_at(out), tokens_by_key(out)
    assert len(encoded) == 3
    run_pack(source, out, tok, media_dir=pics)  # resume: nothing is encoded or written again
    assert digest(out) == first and _encoded_at(out) == encoded
    # An image replaced under the same name (other size: other image tokens) is never packed stale; only its
    # chunk (records 4-7) is encoded again.
    (pics / _images(5)[0]).write_bytes(make_image(300, 200, seed=99, fmt="JPEG"))
    run_pack(source, out, tok, media_dir=pics)
    again = _encoded_at(out)
    changed = [k for k in again if again[k] != encoded[k]]
    assert len(changed) == 1 and changed[0].startswith("train/data.json_000000004-")  # the chunk from record 4
    fresh = run_pack(source, tmp_path / "fresh", tok, media_dir=pics)
    assert digest(out) != first and tokens_by_key(out) == tokens_by_key(fresh)
    assert len(tokens_by_key(out)["000000005"][0]) > len(first_tokens["000000005"][0])
    # An edited record too (its chunk only).
    records = [llava(i) for i in range(N)]
    records[0]["conversations"][1]["value"] = "Edited."
    source.write_text(json.dumps(records))
    before = _encoded_at(out)
    run_pack(source, out, tok, media_dir=pics)
    after = _encoded_at(out)
    changed = [k for k in after if after[k] != before[k]]
    assert len(changed) == 1 and changed[0].startswith("train/data.json_000000000-")  # the first chunk
    assert tokens_by_key(out) == tokens_by_key(run_pack(source, tmp_path / "fresh2", tok, media_dir=pics))
    # A missing media file is stamped as missing: once it appears, its record is encoded again and packed.
    gone = pics / _images(8)[0]
    kept = gone.read_bytes()
    gone.unlink()
    run_pack(source, out, tok, media_dir=pics)
    assert ledger(out)["000000008:r8"][0] == "error"
    gone.write_bytes(kept)
    run_pack(source, out, tok, media_dir=pics)
    assert ledger(out)["000000008:r8"][0] in ("packed", "truncated")


def test_same_bytes_whatever_the_workers(demo_dir, media, tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(sharegpt(i)) for i in range(N)))
    one = run_pack(tmp_path / "d.jsonl", tmp_path / "one", demo_dir / "tokenizer", media_dir=media)
    two = run_pack(tmp_path / "d.jsonl", tmp_path / "two", demo_dir / "tokenizer", media_dir=media, workers=2)
    assert digest(one) == digest(two)


def test_sources_packtool_does_not_read_and_staging_refused(demo_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SourceError, match="no .nv-meta folder"):
        resolve_source(tmp_path / "notes.txt")
    (tmp_path / "a.json").write_text('{"x": 1}')
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE))
    with pytest.raises(SourceError, match="expected a list of records"):
        pack(resolve_source(tmp_path / "a.json"), tmp_path / "out", settings, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "b.json").write_text("[]")
    with pytest.raises(SourceError, match="holds no records"):
        pack(resolve_source(tmp_path / "b.json"), tmp_path / "out", settings, progress=False)
    done = subprocess.run([sys.executable, "-m", "packtool.cli", "pack", str(tmp_path / "b.json"),
                           str(tmp_path / "out"), "--tokenizer", str(demo_dir / "tokenizer"), "--pack-size", "64",
                           "--staging", str(tmp_path / "st")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "packtool: error: staging: JSON/JSONL, Parquet and save_to_disk sources are read in place, nothing is "
        "staged; remove the staging option"]
    assert not (tmp_path / "st").exists() and not (tmp_path / "out").exists()


def test_python_api_packs_a_llava_file(demo_dir, media, tmp_path):
    light = subprocess.run([sys.executable, "-c", "import sys, packtool; print(sorted(m for m in ('numpy', "
                            "'pyarrow', 'torch', 'packtool.packer.pipeline') if m in sys.modules))"],
                           capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"  # import packtool stays light; pack loads the pipeline when called
    import packtool

    (tmp_path / "llava.json").write_text(json.dumps([llava(i) for i in range(N)]))
    summary = packtool.pack(tmp_path / "llava.json", tmp_path / "out", tokenizer=str(demo_dir / "tokenizer"),
                            pack_size=PACK_SIZE, media_dir=str(media), shard_size="4", workers=1, progress=False)
    assert isinstance(summary, packtool.PackSummary) and summary.source == (tmp_path / "llava.json").resolve()
    assert not (tmp_path / "out.source").exists()
    assert summary.splits["train"].samples == N and summary.splits["train"].error == 0
    manifest = json.loads((tmp_path / "out" / ".nv-meta" / "packtool.json").read_text())
    assert summary.splits["train"].packs == manifest["packs"]["train"] > 0
    reference = run_pack(tmp_path / "llava.json", tmp_path / "ref", demo_dir / "tokenizer", media_dir=media)
    assert tokens_by_key(tmp_path / "out") == tokens_by_key(reference)
    assert summary.config["pack_size"] == PACK_SIZE and summary.config["tokenizer"] == str(demo_dir / "tokenizer")


def test_readme_quick_start_runs_as_written(demo_dir, tmp_path):
    """The README's quick start, command for command (the demo folder the fixture built stands for
    examples/demo): LLaVA JSON -> packs -> candidates and batch size -> config -> a pack at the chosen size."""
    import shlex

    from packtool.verify.stats import decide

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```\n", 2)[1]
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("python examples/demo.py")]
    assert [c.split()[1] for c in commands] == \
        ["examples/llava_json.py", "pack", "stats", "inspect", "pack"]
    outputs = []
    for line in commands:
        line = line.replace("examples/demo/tokenizer", str(demo_dir / "tokenizer"))
        line = line.replace("examples/demo/llava", str(tmp_path / "llava"))
        line, _, redirect = line.partition(" > ")
        args = shlex.split(line)
        if args[0] == "python":
            args = [sys.executable, str(root / args[1]), *args[2:]]
        else:
            args = [sys.executable, "-m", "packtool.cli", *args[1:]]
        p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert p.returncode == 0, (line, p.stderr[-2000:])
        if redirect:
            (tmp_path / redirect.strip()).write_text(p.stdout)
        outputs.append(p.stdout)
    stats_out = outputs[2]
    table = readme.split("On the demo (300 records", 1)[1].split("```\n", 2)[1]
    for row in table.splitlines():
        assert row in stats_out, row  # the README's numbers are this run's
    assert (tmp_path / "report.html").stat().st_size > 10_000
    manifest = json.loads((tmp_path / "packed-4k" / ".nv-meta" / "packtool.json").read_text())
    assert manifest["settings"]["pack_size"] == 4096
    judged = next(c for c in decide(tmp_path / "packed", [4096])["train"]["candidates"])
    assert judged["packs"] == manifest["packs"]["train"]
    assert judged["truncated"] == manifest["counts"]["train"]["truncated"]


def test_verify_against_a_json_source(demo_dir, media, tmp_path):
    """``verify --source data.json`` compares with the file as it is now: an image edited since packing is
    reported."""
    pics = tmp_path / "media"
    shutil.copytree(media, pics)
    (tmp_path / "d.json").write_text(json.dumps([llava(i) for i in range(N)]))

    def cli(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "packtool.cli", *map(str, args)], capture_output=True,
                              text=True, timeout=300)

    done = cli("pack", tmp_path / "d.json", tmp_path / "out", "--media-dir", pics, "--tokenizer",
               demo_dir / "tokenizer", "--pack-size", PACK_SIZE, "--workers", 1, "--no-progress")
    assert done.returncode == 0, done.stderr
    ok = cli("verify", tmp_path / "out", "--source", tmp_path / "d.json", "--workers", 1)
    assert ok.returncode == 0, ok.stderr
    (pics / _images(4)[0]).write_bytes(make_image(90, 70, seed=123, fmt="JPEG"))
    bad = cli("verify", tmp_path / "out", "--source", tmp_path / "d.json", "--workers", 1)
    assert bad.returncode == 1 and "000000004" in bad.stderr and "differs from source" in bad.stderr


def test_dataset_dict_and_parquet_folder_splits(media, tmp_path):
    """A ``save_to_disk`` DatasetDict gives one split per folder (``validation`` is ``val``); Parquet files named
    by split give their splits; every row is read, in order."""
    from packtool.packer.sources.files import detect, open_files

    table = pa.table({"messages": [sharegpt(i)["messages"] for i in range(5)],
                      "images": [[{"bytes": (media / n).read_bytes(), "path": n} for n in _images(i)]
                                 for i in range(5)]})
    root = tmp_path / "dd"
    for split, rows in (("train", table.slice(0, 3)), ("validation", table.slice(3))):
        (root / split).mkdir(parents=True)
        with pa.ipc.new_stream(root / split / "data-00000-of-00001.arrow", rows.schema) as writer:
            writer.write_table(rows)
        (root / split / "state.json").write_text(json.dumps({"_data_files": [{"filename":
                                                                              "data-00000-of-00001.arrow"}]}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    src = detect(root)
    assert src is not None and src.kind == "arrow" and list(src.splits) == ["train", "val"]
    opened = open_files(src)
    assert [opened.shard_counts[s] for p in opened.splits.values() for s in p] == [3, 2]
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 4), tmp_path / "pq" / "train-00000-of-00001.parquet")
    pq.write_table(table.slice(4), tmp_path / "pq" / "validation-00000-of-00001.parquet")
    src = detect(tmp_path / "pq")
    assert src is not None and src.kind == "parquet" and sorted(src.splits) == ["train", "val"]


def test_forgotten_media_dir_names_the_reason_and_failures_lists_the_samples(demo_dir, media, tmp_path):
    """Without --media-dir the media are looked for beside the JSONL: the exit-3 line names the top reason with
    a full example and hints --media-dir; ``failures`` lists each sample with its full reason, shard and key."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "data.jsonl").write_text("".join(json.dumps(sharegpt(i)) + "\n" for i in (0, 1, 1, 1, 1))
                                                 + "{not json\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "packtool.cli", "pack", str(tmp_path / "src" / "data.jsonl"), str(out),
           "--tokenizer", str(demo_dir / "tokenizer"), "--pack-size", str(PACK_SIZE), "--workers", "1",
           "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("packtool: error:")]
    assert len(line) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "top reasons: 4 × media file 'pics/001-0.jpg' not found in" in line[0], line[0]
    assert "--media-dir" in line[0] and f"packtool failures {out}" in line[0], line[0]
    table = subprocess.run([sys.executable, "-m", "packtool.cli", "failures", str(out)], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("5 samples not packed whole"), table.stdout
    assert "line 6 of data.jsonl is not valid JSON" in table.stdout  # the full reason, not "line N"
    report = json.loads(subprocess.run([sys.executable, "-m", "packtool.cli", "failures", str(out), "--json",
                                        "--status", "error", "--limit", "1"], capture_output=True, text=True,
                                       timeout=120).stdout)
    assert report["total"] == 5 and [g["count"] for g in report["groups"]] == [4, 1], report
    assert [len(g["samples"]) for g in report["groups"]] == [1, 1]
    first = report["groups"][0]["samples"][0]
    assert first["key"] and first["shard"] and first["split"] == "train" and "not found in" in first["reason"]
    refused = subprocess.run([sys.executable, "-m", "packtool.cli", "failures", str(out), "--status", "packd"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "unknown status 'packd'" in refused.stderr
    # stats keeps grouping but shows the full reason of each group
    stats = subprocess.run([sys.executable, "-m", "packtool.cli", "stats", str(out)], capture_output=True,
                           text=True, timeout=120).stdout
    assert "line N of data.jsonl" in stats and "e.g. line 6 of data.jsonl is not valid JSON" in stats, stats
