"""Assemble pack records from encoded samples and write one output shard (one task per shard).

A record takes each segment's tokens and targets from the encode store and its media bytes from the source
shard, byte for byte, at the offsets the scan recorded; each source shard is checked against its stamp before
its bytes are read, and each video's bytes against the SHA-256 the encoder took of those it measured, so an edit
made after encoding fails the task instead of packing stale bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import pyarrow as pa

from packtool import __version__
from packtool.commit import naming
from packtool.errors import SourceError
from packtool.format import MediaRef, PackRecord, Segment, pack_key, sha256
from packtool.item import MediaItem, loads_media
from packtool.packer.sources.safepickle import load_bytes_list, video_frames
from packtool.packer.store import NpyReader, SourceStamp
from packtool.shards import ShardIndex, idx_path, index_tar, write_records, write_tar
from packtool.storage import RangedReader as _ObjectReader
from packtool.storage import is_remote, location, open_read, parquet_file


#: Columns of a write task's segment table (``pack`` first), sorted by pack, then source order.
class SegmentRow(NamedTuple):
    """One segment of a pack as the write stage reads it from the plan (one row of the segments table)."""

    pack: int
    #: The encode store (its position among the split's) and the row in it.
    src: int
    row: int
    key: str
    shard: str
    truncated: bool
    #: Where the segment's tokens start in its store's token array, and how many.
    tok_offset: int
    tokens: int
    #: The encoded media items (:func:`~packtool.item.loads_media`).
    media: str
    #: The sample's loss weight (its own, times its dataset's factor in a mixture).
    loss_weight: float
    #: A mixture's: the dataset's index among its names, and the sample's copy number (0 for one dataset).
    dataset: int = 0
    copy: int = 0


#: The segments table's columns, in :class:`SegmentRow` order.
SEGMENT_COLUMNS = ("pack", "src", "row", "key", "shard", "truncated", "tok_offset", "tokens", "media",
                   "loss_weight")
#: A mixture's segment columns besides those: the dataset's index and the sample's copy number.
MIXTURE_COLUMNS = ("dataset", "copy")
#: Estimated bytes of a record besides its token arrays and media: headers, json, padding.
_RECORD_OVERHEAD = 4096
_MEDIA_OVERHEAD = 1024
_SEGMENT_OVERHEAD = 512
#: Bytes per token in a record: int32 token + uint8 target.
_TOKEN_BYTES = 5
#: Media bytes of a batch of segments fetched ahead from an object store, at most.
PREFETCH_MEDIA_BYTES = 64 << 20


def estimate_pack_bytes(pack: np.ndarray, lengths: np.ndarray, media_bytes: np.ndarray, n_packs: int) -> np.ndarray:
    """Estimated tar bytes of each pack, from its segments' lengths and media sizes (``pack``: pack of each
    segment). Output shards are cut on this estimate."""
    est = np.full(n_packs, _RECORD_OVERHEAD, dtype=np.int64)
    np.add.at(est, pack, lengths * _TOKEN_BYTES + media_bytes + _SEGMENT_OVERHEAD)
    return est


def media_bytes_of(media_json: list[str]) -> np.ndarray:
    """Source bytes (plus per-member overhead) of each encoded row's media."""
    return np.asarray([sum(m.size + _MEDIA_OVERHEAD for m in loads_media(s)) for s in media_json], dtype=np.int64)


