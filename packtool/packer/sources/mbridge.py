"""Adapter for Megatron-Bridge's ``ChatMLWebdataset`` samples, named by ``dataset.yaml``'s ``field_map``.

Bridge's converters and tutorials write ``.nv-meta/dataset.yaml`` as::

    __module__: megatron.bridge.data.energon.task_encoder_utils   # or ...models.qwen_vl.data.energon
    __class__: ChatMLWebdataset
    field_map:
      imgs: jpgs                 # or image.png / image.jpg / jpg
      videos: videos             # optional; or mp4s, or video.mp4
      conversation: json         # or conversation.json
    subflavors: {}

Each ``field_map`` value is the member that fills that field. ``conversation`` holds the chat JSON (a list of
``from``/``value`` or ``role``/``content`` turns, or an object with ``conversation``, ``conversations`` or
``messages``). ``imgs`` is either one encoded image member or a pickled list (a ``jpgs`` member: encoded image
bytes, or decoded ``HxWx3`` uint8 arrays from ``convert_to_qwenvl_wds.py``, re-encoded as PNG, see
:mod:`packtool.packer.sources.safepickle`). ``videos`` is one video member (``video.mp4``) or a pickled list of videos
(``videos``/``mp4s``), each a list of encoded frames; a video of decoded frames (``convert_to_qwenvl_wds.py``'s
arrays) is refused per sample. ``audio`` (one clip) is taken only where the convention says so (``audio=True``:
Megatron-Bridge's Nemotron Omni path, which tags no audio in the text); else it is refused per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from packtool.errors import SourceError
from packtool.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from packtool.packer.sources.conversation import parse_turns, place_media
from packtool.packer.sources.safepickle import encoded_videos, load_bytes_list
from packtool.packer.sources.sample import Conversation, Media, SampleError, json_member

#: ``dataset.yaml`` ``__class__`` of Bridge's multi-turn chat samples.
CHATML_CLASS = "ChatMLWebdataset"
#: Member extensions Bridge's decoder reads as pickled lists (``jpgs`` of images; ``videos``/``mp4s`` of videos).
PICKLED_IMAGES, PICKLED_VIDEOS = ("jpgs",), ("videos", "mp4s")


@dataclass(frozen=True)
class ChatMLFields:
    """Which member fills which ``ChatMLSample`` field (``dataset.yaml`` ``field_map``)."""

    #: Member holding the chat JSON.
    conversation: str
    #: Member holding the images (one image, or a pickled list), or ``None``.
    imgs: str | None = None
    #: Member holding the videos (a pickled list of frame lists, or one video file), or ``None``.
    videos: str | None = None
    #: Member holding the audio, or ``None``.
    audio: str | None = None

    def __post_init__(self) -> None:
        for name in ("conversation", "imgs", "videos", "audio"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or any(c in value for c in "[],")):
                raise SourceError(f"dataset.yaml field_map.{name} must name one member, got {value!r}")


def chatml_fields(dataset_yaml: dict) -> ChatMLFields | None:
    """The field map of a ``ChatMLWebdataset`` ``dataset.yaml``, or ``None`` for any other dataset.

    Raises :class:`SourceError` for a field map packtool cannot follow (no ``conversation``, an unknown field,
    Energon's ``part[key]`` access or ``a,b`` alternatives).
    """
    if dataset_yaml.get("__class__") != CHATML_CLASS:
        return None
    field_map = dataset_yaml.get("field_map")
    if not isinstance(field_map, dict) or "conversation" not in field_map:
        raise SourceError("dataset.yaml for ChatMLWebdataset has no field_map.conversation")
    unknown = sorted(set(field_map) - {"conversation", "imgs", "videos", "audio"})
    if unknown:
        raise SourceError(f"dataset.yaml field_map.{unknown[0]} is not supported (conversation, imgs, videos, audio)")
    return ChatMLFields(**field_map)


def _ext(member: str) -> str:
    return member.rsplit(".", 1)[-1].lower()


def _member(parts: dict[str, bytes], fields: ChatMLFields, field: str) -> str | None:
    """The member named by ``field``, ``None`` if the field is not mapped; a mapped member must exist."""
    member = getattr(fields, field)
    if member is not None and member not in parts:
        raise SampleError(f"member {member!r} (field_map.{field}) is missing")
    return member


def _refuse_pickle(member: str, allow_pickle: bool) -> None:
    if not allow_pickle:
        raise SampleError(f"pickled member {member!r} refused (pickled members are read only when allowed)")


def chatml_adapter(parts: dict[str, bytes], *, fields: ChatMLFields, allow_pickle: bool = False,
                   audio: bool = False) -> Conversation:
    """The conversation of one raw sample (``{part: bytes}``) of a ``ChatMLWebdataset`` (``audio``: take its audio
    clip, placed untagged; a ``<audio>`` in the text is then the sample's error)."""
    videos = _member(parts, fields, "videos")
    video_media: list[Media] = []
    if videos is not None and _ext(videos) in PICKLED_VIDEOS:
        _refuse_pickle(videos, allow_pickle)
        video_media = [Media(part=videos, kind="video", item=i) for i in range(len(encoded_videos(parts[videos])))]
    elif videos is not None and _ext(videos) in VIDEO_EXTENSIONS:
        video_media = [Media(part=videos, kind="video")]
    elif videos is not None:
        raise SampleError(f"videos member {videos!r} is neither a video nor a pickled video list")
    clip = _member(parts, fields, "audio")
    if clip is not None and not audio:
        raise SampleError(f"audio member {fields.audio!r}: audio is not supported yet")
    _member(parts, fields, "conversation")  # always mapped; raises when this sample lacks it
    name = fields.conversation
    doc = json_member(name, parts[name])
    messages = parse_turns(doc)
    media: list[Media] = []
    imgs = _member(parts, fields, "imgs")
    if imgs is not None and _ext(imgs) in PICKLED_IMAGES:
        _refuse_pickle(imgs, allow_pickle)
        media = [Media(part=imgs, item=i) for i in range(len(load_bytes_list(parts[imgs])))]
    elif imgs is not None and _ext(imgs) in IMAGE_EXTENSIONS:
        media = [Media(part=imgs)]
    elif imgs is not None:
        raise SampleError(f"imgs member {imgs!r} is neither an image nor a pickled image list")
    if clip is None:
        messages, media, untagged = place_media(messages, media + video_media)
        return Conversation(messages=messages, media=media, untagged=untagged)
    if any("<audio>" in m["content"] for m in messages):
        raise SampleError("a <audio> tag in the text: Megatron-Bridge's Nemotron Omni path tags no audio (it would "
                          "train the tag as text and place the clip after the last image)")
    messages, media, untagged = place_media(messages, media + video_media + [Media(part=clip, kind="audio")])
    return Conversation(messages=messages, media=media, untagged=untagged - 1)
