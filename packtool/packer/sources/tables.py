"""Parquet and Arrow files: the record batches that hold a range of rows, read on rather than again.

Parquet has no random access inside a row group, so each process keeps a few open row-group streams and serves a
range from where its last one stopped (a worker's chunks come in order); an Arrow file (``save_to_disk`` writes
IPC streams; IPC files are read too) is memory-mapped. A batch of a single row is served from a small cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Literal

#: The table files a file source reads.
TableKind = Literal["arrow", "parquet"]

#: Decoded table batches kept for the media of later rows (a pack's rows come in any order), bytes at most.
_CACHE_BYTES = 64 << 20
_cache: dict[tuple[str, int], Any] = {}


def table_batches(path: Path, kind: TableKind, lo: int, hi: int, size: int = 16) -> Iterator[tuple[int, Any]]:
    """``(first row number, batch)`` of batches of a table file that hold rows ``lo`` to ``hi``: a Parquet
    file's row groups that hold them (streamed from the group's start: Parquet has no random access inside a
    group), an Arrow file's batches (memory-mapped). A batch of a single row is served from a small cache."""
    import pyarrow.parquet as pq

    st = os.stat(path)
    version = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"  # a rewritten file is never served stale
    if hi - lo == 1:
        for (p, start), batch in list(_cache.items()):
            if p == version and start <= lo < start + batch.num_rows:
                yield start, batch
                return
    if kind == "parquet":
        pf = pq.ParquetFile(path)
        meta = pf.metadata
        start = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if start < hi and lo < start + n:
                stream = _stream(version, g, lo, size, partial(_open_group, path, g, start, size))
                for offset, batch in stream.serve(lo, hi):
                    _remember(version, offset, batch, hi - lo == 1)
                    yield offset, batch
                if stream.next >= hi:
                    return
            start += n
        return
    offset = 0
    for batch in arrow_reader(path):
        if offset >= hi:
            return
        if offset + batch.num_rows > lo:
            for k in range(0, batch.num_rows, size):
                if offset + k + size > lo and offset + k < hi:
                    piece = batch.slice(k, size)
                    _remember(version, offset + k, piece, hi - lo == 1)
                    yield offset + k, piece
        offset += batch.num_rows


class _GroupStream:
    """Batches of one Parquet row group, read on from where the last request stopped: a task reads its chunks in
    order, so each worker decodes a group about once, not once per chunk (Parquet has no random access inside a
    group: each fresh read decodes the group from its start)."""

    def __init__(self, batches: Iterator[Any], start: int):
        self.batches, self.next = batches, start
        #: The last batch read and its first row (a chunk may end inside it).
        self.batch: Any = None
        self.batch_start = start

    def serves(self, lo: int) -> bool:
        """Whether rows from ``lo`` on are still ahead (or in the last batch)."""
        return self.next <= lo or (self.batch is not None and self.batch_start <= lo)

    def serve(self, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
        if self.batch is not None and self.batch_start <= lo < self.next:
            yield self.batch_start, self.batch
        while self.next < hi:
            batch = next(self.batches, None)
            if batch is None:
                return
            self.batch, self.batch_start = batch, self.next
            self.next += batch.num_rows
            if self.next > lo:
                yield self.batch_start, batch


def _open_group(path: Path, group: int, start: int, size: int) -> _GroupStream:
    import pyarrow.parquet as pq

    return _GroupStream(pq.ParquetFile(path).iter_batches(batch_size=size, row_groups=[group]), start)


#: Open row-group streams of this thread, by (file version, row group, batch size); a few at most.
_local = threading.local()
_STREAMS = 4


def _stream(version: str, group: int, lo: int, size: int, start: Callable[[], _GroupStream]) -> _GroupStream:
    """The open stream of a row group that still has row ``lo`` ahead, or a new one from the group's start."""
    streams: dict[tuple[str, int, int], _GroupStream] = _local.__dict__.setdefault("streams", {})
    key = (version, group, size)
    stream = streams.pop(key, None)
    if stream is None or not stream.serves(lo):
        stream = start()
    streams[key] = stream  # the most recent last
    while len(streams) > _STREAMS:
        del streams[next(iter(streams))]
    return stream


def _remember(version: str, start: int, batch: Any, wanted: bool) -> None:
    if not wanted:
        return
    _cache[(version, start)] = batch
    while sum(b.nbytes for b in _cache.values()) > _CACHE_BYTES and len(_cache) > 1:
        del _cache[next(iter(_cache))]


def arrow_reader(path: Path) -> Any:
    """The record batches of an Arrow file (``save_to_disk`` writes IPC streams; IPC files are read too),
    memory-mapped."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        return (reader.get_batch(k) for k in range(reader.num_record_batches))
