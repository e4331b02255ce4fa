"""Scan an Energon WebDataset: splits and excludes from ``.nv-meta``, samples with byte ranges, on-disk order."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import braceexpand
import yaml

from packtool.errors import SourceError


@dataclass
class RawSample:
    """One source sample exactly as stored: its parts' bytes and where they lie in the shard."""

    #: Sample key (member path up to the first dot of the basename).
    key: str
    #: Shard path relative to the dataset root, as named in ``split.yaml``.
    shard: str
    #: Position of the sample in its shard (0-based, on-disk order).
    index: int
    #: Part name (the member name after the key and its dot) -> bytes.
    parts: dict[str, bytes] = field(default_factory=dict)
    #: Part name -> (byte offset of the content in the shard, size).
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Why the sample is unusable before any adapter sees it (unsafe member name, duplicate key), or ``None``.
    problem: str | None = None


@dataclass
class SourceDataset:
    """What ``.nv-meta`` says about a dataset."""

    root: Path
    #: Split name -> shard paths (relative, on-disk order), whole-shard excludes removed.
    splits: dict[str, list[str]]
    #: ``"<shard>/<key>"`` entries of ``exclude``.
    excluded_samples: frozenset[str]
    #: Parsed ``dataset.yaml`` (may be empty).
    dataset_yaml: dict
    #: Shard path -> sample count from ``.info.json``/``.info.yaml`` (may be empty).
    shard_counts: dict[str, int]


def _load_yaml_or_json(path: Path) -> dict:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return data or {}


def open_source(root: str | Path, splits: list[str] | None = None) -> SourceDataset:
    """Read the dataset's metadata; ``splits`` restricts to those (each must exist)."""
    root = Path(root)
    meta = root / ".nv-meta"
    if not meta.is_dir():
        raise SourceError(f"{root} is not an Energon dataset: no .nv-meta folder")
    split_file = next((p for p in (meta / "split.yaml", meta / "split.json") if p.exists()), None)
    if split_file is None:
        raise SourceError(f"{meta} has no split.yaml")
    split_cfg = _load_yaml_or_json(split_file)
    parts = split_cfg.get("split_parts") or {}
    if not parts:
        raise SourceError(f"{split_file} defines no split_parts")
    excludes = {e for pattern in split_cfg.get("exclude") or [] for e in braceexpand.braceexpand(pattern)}
    chosen = list(parts) if not splits else splits
    unknown = [s for s in chosen if s not in parts]
    if unknown:
        raise SourceError(f"unknown split {unknown[0]!r}; {split_file.name} has {', '.join(parts)}")
    shards_by_split = {}
    for split in chosen:
        shards = [n for pattern in parts[split] or [] for n in braceexpand.braceexpand(pattern)]
        shards_by_split[split] = [s for s in shards if s not in excludes]
        missing = [s for s in shards_by_split[split] if not (root / s).is_file()]
        if missing:
            raise SourceError(f"split {split!r}: shard {missing[0]} does not exist under {root}")
    counts = {}
    for info in (meta / ".info.json", meta / ".info.yaml"):
        if info.exists():
            counts = dict(_load_yaml_or_json(info).get("shard_counts") or {})
            break
    dataset_yaml = _load_yaml_or_json(meta / "dataset.yaml") if (meta / "dataset.yaml").exists() else {}
    all_shards = {s for shards in shards_by_split.values() for s in shards}
    sample_excludes = frozenset(e for e in excludes if e not in all_shards and "/" in e)
    return SourceDataset(root, shards_by_split, sample_excludes, dataset_yaml, counts)


def _split_member(name: str) -> tuple[str, str]:
    """``dir/key.part.ext`` -> (``dir/key``, ``part.ext``), Energon's and WebDataset's rule."""
    head, _, base = name.rpartition("/")
    stem, dot, part = base.partition(".")
    return (f"{head}/{stem}" if head else stem), part


def _unsafe(name: str) -> bool:
    return name.startswith("/") or ".." in name.split("/") or "\\" in name or "\x00" in name


def _ends_cleanly(tar: tarfile.TarFile) -> bool:
    """Whether iteration stopped at the end-of-archive marker (a zero block). ``tarfile`` also stops silently at a
    truncated or garbled header, which would drop the rest of the shard and the rest of the current sample."""
    tar.fileobj.seek(tar.offset)
    return tar.fileobj.read(tarfile.BLOCKSIZE) == tarfile.NUL * tarfile.BLOCKSIZE


def read_raw_samples(root: Path, shard: str, excluded: frozenset[str] = frozenset()) -> Iterator[RawSample]:
    """Every sample of one shard in on-disk order, excluded keys skipped (they are not part of the dataset).

    Members are grouped by key while adjacent, as Energon does; a key seen again later is reported as a
    duplicate. Member names are never used as file paths; one with ``..`` or an absolute path marks its sample.
    Raises :class:`SourceError` if the tar itself cannot be read.
    """
    path = Path(root) / shard
    seen: set[str] = set()
    current: RawSample | None = None
    index = 0
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, part = _split_member(member.name)
                if current is None or key != current.key:
                    if current is not None and current.index >= 0:
                        yield current
                    if f"{shard}/{key}" in excluded:
                        current = RawSample(key=key, shard=shard, index=-1)  # consumed, never yielded
                    else:
                        current = RawSample(key=key, shard=shard, index=index)
                        index += 1
                        if key in seen:
                            current.problem = f"duplicate key {key!r} in {shard}"
                        seen.add(key)
                if current.index < 0:
                    continue
                if _unsafe(member.name):
                    current.problem = f"unsafe member name {member.name!r}"
                    continue
                if part in current.parts:
                    current.problem = f"part {part!r} appears twice"
                    continue
                fobj = tar.extractfile(member)
                current.parts[part] = fobj.read() if fobj is not None else b""
                current.ranges[part] = (member.offset_data, member.size)
            if not _ends_cleanly(tar):
                raise SourceError(f"cannot read shard {shard}: no end-of-archive marker at byte {tar.offset} "
                                  f"(truncated or corrupt; its last sample may be incomplete)")
            if current is not None and current.index >= 0:
                yield current
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise SourceError(f"cannot read shard {shard}: {exc}") from exc
