"""End to end: the demo dataset packed, then read back with Energon, plain webdataset, tarfile and sqlite."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

import demo


def energon_samples(path: Path, split: str) -> list[dict]:
    """Every sample of a split through Energon's own loader: crude, raw bytes, errors re-raised, in order."""
    from megatron.energon import WorkerConfig
    from megatron.energon.dataset_config import get_dataset_from_config
    from megatron.energon.errors import reraise_exception

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    factory = get_dataset_from_config(path, split_part=split, training=False, worker_config=wc, decoder=None)
    dataset = factory.build()
    wc.worker_activate(0)
    try:
        return [dict(s) for s in dataset]
    finally:
        wc.worker_deactivate()


def source_samples(dataset: Path) -> dict[tuple[str, str], dict[str, bytes]]:
    """(shard, key) -> {part: bytes} for every sample of the source, read with tarfile, excludes applied."""
    split_cfg = yaml.safe_load((dataset / ".nv-meta" / "split.yaml").read_text())
    import braceexpand

    excluded = set(split_cfg.get("exclude") or [])
    out = {}
    for patterns in split_cfg["split_parts"].values():
        for shard in (s for p in patterns for s in braceexpand.braceexpand(p)):
            with tarfile.open(dataset / shard) as tar:
                for m in tar:
                    key, _, part = m.name.partition(".")
                    if f"{shard}/{key}" in excluded:
                        continue
                    out.setdefault((shard, key), {})[part] = tar.extractfile(m).read()
    return out


def records(path: Path, split: str) -> list[tuple[str, dict[str, bytes]]]:
    """Packs of a split read with tarfile, in shard and record order."""
    split_cfg = yaml.safe_load((path / ".nv-meta" / "split.yaml").read_text())
    out = []
    for shard in split_cfg["split_parts"][split]:
        with tarfile.open(path / shard) as tar:
            for m in tar:
                key, _, part = m.name.partition(".")
                if not out or out[-1][0] != key:
                    out.append((key, {}))
                out[-1][1][part] = tar.extractfile(m).read()
    return out


def npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_energon_loads_every_pack(packed):
    info = json.loads((packed / ".nv-meta" / ".info.json").read_text())
    split_cfg = yaml.safe_load((packed / ".nv-meta" / "split.yaml").read_text())
    assert set(split_cfg["split_parts"]) == {"train", "val"}
    for split, shards in split_cfg["split_parts"].items():
        loaded = energon_samples(packed, split)
        expected = records(packed, split)
        assert len(loaded) == sum(info["shard_counts"][s] for s in shards) == len(expected)
        assert [s["__key__"] for s in loaded] == [k for k, _ in expected]
        for sample, (_, parts) in zip(loaded, expected):
            for part, data in parts.items():
                assert sample[part] == data


def test_plain_webdataset_reads_same_records(packed):
    import webdataset as wds

    for split in ("train", "val"):
        shards = yaml.safe_load((packed / ".nv-meta" / "split.yaml").read_text())["split_parts"][split]
        urls = [str(packed / s) for s in shards]
        got = [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
               for s in wds.WebDataset(urls, shardshuffle=False)]
        assert got == records(packed, split)


