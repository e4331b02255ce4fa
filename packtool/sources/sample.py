"""What an adapter returns: a conversation with its media in placeholder order."""

from __future__ import annotations

from dataclasses import dataclass, field

from packtool.errors import SampleError

__all__ = ["IMAGE_TAG", "Conversation", "Media", "SampleError"]


@dataclass(frozen=True)
class Media:
    """One media item of a sample, referenced by the member it came from."""

    #: Part name inside the source sample (``jpg``, ``img0.png``, ``0.webp``).
    part: str
    #: ``image`` (``audio``/``video`` later).
    kind: str = "image"
    #: Position inside a part that holds a list of media (a pickled ``jpgs`` list), else ``None``.
    item: int | None = None


@dataclass
class Conversation:
    """A chat as the template sees it, plus its media in placeholder order.

    Each message's ``content`` is a string in which every :data:`IMAGE_TAG` marks where the next media item goes,
    in order across the conversation; adapters guarantee the number of tags equals ``len(media)``.
    """

    #: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``
    messages: list[dict]
    #: Media items in placeholder order.
    media: list[Media] = field(default_factory=list)


#: The placeholder adapters leave in message text where an image goes.
IMAGE_TAG = "<image>"
