"""Write: packed records into USTAR shards (byte-reproducible), and every Energon metadata file, directly.

One writer, atomic files: everything is written to a temporary name, fsynced and renamed, so a file that exists
under its final name is complete.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import yaml

BLOCK = 512


# -- atomic files ----------------------------------------------------------------------------------------------
def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def npy_bytes(array: np.ndarray) -> bytes:
    """``.npy`` bytes of an array (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


# -- tar -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexedSample:
    """Where one record lies in its shard (what ``.tar.idx`` and ``index.sqlite`` hold)."""

    key: str
    #: Byte offset of the record's first member header.
    offset: int
    #: Bytes from that header to the end of the record's last member data, padded to a block.
    size: int
    #: (part name, content offset, content size) of each member.
    parts: tuple[tuple[str, int, int], ...]


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def write_tar(path: Path, records: Iterable[tuple[str, list[tuple[str, bytes]]]]) -> list[IndexedSample]:
    """Write records ``(key, [(part, bytes), ...])`` as an uncompressed USTAR tar plus its ``.tar.idx``.

    Member names are ``KEY.part``; headers carry mtime 0, uid/gid 0, mode 0644, so equal input gives equal bytes.
    Both files appear atomically. Returns the index of every record.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    index: list[IndexedSample] = []
    with open(tmp, "wb") as f:
        pos = 0
        for key, parts in records:
            start, placed = pos, []
            for part, data in parts:
                head = _header(f"{key}.{part}", len(data))
                pad = -len(data) % BLOCK
                f.write(head)
                f.write(data)
                f.write(b"\0" * pad)
                placed.append((part, pos + len(head), len(data)))
                pos += len(head) + len(data) + pad
            index.append(IndexedSample(key, start, pos - start, tuple(placed)))
        f.write(b"\0" * (2 * BLOCK))
        f.flush()
        os.fsync(f.fileno())
    offsets = [s.offset for s in index] + [pos]
    atomic_write(path.with_name(path.name + ".idx"), np.asarray(offsets, dtype=np.uint64).tobytes())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return index


def index_tar(path: Path) -> list[IndexedSample]:
    """Re-derive the record index of a tar written by :func:`write_tar` from its headers (data is not read)."""
    records: list[IndexedSample] = []
    cur_key, cur_start, cur_parts, end = None, 0, [], 0
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            key, _, part = m.name.partition(".")
            if key != cur_key:
                if cur_key is not None:
                    records.append(IndexedSample(cur_key, cur_start, end - cur_start, tuple(cur_parts)))
                cur_key, cur_start, cur_parts = key, m.offset, []
            cur_parts.append((part, m.offset_data, m.size))
            end = m.offset_data + m.size + (-m.size % BLOCK)
    if cur_key is not None:
        records.append(IndexedSample(cur_key, cur_start, end - cur_start, tuple(cur_parts)))
    return records


# -- Energon metadata ------------------------------------------------------------------------------------------
def write_energon_meta(out: Path, splits: dict[str, list[str]], indexes: dict[str, list[IndexedSample]],
                       energon_version: str) -> None:
    """Write ``dataset.yaml``, ``split.yaml``, ``.info.json``/``.info.yaml``, ``index.sqlite``, ``index.uuid``.

    ``splits`` maps split -> shard paths (relative to ``out``); ``indexes`` maps shard path -> its records.
    ``tar_file_id`` is the shard's position in ``.info.json``. The uuid derives from the content, so reruns match.
    """
    meta = Path(out) / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    shards = [s for split in splits for s in splits[split]]
    counts = {s: len(indexes[s]) for s in shards}
    dump = lambda d: yaml.safe_dump(d, sort_keys=False).encode()  # noqa: E731
    atomic_write(meta / "dataset.yaml", dump(
        {"__module__": "megatron.energon", "__class__": "CrudeWebdataset", "subflavors": {"packtool": 1}}))
    atomic_write(meta / "split.yaml", dump({"split_parts": {k: list(v) for k, v in splits.items()}, "exclude": []}))
    atomic_write(meta / ".info.json",
                 json.dumps({"energon_version": energon_version, "shard_counts": counts}, indent=2).encode())
    atomic_write(meta / ".info.yaml", dump({"shard_counts": counts}))
    tmp = meta / ".index.sqlite.tmp"
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    con.executescript(
        """
        CREATE TABLE samples (
            tar_file_id INTEGER NOT NULL,
            sample_key TEXT NOT NULL UNIQUE,
            sample_index INTEGER NOT NULL,
            byte_offset INTEGER,
            byte_size INTEGER
        );
        CREATE TABLE sample_parts (
            tar_file_id INTEGER,
            sample_index INTEGER,
            part_name TEXT,
            content_byte_offset INTEGER,
            content_byte_size INTEGER
        );
        """
    )
    for fid, shard in enumerate(shards):
        con.executemany(
            "INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) VALUES (?,?,?,?,?)",
            [(fid, r.key, i, r.offset, r.size) for i, r in enumerate(indexes[shard])],
        )
        con.executemany(
            "INSERT INTO sample_parts VALUES (?,?,?,?,?)",
            [(fid, i, p, o, n) for i, r in enumerate(indexes[shard]) for p, o, n in r.parts],
        )
    con.executescript(
        """
        CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index);
        CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset);
        CREATE INDEX idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name,
                                                          content_byte_offset, content_byte_size);
        """
    )
    con.commit()
    con.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, meta / "index.sqlite")
    digest = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(counts, sort_keys=True) + str(sum(
        r.offset + r.size for rs in indexes.values() for r in rs)))
    atomic_write(meta / "index.uuid", str(digest).encode())
