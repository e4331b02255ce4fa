"""A mixture, as an Energon metadataset (``MetadatasetV2``) declares it: one SOURCE packed with one global plan
per split, each dataset's samples in its declared proportion. A dataset (an entry) is an Energon dataset or
anything else packtool reads as a SOURCE (a JSON/JSONL/Parquet/Arrow file, a folder of them, a ``save_to_disk``
folder), read in place.

Read by packtool's own parser (no Energon object is built, no dataset is opened twice). What a split may hold:

- one dataset reference (``path``, optional ``split_part``, ``subflavors``): each sample once;
- ``blend_epochized``: a list of references with ``repetitions`` r (default 1): each sample ``floor(r)`` times,
  and a deterministic subset (by digest of shard and key) of ``r - floor(r)`` of them once more;
- ``blend``: a list of references with ``weight`` w (default 1): dataset i takes the share ``w_i / sum(w)`` of
  the split's samples over one pass. The pass is as long as the largest dataset needs, so no dataset repeats a
  sample more than its share needs: with ``n_i`` samples, the pass holds ``N = max_i(n_i * W / w_i)`` samples and
  dataset i contributes ``N * w_i / W``, i.e. its samples ``N w_i / (W n_i)`` times (at least once);
- a reference's ``path`` may name another metadataset YAML: its datasets come in with their repetitions
  multiplied by the reference's (``blend_epochized``), or their weights scaled to the reference's (``blend``).

A reference's ``packtool:`` mapping holds packtool's own options for it (Energon never reads them):
``loss_weight`` (a factor on each of its samples' loss weights, multiplied through nested metadatasets),
``group`` (a packing group: packs never hold samples of two groups; a nested metadataset's group is its
datasets'; within a split either every dataset has a group or none has), and for a file entry ``media_dir`` (the
folder its relative media paths are read from, relative to the file naming it; default the entry's own folder) and
``absolute_media_paths``. A file entry is taken whole when it has one split and names no ``split_part``; one
with several (a ``dataset_dict.json`` folder, ``train``/``val`` files) gives the split named ``split_part``
(default the mixture's split).

A split mixing ``blend`` and ``blend_epochized`` (Energon refuses it too), ``join``, ``subset``, ``aux``,
``dataset_config`` and ``split_config`` are refused, each with one line. Every dataset is named by its folder
relative to the metadataset's folder (``:part`` added when its ``split_part`` is not the split's name); the name
is stable, is written into each pack segment (``dataset``) and each ledger row, and the same dataset and part may
appear only once per split.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.errors import FormatError, SourceError
from packtool.format import META, read_mapping

if TYPE_CHECKING:
    from packtool.packer.sources.energon import SourceDataset
    from packtool.packer.sources.files import FileSource

#: The keys a dataset reference may have (the others are refused by name).
_REFERENCE_KEYS = {"path", "split_part", "subflavors", "weight", "repetitions", "shuffle_over_epochs_multiplier",
                   "packtool"}
#: The keys of a reference's ``packtool:`` mapping (packtool's own options for the entry, which Energon never
#: reads; see the module docstring).
PACKTOOL_KEYS = frozenset({"loss_weight", "group", "media_dir", "absolute_media_paths"})
#: Those only a file entry (not an Energon dataset, whose media are members) takes.
FILE_KEYS = frozenset({"media_dir", "absolute_media_paths"})
_UNSUPPORTED = {"join": "joined datasets", "subset": "subsets", "aux": "auxiliary datasets",
                "dataset_config": "another dataset.yaml", "split_config": "another split.yaml"}


@dataclass(frozen=True)
class MixtureEntry:
    """One dataset of a split of the mixture."""

    name: str
    root: Path
    split_part: str
    #: ``blend`` weight (scaled through nested metadatasets), or None under ``blend_epochized``.
    weight: float | None = None
    #: ``blend_epochized`` repetitions (multiplied through nested metadatasets), or None under ``blend``.
    repetitions: float | None = None
    subflavors: dict = field(default_factory=dict)
    #: The factor on each sample's loss weight (``packtool: {loss_weight: F}``, multiplied through nested
    #: metadatasets); 1 by default.
    loss_weight: float = 1.0
    #: The packing group (``packtool: {group: NAME}``), or None.
    group: str | None = None
    #: ``energon``, or the kind of a file entry (``json``, ``parquet``, ``arrow``).
    kind: str = "energon"
    #: A file entry's media folder (relative to the mixture file's folder) and absolute-path rule.
    media_dir: str | None = None
    absolute_media_paths: bool = False
    #: A file entry's source, as packtool reads it alone (its chosen split only).
    source: FileSource | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Mixture:
    """A metadataset read: its file, and each split's datasets."""

    path: Path
    splits: dict[str, list[MixtureEntry]]

    def names(self) -> list[str]:
        """Every dataset name, in order of first appearance (a segment's dataset index is its place here)."""
        out: list[str] = []
        for entries in self.splits.values():
            out += [e.name for e in entries if e.name not in out]
        return out

    def groups(self, split: str) -> list[str]:
        """The split's packing groups, in order of first appearance (empty: one plan)."""
        out: list[str] = []
        for e in self.splits.get(split, []):
            if e.group is not None and e.group not in out:
                out.append(e.group)
        return out

    def describe(self) -> dict:
        """The mixture as plain values (manifest and output fingerprint): each entry's fields that are not their
        defaults."""
        return {"path": str(self.path), "datasets": self.names(),
                "splits": {s: [_described(e) for e in entries] for s, entries in self.splits.items()}}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()


