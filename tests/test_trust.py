"""Trust: no input, fault or mistake may crash the job, pack stale bytes or touch the source.

Every test drives the ``packtool`` command (a subprocess, or Typer's runner in this process where a fault is
injected) on small datasets written here: real tar shards, the demo's trained tokenizer, real images.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

import demo
import packfixture as fx
from packtool.cli import app

ROOT = Path(__file__).resolve().parents[1]
PACK_SIZE = 2048


# -- building blocks -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    """The demo model folder: a trained byte-level BPE, the ChatML template, Qwen2-VL's image processor config."""
    return demo.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def chat(user: str, reply: str | None = "fine", *, first: str = "human") -> bytes:
    """A ShareGPT conversation: one user turn and one reply (``first="gpt"`` puts the reply first)."""
    turns = [{"from": "human", "value": user}] + ([{"from": "gpt", "value": reply}] if reply is not None else [])
    if first == "gpt":
        turns.reverse()
    return json.dumps({"conversations": turns}).encode()


def jpeg(width: int, height: int, seed: int, *, quality: int = 90, exif: Image.Exif | None = None) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality, **({"exif": exif} if exif is not None else {}))
    return buf.getvalue()


def sample(i: int, *, image: bool = False) -> tuple[str, dict[str, bytes]]:
    """A healthy sample ``s0000i``: a question and a reply of a few sentences, with a JPEG when ``image``."""
    words = demo.paragraph(__import__("random").Random(i), 40)
    if image:
        return f"s{i:05d}", {"json": chat(f"<image> what is this? ({i})", words), "jpg": jpeg(64, 48, i)}
    return f"s{i:05d}", {"json": chat(f"question {i}: {words[:60]}", words)}


