"""An output shard written as parts by several workers and joined has the bytes of one written whole."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from packtool.format import MANIFEST
from packtool.packer import pipeline
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings
from packtool.shards import idx_path, join_tar, write_records, write_tar

RECORDS = [(f"k{i}", [("json", b"{}" * i), ("bin", bytes(range(i % 256)) * 3)]) for i in range(9)]


@pytest.mark.parametrize("kernel_copy", ["yes", "refused", "missing"])
def test_parts_joined_equal_one_tar(tmp_path: Path, monkeypatch, kernel_copy: str) -> None:
    """Joined parts equal one tar written whole, whether the kernel copies (copy_file_range), refuses to, or
    the platform has no such call (user-space copy)."""
    import errno
    import os

    if kernel_copy == "refused":
        def refuse(*args, **kwargs):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif kernel_copy == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    whole = write_tar(tmp_path / "whole.tar", RECORDS)
    parts = []
    for i, chunk in enumerate((RECORDS[:4], RECORDS[4:5], RECORDS[5:])):
        with open(tmp_path / f"part{i}", "wb") as f:
            parts.append((tmp_path / f"part{i}", write_records(f, chunk)))
    assert join_tar(tmp_path / "joined.tar", parts) == whole
    assert (tmp_path / "joined.tar").read_bytes() == (tmp_path / "whole.tar").read_bytes()
    assert np.array_equal(np.fromfile(idx_path(tmp_path / "joined.tar"), np.uint64),
                          np.fromfile(idx_path(tmp_path / "whole.tar"), np.uint64))
    assert not any(p.exists() for p, _ in parts)


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.relative_to(root).parts}


def test_one_shard_two_workers_same_bytes(demo_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """One output shard, two workers: written in two parts, byte for byte what one worker writes; a rerun of a
    run that stopped after the shard was committed indexes it instead."""
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048), splits=("train",))
    pack(demo_dir / "dataset", tmp_path / "one", settings, workers=1, progress=False)
    joined: list[int] = []
    monkeypatch.setattr(pipeline, "join_tar", lambda path, parts: joined.append(len(parts)) or join_tar(path, parts))
    pack(demo_dir / "dataset", tmp_path / "two", settings, workers=2, progress=False)
    assert joined == [2]
    reference = _files(tmp_path / "one")
    assert [n for n in reference if n.endswith(".tar")] == ["train/pack-000000.tar"]
    assert _files(tmp_path / "two") == reference
    (tmp_path / "two" / MANIFEST).unlink()
    shard = tmp_path / "two" / "train" / "pack-000000.tar"
    written = shard.stat().st_mtime_ns
    pack(demo_dir / "dataset", tmp_path / "two", settings, workers=2, progress=False)
    assert _files(tmp_path / "two") == reference and shard.stat().st_mtime_ns == written and joined == [2]


def test_headers_equal_tarfiles():
    """The writer's spliced USTAR headers are tarfile's bytes for every name and size (long and non-ASCII names
    and sizes of 8 GiB or more take tarfile's own path)."""
    import random

    from packtool.shards import _header, _tar_header

    rng = random.Random(0)
    cases = [("a", 0), ("x" * 100, 8 ** 11 - 1), ("x" * 101, 3), ("é.json", 4), ("y" * 150 + "/z.npy", 9),
             ("big", 8 ** 11), ("train-000001.tokens.npy", 32128)]
    cases += [("".join(rng.choice("ab./_-09") for _ in range(rng.randint(1, 120))),
               rng.choice([0, 511, 512, 513, rng.randint(0, 2 ** 36)])) for _ in range(500)]
    for name, size in cases:
        try:
            want: bytes | type = _tar_header(name, size)
        except ValueError as exc:  # a name tarfile cannot split into prefix and name
            want = type(exc)
        try:
            got: bytes | type = _header(name, size)
        except ValueError as exc:
            got = type(exc)
        assert got == want, (name, size)
    with tarfile.open(fileobj=io.BytesIO(_header("k.json", 3) + b"abc" + bytes(509 + 1024))) as tar:
        member = tar.next()
        assert member is not None and (member.name, member.size, member.mode) == ("k.json", 3, 0o644)


def test_npy_bytes_equal_np_save():
    """npy_bytes lays the header out as np.save does, for every dtype and length digit count."""
    from packtool.format import load_npy, npy_bytes

    for dtype in (np.int32, np.uint8, np.int64, np.float32, np.bool_, np.dtype(">i4")):
        for n in (0, 1, 9, 10, 99, 100, 8191, 8192, 100_003):
            array = (np.arange(n) % 7).astype(dtype)
            buf = io.BytesIO()
            np.save(buf, array, allow_pickle=False)
            assert npy_bytes(array) == buf.getvalue(), (dtype, n)
    assert np.array_equal(load_npy(npy_bytes(np.arange(5, dtype=np.int32)), np.int32, "x"), np.arange(5))
    with pytest.raises(ValueError):
        npy_bytes(np.zeros((2, 2), np.int32))


def test_shard_index_is_its_records():
    """A shard's index held as arrays reads back as the records it was made of (every access the metadata
    writers and ``verify`` use), pickles to itself, and holds a record in a fraction of a record object's
    memory (the command's process keeps every shard's index until it writes ``index.sqlite``)."""
    import pickle
    import random
    import tracemalloc

    from packtool.format import IndexedRecord
    from packtool.shards import ShardIndex

    rng = random.Random(0)
    records = []
    for i in range(5000):
        parts = tuple((rng.choice(["tokens.npy", "targets.npy", "json", f"img{i % 3}.jpg"]), rng.randrange(1 << 40),
                       rng.randrange(1 << 20)) for _ in range(rng.randint(0, 6)))
        records.append(IndexedRecord(f"train-{i:09d}", rng.randrange(1 << 40), rng.randrange(1 << 30), parts))
    index = ShardIndex(records)
    assert len(index) == len(records) and list(index) == records and index == records
    assert index[0] == records[0] and index[-1] == records[-1] and index[17:20] == records[17:20]
    assert pickle.loads(pickle.dumps(index)) == index and ShardIndex() == [] and list(ShardIndex()) == []
    assert index != records[:-1] and index != records[:-1] + [records[0]]
    with pytest.raises(IndexError):
        index[len(records)]
    blob = pickle.dumps(records)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = ShardIndex(pickle.loads(blob))
        compact = tracemalloc.get_traced_memory()[0] - before
        objects_before = tracemalloc.get_traced_memory()[0]
        as_objects = pickle.loads(blob)
        objects = tracemalloc.get_traced_memory()[0] - objects_before
    finally:
        tracemalloc.stop()
    assert len(kept) == len(as_objects)
    assert compact * 4 < objects, (compact, objects)


def test_write_tasks_carry_their_rows_by_file(demo_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A write task names its rows of the plan (a file in OUTPUT's work folder, removed once the shards are
    written): the command's process hands each worker a few names, not a table, whatever the rows, and the worker
    reads them a batch at a time."""
    import pickle

    import pyarrow.parquet as pq

    from packtool.packer import assemble
    from packtool.settings import PlanSettings

    rows: list[int] = []
    batches: list[int] = []
    real = assemble._segments

    def reading(task):
        assert "/.packtool/write/" in str(task.segments)
        rows.append(0)
        for batch in real(task):
            rows[-1] += batch.num_rows
            batches.append(batch.num_rows)
            yield batch

    tasks: list = []
    write_shard = pipeline.write_shard

    def keep(task):
        tasks.append(task)
        return write_shard(task)

    monkeypatch.setattr(assemble, "_segments", reading)
    monkeypatch.setattr(pipeline, "write_shard", keep)
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="8"), splits=("train",))
    pack(demo_dir / "dataset", tmp_path / "out", settings, workers=1, progress=False)
    status = pq.read_table(tmp_path / "out" / "ledger.parquet", columns=["status"]).column("status").to_pylist()
    assert len(tasks) > 2 and len(rows) == len(tasks) and all(isinstance(t.segments, str) for t in tasks)
    assert sum(rows) == sum(s in ("packed", "truncated") for s in status) and len(set(rows)) > 1
    assert max(batches) <= assemble._ROWS_READ  # a task reads its rows a batch at a time, never all at once
    sizes = [len(pickle.dumps(t)) for t in tasks]
    assert max(sizes) - min(sizes) < 256, sizes  # a task's size does not follow its rows
    assert not (tmp_path / "out" / ".packtool" / "write").exists()
