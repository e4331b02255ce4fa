"""Sources beside Energon datasets, read in place: JSON / JSONL conversations with a media folder (LLaVA,
ShareGPT, OpenAI messages), Hugging Face ``datasets`` saved to disk (Arrow) and Parquet files with media columns.

Nothing is copied. A split's records are cut into *chunks* (:class:`FileChunk`: up to :data:`RECORDS_PER_CHUNK`
consecutive records of one file; a Parquet row group), which the pipeline treats as it treats an Energon shard:
each chunk is encoded in ranges, stamped, and re-encoded only when its stamp changes. Records are streamed: a
JSONL file line by line, a JSON array by a streaming scan of its tokens (:func:`json_spans`: only the byte span of
each element is kept, never the file), a Parquet file by row group, a ``save_to_disk`` folder by its Arrow files.

A record becomes the raw sample its Energon equivalent is (:func:`record_sample`): a ``json`` member (the record
with its media references renamed to members ``m0.jpg``, ``m1.png``, …) plus its media's bytes, read from the
user's files (or the Parquet/Arrow cells) when the sample is encoded, and again when its pack is written. So a
record gives the tokens its Energon sample gives, and its ledger row, resume, stale input and ``verify --source``
follow the Energon path.

Stamps. Each record's stamp (:func:`FileChunk.stamp_records`) is the digest of its bytes (its JSON text; a row's
values, media cells included) and of each media file it names: size, modification time, inode and device, or
``missing`` (a file that appears later makes the record stale), plus the media folder's own identity. A chunk's
stamp is the digest of its records' stamps, so an edited record or a replaced image re-encodes only its chunk;
when its pack is written each record read is checked against its stamp again, so nothing is packed stale.

What a record may hold (see :mod:`packtool.packer.sources.conversation` for the conversation itself): media named
by ``image``/``images``, ``video``/``videos`` (an entry may be a list of frames), ``audio``/``audios``, or by
OpenAI content parts, as paths relative to the media folder; in Arrow/Parquet rows, media columns named so that
hold bytes (``binary``, ``large_binary``, lists of them), ``{"bytes", "path", …}`` structs (``datasets``'
``Image``/``Audio`` features; extra keys such as ``mime`` are ignored) or path strings. Only regular files are
read as media (a FIFO, a device or a socket is refused before it is opened), a path may not leave the media
folder (by ``..`` or by a symbolic link), absolute paths only with ``absolute_media_paths``, and URLs are never
fetched. A record that cannot be used keeps its place and gets an error row saying why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from packtool.errors import SourceError
from packtool.format import META, record_position
from packtool.packer.sources.energon import RawSample, SourceDataset
from packtool.packer.sources.mixture import is_mixture
from packtool.storage import is_remote, location

#: Records per chunk of a JSON/JSONL file (a Parquet chunk is a row group; an Arrow chunk this many rows).
RECORDS_PER_CHUNK = 1000
#: Bytes of a record's stamp (a truncated SHA-256).
STAMP_BYTES = 16
#: Record fields (and Arrow/Parquet columns) that name media, with their kind.
MEDIA_FIELDS = {"image": "image", "images": "image", "video": "video", "videos": "video", "audio": "audio",
                "audios": "audio"}
#: Content-part types that name a media item (as :mod:`packtool.packer.sources.conversation` reads them).
_PART_TYPES = {"image": "image", "image_url": "image", "video": "video", "video_url": "video", "audio": "audio",
               "input_audio": "audio", "audio_url": "audio"}
#: Split names, one mapping for every layout (Energon calls the validation split ``val``).
SPLIT_NAMES = {"train": "train", "validation": "val", "val": "val", "valid": "val", "test": "test", "dev": "val"}
#: Bytes read at once while streaming a JSON/JSONL file.
_BLOCK = 1 << 20

SourceKind = Literal["json", "arrow", "parquet"]


def split_name(name: str) -> str:
    """A split's name as packtool packs it (``validation``, ``valid`` and ``dev`` are ``val``)."""
    return SPLIT_NAMES.get(name.lower(), name)


@dataclass(frozen=True)
class FileSource:
    """A source that is not an Energon dataset: its kind and the files of each split, in order."""

    kind: SourceKind
    splits: dict[str, tuple[Path, ...]]
    #: Folder that relative media paths are read from.
    media_dir: Path
    #: The file or folder given.
    path: Path | None = None
    #: Whether absolute media paths are read (else each is its record's error).
    absolute_media_paths: bool = False

    def describe(self) -> dict:
        return {"kind": self.kind, "splits": {s: [str(f) for f in fs] for s, fs in self.splits.items()},
                "media_dir": str(self.media_dir.resolve()),
                "input": str(self.path.resolve()) if self.path is not None else None}


def is_energon(path: Path) -> bool:
    return (Path(path) / META).is_dir()


def detect(source: str | Path, media_dir: str | Path | None = None, *,
           absolute_media_paths: bool = False) -> FileSource | None:
    """The file source at ``source`` (None: an Energon dataset). Raises :class:`SourceError` for anything else,
    saying what packtool reads."""
    found = _detect(source, media_dir)
    return None if found is None else FileSource(found.kind, found.splits, found.media_dir, Path(source),
                                                 absolute_media_paths)