class _Sources:
    """Open source shards and encode stores of one write task, each checked once before use."""

    def __init__(self, root: Path, enc_dirs: list[str], stamps: dict[str, SourceStamp], files: dict | None = None):
        self.root, self.enc_dirs, self.stamps = root, enc_dirs, stamps
        #: Source shards that are chunks of a file source: their media are read from the user's files by record.
        self.chunks = files or {}
        self.arrays: dict[int, tuple[NpyReader, NpyReader]] = {}
        self.files: dict[str, BinaryIO] = {}
        self.remote = any(is_remote(d) for d in enc_dirs[:1]) or is_remote(root)
        #: Media bytes fetched ahead by :meth:`prefetch`, by (shard, offset, size).
        self.fetched: dict[tuple[str, int, int], bytes] = {}
        #: Media of table chunks' records (Parquet/Arrow cells) read ahead by :meth:`prefetch`, by (shard, record
        #: index in its chunk, member).
        self.cells: dict[tuple[str, int, str], bytes] = {}
        #: Whether :meth:`prefetch` has anything to do (an object store, or media in table cells).
        self.reads_ahead = self.remote or any(c.kind != "json" for c in self.chunks.values())

    def tokens(self, src: int) -> tuple[NpyReader, NpyReader]:
        if src not in self.arrays:
            d = location(self.enc_dirs[src])
            self.arrays[src] = (NpyReader(d / "tokens.npy"), NpyReader(d / "targets.npy"))
        return self.arrays[src]

    def prefetch(self, batch: pa.RecordBatch) -> None:
        """Fetch what a batch of segment rows needs from an object store with concurrent ranged requests: the
        token spans (few requests: see :meth:`NpyReader.prefetch`) and the media items' bytes, up to
        :data:`PREFETCH_MEDIA_BYTES` (the rest is read when used)."""
        self._prefetch_cells(batch)
        if not self.remote:
            return
        src, offset, length = (batch.column(c).to_numpy() for c in ("src", "tok_offset", "tokens"))
        for s in np.unique(src).tolist():
            mine = src == s
            spans = list(zip(offset[mine].tolist(), (offset[mine] + length[mine]).tolist()))
            for reader in self.tokens(s):
                reader.prefetch(spans)
        self.fetched.clear()
        wanted: dict[str, list[tuple[int, int]]] = {}
        total = 0
        for shard, media_json in zip(batch.column("shard").to_pylist(), batch.column("media").to_pylist()):
            if shard in self.chunks:
                continue  # a file source's media are read from local files
            for m in loads_media(media_json):
                reads = [(o, n) for _, o, n in m.frames[:1 if m.item is not None else None]] \
                    if m.frames else [(m.offset, m.size)]
                for o, n in reads:
                    if total + n <= PREFETCH_MEDIA_BYTES:
                        wanted.setdefault(shard, []).append((o, n))
                        total += n
        for shard, reads in wanted.items():
            f = self._open(shard)  # the stamp is checked before any byte is used
            path = getattr(f, "raw", None)
            if isinstance(path, _ObjectReader):
                for (o, n), data in zip(reads, path.path.read_ranges(reads)):
                    self.fetched[(shard, o, n)] = data

    def _prefetch_cells(self, batch: pa.RecordBatch) -> None:
        """Read the media a batch of segment rows needs from table chunks (Parquet/Arrow cells), each chunk in one
        pass, up to :data:`PREFETCH_MEDIA_BYTES` (the rest is read when used)."""
        self.cells.clear()
        wanted: dict[str, dict[int, set[str]]] = {}
        total = 0
        for shard, key, media_json in zip(*(batch.column(c).to_pylist() for c in ("shard", "key", "media"))):
            chunk = self.chunks.get(shard)
            if chunk is None or chunk.kind == "json" or media_json == "[]":
                continue
            for m in loads_media(media_json):
                size = sum(n for _, _, n in m.frames) if m.frames else m.size
                if total + size <= PREFETCH_MEDIA_BYTES:
                    wanted.setdefault(shard, {}).setdefault(int(key.split(":", 1)[0]) - chunk.first, set()).update(
                        {part for part, _, _ in m.frames} if m.frames else {m.part})
                    total += size
        for shard in sorted(wanted, key=lambda s: (self.chunks[s].path, self.chunks[s].first)):  # on through a file
            for i, members in self.chunks[shard].media_of(wanted[shard]).items():
                for member, data in members.items():
                    self.cells[(shard, i, member)] = data

    def media(self, shard: str, m: MediaItem, key: str = "") -> bytes:
        """The bytes of one media item (of a frame list: see :meth:`frames`) of sample ``key``."""
        data = self._read(shard, m.part, m.offset, m.size, key)
        return data if m.item is None else load_bytes_list(data)[m.item]

    def _read(self, shard: str, part: str, offset: int, size: int, key: str = "") -> bytes:
        """The bytes of one source member."""
        chunk = self.chunks.get(shard)
        if chunk is not None:  # read in place: the record's file (or cell), checked against its stamp
            index = int(key.split(":", 1)[0]) - chunk.first
            data = self.cells.get((shard, index, part))
            if data is None:
                data = chunk.media_bytes(index, part)
            data = data[offset:offset + size]
            if len(data) != size:
                raise SourceError(f"{shard}: media {part} of record {key} changed after it was encoded; run the "
                                  f"same command again to encode it anew")
            return data
        f = self._open(shard)
        data = self.fetched.get((shard, offset, size))
        if data is None:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise SourceError(f"{shard}: short read of member {part}")
        return data

    def frames(self, shard: str, m: MediaItem, key: str = "") -> list[bytes]:
        """The bytes of each frame of a video given as a list of images (members, or a video of a pickled list)."""
        if m.item is not None:
            _, offset, size = m.frames[0]
            return [frame for _, frame in video_frames(self._read(shard, m.part, offset, size, key), m.part,
                                                       m.item)]
        return [self._read(shard, part, offset, size, key) for part, offset, size in m.frames]

    def _open(self, shard: str) -> BinaryIO:
        if shard not in self.files:
            if SourceStamp.of(self.root, shard, self.stamps[shard].metadata) != self.stamps[shard]:
                raise SourceError(f"source shard {shard} changed after it was encoded; run the same command "
                                  f"again to encode it anew")
            self.files[shard] = open_read(self.root / shard)  # an object: one ranged read per item
        return self.files[shard]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for pair in self.arrays.values():
            for r in pair:
                r.close()


