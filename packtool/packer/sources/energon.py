"""Scan an Energon WebDataset: splits and excludes from ``.nv-meta``, samples with byte ranges, on-disk order."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import braceexpand

from packtool.errors import FormatError, SourceError
from packtool.format import META, InfoJson, SplitYaml, read_mapping, safe_relative, split_member
from packtool.packer.sources.mixture import Mixture, is_mixture, open_mixture
from packtool.storage import is_remote, location, open_read


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
    #: Digest of the metadata files (part of every shard's source stamp).
    metadata: str = ""
    #: A metadataset's datasets (:mod:`packtool.packer.sources.mixture`), or None: one dataset.
    mixture: Mixture | None = None
    #: With a mixture: each shard's dataset name, and each dataset's ``dataset.yaml`` and metadata digest.
    dataset_of: dict[str, str] = field(default_factory=dict)
    parts: dict[str, tuple[dict, str]] = field(default_factory=dict)
    #: Source shards that are chunks of a file source (:class:`~packtool.packer.sources.files.FileChunk`), by
    #: name: a file source's every shard, some of a mixture's.
    chunks: dict[str, Any] = field(default_factory=dict)

    def yaml_of(self, shard: str) -> dict:
        """The parsed ``dataset.yaml`` that says how ``shard``'s samples are read."""
        return self.parts[self.dataset_of[shard]][0] if self.dataset_of else self.dataset_yaml

    def metadata_of(self, shard: str) -> str:
        """The metadata digest in ``shard``'s source stamp (its own dataset's, in a mixture)."""
        return self.parts[self.dataset_of[shard]][1] if self.dataset_of else self.metadata


def read_dataset_yaml(root: str | Path) -> dict:
    """The dataset's parsed ``dataset.yaml`` ({} when it has none)."""
    path = location(root) / META / "dataset.yaml"
    return read_mapping(path, "dataset file") if path.exists() else {}


def open_source(root: str | Path, splits: list[str] | None = None) -> SourceDataset:
    """Read the dataset's metadata; ``splits`` restricts to those (each must exist). Every shard path must stay
    inside ``root`` and exist (``root`` may be an object-store location, see :mod:`packtool.storage`)."""
    if not is_remote(root) and is_mixture(root):
        return open_mixture(root, splits)
    root = location(root)
    meta = root / META
    if not root.is_dir():
        raise SourceError(f"source {root} " + ("is not a folder" if root.exists() else "does not exist"))
    if not meta.is_dir():
        raise SourceError(f"{root} is not an Energon dataset: no {META} folder; prepare it with `energon prepare "
                          f"{root}` (choose \"Crude sample\" when asked: packtool reads crude datasets)")
    try:
        split_cfg = SplitYaml.read(root)
        dataset_yaml = read_dataset_yaml(root)
        info = InfoJson.read(root) if any((meta / n).exists() for n in (".info.json", ".info.yaml")) else None
    except FormatError as exc:
        raise SourceError(str(exc)) from None
    if not split_cfg.split_parts:
        raise SourceError(f"{meta / 'split.yaml'} defines no split_parts")
    excludes = {e for pattern in split_cfg.exclude for e in _expand(pattern)}
    chosen = list(split_cfg.split_parts) if not splits else splits
    unknown = [s for s in chosen if s not in split_cfg.split_parts]
    if unknown:
        raise SourceError(f"unknown split {unknown[0]!r}; split.yaml has {', '.join(split_cfg.split_parts)}")
    shards_by_split = {}
    owner: dict[str, str] = {}  # shard -> the split that lists it (every split: a shard in two leaks across them)
    for split in split_cfg.split_parts:
        for shard in (n for pattern in split_cfg.split_parts[split] for n in _expand(pattern)):
            if shard in excludes:
                continue
            if shard in owner:
                where = "twice" if owner[shard] == split else f"in splits {owner[shard]!r} and {split!r}"
                raise SourceError(f"split.yaml lists shard {shard} {where}: its samples would be packed twice"
                                  + ("" if owner[shard] == split else " and leak across the splits"))
            owner[shard] = split
    inside = root.resolve()
    for split in chosen:
        shards = [n for pattern in split_cfg.split_parts[split] for n in _expand(pattern)]
        bad = [s for s in shards if not safe_relative(s)]
        if bad:
            raise SourceError(f"split {split!r}: shard path {bad[0]!r} leaves the dataset folder")
        shards_by_split[split] = [s for s in shards if s not in excludes]
        missing = [s for s in shards_by_split[split] if not (root / s).is_file()]
        if missing:
            raise SourceError(f"split {split!r}: shard {missing[0]} does not exist under {root}")
        outside = [s for s in shards_by_split[split] if inside not in (root / s).resolve().parents]
        if outside:
            raise SourceError(f"split {split!r}: shard {outside[0]} is a link to {(root / outside[0]).resolve()}, "
                              f"outside the dataset folder {inside}")
    all_shards = {s for shards in shards_by_split.values() for s in shards}
    sample_excludes = frozenset(e for e in excludes if e not in all_shards and "/" in e)
    counts = info.shard_counts if info is not None else {}
    return SourceDataset(root, shards_by_split, sample_excludes, dataset_yaml, counts, metadata_digest(root))


