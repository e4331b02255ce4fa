"""Mixtures: an Energon metadataset as SOURCE, one global plan per split, each dataset's samples in its declared
proportion (``blend_epochized`` repetitions, integer and fractional; ``blend`` weights), every segment and ledger
row naming its dataset, the reader's per-segment dataset index, per-dataset stats against packing apart, and
byte-identical reruns."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import yaml
from typer.testing import CliRunner

import demo
from packtool.cli import app
from packtool.errors import SourceError
from packtool.format import KEPT, Manifest, Segment
from packtool.packer.ledger import read_ledger
from packtool.packer.mixing import NOT_DRAWN, copies_of
from packtool.packer.pipeline import pack
from packtool.packer.sources.mixture import read_mixture
from packtool.settings import EncodeSettings, Holdout, PackSettings, PlanSettings
from packtool.verify.stats import compute

RUNNER = CliRunner()
HEADER = {"__module__": "megatron.energon", "__class__": "MetadatasetV2"}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Path:
    """Short text, images, long samples and typed VQA samples: four Energon datasets in one folder."""
    d = tmp_path_factory.mktemp("mix")
    demo.build_dataset(d / "text", n_train=60, n_val=6, samples_per_shard=30, image_fraction=0.0,
                       long_fraction=0.0, text_scale=0.3, seed=1)
    demo.build_dataset(d / "images", n_train=30, n_val=4, samples_per_shard=15, image_fraction=1.0,
                       long_fraction=0.0, seed=2)
    demo.build_dataset(d / "long", n_train=12, n_val=2, samples_per_shard=12, image_fraction=0.0,
                       long_fraction=0.5, seed=3)
    demo.build_vqa_dataset(d / "vqa", n=20, seed=4)
    return d


def _write(folder: Path, name: str, splits: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump({**HEADER, "splits": splits}))
    return path


def _settings(demo_dir: Path, holdout: Holdout | None = None, splits: tuple[str, ...] = ()) -> PackSettings:
    return PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                        PlanSettings(shard_size="8"), splits, holdout)


def _tree(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _kept_alone(demo_dir: Path, dataset: Path, tmp: Path) -> int:
    """The train samples a dataset keeps packed on its own (the pool its proportion applies to)."""
    out = tmp / f"alone-{dataset.name}"
    pack(dataset, out, _settings(demo_dir, splits=("train",)), workers=1, progress=False)
    return sum(Manifest.read(out).counts["train"][s] for s in KEPT)


EPOCHIZED = {"train": {"blend_epochized": [{"repetitions": 2, "path": "text"}, {"repetitions": 0.5, "path": "images"},
                                           {"path": "long"}, {"repetitions": 1.5, "path": "vqa"}]}}


@pytest.fixture(scope="module")
def epochized(datasets, demo_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("epochized") / "out"
    pack(_write(datasets, "epochized.yaml", EPOCHIZED), out, _settings(demo_dir), workers=1, progress=False)
    return out


def test_repetitions_give_exact_counts_and_lose_nothing(epochized, datasets, demo_dir, tmp_path):
    ledger = read_ledger(epochized).to_pandas()
    kept = ledger[ledger.status.isin(KEPT)]
    for name, r in (("text", 2), ("images", 0.5), ("long", 1), ("vqa", 1.5)):
        pool = _kept_alone(demo_dir, datasets / name, tmp_path)
        assert (kept.dataset == name).sum() == copies_of(pool, r), name
        mine = ledger[ledger.dataset == name]
        assert mine[mine["copy"] == 0][["shard", "key"]].drop_duplicates().shape[0] == (mine["copy"] == 0).sum()
    # A fraction below 1 leaves samples out: each keeps its ledger row, dropped with the reason, and the drop
    # limit does not count them (the run exited 0).
    left = ledger[ledger.reason.fillna("").str.startswith(NOT_DRAWN)]
    assert len(left) == _kept_alone(demo_dir, datasets / "images", tmp_path) - copies_of(
        _kept_alone(demo_dir, datasets / "images", tmp_path), 0.5)
    assert set(left.status) == {"dropped"} and set(left.dataset) == {"images"}
    assert Manifest.read(epochized).counts["train"]["not_drawn"] == len(left)
    # Copies of one sample never share a pack here.
    per_pack = Counter(zip(kept.pack, kept.shard, kept.key))
    assert max(per_pack.values()) == 1
    assert Manifest.read(epochized).mixture["repetitions"]["train"] == {"text": 2.0, "images": 0.5, "long": 1.0,
                                                                         "vqa": 1.5}


def test_segments_name_their_dataset_and_the_reader_indexes_it(epochized):
    from megatron.energon import WorkerConfig, reraise_exception
    from megatron.energon.dataset_config import get_dataset_from_config

    from packtool.runtime.read import open_pack, pack_to_batch

    manifest = Manifest.read(epochized)
    names = manifest.mixture["datasets"]
    assert names == ["text", "images", "long", "vqa"]
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    dataset = get_dataset_from_config(epochized, split_part="train", training=False, worker_config=wc,
                                      decoder=None).build()
    wc.worker_activate(sample_index=0)
    try:
        samples = [dict(s) for s in dataset]
    finally:
        wc.worker_deactivate()
    assert len(samples) == manifest.packs["train"]
    seen = Counter()
    for members in samples[:12]:
        record = open_pack(members)[0]
        batch = pack_to_batch(members, manifest, images=False)
        assert batch["dataset_index"].tolist() == [names.index(s.dataset) for s in record.segments]
    for members in samples:
        for s in open_pack(members)[0].segments:
            assert s.shard.split("/")[0] == s.dataset  # the dataset's folder leads its shard paths
            seen[(s.dataset, s.copy)] += 1
    ledger = read_ledger(epochized).to_pandas()
    kept = ledger[ledger.status.isin(KEPT)]
    assert seen == Counter(zip(kept.dataset, kept["copy"]))
    # One dataset's segments keep their bytes: no dataset, no copy written.
    assert "dataset" not in Segment("k", "train", "s.tar", False).to_json()


def test_verify_packs_and_source(epochized, datasets):
    result = RUNNER.invoke(app, ["verify", str(epochized), "--source", str(datasets / "epochized.yaml")])
    assert result.exit_code == 0, result.output[-2000:]


def test_blend_shares_and_joint_fill(datasets, demo_dir, tmp_path):
    splits = {"train": {"blend": [{"weight": 1, "path": "text"}, {"weight": 1, "path": "images"},
                                  {"weight": 2, "path": "vqa"}]}}
    out = tmp_path / "blend"
    pack(_write(datasets, "blend.yaml", splits), out, _settings(demo_dir), workers=1, progress=False)
    reps = Manifest.read(out).mixture["repetitions"]["train"]
    assert min(reps.values()) == pytest.approx(1.0)  # the dataset that needs the longest pass is taken once
    report = compute(out)["splits"]["train"]
    rows = {d["dataset"]: d for d in report["datasets"]}
    total = sum(d["samples"] for d in rows.values())
    for name, share in (("text", 0.25), ("images", 0.25), ("vqa", 0.5)):
        assert rows[name]["declared_share"] == pytest.approx(share)
        assert abs(rows[name]["samples"] / total - share) <= 1.5 / total + 1e-9  # rounding: within a sample
    # Packed jointly never takes more packs than the same proportions packed apart.
    assert report["packs"] <= sum(d["packs_apart"] for d in rows.values())
    text = RUNNER.invoke(app, ["stats", str(out)]).output
    assert "packed apart:" in text and "declared" in text


def test_copies_of_short_samples_never_share_a_pack(datasets, demo_dir, tmp_path):
    """Many copies of a few short samples of near-equal length (a blend that takes 20 VQA samples many times
    beside the text set): no pack holds one sample twice, and stats says so. Control: the plain planner on the same
    lengths puts copies of one sample together."""
    from packtool.packer.algorithms import pack_lengths
    from packtool.packer.mixing import shared_packs

    splits = {"train": {"blend": [{"weight": 0.6, "path": "vqa"}, {"weight": 0.4, "path": "text"}]}}
    out = tmp_path / "copies"
    pack(_write(datasets, "copies.yaml", splits), out, _settings(demo_dir), workers=1, progress=False)
    ledger = read_ledger(out).to_pandas()
    kept = ledger[ledger.pack.notna()]
    assert kept["copy"].max() >= 4  # each VQA sample taken several times
    per_pack = Counter(zip(kept.pack, kept.shard, kept.key))
    assert max(per_pack.values()) == 1
    report = compute(out)["splits"]["train"]
    assert report["packs_sharing_a_sample"] == 0
    assert "copies together: 0 packs" in RUNNER.invoke(app, ["stats", str(out)]).output
    # the plan without the copies' identities packs them together, and the count sees it
    ident = [f"{a}\0{b}" for a, b in zip(kept.shard, kept.key)]
    plain = pack_lengths(kept.tokens.to_numpy(), 2048)
    assert shared_packs(plain, ident) > 0
    # the joint plan still costs no more packs than the same proportions packed apart
    assert report["packs"] <= sum(d["packs_apart"] for d in report["datasets"])


def test_reruns_are_byte_identical_whatever_the_workers(epochized, datasets, demo_dir, tmp_path):
    again = tmp_path / "again"
    pack(datasets / "epochized.yaml", again, _settings(demo_dir), workers=2, progress=False)
    assert _tree(again) == _tree(epochized)


def test_nested_metadatasets_multiply_and_holdout_per_dataset(datasets, demo_dir, tmp_path):
    inner = _write(datasets, "inner.yaml", {"train": {"blend_epochized": [{"repetitions": 2, "path": "text"},
                                                                         {"path": "long"}]}})
    outer = _write(datasets, "outer.yaml", {"train": {"blend_epochized": [{"repetitions": 1.5, "path": inner.name},
                                                                         {"path": "vqa"}]}})
    mixture = read_mixture(outer)
    assert {e.name: e.repetitions for e in mixture.splits["train"]} == {"text": 3.0, "long": 1.5, "vqa": 1.0}
    out = tmp_path / "held"
    pack(outer, out, _settings(demo_dir, Holdout(count=2)), workers=1, progress=False)
    ledger = read_ledger(out).to_pandas()
    val = ledger[ledger.split == "val"]
    assert sorted(Counter(val.dataset).items()) == [("long", 2), ("text", 2), ("vqa", 2)]
    assert set(val["copy"]) == {0}  # held-out samples are taken once
    train = ledger[(ledger.split == "train") & ledger.status.isin(KEPT)]
    assert not set(zip(val.shard, val.key)) & set(zip(train.shard, train.key))


@pytest.mark.parametrize("splits, needle", [
    ({"train": {"blend": [{"path": "text"}], "blend_epochized": [{"path": "vqa"}]}}, "choose one"),
    ({"train": {"blend": [{"weight": 0, "path": "text"}]}}, "weight must be a positive number"),
    ({"train": {"blend_epochized": [{"repetitions": -1, "path": "text"}]}}, "repetitions must be a positive"),
    ({"train": {"blend": [{"path": "text"}, {"path": "text"}]}}, "names dataset text twice"),
    ({"train": {"join": [{"path": "text"}, {"path": "vqa"}]}}, "join (joined datasets) is not supported"),
    ({"train": {"blend": [{"path": "missing"}]}}, "dataset missing does not exist"),
    ({"train": {"blend": [{"path": "text", "wieght": 2}]}}, "unknown key 'wieght'"),
    ({"train": {"blend": [{"repetitions": 2, "path": "text"}]}}, "repetitions in a blend entry"),
    ({"train": {"blend": [{"path": "text", "shuffle_over_epochs_multiplier": 2}]}}, "does not apply to packing"),
])
def test_bad_metadatasets_are_refused_with_one_line(datasets, demo_dir, tmp_path, splits, needle):
    path = _write(datasets, "bad.yaml", splits)
    with pytest.raises(SourceError, match=None) as exc:
        read_mixture(path)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    result = RUNNER.invoke(app, ["pack", str(path), str(tmp_path / "out"), "--tokenizer",
                                 str(demo_dir / "tokenizer"), "--pack-size", "2048", "--no-progress"])
    text = result.output.strip()
    assert result.exit_code == 2 and "\n" not in text and needle in text, text[-2000:]


def test_an_entry_error_names_the_entry_and_the_file(datasets, demo_dir, tmp_path):
    """A ``val`` blend naming a dataset without a ``val`` split: one line naming the mixture file, the split and
    the dataset (the dataset's own error after them); the same blend on ``train`` packs (control)."""
    from packtool.packer.sources.mixture import open_mixture

    blend = {"blend": [{"weight": 1, "path": "text"}, {"weight": 1, "path": "vqa"}]}
    path = _write(datasets, "val-blend.yaml", {"val": blend})
    with pytest.raises(SourceError) as exc:
        open_mixture(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: split 'val', dataset vqa (") and "unknown split 'val'" in message
    assert "\n" not in message
    assert open_mixture(_write(datasets, "train-blend.yaml", {"train": blend})).splits["train"]


def test_not_a_metadataset(datasets):
    path = datasets / "plain.yaml"
    path.write_text(json.dumps({"splits": {"train": {"path": "text"}}}))
    with pytest.raises(SourceError, match="not an Energon metadataset"):
        read_mixture(path)


def test_a_single_reference_per_split(datasets, demo_dir, tmp_path):
    path = _write(datasets, "single.yaml", {"train": {"path": "text"}, "val": {"path": "text"}})
    out = tmp_path / "single"
    pack(path, out, _settings(demo_dir), workers=1, progress=False)
    ledger = read_ledger(out)
    assert set(ledger.column("dataset").to_pylist()) == {"text"}
    assert pc.max(ledger.column("copy")).as_py() == 0
    assert np.all(np.asarray(ledger.column("split").to_pylist()) != None)  # noqa: E711


def test_other_proportions_are_another_output(datasets, demo_dir, tmp_path):
    """The declared proportions decide the output: a rerun with other repetitions is refused without --overwrite
    (never the old output returned as finished), and with it re-plans on the same encodings."""
    from packtool.errors import OutputError

    path = _write(datasets, "change.yaml", {"train": {"blend_epochized": [{"path": "long"}, {"path": "vqa"}]}})
    out = tmp_path / "out"
    pack(path, out, _settings(demo_dir), workers=1, progress=False)
    before = Manifest.read(out).counts["train"]["samples"]
    assert Manifest.read(out).source == str(path)  # the metadataset, not the datasets' common folder
    _write(datasets, "change.yaml", {"train": {"blend_epochized": [{"path": "long"},
                                                                   {"repetitions": 2, "path": "vqa"}]}})
    with pytest.raises(OutputError, match="mixture"):
        pack(path, out, _settings(demo_dir), workers=1, progress=False)
    pack(path, out, _settings(demo_dir), workers=1, progress=False, overwrite=True)
    assert Manifest.read(out).counts["train"]["samples"] > before
    assert Manifest.read(out).mixture["repetitions"]["train"]["vqa"] == 2.0


def test_the_trainers_take_the_mixed_output_as_one_dataset(epochized):
    """The reader's batches of a mixture feed Megatron-Bridge's step batch, the Hugging Face batch and the
    collation of several packs as any output's do, with ``dataset_index`` beside them."""
    from itertools import islice

    from packtool.runtime import megatron_bridge_batch, read_packs
    from packtool.runtime.hf import hf_batch
    from packtool.runtime.loader import collate_packs

    manifest = Manifest.read(epochized)
    rows = list(islice(read_packs(epochized, "train"), 3))
    for batch in rows:
        assert batch["dataset_index"].shape[0] == len(batch["keys"])
        step = megatron_bridge_batch(batch)
        assert step["tokens"].shape == batch["tokens"].shape
        assert hf_batch(batch, manifest)["input_ids"].shape[1] == int(batch["cu_seqlens_unpadded"][-1])
    joined = collate_packs(rows, manifest.pad_token_id)
    assert joined["dataset_index"].tolist() == [i for r in rows for i in r["dataset_index"].tolist()]
    assert len(joined["keys"]) == joined["dataset_index"].shape[0]


def test_an_entry_added_in_the_middle_encodes_that_entry_only(datasets, demo_dir, tmp_path):
    """Encode stores are named by the shard they encode, not by its position in the mixture: adding an entry in
    the middle encodes its shards only (the others' stores are the same files), reordering encodes nothing, and
    removing an entry deletes its stores; each output equals a fresh pack of its mixture."""
    import pyarrow.parquet as pq

    def stores(out: Path) -> dict[str, tuple[int, int, int]]:
        """Each range store: (inode, mtime_ns, samples) of its samples.parquet."""
        found = {}
        for f in sorted((out / ".packtool" / "encode").glob("*/*/*/samples.parquet")):
            st = f.stat()
            found[f.parent.relative_to(out).as_posix()] = (st.st_ino, st.st_mtime_ns, pq.read_metadata(f).num_rows)
        return found

    def mix(*names: str) -> Path:
        return _write(tmp_path, "grow.yaml", {"train": {"blend_epochized": [{"path": str(datasets / n)}
                                                                            for n in names]}})

    settings = _settings(demo_dir, splits=("train",))
    out = tmp_path / "out"
    pack(mix("text", "long"), out, settings, workers=1, progress=False)
    before = stores(out)
    pack(mix("text", "images", "long"), out, settings, workers=1, progress=False, overwrite=True)
    after = stores(out)
    new = {k: v for k, v in after.items() if before.get(k) != v}
    assert {k: after[k] for k in before} == before  # text's and long's stores: the very same files
    assert new and all("images_shards_" in k for k in new)  # the added entry's shards, and only those
    encoded = sum(v[2] for v in new.values())
    fresh = tmp_path / "fresh"
    pack(mix("text", "images", "long"), fresh, settings, workers=1, progress=False)
    assert encoded == Manifest.read(fresh).counts["train"]["samples"] - sum(v[2] for v in before.values())
    assert {k: v for k, v in _tree(out).items() if ".packtool" not in k} == \
        {k: v for k, v in _tree(fresh).items() if ".packtool" not in k}
    # Reordered: nothing encoded again. Removed: its stores go, and the output is the first one again.
    pack(mix("long", "images", "text"), out, settings, workers=1, progress=False, overwrite=True)
    assert stores(out) == after
    pack(mix("text", "long"), out, settings, workers=1, progress=False, overwrite=True)
    assert stores(out) == before
    first = tmp_path / "first"
    pack(mix("text", "long"), first, settings, workers=1, progress=False)
    assert {k: v for k, v in _tree(out).items() if ".packtool" not in k} == \
        {k: v for k, v in _tree(first).items() if ".packtool" not in k}
