"""Tar shards: the byte-reproducible USTAR writer with its ``.tar.idx``, and the readers of records.

A record is the adjacent members of one key (:func:`packtool.format.split_member`). The writer commits the
``.tar.idx`` and then the tar atomically, so a shard whose tar exists is complete.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, overload

import numpy as np

from packtool.commit import commit_bytes, commit_path
from packtool.errors import FormatError
from packtool.format import IndexedRecord, member_name, split_member
from packtool.storage import is_remote, location, open_read

BLOCK = 512
#: Bytes read at once from an object while walking a tar's headers.
_HEADER_READAHEAD = 64 << 10


def _header(name: str, size: int) -> bytes:
    """A USTAR header as ``tarfile`` writes it for these fields; for the common case (an ASCII name of at most
    100 bytes, a size below 8 GiB) spliced into ``tarfile``'s own header of a template member (test: equal)."""
    if name.isascii() and len(name) <= 100 and size < 8 ** 11:
        head = name.encode("ascii").ljust(100, b"\0") + _BETWEEN + b"%011o\0" % size + _AFTER_SIZE
        return head + b"%06o\0 " % (sum(head) + _REST_SUM) + _REST
    return _tar_header(name, size)


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


_TEMPLATE = _tar_header("", 0)
#: The template's fields between name and size (mode, uid, gid), after size (mtime), after the checksum (type,
#: link, magic, owner names, devices, prefix); the checksum counts its own field as spaces.
_BETWEEN, _AFTER_SIZE, _REST = _TEMPLATE[100:124], _TEMPLATE[136:148], _TEMPLATE[156:]
_REST_SUM = 8 * 32 + sum(_REST)


class ShardIndex(Sequence[IndexedRecord]):
    """Every record of a shard (:class:`IndexedRecord` each, in order), held as a few arrays: a write task returns
    its shard's index to the command's process, which keeps every shard's until it writes ``index.sqlite`` (a
    record object per pack would be ~1 KB a pack there)."""

    def __init__(self, records: Iterable[IndexedRecord] = ()):
        keys: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        names: dict[str, int] = {}
        first = [0]
        part_name: list[int] = []
        part_offset: list[int] = []
        part_size: list[int] = []
        for r in records:
            keys.append(r.key)
            offsets.append(r.offset)
            sizes.append(r.size)
            for name, offset, size in r.parts:
                part_name.append(names.setdefault(name, len(names)))
                part_offset.append(offset)
                part_size.append(size)
            first.append(len(part_name))
        self._keys = "\0".join(keys)  # a tar member's name holds no NUL
        self._count = len(keys)
        self._names = tuple(names)
        self._offsets, self._sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        self._first = np.asarray(first, np.int64)
        self._part_name = np.asarray(part_name, np.int32)
        self._part_offset, self._part_size = np.asarray(part_offset, np.int64), np.asarray(part_size, np.int64)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> IndexedRecord: ...

    @overload
    def __getitem__(self, i: slice) -> list[IndexedRecord]: ...

    def __getitem__(self, i: int | slice) -> IndexedRecord | list[IndexedRecord]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(i)
        return self._records(i % self._count, i % self._count + 1)[0]

    def __iter__(self) -> Iterator[IndexedRecord]:
        step = 4096
        for a in range(0, self._count, step):
            yield from self._records(a, min(a + step, self._count))

    def _records(self, a: int, b: int) -> list[IndexedRecord]:
        keys = self.keys()[a:b]
        lo, hi = int(self._first[a]), int(self._first[b])
        names = [self._names[n] for n in self._part_name[lo:hi].tolist()]
        offsets, sizes = self._part_offset[lo:hi].tolist(), self._part_size[lo:hi].tolist()
        parts = list(zip(names, offsets, sizes))
        first = (self._first[a:b + 1] - lo).tolist()
        return [IndexedRecord(key, offset, size, tuple(parts[first[k]:first[k + 1]]))
                for k, (key, offset, size) in enumerate(zip(keys, self._offsets[a:b].tolist(),
                                                            self._sizes[a:b].tolist()))]

    def keys(self) -> list[str]:
        return self._keys.split("\0") if self._count else []

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardIndex({list(self)!r})"