def test_index_sqlite_lookup_by_key(packed):
    info = json.loads((packed / ".nv-meta" / ".info.json").read_text())
    shards = list(info["shard_counts"])
    con = sqlite3.connect(packed / ".nv-meta" / "index.sqlite")
    rows = con.execute("SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM samples").fetchall()
    assert len(rows) == sum(info["shard_counts"].values())
    for fid, key, index, offset, _size in rows[:: max(1, len(rows) // 10)]:
        parts = con.execute("SELECT part_name, content_byte_offset, content_byte_size FROM sample_parts "
                            "WHERE tar_file_id=? AND sample_index=?", (fid, index)).fetchall()
        with open(packed / shards[fid], "rb") as f:
            f.seek(offset)
            head = f.read(512)
            assert head[:100].rstrip(b"\0").decode().startswith(key + ".")
            for part, poff, psize in parts:
                f.seek(poff)
                data = f.read(psize)
                if part == "json":
                    assert json.loads(data)["segments"]
        idx = np.fromfile(packed / (shards[fid] + ".idx"), dtype=np.uint64)
        assert idx[index] == offset
    # Energon's own random access by key.
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

    reader = SqliteITarEntryReader(EPath(packed), key_is_full_entryname=False)
    key = rows[len(rows) // 2][1]
    sample = reader[key]
    assert sample["__key__"] == key and json.loads(sample["json"])["segments"]


def test_every_source_sample_accounted_for_once(packed, demo_dir):
    ledger = pq.read_table(packed / "ledger.parquet").to_pylist()
    source = source_samples(demo_dir / "dataset")
    assert Counter((r["shard"], r["key"]) for r in ledger) == Counter(source.keys())
    assert (demo.EXCLUDED_SHARD, demo.EXCLUDED_KEY) not in source
    in_packs = Counter()
    for split in ("train", "val"):
        for _key, parts in records(packed, split):
            for seg in json.loads(parts["json"])["segments"]:
                in_packs[(seg["shard"], seg["key"])] += 1
    for r in ledger:
        placed = in_packs[(r["shard"], r["key"])]
        if r["status"] in ("packed", "truncated"):
            assert placed == 1 and r["pack"] is not None
        else:
            assert placed == 0 and r["pack"] is None and r["reason"]
    assert sum(in_packs.values()) == sum(r["status"] in ("packed", "truncated") for r in ledger)


def test_media_bytes_identical_and_image_tokens_follow_the_rule(packed, demo_dir):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    source = source_samples(demo_dir / "dataset")
    manifest = json.loads((packed / ".nv-meta" / "packtool.json").read_text())
    pad = manifest["image_token_id"]
    cfg = json.loads((demo_dir / "tokenizer" / "preprocessor_config.json").read_text())
    branches = Counter()
    for split in ("train", "val"):
        for _, parts in records(packed, split):
            tokens = npy(parts["tokens.npy"])
            seqlens = npy(parts["seqlens.npy"])
            starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
            meta = json.loads(parts["json"])
            for seg, start, n in zip(meta["segments"], starts, seqlens):
                seg_tokens = tokens[start:start + n]
                src = source[(seg["shard"], seg["key"])]
                src_images = sorted(p for p in src if p.rsplit(".", 1)[-1] in ("jpg", "png", "webp"))
                expected_pads = 0
                for m in seg["media"]:
                    data = parts[m["member"]]
                    assert any(data == src[p] for p in src_images)
                    w, h = Image.open(io.BytesIO(data)).size
                    rh, rw = smart_resize(h, w, 28, cfg["min_pixels"], cfg["max_pixels"])
                    assert m["grid_thw"] == [1, rh // 14, rw // 14]
                    assert m["tokens"] == rh * rw // 784
                    block = seg_tokens[m["token_offset"]: m["token_offset"] + m["tokens"]]
                    assert (block == pad).all()
                    expected_pads += m["tokens"]
                    if round(h / 28) * round(w / 28) * 784 > cfg["max_pixels"]:
                        branches["down"] += 1
                    elif round(h / 28) * round(w / 28) * 784 < cfg["min_pixels"]:
                        branches["up"] += 1
                assert int((seg_tokens == pad).sum()) == expected_pads
    assert branches["down"] > 0 and branches["up"] > 0


def test_overlong_samples_truncated_safely(packed):
    ledger = pq.read_table(packed / "ledger.parquet").to_pylist()
    truncated = [r for r in ledger if r["status"] == "truncated"]
    assert truncated, "the demo has samples longer than the pack size"
    for r in truncated:
        assert 0 < r["tokens"] <= 2048 < r["source_tokens"] and r["targets"] > 0 and r["reason"]
    for r in ledger:
        if r["status"] in ("dropped", "error"):
            assert r["reason"]


def test_train_fill_and_stats(packed):
    from packtool.verify.stats import compute

    report = compute(packed)
    train = report["splits"]["train"]
    assert train["fill"] >= 0.98, train
    assert train["packs"] >= train["l1_bound"]
    assert train["padding_tail"] == train["packs"] * 2048 - train["tokens"] - train["padding_align"]


def test_rerun_is_byte_identical(packed, demo_dir, tmp_path):
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    out = tmp_path / "again"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="8"))
    pack(demo_dir / "dataset", out, settings, workers=2, progress=False)

    def digest(root: Path) -> dict:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.parts}

    assert digest(out) == digest(packed)
    # The encode store stays (a re-plan reuses it); it is not part of the dataset.
    assert (out / ".packtool" / "encode").is_dir()


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.parts}


def test_encode_ranges_do_not_change_the_output(packed, demo_dir, tmp_path, monkeypatch):
    """Source shards cut into many small encode ranges (by sample count and by bytes) give the same bytes."""
    from packtool.packer import pipeline, store
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    monkeypatch.setattr(store, "SAMPLES_PER_RANGE", 7)
    monkeypatch.setattr(store, "BYTES_PER_RANGE", 20_000)
    out = tmp_path / "ranges"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="8"))
    pipeline.pack(demo_dir / "dataset", out, settings, workers=2, progress=False)
    stores = list((out / ".packtool" / "encode").rglob("source.json"))
    shards = len(list((demo_dir / "dataset").rglob("*.tar")))
    assert len(stores) > 2 * shards  # the shards were really cut into several ranges each
    assert _digest(out) == _digest(packed)


@pytest.mark.parametrize("per_range, max_bytes, max_large", [(1, None, None), (3, None, None), (1024, None, None),
                                                              (1024, 1, None), (5, 250, None), (2, 10_000, None),
                                                              (1024, None, 1), (1024, None, 4), (7, 900, 3)])