def tar_bytes(samples: list[tuple[str, dict[str, bytes]]]) -> bytes:
    """A reproducible USTAR shard of ``(key, {part: bytes})``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for part, data in members.items():
                info = tarfile.TarInfo(f"{key}.{part}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tar_bytes(samples))


def dataset(root: Path, shards: dict[str, list[tuple[str, dict[str, bytes]]]], *, dataset_yaml: dict | None = None,
            split_parts: dict | None = None, counts: dict[str, int] | None = None) -> Path:
    """An Energon dataset under ``root``: the shards (path -> samples), split.yaml (all shards in ``train`` unless
    ``split_parts``), dataset.yaml (crude unless given), .info.json (the written counts unless ``counts``)."""
    for name, samples in shards.items():
        write_shard(root / name, samples)
    meta = root / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    parts = split_parts if split_parts is not None else {"train": list(shards)}
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": parts, "exclude": []}))
    crude = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    (meta / "dataset.yaml").write_text(yaml.safe_dump(dataset_yaml or crude))
    shard_counts = counts if counts is not None else {name: len(s) for name, s in shards.items()}
    (meta / ".info.json").write_text(json.dumps({"energon_version": "7.4.1", "shard_counts": shard_counts}))
    return root


def pack_args(source: Path, output: Path, tok: Path, *extra: str) -> list[str]:
    return ["pack", str(source), str(output), "--tokenizer", str(tok), "--pack-size", str(PACK_SIZE),
            "--shard-size", "4", "--workers", "1", "--no-progress", *extra]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m packtool.cli ARGS`` in a fresh process (this checkout's packtool)."""
    return subprocess.run([sys.executable, "-m", "packtool.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout, check=False)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with exit 2 and one line on stderr starting with ``packtool`` (no traceback)."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "\n" not in err and err.startswith("packtool") and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, err
    return err


def tree(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), folders named in ``skip`` left out."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def output_files(output: Path) -> dict[str, bytes]:
    """What a run delivers: every file of OUTPUT but its work folder."""
    files = tree(output, skip=(".packtool",))
    assert any(name.endswith(".tar") for name in files), sorted(files)
    return files


def ledger(output: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(output / "ledger.parquet").to_pylist()}


def segments(output: Path, split: str = "train") -> dict[str, dict]:
    """Segment key -> its tokens, targets, media bytes and media entries, read from the packed tars."""
    return {seg.key: {"tokens": tokens, "targets": targets, "media": [media[m.member] for m in seg.media],
                      "refs": [dataclasses.asdict(m) for m in seg.media]}
            for seg, tokens, targets, media in fx.packed_segments(output, split)}


# -- 1. one sample never kills the job; a packtool bug always does ----------------------------------------------
def test_each_sample_level_failure_quarantines_only_that_sample(tok, tmp_path):
    """A lone surrogate (tokenizer), bad JSON (parse), a template that raises for one sample (render) and an
    undecodable image (media) each quarantine their own sample; the others pack."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tok.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    template = (tok / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "{%- for m in messages %}{% if 'REFUSE' in m['content'] %}{{ raise_exception('refused by the template') }}"
        "{% endif %}{% endfor -%}\n" + template)
    bad = [("x1surrogate", {"json": b'{"conversations": [{"from": "human", "value": "hi \\ud800 there"}, '
                                    b'{"from": "gpt", "value": "ok"}]}'}),
           ("x2badjson", {"json": b"{not json"}),
           ("x3render", {"json": chat("please REFUSE this")}),
           ("x4media", {"json": chat("<image> what?"), "jpg": b"\xff\xd8\xff not a jpeg"})]
    good = [sample(i, image=i % 2 == 0) for i in range(8)]
    src = dataset(tmp_path / "src", {"shards/a.tar": good[:4] + bad + good[4:]})
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, model, "--max-error-rate", "0.5")))
    rows = ledger(out)
    assert {k for k, r in rows.items() if r["status"] == "error"} == {k for k, _ in bad}
    assert "not valid Unicode" in rows["x1surrogate"]["reason"]
    assert "json" in rows["x2badjson"]["reason"].lower()
    assert "refused by the template" in rows["x3render"]["reason"]
    assert "undecodable image" in rows["x4media"]["reason"]
    assert set(segments(out)) == {k for k, _ in good}


def test_a_packtool_bug_stops_the_run_instead_of_quarantining(tok, tmp_path, monkeypatch):
    """Any exception packtool's own code raises while one sample is encoded is a bug, not bad data, whatever its
    type (KeyError, TypeError, IndexError, ValueError as much as AttributeError): the run stops with it, its
    traceback names the sample, and no ledger is written."""
    import packtool.packer.sources.formats

    real = packtool.packer.sources.formats.conversation_adapter
    for bug in (AttributeError("'NoneType' object has no attribute 'messages'"), NameError("name 'x' is not defined"),
                KeyError("grid_thw"), TypeError("'NoneType' object is not subscriptable"),
                IndexError("list index out of range"), ValueError("too many values to unpack")):
        def broken(parts, *args, _bug=bug, **kwargs):
            if b"BUG" in parts.get("json", b""):
                raise _bug
            return real(parts, *args, **kwargs)

        monkeypatch.setattr(packtool.packer.sources.formats, "conversation_adapter", broken)
        src = dataset(tmp_path / f"src-{type(bug).__name__}",
                      {"shards/a.tar": [sample(0), ("x0bug", {"json": chat("a BUG here")}), sample(1)]})
        out = tmp_path / f"out-{type(bug).__name__}"
        result = CliRunner().invoke(app, pack_args(src, out, tok, "--max-error-rate", "1"))
        assert result.exit_code != 0 and isinstance(result.exception, type(bug)), (result.output, result.exception)
        assert any("shards/a.tar/x0bug" in note and "bug in packtool" in note
                   for note in getattr(result.exception, "__notes__", [])), result.exception
        assert not (out / "ledger.parquet").exists()


#: A user's adapter that fails on some samples the way user code does (each key names the exception) and calls
#: ``sys.exit(3)`` on ``x9exit``.
FAILING_ADAPTER = '''
import json, sys

def deep(n):
    return deep(n + 1)

def adapt(sample):
    key = sample["__key__"]
    if key == "x1attr":
        return None.messages
    if key == "x2recursion":
        return deep(0)
    if key == "x3memory":
        raise MemoryError("cannot allocate the frames")
    if key == "x4notimpl":
        raise NotImplementedError("this layout")
    if key == "x9exit":
        sys.exit(3)
    return {"messages": json.loads(sample["json"])["conversations"], "media": []}
'''


def test_user_code_and_user_data_are_not_packtool_bugs(tok, tmp_path):
    """A JSON member nested 200,000 deep (RecursionError in the parser) is a quarantine row with a reason, in pack
    and in ``verify --source``; an adapter that raises AttributeError, RecursionError, MemoryError or
    NotImplementedError on a sample quarantines that sample with the adapter and its error; ``sys.exit(3)`` in an
    adapter stops the run with one line naming the adapter and the sample."""
    good = [sample(i) for i in range(4)]
    deep = ("x0deep", {"json": b"[" * 200_000})
    src = dataset(tmp_path / "src", {"shards/a.tar": good[:2] + [deep] + good[2:]})
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok, "--max-error-rate", "0.5")))
    rows = ledger(out)
    assert rows["x0deep"]["status"] == "error" and "invalid json in 'json'" in rows["x0deep"]["reason"], rows
    assert set(segments(out)) == {k for k, _ in good}
    ok(cli("verify", str(out), "--source", str(src)))

    (tmp_path / "failing_adapter.py").write_text(FAILING_ADAPTER)
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    bad = [(key, {"json": chat(f"sample {key}")}) for key in ("x1attr", "x2recursion", "x3memory", "x4notimpl")]
    src2 = dataset(tmp_path / "src2", {"shards/a.tar": good[:2] + bad + good[2:]})
    out2 = tmp_path / "out2"
    ok(cli(*pack_args(src2, out2, tok, "--adapter", "failing_adapter:adapt", "--max-error-rate", "0.9"), env=env))
    rows = ledger(out2)
    for key, error in zip(("x1attr", "x2recursion", "x3memory", "x4notimpl"),
                          ("AttributeError", "RecursionError", "MemoryError", "NotImplementedError")):
        assert rows[key]["status"] == "error", rows[key]
        assert rows[key]["reason"].startswith(f"adapter failing_adapter:adapt: {error}: "), rows[key]
    assert set(segments(out2)) == {k for k, _ in good}

    src3 = dataset(tmp_path / "src3", {"shards/a.tar": good[:2] + [("x9exit", {"json": chat("bye")})]})
    one_line_error(cli(*pack_args(src3, tmp_path / "out3", tok, "--adapter", "failing_adapter:adapt"), env=env),
                   "shards/a.tar/x9exit", "adapter failing_adapter:adapt called sys.exit(3)")


# -- 2. a rerun never packs stale bytes ---------------------------------------------------------------------------
#: A custom adapter that reads the ShareGPT samples of these tests and, when told to, stops forever at one key
#: after saying so in a file: the test kills the run there (``kill -9``) at a known point.
ADAPTER = '''
import json, os, pathlib, time

def adapt(sample):
    if sample["__key__"] == os.environ.get("TRUST_STOP_AT"):
        pathlib.Path(os.environ["TRUST_STOPPED"]).write_text("stopped")
        time.sleep(600)
    media = [p for p in ("jpg",) if p in sample]
    return {"messages": json.loads(sample["json"])["conversations"], "media": media}
'''


@pytest.fixture
def adapter(tmp_path) -> dict:
    (tmp_path / "trust_adapter.py").write_text(ADAPTER)
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def kill_at(args: list[str], env: dict, key: str, mark: Path) -> None:
    """Run the CLI until it reaches sample ``key`` (after everything before it is committed), then ``kill -9``."""
    proc = subprocess.Popen([sys.executable, "-m", "packtool.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **env, "TRUST_STOP_AT": key,
                                                         "TRUST_STOPPED": str(mark)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the stop key"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def edit_first_shard(src: Path) -> tuple[str, bytes, str]:
    """Re-save one JPEG at another quality and change one reply, in place; returns (image key, its new bytes,
    the key of the edited reply)."""
    shard = src / "shards/a.tar"
    with tarfile.open(shard) as tar:
        records: dict[str, dict[str, bytes]] = {}
        for m in tar:
            key, _, part = m.name.partition(".")
            records.setdefault(key, {})[part] = tar.extractfile(m).read()
    image_key = next(k for k, parts in records.items() if "jpg" in parts)
    pixels = Image.open(io.BytesIO(records[image_key]["jpg"]))
    buf = io.BytesIO()
    pixels.save(buf, "JPEG", quality=40)
    records[image_key]["jpg"] = buf.getvalue()
    text_key = next(k for k, parts in records.items() if "jpg" not in parts)
    records[text_key]["json"] = chat("what changed?", "the reply was edited after the first run")
    shard.write_bytes(tar_bytes(list(records.items())))
    return image_key, records[image_key]["jpg"], text_key


def assert_edits_packed(output: Path, tok: Path, edits: tuple[str, bytes, str]) -> None:
    from tokenizers import Tokenizer

    image_key, image, text_key = edits
    packed = segments(output)
    assert packed[image_key]["media"] == [image]
    assert "the reply was edited" in Tokenizer.from_file(str(tok / "tokenizer.json")).decode(
        packed[text_key]["tokens"].tolist())


def two_shard_source(root: Path) -> Path:
    return dataset(root, {"shards/a.tar": [sample(i, image=i % 3 == 0) for i in range(10)],
                          "shards/b.tar": [sample(i, image=i % 3 == 0) for i in range(10, 20)]})


def test_resume_after_kill_and_source_edit_packs_the_edited_source(tok, tmp_path, adapter):
    """``kill -9`` once the first shard is encoded, edit that shard (a re-saved JPEG, a changed reply), rerun the
    same command: the output equals a clean run of the edited source."""
    src = two_shard_source(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = pack_args(src, out, tok, "--adapter", "trust_adapter:adapt")
    kill_at(args, adapter, "s00010", tmp_path / "stopped")  # the first sample of the second shard
    assert not (out / ".nv-meta/packtool.json").exists()
    assert list((out / ".packtool").rglob("samples.parquet")), "the first shard was not committed before the kill"
    edits = edit_first_shard(src)
    ok(cli(*args, env=adapter))
    ok(cli(*pack_args(src, clean, tok, "--adapter", "trust_adapter:adapt"), env=adapter))
    assert output_files(out) == output_files(clean)
    assert_edits_packed(out, tok, edits)


def test_rerun_after_a_complete_run_remakes_an_edited_source(tok, tmp_path):
    """A source shard edited after a complete run: rerunning the same command re-makes the output from the edited
    source (it is not reported as done)."""
    src = two_shard_source(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    ok(cli(*pack_args(src, out, tok)))
    before = output_files(out)
    edits = edit_first_shard(src)
    ok(cli(*pack_args(src, out, tok)))
    ok(cli(*pack_args(src, clean, tok)))
    after = output_files(out)
    assert after != before and after == output_files(clean)
    assert_edits_packed(out, tok, edits)


# -- 3. the source is never touched -------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "output-inside-source", "source-inside-output"])
def test_an_output_overlapping_the_source_is_refused_before_anything_is_touched(tok, tmp_path, where):
    """``pack SRC SRC --overwrite`` (and OUTPUT inside SOURCE, SOURCE inside OUTPUT) is refused with one line and
    every byte under SOURCE, and the set of its files, stays as it was."""
    src = dataset(tmp_path / "outer/src" if where == "source-inside-output" else tmp_path / "src",
                  {"shards/a.tar": [sample(i, image=i % 2 == 0) for i in range(4)]})
    output = {"same": src, "output-inside-source": src / "packed", "source-inside-output": tmp_path / "outer"}[where]
    watched = tmp_path / "outer" if where == "source-inside-output" else src
    before = tree(watched)
    one_line_error(cli(*pack_args(src, output, tok, "--overwrite")), "overlaps the source")
    assert tree(watched) == before


# -- 7. memory stays bounded on oversized input ---------------------------------------------------------------------
def cli_peak_rss(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI; return its result and the peak resident memory (bytes) of its process tree, sampled every
    10 ms. (``ru_maxrss`` of the child would count this test process's own memory: a child is forked from it
    before it executes the CLI.)"""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "packtool.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        rss = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                continue
        peak = max(peak, rss)
        time.sleep(0.01)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    return subprocess.CompletedProcess(args, proc.returncode, "", stderr), peak


def long_text(n_chars: int) -> str:
    import random

    rng = random.Random(7)
    para = " ".join(demo.paragraph(rng, 200) for _ in range(20)) + "\n"
    return (para * (n_chars // len(para) + 1))[:n_chars]


def test_a_10mb_reply_packs_truncated_in_bounded_memory_with_exact_tokens(tok, tmp_path):
    """A 10 MB reply packs truncated to the pack size, and the run's peak memory stays far below 1 GB. Its kept
    tokens are those of a 1 MB reply with the same start (also cut before tokenizing), and those equal the
    tokenization of that whole sample's rendered chat, uncut."""
    from transformers import PreTrainedTokenizerFast

    huge, big = long_text(10_000_000), long_text(1_000_000)
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), ("x0huge", {"json": chat("tell me all", huge)}),
                                                      ("x1big", {"json": chat("tell me all", big)}), sample(1)]})
    out = tmp_path / "out"
    proc, peak = cli_peak_rss(*pack_args(src, out, tok))
    ok(proc)
    assert peak < 600 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"  # about 220 MiB; 1.8 GiB before the bound
    rows, packed = ledger(out), segments(out)
    for key in ("x0huge", "x1big"):
        assert rows[key]["status"] == "truncated", rows[key]
        assert len(packed[key]["tokens"]) == rows[key]["tokens"] == PACK_SIZE
    hf = PreTrainedTokenizerFast.from_pretrained(str(tok))
    rendered = hf.apply_chat_template([{"role": "user", "content": "tell me all"},
                                       {"role": "assistant", "content": big}], tokenize=False)
    uncut = hf.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
    assert packed["x1big"]["tokens"].tolist() == uncut[:PACK_SIZE]
    assert packed["x0huge"]["tokens"].tolist() == packed["x1big"]["tokens"].tolist()
    assert packed["x0huge"]["targets"].any()