@dataclass(frozen=True)
class WriteTask:
    """One write task: the packs of an output shard (or of a part of one) from its rows of the split's plan."""

    #: The output shard's path (or the part file's).
    path: str
    split: str
    #: The source dataset's root, the split's encode stores in order, and the source shards' stamps.
    root: str
    enc_dirs: list[str]
    stamps: dict[str, SourceStamp]
    #: The Parquet file (in OUTPUT's work folder) of the packs' segments (:data:`SEGMENT_COLUMNS`), in pack
    #: order: a task is a few names, whatever its rows (the command's process keeps none of them).
    segments: str
    pack_size: int
    align: int
    #: The file source chunks its segments come from (:class:`~packtool.packer.sources.files.FileChunk`), by name.
    files: dict | None = None
    #: A mixture's dataset names: the segments then also hold :data:`MIXTURE_COLUMNS` (a dataset index, a copy).
    datasets: tuple[str, ...] = ()


def write_shard(task: WriteTask) -> ShardIndex:
    """Write the packs of one output shard. Returns the shard's record index; a shard already committed is
    indexed, not rewritten."""
    path = location(task.path)
    if path.exists() and idx_path(path).exists():
        return index_tar(path)
    sources = _Sources(location(task.root), task.enc_dirs, task.stamps, task.files)
    try:
        return write_tar(path, _records(task.split, _segments(task), sources, task.pack_size, task.align,
                                        task.datasets))
    finally:
        sources.close()


def write_part(task: WriteTask) -> ShardIndex:
    """Write some consecutive packs of an output shard as a part file (see :func:`~packtool.shards.join_tar`):
    how the packs of one shard are written by several workers. Returns the part's index."""
    Path(task.path).parent.mkdir(parents=True, exist_ok=True)
    sources = _Sources(Path(task.root), task.enc_dirs, task.stamps, task.files)
    try:
        with naming(task.path), open(task.path, "wb") as f:
            return write_records(f, _records(task.split, _segments(task), sources, task.pack_size, task.align,
                                             task.datasets))
    finally:
        sources.close()


#: Segment rows of a write task read (and turned into Python values) at once.
_ROWS_READ = 1024