def _expand(pattern: str) -> list[str]:
    try:
        return list(braceexpand.braceexpand(pattern))
    except Exception as exc:  # braceexpand raises its own error type for unbalanced braces
        raise SourceError(f"split.yaml: bad shard pattern {pattern!r} ({exc})") from None


def metadata_digest(root: Path) -> str:
    """SHA-256 of the ``.nv-meta`` files that decide how shards are read (split, dataset and info files)."""
    h = hashlib.sha256()
    for name in ("split.yaml", "split.json", "dataset.yaml", ".info.json", ".info.yaml"):
        path = location(root) / META / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _unsafe(name: str) -> bool:
    return name.startswith("/") or ".." in name.split("/") or "\\" in name or "\x00" in name


@dataclass(frozen=True)
class ShardLayout:
    """Where each sample of a shard starts, from a walk over its member headers (no data is read): what lets
    one shard be encoded as several independent ranges."""

    shard: str
    #: Byte offset of each sample's first member header, in on-disk order (excluded samples too); a file
    #: source's chunk, whose records are counted, not walked: ``range(count)``.
    starts: Sequence[int]
    #: Positions of samples whose key appeared earlier in the shard.
    duplicates: frozenset[int]
    #: Positions of samples left out by ``split.yaml``'s ``exclude``.
    excluded: frozenset[int]

    def ranges(self, per_range: int, max_bytes: int | None = None, *, max_large: int | None = None,
               large_bytes: int = 64 << 10) -> list[SampleRange]:
        """Consecutive ranges covering the shard, of even work and within every limit: at most ``per_range``
        samples, at most ``max_large`` samples of ``large_bytes`` or more (media: a small video costs a decoder
        far more per byte than a large one), and closed at the first sample that starts ``max_bytes`` or more past
        the range's own start (a single larger sample is a range of its own). Each sample weighs its largest
        share of a limit; the shard is cut into as few ranges as those weights allow, at even weight, so no range
        is a small leftover that a worker ends the run on. At least one range; the last reads to the end of the
        file, so a tail the header walk could not read is still reported."""
        n = len(self.starts)
        # a sample's size is the distance to the next one's start (the last one's is unknown: the mean)
        sizes = [b - a for a, b in zip(self.starts, self.starts[1:])]
        sizes += [round(sum(sizes) / len(sizes)) if sizes else 0] * min(n, 1)
        weights = [max(1 / per_range, size / max_bytes if max_bytes else 0.0,
                       1 / max_large if max_large and size >= large_bytes else 0.0) for size in sizes]
        prefix = [0.0, *itertools.accumulate(weights)]
        fewest = max(1, math.ceil(prefix[-1] - 1e-9))
        for count in range(fewest, fewest + 4):  # the fewest even cuts that keep every limit
            bounds = [0]
            for j in range(1, count):  # cut where the running weight is nearest j / count of the whole
                target = prefix[-1] * j / count
                i = bisect.bisect_left(prefix, target)
                i = i - 1 if i > 0 and target - prefix[i - 1] < prefix[min(i, n)] - target else i
                if bounds[-1] < i < n:
                    bounds.append(i)
            within = [self._within(a, stop, sizes, per_range, max_bytes, max_large, large_bytes)
                      for a, stop in zip(bounds, [*bounds[1:], n])]
            if all(len(part) == 1 for part in within):
                break
        bounds = [b for part in within for b in part]  # else cut further where a limit is broken
        out = []
        for k, first in enumerate(bounds):
            last = k == len(bounds) - 1
            stop = None if last else self.starts[bounds[k + 1]]
            kept_before = first - sum(1 for e in self.excluded if e < first)
            out.append(SampleRange(first, self.starts[first] if n else 0, stop, kept_before, last))
        return out

    def _within(self, first: int, stop: int, sizes: list[int], per_range: int, max_bytes: int | None,
                max_large: int | None, large_bytes: int) -> list[int]:
        """The starts of the samples ``[first, stop)`` cut further wherever they break a limit (a cut at even
        weight can overshoot one by a sample)."""
        out, large = [first], 0
        for i in range(first, stop):
            is_large = max_large is not None and sizes[i] >= large_bytes
            a = out[-1]
            if i > a and (i - a >= per_range or (max_bytes is not None and self.starts[i] - self.starts[a] >= max_bytes)
                          or (is_large and large >= (max_large or 0))):
                out.append(i)
                large = 0
            large += is_large
        return out