def test_a_sample_over_max_sample_bytes_is_quarantined_with_its_reason(tok, tmp_path):
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), ("x0fat", {"json": chat("hi", "y" * 200_000)}),
                                                      sample(1)]})
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok, "--max-sample-bytes", "100000", "--max-error-rate", "0.5")))
    rows = ledger(out)
    assert rows["x0fat"]["status"] == "error"
    assert "more than 100000 bytes" in rows["x0fat"]["reason"], rows["x0fat"]["reason"]
    assert set(segments(out)) == {"s00000", "s00001"}


# -- 8. every failure a user can cause is one line -----------------------------------------------------------------
@pytest.fixture
def mount(tmp_path):
    """``mount(name, options)``: a fresh tmpfs under ``tmp_path`` (a full disk, a read-only folder; root only)."""
    mounted = []

    def make(name: str, options: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True,
                           check=False)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture(scope="module")
def small(tok, tmp_path_factory) -> tuple[Path, Path]:
    """(source, its packed OUTPUT), a few samples with images."""
    root = tmp_path_factory.mktemp("small")
    src = dataset(root / "src", {"shards/a.tar": [sample(i, image=i % 2 == 0) for i in range(6)]})
    ok(cli(*pack_args(src, root / "out", tok)))
    return src, root / "out"


