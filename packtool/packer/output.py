"""The OUTPUT folder's lifecycle: where it may be, who may write it, what a rerun keeps.

A run holds an exclusive lock on ``OUTPUT/.packtool/lock`` for as long as it writes. Two stamps under
``.packtool/`` record what the committed work was made with: ``encode.json`` (the encode stage's settings, model
files and source) and ``output.json`` (those plus the plan). A rerun with the same stamps resumes; one whose plan
differs reuses the encode work and re-plans; committed work made with other settings is only replaced with
``overwrite``. Nothing is touched before every check has passed.

Only what packtool writes is ever removed (:func:`written_by_packtool` names it: the work folder, the manifest and
Energon metadata, the ledger, the model files' copy, the pack shards, temporaries). A folder packtool did not make
is used only when empty, and one that holds anything else is refused, with the foreign files named, before
anything is deleted: no flag removes a user's file.

OUTPUT may be an object-store location (:mod:`packtool.storage`): ``.packtool/`` is then in the object store
too (workers on any node read the encode store), except the lock, which is a local file (:func:`lock_file`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, cast

from packtool.commit import commit_bytes, is_temporary, remove_temporaries
from packtool.errors import OutputError
from packtool.format import MANIFEST, META, TOKENIZER_DIR, TOKENIZER_FILES
from packtool.packer.store import SourceStamp
from packtool.storage import ObjectPath, is_remote, location, physical, remove_tree, resolved

#: The work folder inside OUTPUT: lock, stamps, encode store.
WORK = ".packtool"
ENCODE = f"{WORK}/encode"
#: Each write task's rows of the plan, while the shards are written (removed after).
WRITE = f"{WORK}/write"


#: Files packtool writes under ``.nv-meta`` (the manifest and Energon's metadata).
_META_FILES = frozenset({MANIFEST.split("/", 1)[1], "dataset.yaml", "split.yaml", ".info.json", ".info.yaml",
                         "index.sqlite", "index.uuid"})
#: A pack shard (``shard_path``) or its index, relative to OUTPUT.
_SHARD = re.compile(r"[^/]+/pack-\d{6}\.tar(\.idx)?")


def written_by_packtool(relative: str) -> bool:
    """Whether the file at ``relative`` (a path inside OUTPUT, ``/``-separated) is one packtool writes."""
    parts = relative.split("/")
    if parts[0] == WORK or is_temporary(parts[-1]):
        return True
    if relative in ("ledger.parquet",) or _SHARD.fullmatch(relative):
        return True
    if parts[0] == META and len(parts) == 2:
        return parts[1] in _META_FILES
    return relative.startswith(TOKENIZER_DIR + "/") and len(parts) == 3 and parts[2] in TOKENIZER_FILES


def foreign_files(output: Path) -> list[str]:
    """Files (and links) under ``output`` that packtool did not write, relative and sorted."""
    if is_remote(output):
        return sorted(rel for rel in (f.relative_to(output).as_posix() for f in cast(Any, output).files())
                      if not written_by_packtool(rel))
    found = []
    for folder, dirs, files in os.walk(output):
        rel = Path(folder).relative_to(output)
        for name in files + [d for d in dirs if Path(folder, d).is_symlink()]:
            path = (rel / name).as_posix()
            if not written_by_packtool(path) or Path(folder, name).is_symlink():
                found.append(path)
    return sorted(found)


def _same_store_overlap(source: Path, output: Path) -> bool:
    """Whether two object-store locations named through different profiles lie in one another (two profiles may
    share a bucket, one with a base path inside the other's): compared by provider, endpoint, bucket and key."""
    if not (is_remote(source) and is_remote(output)):
        return False
    a, b = physical(cast(ObjectPath, source)), physical(cast(ObjectPath, output))
    if a is None or b is None or a[:2] != b[:2]:
        return False
    return a[2] == b[2] or a[2] in b[2].parents or b[2] in a[2].parents


def _named(paths: list[str], limit: int = 3) -> str:
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def check_paths(source: Path, output: Path, model: Path | None = None) -> None:
    """Refuse an OUTPUT that is, holds or lies in SOURCE (a run or ``overwrite`` would delete source shards),
    that holds the model folder (its copy in the output would be written from files a rerun deletes), or that
    is not a folder."""
    source, output = resolved(source), resolved(output)
    if output == source or source in output.parents or output in source.parents or _same_store_overlap(source,
                                                                                                         output):
        raise OutputError(f"output {output} overlaps the source {source}; choose a folder outside it")
    if model is not None:
        model = resolved(model)
        if model == output or output in model.parents:
            raise OutputError(f"the model folder {model} lies inside the output {output}; copy it to a folder "
                              f"outside the output and pass that")
    if is_remote(output):
        if not output.parents:  # msc://PROFILE alone: --overwrite would empty the whole bucket
            raise OutputError(f"output {output} is a whole profile; choose a folder inside it")
        if output.is_file():
            raise OutputError(f"output {output} exists and is not a folder")
        return
    if output.exists() and not output.is_dir():
        raise OutputError(f"output {output} exists and is not a folder")
    parent = next((p for p in output.parents if p.exists()), None)
    if not output.exists() and parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot create {output}: {parent} is not writable")


class OutputDir:
    """An OUTPUT folder opened for one run (use as a context manager: the lock is held inside)."""

    def __init__(self, path: Path, fingerprints: dict[str, dict], *, overwrite: bool = False):
        self.path = location(path)
        self.fingerprints = fingerprints
        self.overwrite = overwrite
        #: The run replaces a finished (or partly written) output: deleted by :meth:`make_room`.
        self.replacing = False
        self._lock: IO[str] | None = None

    def __enter__(self) -> OutputDir:
        out, work = self.path, self.path / WORK
        ours = (work).is_dir() or (out / MANIFEST).exists()
        if out.exists() and not ours and any(out.iterdir()):
            raise OutputError(f"{out} exists, is not empty and was not made by packtool (it holds "
                              f"{_named(sorted(p.name for p in out.iterdir()))}); choose a new or empty folder")
        try:
            work.mkdir(parents=True, exist_ok=True)
            lock = open(lock_file(out), "a")
        except OSError as exc:
            raise OutputError(f"cannot write {out}: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise OutputError(f"another packtool run is writing {out}") from None
        self._lock = lock
        try:
            self._settle(ours)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _settle(self, ours: bool) -> None:
        """Compare the stamps with the committed work; clear what the new settings make stale."""
        out, work = self.path, self.path / WORK
        previous = {name: _read_json(work / f"{name}.json") for name in ("encode", "output")}
        encode_changed = previous["encode"] not in (None, self.fingerprints["encode"])
        output_changed = previous["output"] not in (None, self.fingerprints["output"])
        encode_committed = any((out / ENCODE).glob("*/*/*/samples.parquet"))
        output_committed = self._output_committed()
        # An encode store of other settings beside a finished output of these (a replacing run that failed) is
        # only stale work.
        finished = previous["output"] == self.fingerprints["output"] and output_committed
        if ((encode_changed and encode_committed and not finished) or (output_changed and output_committed)) \
                and not self.overwrite:
            old = previous["output"] or {"encode": previous["encode"]}
            raise OutputError(f"{out} was packed with other settings "
                              f"({'; '.join(_changes(old, self.fingerprints['output']))})", option="overwrite")
        if not finished and (encode_changed or output_changed or (self.overwrite and previous["output"] is None)):
            self._refuse_foreign()  # before any work: a run that cannot replace the output does not start
            # The finished output stays until the new run has encoded and planned (:meth:`make_room`); until
            # then ``output.json`` keeps the old stamp, so an interrupted run is still a change of settings.
            self.replacing = True
        if encode_changed:
            remove_tree(work / "encode")
            (work / "encode.json").unlink(missing_ok=True)
        remove_temporaries(out)
        for name in ("encode", "output"):
            if name == "output" and self.replacing:
                continue
            if previous[name] != self.fingerprints[name] or not (work / f"{name}.json").exists():
                commit_bytes(work / f"{name}.json", json.dumps(self.fingerprints[name], indent=1,
                                                               sort_keys=True).encode())

    def make_room(self) -> None:
        """Delete the output this run replaces (when it replaces one): called once the new run has encoded and
        planned, just before it writes, so a run that fails before then leaves the finished output as it was."""
        if self.replacing:
            self._clear(keep_encode=True)
            commit_bytes(self.path / WORK / "output.json", json.dumps(self.fingerprints["output"], indent=1,
                                                                       sort_keys=True).encode())
            self.replacing = False

    def _refuse_foreign(self) -> None:
        foreign = foreign_files(self.path)
        if foreign:
            raise OutputError(f"{self.path} holds files packtool did not write ({_named(foreign)}); move them out "
                              f"of the output first")

    def _output_committed(self) -> bool:
        manifest = _read_json(self.path / MANIFEST)
        if manifest is not None and not manifest.get("dry_run"):
            return True
        return any(p.suffix == ".tar" for p in self.path.glob("*/*.tar"))

    def _clear(self, *, keep_encode: bool) -> None:
        """Delete what packtool wrote but the lock we hold (and the encode store when ``keep_encode``); refuse,
        deleting nothing, when OUTPUT holds any other file."""
        self._refuse_foreign()
        for child in self.path.iterdir():
            if child.name == WORK:
                for inner in child.iterdir():
                    if inner.name == "lock" or (keep_encode and inner.name in ("encode", "encode.json")):
                        continue
                    remove_tree(inner)
            else:
                remove_tree(child)

    def clear_output(self) -> None:
        """Drop the written output (shards, ledger, metadata) but keep the encode work: a source shard changed
        since, so every pack must be planned and written anew (the old output packs a source that is gone)."""
        self._clear(keep_encode=True)
        commit_bytes(self.path / WORK / "output.json", json.dumps(self.fingerprints["output"], indent=1,
                                                                   sort_keys=True).encode())
        self.replacing = False

    def encode_dir(self, split: str, shard: str, part: int) -> Path:
        """Encode store of range ``part`` of source shard ``shard`` of ``split``: named by the shard
        (:func:`store_name`), never by its position, so that a mixture entry added, removed or moved leaves the
        other entries' stores in place."""
        return self.path / ENCODE / split / store_name(shard) / f"{part:06d}"

    def drop_stale_encodings(self, stamps: dict[str, SourceStamp], shards: dict[str, list[str]]) -> bool:
        """Delete the encode stores of every source shard that has changed since it was encoded (all its
        ranges: the new content may cut into other ranges); returns whether there were any. The stores of shards
        the source no longer has in a split (a mixture entry removed) are deleted too."""
        stale = set()
        for stamp_file in (self.path / ENCODE).glob("*/*/*/source.json"):
            recorded = _read_json(stamp_file)
            if recorded is not None:
                recorded.pop("range", None)  # which samples of the shard: checked by the encode task itself
            if recorded is None or recorded != asdict(stamps.get(recorded.get("shard", ""), _NO_STAMP)):
                stale.add(stamp_file.parent.parent)
        wanted = {(split, store_name(shard)) for split, names in shards.items() for shard in names}
        folders = {f.parent.parent for name in ("source.json", "samples.parquet")
                   for f in (self.path / ENCODE).glob(f"*/*/*/{name}")}
        gone = {f for f in folders if (f.parent.name, f.name) not in wanted} - stale
        for folder in sorted(stale | gone):
            remove_tree(folder)
        return bool(stale)


_NO_STAMP = SourceStamp("", -1, -1, -1, "")


def store_name(shard: str) -> str:
    """The encode store folder of a source shard: its name made a file name, and a digest of it (two names that
    read alike stay apart): ``shards/train-0001.tar`` -> ``shards_train-0001.tar-<10 hex digits>``."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shard).strip("._")[-80:]
    return f"{readable}-{hashlib.sha256(shard.encode()).hexdigest()[:10]}"


def lock_file(output: Path) -> Path:
    """The file a run locks while it writes ``output``: ``OUTPUT/.packtool/lock``; for an object-store OUTPUT a
    local file under ``PACKTOOL_WORK`` (default ``~/.cache/packtool``), ``locks/<digest of the URL>`` (runs on
    other machines are not excluded: start one run per OUTPUT)."""
    if not is_remote(output):
        return output / WORK / "lock"
    root = Path(os.environ.get("PACKTOOL_WORK") or Path.home() / ".cache" / "packtool") / "locks"
    root.mkdir(parents=True, exist_ok=True)
    return root / hashlib.sha256(str(output).encode()).hexdigest()[:32]


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``name: old -> new`` for each setting that differs (nested ones as ``encode.pack_size``)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:12] + "…" + text[-8:]
