"""What ``stats`` and ``failures`` check of an output before they report on its ledger: that every shard the
manifest names is there whole. No pack is read: each shard's ``.tar.idx`` (8 bytes a pack) gives the records it
holds and the tar's size (the end of its last record plus the two end blocks of a tar), held against the tar's
size on disk, its ``.info.json`` count and the manifest's pack count. What it cannot see (a changed byte inside a
record) is ``packtool verify``'s."""

from __future__ import annotations

from pathlib import Path

from packtool.errors import FormatError
from packtool.format import META, InfoJson, Manifest
from packtool.shards import BLOCK, idx_path, record_offsets
from packtool.storage import location


def shard_problems(output: str | Path) -> list[str]:
    """One line per shard of ``output`` (a packed folder, or its ledger file) that is missing or not the size its
    index records (none for a dry run, or a folder or ledger file without a manifest beside it)."""
    root = location(output)
    if not root.is_dir():
        root = root.parent
    if not (root / META).is_dir():
        return []
    try:
        manifest = Manifest.read(root)
    except FormatError as exc:
        return [str(exc)]
    if manifest.dry_run:
        return []
    try:
        counts = InfoJson.read(root).shard_counts
    except FormatError as exc:
        return [str(exc)]
    problems = []
    for split, shards in manifest.splits.items():
        records = 0
        for name in shards:
            path = root / name
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            if not idx_path(path).is_file():
                problems.append(f"{idx_path(path)}: missing")
                continue
            offsets = record_offsets(path)
            expect = int(offsets[-1]) + 2 * BLOCK if offsets.size else 0
            size = path.stat().st_size
            if size != expect:
                problems.append(f"{path}: {size} bytes, its index records {expect}")
            n = max(offsets.size - 1, 0)
            records += n
            if counts.get(name, n) != n:
                problems.append(f"{path}: {n} packs in its index, .info.json says {counts[name]}")
        if records != manifest.packs.get(split, records):
            problems.append(f"{split}: {records} packs in its shards, the manifest says {manifest.packs[split]}")
    return problems
