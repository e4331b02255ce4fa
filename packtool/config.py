"""A ``pack`` run written down: every setting by name, from a YAML file, flags or keyword arguments.

:data:`KEYS` is the one list of what a run takes: the fields of :class:`~packtool.settings.EncodeSettings`,
:class:`~packtool.settings.PlanSettings` and :class:`~packtool.settings.RunOptions`, plus the source, the
output, ``split``, ``media_dir``, ``absolute_media_paths`` and the parallel sizes ``align`` derives from
(``staging`` is refused: file sources are read in place). The command line has one flag per key (a test
holds them equal), the config file and :func:`packtool.pack` take the same names.

Values are merged in this order: the settings' defaults, the config file, then what was given explicitly (flags or
keyword arguments). A preset fills only the settings nobody gave: one given explicitly, from the file or a flag,
that differs from the preset is an error (even when it equals the default, e.g. ``media_first: false``).

The settings as they took effect are recorded in the manifest (``run_config``, :func:`recorded_config`: never the
output folder or how the run went, so the same settings write the same manifest) and print back as a config file
(:func:`dump`): ``packtool pack ... --print-config`` and ``packtool inspect OUTPUT --config``.
"""

from __future__ import annotations

import os
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from packtool.errors import ConfigError
from packtool.families.conventions import CONVENTIONS
from packtool.settings import (
    PRESETS,
    EncodeSettings,
    Holdout,
    PackSettings,
    Parallel,
    PlanSettings,
    RunOptions,
    ShardSize,
    alignment_for,
    default,
    help_of,
    resolve_align,
)
from packtool.storage import is_remote, location

_ENCODE = tuple(f.name for f in fields(EncodeSettings))
_PLAN = tuple(f.name for f in fields(PlanSettings))
_RUN = tuple(f.name for f in fields(RunOptions))


@dataclass(frozen=True)
class Key:
    """One key of a pack run, declared once: its name, its type (as a config file writes it), its default and its
    line in ``packtool pack --help`` (the command's options are generated from the keys). The settings classes'
    fields are keys as they are declared (:func:`packtool.settings.setting`); the others are :data:`EXTRA` and
    :data:`HOLDOUT`."""

    name: str
    kind: Any
    default: Any
    help: str


#: The keys besides the settings classes' fields: what is read, and the split to pack (:data:`HOLDOUT`, the split
#: held out).
EXTRA = (
    Key("source", str, None, "Energon dataset (a folder or msc://PROFILE/path), .json/.jsonl conversations (LLaVA, "
                             "ShareGPT, OpenAI messages), Parquet, or a save_to_disk folder."),
    Key("output", str, None, "Output folder (or msc://PROFILE/path): a packed Energon dataset."),
    Key("media_dir", str | None, None, "Folder of the media a JSON/Parquet source names (default: the source's "
                                       "folder)."),
    Key("absolute_media_paths", bool, False, "Read absolute media paths of a JSON/Parquet source (else each is its "
                                             "record's error)."),
    Key("staging", str | None, None, "Refused: JSON/Parquet sources are read in place."),
    Key("split", str | list[str] | None, (), "Split to pack (repeatable); default: all in split.yaml."),
)
#: The keys of a held-out split (:class:`~packtool.settings.Holdout`).
HOLDOUT = (
    Key("val_ratio", float | None, None, "Hold this share of train's kept samples out as the val split (rounded "
                                         "half up; chosen by digest, not position)."),
    Key("val_count", int | None, None, "Hold this many of train's kept samples out as the val split (all, when it "
                                       "has fewer)."),
)
#: Settings fields a run takes with another type or default: those it requires (no default: the run says where to
#: give each), ``align`` (derived from the parallel sizes when unset) and ``workers`` (unset: one per core).
_RUN_KINDS: dict[str, tuple[Any, Any]] = {"tokenizer": (str, None), "pack_size": (int, None),
                                          "align": (int | None, None), "workers": (int | None, None)}