def _segments(task: WriteTask) -> Iterator[pa.RecordBatch]:
    """The task's segment rows, a batch at a time: a shard's rows are never all in memory at once."""
    with parquet_file(location(task.segments)) as f:
        yield from f.iter_batches(batch_size=_ROWS_READ)


def _records(split: str, segments: Iterable[pa.RecordBatch], sources: _Sources, pack_size: int, align: int,
             datasets: tuple[str, ...] = ()) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """The tar members of each pack of ``segments`` (batches of segment rows, in pack order), in order."""
    columns = SEGMENT_COLUMNS + (MIXTURE_COLUMNS if datasets else ())

    def rows() -> Iterator[SegmentRow]:  # a batch of rows at a time as Python values
        for batch in segments:
            if sources.reads_ahead:
                sources.prefetch(batch)
            yield from itertools.starmap(SegmentRow, zip(*(batch.column(c).to_pylist() for c in columns)))

    for p, group in itertools.groupby(rows(), key=lambda row: row.pack):
        record = assemble_record(pack_key(split, p), split, list(group), sources, pack_size, align, datasets)
        yield record.key, record.to_members()


def media_ref(m: MediaItem, member: str, frames: list[str], size: int, digest: str) -> MediaRef:
    """The pack record's entry of an encoded item whose bytes are written as ``member`` (``frames``: each frame's
    member of a frame list), ``size`` bytes of SHA-256 ``digest``."""
    return MediaRef(member=member, kind=m.kind, token_offset=m.token_offset, tokens=m.tokens,
                    grid_thw=list(m.grid_thw), width=m.width, height=m.height, size=size, sha256=digest,
                    frames=frames, total_frames=m.total_frames, fps=m.fps, duration=m.duration,
                    frame_indices=list(m.frame_indices), second_per_grid_ts=m.second_per_grid_ts,
                    span=list(m.span or ()), samples=m.samples or 0)


def assemble_record(key: str, split: str, group: list[SegmentRow], sources: _Sources, pack_size: int,
                    align: int, datasets: tuple[str, ...] = ()) -> PackRecord:
    """One pack from its segment rows (in pack order; a mixture's ``datasets`` name their dataset indices)."""
    toks, tgts, seqlens, segs = [], [], [], []
    media: dict[str, bytes] = {}
    items = 0
    for row in group:
        src, sample_key, shard, truncated, tok_offset, length, media_json = (
            row.src, row.key, row.shard, row.truncated, row.tok_offset, row.tokens, row.media)
        dataset, copy = (datasets[row.dataset], int(row.copy)) if datasets else (None, 0)
        tok, tgt = sources.tokens(src)
        toks.append(np.asarray(tok[tok_offset: tok_offset + length]))
        tgts.append(np.asarray(tgt[tok_offset: tok_offset + length]))
        seqlens.append(length)
        refs = []
        for m in loads_media(media_json):
            items += 1
            if m.frames:  # a video given as images: one member per frame, in frame order
                frames = sources.frames(shard, m, sample_key)
                names = [f"m{items - 1}.{i}.{part.rsplit('.', 1)[-1].lower()}"
                         for i, (part, _, _) in enumerate(m.frames)]
                media.update(zip(names, frames))
                data, member = b"".join(frames), names[0]
            else:
                names, member = [], f"m{items - 1}.{m.ext}"
                data = media[member] = sources.media(shard, m, sample_key)
            digest = sha256(data)
            if m.sha256 and digest != m.sha256:  # a video's bytes as the encoder measured them
                raise SourceError(f"{shard}: the bytes of {m.kind} {m.part!r} of sample {sample_key} differ "
                                  f"from those encoded (sha256 {digest[:12]}, encoded {m.sha256[:12]}); run "
                                  f"the same command again to encode them anew")
            refs.append(media_ref(m, member, names, len(data), digest))
        segs.append(Segment(sample_key, split, shard, bool(truncated), refs, dataset, copy, float(row.loss_weight)))
    return PackRecord(key, np.concatenate(toks), np.concatenate(tgts), np.asarray(seqlens, dtype=np.int32),
                      pack_size, align, segs, media, __version__)
