"""JSON and JSONL files: where each record lies, found by streaming.

A JSONL file is cut at its line ends; a JSON file is a top-level array of records (or an object with a ``data``
array), whose elements the JSON decoder finds a buffer at a time (:func:`json_spans`; a byte walk only for an
element that is not plain JSON or that a buffer cuts). Only each record's byte span is kept, never the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packtool.errors import SourceError

#: Bytes read at once while streaming a JSON/JSONL file.
READ_BLOCK = 1 << 20


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
            block = f.read(READ_BLOCK)
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

    def events(self, path: Path, start: int = 0, block_size: int = READ_BLOCK) -> Iterator[tuple[int, int, int]]:
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
                buf_at, buf = start, f.read(READ_BLOCK).decode("latin-1")
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
        block = f.read(min(READ_BLOCK, end - start))
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
