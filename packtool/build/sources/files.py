"""Sources beside Energon datasets: JSON / JSONL conversations with a media folder (LLaVA, ShareGPT, OpenAI
messages), Hugging Face ``datasets`` saved to disk (Arrow) and Parquet files with media columns.

Such a source is *staged*: its records are written, in order, as the crude Energon dataset they stand for (one
WebDataset sample per record: a ``json`` member holding the record with its media references renamed to members,
plus one member per media file, byte for byte), and the pack run reads that dataset like any other. So a record
gives exactly the tokens its Energon equivalent gives, gets a ledger row with its reason, and resumes, detects
stale input and writes the same bytes whatever the workers or engine, through the one Energon path.

Staging is incremental. Records are cut into shards of :data:`RECORDS_PER_SHARD`; each shard's stamp is the
digest of its records' text plus the size and times of every media file it reads, kept in ``.nv-meta/``
:data:`STAGE_FILE`. A rerun rewrites only the shards whose stamp changed (and the pack run then re-encodes only
those), so an edited record or a replaced image is never packed stale.

What a record may hold (see :mod:`packtool.build.sources.conversation` for the conversation itself):

* media named by ``image``/``images``, ``video``/``videos`` (an entry may be a list of frames), ``audio``/
  ``audios``, or by OpenAI content parts (``{"type": "image_url", "image_url": {"url": "a.jpg"}}``,
  ``{"type": "image", "image": "a.jpg"}``): paths relative to the media folder (absolute paths are read as they
  are; a relative path may not climb out of the folder with ``..``, though it may go through a symbolic link;
  URLs are never fetched);
* in Arrow/Parquet rows, media columns named as above holding Hugging Face ``Image``/``Audio`` values
  (``{"bytes", "path"}``, one or a list) or path strings.

A record whose media cannot be read keeps its place and gets an error row naming the file and the folder looked in.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packtool.commit import commit_bytes
from packtool.errors import SourceError
from packtool.format import META
from packtool.storage import is_remote, location

#: Records per staged shard.
RECORDS_PER_SHARD = 1000
#: What staging records under ``.nv-meta``: the input, and each shard's stamp.
STAGE_FILE = "packtool-source.json"
#: Member of a staged sample that says why the record cannot be used (the conversation adapter reports it).
PROBLEM_PART = "packtool-problem"
#: Record fields (and Arrow/Parquet columns) that name media, with their kind.
MEDIA_FIELDS = {"image": "image", "images": "image", "video": "video", "videos": "video", "audio": "audio",
                "audios": "audio"}
#: Content-part types that name a media item (as :mod:`packtool.build.sources.conversation` reads them).
_PART_TYPES = {"image": "image", "image_url": "image", "video": "video", "video_url": "video", "audio": "audio",
               "input_audio": "audio", "audio_url": "audio"}
#: The file name patterns of the files of each split of a Hugging Face folder of Parquet files.
_SPLIT_NAMES = {"train": "train", "validation": "val", "val": "val", "valid": "val", "test": "test",
                "dev": "val"}

SourceKind = Literal["json", "arrow", "parquet"]


@dataclass(frozen=True)
class FileSource:
    """A source that is not an Energon dataset: its kind and the files of each split, in order."""

    kind: SourceKind
    splits: dict[str, tuple[Path, ...]]
    #: Folder that relative media paths are read from.
    media_dir: Path
    #: The file or folder given.
    path: Path | None = None

    def describe(self) -> dict:
        return {"kind": self.kind, "splits": {s: [str(f) for f in fs] for s, fs in self.splits.items()},
                "media_dir": str(self.media_dir.resolve()),
                "input": str(self.path.resolve()) if self.path is not None else None}


def is_energon(path: Path) -> bool:
    return (Path(path) / META).is_dir()


def detect(source: str | Path, media_dir: str | Path | None = None) -> FileSource | None:
    """The file source at ``source`` (None: an Energon dataset). Raises :class:`SourceError` for anything else,
    saying what packtool reads."""
    found = _detect(source, media_dir)
    return None if found is None else FileSource(found.kind, found.splits, found.media_dir, Path(source))


def _detect(source: str | Path, media_dir: str | Path | None) -> FileSource | None:
    path = Path(source)
    if not path.exists():
        raise SourceError(f"source {path} does not exist")
    if path.is_dir() and is_energon(path):
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
        return FileSource("arrow", {s: _arrow_files(path / s) for s in splits}, media)
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
            prefix = f.name.split(".")[0].split("-")[0].lower()
            splits.setdefault(_SPLIT_NAMES.get(prefix, prefix), []).append(f)
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


# -- records --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One record of a file source: the document, or why it cannot be read; ``blobs`` holds media given as bytes
    (Arrow/Parquet), keyed by the placeholder the document names them by."""

    doc: Any = None
    problem: str | None = None
    blobs: dict[str, bytes] | None = None


