"""Where packtool reads and writes: local paths, and object-store locations ``msc://PROFILE/path``.

An object-store location is read and written through NVIDIA's multi-storage-client (MSC) with the profile its
configuration gives (``MSC_CONFIG``, ``~/.msc_config.yaml``), the form Energon opens datasets in. :func:`location`
turns a location string into a :class:`~pathlib.Path` or an :class:`ObjectPath`, which offers the part of
``Path``'s interface packtool uses, so code that reads and writes through these calls serves both.

Reading is by ranged requests (:meth:`ObjectPath.read_range`, :func:`open_read`): a source shard's headers and a
media item's bytes are fetched without the rest of the object. Writing is by whole objects: a file is made in a
local scratch folder and put with one request (complete or absent, never partial, as a rename is on disk); a
folder's data files are put before its JSON files, which describe them, so a folder whose JSON is there is
complete (:func:`commit_remote`). The scratch folder is ``PACKTOOL_SCRATCH``, else the system's temporary folder.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import importlib.abc
import importlib.util
import io
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, cast

from packtool.errors import ConfigError

SCHEME = "msc://"
_URL = re.compile(r"^msc://(?P<profile>[^/]+)(?:/(?P<key>.*))?$")


@dataclass
class Requests:
    """Reads this process sent to object stores (ranged and whole-object reads, downloads): how many, and how
    many bytes they asked for."""

    count: int = 0
    bytes: int = 0
    #: Bytes put (uploads).
    put: int = 0
    #: Bytes requested by object URL.
    per_object: dict[str, int] = field(default_factory=dict)

    def add(self, url: str, size: int) -> None:
        with _COUNTING:
            self.count += 1
            self.bytes += size
            self.per_object[url] = self.per_object.get(url, 0) + size

    def reset(self) -> None:
        self.count = self.bytes = self.put = 0
        self.per_object.clear()


#: What this process requested from object stores so far (the benchmark reads it).
REQUESTED = Requests()
_COUNTING = threading.Lock()


def is_remote(loc: object) -> bool:
    """Whether ``loc`` is an object-store location."""
    return isinstance(loc, ObjectPath) or (isinstance(loc, str) and loc.startswith(SCHEME))


def location(loc: str | os.PathLike[str] | ObjectPath) -> Path:
    """A :class:`Path` for a local location, an :class:`ObjectPath` for ``msc://PROFILE/path`` (typed as
    ``Path``: it offers the part of ``Path``'s interface packtool uses)."""
    if isinstance(loc, ObjectPath):
        return cast(Path, loc)
    if isinstance(loc, str) and loc.startswith(SCHEME):
        return cast(Path, ObjectPath(loc))
    return Path(loc)


def resolved(loc: str | os.PathLike[str] | ObjectPath) -> Path:
    """:func:`location`, local paths made absolute."""
    p = location(loc)
    return p if is_remote(p) else p.resolve()


def object_store_error(exc: BaseException) -> str | None:
    """A one-line message for an error an object store answered (a missing bucket, access denied, a store out
    of reach: botocore's and multi-storage-client's own exception types), else None."""
    module = type(exc).__module__ or ""
    if not module.startswith(("botocore", "boto3", "multistorageclient", "s3transfer")):
        return None
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"object store: {text}"


def physical(loc: ObjectPath) -> tuple[str, str, PurePosixPath] | None:
    """Where an object-store location lies whatever profile names it: the provider kind, its endpoint, and the
    bucket-and-key path (the profile's base path joined with the key); None when the profile does not say."""
    try:
        provider = loc.client._config.storage_provider
        base = str(provider._base_path or "")
        kind, endpoint = str(provider._provider_name), str(getattr(provider, "_endpoint_url", "") or "")
    except (AttributeError, TypeError):
        return None
    return kind, endpoint, PurePosixPath("/", base, loc.key)


@cache
def _client(profile: str) -> Any:
    try:
        import multistorageclient as msc
    except ImportError:  # pragma: no cover - a dependency of megatron-energon
        raise ConfigError("msc:// locations need multi-storage-client: pip install 'packtool[storage]'") from None
    try:
        client, _ = msc.resolve_storage_client(f"{SCHEME}{profile}")
    except Exception as exc:  # MSC raises its own error types for a missing profile or configuration
        raise ConfigError(f"{SCHEME}{profile}: cannot open the object-store profile ({exc})") from None
    return client


