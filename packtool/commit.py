"""The atomic commit: every file and folder packtool writes appears under its final name complete, or not at all.

One rule for all of them (bytes, a file written by a library such as Parquet or SQLite, a whole folder): write
under a temporary name in the same folder, fsync the data, rename onto the final name, fsync the folder. A crash
at any point leaves either the old state or the new one, plus temporaries that :func:`remove_temporaries`
recognises by name. Temporary names carry the host, the process and a random part, so two writers of the same
path (a Ray task retried on another machine over a shared filesystem) never collide.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packtool.storage import commit_remote, is_remote, remove_dead_scratch

#: Errors of a full filesystem: raised by ``write`` or ``fsync`` without a file name, so :func:`commit_path` adds
#: the path being written (the user learns which disk is full).
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: The suffix every temporary name ends with: ``.tmp-<host>-<pid>-<random>``.
_TEMPORARY = re.compile(r"\.tmp-[A-Za-z0-9_-]*-\d+-[0-9a-f]{8}$")


def temporary_name(path: Path) -> Path:
    """A fresh temporary sibling of ``path`` (hidden, unique across hosts and processes)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32]
    return path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temporary(name: str) -> bool:
    """Whether a file or folder name is one of :func:`temporary_name`'s."""
    return _TEMPORARY.search(name) is not None


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Add ``path`` to a full-filesystem error raised inside without a file name (``write``, ``fsync``)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno in _FULL:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


@contextmanager
def commit_path(path: str | Path | Any) -> Iterator[Path]:
    """Yield a temporary path to create ``path`` at (a file, or a folder, made by any writer); on success the
    result is fsynced and renamed onto ``path`` (replacing it), on failure removed.

    >>> with commit_path(out / "ledger.parquet") as tmp:   # doctest: +SKIP
    ...     pyarrow.parquet.write_table(table, tmp)

    An object-store ``path`` is made in a local scratch folder and put in the store once complete
    (:func:`packtool.storage.commit_remote`).
    """
    if is_remote(path):
        with commit_remote(path) as remote_tmp:  # type: ignore[arg-type]
            yield remote_tmp
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with naming(path):
            yield tmp
            if tmp.is_dir():
                _fsync_tree(tmp)
                if path.is_dir():
                    shutil.rmtree(path)
            else:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def commit_bytes(path: str | Path | Any, data: bytes) -> None:
    """Write ``data`` as ``path``, atomically."""
    with commit_path(path) as tmp:
        tmp.write_bytes(data)


def remove_temporaries(root: str | Path) -> None:
    """Remove what interrupted writers left under temporary names anywhere below ``root``. Nothing under such a
    name is part of any output: it is renamed away the moment it is complete. An object store holds none (its
    files are made in local scratch folders, those of dead processes removed here)."""
    if is_remote(root):
        remove_dead_scratch()  # what a killed writer of an object store left is local
        return
    for folder, dirs, files in os.walk(root):
        for name in [d for d in dirs if is_temporary(d)]:
            shutil.rmtree(Path(folder, name), ignore_errors=True)
            dirs.remove(name)
        for name in files:
            if is_temporary(name):
                Path(folder, name).unlink(missing_ok=True)
