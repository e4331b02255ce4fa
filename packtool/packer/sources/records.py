"""A file source's records: each record's document (a JSON text, a table row), the media it names, resolved
against its media folder into the members of the raw sample its Energon equivalent is, and its stamp.

A record's stamp is the digest of its bytes (its JSON text; a row's values, media cells included) and of each media
file it names: size, modification time, inode and device, or ``missing`` (a file that appears later makes the
record stale), plus the media folder's own identity. Only regular files are read as media (a FIFO, a device or a
socket is refused before it is opened), a path may not leave the media folder (by ``..`` or by a symbolic link),
absolute paths only with ``absolute_media_paths``, and URLs are never fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packtool.errors import SourceError

#: Bytes of a record's stamp (a truncated SHA-256).
STAMP_BYTES = 16
#: Record fields (and Arrow/Parquet columns) that name media, with their kind.
MEDIA_FIELDS = {"image": "image", "images": "image", "video": "video", "videos": "video", "audio": "audio",
                "audios": "audio"}
#: Content-part types that name a media item (as :mod:`packtool.packer.sources.conversation` reads them).
_PART_TYPES = {"image": "image", "image_url": "image", "video": "video", "video_url": "video", "audio": "audio",
               "input_audio": "audio", "audio_url": "audio"}

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
def row_record(row: dict, columns: dict[str, str]) -> Record:
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


def media_columns(schema: Any) -> dict[str, str]:
    """The media columns of a table, by name (as :data:`MEDIA_FIELDS`)."""
    return {name: kind for name, kind in MEDIA_FIELDS.items() if schema.get_field_index(name) >= 0}