def json_records(path: Path) -> Iterator[Record]:
    """The records of a JSON array file or a JSONL file (blank lines skipped; a line that is not JSON is a
    record with a problem)."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            if "Extra data" not in str(exc):
                raise SourceError(f"{path} is not valid JSON: {exc}") from None
        else:
            if isinstance(doc, dict) and isinstance(doc.get("data"), list):
                doc = doc["data"]
            if not isinstance(doc, list):
                raise SourceError(f"{path} holds a JSON {type(doc).__name__}; expected a list of records")
            for d in doc:
                yield Record(d)
            return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield Record(json.loads(line))
        except ValueError as exc:
            yield Record(problem=f"line {number} of {path.name} is not valid JSON: {exc}")


def table_records(path: Path, kind: SourceKind) -> Iterator[Record]:
    """The rows of an Arrow file (as ``save_to_disk`` writes it: an IPC stream) or a Parquet file, read with
    pyarrow; media columns' bytes become blobs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        else:
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(pa.memory_map(str(path)))
            batches = iter(reader.read_all().to_batches(256))
        for batch in batches:
            for row in batch.to_pylist():
                yield _row_record(row)
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from None


def _row_record(row: dict) -> Record:
    blobs: dict[str, bytes] = {}

    def media(value: Any) -> Any:
        if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
            if value.get("bytes") is not None:
                name = f"blob:{len(blobs)}:{value.get('path') or ''}"
                blobs[name] = value["bytes"]
                return name
            return value.get("path")
        if isinstance(value, list):
            return [media(v) for v in value]
        return value

    doc = {k: (media(v) if k in MEDIA_FIELDS else v) for k, v in row.items()}
    doc = {k: v for k, v in doc.items() if _jsonable(v)}
    return Record(doc, blobs=blobs or None)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- staging --------------------------------------------------------------------------------------------------


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
                field = next((k for k in ("url", "path") if isinstance(value.get(k), str)), None)
                if field is not None:
                    out.append((value, field, part_kind))
            elif isinstance(value, str):
                out.append((part, part["type"], part_kind))
            else:
                field = next((k for k in ("path", "url") if isinstance(part.get(k), str)), None)
                if field is not None:
                    out.append((part, field, part_kind))
    return out