def test_garbage_or_list_shaped_split_yaml_is_one_line(tok, small, tmp_path):
    for name, text in (("garbage", "split_parts: [unclosed\n  - : : {\n"), ("list", "- train\n- val\n")):
        src = dataset(tmp_path / name, {"shards/a.tar": [sample(0)]})
        (src / ".nv-meta/split.yaml").write_text(text)
        one_line_error(cli(*pack_args(src, tmp_path / f"out-{name}", tok)), "split.yaml")
        assert not (tmp_path / f"out-{name}").exists()


def test_non_utf8_dataset_yaml_is_one_line(tok, tmp_path):
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0)]})
    (src / ".nv-meta/dataset.yaml").write_bytes(b"__module__: megatron.energon\n__class__: Crude\xff\xfeWebdataset\n")
    one_line_error(cli(*pack_args(src, tmp_path / "out", tok)), "dataset.yaml")
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_one_line(tok, tmp_path, mount):
    src = dataset(tmp_path / "src", {"shards/a.tar": [(f"s{i:05d}", {"json": chat("<image> what?", "a photo"),
                                                                      "jpg": jpeg(256, 256, i)}) for i in range(8)]})
    full = mount("full", "size=200k")
    one_line_error(cli(*pack_args(src, full / "out", tok)), "No space left on device", str(full / "out"))


