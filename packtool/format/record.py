"""One pack record: its members (the token arrays, the segment table, the media placeholders' rules) as the writer
lays them out and every reader parses them."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from packtool.errors import FormatError
from packtool.format.names import TOKENIZER_FILES, MediaKind
from packtool.storage import location


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