#: Leading bytes of the media formats packtool reads, for media given as bytes without a name.
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"fLaC", "flac"),
          (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\x1aE\xdf\xa3", "mkv"))


def _extension(name: str, data: bytes | None) -> str:
    base = name.rsplit("/", 1)[-1]
    if "." in base and base.rsplit(".", 1)[-1].isalnum():
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


@dataclass
class _Staged:
    """One record as a staged sample: its members, and the media files it read (path, size, times)."""

    members: list[tuple[str, bytes]]
    files: list[tuple[str, int, int, int]]


def _stage_record(record: Record, media_dir: Path) -> _Staged:
    """The members of one record's sample. A record that cannot be used becomes a sample whose problem member
    says why (its ledger row then carries that reason)."""
    if record.problem is not None:
        return _Staged([(PROBLEM_PART, record.problem.encode())], [])
    doc = json.loads(json.dumps(record.doc))  # a private copy to rename references in
    names: dict[str, str] = {}
    members: list[tuple[str, bytes]] = []
    files: list[tuple[str, int, int, int]] = []
    for container, key, _kind in _media_refs(doc):
        ref = container[key]
        if ref.startswith("data:"):
            continue  # inline data: the conversation adapter refuses it with its own reason
        if ref not in names:
            data: bytes | None
            if record.blobs and ref in record.blobs:
                data = record.blobs[ref]
            else:
                if "://" in ref:
                    return _problem(f"media {ref[:80]!r} is a URL; packtool reads local files only (download it "
                                    f"into the media folder)")
                path = Path(ref) if Path(ref).is_absolute() else media_dir / ref
                if not Path(ref).is_absolute() and Path(os.path.normpath(ref)).parts[:1] == ("..",):
                    return _problem(f"media path {ref[:80]!r} leaves the media folder {media_dir}")
                try:
                    with open(path, "rb") as f:
                        st = os.fstat(f.fileno())
                        data = f.read()
                except OSError as exc:
                    why = exc.strerror or "cannot be read"
                    return _problem(f"media file {ref[:80]!r} not found in {media_dir} ({why})"
                                    if isinstance(exc, FileNotFoundError) else f"media file {path}: {why}")
                files.append((str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            named = ref.split(":", 2)[-1] if record.blobs and ref in record.blobs else ref
            names[ref] = f"m{len(names)}.{_extension(named, data)}"
            members.append((names[ref], data))
        container[key] = names[ref]
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    return _Staged([("json", text), *members], files)


def _problem(reason: str) -> _Staged:
    return _Staged([(PROBLEM_PART, reason.encode())], [])


def _records(src: FileSource, split: str) -> Iterator[Record]:
    for path in src.splits[split]:
        yield from (json_records(path) if src.kind == "json" else table_records(path, src.kind))


def _shards_of(records: Iterator[Record]) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for r in records:
        chunk.append(r)
        if len(chunk) == RECORDS_PER_SHARD:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _doc_digest(chunk: list[Record], first: int) -> str:
    h = hashlib.sha256(str(first).encode())
    for r in chunk:
        h.update(json.dumps([r.doc, r.problem], sort_keys=True, default=repr).encode() + b"\0")
        for name, blob in sorted((r.blobs or {}).items()):
            h.update(name.encode() + hashlib.sha256(blob).digest())
    return h.hexdigest()


def _files_current(files: list) -> bool:
    for path, size, mtime, ctime in files:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (size, mtime, ctime):
            return False
    return True


def stage(src: FileSource, staging: str | Path, *, log: Callable[[str], None] | None = None) -> Path:
    """Write (or bring up to date) the Energon dataset ``src`` stands for in ``staging``; returns its path. A
    folder that holds anything but a previous staging is refused (nothing packtool did not write is removed); two
    runs never stage into one folder at once."""
    root = Path(staging)
    record_file = root / META / STAGE_FILE
    lock_name = "packtool-staging.lock"
    begun = {p.name for p in (root / META).iterdir()} <= {lock_name} if (root / META).is_dir() else False
    if root.exists() and not record_file.is_file() and any(p.name != META or not begun for p in root.iterdir()):
        raise SourceError(f"staging folder {root} exists and was not made by packtool; choose another (staging)")
    (root / META).mkdir(parents=True, exist_ok=True)
    with open(root / META / lock_name, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SourceError(f"another packtool run is staging into {root}") from None
        return _stage(src, root, record_file, log)


def _stage(src: FileSource, root: Path, record_file: Path, log: Callable[[str], None] | None) -> Path:
    import yaml

    from packtool.shards import write_tar

    previous = _read_json_file(record_file) if record_file.is_file() else {}
    old_shards: dict = previous.get("shards", {}) if isinstance(previous.get("shards"), dict) else {}
    shards: dict[str, dict] = {}
    split_parts: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    written = 0
    for split in src.splits:
        split_parts[split] = []
        first = 0
        for number, chunk in enumerate(_shards_of(_records(src, split))):
            name = f"shards/{split}-{number:06d}.tar"
            digest = _doc_digest(chunk, first)
            old = old_shards.get(name)
            if not (old and old.get("records") == digest and (root / name).is_file()
                    and _files_current(old.get("files", []))):
                staged = [_stage_record(r, src.media_dir) for r in chunk]
                write_tar(root / name, ((str(first + i).zfill(9), s.members) for i, s in enumerate(staged)))
                old = {"records": digest, "files": [list(f) for s in staged for f in s.files]}
                written += 1
            shards[name] = old
            split_parts[split].append(name)
            counts[name] = len(chunk)
            first += len(chunk)
        if not split_parts[split]:
            raise SourceError(f"split {split!r} of {src.splits[split][0]} holds no records")
    for name in set(old_shards) - set(shards):  # shards of a longer previous input: ours to remove
        for path in (root / name, root / (name + ".idx")):
            path.unlink(missing_ok=True)
    meta = root / META
    commit_bytes(meta / "split.yaml", yaml.safe_dump({"split_parts": split_parts}, sort_keys=True).encode())
    commit_bytes(meta / "dataset.yaml", yaml.safe_dump({"__module__": "megatron.energon",
                                                        "__class__": "CrudeWebdataset"}).encode())
    commit_bytes(meta / ".info.json", json.dumps({"shard_counts": counts}, indent=1, sort_keys=True).encode())
    commit_bytes(record_file, json.dumps({"source": src.describe(), "shards": shards}, indent=1,
                                         sort_keys=True).encode())
    if log is not None:
        log(f"staged {sum(counts.values())} records of {', '.join(src.splits)} in {root} "
            f"({written} of {len(shards)} shards written)")
    return root


def default_staging(output: str | Path) -> Path:
    """Where a file source is staged unless told: beside OUTPUT, as ``<OUTPUT>.source``."""
    if is_remote(output):
        raise SourceError(f"a JSON/Parquet source is staged on local disk: with an object-store output ({output}) "
                          f"give --staging DIR, a local folder")
    output = Path(output).resolve()
    return output.with_name(output.name + ".source")


def resolve_source(source: str | Path, output: str | Path, *, media_dir: str | Path | None = None,
                   staging: str | Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The Energon dataset to pack for ``source``: itself, or the staging of a file source."""
    if is_remote(source):  # an Energon dataset in an object store (file sources are staged from local files)
        return location(source)
    src = detect(source, media_dir)
    if src is None:
        if media_dir is not None:
            raise SourceError(f"{source} is an Energon dataset: its media are members, a media folder does not "
                              f"apply (media_dir)")
        return Path(source)
    return stage(src, staging if staging is not None else default_staging(output), log=log)


def source_for_verify(source: str | Path, output: str | Path) -> Path:
    """The Energon dataset ``verify --source`` compares OUTPUT with: ``source`` itself, or, for a file source, its
    staging as the run recorded it, brought up to date first (so an input edited since packing shows up)."""
    from packtool.format import Manifest

    if is_remote(source):
        return location(source)
    if detect(source) is None:
        return Path(source)
    manifest = Manifest.read(output)
    staged = staged_input(Path(manifest.source))
    if not staged:
        raise SourceError(f"{output} was not packed from a JSON/Parquet source (its source is {manifest.source})")
    return resolve_source(source, output, media_dir=staged.get("media_dir"), staging=manifest.source)


def staged_input(staging: Path) -> dict:
    """``{"source": the file or folder given, "media_dir": ...}`` when ``staging`` is a staged file source, else
    {}."""
    record = staging / META / STAGE_FILE
    if not record.is_file():
        return {}
    described = _read_json_file(record).get("source", {})
    if not isinstance(described, dict) or not described.get("input"):
        return {}
    return {"source": described["input"], "media_dir": described.get("media_dir"), "staging": str(staging)}
