"""The encode stage's store: one folder per range of a source shard, under
``OUTPUT/.packtool/encode/<split>/<shard's store name>/<range number>`` (the name from the shard's own name,
:func:`~packtool.packer.output.store_name`, so adding, removing or reordering a mixture's entries keeps every
other entry's stores).

A shard is cut into ranges of consecutive samples (:class:`~packtool.packer.sources.energon.SampleRange`, from a walk
over its headers) so that tasks are even and a task's memory does not grow with its shard. ``encode_range`` (one
task per range) reads its samples, encodes them and commits the folder atomically: ``samples.parquet`` (one
:data:`ENCODED_SCHEMA` row per sample, on-disk order), ``tokens.npy`` and ``targets.npy`` (the kept samples'
tokens, concatenated), :data:`SOURCE_FACTS` (each sample before any cut) and ``source.json`` (what the source
shard looked like when it was read, and which of its samples the range holds). A rerun keeps a folder only
while its source shard still looks the same and the range is the same: an edited shard is encoded again, so a
resumed run never packs stale bytes.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packtool.commit import commit_path
from packtool.errors import LimitError, SourceError
from packtool.format import KEPT, STATUSES, npy_bytes
from packtool.item import dumps_media
from packtool.packer.sources.energon import RawSample, SampleRange, ShardLayout, ShardScan
from packtool.settings import EncodeSettings
from packtool.storage import ObjectPath, file_version, location, open_read, parquet_file, read_parquet

if TYPE_CHECKING:
    from packtool.packer.encoder import Encoded

#: Raw bytes of source samples held at once by an encode task (at most 256 samples, fewer if media are large).
CHUNK_BYTES = 64 * 2**20
CHUNK_SAMPLES = 256
#: Key of the ledger row that stands for the unreadable rest of a shard.
UNREADABLE = "#unreadable-after-"

#: Columns of an encoded source shard, one row per sample in on-disk order.
ENCODED_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("status", pa.string()), ("reason", pa.string()),
    ("tokens", pa.int32()), ("source_tokens", pa.int32()), ("targets", pa.int32()), ("images", pa.int32()),
    ("image_tokens", pa.int32()), ("truncated", pa.bool_()), ("tok_offset", pa.int64()), ("media", pa.string()),
    ("loss_weight", pa.float64()),
])


@dataclass(frozen=True)
class SourceStamp:
    """What a source shard looked like when it was read: any change of it (or of the dataset metadata that
    decided how it was read) makes its encoded folder stale."""

    shard: str
    size: int
    mtime_ns: int
    #: Changes with every write to the file, and cannot be set back by a user.
    ctime_ns: int
    #: SHA-256 of the dataset's ``.nv-meta`` files that decide how the shard is read.
    metadata: str
    #: The object's ETag when the source is in an object store (which has no ctime), else empty.
    etag: str = ""

    @classmethod
    def of(cls, root: Path, shard: str, metadata: str) -> SourceStamp:
        size, mtime_ns, ctime_ns, etag = file_version(location(root) / shard)
        return cls(shard, size, mtime_ns, ctime_ns, metadata, etag)


def range_stamp(stamp: SourceStamp, span: SampleRange) -> dict:
    """What a range's ``source.json`` records: the shard's stamp and which of its samples the range holds (so a
    store made with other range bounds, e.g. by another packtool version, is never taken for this range)."""
    return {**asdict(stamp), "range": [span.first, span.start, span.stop]}


def is_current(folder: Path, stamp: SourceStamp, span: SampleRange) -> bool:
    """Whether ``folder`` holds a committed encoding of this range of the shard as ``stamp`` describes it now,
    whole (:func:`is_whole`: a part deleted or damaged since makes the range be encoded again)."""
    try:
        if json.loads((location(folder) / "source.json").read_text()) != range_stamp(stamp, span):
            return False
    except (OSError, ValueError):
        return False
    return is_whole(folder)


def is_whole(folder: Path) -> bool:
    """Whether every part of a range's store is there and agrees with its ``samples.parquet``: the facts have as
    many rows, ``tokens.npy`` and ``targets.npy`` as many elements as the kept rows' tokens and exactly the bytes
    their headers promise."""
    folder = location(folder)
    try:
        # (a store of a packtool that read no loss weights lacks the column: encoded again)
        rows = read_parquet(folder / "samples.parquet", columns=["status", "tokens", "loss_weight"])
        if parquet_file(folder / SOURCE_FACTS).metadata.num_rows != rows.num_rows:
            return False
        kept = pc.is_in(rows.column("status"), value_set=pa.array(list(KEPT)))
        tokens = int(pc.sum(pc.if_else(kept, rows.column("tokens"), 0)).as_py() or 0)
        for name in ("tokens.npy", "targets.npy"):
            with open_read(folder / name, readahead=4096) as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                start = f.tell()
                size = f.seek(0, os.SEEK_END)
            if shape != (tokens,) or size != start + tokens * dtype.itemsize:
                return False
    except Exception:  # a part missing, cut short or not what it should be: any reader's error
        return False
    return True


#: A range's facts of every sample before any cut, row for row with ``samples.parquet`` (first target token,
#: whether the length is exact, media spans): what ``packtool stats`` judges other pack sizes by.
SOURCE_FACTS = "source_facts.parquet"

#: Samples per encode task, at most.
SAMPLES_PER_RANGE = 1024
#: Bytes of source shard per encode task, about (a range closes at the first sample past it): a shard of videos
#: is split into tasks of even work, whatever its sample count.
BYTES_PER_RANGE = 16 << 20
#: Samples of :data:`LARGE_SAMPLE_BYTES` or more (media, almost always) per encode task, at most: a small video costs
#: its decode check several times more per byte than a large one, so bytes alone would make one long task of a
#: shard of small videos. An encode task's own cost is a few milliseconds: ranges this size keep the tasks' work
#: even on any worker count, and the last task short.
LARGE_PER_RANGE = 64
LARGE_SAMPLE_BYTES = 64 << 10


def shard_ranges(layout: ShardLayout) -> list[SampleRange]:
    """The encode tasks' ranges of a shard (:meth:`ShardLayout.ranges` under this module's limits)."""
    return layout.ranges(SAMPLES_PER_RANGE, BYTES_PER_RANGE, max_large=LARGE_PER_RANGE,
                         large_bytes=LARGE_SAMPLE_BYTES)


@dataclass(frozen=True)
class FailureLimits:
    """When an encode task stops the run: only when its failures (error or dropped) are systematic (a setting, the
    model folder, the data's layout: a long streak, or one reason again and again) and already certain to fail
    the run's rate limit, i.e. this range alone holds more samples of one status than its limit allows of the
    whole run. A run within its limits never stops early; without a known ``total`` nothing stops early. 0 turns
    a rule off."""

    #: This many failed samples in a row.
    in_a_row: int = 100
    #: This many failed samples with the very same reason (a reason that names no property of one sample).
    same_reason: int = 20
    #: At least as many samples as the run has (an upper bound); None: unknown, the run never stops early.
    total: int | None = None
    #: Ledger status -> the largest fraction of the run's samples it may have (:meth:`RunOptions.limits`).
    rates: tuple[tuple[str, float], ...] = ()

    def certain(self, counts: Counter[str]) -> tuple[str, int, float] | None:
        """``(status, count, limit)`` of a status whose ``counts`` already exceed its limit of the whole run."""
        if self.total is None:
            return None
        for status, limit in self.rates:
            if counts[status] > limit * self.total:
                return status, counts[status], limit
        return None


class _FailureWatch:
    def __init__(self, limits: FailureLimits, shard: str):
        self.limits, self.shard = limits, shard
        self.streak: list[str] = []
        self.reasons: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        #: Why the failures are systematic, once they are (the first rule they met).
        self.systematic: str | None = None

    def see(self, encoded: list[Encoded]) -> None:
        for e in encoded:
            if e.status not in ("error", "dropped"):
                self.streak = []
                continue
            self.streak.append(e.key)
            reason = stable_reason(e.reason)
            self.reasons[reason] += 1
            self.statuses[e.status] += 1
            n, same = self.limits.in_a_row, self.limits.same_reason
            if self.systematic is None and n and len(self.streak) >= n:
                self.systematic = (f"{n} samples in a row of {self.shard} failed ({self.streak[0]} to {e.key}; the "
                                   f"last: {e.status}, {e.reason}); fix the cause or raise max_failures_in_a_row "
                                   f"(0: never stop)")
            if self.systematic is None and same and self.reasons[reason] >= same:
                self.systematic = (f"{same} samples of {self.shard} failed for the same reason (the last {e.key}: "
                                   f"{e.status}, {e.reason}); fix the cause or raise max_same_failures (0: never "
                                   f"stop)")
            over = self.limits.certain(self.statuses) if self.systematic is not None else None
            if over is not None:
                status, count, limit = over
                raise LimitError(f"stopped early: {self.systematic}; {count} {status} already exceed max_"
                                 f"{_RATE_NAME[status]}_rate {limit:.2%} of the run's {self.limits.total} samples "
                                 f"at most")


_RATE_NAME = {"error": "error", "dropped": "drop", "truncated": "truncate"}


@dataclass(frozen=True)
class EncodeTask:
    """One encode task: a range of one source shard, encoded into its store."""

    #: The source dataset's root, and the shard's layout (its members' offsets) from the scan.
    root: str
    layout: ShardLayout
    #: The range of the shard's samples to encode.
    span: SampleRange
    #: Samples the dataset excludes (``shard/key``).
    excluded: frozenset
    settings: EncodeSettings
    dataset_yaml: dict
    #: The shard's sample count from the dataset's ``.info.json`` (None if unknown): when the last range finds
    #: fewer samples in the shard (a second tar appended after an end-of-archive marker, a lost tail), it adds an
    #: error row saying so, so no sample is lost without a ledger row.
    expected: int | None
    #: The source shard's stamp the store is recorded with (a store with another is stale).
    stamp: SourceStamp
    #: Stop at an unreadable source instead of recording it.
    strict: bool
    #: The range's store.
    out_dir: str
    #: When the samples fail systematically enough to stop the run.
    limits: FailureLimits = FailureLimits()
    #: The shard is a chunk of a file source (:class:`~packtool.packer.sources.files.FileChunk`), read in place.
    files: Any = None


def encode_range(task: EncodeTask) -> dict[str, int]:
    """Encode the samples of one range of a shard into its store (see the module doc and :class:`EncodeTask`);
    returns status counts. Raises :class:`LimitError` as soon as the samples fail systematically
    (``task.limits``); a stopped range commits nothing."""
    root, layout, span, excluded, settings = task.root, task.layout, task.span, task.excluded, task.settings
    dataset_yaml, expected, stamp, strict, limits = (task.dataset_yaml, task.expected, task.stamp, task.strict,
                                                     task.limits)
    out = location(task.out_dir)
    if is_current(out, stamp, span):
        return status_counts(read_parquet(out / "samples.parquet", columns=["status"]))
    from packtool.packer.encoder import get_encoder  # here, in the worker: the parent never loads the encoder

    encoder = get_encoder(settings, dataset_yaml)
    encoded: list[Encoded] = []
    chunk: list = []
    chunk_bytes, unreadable = 0, None
    shard = layout.shard
    scan: ShardScan | ChunkScan = ShardScan(location(root), shard, excluded, max_sample_bytes=settings.max_sample_bytes,
                                            span=span, layout=layout) if task.files is None else \
        ChunkScan(task.files, span, settings.max_sample_bytes)
    samples = iter(scan)
    watch = _FailureWatch(limits, shard)
    while True:
        try:
            raw = next(samples)
        except StopIteration:
            break
        except SourceError as exc:
            if strict:
                raise
            unreadable = str(exc)
            break
        chunk.append(raw)
        chunk_bytes += sum(len(v) for v in raw.parts.values())
        if len(chunk) >= CHUNK_SAMPLES or chunk_bytes >= CHUNK_BYTES:  # raw bytes held stay bounded
            encoded += encoder.encode_many(chunk, strict=strict)
            watch.see(encoded[len(encoded) - len(chunk):])
            chunk, chunk_bytes = [], 0
    encoded += encoder.encode_many(chunk, strict=strict)
    watch.see(encoded[len(encoded) - len(chunk):])
    rows, offset = [], 0
    for e in encoded:
        rows.append(_row(e, offset))
        offset += len(e.tokens) if e.status in KEPT else 0
    lost = f"{UNREADABLE}{span.kept_before + len(encoded)}"
    if unreadable is not None:
        rows.append(_error_row(lost, shard, unreadable))
    elif span.last and expected is not None and span.first + scan.seen < expected:
        rows.append(_error_row(lost, shard, f"the dataset's .info.json counts {expected} samples in {shard}, the "
                                            f"tar holds {span.first + scan.seen}"))
    kept = [e for e in encoded if e.status in KEPT]
    tokens = np.concatenate([e.tokens for e in kept]).astype(np.int32) if kept else np.zeros(0, np.int32)
    targets = np.concatenate([e.targets for e in kept]).astype(np.uint8) if kept else np.zeros(0, np.uint8)
    table = pa.Table.from_pylist(rows, schema=ENCODED_SCHEMA)
    facts = pa.table({"first_target": pa.array([e.first_target for e in encoded] + [-1] * (len(rows) - len(encoded)),
                                               pa.int32()),
                      "length_known": pa.array([e.length_known for e in encoded] + [False] * (len(rows) -
                                                                                             len(encoded))),
                      "source_media": pa.array([json.dumps(e.source_media, separators=(",", ":")) for e in encoded]
                                               + ["[]"] * (len(rows) - len(encoded)))})
    with commit_path(out) as tmp:
        tmp.mkdir()
        pq.write_table(facts, tmp / SOURCE_FACTS)
        (tmp / "tokens.npy").write_bytes(npy_bytes(tokens))
        (tmp / "targets.npy").write_bytes(npy_bytes(targets))
        pq.write_table(table, tmp / "samples.parquet")
        (tmp / "source.json").write_text(json.dumps(range_stamp(stamp, span)))
    return status_counts(table)


class ChunkScan:
    """The samples of one range of a file source's chunk (what :class:`ShardScan` is for a shard)."""

    def __init__(self, chunk: Any, span: SampleRange | None = None, max_sample_bytes: int | None = None):
        self.chunk, self.max_sample_bytes = chunk, max_sample_bytes
        self.first = span.first if span is not None else 0
        self.stop = span.stop if span is not None else None
        self.seen = 0

    def __iter__(self) -> Iterator[RawSample]:
        for raw in self.chunk.samples(self.first, self.stop, max_sample_bytes=self.max_sample_bytes):
            self.seen += 1
            yield raw


#: The address in an object's default repr (``<_io.BytesIO object at 0x7f…>``), which a library's error text may
#: carry (PIL's does): it differs from run to run.
_ADDRESS = re.compile(r"(<[^<>]*?) at 0x[0-9a-fA-F]+>")


def stable_reason(reason: str) -> str:
    """A ledger reason without what differs between identical runs (object addresses)."""
    return _ADDRESS.sub(r"\1>", reason)


def _row(e: Encoded, offset: int) -> dict:
    keep = e.status in KEPT
    return {"key": e.key, "shard": e.shard, "status": e.status, "reason": stable_reason(e.reason),
            "tokens": len(e.tokens) if keep else 0, "source_tokens": e.source_tokens,
            "targets": int(np.count_nonzero(e.targets)) if keep else 0, "images": len(e.media) if keep else 0,
            "image_tokens": sum(m.tokens for m in e.media) if keep else 0,
            "truncated": e.status == "truncated", "tok_offset": offset if keep else -1,
            "media": dumps_media(e.media) if keep else "[]", "loss_weight": e.loss_weight}


def _error_row(key: str, shard: str, reason: str) -> dict:
    return {"key": key, "shard": shard, "status": "error", "reason": stable_reason(reason), "tokens": 0,
            "source_tokens": 0, "targets": 0, "images": 0, "image_tokens": 0, "truncated": False, "tok_offset": -1,
            "media": "[]", "loss_weight": 1.0}


def status_counts(table: pa.Table) -> dict[str, int]:
    statuses = table.column("status").to_pylist()
    return {s: statuses.count(s) for s in STATUSES}


class NpyReader:
    """Slices of a 1-D ``.npy`` file (or object) by positioned (ranged) reads: unlike a memory map, what was read
    does not stay in the process's resident memory."""

    def __init__(self, path: Path):
        self.path = location(path)
        with open_read(self.path, readahead=4096) as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            _, _, self.dtype = read_header(f)
            self.start = f.tell()
        # A local file is read by positioned reads of a bare descriptor: a write task holds one per encode store
        # of its split (every store, since the plan mixes them), so a file object's buffer would cost 8 KiB each.
        self.fd = -1 if isinstance(self.path, ObjectPath) else os.open(self.path, os.O_RDONLY)
        #: Blocks of an object fetched by :meth:`prefetch`: their byte offsets, and their bytes.
        self.block_starts: list[int] = []
        self.blocks: list[bytes] = []

    def prefetch(self, spans: list[tuple[int, int]], gap: int = 1 << 16) -> None:
        """For an object: fetch the bytes of these element spans ``(start, stop)`` at once, spans less than
        ``gap`` bytes apart by one ranged request; slices inside them are then served from memory (until the
        next prefetch). A local file is read where it lies."""
        if not isinstance(self.path, ObjectPath):
            return
        size, merged = self.dtype.itemsize, []
        for a, b in sorted(spans):
            lo, hi = self.start + a * size, self.start + b * size
            if merged and lo - merged[-1][1] <= gap:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.block_starts = [lo for lo, _ in merged]
        self.blocks = self.path.read_ranges([(lo, hi - lo) for lo, hi in merged])

    def __getitem__(self, s: slice) -> np.ndarray:
        size = self.dtype.itemsize
        n, at = (s.stop - s.start) * size, self.start + s.start * size
        if not isinstance(self.path, ObjectPath):
            return np.frombuffer(os.pread(self.fd, n, at), self.dtype)
        k = bisect.bisect_right(self.block_starts, at) - 1
        if k >= 0 and at + n <= self.block_starts[k] + len(self.blocks[k]):
            offset = at - self.block_starts[k]
            return np.frombuffer(self.blocks[k][offset:offset + n], self.dtype)
        return np.frombuffer(self.path.read_range(at, n), self.dtype)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
