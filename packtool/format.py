"""The packed format: every file packtool writes or reads (a typed class, or the function that writes it), and the
rules of keys and rows.

This module is the contract (with docs/format.md): the writer, the reader, ``verify``, ``inspect`` and the tests all
go through it, so a field is defined once.

OUTPUT layout::

    .nv-meta/dataset.yaml    CrudeWebdataset with subflavors {packtool: 1} (write_energon_metadata)
    .nv-meta/split.yaml      SplitYaml     split -> shard paths (also read from the source dataset)
    .nv-meta/.info.json      InfoJson      shard -> record count (+ .info.yaml for Energon <= 6)
    .nv-meta/index.sqlite    Energon's sample index (Energon's schema) + index.uuid (write_energon_metadata)
    .nv-meta/packtool.json   Manifest      written last: an OUTPUT with a manifest is complete
    .nv-meta/tokenizer/      the model folder's tokenizer files, so readers need nothing but OUTPUT
    <split>/pack-NNNNNN.tar  one PackRecord per pack (+ .tar.idx)
    ledger.parquet           one row per source sample (LEDGER_SCHEMA)

Keys follow WebDataset's and Energon's rule (:func:`split_member`): a tar member ``dir/KEY.part.ext`` belongs to
sample ``dir/KEY`` as part ``part.ext``; the members of a sample are adjacent.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sqlite3
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml

from packtool.commit import commit_bytes, commit_path
from packtool.errors import FormatError
from packtool.storage import location

#: Version of the on-disk format (``Manifest.format``); a reader refuses a newer one.
FORMAT_VERSION = 2
META = ".nv-meta"
MANIFEST = f"{META}/packtool.json"
TOKENIZER_DIR = f"{META}/tokenizer"
#: Files of a model folder that decide the encoding (their bytes form the tokenizer fingerprint); an output's
#: ``TOKENIZER_DIR`` holds a copy of each the model folder has.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
LEDGER = "ledger.parquet"
#: Subflavor that marks a packed dataset (the Energon task encoder's cooker matches it).
SUBFLAVOR = {"packtool": 1}

Status = Literal["packed", "truncated", "dropped", "error"]
STATUSES: tuple[Status, ...] = ("packed", "truncated", "dropped", "error")
#: Statuses whose sample lies in a pack.
KEPT: tuple[Status, ...] = ("packed", "truncated")
MediaKind = Literal["image", "video", "audio"]
#: The tags a conversation's message text holds where an image, a video or an audio clip goes (adapters write
#: them; the encoder and the conventions lay the text out around them).
IMAGE_TAG, VIDEO_TAG, AUDIO_TAG = "<image>", "<video>", "<audio>"
MEDIA_TAGS: dict[MediaKind, str] = {"image": IMAGE_TAG, "video": VIDEO_TAG, "audio": AUDIO_TAG}
#: Any media tag.
TAG_PATTERN = re.compile("|".join(re.escape(t) for t in MEDIA_TAGS.values()))
_KIND_OF_TAG = {t: k for k, t in MEDIA_TAGS.items()}


def tag_kinds(text: str) -> list[MediaKind]:
    """Kinds of the media tags in ``text``, in order."""
    if "<" not in text:  # every tag starts with it
        return []
    return [_KIND_OF_TAG[m.group(0)] for m in TAG_PATTERN.finditer(text)]


# -- keys ------------------------------------------------------------------------------------------------------
def split_member(name: str) -> tuple[str, str]:
    """``dir/key.part.ext`` -> (``dir/key``, ``part.ext``): the sample key is the member path up to the first dot
    of its basename (WebDataset's ``base_plus_ext``, Energon's rule); a name without a dot has part ``""``."""
    head, _, base = name.rpartition("/")
    stem, _, part = base.partition(".")
    return (f"{head}/{stem}" if head else stem), part


def member_name(key: str, part: str) -> str:
    return f"{key}.{part}"


#: Digits of the pack number that ends a pack key.
PACK_NUMBER_DIGITS = 9


def record_position(number: int) -> str:
    """A record's position in a JSON/JSONL/Parquet/Arrow source as its ledger key and chunk label begin
    (``000000042``: sorts as the number)."""
    return f"{number:0{PACK_NUMBER_DIGITS}d}"


def copied_key(key: str, copy: int) -> str:
    """A sample's identity among the copies a mixture takes of it: its key, ``#k`` added for copy k > 0."""
    return f"{key}#{copy}" if copy else key


