"""What an adapter returns: a conversation with its media in placeholder order."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from packtool.errors import SampleError
from packtool.format import AUDIO_TAG, IMAGE_TAG, MEDIA_TAGS, TAG_PATTERN, VIDEO_TAG, MediaKind, tag_kinds

__all__ = ["AUDIO_TAG", "IMAGE_TAG", "LOSS_WEIGHT", "MEDIA_TAGS", "TAG_PATTERN", "VIDEO_TAG", "Conversation", "Media",
           "MediaKind", "SampleError", "json_member", "loss_weight", "tag_kinds"]

#: The field of a sample's JSON (a JSON/JSONL record's key, a Parquet/Arrow column, a field of an Energon
#: sample's JSON part) that gives its loss weight: a number >= 0, 1 where absent or null.
LOSS_WEIGHT = "loss_weight"
_LOSS_WEIGHT_BYTES = f'"{LOSS_WEIGHT}"'.encode()


@dataclass(frozen=True)
class Media:
    """One media item of a sample, referenced by the member it came from."""

    #: Part name inside the source sample (``jpg``, ``img0.png``, ``0.webp``, ``clip.mp4``); for a video given as
    #: a list of frames, its first frame's part.
    part: str
    #: ``image``, ``video`` or ``audio``.
    kind: MediaKind = "image"
    #: Position inside a part that holds a list of media (a pickled ``jpgs`` list of images, a pickled ``videos``
    #: list of frame lists), else ``None``.
    item: int | None = None
    #: The frame members of a video given as a list of images, in frame order (``part`` is the first); else empty.
    frames: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_TAGS:
            raise SampleError(f"unknown media kind {self.kind!r} for member {self.part!r}")
        if self.frames and (self.kind != "video" or self.frames[0] != self.part or self.item is not None):
            raise SampleError(f"frame list of {self.part!r} must be a video starting at that member")


@dataclass
class Conversation:
    """A chat as the template sees it, plus its media in placeholder order.

    Each message's ``content`` is a string in which every tag of :data:`MEDIA_TAGS` marks where the next media item
    goes, in order across the conversation: the kinds of the tags, read in order, are the kinds of ``media``
    (the encoder checks this for every adapter).
    """

    #: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``
    messages: list[dict]
    #: Media items in placeholder order.
    media: list[Media] = field(default_factory=list)
    #: How many of them the source gave without a tag in the text (placed before the first user text).
    untagged: int = 0


def json_member(name: str, data: bytes) -> Any:
    """The value of a sample's JSON member ``name``; bytes that are not UTF-8 JSON, or JSON nested too deep for the
    parser (a ``[[[[...`` member raises RecursionError in it), are the sample's :class:`SampleError`."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleError(f"invalid json in {name!r}: {exc}") from None
    except RecursionError:
        raise SampleError(f"invalid json in {name!r}: nested too deeply to parse") from None


def loss_weight(parts: dict[str, bytes]) -> float:
    """A raw sample's loss weight (:data:`LOSS_WEIGHT` in its JSON part, ``json`` or the first part ending in
    ``json``): 1 where the sample has none; a value that is not a finite number >= 0 (a string, a bool, NaN, a
    negative number) is the sample's :class:`SampleError`. The JSON is parsed only where the field's name is in
    its bytes."""
    name = "json" if "json" in parts else next((p for p in sorted(parts) if p.endswith("json")), None)
    if name is None or _LOSS_WEIGHT_BYTES not in parts[name]:
        return 1.0
    doc = json_member(name, parts[name])
    value = doc.get(LOSS_WEIGHT) if isinstance(doc, dict) else None
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SampleError(f"{LOSS_WEIGHT} {value!r} is not a number")
    if not math.isfinite(value) or value < 0:
        raise SampleError(f"{LOSS_WEIGHT} {value!r} is not a finite number >= 0")
    return float(value)
