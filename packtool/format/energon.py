"""Writing Energon's metadata of a packed dataset: ``dataset.yaml``, ``split.yaml``, ``.info.json``/``.info.yaml``,
``index.sqlite`` and ``index.uuid``."""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packtool.commit import commit_bytes, commit_path
from packtool.format.metadata import SplitYaml, yaml_bytes
from packtool.format.names import META, SUBFLAVOR
from packtool.storage import location


@dataclass(frozen=True)
class IndexedRecord:
    """Where one record lies in its shard (what ``.tar.idx`` and ``index.sqlite`` hold)."""

    key: str
    #: Byte offset of the record's first member header.
    offset: int
    #: Bytes from that header to the end of the record's last member data, padded to a block.
    size: int
    #: (part name, content offset, content size) of each member.
    parts: tuple[tuple[str, int, int], ...]


def energon_dataset_yaml() -> dict:
    """What a packed dataset's ``dataset.yaml`` holds: a crude dataset with :data:`SUBFLAVOR` (the task encoders'
    cooker matches it: with another subflavor, Energon would hand them no pack)."""
    return {"__module__": "megatron.energon", "__class__": "CrudeWebdataset", "subflavors": dict(SUBFLAVOR)}


def write_energon_metadata(out: Path, splits: dict[str, list[str]],
                           indexes: Mapping[str, Sequence[IndexedRecord]], energon_version: str) -> None:
    """Write ``dataset.yaml``, ``split.yaml``, ``.info.json``/``.info.yaml``, ``index.sqlite`` and ``index.uuid``.

    ``splits`` maps split -> shard paths (relative to ``out``); ``indexes`` maps shard path -> its records. The
    uuid derives from the content, so reruns write the same bytes.
    """
    meta = location(out) / META
    shards = [s for split in splits for s in splits[split]]
    counts = {s: len(indexes[s]) for s in shards}
    commit_bytes(meta / "dataset.yaml", yaml_bytes(energon_dataset_yaml()))
    commit_bytes(meta / "split.yaml", SplitYaml({k: list(v) for k, v in splits.items()}).to_bytes())
    commit_bytes(meta / ".info.json",
                 json.dumps({"energon_version": energon_version, "shard_counts": counts}, indent=2).encode())
    commit_bytes(meta / ".info.yaml", yaml_bytes({"shard_counts": counts}))
    with commit_path(meta / "index.sqlite") as tmp:
        _write_sqlite_index(tmp, [indexes[s] for s in shards])
    digest = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(counts, sort_keys=True) + str(sum(
        r.offset + r.size for rs in indexes.values() for r in rs)))
    commit_bytes(meta / "index.uuid", str(digest).encode())


def _write_sqlite_index(path: Path, shards: list[Sequence[IndexedRecord]]) -> None:
    """Energon's ``index.sqlite`` schema (``samples``, ``sample_parts``; ``tar_file_id`` = shard position),
    written here rather than with Energon's ``SqliteIndexWriter``: importing Energon imports torch, 240 MB more in
    the packing process for a 20-line writer."""
    con = sqlite3.connect(path)
    try:
        con.executescript(
            """
            CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE,
                                  sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER);
            CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT,
                                       content_byte_offset INTEGER, content_byte_size INTEGER);
            """
        )
        for fid, records in enumerate(shards):
            con.executemany("INSERT INTO samples VALUES (?,?,?,?,?)",
                            [(fid, r.key, i, r.offset, r.size) for i, r in enumerate(records)])
            con.executemany("INSERT INTO sample_parts VALUES (?,?,?,?,?)",
                            [(fid, i, p, o, n) for i, r in enumerate(records) for p, o, n in r.parts])
        con.executescript(
            """
            CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index);
            CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset);
            CREATE INDEX idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name,
                                                              content_byte_offset, content_byte_size);
            """
        )
        con.commit()
    finally:
        con.close()