def test_shard_ranges_cover_every_sample_once(per_range, max_bytes, max_large):
    from packtool.packer.sources.energon import ShardLayout

    rng = np.random.default_rng(per_range)
    starts = tuple(int(x) for x in np.cumsum(rng.integers(1, 400, size=40)) - 1)
    layout = ShardLayout("s.tar", starts, frozenset(), frozenset({3, 17}))
    ranges = layout.ranges(per_range, max_bytes, max_large=max_large, large_bytes=200)
    sizes = np.diff(starts).tolist() + [0]  # the last one counted small: its size is not known here
    firsts = [r.first for r in ranges] + [len(starts)]
    assert firsts[0] == 0 and all(a < b for a, b in zip(firsts, firsts[1:]))  # in order, none empty
    assert [r.last for r in ranges] == [False] * (len(ranges) - 1) + [True]
    for r, nxt in zip(ranges, firsts[1:]):
        assert nxt - r.first <= per_range
        assert r.start == starts[r.first] and r.stop == (starts[nxt] if nxt < len(starts) else None)
        assert r.kept_before == r.first - sum(1 for e in (3, 17) if e < r.first)
        if max_bytes is not None and nxt - r.first > 1:  # only a single sample may start past the byte budget
            assert starts[nxt - 1] - starts[r.first] < max_bytes
        if max_large is not None:
            assert sum(size >= 200 for size in sizes[r.first:nxt]) <= max_large
    assert ShardLayout("e.tar", (), frozenset(), frozenset()).ranges(4, 10)[0].last


def _range_sizes(sizes: list[int], *args, **kwargs) -> list[int]:
    from packtool.packer.sources.energon import ShardLayout

    starts = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
    firsts = [r.first for r in ShardLayout("s.tar", starts, frozenset(), frozenset()).ranges(*args, **kwargs)]
    return [b - a for a, b in zip(firsts, [*firsts[1:], len(sizes)])]


def test_shard_ranges_are_even_and_count_small_media():
    """Ranges are cut at even work, never a full range and a leftover; samples of media size count on their own,
    so a shard of small videos (far below the byte budget) is still several tasks; the module's own limits cut
    a shard of 400 such videos into tasks two workers share evenly."""
    from packtool.packer.sources.energon import ShardLayout
    from packtool.packer.store import shard_ranges

    assert _range_sizes([1000] * 30, 1024, 10_000) == [10, 10, 10]
    assert sorted(_range_sizes([1000] * 25, 1024, 10_000)) == [8, 8, 9]  # not 10, 10 and a leftover 5
    assert _range_sizes([100] * 2050, 1024) == [683, 684, 683]
    small_videos = [70_000] * 400
    assert _range_sizes(small_videos, 1024, 32 << 20) == [400]  # bytes alone: one task for the whole shard
    sizes = _range_sizes(small_videos, 1024, 32 << 20, max_large=100, large_bytes=64 << 10)
    assert len(sizes) == 4 and max(sizes) <= 100 and max(sizes) - min(sizes) <= 2, sizes
    text_and_video = [2_000, 70_000] * 200  # 200 large ones (weight 1/100 each) and 200 small (1/1024)
    sizes = _range_sizes(text_and_video, 1024, 32 << 20, max_large=100, large_bytes=64 << 10)
    assert sorted(sizes) == [133, 133, 134], sizes
    starts = tuple(int(x) for x in np.cumsum([0, *small_videos[:-1]]))
    assert len(shard_ranges(ShardLayout("s.tar", starts, frozenset(), frozenset()))) >= 4


def test_an_encode_store_is_only_reused_for_the_same_range(demo_dir, tmp_path):
    """A resumed run whose ranges differ from the stored ones (other range bounds, another packtool version)
    encodes again instead of taking another range's samples for its own."""
    import pyarrow.parquet as pq

    from packtool.packer.sources.energon import metadata_digest, shard_layout
    from packtool.packer.store import EncodeTask, SourceStamp, encode_range, is_current
    from packtool.settings import EncodeSettings

    root = demo_dir / "dataset"
    shard = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.tar"))[0]
    layout = shard_layout(root, shard)
    stamp = SourceStamp.of(root, shard, metadata_digest(root))
    settings = EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048)
    seven, five = layout.ranges(7)[0], layout.ranges(5)[0]
    store = tmp_path / "store"
    encode_range(EncodeTask(str(root), layout, seven, frozenset(), settings, {}, None, stamp, False, str(store)))
    assert is_current(store, stamp, seven) and not is_current(store, stamp, five)
    encode_range(EncodeTask(str(root), layout, five, frozenset(), settings, {}, None, stamp, False, str(store)))
    assert pq.read_table(store / "samples.parquet").num_rows == 5


def test_the_run_reports_the_fill_the_ledger_gives(demo_dir, tmp_path):
    """The fill and L1 bound a run prints come from its plans; they are the numbers ``stats`` reads back from the
    ledger (aligned rows, truncated samples)."""
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings
    from packtool.verify.stats import compute

    out = tmp_path / "aligned"
    result = pack(demo_dir / "dataset", out, PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"),
                                                                         pack_size=1024, align=8)),
                  workers=1, progress=False)
    report = compute(out)
    assert set(result.fills) == set(report["splits"]) == {"train", "val"}
    for split, fill in result.fills.items():
        entry = report["splits"][split]
        assert vars(fill) == {k: entry[k] for k in ("packs", "tokens", "l1_bound", "fill")}
    assert report["splits"]["train"]["status"]["truncated"] and report["splits"]["train"]["padding_align"]