_KEEP = object()  # a field always described (name, split_part)
#: What an entry's field is unless the mixture says otherwise (such fields are not described).
_DEFAULTS: dict[str, Any] = {"weight": None, "repetitions": None, "subflavors": {}, "loss_weight": 1.0, "group": None,
             "kind": "energon", "media_dir": None, "absolute_media_paths": False}


def _described(e: MixtureEntry) -> dict:
    return {f.name: getattr(e, f.name) for f in fields(e)
            if f.name not in ("root", "source") and getattr(e, f.name) != _DEFAULTS.get(f.name, _KEEP)}


def is_mixture(path: str | Path) -> bool:
    """Whether ``path`` is a file SOURCE packtool reads as a metadataset (a ``.yaml``/``.yml`` file)."""
    p = Path(path)
    return p.suffix.lower() in (".yaml", ".yml") and p.is_file()


def read_mixture(path: str | Path) -> Mixture:
    """The metadataset at ``path`` (see the module docstring); :class:`SourceError` for anything else."""
    path = Path(path).resolve()
    top = _read(path)
    splits: dict[str, list[MixtureEntry]] = {}
    for split, node in top.items():
        entries = _split_entries(path, path.parent, split, node, scale=1.0, seen=(path,))
        if len({e.weight is None for e in entries}) > 1:
            raise SourceError(f"{path}: split {split!r} mixes blend weights and blend_epochized repetitions "
                              f"(through a nested metadataset); choose one")
        names = [(e.name, e.split_part) for e in entries]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise SourceError(f"{path}: split {split!r} names dataset {dup[0]} twice; give it once, with its "
                              f"weight or repetitions")
        grouped = next((e for e in entries if e.group is not None), None)
        loose = next((e for e in entries if e.group is None), None)
        if grouped is not None and loose is not None:
            raise SourceError(f"{path}: split {split!r}, dataset {loose.name} has no packing group while "
                              f"{grouped.name} has group {grouped.group!r}; give every dataset of the split a "
                              f"group (packtool: {{group: NAME}}), or none")
        splits[split] = entries
    return Mixture(path, splits)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = read_mapping(path, "metadataset")
    except FormatError as exc:
        raise SourceError(str(exc)) from None
    cls = data.get("__class__")
    if cls != "MetadatasetV2":
        raise SourceError(f"{path}: not an Energon metadataset (__class__ {cls!r}; packtool reads MetadatasetV2)")
    splits = data.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise SourceError(f"{path}: `splits` must map split names to datasets")
    return splits


