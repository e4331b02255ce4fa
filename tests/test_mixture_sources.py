"""Mixtures of every kind of source in one metadataset: an Energon dataset, a JSONL beside a media folder, a
Parquet folder with image cells and a ``save_to_disk`` folder. Each entry packs as it does alone (its ledger
rows, its tokens), in its declared proportion; packing groups keep packs apart; reruns are byte-identical
whatever the workers; bad entries get one line naming them."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

import demo
import packfixture as fx
from mediafixture import make_image
from packtool.cli import app
from packtool.errors import SourceError
from packtool.format import KEPT, Manifest
from packtool.packer.ledger import read_ledger
from packtool.packer.mixing import copies_of
from packtool.packer.pipeline import pack
from packtool.packer.sources.files import resolve_source
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.stats import compute, mixture_lines, mixture_report

RUNNER = CliRunner()
HEADER = {"__module__": "megatron.energon", "__class__": "MetadatasetV2"}
N = 14


def _images(i: int) -> list[str]:
    return [f"pics/{i:03d}-{k}.{'jpg' if k == 0 else 'png'}" for k in range(i % 3)]


def _messages(i: int, long: int = 1) -> list[dict]:
    question = "<image>\n" * len(_images(i)) + f"Question {i}: what is shown?" + " more words" * (i * 5 * long)
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": f"Answer number {i}." * (1 + i % 4)}]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Four sources in one folder: ``energon/``, ``chat.jsonl`` with its images under ``media/``, ``cells/``
    (Parquet, image bytes in cells) and ``disk/`` (save_to_disk, Arrow)."""
    d = tmp_path_factory.mktemp("mixsources")
    demo.build_dataset(d / "energon", n_train=24, n_val=0, samples_per_shard=12, image_fraction=0.5,
                       long_fraction=0.0, text_scale=0.4, seed=7)
    (d / "media" / "pics").mkdir(parents=True)
    for i in range(N):
        for k, name in enumerate(_images(i)):
            (d / "media" / name).write_bytes(make_image(40 + 7 * i, 30 + 5 * k, seed=i * 3 + k,
                                                        fmt="JPEG" if name.endswith("jpg") else "PNG"))
    (d / "chat.jsonl").write_text("".join(json.dumps({"messages": _messages(i), "images": _images(i)}) + "\n"
                                          for i in range(N)))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    cells = pa.table({
        "messages": pa.array([_messages(i, long=2) for i in range(N)], pa.list_(message)),
        "images": pa.array([[{"bytes": (d / "media" / n).read_bytes(), "path": n.rsplit("/", 1)[1]}
                             for n in _images(i)] for i in range(N)], pa.list_(image))})
    (d / "cells").mkdir()
    pq.write_table(cells.slice(0, 8), d / "cells" / "train-00000-of-00002.parquet")
    pq.write_table(cells.slice(8), d / "cells" / "train-00001-of-00002.parquet")
    text = pa.table({"messages": pa.array([[{"role": "user", "content": f"Tell me fact {i}." + " please" * i},
                                            _messages(i)[1]] for i in range(N)], pa.list_(message))})
    (d / "disk").mkdir()
    with pa.ipc.new_stream(d / "disk" / "data-00000-of-00001.arrow", text.schema) as writer:
        writer.write_table(text)
    (d / "disk" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return d


def _entries(groups: dict[str, str] | None = None) -> list[dict]:
    entries = [{"path": "energon"}, {"path": "chat.jsonl", "repetitions": 2, "packtool": {"media_dir": "media"}},
               {"path": "cells", "repetitions": 1.5}, {"path": "disk", "repetitions": 0.5}]
    for e in entries:
        if groups:
            e.setdefault("packtool", {})["group"] = groups[e["path"]]
    return entries


def _write(folder: Path, name: str, entries: list[dict]) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump({**HEADER, "splits": {"train": {"blend_epochized": entries}}}))
    return path


def _settings(demo_dir: Path) -> PackSettings:
    return PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1024),
                        PlanSettings(shard_size="6"))


def _tree(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and ".packtool" not in p.parts}


def _rows(ledger, columns=("key", "status", "reason", "tokens", "images", "image_tokens")) -> list[tuple]:
    return sorted(zip(*(ledger[c].fillna("").tolist() if ledger[c].dtype == object else ledger[c].tolist()
                        for c in columns)))