@dataclass(frozen=True)
class SampleRange:
    """A run of consecutive samples of one shard."""

    #: Position of its first sample in the shard.
    first: int
    #: Byte offset of that sample's first header.
    start: int
    #: Byte offset where the next range begins (None: to the end of the file).
    stop: int | None
    #: Samples before it that are not excluded.
    kept_before: int
    #: Whether it ends the shard (the end-of-archive checks apply).
    last: bool


@dataclass(frozen=True)
class ScanTask:
    """The scan task of one source shard: its header walk (:func:`shard_layout`)."""

    root: Path
    shard: str
    excluded: frozenset[str] = frozenset()


def scan_layout(task: ScanTask) -> ShardLayout:
    """:func:`shard_layout` of a scan task."""
    return shard_layout(task.root, task.shard, task.excluded)


def shard_layout(root: Path, shard: str, excluded: frozenset[str] = frozenset()) -> ShardLayout:
    """Walk the member headers of ``shard``. A header that cannot be read ends the walk (the range reading to
    the end of the file then reports it)."""
    path = location(root) / shard
    try:
        members = _plain_members(path)
    except _Unusual:
        members = _tar_members(path)
    starts: list[int] = []
    seen: set[str] = set()
    duplicates, skipped = set(), set()
    current = None
    for name, offset in members:
        key, _ = split_member(name)
        if key != current:
            current = key
            if key in seen:
                duplicates.add(len(starts))
            if f"{shard}/{key}" in excluded:
                skipped.add(len(starts))
            seen.add(key)
            starts.append(offset)
    return ShardLayout(shard, tuple(starts), frozenset(duplicates), frozenset(skipped))


def _tar_members(path: Path) -> list[tuple[str, int]]:
    """``(name, header offset)`` of every member but folders, as ``tarfile`` reads them (up to the first header
    it cannot read)."""
    members: list[tuple[str, int]] = []
    try:
        with open_read(path, readahead=_HEADER_READAHEAD) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            members.extend((m.name, m.offset) for m in tar if not m.isdir())
    except (tarfile.TarError, OSError, EOFError):
        pass
    return members


class _Unusual(Exception):
    """A header :func:`_plain_members` leaves to ``tarfile`` (extended headers, links, odd fields)."""