def write_tar(path: Path, records: Iterable[tuple[str, list[tuple[str, bytes]]]]) -> ShardIndex:
    """Write records ``(key, [(part, bytes), ...])`` as an uncompressed USTAR tar plus its ``.tar.idx``.

    Headers carry mtime 0, uid/gid 0, mode 0644, so equal input gives equal bytes. ``.tar.idx`` holds each
    record's first header offset, then the end of the data (native uint64, as Energon reads it). Returns the
    index of every record.
    """
    path = location(path)
    with commit_path(path) as tmp:
        with open(tmp, "wb") as f:
            index = write_records(f, records)
            f.write(b"\0" * (2 * BLOCK))
        _commit_idx(path, index)
    return index


def write_records(f: BinaryIO, records: Iterable[tuple[str, list[tuple[str, bytes]]]]) -> ShardIndex:
    """Write records as tar members (no end-of-archive marker) to ``f``; their index, offsets from where ``f``
    was. A tar's bytes are its records' bytes in order, so a shard may be written as parts and joined."""
    def written() -> Iterator[IndexedRecord]:  # each record as it is written: the index grows as arrays
        pos = 0
        for key, parts in records:
            start, placed = pos, []
            for part, data in parts:
                head = _header(member_name(key, part), len(data))
                pad = -len(data) % BLOCK
                f.write(head)
                f.write(data)
                f.write(b"\0" * pad)
                placed.append((part, pos + len(head), len(data)))
                pos += len(head) + len(data) + pad
            yield IndexedRecord(key, start, pos - start, tuple(placed))

    return ShardIndex(written())


def join_tar(path: Path, parts: list[tuple[Path, Sequence[IndexedRecord]]]) -> ShardIndex:
    """Commit the tar (and ``.tar.idx``) made of ``parts`` (files of :func:`write_records`, with their indexes)
    in order: the bytes :func:`write_tar` writes for all their records. The first part becomes the tar (only the
    others are copied, kernel-side where the OS can); the parts are removed."""
    path = Path(path)
    index: list[IndexedRecord] = []
    with commit_path(path) as tmp:
        if parts:
            os.replace(parts[0][0], tmp)
        with open(tmp, "r+b" if parts else "wb") as f:
            for k, (part, records) in enumerate(parts):
                base = f.seek(0, os.SEEK_END) if k else 0  # the first part is the file itself
                if k:
                    _append(part, f)
                index += [IndexedRecord(r.key, r.offset + base, r.size,
                                        tuple((name, offset + base, size) for name, offset, size in r.parts))
                          for r in records]
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * (2 * BLOCK))
        _commit_idx(path, index)
    for part, _ in parts[1:]:
        part.unlink()
    return ShardIndex(index)


#: copy_file_range errors that mean "not here" (an old kernel, a filesystem without it): copy in user space.
_NO_KERNEL_COPY = (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)


def _append(src: Path, dst: BinaryIO) -> None:
    """Append the bytes of file ``src`` to the open file ``dst``."""
    dst.flush()
    end = dst.seek(0, os.SEEK_END)
    with open(src, "rb") as s:
        size, done = os.fstat(s.fileno()).st_size, 0
        try:
            while done < size:
                n = os.copy_file_range(s.fileno(), dst.fileno(), size - done, offset_src=done, offset_dst=end + done)
                if n == 0:
                    break
                done += n
        except AttributeError:  # no copy_file_range on this platform
            pass
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
        s.seek(done)
        dst.seek(end + done)
        shutil.copyfileobj(s, dst, 1 << 22)  # what the kernel did not copy
    dst.seek(0, os.SEEK_END)


