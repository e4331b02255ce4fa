"""The metadata files of a packed dataset: Energon's ``split.yaml`` and ``.info.json`` (also read from a source),
packtool's manifest (written last), and the safe YAML/JSON reading they share."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from packtool.errors import FormatError
from packtool.format.names import FORMAT_VERSION, MANIFEST, META
from packtool.storage import location


def read_mapping(path: Path, what: str) -> dict:
    """A YAML or JSON file that must hold a mapping; one-line :class:`FormatError` otherwise."""
    if not path.is_file():
        raise FormatError(f"{path}: missing")
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text) if path.suffix == ".json" else _safe_yaml(text)
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise FormatError(f"{path}: unreadable {what} ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise FormatError(f"{path}: unreadable {what} (nested too deeply)") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FormatError(f"{path}: {what} must be a mapping, not {type(data).__name__}")
    return data


#: Nodes a metadata YAML file may hold once its aliases are expanded: an alias repeats a value without repeating
#: its text, so a few hundred bytes of nested aliases would otherwise expand to billions of values (in every
#: later walk of the data: hashing, JSON, comparison).
MAX_YAML_NODES = 1_000_000


def _safe_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a document whose aliases expand it past :data:`MAX_YAML_NODES` nodes
    (counted on the node graph, each shared node once, so the count itself stays linear in the text)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}

        def size(n: yaml.Node) -> int:
            if id(n) not in sizes:
                sizes[id(n)] = 1  # a recursive alias counts once (the constructor refuses nothing for it)
                children = (n.value if isinstance(n, yaml.SequenceNode) else
                            [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else [])
                sizes[id(n)] = min(MAX_YAML_NODES + 1, 1 + sum(size(c) for c in children))
            return sizes[id(n)]

        expanded = size(node)
        if expanded > MAX_YAML_NODES:
            raise ValueError(f"its aliases expand it to more than {MAX_YAML_NODES:,} values; write the values out")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_bytes(data: dict) -> bytes:
    return yaml.safe_dump(data, sort_keys=False).encode()


@dataclass
class SplitYaml:
    """``.nv-meta/split.yaml``: which shards make each split."""

    #: Split name -> shard paths (relative to the dataset root; may hold brace patterns in a source dataset).
    split_parts: dict[str, list[str]]
    #: Shards or ``"<shard>/<key>"`` samples left out (brace patterns allowed).
    exclude: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, root: str | Path) -> SplitYaml:
        meta = location(root) / META
        path = next((p for p in (meta / "split.yaml", meta / "split.json") if p.exists()), meta / "split.yaml")
        data = read_mapping(path, "split file")
        parts, exclude = data.get("split_parts") or {}, data.get("exclude") or []
        if not isinstance(parts, dict) or not all(isinstance(v, (list, str)) or v is None for v in parts.values()):
            raise FormatError(f"{path}: split_parts must map each split to a list of shard paths")
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise FormatError(f"{path}: exclude must be a list of paths")
        out = {}
        for split, shards in parts.items():
            shards = [shards] if isinstance(shards, str) else list(shards or [])
            if not all(isinstance(s, str) for s in shards):
                raise FormatError(f"{path}: split {split!r} lists a shard path that is not text")
            out[str(split)] = shards
        return cls(out, list(exclude))

    def to_bytes(self) -> bytes:
        return yaml_bytes({"split_parts": self.split_parts, "exclude": self.exclude})

    def shards(self, split: str) -> list[str]:
        if split not in self.split_parts:
            raise FormatError(f"split {split!r} not in {sorted(self.split_parts)}")
        return self.split_parts[split]


def safe_relative(path: str) -> bool:
    """Whether a shard path named by metadata stays inside its dataset (relative, no ``..``)."""
    p = PurePosixPath(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and "\\" not in path and "\0" not in path


@dataclass
class InfoJson:
    """``.nv-meta/.info.json``: the record count of each shard (Energon requires them exact)."""

    #: Shard path -> records, in split order (a shard's position is its ``tar_file_id`` in ``index.sqlite``).
    shard_counts: dict[str, int]
    energon_version: str = ""

    @classmethod
    def read(cls, root: str | Path) -> InfoJson:
        meta = location(root) / META
        path = meta / ".info.json" if (meta / ".info.json").exists() else meta / ".info.yaml"
        data = read_mapping(path, "info file")
        counts = data.get("shard_counts") or {}
        if not isinstance(counts, dict) or not all(isinstance(v, int) and v >= 0 for v in counts.values()):
            raise FormatError(f"{path}: shard_counts must map shard paths to sample counts")
        return cls({str(k): int(v) for k, v in counts.items()}, str(data.get("energon_version", "")))


@dataclass
class Manifest(Mapping[str, Any]):
    """``.nv-meta/packtool.json``: how the output was made and what a reader needs besides the tars."""

    #: packtool version that wrote it.
    packtool: str
    #: On-disk format version (:data:`FORMAT_VERSION`).
    format: int
    #: Settings that decide the bytes of the encode stage and of the whole output (compared on a rerun).
    fingerprint: dict
    #: Every setting, as the user gave it (tokenizer as the folder's name).
    settings: dict
    #: Source dataset path.
    source: str
    #: Split -> output shard paths.
    splits: dict[str, list[str]]
    #: ``{"fingerprint": sha256 of the model files, "dir": ".nv-meta/tokenizer"}``.
    tokenizer: dict
    pad_token_id: int
    eos_token_id: int | None
    image_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    #: Settings of the image processor a reader builds (``type``: ``qwen2_vl`` or ``fixed``), or None; for a
    #: Nemotron Omni folder the settings of its whole processor (``family``: ``nemotron_omni``: images, video
    #: and audio), with ``image_token_id`` its ``<image>`` and the vision start/end tokens its ``<img>``/``</img>``.
    image_processor: dict | None
    seed: int
    #: Split -> ``{"samples": n, "packed": n, "truncated": n, "dropped": n, "error": n}``.
    counts: dict[str, dict[str, int]]
    #: Split -> number of packs.
    packs: dict[str, int]
    #: Whether the run stopped after planning (ledger only, no shards).
    dry_run: bool = False
    #: Token of a video's placeholders, and the video settings a reader needs (``family``: ``qwen2_vl``, with the
    #: frame sampling and pixel bounds the tokens were counted with), or None when the model folder takes no video.
    video_token_id: int | None = None
    video_processor: dict | None = None
    #: Audio clips (Nemotron Omni): the embedding placeholder token and the markers around each clip's
    #: placeholders; None when the model folder takes no audio.
    audio_token_id: int | None = None
    audio_start_token_id: int | None = None
    audio_end_token_id: int | None = None
    #: The run's settings as a config file holds them (:func:`packtool.config.recorded_config`: the source, the
    #: tokenizer folder, every setting as it took effect); None in manifests of older packtool versions.
    run_config: dict | None = None
    #: A metadataset's datasets (``datasets``: the names, a segment's ``dataset`` index order; ``splits``: each
    #: split's entries as declared; ``repetitions``: split -> dataset -> times its kept samples were taken); None
    #: for one dataset.
    mixture: dict | None = None
    #: A ``--preset`` run's convention as it took effect (``packtool.families.conventions.Convention.record``: its
    #: name and every choice it made), which readers take instead of looking the name up again; None without a
    #: preset (and in manifests of older packtool versions: then the preset's name in ``settings`` is looked up).
    convention: dict | None = None
    #: Where some sample's loss weight is not 1: ``{"min": w, "max": w, "whole": bool}`` over the packed samples
    #: (``whole``: every weight a whole number, which a trainer counting its normalizer in integers takes exactly);
    #: None where every weight is 1.
    loss_weights: dict | None = None

    @classmethod
    def read(cls, root: str | Path) -> Manifest:
        path = location(root) / MANIFEST
        return cls.parse(read_mapping(path, "manifest"), str(path))

    @classmethod
    def parse(cls, data: Mapping[str, Any], path: str) -> Manifest:
        """The manifest in ``data`` (read from ``path``, named in errors): unknown fields are ignored, a format
        newer than this packtool reads is refused."""
        names = {f.name for f in fields(cls)}
        try:
            manifest = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise FormatError(f"{path}: incomplete manifest ({exc})") from None
        if not isinstance(manifest.format, int) or manifest.format > FORMAT_VERSION:
            raise FormatError(f"{path}: format {manifest.format!r} is newer than this packtool reads "
                              f"({FORMAT_VERSION}); upgrade packtool")
        return manifest

    def to_bytes(self) -> bytes:
        data = asdict(self)
        # written only when set (other outputs keep their bytes)
        for name in ("run_config", "mixture", "convention", "loss_weights"):
            if data[name] is None:
                del data[name]
        return json.dumps(data, indent=1).encode()

    # A read-only mapping of its fields too, so readers take a Manifest or the plain dict of one alike.
    def __getitem__(self, name: str) -> Any:
        if name not in _MANIFEST_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_MANIFEST_FIELDS)

    def __len__(self) -> int:
        return len(_MANIFEST_FIELDS)


_MANIFEST_FIELDS = tuple(f.name for f in fields(Manifest))


def load_manifest(root: str | Path) -> Manifest:
    """The manifest of a packed dataset (:class:`FormatError` if it is missing: the run did not finish)."""
    return Manifest.read(root)


def split_shard_paths(root: str | Path, split: str) -> list[Path]:
    """Shard paths of ``split`` of a packed dataset, in ``split.yaml`` order."""
    return [location(root) / s for s in SplitYaml.read(root).shards(split)]