@pytest.fixture(scope="module")
def mixed(sources, demo_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "out"
    pack(_write(sources, "mix.yaml", _entries()), out, _settings(demo_dir), workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def alone(sources, demo_dir, tmp_path_factory) -> dict[str, Path]:
    """Each entry packed on its own with the same settings (a file entry with its media folder)."""
    base = tmp_path_factory.mktemp("alone")
    out = {}
    for name, media in (("energon", None), ("chat.jsonl", sources / "media"), ("cells", None), ("disk", None)):
        src = resolve_source(sources / name, media_dir=media)
        pack(src, base / name, _settings(demo_dir), workers=1, progress=False)
        out[name] = base / name
    return out


def test_each_entry_packs_as_it_does_alone_in_its_proportion(mixed, alone):
    ledger = read_ledger(mixed).to_pandas()
    assert sorted(set(ledger.dataset)) == ["cells", "chat.jsonl", "disk", "energon"]
    for name, r in (("energon", 1), ("chat.jsonl", 2), ("cells", 1.5), ("disk", 0.5)):
        own = read_ledger(alone[name]).to_pandas()
        mine = ledger[(ledger.dataset == name) & (ledger["copy"] == 0)]
        left = mine.reason.fillna("").str.startswith("not drawn")  # a repetition below 1 leaves these out
        assert sorted(mine.key) == sorted(own.key) and left.sum() == (r < 1) * (len(own) - copies_of(len(own), r))
        drawn = own[own.key.isin(set(mine[~left].key))]
        assert _rows(mine[~left]) == _rows(drawn), name  # every sample, its status, reason and counts as alone
        kept = int(own.status.isin(KEPT).sum())
        assert kept >= N - 1
        assert int((ledger[ledger.status.isin(KEPT)].dataset == name).sum()) == copies_of(kept, r), name
    # The tokens of each sample are its tokens alone (media included: images' placeholders counted exactly).
    by_entry: dict[str, dict[str, tuple]] = {}
    for seg, tokens, targets, _ in fx.packed_segments(mixed):
        by_entry.setdefault(seg.dataset, {})[seg.key] = (tuple(tokens.tolist()), tuple(targets.tolist()))
    for name, out in alone.items():
        own = {seg.key: (tuple(t.tolist()), tuple(g.tolist())) for seg, t, g, _ in fx.packed_segments(out)}
        assert set(by_entry[name]) <= set(own) and by_entry[name] == {k: own[k] for k in by_entry[name]}, name
    # Control: one entry's tokens are not another's.
    assert by_entry["chat.jsonl"] != {k: v for k, v in by_entry["disk"].items() if k in by_entry["chat.jsonl"]}
    assert Manifest.read(mixed).mixture["repetitions"]["train"] == {"energon": 1.0, "chat.jsonl": 2.0,
                                                                    "cells": 1.5, "disk": 0.5}
    # stats per entry: samples with copies and target tokens, each against the whole.
    report = {d["dataset"]: d for d in compute(mixed)["splits"]["train"]["datasets"]}
    packed = ledger[ledger.status.isin(KEPT)]
    for name, d in report.items():
        assert d["samples"] == int((packed.dataset == name).sum())
        assert d["targets"] == int(packed[packed.dataset == name].targets.sum()) > 0
    assert sum(d["target_share"] for d in report.values()) == pytest.approx(1.0)


def test_media_come_from_each_entry_and_verify_passes(mixed, sources):
    images = [m for seg, _, _, media in fx.packed_segments(mixed) if seg.dataset == "chat.jsonl"
              for m in media]
    assert images  # the JSONL's images are in its packs, read from its media folder
    result = RUNNER.invoke(app, ["verify", str(mixed), "--source", str(sources / "mix.yaml")])
    assert result.exit_code == 0, result.output[-2000:]


def test_same_bytes_whatever_the_workers(mixed, sources, demo_dir, tmp_path):
    other = tmp_path / "two"
    pack(sources / "mix.yaml", other, _settings(demo_dir), workers=2, progress=False)
    assert _tree(other) == _tree(mixed)


def test_groups_never_share_a_pack_and_keep_the_proportions(mixed, sources, demo_dir, tmp_path):
    groups = {"energon": "a", "disk": "a", "chat.jsonl": "b", "cells": "c"}
    out = tmp_path / "grouped"
    result = pack(_write(sources, "grouped.yaml", _entries(groups)), out, _settings(demo_dir), workers=1,
                  progress=False)
    ledger = read_ledger(out).to_pandas()
    kept = ledger[ledger.status.isin(KEPT)]
    per_pack = kept.groupby("pack").dataset.agg(lambda d: {groups[x] for x in d})
    assert all(len(g) == 1 for g in per_pack)
    assert Counter(kept.dataset) == Counter(read_ledger(mixed).to_pandas().query("status in @KEPT").dataset)
    # Control: the same mixture without groups puts two groups' samples in one pack.
    plain = read_ledger(mixed).to_pandas()
    plain = plain[plain.status.isin(KEPT)].groupby("pack").dataset.agg(lambda d: {groups[x] for x in d})
    assert any(len(g) > 1 for g in plain)
    report = compute(out)["splits"]["train"]
    rows = {g["group"]: g for g in report["groups"]}
    assert sorted(rows) == ["a", "b", "c"]
    assert sum(g["packs"] for g in rows.values()) == report["packs"] >= compute(mixed)["splits"]["train"]["packs"]
    assert all(0 < g["fill"] <= 1 for g in rows.values())
    text = RUNNER.invoke(app, ["stats", str(out)]).output
    assert "group a" in text and "one plan" in text
    # What the run reports, taken from its plans, is what the ledger says.
    fill = vars(result.fills["train"])
    assert fill == {k: report[k] for k in ("packs", "tokens", "l1_bound", "fill")}
    assert mixture_report(out, "train", fill) == mixture_report(out, "train", report) == mixture_lines(report, 1024)
    assert any(line.startswith("  group a") for line in mixture_report(out, "train", fill))


def test_an_added_file_entry_encodes_that_entry_only(sources, demo_dir, tmp_path):
    out = tmp_path / "grow"
    entries = _entries()
    pack(_write(sources, "grow.yaml", [entries[0], entries[2]]), out, _settings(demo_dir), workers=1, progress=False)
    stores = {p.parent: p.stat().st_mtime_ns for p in (out / ".packtool" / "encode").glob("*/*/*/samples.parquet")}
    pack(_write(sources, "grow.yaml", [entries[0], entries[1], entries[2]]), out, _settings(demo_dir), workers=1,
         progress=False, overwrite=True)
    after = {p.parent: p.stat().st_mtime_ns for p in (out / ".packtool" / "encode").glob("*/*/*/samples.parquet")}
    new = [p for p in after if p not in stores]
    assert new and all(p.parent.name.startswith("chat.jsonl") for p in new)
    assert all(after[p] == t for p, t in stores.items())  # the other entries' stores were not written again
    fresh = tmp_path / "fresh"
    pack(sources / "grow.yaml", fresh, _settings(demo_dir), workers=1, progress=False)
    assert _tree(fresh) == _tree(out)


@pytest.mark.parametrize("entry, needle", [
    ({"path": "nothing.jsonl"}, "dataset nothing.jsonl does not exist"),
    ({"path": "notes.txt"}, "dataset notes.txt: "),
    ({"path": "energon", "packtool": {"media_dir": "media"}}, "energon is an Energon dataset"),
    ({"path": "chat.jsonl", "packtool": {"colour": "red"}}, "unknown packtool option 'colour'"),
    ({"path": "chat.jsonl", "subflavors": {"a": 1}}, "subflavors apply to Energon datasets only"),
    ({"path": "cells", "split_part": "val"}, "dataset cells: it has no split 'val'"),
])
def test_bad_entries_get_one_line_naming_them(sources, demo_dir, tmp_path, entry, needle):
    (sources / "notes.txt").write_text("not data\n")
    mix = _write(sources, f"bad-{entry['path']}.yaml", [{"path": "disk"}, entry])
    with pytest.raises(SourceError) as exc:
        pack(mix, tmp_path / "out", _settings(demo_dir), workers=1, progress=False)
    message = str(exc.value)
    assert "\n" not in message and needle in message and str(mix) in message, message
    result = RUNNER.invoke(app, ["pack", str(mix), str(tmp_path / "cli"), "--tokenizer", str(demo_dir / "tokenizer"),
                                 "--pack-size", "1024"])
    assert result.exit_code != 0 and result.output.count("packtool: error:") == 1, result.output


def test_a_group_on_some_entries_only_is_refused(sources, demo_dir, tmp_path):
    entries = _entries({"energon": "a", "disk": "a", "chat.jsonl": "b", "cells": "c"})
    del entries[2]["packtool"]
    with pytest.raises(SourceError, match=r"dataset cells has no packing group while energon has group 'a'"):
        pack(_write(sources, "some.yaml", entries), tmp_path / "out", _settings(demo_dir), workers=1,
             progress=False)


def test_an_entry_whose_samples_all_fail_is_named(sources, demo_dir, tmp_path):
    record = {"messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                           {"role": "assistant", "content": "A picture."}], "images": ["gone.png"]}
    (tmp_path / "broken.jsonl").write_text((json.dumps(record) + "\n") * 3)
    mix = _write(tmp_path, "fails.yaml", [{"path": str(sources / "disk")}, {"path": "broken.jsonl"}])
    with pytest.raises(SourceError, match=r"fails.yaml: split 'train', dataset broken.jsonl: all 3 of its samples "
                                          r"failed \(first reason: .*gone.png"):
        pack(mix, tmp_path / "out", _settings(demo_dir), workers=1, progress=False)
    # Control: with its images there, the same entry packs.
    (tmp_path / "gone.png").write_bytes(make_image(32, 32, seed=1, fmt="PNG"))
    pack(mix, tmp_path / "out", _settings(demo_dir), workers=1, progress=False, overwrite=True)
    assert int(read_ledger(tmp_path / "out").to_pandas().query("dataset == 'broken.jsonl'").status.isin(KEPT).sum())


def test_a_dry_run_prints_the_proportions_and_new_weights_plan_without_encoding(sources, demo_dir, tmp_path):
    out = tmp_path / "dry"
    args = ["pack", None, str(out), "--tokenizer", str(demo_dir / "tokenizer"), "--pack-size", "1024", "--dry-run"]
    first = RUNNER.invoke(app, [str(_write(sources, "tune.yaml", _entries())) if a is None else a for a in args])
    assert first.exit_code == 0, first.output[-2000:]
    assert not list(out.glob("*.tar"))  # nothing packed
    table = [line.split() for line in first.output.splitlines() if line.split()[:1] in (["chat.jsonl"], ["disk"])]
    # dataset, samples (copies counted), distinct, tokens, declared share, realized shares of samples and tokens
    assert len(table) == 2 and table[0][:3] == ["chat.jsonl", str(2 * N), str(N)], first.output
    assert table[0][4] == table[0][5] and table[1][4] == table[1][5]  # epochized: realized as declared
    stores = {p: p.stat().st_mtime_ns for p in (out / ".packtool" / "encode").glob("*/*/*/samples.parquet")}
    entries = _entries()
    entries[1]["repetitions"] = 1  # the JSONL once, not twice: another plan of the same encoded samples
    _write(sources, "tune.yaml", entries)
    second = RUNNER.invoke(app, [str(sources / "tune.yaml") if a is None else a for a in args] + ["--overwrite"])
    assert second.exit_code == 0, second.output[-2000:]
    assert {p: p.stat().st_mtime_ns for p in stores} == stores
    chat = next(line.split() for line in second.output.splitlines() if line.split()[:1] == ["chat.jsonl"])
    assert chat[1] == str(N) and chat != table[0]


def test_groups_through_nested_metadatasets(sources, demo_dir, tmp_path):
    from packtool.packer.sources.mixture import read_mixture

    _write(sources, "inner.yaml", _entries()[1:3])
    outer = _write(sources, "outer.yaml", [{"path": "energon", "packtool": {"group": "energon"}},
                                           {"path": "inner.yaml", "packtool": {"group": "files"}}])
    groups = {e.name: e.group for e in read_mixture(outer).splits["train"]}
    assert groups == {"energon": "energon", "chat.jsonl": "files", "cells": "files"}
    assert read_mixture(outer).groups("train") == ["energon", "files"]
    # A group set both on the metadataset and on one of its datasets, and a file option on a metadataset.
    inner_entries = _entries()[1:3]
    inner_entries[0]["packtool"]["group"] = "chat"
    _write(sources, "inner.yaml", inner_entries)
    with pytest.raises(SourceError, match="has group 'files', and its dataset chat.jsonl group 'chat'"):
        read_mixture(outer)
    bad = _write(sources, "outer2.yaml", [{"path": "inner.yaml", "packtool": {"media_dir": "media"}}])
    with pytest.raises(SourceError, match="media_dir applies to one file entry, not to the metadataset"):
        read_mixture(bad)
    result = RUNNER.invoke(app, ["pack", str(outer), str(tmp_path / "o"), "--tokenizer", str(demo_dir / "tokenizer"),
                                 "--pack-size", "64",
                                 "--media-dir",
                                 str(sources / "media")])
    assert result.exit_code != 0 and "is a mixture: give each JSON/Parquet entry its media folder" in result.output