def _fields(cls: type) -> list[Key]:
    """The keys of a settings class: its fields as declared (with :data:`_RUN_KINDS`' type and default)."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        kind, value = _RUN_KINDS[f.name] if f.name in _RUN_KINDS else (hints[f.name], default(cls, f.name))
        out.append(Key(f.name, kind, str(value) if isinstance(value, ShardSize) else value, help_of(cls, f.name)))
    return out


#: Every key a pack run takes, by name, in the order a config file and ``--help`` list them.
SPEC: dict[str, Key] = {k.name: k for k in (*EXTRA, *_fields(Parallel), *HOLDOUT, *_fields(EncodeSettings),
                                            *_fields(PlanSettings), *_fields(RunOptions))}
#: Every key's name.
KEYS = tuple(SPEC)
#: Keys that name files: relative paths in a config file are read relative to the file's folder.
PATH_KEYS = ("source", "output", "media_dir", "staging", "tokenizer")


def _key_types() -> dict[str, Any]:
    return {k.name: k.kind for k in SPEC.values()}


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of type ``kind`` as a config file writes it: booleans only ``true``/``false`` (never a
    string, never a number), integers never booleans, floats also integers, a shard size a string or a count, a
    path a string (or a path object, from Python)."""
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(_fits(value, k) for k in get_args(kind))
    if origin is Literal:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_fits(v, get_args(kind)[0]) for v in value)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is ShardSize:
        return isinstance(value, (str, ShardSize)) or (isinstance(value, int) and not isinstance(value, bool))
    if kind is str:
        return isinstance(value, (str, os.PathLike))
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        names = [_describe(k) for k in get_args(kind) if k is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in get_args(kind) else "")
    if origin is Literal:
        return "one of " + ", ".join(get_args(kind))
    if origin is list:
        return f"a list of {_describe(get_args(kind)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            ShardSize: "a pack count or a size like 512MB"}.get(kind, getattr(kind, "__name__", str(kind)))


def check_types(values: Mapping[str, Any], where: str = "") -> None:
    """Every value of ``values`` has its key's type (:data:`KEYS`); else a :class:`ConfigError` naming the key
    (and ``where`` it was given, e.g. the config file)."""
    kinds = _key_types()
    for key, value in values.items():
        if key in kinds and not _fits(value, kinds[key]):
            raise ConfigError(f"{where}{key} must be {_describe(kinds[key])}, not {value!r}")
    workers = values.get("workers")
    if isinstance(workers, int) and not isinstance(workers, bool) and workers < 1:
        raise ConfigError(f"{where}workers must be at least 1 (leave it unset for one per core), not {workers}")


def defaults() -> dict[str, Any]:
    """Every key with its default value."""
    return {k.name: list(k.default) if isinstance(k.default, tuple) else k.default for k in SPEC.values()}


def read(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML config file (a mapping of :data:`KEYS`); paths in it are taken relative to its
    folder."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping of settings")
    spelled: dict[str, str] = {}
    for k in data:
        name = str(k).replace("-", "_")
        if name in spelled:
            raise ConfigError(f"config file {path}: {spelled[name]!r} and {k!r} are the same setting; give it once")
        spelled[name] = str(k)
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting {unknown[0]!r} (see `packtool pack --help`)")
    check_types(data, f"config file {path}: ")
    for key in PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str) and is_remote(value):
            continue
        if isinstance(value, str) and key != "tokenizer" and not Path(value).expanduser().is_absolute():
            data[key] = str(path.parent / value)
        elif key == "tokenizer" and isinstance(value, str) and (path.parent / value).is_dir():
            data[key] = str(path.parent / value)
    return data


#: What a run that lacks a required setting is told: where each is given.
REQUIRED = {
    "source": "SOURCE is required: `packtool pack SOURCE OUTPUT ...`, or `source:` in the config file",
    "output": "OUTPUT is required: `packtool pack SOURCE OUTPUT ...`, `packtool pack OUTPUT --config FILE` when FILE "
              "names the source, or `output:` in the config file",
    "tokenizer": "tokenizer is required: --tokenizer MODEL, or `tokenizer:` in the config file",
    "pack_size": "pack_size is required: --pack-size N, or `pack_size:` in the config file",
}


@dataclass(frozen=True)
class PackRun:
    """One pack run, built from merged values and checked."""

    source: Path
    output: Path
    settings: PackSettings
    options: RunOptions
    media_dir: Path | None
    #: Whether a file source's absolute media paths are read (else each is its record's error).
    absolute_media_paths: bool
    #: The merged values, as :func:`dump` writes them (paths as given, the tokenizer as given: a folder or an id).
    config: dict