def _detect(source: str | Path, media_dir: str | Path | None) -> FileSource | None:
    path = Path(source)
    if not path.exists():
        raise SourceError(f"source {path} does not exist")
    if (path.is_dir() and is_energon(path)) or is_mixture(path):  # an Energon dataset, or a metadataset of them
        return None
    base = path if path.is_dir() else path.parent
    media = Path(media_dir) if media_dir is not None else base
    if media_dir is not None and not media.is_dir():
        raise SourceError(f"media folder {media} does not exist")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".json", ".jsonl"):
            return FileSource("json", {"train": (path,)}, media)
        if suffix == ".parquet":
            return FileSource("parquet", {"train": (path,)}, media)
        if suffix == ".arrow":
            return FileSource("arrow", {"train": (path,)}, media)
    elif (path / "dataset_dict.json").is_file():
        splits = _read_json_file(path / "dataset_dict.json").get("splits", [])
        named: dict[str, tuple[Path, ...]] = {}
        for s in splits:
            if not isinstance(s, str) or "/" in s or s in ("", ".", ".."):
                raise SourceError(f"{path / 'dataset_dict.json'} names a split {s!r} that is not a folder name")
            if split_name(s) in named:
                raise SourceError(f"{path} has splits that are both {split_name(s)!r} (validation, valid and dev "
                                  f"are all 'val')")
            named[split_name(s)] = _arrow_files(path / s)
        return FileSource("arrow", named, media)
    elif (path / "state.json").is_file():
        return FileSource("arrow", {"train": _arrow_files(path)}, media)
    else:
        found = _folder_splits(path)
        if found is not None:
            return found if media_dir is None else FileSource(found.kind, found.splits, media)
    raise SourceError(f"{path} is not a source packtool reads (no {META} folder, and not a .json/.jsonl file, Parquet "
                      f"files or a `datasets` folder written by save_to_disk); for WebDataset shards, run `energon "
                      f"prepare {path}` first and choose \"Crude sample\" when asked (packtool reads crude datasets)")


def _folder_splits(path: Path) -> FileSource | None:
    """A folder of ``<split>.json(l)`` files or Parquet files (``train-00000-of-00002.parquet``, also under
    ``data/``): split by name prefix."""
    for kind, pattern in (("json", "*.json*"), ("parquet", "*.parquet"), ("parquet", "data/*.parquet")):
        files = sorted(f for f in path.glob(pattern) if f.suffix.lower() in (".json", ".jsonl", ".parquet"))
        if not files:
            continue
        splits: dict[str, list[Path]] = {}
        for f in files:
            splits.setdefault(split_name(f.name.split(".")[0].split("-")[0]), []).append(f)
        return FileSource(kind, {s: tuple(fs) for s, fs in sorted(splits.items())}, path)  # type: ignore[arg-type]
    return None


def _arrow_files(folder: Path) -> tuple[Path, ...]:
    state = folder / "state.json"
    if not state.is_file():
        raise SourceError(f"{folder} holds no state.json (not a dataset written by save_to_disk)")
    files = [f.get("filename") for f in _read_json_file(state).get("_data_files", [])]
    if not files or not all(isinstance(f, str) and "/" not in f for f in files):
        raise SourceError(f"{state} names no data files")
    return tuple(folder / f for f in files)


def _read_json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


# -- streaming the records' spans -----------------------------------------------------------------------------


def jsonl_spans(path: Path) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte span of each non-blank line of a JSONL file, one line at a time."""
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield offset, offset + len(line)
            offset += len(line)


def json_spans(path: Path) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte span of each element of a JSON array file (or of its ``"data"`` array), by a
    streaming scan of its structure (strings, escapes, brackets; 1 MiB at a time: the file is never held). A
    file whose top level is several values is read as JSONL. Raises :class:`SourceError` for a file that holds
    no list of records."""
    first = _first_byte(path)
    if first == b"[":
        yield from _array_spans(path, data_key=False)
        return
    if first != b"{":
        raise SourceError(f"{path} holds no JSON list of records" + (" (it is empty)" if first is None else ""))
    spans, end = _object_scan(path)
    if end is None:
        yield from jsonl_spans(path)  # several top-level objects: one record per line
        return
    if spans is None:
        raise SourceError(f"{path} holds a JSON object; expected a list of records (or {{\"data\": [...]}})")
    yield from spans


def _first_byte(path: Path) -> bytes | None:
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                return None
            stripped = block.lstrip()
            if stripped:
                return stripped[:1]