class ObjectPath:
    """A file or folder of an object store, named ``msc://PROFILE/path``. Folders are key prefixes: one exists
    when an object lies below it. Pickles as its URL (credentials stay in each machine's MSC configuration)."""

    __slots__ = ("profile", "key")

    def __init__(self, url: str):
        m = _URL.match(url)
        if m is None:
            raise ConfigError(f"{url!r} is not an object-store location ({SCHEME}PROFILE/path)")
        parts = [p for p in (m.group("key") or "").split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ConfigError(f"{url!r}: '..' is not allowed in an object-store location")
        self.profile, self.key = m.group("profile"), "/".join(parts)

    # -- names -------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.profile}/{self.key}" if self.key else f"{SCHEME}{self.profile}"

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __reduce__(self) -> tuple:
        return ObjectPath, (self.url,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.profile, self.key) == (other.profile, other.key)

    def __hash__(self) -> int:
        return hash((self.profile, self.key))

    def __lt__(self, other: ObjectPath) -> bool:
        return (self.profile, self.key) < (other.profile, other.key)

    def __truediv__(self, other: str | os.PathLike[str]) -> ObjectPath:
        return ObjectPath(f"{self.url}/{os.fspath(other)}")

    def joinpath(self, *parts: str) -> ObjectPath:
        out = self
        for p in parts:
            out = out / p
        return out

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def parent(self) -> ObjectPath:
        parent = str(PurePosixPath(self.key).parent)
        return ObjectPath(f"{SCHEME}{self.profile}" + ("" if parent == "." else f"/{parent}"))

    @property
    def parents(self) -> list[ObjectPath]:
        out, p = [], self
        while p.key:
            p = p.parent
            out.append(p)
        return out

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    def resolve(self) -> ObjectPath:
        return self

    # -- reading -----------------------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        return _client(self.profile)

    def stat(self) -> ObjectStat:
        """The object's size, modification time and ETag; FileNotFoundError if there is none."""
        info = self.client.info(self.key)
        modified = info.last_modified
        return ObjectStat(info.content_length, int(modified.timestamp()) * 10**9 + modified.microsecond * 1000,
                          info.etag or "")

    def is_file(self) -> bool:
        return bool(self.key) and self.client.is_file(self.key)

    def is_dir(self) -> bool:
        return next(iter(self.client.list(self._prefix())), None) is not None

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def read_bytes(self) -> bytes:
        data = self.client.read(self.key)
        REQUESTED.add(self.url, len(data))
        return data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def read_range(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (fewer at the end of the object), by one ranged request."""
        if size <= 0:
            return b""
        from multistorageclient.types import Range

        REQUESTED.add(self.url, size)
        return self.client.read(self.key, byte_range=Range(offset, size))

    def read_ranges(self, ranges: list[tuple[int, int]], threads: int = 8) -> list[bytes]:
        """The bytes of each ``(offset, size)``, by ranged requests sent ``threads`` at a time (an object store
        answers each after a round trip: concurrent requests hide it)."""
        if len(ranges) <= 1:
            return [self.read_range(o, n) for o, n in ranges]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(ranges))) as pool:
            return list(pool.map(lambda r: self.read_range(*r), ranges))

    def open(self, mode: str = "rb", readahead: int = 0) -> BinaryIO:
        if mode != "rb":
            raise ValueError(f"{self}: objects are opened for reading only (written through commit_remote)")
        return io.BufferedReader(RangedReader(self, self.stat().st_size), max(readahead, 1))

    def _prefix(self) -> str:
        return f"{self.key}/" if self.key else ""

    def files(self) -> Iterator[ObjectPath]:
        """Every object below this folder."""
        base = f"{SCHEME}{self.profile}/"
        for obj in self.client.list(self._prefix()):
            yield ObjectPath(base + obj.key)

    def iterdir(self) -> Iterator[ObjectPath]:
        """The files and folders right below this folder."""
        seen = set()
        for f in self.files():
            first = f.key[len(self._prefix()):].split("/", 1)[0]
            if first not in seen:
                seen.add(first)
                yield self / first

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """The objects below this folder whose relative key matches ``pattern`` (``*`` stays within a level)."""
        depth = pattern.count("/")
        for f in self.files():
            rel = f.key[len(self._prefix()):]
            if rel.count("/") == depth and all(fnmatch.fnmatchcase(a, b)
                                               for a, b in zip(rel.split("/"), pattern.split("/"))):
                yield f

    # -- writing -----------------------------------------------------------------------------------------------

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Folders need not be made in an object store."""

    def upload(self, local: Path) -> None:
        """Put the local file as this object (one object, complete or absent)."""
        self.client.upload_file(self.key, str(local))
        REQUESTED.put += Path(local).stat().st_size

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.client.delete(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Delete every object below this folder."""
        keys = [f.key for f in self.files()]
        if keys:
            self.client.delete_many(keys)


@dataclass(frozen=True)
class ObjectStat:
    """What :meth:`ObjectPath.stat` tells (named as :func:`os.stat` names them)."""

    st_size: int
    st_mtime_ns: int
    etag: str


class RangedReader(io.RawIOBase):
    """A seekable raw reader of one object: each read is a ranged request (buffer it for read-ahead)."""

    def __init__(self, path: ObjectPath, size: int):
        self.path, self.size, self.pos = path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self.size - self.pos))
        if n == 0:
            return 0
        data = self.path.read_range(self.pos, n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def open_read(loc: Any, readahead: int = 0) -> BinaryIO:
    """A seekable binary reader of a local file or an object. For an object each read is a ranged request of at
    least ``readahead`` bytes (0: exactly what is asked)."""
    if isinstance(loc, ObjectPath):
        return loc.open("rb", readahead=readahead)
    return open(loc, "rb")


def file_version(loc: Any) -> tuple[int, int, int, str]:
    """``(size, mtime_ns, ctime_ns, etag)`` of a file or object: what changes when it is rewritten (an object
    has no ctime; its ETag changes with its content and its modification time with every put)."""
    if isinstance(loc, ObjectPath):
        st = loc.stat()
        return st.st_size, st.st_mtime_ns, 0, st.etag
    local = os.stat(loc)
    return local.st_size, local.st_mtime_ns, local.st_ctime_ns, ""


def remove_tree(loc: Any) -> None:
    """Delete a folder (and everything below it) or a file."""
    if isinstance(loc, ObjectPath):
        loc.rmtree()
        loc.unlink(missing_ok=True)
    elif loc.is_dir() and not loc.is_symlink():
        shutil.rmtree(loc)
    else:
        loc.unlink(missing_ok=True)


def scratch_root() -> Path:
    """The local folder for files on their way to an object store."""
    root = Path(os.environ.get("PACKTOOL_SCRATCH") or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root


def _scratch_prefix() -> str:
    return ".packtool-" + re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32] + "-"


def remove_dead_scratch() -> None:
    """Remove the scratch folders that processes of this machine which no longer run left behind (a killed run's
    files on their way to the store)."""
    prefix, root = _scratch_prefix(), scratch_root()
    for folder in root.glob(f"{glob.escape(prefix)}*"):
        pid = folder.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


@contextmanager
def commit_remote(path: ObjectPath) -> Iterator[Path]:
    """Yield a local scratch path to create the object (or folder of objects) ``path`` at; on success it is put
    in the object store: a file as one object, a folder's files one by one, its JSON files last, after the old
    folder's objects are deleted. On failure nothing is put; the scratch is always removed."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{_scratch_prefix()}{os.getpid()}-", dir=scratch_root()))
    tmp = scratch / (path.name or "root")
    try:
        yield tmp
        if tmp.is_dir():
            path.rmtree()
            files = sorted((f for f in tmp.rglob("*") if f.is_file()),
                           key=lambda f: (f.suffix == ".json", str(f)))
            for f in files:
                (path / f.relative_to(tmp).as_posix()).upload(f)
        else:
            path.upload(tmp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _NoPandas(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds pandas and refuses to load it (see :func:`arrow_without_pandas`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name == "pandas" else None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ImportError("pandas is not loaded in packtool's own processes (packtool.storage.arrow_without_pandas)")


_NO_PANDAS = _NoPandas()


def arrow_without_pandas() -> None:
    """Keep pandas out of this process (where none is imported yet). pyarrow imports pandas on the first array it
    makes from numpy or a list, to check for pandas objects (and tries again on each list while it cannot): 0.4 s
    of every packtool process, for a library packtool never uses. For packtool's own processes only (the command
    line, the pack workers); :func:`allow_pandas` undoes it before user code is imported (a custom adapter)."""
    if "pandas" not in sys.modules and _NO_PANDAS not in sys.meta_path:
        sys.meta_path.insert(0, _NO_PANDAS)


def system_allocator() -> None:
    """Have Arrow allocate with the C library's allocator in this process and the processes it starts (unless
    ``ARROW_DEFAULT_MEMORY_POOL`` names another). Arrow's default (mimalloc) keeps the pages of what it freed: a
    write task grew by ~35 MB over one shard with it and by ~14 MB without, and the command's process held ~20 MB
    more of the split's rows. For packtool's own processes only, as :func:`arrow_without_pandas`."""
    os.environ.setdefault(_ARROW_POOL, "system")
    if os.environ[_ARROW_POOL] == "system" and "pyarrow" in sys.modules:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())


_ARROW_POOL = "ARROW_DEFAULT_MEMORY_POOL"


def own_process() -> None:
    """Set up one of packtool's own processes (the command line, a pack's pool worker): pandas kept out
    (:func:`arrow_without_pandas`), Arrow on the system allocator (:func:`system_allocator`)."""
    arrow_without_pandas()
    system_allocator()


def allow_pandas() -> None:
    """Let pandas be imported again (a user's module may need it)."""
    if _NO_PANDAS in sys.meta_path:
        sys.meta_path.remove(_NO_PANDAS)


def read_parquet(loc: Any, columns: list[str] | None = None, **options: Any) -> Any:
    """A Parquet file or object as an Arrow table (only ``columns``, when given; ``options`` as for
    :func:`pyarrow.parquet.read_table`). Without options the file is read as one file: ``read_table`` builds a
    dataset, whose module imports pandas (0.4 s of a run's start-up, for nothing a run uses)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = pa.BufferReader(loc.read_bytes()) if isinstance(loc, ObjectPath) else loc
    if not isinstance(loc, ObjectPath) and not os.path.exists(loc):  # the error read_table gives
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(loc))
    if options:
        return pq.read_table(source, columns=columns, **options)
    with pq.ParquetFile(source) as f:
        return f.read(columns=columns)


def parquet_file(loc: Any) -> Any:
    """A :class:`pyarrow.parquet.ParquetFile` of a file or object (an object is read by ranged requests)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(open_read(loc, readahead=1 << 20) if isinstance(loc, ObjectPath) else loc)


def local_copy(loc: Any) -> Path:
    """A local path holding the file or folder ``loc``: itself when local; an object (or every object below a
    folder) is fetched once into ``<scratch>/packtool-cache/<digest of its URL and ETags>`` (what a library
    that only opens local files needs: SQLite, a tokenizer, a processor's model folder)."""
    if not isinstance(loc, ObjectPath):
        return Path(loc)
    import hashlib

    files = [loc] if loc.is_file() else sorted(loc.files())
    tags = [(f.key, f.stat().etag) for f in files]
    digest = hashlib.sha256(json.dumps([loc.url, tags]).encode()).hexdigest()[:32]
    target = scratch_root() / "packtool-cache" / digest / (loc.name or "root")
    if not target.exists():
        part = target.with_name(f".{target.name}.{os.getpid()}")
        for f in files:
            dest = part if f == loc else part / f.relative_to(loc)
            dest.parent.mkdir(parents=True, exist_ok=True)
            f.client.download_file(f.key, str(dest))
            REQUESTED.add(f.url, dest.stat().st_size)
        if not files:
            part.mkdir(parents=True)
        try:
            os.replace(part, target)
        except OSError:  # another process of this machine fetched it first
            if not target.exists():
                raise
            shutil.rmtree(part, ignore_errors=True)
    return target


def fetched(settings: Any) -> Any:
    """Settings whose ``tokenizer`` (model folder) is an object-store location, with it replaced by the local
    copy (:func:`local_copy`): what the libraries that load a model folder read. Other settings unchanged."""
    if not is_remote(settings.tokenizer):
        return settings
    import dataclasses

    return dataclasses.replace(settings, tokenizer=str(local_copy(location(settings.tokenizer))))