def test_a_read_only_output_parent_is_one_line(tok, small, mount):
    one_line_error(cli(*pack_args(small[0], mount("ro", "ro,size=1m") / "out", tok)), "not writable")


def test_an_output_that_is_a_file_is_one_line(tok, small, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    one_line_error(cli(*pack_args(small[0], tmp_path / "file", tok)), "not a folder")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_a_template_with_an_unknown_filter_is_one_line(tok, small, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in tok.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] | no_such_filter }}"
                                               "{% endfor %}")
    one_line_error(cli(*pack_args(small[0], tmp_path / "out", model)), "no_such_filter")
    assert not (tmp_path / "out").exists()


def test_inspect_of_a_file_is_one_line(small):
    one_line_error(cli("inspect", str(small[1] / "ledger.parquet")))


def test_stats_plot_to_an_unwritable_path_is_one_line(small, tmp_path, mount):
    (tmp_path / "file").write_text("")
    one_line_error(cli("stats", str(small[1]), "--plot", str(tmp_path / "file" / "plot.png")))
    one_line_error(cli("stats", str(small[1]), "--plot", str(mount("ro", "ro,size=1m") / "plot.png")))


def test_a_malformed_ray_address_is_one_line(tok, small, tmp_path):
    proc = cli(*pack_args(small[0], tmp_path / "out", tok, "--engine", "ray", "--ray-address", "not an address:xx"),
               timeout=120)
    one_line_error(proc, "not an address:xx")
    assert not (tmp_path / "out").exists()