class _Scanner:
    """A byte-level walk over JSON structure: depth, strings and escapes, with the offsets of commas and brackets
    at a chosen depth. No recursion, so any nesting depth is walked (parsing an element is the record's own
    business)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def events(self, path: Path, start: int = 0, block_size: int = _BLOCK) -> Iterator[tuple[int, int, int]]:
        """``(offset, byte, depth before it)`` of each structural byte outside strings, and of each string's
        opening and closing quote, from byte ``start`` on."""
        offset = start
        with open(path, "rb") as f:
            f.seek(start)
            while True:
                block = f.read(block_size)
                if not block:
                    return
                i, n = 0, len(block)
                while i < n:
                    if self.in_string:
                        if self.escape:
                            self.escape = False
                            i += 1
                            continue
                        q, b = block.find(b'"', i), block.find(b"\\", i)
                        if b != -1 and (q == -1 or b < q):
                            self.escape = True
                            i = b + 1
                            continue
                        if q == -1:
                            break
                        self.in_string = False
                        yield offset + q, 0x22, self.depth
                        i = q + 1
                        continue
                    c = block[i]
                    if c == 0x22:
                        self.in_string = True
                        yield offset + i, c, self.depth
                    elif c in (0x5B, 0x7B):
                        yield offset + i, c, self.depth
                        self.depth += 1
                    elif c in (0x5D, 0x7D):
                        self.depth -= 1
                        yield offset + i, c, self.depth + 1
                    elif c in (0x2C, 0x3A):
                        yield offset + i, c, self.depth
                    i += 1
                offset += n


class _DataKey:
    """Follows the keys of the top-level object while the scanner walks it (events at depth 1): says when the
    value of its ``"data"`` key opens as an array. Keys longer than 16 bytes are never ``data``: not read."""

    def __init__(self) -> None:
        self.key_start, self.last_key, self.value_key = -1, b"", b""

    def opens_data_array(self, f: Any, in_string: bool, offset: int, c: int) -> bool:
        if c == 0x22:
            if in_string:
                self.key_start = offset
            else:
                length = offset - self.key_start - 1
                f.seek(self.key_start + 1)
                self.last_key = f.read(length) if length <= 16 else b""
        elif c == 0x3A:
            self.value_key = self.last_key
        elif c == 0x2C:
            self.value_key = b""
        elif c == 0x5B and self.value_key == b"data":
            return True
        return False


def _array_spans(path: Path, data_key: bool) -> Iterator[tuple[int, int]]:
    """Element spans of the top-level array (``data_key``: of the array that is the top-level object's
    ``"data"`` value): each from just after the comma or bracket before it to the comma or bracket after it.

    An element that is plain JSON is found by Python's JSON decoder, a buffer at a time (the bytes read as
    Latin-1, one character a byte, so offsets are the file's); one that is not (broken, nested too deep, cut by
    the buffer's end) by the byte walk of :class:`_Scanner` from its start, which defines what an element is."""
    start = _array_open(path, data_key)
    if start is None:
        return
    inner, size = (2 if data_key else 1), os.stat(path).st_size
    decoder = json.JSONDecoder(strict=False)  # control characters in strings: the record's own parse judges them
    with open(path, "rb") as f:
        buf_at, buf = start, ""
        while True:
            if start >= buf_at + len(buf):
                f.seek(start)
                buf_at, buf = start, f.read(_BLOCK).decode("latin-1")
            found = _decoded_element(decoder, buf, start - buf_at)
            if found is not None:
                end, closing, blank = found
                if not blank or closing == ",":
                    yield start, buf_at + end
                if closing == "]":
                    return
                start = buf_at + end + 1
                continue
            walked = _walk_element(path, start, inner)
            if walked is None:  # cut short: what is left is one last (broken) record
                if _nonblank(f, start, size):
                    yield start, size
                return
            end, c = walked
            if c == 0x2C or _nonblank(f, start, end):
                yield start, end
            if c == 0x5D:
                return
            start = end + 1


_WS = re.compile(r"[ \t\n\r]*")


def _decoded_element(decoder: json.JSONDecoder, buf: str, pos: int) -> tuple[int, str, bool] | None:
    """The element of ``buf`` from ``pos`` if it is plain JSON followed by a comma or the closing bracket, all in
    ``buf``: ``(index of that comma or bracket, it, whether the element is blank)``; None otherwise."""
    j = _WS.match(buf, pos).end()  # type: ignore[union-attr]
    if j >= len(buf):
        return None
    if buf[j] in ",]":
        return j, buf[j], True
    try:
        k = decoder.raw_decode(buf, j)[1]
    except (ValueError, RecursionError):
        return None
    m = _WS.match(buf, k).end()  # type: ignore[union-attr]
    if m >= len(buf) or buf[m] not in ",]":
        return None
    return m, buf[m], False


def _walk_element(path: Path, start: int, inner: int) -> tuple[int, int] | None:
    """Where the element starting at ``start`` (at array depth ``inner``) ends, by the byte walk: the offset and
    byte of the comma or bracket after it, or None when the file ends first."""
    scanner = _Scanner()
    scanner.depth = inner
    for offset, c, depth in scanner.events(path, start, 1 << 16):
        if depth == inner and c in (0x2C, 0x5D):
            return offset, c
    return None


def _array_open(path: Path, data_key: bool) -> int | None:
    """The offset just after the bracket that opens the array of records, or None where there is none."""
    scanner = _Scanner()
    keys = _DataKey()
    with open(path, "rb") as f:
        for offset, c, depth in scanner.events(path):
            if data_key:
                if depth == 1 and keys.opens_data_array(f, scanner.in_string, offset, c):
                    return offset + 1
            elif depth == 0 and c == 0x5B:
                return offset + 1
    return None


def _nonblank(f: Any, start: int, end: int) -> bool:
    f.seek(start)
    while start < end:
        block = f.read(min(_BLOCK, end - start))
        if not block:
            return False
        if block.strip():
            return True
        start += len(block)
    return False


