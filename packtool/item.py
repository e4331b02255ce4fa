"""One media item of an encoded sample (:class:`MediaItem`), and its record in the encode store.

The encoder measures an item (where its bytes lie, its size, a video's container facts), the family plans it
(tokens, grid, frames) and places it (``token_offset``, ``span``); the encode store keeps a sample's items as a
JSON list (``samples.parquet``'s ``media`` column: :func:`dumps_media`, read back by :func:`loads_media`), from
which assembly builds each pack's :class:`~packtool.format.MediaRef` and verify compares a fresh encoding. Items
are frozen: a stage that changes one makes a new one (``dataclasses.replace``).

While its sample is encoded an item travels as a :class:`Staged`: the item so far plus what only encoding needs
(an expansion text, its characters, the processor mode's decoded media and ids), which is never stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from packtool.format import MediaKind

#: The encode store's keys of each item layout, in the order it writes them (the bytes of stores written before
#: the type existed; :func:`dumps_media` keeps them). ``samples`` (audio) and ``span`` are left out when None.
IMAGE_KEYS = ("part", "item", "kind", "ext", "width", "height", "offset", "size", "tokens", "grid_thw",
              "token_offset", "span")
VIDEO_KEYS = ("part", "item", "kind", "ext", "width", "height", "offset", "size", "sha256", "frames",
              "total_frames", "fps", "duration", "tokens", "grid_thw", "frame_indices", "second_per_grid_ts",
              "token_offset", "span")
#: Audio planned by a rule; an audio clip decoded before its plan (:attr:`MediaItem.decoded`) has its waveform's
#: ``samples`` before ``tokens``.
AUDIO_KEYS = ("part", "item", "kind", "ext", "grid_thw", "width", "height", "offset", "size", "tokens", "samples",
              "token_offset", "span")
DECODED_AUDIO_KEYS = ("part", "item", "kind", "ext", "grid_thw", "width", "height", "offset", "size", "samples",
                      "tokens", "token_offset", "span")
#: Keys written only when their value is not None.
_OPTIONAL = frozenset({"samples", "span"})
_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class MediaItem:
    """One media item of a sample, in placeholder order: where its bytes lie, what the family planned for it and,
    once placed, where its tokens lie in the sample."""

    #: The source member holding its bytes (for an item of a pickled list: the list's member; for a frame list:
    #: the first frame's member), and the item's index in a pickled list (None: the member itself).
    part: str
    item: int | None
    kind: MediaKind
    #: Extension of the pack member the writer names it with (``jpg``, ``mp4``; from the format for a list item).
    ext: str
    #: Stored size in pixels (of one frame for a video; 0 for audio).
    width: int
    height: int
    #: Where the member lies in the source shard (for an item of a pickled list, the list's member).
    offset: int
    size: int
    #: Placeholder tokens of the item, and the patch grid ``[t, h, w]`` its processor makes (empty for audio).
    tokens: int
    grid_thw: tuple[int, ...] = ()
    #: Video: SHA-256 of the bytes measured (checked again when the pack is written); each frame's
    #: ``(member, offset, size)`` for a video given as a list of frames; the container's frames, rate and
    #: seconds (None when it gives none); the frames the processor is given; seconds per temporal patch (Qwen2-VL).
    sha256: str = ""
    frames: tuple[tuple[str, int, int], ...] = ()
    total_frames: int = 0
    fps: float | None = None
    duration: float | None = None
    frame_indices: tuple[int, ...] = ()
    second_per_grid_ts: float | None = None
    #: Audio: samples of the waveform the processor is given (None: not counted).
    samples: int | None = None
    #: Audio: the clip was decoded before it was planned (the processor mode measures its waveform first).
    decoded: bool = False
    #: Set by the family's ``place``: the first placeholder token, relative to the sample start, and ``[start,
    #: end)`` of the item's whole expansion (None in stores written before spans were recorded).
    token_offset: int = -1
    span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.decoded and (self.kind != "audio" or self.samples is None):
            raise ValueError(f"only an audio item with its samples is decoded before its plan ({self.kind}, samples "
                             f"{self.samples})")

    @property
    def pixels(self) -> int:
        """Decoded pixels its processor is given: the image's, or those of each frame given of a video."""
        frames = len(self.frame_indices) if self.kind == "video" else int(self.kind == "image")
        return frames * self.width * self.height

    @property
    def keys(self) -> tuple[str, ...]:
        """The encode store's keys of this item, in order (see :data:`IMAGE_KEYS`)."""
        if self.kind == "image":
            return IMAGE_KEYS
        if self.kind == "video":
            return VIDEO_KEYS
        return DECODED_AUDIO_KEYS if self.decoded else AUDIO_KEYS

    def to_json(self) -> dict[str, Any]:
        """The item as the encode store records it (JSON values, keys in the store's order)."""
        out: dict[str, Any] = {}
        for key in self.keys:
            value = getattr(self, key)
            if value is None and key in _OPTIONAL:
                continue
            if key == "frames":
                value = [list(f) for f in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[key] = value
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MediaItem:
        """An item from its encode-store record (written by any packtool version: a key it lacks takes the
        field's default)."""
        order = list(d)
        decoded = d["kind"] == "audio" and "samples" in d and order.index("samples") < order.index("tokens")
        span = d.get("span")
        return cls(part=d["part"], item=d["item"], kind=d["kind"], ext=d["ext"], width=d["width"],
                   height=d["height"], offset=d["offset"], size=d["size"], tokens=d["tokens"],
                   grid_thw=tuple(d.get("grid_thw") or ()), sha256=d.get("sha256") or "",
                   frames=tuple((str(p), int(o), int(n)) for p, o, n in d.get("frames") or ()),
                   total_frames=d.get("total_frames", 0), fps=d.get("fps"), duration=d.get("duration"),
                   frame_indices=tuple(d.get("frame_indices") or ()), second_per_grid_ts=d.get("second_per_grid_ts"),
                   samples=d.get("samples"), decoded=decoded, token_offset=d.get("token_offset", -1),
                   span=(int(span[0]), int(span[1])) if span else None)


def dumps_media(items: Sequence[MediaItem]) -> str:
    """A sample's items as the encode store's JSON text."""
    return json.dumps([m.to_json() for m in items], separators=_SEPARATORS) if items else "[]"


def loads_media(text: str) -> list[MediaItem]:
    """A sample's items from the encode store's JSON text."""
    return [] if text == "[]" else [MediaItem.from_json(d) for d in json.loads(text)]


@dataclass(frozen=True, eq=False)
class Staged:
    """A media item while its sample is encoded: the item so far, and what only encoding needs (never stored)."""

    item: MediaItem
    #: The placeholder's expansion, for a family that expands in the text (consumed by its ``expand_text``).
    text: str | None = None
    #: Characters of the expansion in the expanded text: start, first embedding placeholder, end (from the
    #: family's ``expand_text`` to its ``place``).
    chars: tuple[int, int, int] | None = None
    #: The processor mode: the decoded media its processor is given, and the processor's ids of the whole
    #: sample (one array shared by the sample's items, from ``expand_text`` to ``place``).
    input: object = None
    ids: np.ndarray | None = None