# -- 9. what cannot work is refused before any work ----------------------------------------------------------------
def test_a_split_name_too_long_for_a_tar_header_is_refused_before_output_exists(tok, tmp_path):
    name = "s" * 200
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0)]}, split_parts={name: ["shards/a.tar"]})
    one_line_error(cli(*pack_args(src, tmp_path / "out", tok)), "too long")
    assert not (tmp_path / "out").exists()


def test_a_pack_size_beyond_int32_is_refused_before_output_exists(tok, small, tmp_path):
    args = pack_args(small[0], tmp_path / "out", tok)
    args[args.index("--pack-size") + 1] = "3000000000"
    one_line_error(cli(*args), "pack_size")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard", ["../outside.tar", "ABSOLUTE"])
def test_shard_paths_that_leave_the_source_are_refused_before_output_exists(tok, tmp_path, shard):
    """A ``split.yaml`` naming a shard outside SOURCE (a real tar there) is refused: packtool reads only SOURCE."""
    outside = tmp_path / "outside.tar"
    write_shard(outside, [sample(0)])
    shard = str(outside) if shard == "ABSOLUTE" else shard
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(1)]}, split_parts={"train": ["shards/a.tar", shard]},
                  counts={"shards/a.tar": 1, shard: 1})
    one_line_error(cli(*pack_args(src, tmp_path / "out", tok)), "leaves the dataset folder")
    assert not (tmp_path / "out").exists()


# -- 10. smaller holes ------------------------------------------------------------------------------------------
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 48\n%%EndComments\n0 0 moveto showpage\n%%EOF\n"


@pytest.mark.parametrize("media_check", ["header", "decode"])
def test_an_eps_named_jpg_is_quarantined_and_never_reaches_ghostscript(tok, tmp_path, monkeypatch, media_check):
    """PIL opens only the image formats packtool supports: PostScript in a ``jpg`` member is refused by name of
    its format, in both media checks, and Ghostscript is never called."""
    from PIL import EpsImagePlugin

    calls = []

    def ghostscript(*args, **kwargs):
        calls.append(args)
        raise OSError("Ghostscript was called")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), ("x0eps", {"json": chat("<image> what?"),
                                                                             "jpg": EPS}), sample(1)]})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, pack_args(src, out, tok, "--media-check", media_check, "--max-error-rate", "1"))
    assert result.exit_code == 0, (result.output, result.exception)
    row = ledger(out)["x0eps"]
    assert row["status"] == "error" and "undecodable image" in row["reason"], row
    assert calls == []