def _object_scan(path: Path) -> tuple[Iterator[tuple[int, int]] | None, int | None]:
    """For a file starting with ``{``: ``(spans of its "data" array or None, end of the first top-level value)``;
    the end is None when another value follows it (a JSONL file named ``.json``)."""
    scanner = _Scanner()
    end = None
    has_data = False
    keys = _DataKey()
    with open(path, "rb") as f:
        for offset, c, depth in scanner.events(path):
            if end is not None:
                return None, None  # a second top-level value
            if depth == 1 and keys.opens_data_array(f, scanner.in_string, offset, c):
                has_data = True
            if c == 0x7D and scanner.depth == 0:  # the top-level object closes
                end = offset + 1
                tail_size = os.stat(path).st_size - end
                if _nonblank(f, end, end + tail_size):
                    return None, None
    return (_array_spans(path, data_key=True) if has_data else None), end if end is not None else 0


# -- records --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One record of a file source: the document, or why it cannot be read; ``blobs`` holds media given as bytes
    (Arrow/Parquet), keyed by the placeholder the document names them by; ``text`` its bytes as stored (a
    JSON record's text), for its stamp."""

    doc: Any = None
    problem: str | None = None
    blobs: dict[str, bytes] | None = None
    text: bytes = b""
    #: ``text`` is the record's JSON text (not a table row's digest).
    is_json: bool = False


def json_record(text: bytes, where: Callable[[], str]) -> Record:
    """A record from its JSON text; text that does not parse (bad UTF-8, a cut surrogate, nesting too deep) is a
    record with a problem (``where()`` names the record in it)."""
    try:
        return Record(json.loads(text), text=text, is_json=True)
    except RecursionError:
        return Record(problem=f"{where()} is JSON nested too deep to parse", text=text, is_json=True)
    except ValueError as exc:
        return Record(problem=f"{where()} is not valid JSON: {exc}", text=text, is_json=True)


#: Column layouts of a media column a row value may come in, by what pyarrow gives for it.
def _row_record(row: dict, columns: dict[str, str]) -> Record:
    """A table row as a record: media columns' bytes become blobs named ``blob:<k>:<path>``. A media value that
    is neither bytes, a path, a ``{"bytes", "path"}`` struct nor a list of them is the record's problem naming
    the column, as is any other value JSON cannot hold."""
    blobs: dict[str, bytes] = {}

    def media(value: Any, column: str) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            name = f"blob:{len(blobs)}:"
            blobs[name] = bytes(value)
            return name
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            data, path = value.get("bytes"), value.get("path")
            if data is not None:
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise _Unreadable(column, f"its 'bytes' is a {type(data).__name__}")
                name = f"blob:{len(blobs)}:{path if isinstance(path, str) else ''}"
                blobs[name] = bytes(data)
                return name
            if isinstance(path, str):
                return path
            raise _Unreadable(column, "a value has neither bytes nor a path")
        if isinstance(value, (list, tuple)):
            return [media(v, column) for v in value]
        if value is None or isinstance(value, str):
            return value
        raise _Unreadable(column, f"a value is a {type(value).__name__}")

    doc: dict[str, Any] = {}
    try:
        for k, v in row.items():
            doc[k] = media(v, k) if k in columns else v
    except _Unreadable as exc:
        return Record(problem=f"media column {exc.column!r} cannot be read: {exc.why}")
    bad = [k for k, v in doc.items() if not _jsonable(v)]
    if bad:
        return Record(problem=f"column {bad[0]!r} holds a value that is not text, a number or a list "
                              f"({type(doc[bad[0]]).__name__}); name media columns image(s), video(s) or audio(s)")
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8",
                                                                                            "surrogatepass")
    h = hashlib.sha256(text)
    for name in sorted(blobs):
        h.update(name.encode("utf-8", "surrogatepass") + hashlib.sha256(blobs[name]).digest())
    return Record(doc, blobs=blobs or None, text=h.digest())


class _Unreadable(Exception):
    def __init__(self, column: str, why: str):
        super().__init__(why)
        self.column, self.why = column, why


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def record_id(doc: Any) -> str | None:
    """The record's own ``id`` (a string or a number), printable and at most 80 characters, or None."""
    if not isinstance(doc, dict):
        return None
    value = doc.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text[:80] or None


# -- media references -----------------------------------------------------------------------------------------


def _media_refs(doc: Any) -> list[tuple[Any, Any, str]]:
    """Every place in ``doc`` that names a media item: ``(container, index or key, kind)``."""
    out: list[tuple[Any, Any, str]] = []
    if not isinstance(doc, dict):
        return out

    def leaves(container: Any, key: Any, kind: str) -> None:
        value = container[key]
        if isinstance(value, str):
            out.append((container, key, kind))
        elif isinstance(value, list):
            for i in range(len(value)):
                leaves(value, i, kind)

    for key, kind in MEDIA_FIELDS.items():
        if key in doc:
            leaves(doc, key, kind)
    turns = doc.get("conversations", doc.get("messages", doc.get("conversation")))
    for turn in turns if isinstance(turns, list) else []:
        content = turn.get("content") if isinstance(turn, dict) else None
        for part in content if isinstance(content, list) else []:
            part_kind = _PART_TYPES.get(str(part.get("type"))) if isinstance(part, dict) else None
            if part_kind is None:
                continue
            value = part.get(part["type"])
            if isinstance(value, dict):
                key_name = next((k for k in ("url", "path") if isinstance(value.get(k), str)), None)
                if key_name is not None:
                    out.append((value, key_name, part_kind))
            elif isinstance(value, str):
                out.append((part, part["type"], part_kind))
            else:
                key_name = next((k for k in ("path", "url") if isinstance(part.get(k), str)), None)
                if key_name is not None:
                    out.append((part, key_name, part_kind))
    return out