#: A numeric header field ``tarfile`` reads as octal: digits between spaces, up to the first NUL.
_OCTAL = re.compile(rb"[ ]*[0-7]*[ ]*(?:\x00[\s\S]*)?")
#: Numeric fields of a USTAR header besides the checksum (mode, uid, gid, size, mtime, devmajor, devminor).
_NUMERIC = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))
_ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)


def _plain_members(path: Path) -> list[tuple[str, int]]:
    """What :func:`_tar_members` returns, read straight from the 512-byte headers (three times faster, and the
    walk runs before any encoding starts). Covers shards of plain files and folders only: any other header,
    and any header ``tarfile`` might read otherwise, raises :class:`_Unusual`."""
    members: list[tuple[str, int]] = []
    try:
        pread = _pread(path)
    except OSError:
        return members
    try:
        offset = 0
        while True:
            head = pread(tarfile.BLOCKSIZE, offset)
            if len(head) < tarfile.BLOCKSIZE or head == _ZERO_BLOCK:
                return members  # the end, or a header tarfile cannot read either: the walk ends
            if any(_OCTAL.fullmatch(head, a, b) is None for a, b in _NUMERIC):
                raise _Unusual
            checksum = head[148:156]
            if _OCTAL.fullmatch(checksum) is None or _octal(checksum) != 256 + sum(head) - sum(checksum):
                raise _Unusual  # corrupt (or a signed-checksum header): tarfile decides
            kind = head[156:157]
            name = _text(head[:100])
            if kind == tarfile.DIRTYPE or (kind == tarfile.AREGTYPE and name.endswith("/")):
                offset += tarfile.BLOCKSIZE
                continue
            if kind not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise _Unusual
            prefix = _text(head[345:500])
            members.append((f"{prefix}/{name}" if prefix else name, offset))
            offset += tarfile.BLOCKSIZE + -(-_octal(head[124:136]) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    except OSError:
        return members
    finally:
        pread(-1, 0)


#: Bytes read at once from an object while walking a shard's headers (small members' headers come together).
_HEADER_READAHEAD = 64 << 10
#: Bytes read at once from an object while reading a range of a shard front to back.
_SCAN_READAHEAD = 1 << 20


def _pread(path: Any) -> Callable[[int, int], bytes]:
    """``pread(size, offset)`` of a local file or an object (ranged reads with read-ahead); ``pread(-1, 0)``
    closes it."""
    if not is_remote(path):
        fd = os.open(path, os.O_RDONLY)

        def pread(size: int, offset: int) -> bytes:
            if size < 0:
                os.close(fd)
                return b""
            return os.pread(fd, size, offset)
        return pread
    f = open_read(path, readahead=_HEADER_READAHEAD)

    def read(size: int, offset: int) -> bytes:
        if size < 0:
            f.close()
            return b""
        f.seek(offset)
        return f.read(size)
    return read


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")


class ShardScan:
    """The samples of one shard (or of one :class:`SampleRange` of it) in on-disk order, excluded keys skipped
    (they are not part of the dataset).

    Members are grouped by key while adjacent, as Energon does; a key seen again later is marked as a duplicate
    (across the whole shard when a ``layout`` is given). Member names are never used as file paths; one with
    ``..`` or an absolute path marks its sample. A sample whose members hold more than ``max_sample_bytes`` is
    marked and its bytes are not kept. Links and other non-file members mark their sample too (their content
    cannot be packed). Iterating raises :class:`SourceError` if the tar itself cannot be read, including data
    after its end-of-archive marker. ``seen`` counts the samples met so far, excluded ones included (what
    ``.info.json`` counts).
    """

    def __init__(self, root: Path, shard: str, excluded: frozenset[str] = frozenset(), *,
                 max_sample_bytes: int | None = None, span: SampleRange | None = None,
                 layout: ShardLayout | None = None):
        self.root, self.shard, self.excluded = location(root), shard, excluded
        self.max_sample_bytes = max_sample_bytes
        self.span = span or SampleRange(0, 0, None, 0, True)
        self.duplicates = layout.duplicates if layout is not None else None
        self.seen = 0

    def __iter__(self) -> Iterator[RawSample]:
        shard, span = self.shard, self.span
        keys: set[str] = set()
        current: RawSample | None = None
        try:
            with open_read(self.root / shard, readahead=_SCAN_READAHEAD) as f:
                f.seek(span.start)
                with tarfile.open(fileobj=f, mode="r:") as tar:
                    for member in tar:
                        if member.isdir():
                            continue
                        key, part = split_member(member.name)
                        if current is None or key != current.key:
                            if span.stop is not None and member.offset >= span.stop:
                                break
                            if current is not None and current.index >= 0:
                                yield current
                            current = self._start(key, keys)
                        if current.index < 0 or current.problem:
                            continue
                        current.problem = self._member_problem(member, part, current)
                        if current.problem:
                            current.parts.clear()
                            continue
                        fobj = tar.extractfile(member)
                        current.parts[part] = fobj.read() if fobj is not None else b""
                        current.ranges[part] = (member.offset_data, member.size)
                    else:
                        if span.last:
                            _check_end_marker(tar, shard)
                    if current is not None and current.index >= 0:
                        yield current  # whole: the range ended, or its tar ended cleanly
                    if span.last:
                        _check_after_end(tar, shard)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise SourceError(f"cannot read shard {shard}: {exc}") from exc

    def _start(self, key: str, keys: set[str]) -> RawSample:
        """The sample that begins with ``key`` (index -1: excluded, consumed but never yielded)."""
        position = self.span.first + self.seen
        self.seen += 1
        if f"{self.shard}/{key}" in self.excluded:
            return RawSample(key=key, shard=self.shard, index=-1)
        sample = RawSample(key=key, shard=self.shard, index=position)
        duplicate = position in self.duplicates if self.duplicates is not None else key in keys
        if duplicate:
            sample.problem = f"duplicate key {key!r} in {self.shard}"
        keys.add(key)
        return sample

    def _member_problem(self, member: tarfile.TarInfo, part: str, current: RawSample) -> str | None:
        if _unsafe(member.name):
            return f"unsafe member name {member.name!r}"
        if not member.isfile():
            kind = "link" if member.issym() or member.islnk() else "non-file member"
            return f"member {part!r} is a {kind}; only regular files can be packed"
        if part in current.parts:
            return f"part {part!r} appears twice"
        held = sum(len(v) for v in current.parts.values()) + member.size
        if self.max_sample_bytes is not None and held > self.max_sample_bytes:
            return f"sample holds more than {self.max_sample_bytes} bytes (member {part!r}: {member.size} bytes)"
        return None


def _check_end_marker(tar: tarfile.TarFile, shard: str) -> None:
    """Iteration must have stopped at the end-of-archive marker: ``tarfile`` also stops silently at a truncated
    or garbled header (the rest of the shard would be lost, and the sample before it may miss members)."""
    f = tar.fileobj
    f.seek(tar.offset)
    if f.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
        raise SourceError(f"cannot read shard {shard}: no end-of-archive marker at byte {tar.offset} "
                          f"(truncated or corrupt; its last sample may be incomplete)")


def _check_after_end(tar: tarfile.TarFile, shard: str) -> None:
    """Nothing but zeros may follow the end-of-archive marker (the second of two concatenated tars would be
    lost)."""
    f = tar.fileobj
    f.seek(tar.offset + tarfile.BLOCKSIZE)
    while block := f.read(1 << 16):
        if block.strip(b"\0"):
            raise SourceError(f"cannot read shard {shard}: data after the end-of-archive marker at byte "
                              f"{tar.offset} (concatenated tars?) is not read")


def read_raw_samples(root: Path, shard: str, excluded: frozenset[str] = frozenset(), *,
                     max_sample_bytes: int | None = None) -> Iterator[RawSample]:
    """The samples of one shard (see :class:`ShardScan`)."""
    return iter(ShardScan(root, shard, excluded, max_sample_bytes=max_sample_bytes))