def test_a_second_tar_after_the_end_marker_gets_a_ledger_row(tok, tmp_path):
    """Two tars concatenated into one shard: the first one's samples pack and the unread rest is an error row of
    the ledger (it does not vanish); so is a shard holding fewer samples than ``.info.json`` counts."""
    first, second = [sample(i) for i in range(3)], [sample(i) for i in range(3, 6)]
    src = dataset(tmp_path / "src", {"shards/a.tar": first, "shards/b.tar": [sample(6)]},
                  counts={"shards/a.tar": 6, "shards/b.tar": 4})
    (src / "shards/a.tar").write_bytes(tar_bytes(first) + tar_bytes(second))
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok, "--max-error-rate", "1")))
    rows = pq.read_table(out / "ledger.parquet").to_pylist()
    errors = {(r["shard"], r["key"]): r["reason"] for r in rows if r["status"] == "error"}
    assert set(errors) == {("shards/a.tar", "#unreadable-after-3"), ("shards/b.tar", "#unreadable-after-1")}
    assert "after the end-of-archive marker" in errors[("shards/a.tar", "#unreadable-after-3")]
    assert ".info.json counts 4 samples" in errors[("shards/b.tar", "#unreadable-after-1")]
    assert set(segments(out)) == {k for k, _ in first} | {"s00006"}


def test_bad_turns_are_quarantined_with_a_reason_that_says_what_is_wrong(tok, tmp_path):
    """An empty reply is quarantined (not trained as a lone end-of-turn token); a conversation that starts with
    the assistant, and an ``<image>`` tag in a reply, are quarantined with reasons that say so."""
    bad = {"x0empty": ({"json": chat("hello", "")}, "reply in turn 1 is empty"),
           "x1blank": ({"json": chat("hello", "  \n ")}, "reply in turn 1 is empty"),
           "x2assistantfirst": ({"json": chat("and you?", "I speak first", first="gpt")},
                                "starts with an assistant turn"),
           "x3imageinreply": ({"json": chat("draw", "here: <image>"), "jpg": jpeg(64, 48, 0)},
                              "lies in assistant turn 1")}
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), *((k, m) for k, (m, _) in bad.items()), sample(1)]})
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok, "--max-error-rate", "1")))
    rows = ledger(out)
    for key, (_, reason) in bad.items():
        assert rows[key]["status"] == "error" and reason in rows[key]["reason"], rows[key]
        assert "generation" not in rows[key]["reason"], rows[key]
    assert set(segments(out)) == {"s00000", "s00001"}