#: Leading bytes of the media formats packtool reads, for media given as bytes without a name.
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"fLaC", "flac"),
          (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\x1aE\xdf\xa3", "mkv"))


def _extension(name: str, data: bytes | None) -> str:
    base = name.rsplit("/", 1)[-1]
    if "." in base and base.rsplit(".", 1)[-1].isalnum() and base.rsplit(".", 1)[-1].isascii():
        return base.rsplit(".", 1)[-1].lower()
    if data is not None:
        if data[:4] == b"RIFF" and data[8:12] in (b"WEBP", b"WAVE", b"AVI "):
            return {b"WEBP": "webp", b"WAVE": "wav", b"AVI ": "avi"}[data[8:12]]
        if data[4:8] == b"ftyp":
            return "mp4"
        for magic, ext in _MAGIC:
            if data.startswith(magic):
                return ext
    return "bin"


class RecordProblem(Exception):
    """Why a record cannot be used (its error row)."""


@dataclass(frozen=True)
class MediaFile:
    """A media file a record names, checked: its path, and its stamp when it was looked at."""

    path: str
    stamp: tuple


def _file_stamp(st: os.stat_result) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class MediaFolder:
    """Where a source's relative media paths are read from, and the rules for reading them."""

    def __init__(self, folder: Path, absolute: bool):
        self.folder, self.absolute = folder, absolute
        try:
            self.real = os.path.realpath(folder, strict=True)
            st = os.stat(self.real)
            self.stamp: tuple = (self.real, st.st_ino, st.st_dev)
        except OSError:
            self.real, self.stamp = str(folder), ("missing", str(folder))

    def locate(self, ref: str) -> tuple[str, tuple]:
        """The file a reference names and its stamp (``("missing", why)`` where it cannot be stat'ed); raises
        :class:`RecordProblem` for a reference that may not be read."""
        short = ref[:80]
        if "\x00" in ref or any(0xD800 <= ord(c) <= 0xDFFF for c in ref):
            raise RecordProblem(f"media path {short!r} is not a file name (a NUL or a lone surrogate)")
        if "://" in ref:
            raise RecordProblem(f"media {short!r} is a URL; packtool reads local files only (download it into the "
                                f"media folder)")
        if os.path.isabs(ref):
            if not self.absolute:
                raise RecordProblem(f"media path {short!r} is absolute; absolute paths are read only with "
                                    f"--absolute-media-paths (absolute_media_paths: true), else name files "
                                    f"relative to the media folder {self.folder}")
            path = ref
        else:
            if Path(os.path.normpath(ref)).parts[:1] == ("..",):
                raise RecordProblem(f"media path {short!r} leaves the media folder {self.folder}")
            path = os.path.join(self.folder, ref)
        try:
            st = os.stat(path)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                return path, ("missing", f"media file {short!r} not found in {self.folder} ({exc.strerror})")
            return path, ("missing", f"media file {path}: {exc.strerror or 'cannot be read'}")
        if not os.path.isabs(ref):
            real = os.path.realpath(path)
            if not (real + os.sep).startswith(self.real.rstrip(os.sep) + os.sep):
                raise RecordProblem(f"media path {short!r} is a link to {real}, outside the media folder "
                                    f"{self.folder}")
        if not stat.S_ISREG(st.st_mode):
            what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise RecordProblem(f"media path {short!r} is {what}; only regular files are read as media")
        return path, _file_stamp(st)

    def read(self, path: str, stamp: tuple) -> bytes:
        """The bytes of a located file, which must still be the regular file stamped (never blocks on a FIFO
        put in its place)."""
        if stamp[0] == "missing":
            raise RecordProblem(stamp[1])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise RecordProblem(f"media file {path}: {exc.strerror or 'cannot be read'}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or _file_stamp(st) != stamp:
                raise SourceError(f"media file {path} changed after it was encoded; run the same command again "
                                  f"to encode it anew")
            data = f.read()
        if len(data) != stamp[0]:
            raise SourceError(f"media file {path} changed while it was read; run the same command again")
        return data


@dataclass
class Resolved:
    """A record as a sample: its ``json`` member's bytes, and each media member's source: bytes or a file."""

    text: bytes
    members: list[tuple[str, bytes | MediaFile]]


def resolve(record: Record, folder: MediaFolder) -> Resolved:
    """The members of a record's sample, its media located (not read); raises :class:`RecordProblem`."""
    if record.problem is not None:
        raise RecordProblem(record.problem)
    doc, refs = record.doc, _media_refs(record.doc)
    if refs:
        try:
            doc = json.loads(json.dumps(doc))  # a private copy to rename references in
        except (TypeError, ValueError) as exc:
            raise RecordProblem(f"the record cannot be held as JSON ({exc})") from None
        refs = _media_refs(doc)
    names: dict[str, str] = {}
    members: list[tuple[str, bytes | MediaFile]] = []
    for container, key, _kind in refs:
        ref = container[key]
        if ref.startswith("data:"):
            continue  # inline data: the conversation adapter refuses it with its own reason
        if ref not in names:
            source: bytes | MediaFile
            if record.blobs and ref in record.blobs:
                source = record.blobs[ref]
                ext = _extension(ref.split(":", 2)[-1], source)
            else:
                path, stamp = folder.locate(ref)
                source = MediaFile(path, stamp)
                ext = _extension(ref, None)
            names[ref] = f"m{len(names)}.{ext}"
            members.append((names[ref], source))
        container[key] = names[ref]
    try:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError as exc:
        raise RecordProblem(f"the record's text is not valid Unicode ({exc.reason}: a cut or lone surrogate)") \
            from None
    return Resolved(text, members)


#: What the text of every JSON record that names a media item holds: a media key or content-part type (each holds
#: one of these words), or an escape that could spell one.
_MEDIA_WORDS = (b"image", b"video", b"audio", b"\\u")


def names_no_media(text: bytes) -> bool:
    """Whether a JSON record's text can name no media item (so its stamp is its bytes alone, found unparsed)."""
    return not any(word in text for word in _MEDIA_WORDS)


def text_stamp(text: bytes, folder: MediaFolder) -> str:
    """The stamp of a JSON record whose text names no media item (:func:`names_no_media`)."""
    h = hashlib.sha256(text)
    h.update(repr(folder.stamp).encode())
    return h.hexdigest()[:2 * STAMP_BYTES]


def record_stamp(record: Record, folder: MediaFolder) -> str:
    """A record's stamp: its bytes, and each media file it names as it is now (see the module doc)."""
    if record.is_json and names_no_media(record.text):
        return text_stamp(record.text, folder)
    h = hashlib.sha256(record.text)
    h.update(repr(folder.stamp).encode())
    try:
        resolved = resolve(record, folder)
    except RecordProblem as exc:
        h.update(b"problem\0" + str(exc).encode("utf-8", "replace"))
        return h.hexdigest()[:2 * STAMP_BYTES]
    for name, source in resolved.members:
        if isinstance(source, MediaFile):
            h.update(f"{name}\0{source.path}\0{source.stamp!r}\0".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:2 * STAMP_BYTES]


# -- chunks ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FileChunk:
    """Consecutive records of one file: what the pipeline treats as a source shard. Its per-record fields are
    compact (arrays, one bytes object): the command's process holds every chunk of the run."""

    kind: SourceKind
    #: The file, and the chunk's name (the ledger's ``shard``: the file's name relative to the source, and the
    #: chunk's first record in the file).
    path: str
    shard: str
    #: Position in its split of the chunk's first record (its key), and each record's place in the file: byte
    #: offsets of JSON records (``ends``: where each ends), row numbers of table rows.
    first: int
    starts: np.ndarray
    ends: np.ndarray
    media_dir: str
    absolute_media_paths: bool = False
    #: Each record's stamp (:data:`STAMP_BYTES` bytes each, one after another; set by :func:`stamp_chunk`).
    stamps: bytes = b""

    @property
    def count(self) -> int:
        return len(self.starts)

    def stamp(self, i: int) -> str:
        """Record ``i``'s stamp, as :func:`record_stamp` gives it."""
        return self.stamps[i * STAMP_BYTES:(i + 1) * STAMP_BYTES].hex()

    def folder(self) -> MediaFolder:
        return MediaFolder(Path(self.media_dir), self.absolute_media_paths)

    def records(self, first: int = 0, stop: int | None = None) -> Iterator[tuple[int, Record]]:
        """``(index in the chunk, record)`` of records ``first`` to ``stop``, streamed."""
        stop = self.count if stop is None else min(stop, self.count)
        if self.kind == "json":
            for i, text in enumerate(self.texts(first, stop), first):
                yield i, json_record(text, partial(self.where, i))
            return
        yield from self._rows(first, stop)

    def texts(self, first: int = 0, stop: int | None = None) -> Iterator[bytes]:
        """The JSON text of records ``first`` to ``stop`` of a JSON chunk, unparsed."""
        stop = self.count if stop is None else min(stop, self.count)
        with open(self.path, "rb") as f:
            for a, b in zip(self.starts[first:stop].tolist(), self.ends[first:stop].tolist()):
                f.seek(a)
                yield f.read(b - a)

    def where(self, i: int) -> str:
        """How an error names record ``i`` (found only then: counting lines reads the file up to it)."""
        name = Path(self.path).name
        return f"line {self._line(i)} of {name}" if Path(self.path).suffix.lower() == ".jsonl" \
            else f"record {self.first + i} of {name}"

    def _line(self, i: int) -> int:
        with open(self.path, "rb") as f:
            n, left = 1, int(self.starts[i])
            while left > 0:
                block = f.read(min(_BLOCK, left))
                if not block:
                    break
                n += block.count(b"\n")
                left -= len(block)
            return n

    def _rows(self, first: int, stop: int) -> Iterator[tuple[int, Record]]:
        import pyarrow as pa

        if first >= stop:
            return
        lo, hi = int(self.starts[first]), int(self.starts[stop - 1]) + 1
        try:
            for offset, batch in _table_batches(Path(self.path), self.kind, lo, hi):
                columns = _media_columns(batch.schema)
                for j, row in enumerate(batch.to_pylist()):
                    row_number = offset + j
                    if lo <= row_number < hi:
                        yield first + row_number - lo, _row_record(row, columns)
        except (OSError, pa.ArrowException) as exc:
            raise SourceError(f"cannot read {self.path}: {exc}") from None

    def samples(self, first: int = 0, stop: int | None = None, *, media: bool = True,
                max_sample_bytes: int | None = None) -> Iterator[Any]:
        """The raw samples of records ``first`` to ``stop`` (media bytes read unless ``media`` is False)."""
        folder = self.folder()
        for i, record in self.records(first, stop):
            sample = RawSample(key=self.key(i, record), shard=self.shard, index=i)
            try:
                resolved = resolve(record, folder)
                sample.parts["json"] = resolved.text
                total = len(resolved.text)
                for name, source in resolved.members:
                    if isinstance(source, MediaFile):
                        size = source.stamp[0] if source.stamp[0] != "missing" else 0
                        if max_sample_bytes is not None and total + size > max_sample_bytes:
                            raise RecordProblem(f"sample holds more than {max_sample_bytes} bytes "
                                                f"(max_sample_bytes)")
                        data = folder.read(source.path, source.stamp) if media else b""
                    else:
                        data = source
                    total += len(data)
                    sample.parts[name] = data
                    sample.ranges[name] = (0, len(data))
                if max_sample_bytes is not None and total > max_sample_bytes:
                    raise RecordProblem(f"sample holds more than {max_sample_bytes} bytes (max_sample_bytes)")
            except RecordProblem as exc:
                sample.parts.clear()
                sample.ranges.clear()
                sample.problem = str(exc)
            yield sample

    def key(self, i: int, record: Record) -> str:
        """A record's key: its position in the split, and its own ``id`` where it has one (``000000042:r42``)."""
        own = record_id(record.doc)
        return record_position(self.first + i) + (f":{own}" if own is not None else "")

    def media_bytes(self, index: int, member: str) -> bytes:
        """The bytes of member ``member`` of record ``index``, read now from the user's file or cell; the record
        must still match its stamp."""
        return self.media_of({index: {member}})[index][member]

    def media_of(self, wanted: dict[int, set[str]]) -> dict[int, dict[str, bytes]]:
        """The bytes of members ``wanted[i]`` of records ``i``, read in one pass over the records they span (a
        table's rows are decoded once, not from their row group's start for each), each record checked against
        its stamp."""
        out: dict[int, dict[str, bytes]] = {}
        if not wanted:
            return out
        folder = self.folder()
        for i, record in self.records(min(wanted), max(wanted) + 1):
            if i not in wanted:
                continue
            if self.stamps and record_stamp(record, folder) != self.stamp(i):
                raise SourceError(f"record {self.first + i} of {self.path} (or a media file it names) changed after "
                                  f"it was encoded; run the same command again to encode it anew")
            member = ""
            try:
                members = dict(resolve(record, folder).members)
                out[i] = {}
                for member in sorted(wanted[i]):
                    source = members[member]
                    out[i][member] = folder.read(source.path, source.stamp) if isinstance(source, MediaFile) \
                        else source
            except (RecordProblem, KeyError) as exc:
                raise SourceError(f"record {self.first + i} of {self.path}: {member}: {exc}") from None
        return out


def _media_columns(schema: Any) -> dict[str, str]:
    """The media columns of a table, by name (as :data:`MEDIA_FIELDS`)."""
    return {name: kind for name, kind in MEDIA_FIELDS.items() if schema.get_field_index(name) >= 0}


#: Decoded table batches kept for the media of later rows (a pack's rows come in any order), bytes at most.
_CACHE_BYTES = 64 << 20
_cache: dict[tuple[str, int], Any] = {}


def _table_batches(path: Path, kind: SourceKind, lo: int, hi: int, size: int = 16) -> Iterator[tuple[int, Any]]:
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
    for batch in _arrow_reader(path):
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


def _arrow_reader(path: Path) -> Any:
    """The record batches of an Arrow file (``save_to_disk`` writes IPC streams; IPC files are read too),
    memory-mapped."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        return (reader.get_batch(k) for k in range(reader.num_record_batches))


def stamp_chunk(chunk: FileChunk) -> FileChunk:
    """The chunk with each record's stamp (a task: workers stamp chunks in parallel)."""
    folder = chunk.folder()
    if chunk.kind != "json":
        return replace(chunk, stamps=b"".join(bytes.fromhex(record_stamp(r, folder)) for _, r in chunk.records()))
    stamps = []
    for i, text in enumerate(chunk.texts()):  # parsed only where the text could name media
        stamps.append(bytes.fromhex(text_stamp(text, folder) if names_no_media(text) else
                                    record_stamp(json_record(text, partial(chunk.where, i)), folder)))
    return replace(chunk, stamps=b"".join(stamps))


def chunk_digest(chunk: FileChunk) -> str:
    """A stamped chunk's stamp: the digest of its records' stamps and where they are."""
    h = hashlib.sha256(json.dumps([chunk.kind, chunk.path, chunk.first, chunk.media_dir,
                                   chunk.absolute_media_paths]).encode())
    h.update(chunk.stamps.hex().encode())  # each record's stamp as hex, one after another
    return h.hexdigest()


# -- the dataset ----------------------------------------------------------------------------------------------


def _chunks_of_file(kind: SourceKind, path: Path, label: str, first: int, media_dir: str,
                    absolute: bool) -> list[FileChunk]:
    """The chunks of one file, its records found by streaming (see the module doc)."""
    chunks: list[FileChunk] = []
    in_file = 0

    def close(starts: list[int], ends: list[int]) -> None:
        nonlocal first, in_file
        if starts:
            chunks.append(FileChunk(kind, str(path), f"{label}@{record_position(in_file)}", first,
                                    np.asarray(starts, np.int64), np.asarray(ends, np.int64), media_dir, absolute))
            first += len(starts)
            in_file += len(starts)

    try:
        if kind == "json":
            spans = jsonl_spans(path) if path.suffix.lower() == ".jsonl" else json_spans(path)
            starts: list[int] = []
            ends: list[int] = []
            for a, b in spans:
                starts.append(a)
                ends.append(b)
                if len(starts) == RECORDS_PER_CHUNK:
                    close(starts, ends)
                    starts, ends = [], []
            close(starts, ends)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            row = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                for a in range(row, row + n, RECORDS_PER_CHUNK):
                    close(list(range(a, min(a + RECORDS_PER_CHUNK, row + n))), [])
                row += n
        else:
            rows = sum(b.num_rows for b in _arrow_reader(path))
            for a in range(0, rows, RECORDS_PER_CHUNK):
                close(list(range(a, min(a + RECORDS_PER_CHUNK, rows))), [])
    except SourceError:
        raise
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # pyarrow's errors on a file that is not Parquet/Arrow
        raise SourceError(f"cannot read {path}: {exc}") from None
    return chunks


def open_files(src: FileSource, splits: list[str] | None = None, *, label: str | None = None) -> Any:
    """The :class:`~packtool.packer.sources.energon.SourceDataset` of a file source: its chunks as shards,
    records found by streaming (nothing is parsed or read beyond their boundaries). Chunks are named by their
    file (relative to the source folder) and first record; ``label`` (a mixture's entry name) stands for the
    source: a file's chunks are then ``<label>@<record>``, a folder's ``<label>/<file>@<record>``."""
    chosen = list(src.splits) if not splits else splits
    unknown = [s for s in chosen if s not in src.splits]
    if unknown:
        raise SourceError(f"unknown split {unknown[0]!r}; {src.path} has {', '.join(src.splits)}")
    base = src.path if src.path is not None and src.path.is_dir() else None
    media_dir = str(src.media_dir.resolve())
    chunks: dict[str, FileChunk] = {}
    splits_out: dict[str, list[str]] = {}
    for split in chosen:
        first = 0
        names: list[str] = []
        for path in src.splits[split]:
            name = Path(path.relative_to(base)).as_posix() if base is not None else path.name
            if label is not None:
                name = f"{label}/{name}" if base is not None else label
            for chunk in _chunks_of_file(src.kind, path, name, first, media_dir, src.absolute_media_paths):
                chunks[chunk.shard] = chunk
                names.append(chunk.shard)
                first += chunk.count
        if not names:
            raise SourceError(f"split {split!r} of {src.splits[split][0]} holds no records")
        splits_out[split] = names
    return FileDataset(Path(src.path or src.media_dir).resolve(), splits_out, frozenset(), {}, {n: c.count for n, c in
                                                                                     chunks.items()},
                       "", chunks=chunks, source=src)


@dataclass
class FileDataset(SourceDataset):
    """A file source opened: its chunks stand for shards (``splits`` names them)."""

    source: FileSource | None = None


# -- what the commands are given ------------------------------------------------------------------------------


def resolve_source(source: str | Path, *, media_dir: str | Path | None = None,
                   absolute_media_paths: bool = False) -> Path | FileSource:
    """What to pack for ``source``: an Energon dataset's path, or the file source it is (read in place)."""
    if is_remote(source):  # an Energon dataset in an object store
        if media_dir is not None:
            raise SourceError(f"{source} is an Energon dataset: its media are members, a media folder does not "
                              f"apply (media_dir)")
        return location(source)
    src = detect(source, media_dir, absolute_media_paths=absolute_media_paths)
    if src is None:
        if media_dir is not None and is_mixture(source):
            raise SourceError(f"{source} is a mixture: give each JSON/Parquet entry its media folder in the file "
                              f"(packtool: {{media_dir: FOLDER}}), not media_dir")
        if media_dir is not None:
            raise SourceError(f"{source} is an Energon dataset: its media are members, a media folder does not "
                              f"apply (media_dir)")
        return Path(source)
    return src


def source_for_verify(source: str | Path, output: str | Path) -> Path | FileSource:
    """What ``verify --source`` compares OUTPUT with: an Energon dataset, or the file source OUTPUT was packed
    from, read as it is now with the media folder the run recorded (so an input edited since shows up)."""
    from packtool.format import Manifest

    if is_remote(source):
        return location(source)
    if detect(source) is None:
        return Path(source)
    config = Manifest.read(output).run_config or {}
    if "media_dir" not in config:
        raise SourceError(f"{output} was not packed from a JSON/Parquet source (its source is "
                          f"{config.get('source')})")
    found = detect(source, config.get("media_dir"), absolute_media_paths=bool(config.get("absolute_media_paths")))
    assert found is not None
    return found


def recorded_source(src: FileSource) -> dict:
    """What a manifest's ``run_config`` adds for a file source: its media folder and the absolute-path rule."""
    return {"media_dir": str(src.media_dir.resolve()), "absolute_media_paths": src.absolute_media_paths}
