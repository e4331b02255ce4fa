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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from packtool.errors import SourceError
from packtool.format import META, record_position
from packtool.packer.sources.energon import RawSample, SourceDataset
from packtool.packer.sources.jsonfile import READ_BLOCK, json_spans, jsonl_spans
from packtool.packer.sources.mixture import is_mixture
from packtool.packer.sources.records import (
    STAMP_BYTES,
    MediaFile,
    MediaFolder,
    Record,
    RecordProblem,
    json_record,
    media_columns,
    names_no_media,
    record_id,
    record_stamp,
    resolve,
    row_record,
    text_stamp,
)
from packtool.packer.sources.tables import arrow_reader, table_batches
from packtool.storage import is_remote, location

#: Records per chunk of a JSON/JSONL file (a Parquet chunk is a row group; an Arrow chunk this many rows).
RECORDS_PER_CHUNK = 1000
#: Split names, one mapping for every layout (Energon calls the validation split ``val``).
SPLIT_NAMES = {"train": "train", "validation": "val", "val": "val", "valid": "val", "test": "test", "dev": "val"}
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
                block = f.read(min(READ_BLOCK, left))
                if not block:
                    break
                n += block.count(b"\n")
                left -= len(block)
            return n

    def _rows(self, first: int, stop: int) -> Iterator[tuple[int, Record]]:
        import pyarrow as pa

        if first >= stop:
            return
        assert self.kind != "json"
        lo, hi = int(self.starts[first]), int(self.starts[stop - 1]) + 1
        try:
            for offset, batch in table_batches(Path(self.path), self.kind, lo, hi):
                columns = media_columns(batch.schema)
                for j, row in enumerate(batch.to_pylist()):
                    row_number = offset + j
                    if lo <= row_number < hi:
                        yield first + row_number - lo, row_record(row, columns)
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
            rows = sum(b.num_rows for b in arrow_reader(path))
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