def pack_key(split: str, number: int) -> str:
    """Key of pack ``number`` (output order) of ``split``: unique across the dataset, no dots."""
    return f"{split}-{number:0{PACK_NUMBER_DIGITS}d}"


def pack_keys(split: str, numbers: np.ndarray) -> pa.Array:
    """:func:`pack_key` of each of ``numbers`` as an Arrow column (no Python string per row); null where a
    number is negative (a sample in no pack)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(numbers, mask=numbers < 0), pa.string()), PACK_NUMBER_DIGITS, "0")
    return pc.binary_join_element_wise(pa.scalar(f"{split}-"), digits, "")


def pack_numbers(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The pack number of each of ``keys`` (made by :func:`pack_key`; no nulls), parsed by Arrow."""
    return pc.cast(pc.utf8_slice_codeunits(keys, start=-PACK_NUMBER_DIGITS), pa.int64()).to_numpy()


def in_split(key: str, split: str) -> bool:
    """Whether a pack key (see :func:`pack_key`) names a pack of ``split``."""
    number = key[len(split) + 1:]
    return key.startswith(f"{split}-") and len(number) == PACK_NUMBER_DIGITS and number.isdigit()


# -- rows ------------------------------------------------------------------------------------------------------
def aligned_lengths(lengths: np.ndarray, align: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``align``: what a sample takes in a pack row (the planner's cost,
    the steps of ``cu_seqlens_padded``)."""
    return -(-lengths // align) * align


def row_length(pack_size: int, align: int) -> int:
    """Length of a full pack row: ``pack_size`` rounded down to a multiple of ``align``. The aligned lengths of a
    pack's samples sum to at most this, and no sample is longer."""
    return pack_size // align * align


def check_split_name(split: str) -> None:
    """A split name must make valid pack keys and shard paths (no dots, slashes or control characters) and fit
    a USTAR member name (``<split>/pack-NNNNNN.tar`` within 100 bytes)."""
    if not split or not re.fullmatch(r"[A-Za-z0-9_\-]+", split):
        raise FormatError(f"split name {split!r} cannot name packs: use letters, digits, '_' and '-' only")
    if len(shard_path(split, 0).encode()) > 100 or len(member_name(pack_key(split, 0), "targets.npy")) > 100:
        raise FormatError(f"split name {split!r} is too long for a tar member name (at most 80 characters)")


def shard_path(split: str, number: int) -> str:
    """Path of output shard ``number`` of ``split``, relative to OUTPUT."""
    return f"{split}/pack-{number:06d}.tar"


# -- media placeholders --------------------------------------------------------------------------------------


def span_problems(key: str, text: np.ndarray, media: list[MediaRef], ids: Mapping[str, int | None]) -> list[str]:
    """Problems of segment ``key``'s placeholders (``text``: its tokens; ``ids``: the placeholder token of
    each media kind, :meth:`packtool.families.Family.placeholder_ids`).

    An item with a recorded ``span`` must hold exactly ``tokens`` of its kind's placeholder inside the span, the
    first at ``token_offset`` (Nemotron Omni's video chunks are separated by frame labels, so placeholders need not
    be contiguous); spans lie in order inside their segment. Without a span (older packs) the ``tokens``
    placeholders from ``token_offset`` on must be contiguous. The segment holds no other placeholder."""
    problems = []
    last = 0
    for m in media:
        token = ids.get(m.kind)
        if token is None:
            continue
        a, n = m.token_offset, m.tokens
        if m.span:
            s0, s1 = m.span
            ok = (last <= s0 <= a < s1 <= len(text) and text[a] == token
                  and int((text[s0:s1] == token).sum()) == n)
            last = s1
        else:
            ok = 0 <= a and a + n <= len(text) and bool((text[a:a + n] == token).all())
        if not ok:
            problems.append(f"{m.member} of segment {key} does not match its {m.kind} tokens (offset {a}, {n} "
                            f"tokens, span {m.span})")
    for token in set(ids.values()) - {None}:
        want = sum(m.tokens for m in media if ids.get(m.kind) == token)
        if int((text == token).sum()) != want:
            problems.append(f"segment {key} holds {int((text == token).sum())} placeholder tokens {token}, its "
                            f"media {want}")
    return problems


# -- one pack record ------------------------------------------------------------------------------------------
@dataclass
class MediaRef:
    """One media item of a segment: which member of the record holds its bytes and where its tokens lie."""

    #: Part name inside the record (``m0.jpg``, ``m1.mp4``); the tar member is ``KEY.m0.jpg``. Numbered in
    #: placeholder order across the pack. For a video given as a list of images, its first frame (``m1.0.png``).
    member: str
    #: ``image``, ``video`` or ``audio``.
    kind: MediaKind
    #: First placeholder token of the media, relative to the segment start.
    token_offset: int
    #: Placeholder tokens the media occupies.
    tokens: int
    #: Patch grid ``[t, h, w]`` the model's processor makes of it (``[1, 1, 1]`` for fixed-count models).
    grid_thw: list[int]
    #: Stored size in pixels (of one frame for a video).
    width: int
    height: int
    #: Bytes of the member (of all frames of a frame list).
    size: int = 0
    #: SHA-256 of the member's bytes (hex; of the frames' bytes in order for a frame list), recorded when the pack
    #: is written: a swapped member is caught.
    sha256: str = ""
    #: Video given as a list of images: the members holding its frames, in order (``member`` is the first).
    frames: list[str] = field(default_factory=list)
    #: Video: frames in the source stream, its rate (None when the source gives none) and seconds (likewise).
    total_frames: int = 0
    fps: float | None = None
    duration: float | None = None
    #: Video: the frames the model's processor is given (already sampled; the reader decodes only these).
    frame_indices: list[int] = field(default_factory=list)
    #: Qwen2-VL video: seconds one temporal patch spans (``second_per_grid_ts``, for mRoPE).
    second_per_grid_ts: float | None = None
    #: Tokens of the item's whole expansion, ``[start, end)`` relative to the segment start: its placeholder
    #: tokens plus the markers and text the processor writes around them (``<|vision_start|>`` ...
    #: ``<|vision_end|>``; Nemotron Omni's ``<img>`` ... ``</img>``, frame labels, ``<so_start>`` ... ``<so_end>``).
    #: Truncation never cuts inside it. Empty in packs written before it was recorded.
    span: list[int] = field(default_factory=list)
    #: Audio: samples of the waveform the processor is given (at its sampling rate, after any length cap).
    samples: int = 0

    @property
    def members(self) -> list[str]:
        """Every member holding this item's bytes."""
        return self.frames or [self.member]


@dataclass
class Segment:
    """One source sample inside a pack."""

    #: Sample key in the source shard.
    key: str
    #: Source split.
    split: str
    #: Source shard path relative to the source dataset root.
    shard: str
    #: Whether the sample was cut to fit (its ledger row says why).
    truncated: bool
    media: list[MediaRef] = field(default_factory=list)
    #: The dataset of a mixture the sample comes from (its name in the manifest's ``mixture``), else None.
    dataset: str | None = None
    #: Which copy of the sample this is, when a mixture takes it more than once (0: the first).
    copy: int = 0
    #: The sample's loss weight (its ``loss_weight``, times its mixture dataset's): a number >= 0, default 1. The
    #: reader's ``loss_weights`` give each target token of the segment this weight under the chosen loss mode.
    loss_weight: float = 1.0

    def to_json(self) -> dict[str, Any]:
        """``asdict(self)``, without its generic walk over every field (a pack holds many segments); ``dataset``,
        ``copy`` and ``loss_weight`` only when set (outputs that set none keep their bytes)."""
        out = {"key": self.key, "split": self.split, "shard": self.shard, "truncated": self.truncated,
               "media": [asdict(m) for m in self.media]}
        if self.dataset is not None:
            out["dataset"] = self.dataset
        if self.copy:
            out["copy"] = self.copy
        if self.loss_weight != 1.0:
            out["loss_weight"] = self.loss_weight
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Segment:
        try:
            media = [MediaRef(**{f.name: m[f.name] for f in fields(MediaRef) if f.name in m}) for m in d["media"]]
            dataset = d.get("dataset")
            weight = d.get("loss_weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0 \
                    or weight == float("inf"):
                raise TypeError(f"loss_weight {weight!r} is not a finite number >= 0")
            return cls(str(d["key"]), str(d["split"]), str(d["shard"]), bool(d["truncated"]), media,
                       None if dataset is None else str(dataset), int(d.get("copy", 0)), float(weight))
        except (KeyError, TypeError) as exc:
            raise FormatError(f"malformed segment {str(d)[:80]!r}: {type(exc).__name__}: {exc}") from None


#: Members of a record besides its media, in the order they are written.
ARRAYS = ("tokens.npy", "targets.npy", "seqlens.npy")


@dataclass
class PackRecord:
    """One pack: what one tar record holds.

    Members: ``tokens.npy`` (int32 ``[T]``, the real tokens of all segments, no padding), ``targets.npy`` (uint8
    ``[T]``, 1 where a token is a training target), ``seqlens.npy`` (int32 ``[S]``), ``json`` (pack size,
    alignment, writer version, segments) and the original media bytes (``m0.jpg``, ...)."""

    key: str
    tokens: np.ndarray
    targets: np.ndarray
    seqlens: np.ndarray
    pack_size: int
    align: int
    segments: list[Segment]
    #: Media member name -> bytes, in placeholder order (a frame list's frames in frame order).
    media: dict[str, bytes] = field(default_factory=dict)
    #: packtool version that wrote the record.
    packtool: str = ""
    #: SHA-256 of the three array members as written (``tokens.npy``, ``targets.npy``, ``seqlens.npy``, in that
    #: order), recorded in ``json`` as ``arrays_sha256``: ``verify`` proves the token arrays intact without
    #: tokenizing again. Empty for records written before it existed.
    arrays_sha256: str = ""

    def to_members(self) -> list[tuple[str, bytes]]:
        """``[(part, bytes)]`` in member order (arrays, json, media)."""
        arrays = [
            ("tokens.npy", npy_bytes(np.asarray(self.tokens, dtype=np.int32))),
            ("targets.npy", npy_bytes(np.asarray(self.targets, dtype=np.uint8))),
            ("seqlens.npy", npy_bytes(np.asarray(self.seqlens, dtype=np.int32))),
        ]
        meta = {"pack_size": self.pack_size, "align": self.align, "packtool": self.packtool,
                "arrays_sha256": arrays_digest(dict(arrays)), "segments": [s.to_json() for s in self.segments]}
        return [
            *arrays,
            ("json", json.dumps(meta, separators=(",", ":")).encode()),
            *self.media.items(),
        ]

    @classmethod
    def from_members(cls, key: str, members: Mapping[str, bytes]) -> PackRecord:
        """Parse and check one record; raises :class:`FormatError` naming the pack and what is wrong."""
        try:
            meta = json.loads(members["json"])
            tokens = load_npy(members["tokens.npy"], np.int32, "tokens.npy")
            targets = load_npy(members["targets.npy"], np.uint8, "targets.npy")
            seqlens = load_npy(members["seqlens.npy"], np.int32, "seqlens.npy")
            segments = [Segment.from_json(s) for s in meta["segments"]]
            pack_size, align = int(meta["pack_size"]), int(meta["align"])
        except KeyError as exc:
            raise FormatError(f"pack {key}: member or field {exc} missing") from None
        except (FormatError, ValueError, TypeError) as exc:
            raise FormatError(f"pack {key}: {exc}") from None
        if len(segments) != len(seqlens) or len(tokens) != len(targets) or len(tokens) != int(seqlens.sum()):
            raise FormatError(f"pack {key}: {len(segments)} segments, seqlens sum {int(seqlens.sum())}, "
                              f"{len(tokens)} tokens, {len(targets)} targets do not agree")
        if len(seqlens) == 0 or (seqlens <= 0).any():
            raise FormatError(f"pack {key}: no segments or an empty segment")
        media = {}
        for name in (name for s in segments for m in s.media for name in m.members):
            if name not in members:
                raise FormatError(f"pack {key}: media member {name} missing")
            media[name] = members[name]
        return cls(key, tokens, targets, seqlens, pack_size, align, segments, media, str(meta.get("packtool", "")),
                   str(meta.get("arrays_sha256", "")))

    @property
    def media_refs(self) -> list[MediaRef]:
        """Every media item of the pack, in placeholder order."""
        return [m for s in self.segments for m in s.media]

    def segment_starts(self) -> np.ndarray:
        """Token index of each segment's first token, then the total."""
        return np.concatenate([[0], np.cumsum(self.seqlens.astype(np.int64))])


def arrays_digest(members: Mapping[str, bytes]) -> str:
    """SHA-256 over a record's array members, in :data:`ARRAYS` order (see ``PackRecord.arrays_sha256``)."""
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(members[name])
    return h.hexdigest()


def npy_bytes(array: np.ndarray) -> bytes:
    """``.npy`` bytes of a 1-D array of plain numbers (never pickled): the NPY 1.0 header laid out as
    ``np.save`` lays it out (a test holds them equal), then the data; several times faster than ``np.save``."""
    array = np.ascontiguousarray(array)
    if array.ndim != 1 or array.dtype.kind not in "biuf":
        raise ValueError(f"npy_bytes takes 1-D numeric arrays, got {array.ndim}-D {array.dtype}")
    n = len(array)
    header = f"{{'descr': '{array.dtype.str}', 'fortran_order': False, 'shape': ({n},), }}"
    header += " " * (_NPY_GROWTH_DIGITS - len(str(n)))  # numpy's room to grow the shape in place
    pad = _NPY_ALIGN - (_NPY_PREFIX + len(header) + 1) % _NPY_ALIGN
    return b"\x93NUMPY\x01\x00%b%b%b\n%b" % (
        (len(header) + 1 + pad).to_bytes(2, "little"), header.encode("latin-1"), b" " * pad, array.tobytes())


#: NPY 1.0 layout: magic + version + header length (10 bytes), data aligned to 64 bytes, and the spaces numpy
#: leaves after the shape.
_NPY_PREFIX, _NPY_ALIGN, _NPY_GROWTH_DIGITS = 10, 64, 21


def load_npy(data: bytes, dtype: type, name: str) -> np.ndarray:
    """A 1-D ``.npy`` array of exactly ``dtype`` (never unpickled); ValueError otherwise."""
    array = np.load(io.BytesIO(data), allow_pickle=False)
    if array.ndim != 1 or array.dtype != dtype:
        raise ValueError(f"{name}: expected 1-D {np.dtype(dtype)}, got {array.ndim}-D {array.dtype}")
    return array


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """SHA-256 over the files that decide the encoding."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = location(tokenizer_dir) / name
        if path.exists():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- metadata files -------------------------------------------------------------------------------------------
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


def _yaml_bytes(data: dict) -> bytes:
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
        return _yaml_bytes({"split_parts": self.split_parts, "exclude": self.exclude})

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


# -- the ledger -----------------------------------------------------------------------------------------------
#: ``ledger.parquet``: one row per source sample, its fate.
LEDGER_SCHEMA = pa.schema([
    ("key", pa.string()),  # sample key in its source shard (``#unreadable-after-N``: a shard's unreadable tail)
    ("split", pa.string()),
    ("shard", pa.string()),  # source shard path relative to the source root
    ("status", pa.string()),  # one of STATUSES
    ("reason", pa.string()),  # why, unless ``packed`` (empty then)
    ("tokens", pa.int32()),  # tokens in the pack (after truncation; 0 unless kept)
    ("targets", pa.int32()),  # training targets in the pack
    ("images", pa.int32()),  # media items in the pack
    ("image_tokens", pa.int32()),  # placeholder tokens of those media
    ("pack", pa.string()),  # pack key (see pack_key), null unless kept
    ("source_tokens", pa.int32()),  # length before truncation (0 if encoding failed)
])
#: A mixture's ledger adds the sample's dataset (its name in the manifest's ``mixture``) and its copy number: one
#: row per copy its dataset's proportion took (``copy`` 0 for the first; a sample not kept has one row).
MIXTURE_LEDGER_COLUMNS = ("dataset", "copy")
#: The ledger of an output where some sample's loss weight is not 1 adds it (float64, last): the sample's own
#: ``loss_weight`` times its mixture dataset's.
WEIGHT_LEDGER_COLUMN = "loss_weight"
#: The entry of every reader batch (``packtool.runtime.read.pack_to_batch``) that names the registered family whose
#: trainer layouts the batch follows (``Family.batch_family``): layouts read it, never guess from the batch's keys.
BATCH_FAMILY = "family"
#: A reader batch's entry with the manifest's facts its trainer layouts need beside the tensors (media token ids, the
#: image processor's merge size: :func:`packtool.readkit.layout_context`), so a layout takes the batch alone.
BATCH_CONTEXT = "layout_context"


# -- writing Energon's metadata ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexedRecord:
    """Where one record lies in its shard (what ``.tar.idx`` and ``index.sqlite`` hold)."""

    key: str
    #: Byte offset of the record's first member header.
    offset: int
    #: Bytes from that header to the end of the record's last member data, padded to a block.
    size: int
    #: (part name, content offset, content size) of each member.
    parts: tuple[tuple[str, int, int], ...]


def energon_dataset_yaml() -> dict:
    """What a packed dataset's ``dataset.yaml`` holds: a crude dataset with :data:`SUBFLAVOR` (the task encoders'
    cooker matches it: with another subflavor, Energon would hand them no pack)."""
    return {"__module__": "megatron.energon", "__class__": "CrudeWebdataset", "subflavors": dict(SUBFLAVOR)}


def write_energon_metadata(out: Path, splits: dict[str, list[str]],
                           indexes: Mapping[str, Sequence[IndexedRecord]], energon_version: str) -> None:
    """Write ``dataset.yaml``, ``split.yaml``, ``.info.json``/``.info.yaml``, ``index.sqlite`` and ``index.uuid``.

    ``splits`` maps split -> shard paths (relative to ``out``); ``indexes`` maps shard path -> its records. The
    uuid derives from the content, so reruns write the same bytes.
    """
    meta = location(out) / META
    shards = [s for split in splits for s in splits[split]]
    counts = {s: len(indexes[s]) for s in shards}
    commit_bytes(meta / "dataset.yaml", _yaml_bytes(energon_dataset_yaml()))
    commit_bytes(meta / "split.yaml", SplitYaml({k: list(v) for k, v in splits.items()}).to_bytes())
    commit_bytes(meta / ".info.json",
                 json.dumps({"energon_version": energon_version, "shard_counts": counts}, indent=2).encode())
    commit_bytes(meta / ".info.yaml", _yaml_bytes({"shard_counts": counts}))
    with commit_path(meta / "index.sqlite") as tmp:
        _write_sqlite_index(tmp, [indexes[s] for s in shards])
    digest = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(counts, sort_keys=True) + str(sum(
        r.offset + r.size for rs in indexes.values() for r in rs)))
    commit_bytes(meta / "index.uuid", str(digest).encode())


def _write_sqlite_index(path: Path, shards: list[Sequence[IndexedRecord]]) -> None:
    """Energon's ``index.sqlite`` schema (``samples``, ``sample_parts``; ``tar_file_id`` = shard position),
    written here rather than with Energon's ``SqliteIndexWriter``: importing Energon imports torch, 240 MB more in
    the packing process for a 20-line writer."""
    con = sqlite3.connect(path)
    try:
        con.executescript(
            """
            CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE,
                                  sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER);
            CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT,
                                       content_byte_offset INTEGER, content_byte_size INTEGER);
            """
        )
        for fid, records in enumerate(shards):
            con.executemany("INSERT INTO samples VALUES (?,?,?,?,?)",
                            [(fid, r.key, i, r.offset, r.size) for i, r in enumerate(records)])
            con.executemany("INSERT INTO sample_parts VALUES (?,?,?,?,?)",
                            [(fid, i, p, o, n) for i, r in enumerate(records) for p, o, n in r.parts])
        con.executescript(
            """
            CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index);
            CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset);
            CREATE INDEX idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name,
                                                              content_byte_offset, content_byte_size);
            """
        )
        con.commit()
    finally:
        con.close()