def _split_entries(top: Path, base: Path, split: str, node: Any, *, scale: float,
                   seen: tuple[Path, ...]) -> list[MixtureEntry]:
    """The datasets of one split node (a reference, ``blend`` or ``blend_epochized``), with weights scaled or
    repetitions multiplied by ``scale``."""
    where = f"{seen[-1]}: split {split!r}"
    if not isinstance(node, dict):
        raise SourceError(f"{where}: expected a mapping, not {type(node).__name__}")
    bad = sorted(set(node) & set(_UNSUPPORTED))
    if bad:
        raise SourceError(f"{where}: {bad[0]} ({_UNSUPPORTED[bad[0]]}) is not supported by packtool; pack those "
                          f"datasets without it")
    if "blend" in node and "blend_epochized" in node:
        raise SourceError(f"{where}: blend and blend_epochized together; choose one")
    for mode in ("blend", "blend_epochized"):
        if mode in node:
            extra = sorted(set(node) - {mode})
            if extra:
                raise SourceError(f"{where}: unknown key {extra[0]!r} beside {mode}")
            items = node[mode]
            if not isinstance(items, list) or not items:
                raise SourceError(f"{where}: {mode} must be a non-empty list of datasets")
            key = "weight" if mode == "blend" else "repetitions"
            total = sum(_number(i, key, where) for i in items) if mode == "blend" else 1.0
            out: list[MixtureEntry] = []
            for item in items:
                factor = _number(item, key, where) * scale / total
                out += _reference(top, base, split, item, mode, factor, seen)
            return out
    return _reference(top, base, split, node, None, scale, seen)


def _number(item: Any, key: str, where: str) -> float:
    if not isinstance(item, dict):
        raise SourceError(f"{where}: a blend entry must be a mapping, not {type(item).__name__}")
    other = "repetitions" if key == "weight" else "weight"
    if other in item:
        raise SourceError(f"{where}: {other} in a {'blend' if key == 'weight' else 'blend_epochized'} entry; "
                          f"use {key}")
    value = item.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SourceError(f"{where}: {key} must be a positive number, not {value!r}")
    return float(value)


def _reference(top: Path, base: Path, split: str, item: dict, mode: str | None, factor: float,
               seen: tuple[Path, ...]) -> list[MixtureEntry]:
    where = f"{seen[-1]}: split {split!r}"
    unknown = sorted(set(item) - _REFERENCE_KEYS - set(_UNSUPPORTED))
    if unknown:
        raise SourceError(f"{where}: unknown key {unknown[0]!r} in a dataset reference")
    bad = sorted(set(item) & set(_UNSUPPORTED))
    if bad:
        raise SourceError(f"{where}: {bad[0]} ({_UNSUPPORTED[bad[0]]}) is not supported by packtool")
    if not isinstance(item.get("path"), str):
        raise SourceError(f"{where}: a dataset reference needs a path")
    if item.get("shuffle_over_epochs_multiplier", 1) != 1:  # Energon's train-time shuffle: nothing a pack holds
        raise SourceError(f"{where}: shuffle_over_epochs_multiplier (Energon's shuffling while training) does not "
                          f"apply to packing; remove it, or set it on the metadataset that reads the packs")
    target = (base / item["path"]).resolve()
    part = item.get("split_part", split)
    if not isinstance(part, str):
        raise SourceError(f"{where}: split_part must be a split name, not {part!r}")
    subflavors = item.get("subflavors") or {}
    own = _packtool_options(item.get("packtool"), where)
    factor_w = own.get("loss_weight", 1.0)
    group = own.get("group")
    if target.is_file() and target.suffix.lower() in (".yaml", ".yml"):  # a nested metadataset
        if target in seen:
            raise SourceError(f"{where}: {target} includes itself")
        if set(own) & FILE_KEYS:
            raise SourceError(f"{where}: packtool: {sorted(set(own) & FILE_KEYS)[0]} applies to one file entry, "
                              f"not to the metadataset {item['path']}; set it on its entries")
        inner = _read(target)
        if part not in inner:
            raise SourceError(f"{where}: {target} has no split {part!r} (it has {', '.join(inner)})")
        entries = _split_entries(top, target.parent, part, inner[part], scale=factor, seen=(*seen, target))
        twice = next((e for e in entries if group is not None and e.group not in (None, group)), None)
        if twice is not None:
            raise SourceError(f"{where}: {item['path']} has group {group!r}, and its dataset {twice.name} group "
                              f"{twice.group!r}; set the group in one place")
        return [replace(e, subflavors={**subflavors, **e.subflavors}, loss_weight=e.loss_weight * factor_w,
                        group=e.group if e.group is not None else group) for e in entries]
    if not target.exists():
        raise SourceError(f"{where}: dataset {item['path']} does not exist (under {base})")
    name = Path(os.path.relpath(target, top.parent)).as_posix()
    weight, reps = (factor, None) if mode == "blend" else (None, factor)
    if not (target / META).is_dir():
        return [_file_entry(top, base, split, item, name, target, own, where, weight, reps, factor_w, group)]
    if set(own) & FILE_KEYS:
        raise SourceError(f"{where}: dataset {item['path']} is an Energon dataset (its media are its members): "
                          f"packtool: {sorted(set(own) & FILE_KEYS)[0]} is for JSON/Parquet/Arrow entries")
    if part != split:
        name = f"{name}:{part}"
    return [MixtureEntry(name, target, part, weight, reps, dict(subflavors), factor_w, group)]


