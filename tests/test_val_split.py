"""A validation split held out of train (``--val-ratio``/``--val-count``): exact counts, chosen by digest (the same
whatever the workers), disjoint from train and losing nothing, readable by Energon's own loader and packtool's
reader, verified against the source, and refused where it would merge into a split the source already has."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from packtool.cli import app
from packtool.errors import ConfigError
from packtool.format import KEPT, Manifest
from packtool.packer.ledger import read_ledger
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, Holdout, PackSettings, PlanSettings

RUNNER = CliRunner()


def _settings(demo_dir: Path, holdout: Holdout | None, seed: int = 0) -> PackSettings:
    return PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                        PlanSettings(shard_size="8", seed=seed), ("train",), holdout)


def _rows(out: Path, split: str) -> list[tuple[str, str, str]]:
    t = read_ledger(out).filter(pc.equal(pc.field("split"), split))
    return list(zip(t.column("shard").to_pylist(), t.column("key").to_pylist(), t.column("status").to_pylist()))


def _tree(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def held(demo_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("held") / "out"
    pack(demo_dir / "dataset", out, _settings(demo_dir, Holdout(ratio=0.25)), workers=1, progress=False)
    return out


def test_the_share_is_exact_and_nothing_is_lost(held, packed):
    plain_train = _rows(packed, "train")  # the same source and settings, nothing held out
    kept = [r for r in plain_train if r[2] in KEPT]
    val, train = _rows(held, "val"), _rows(held, "train")
    assert len(val) == int(0.25 * len(kept) + 0.5)
    assert all(status in KEPT for _, _, status in val)  # only kept samples are held out
    assert not {r[:2] for r in val} & {r[:2] for r in train}
    assert sorted(r[:2] for r in val + train) == sorted(r[:2] for r in plain_train)  # every sample, once
    manifest = Manifest.read(held)
    assert manifest.counts["val"]["samples"] == len(val) and manifest.packs["val"] > 0
    assert manifest.settings["holdout"] == {"val_ratio": 0.25}
    assert manifest.run_config["val_ratio"] == 0.25 and "val_count" not in manifest.run_config
    # A run without a hold-out records none (its manifest keeps its earlier bytes).
    assert "holdout" not in Manifest.read(packed).settings and "val_ratio" not in Manifest.read(packed).run_config


def test_energon_and_the_reader_open_the_val_split(held):
    from megatron.energon import WorkerConfig, reraise_exception
    from megatron.energon.dataset_config import get_dataset_from_config

    from packtool.runtime.read import open_pack

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    dataset = get_dataset_from_config(held, split_part="val", training=False, worker_config=wc, decoder=None).build()
    wc.worker_activate(sample_index=0)
    try:
        records = [open_pack(dict(s))[0] for s in dataset]
    finally:
        wc.worker_deactivate()
    assert len(records) == Manifest.read(held).packs["val"]
    segments = sorted((s.shard, s.key) for r in records for s in r.segments)
    assert segments == sorted(r[:2] for r in _rows(held, "val"))
    assert all(r.key.startswith("val-") for r in records)


def test_verify_against_the_source(held, demo_dir):
    result = RUNNER.invoke(app, ["verify", str(held), "--source", str(demo_dir / "dataset")])
    assert result.exit_code == 0, result.output[-2000:]


def test_same_bytes_whatever_the_workers_and_a_seed_draws_another(held, demo_dir, tmp_path):
    again = tmp_path / "two-workers"
    pack(demo_dir / "dataset", again, _settings(demo_dir, Holdout(ratio=0.25)), workers=2, progress=False)
    assert _tree(again) == _tree(held)
    other = tmp_path / "seed-1"
    pack(demo_dir / "dataset", other, _settings(demo_dir, Holdout(ratio=0.25), seed=1), workers=1, progress=False)
    assert len(_rows(other, "val")) == len(_rows(held, "val"))
    assert {r[:2] for r in _rows(other, "val")} != {r[:2] for r in _rows(held, "val")}


def test_a_count(demo_dir, tmp_path):
    out = tmp_path / "out"
    pack(demo_dir / "dataset", out, _settings(demo_dir, Holdout(count=7)), workers=1, progress=False)
    assert len(_rows(out, "val")) == 7
    assert Holdout(count=10_000).size(12) == 12 and Holdout(ratio=0.5).size(5) == 3


@pytest.mark.parametrize("args, needle", [
    (["--val-ratio", "1.5"], "val_ratio must be between 0 and 1"),
    (["--val-ratio", "0"], "val_ratio must be between 0 and 1"),
    (["--val-count", "0"], "val_count must be at least 1"),
    (["--val-ratio", "0.1", "--val-count", "3"], "give one of val_ratio and val_count"),
    (["--val-ratio", "0.1"], "the source already has a 'val' split"),  # the demo has one: never merged into it
    (["--val-count", "3", "--split", "val"], "out of the 'train' split, and the source packs none"),
])
def test_refused_with_one_line(demo_dir, tmp_path, args, needle):
    result = RUNNER.invoke(app, ["pack", str(demo_dir / "dataset"), str(tmp_path / "out"), "--tokenizer",
                                 str(demo_dir / "tokenizer"), "--pack-size", "2048", "--no-progress", *args])
    text = result.output.strip()
    assert result.exit_code == 2 and "\n" not in text and text.startswith("packtool: error:"), text[-2000:]
    assert needle in text, text
    assert not (tmp_path / "out").exists()


def test_holdout_is_typed():
    with pytest.raises(ConfigError, match="holdout must be a Holdout"):
        PackSettings(EncodeSettings(tokenizer="x", pack_size=64), holdout=0.1)  # type: ignore[arg-type]


def test_candidates_read_each_split_from_trains_stores(held):
    """The held-out split has no encode ranges of its own: ``stats --candidates`` takes each split's samples out
    of train's, with their media (the ledger alone knows none)."""
    from packtool.verify.candidates import load_rows

    for split in ("train", "val"):
        rows = load_rows(held, split, None)
        ledger = _rows(held, split)
        assert rows.error.size == len(ledger)
        assert sum(len(m) for m in rows.media) > 0