def _commit_idx(path: Path, index: Sequence[IndexedRecord]) -> None:
    end = index[-1].offset + index[-1].size if index else 0
    commit_bytes(idx_path(path), np.asarray([r.offset for r in index] + [end], dtype=np.uint64).tobytes())


def idx_path(shard: Path | Any) -> Path | Any:
    return shard.with_name(shard.name + ".idx")


def _grouped(tar: tarfile.TarFile) -> Iterator[tuple[str, list[tuple[str, tarfile.TarInfo]]]]:
    """The file members of a tar grouped by record: ``(key, [(part, member), ...])`` in on-disk order."""
    key: str | None = None
    group: list[tuple[str, tarfile.TarInfo]] = []
    for m in tar:
        if not m.isfile():
            continue
        k, part = split_member(m.name)
        if k != key:
            if key is not None:
                yield key, group
            key, group = k, []
        group.append((part, m))
    if key is not None:
        yield key, group


def index_tar(path: Path) -> ShardIndex:
    """The record index of a tar, from its headers (data is not read)."""
    with open_read(location(path), readahead=_HEADER_READAHEAD) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        return ShardIndex(IndexedRecord(key, group[0][1].offset,
                              group[-1][1].offset_data + group[-1][1].size + (-group[-1][1].size % BLOCK)
                              - group[0][1].offset,
                              tuple((part, m.offset_data, m.size) for part, m in group))
                          for key, group in _grouped(tar))


def record_offsets(shard: str | Path) -> np.ndarray:
    """Byte offset of each record's first header, then the end of the last record (``.tar.idx``)."""
    path = idx_path(location(shard))
    if not path.is_file():
        raise FormatError(f"{path}: missing")
    if is_remote(path):
        return np.frombuffer(path.read_bytes(), dtype=np.uint64).astype(np.int64)
    return np.fromfile(path, dtype=np.uint64).astype(np.int64)


def parse_record(chunk: bytes, where: str = "record") -> tuple[str, dict[str, bytes]]:
    """The key and ``{part: bytes}`` of the tar bytes of one record."""
    # Zero blocks after the chunk make it a complete archive even when the end offset was not block-rounded.
    try:
        tar = tarfile.open(fileobj=io.BytesIO(chunk + bytes(-len(chunk) % BLOCK + 2 * BLOCK)), mode="r:")
        key: str | None = None
        parts: dict[str, bytes] = {}
        for info in tar:
            if not info.isfile():
                continue
            name, part = split_member(info.name)
            if key is None:
                key = name
            elif name != key:
                raise FormatError(f"{where}: record {key!r} also holds member {info.name!r}")
            parts[part] = _member_data(tar, info)
    except tarfile.TarError as exc:
        raise FormatError(f"{where}: unreadable tar record ({exc})") from None
    if key is None:
        raise FormatError(f"{where}: empty record")
    return key, parts


def _member_data(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    """The content of a regular-file member (``extractfile`` has none for links, folders and devices)."""
    f = tar.extractfile(info)
    if f is None:
        raise FormatError(f"tar member {info.name!r} is not a regular file")
    return f.read()


def iter_records(shard: str | Path, indices: Iterable[int] | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Records of one shard as ``(key, members)``, in on-disk order or in the order of ``indices``, found through
    the shard's ``.tar.idx``."""
    offsets = record_offsets(shard)
    with open_read(location(shard)) as f:
        for i in range(len(offsets) - 1) if indices is None else indices:
            f.seek(offsets[i])
            yield parse_record(f.read(offsets[i + 1] - offsets[i]), f"{shard} record {i}")


def scan_records(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Records of a tar read front to back from its headers alone (no ``.tar.idx``): what ``verify`` uses to
    check the index against."""
    with open_read(location(path), readahead=1 << 20) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for key, group in _grouped(tar):
            yield key, {part: _member_data(tar, m) for part, m in group}