def _file_entry(top: Path, base: Path, split: str, item: dict, name: str, target: Path, own: dict, where: str,
                weight: float | None, reps: float | None, factor_w: float, group: str | None) -> MixtureEntry:
    """A dataset reference naming a file source (:func:`~packtool.packer.sources.files.detect`)."""
    from packtool.packer.sources.files import detect

    if item.get("subflavors"):
        raise SourceError(f"{where}: dataset {item['path']} is not an Energon dataset: subflavors apply to Energon "
                          f"datasets only")
    media = own.get("media_dir")
    media_path = (base / media).resolve() if isinstance(media, str) else None
    try:
        found = detect(target, media_path, absolute_media_paths=bool(own.get("absolute_media_paths")))
    except SourceError as exc:
        raise SourceError(f"{where}, dataset {item['path']}: {exc}") from None
    assert found is not None  # an Energon folder is read above
    if "split_part" in item or len(found.splits) > 1:
        part = item.get("split_part", split)
        if part not in found.splits:
            raise SourceError(f"{where}, dataset {item['path']}: it has no split {part!r} (it has "
                              f"{', '.join(found.splits)}); name one with split_part")
        if part != split:
            name = f"{name}:{part}"
    else:  # one split: the entry whole
        part = next(iter(found.splits))
    chosen = replace(found, splits={part: found.splits[part]})
    media_dir = None if media_path is None else Path(os.path.relpath(media_path, top.parent)).as_posix()
    return MixtureEntry(name, target, part, weight, reps, {}, factor_w, group, found.kind, media_dir,
                        found.absolute_media_paths, chosen)