def origins(config: Mapping[str, Any] | None, explicit: Mapping[str, Any], path: str | Path | None) -> dict[str, str]:
    """Key -> the config file ``path`` for each value the file sets and nothing overrides (for :func:`build`)."""
    return {k: str(path) for k in (config or {}) if k not in explicit} if path is not None else {}


def merge(config: Mapping[str, Any] | None, explicit: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Defaults, then the config file's values, then the explicit ones; and the names of every value given."""
    unknown = sorted(set(explicit) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}")
    check_types(explicit)
    values = defaults()
    values.update(config or {})
    values.update(explicit)
    return values, set(config or {}) | set(explicit)


def build(values: Mapping[str, Any], given: Collection[str], origin: Mapping[str, str] | None = None, *,
          need_output: bool = True) -> PackRun:
    """The run ``values`` describe (``given``: the keys set by a file, a flag or an argument, for the preset;
    ``origin``: key -> the config file it came from, named in a conflict's message; ``need_output``: False to
    print the settings of a run that names no output yet)."""
    origin = origin or {}

    def came_from(*keys: str) -> str:
        files = [f"{k} is set in {origin[k]}" for k in keys if k in origin]
        return f" ({'; '.join(files)})" if files else ""

    from packtool.hub import resolve_model
    from packtool.packer.engine import default_workers

    values = dict(values)
    if values.get("staging") is not None:
        raise ConfigError("staging: JSON/JSONL, Parquet and save_to_disk sources are read in place, nothing is "
                          "staged; remove the staging option")
    for key in ("source", "output", "tokenizer", "pack_size"):
        if values.get(key) is None and (key != "output" or need_output):
            raise ConfigError(REQUIRED[key])
    preset = values.get("preset")
    tokenizer = values["tokenizer"] if is_remote(values["tokenizer"]) else resolve_model(values["tokenizer"])
    why = CONVENTIONS[preset].no_context_parallel if preset in CONVENTIONS else None
    if why and values["cp_size"] > 1:
        raise ConfigError(f"preset {preset} with cp_size > 1: {why}; pack with cp_size 1 and train with context "
                          f"parallel 1")
    try:
        parallel = Parallel(values["align_for"], values["cp_size"], values["tp_size"],
                            bool(values["sequence_parallel"]))
        align = resolve_align(values["align"], parallel.align_for, cp_size=parallel.cp_size,
                              tp_size=parallel.tp_size, sequence_parallel=parallel.sequence_parallel)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{came_from('align', 'align_for', 'cp_size', 'tp_size', 'sequence_parallel')}") \
            from None
    # the preset is applied once, by the settings, told what was given and where
    encode = EncodeSettings(**{**{k: values[k] for k in _ENCODE}, "tokenizer": str(tokenizer), "align": align},
                            given=set(given), origin=origin)
    values.update({name: getattr(encode, name) for name in PRESETS.get(str(preset), {})})  # as they took effect
    plan = PlanSettings(**{k: values[k] for k in _PLAN})
    options = RunOptions(**{**{k: values[k] for k in _RUN}, "workers": values["workers"] or default_workers()})
    split = values["split"] or []
    if isinstance(split, str):
        split = [split]
    holdout = None
    if values["val_ratio"] is not None or values["val_count"] is not None:
        holdout = Holdout(values["val_ratio"], values["val_count"])
    settings = PackSettings(encode, plan, tuple(split), holdout, parallel if parallel.describe() else None)
    media_dir = values.get("media_dir")
    config = {k: _plain(values[k]) for k in KEYS}
    for key in PATH_KEYS:  # recorded absolute, so the printed config runs from anywhere
        value = config[key]
        if value is not None and not is_remote(value) and (key != "tokenizer" or Path(value).expanduser().is_dir()):
            config[key] = str(Path(value).expanduser().resolve())
    return PackRun(location(values["source"]), location(values["output"] or "."), settings, options,
                   Path(media_dir) if media_dir is not None else None, bool(values["absolute_media_paths"]), config)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if value is not None and not isinstance(value, (str, int, float, bool, list, dict)):
        return str(value)
    return value


#: Keys a printed config leaves out: how a run goes on this machine, not what it makes.
_MACHINE_KEYS = ("workers", "progress", "ray_address")


def dump(config: Mapping[str, Any], *, all_keys: bool = False) -> str:
    """``config`` as a YAML config file: the values that differ from the defaults (every key with
    ``all_keys``), in :data:`KEYS` order."""
    import yaml

    base = defaults()
    keep = {k: config[k] for k in KEYS if k in config and (all_keys or (config[k] != base[k]
                                                                      and k not in _MACHINE_KEYS))}
    return yaml.safe_dump(keep, sort_keys=False, allow_unicode=True)


def recorded_config(settings: PackSettings, source: Path) -> dict:
    """What the manifest records as ``run_config``: the packed source and every setting as it took effect (the
    tokenizer as the folder read, ``align`` as derived), a function of the settings alone, so a run from the
    command line, from :func:`packtool.pack` or from the pipeline, on any engine, writes the same manifest."""
    from dataclasses import asdict

    encode = asdict(settings.encode)
    if encode["thinking_trace_format"] == default(EncodeSettings, "thinking_trace_format"):
        del encode["thinking_trace_format"]  # added later: recorded only when set, so older outputs keep their bytes
    plan = {**asdict(settings.plan), "shard_size": str(settings.plan.shard_size)}
    held = settings.holdout.describe() if settings.holdout is not None else {}  # recorded only when set
    sizes = settings.parallel.describe() if settings.parallel is not None else {}  # recorded only when set
    return {"source": str(source), "tokenizer": encode.pop("tokenizer"), "split": list(settings.splits),
            **encode, **plan, **held, **sizes}


#: The parallel sizes a run's config records when set (:class:`packtool.settings.Parallel`).
_PARALLEL_KEYS = tuple(f.name for f in fields(Parallel))


def recorded(output: str | Path, relative_to: Path | None = None) -> str:
    """The config file of the run that made ``output``, from the settings its manifest records as they took effect
    (``run_config``, with its media folder for a JSON/Parquet source), written to be reused: a model folder in the
    local hub cache as its model id, values that equal packtool's defaults left out, and the values the run
    derived as comments, never set (each a preset's, and ``align`` where the recorded parallel sizes derive it), so
    the file reused with other flags (``--tp-size 4 --cp-size 2``) sets nothing a preset or those sizes decide.
    With ``relative_to`` (the folder the file is written to), local paths are written relative to it, as
    :func:`read` takes them back."""
    from packtool.format import Manifest
    from packtool.hub import model_id_of

    manifest = Manifest.read(output)
    if manifest.run_config is None:
        raise ConfigError(f"{output} records no run config (packed by an older packtool); its settings: "
                          f"{manifest.settings}")
    config = dict(manifest.run_config)
    model = model_id_of(config.get("tokenizer"))
    config = _relative(config, relative_to)
    if model is not None:
        config["tokenizer"] = model
    preset = config.get("preset")
    derived = {k: v for k, v in PRESETS.get(str(preset), {}).items() if k in config and config[k] == v}
    sizes = {k: config[k] for k in _PARALLEL_KEYS if k in config}
    try:
        needs = alignment_for(**sizes) if sizes else 1  # the alignment the recorded parallel sizes derive
    except (ConfigError, TypeError, ValueError):
        needs = None
    if config.get("align") == needs:
        derived["align"] = needs
    base = defaults()
    text = dump({k: v for k, v in config.items() if k not in derived})
    shown = {k: v for k, v in derived.items() if v != base.get(k)}
    if shown:
        import yaml

        text += f"# derived by the run ({'the preset, ' if preset else ''}the parallel sizes), not set:\n"
        text += "".join(f"# {line}\n" for line in yaml.safe_dump(shown, sort_keys=False).splitlines())
    return text


def _relative(config: dict, relative_to: Path | None) -> dict:
    """``config`` with its local absolute paths relative to ``relative_to`` (unchanged without one)."""
    if relative_to is not None:
        for key in PATH_KEYS:
            value = config.get(key)
            if isinstance(value, str) and not is_remote(value) and Path(value).is_absolute() \
                    and (key != "tokenizer" or Path(value).is_dir()):
                config[key] = os.path.relpath(value, Path(relative_to).resolve())
    return config