def test_exif_orientation_is_never_applied(tok, tmp_path):
    """A JPEG stored 224x112 with EXIF orientation 6 (display rotated to 112x224): its tokens are counted from the
    stored size, and the reader's pixel values are the image processor's on the stored pixels, unrotated."""
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    import packtool.runtime.read

    exif = Image.Exif()
    exif[0x0112] = 6
    data = jpeg(224, 112, 5, exif=exif)
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6
    src = dataset(tmp_path / "src", {"shards/a.tar": [("s0", {"json": chat("<image> which way up?"), "jpg": data})]})
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok)))
    config = json.loads((tok / "preprocessor_config.json").read_text())
    factor = config["patch_size"] * config["merge_size"]
    h, w = smart_resize(112, 224, factor, config["min_pixels"], config["max_pixels"])
    assert h != w
    [ref] = segments(out)["s0"]["refs"]
    assert (ref["width"], ref["height"]) == (224, 112)
    assert ref["grid_thw"] == [1, h // config["patch_size"], w // config["patch_size"]]
    [batch] = list(packtool.runtime.read.read_packs(out, split="train"))
    expected = AutoImageProcessor.from_pretrained(str(tok))(images=[Image.open(io.BytesIO(data))],
                                                            return_tensors="np")
    assert batch["image_grid_thw"].tolist() == [ref["grid_thw"]] == expected["image_grid_thw"].tolist()
    np.testing.assert_array_equal(batch["pixel_values"].numpy(), expected["pixel_values"])


# -- from the redesign (#10) ---------------------------------------------------------------------------------------
def test_a_bad_shard_size_is_refused_before_any_encode_and_the_corrected_rerun_runs(tok, small, tmp_path):
    out = tmp_path / "out"
    args = pack_args(small[0], out, tok)
    args[args.index("--shard-size") + 1] = "12XB"
    one_line_error(cli(*args), "12XB")
    assert not out.exists()
    args[args.index("--shard-size") + 1] = "12KB"
    ok(cli(*args))
    assert (out / ".nv-meta/packtool.json").exists()


@pytest.mark.parametrize("spec", ["not an adapter", "no_such_module_xyz:convert", "json:no_such_function"])
def test_a_bad_adapter_is_one_line(tok, small, tmp_path, spec):
    one_line_error(cli(*pack_args(small[0], tmp_path / "out", tok, "--adapter", spec)), "adapter")
    assert not (tmp_path / "out").exists()


def test_a_typed_field_map_falls_back_to_the_next_alternative_like_energon(tok, tmp_path):
    """``context: json[question],txt``: a sample whose json has no question takes its context from ``txt``, as
    Energon's own loader reads it."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from tokenizers import Tokenizer

    samples = [("s0", {"jpg": jpeg(64, 48, 0), "json": json.dumps({"question": "what from json?",
                                                                    "answers": ["json answer"]}).encode()}),
               ("s1", {"jpg": jpeg(64, 48, 1), "json": json.dumps({"answers": ["txt answer"]}).encode(),
                       "txt": b"what from txt?"})]
    root = tmp_path / "vqa"
    write_shard(root / "shards/a.tar", samples)
    demo.prepare_energon(root, ["shards/a.tar"], {"train": ["shards/a.tar"]}, dataset_yaml={
        "sample_type": {"__module__": "megatron.energon", "__class__": "VQASample"},
        "field_map": {"image": "jpg", "context": "json[question],txt", "answers": "json[answers]"}})
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    energon = {s.__key__: s for s in get_loader(get_val_dataset(root, split_part="train", worker_config=wc,
                                                                batch_size=None))}
    assert energon["s1"].context == "what from txt?"
    out = tmp_path / "out"
    ok(cli(*pack_args(root, out, tok)))
    decode = Tokenizer.from_file(str(tok / "tokenizer.json")).decode
    packed = segments(out)
    for key, s in energon.items():
        text = decode(packed[key]["tokens"].tolist(), skip_special_tokens=False)
        assert f"<|vision_end|>{s.context}<|im_end|>" in text and f"{s.answers[0]}<|im_end|>" in text, text


def test_changing_only_the_plan_with_overwrite_replans_without_re_encoding(tok, tmp_path):
    """``--algorithm``, ``--seed`` or ``--balance-dp`` changed with ``--overwrite``: the encode store is reused
    untouched, and the output equals a fresh run with the new settings."""
    src = two_shard_source(tmp_path / "src")
    out = tmp_path / "out"
    ok(cli(*pack_args(src, out, tok)))
    store = out / ".packtool/encode"
    stamps = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    assert any(p.name == "samples.parquet" for p in stamps)
    first = output_files(out)
    for i, change in enumerate((["--algorithm", "first_fit_shuffle", "--seed", "3"], ["--balance-dp", "2"])):
        ok(cli(*pack_args(src, out, tok, *change, "--overwrite")))
        assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == stamps
        assert output_files(out) != first
        fresh = tmp_path / f"fresh{i}"
        ok(cli(*pack_args(src, fresh, tok, *change)))
        assert output_files(out) == output_files(fresh)


def test_odd_shapes_of_a_samples_json_are_its_data_errors():
    """Now that any other exception is a packtool bug, the adapters refuse every odd JSON shape with a
    SampleError of their own: a role that is a list, a typed field read from a list by name."""
    from packtool.errors import SampleError
    from packtool.packer.sources.conversation import conversation_adapter
    from packtool.packer.sources.typed import typed_adapter

    with pytest.raises(SampleError, match="unknown role"):
        conversation_adapter({"json": b'[{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "y"}]'})
    with pytest.raises(SampleError, match="field 'json\\[question\\]' not found"):
        typed_adapter({"json": b"[1, 2]", "jpg": b""}, kind="VQASample", field_map={"context": "json[question]"})