def _packtool_options(options: Any, where: str) -> dict[str, Any]:
    """A reference's ``packtool:`` mapping checked (:data:`PACKTOOL_KEYS`); empty where it has none."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise SourceError(f"{where}: packtool: must be a mapping of packtool's options, not {options!r}")
    unknown = sorted(set(options) - PACKTOOL_KEYS)
    if unknown:
        known = ", ".join(sorted(PACKTOOL_KEYS))
        raise SourceError(f"{where}: unknown packtool option {unknown[0]!r} (known: {known})")
    value = options.get("loss_weight", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SourceError(f"{where}: packtool: loss_weight must be a finite number >= 0, not {value!r}")
    out: dict[str, Any] = {"loss_weight": float(value)} if "loss_weight" in options else {}
    if "group" in options:
        group = options["group"]
        if not isinstance(group, (str, int)) or isinstance(group, bool) or not str(group).strip():
            raise SourceError(f"{where}: packtool: group must be a name, not {group!r}")
        out["group"] = str(group)
    if "media_dir" in options:
        if not isinstance(options["media_dir"], str) or not options["media_dir"]:
            raise SourceError(f"{where}: packtool: media_dir must be a folder path, not {options['media_dir']!r}")
        out["media_dir"] = options["media_dir"]
    if "absolute_media_paths" in options:
        if not isinstance(options["absolute_media_paths"], bool):
            raise SourceError(f"{where}: packtool: absolute_media_paths must be true or false, not "
                              f"{options['absolute_media_paths']!r}")
        out["absolute_media_paths"] = options["absolute_media_paths"]
    return out


def open_mixture(path: str | Path, splits: list[str] | None = None) -> SourceDataset:
    """The metadataset at ``path`` opened as one source: each Energon dataset opened as its metadata says, its
    shards named relative to the Energon datasets' common folder (the source's root); each file entry opened as
    it is alone, its chunks named by the entry."""
    from packtool.packer.sources.energon import SourceDataset, open_source
    from packtool.packer.sources.files import FileChunk, open_files

    mixture = read_mixture(path)
    chosen = list(mixture.splits) if not splits else splits
    unknown = [s for s in chosen if s not in mixture.splits]
    if unknown:
        raise SourceError(f"unknown split {unknown[0]!r}; {mixture.path} has {', '.join(mixture.splits)}")

    def entry(split: str, e: MixtureEntry) -> SourceDataset:
        try:
            if e.source is not None:
                return open_files(e.source, [e.split_part], label=e.name)
            return open_source(e.root, [e.split_part])
        except SourceError as exc:  # the entry and the file it comes from, before what went wrong
            raise SourceError(f"{mixture.path}: split {split!r}, dataset {e.name} ({e.root}): {exc}") from None

    opened = {(s, e.name): entry(s, e) for s in chosen for e in mixture.splits[s]}
    tars = [str(e.root) for s in chosen for e in mixture.splits[s] if e.source is None]
    root = Path(os.path.commonpath(tars)) if tars else mixture.path.parent
    shards: dict[str, list[str]] = {}
    dataset_of: dict[str, str] = {}
    parts: dict[str, tuple[dict, str]] = {}
    excluded: set[str] = set()
    counts: dict[str, int] = {}
    chunks: dict[str, FileChunk] = {}
    for split in chosen:
        shards[split] = []
        for e in mixture.splits[split]:
            src = opened[(split, e.name)]
            prefix = "." if e.source is not None else Path(os.path.relpath(e.root, root)).as_posix()
            for shard in src.splits[e.split_part]:
                name = shard if prefix == "." else f"{prefix}/{shard}"
                if name in dataset_of:
                    raise SourceError(f"{mixture.path}: shard {name} is packed twice (datasets "
                                      f"{dataset_of[name]!r} and {e.name!r}); name each dataset once per split "
                                      f"and keep the splits' datasets apart")
                dataset_of[name] = e.name
                shards[split].append(name)
                if shard in src.shard_counts:
                    counts[name] = src.shard_counts[shard]
            excluded |= {x if prefix == "." else f"{prefix}/{x}" for x in src.excluded_samples}
            chunks.update(src.chunks)
            metadata = src.metadata if e.source is None else hashlib.sha256(
                json.dumps(e.source.describe(), sort_keys=True).encode()).hexdigest()
            parts[e.name] = (src.dataset_yaml, metadata)
    digest = hashlib.sha256("".join(f"{n}\0{m}\0" for n, (_, m) in sorted(parts.items())).encode()).hexdigest()
    first_yaml = next((y for y, _ in parts.values() if y), {})
    return SourceDataset(root, shards, frozenset(excluded), first_yaml, counts, digest, mixture=mixture,
                         dataset_of=dataset_of, parts=parts, chunks=chunks)
