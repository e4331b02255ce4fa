"""Adapter for chat JSON samples: LLaVA/ShareGPT (``from``/``value``) and ChatML (``role``/``content``).

A ``json`` member holds a list of turns or ``{"conversations"|"messages"|"conversation": [...]}``.

Media members are found by extension: images (``jpg``, ``img0.png``, ``1.webp``), videos (``mp4``, ``webm``,
``mkv``, ``mov``, ``avi``), audio (``wav``, ``flac``, ``mp3``, ``ogg``, ``m4a``); numbered ones in number order. A
video may also be a list of frames: image members ``<name>.<n>.<ext>`` (``video.0.jpg``, ``video.1.jpg``, ...)
sharing a name, numbered from 0 without gaps. With ``allow_pickle``, a ``jpgs`` member holds a pickled list of
images and a ``videos`` member a pickled list of videos, each a list of encoded frames (Megatron-Bridge's layout;
they follow the member media of their kind).

The JSON may name the members of a kind instead (``"image"``/``"images"``, ``"video"``/``"videos"`` where an
entry may be a list of frame members, ``"audio"``/``"audios"``), and so may OpenAI-style content parts
(``{"type": "video", "video": "clip.mp4"}``). ``<image>``, ``<video>`` and ``<audio>`` in the text (or content
parts of type ``image``/``image_url``, ``video``/``video_url``, ``audio``/``input_audio``/``audio_url``) mark
where each item goes; tags and media are matched per kind, in order. A kind with media but no tags goes before the
first user text. Any mismatch, any media member the conversation leaves unused, and media given inline (base64
data) quarantine the sample: no sample is packed without a media item it references or carries.
"""

from __future__ import annotations

import re

from packtool.format import MediaKind
from packtool.media import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from packtool.packer.sources.safepickle import encoded_videos, load_bytes_list
from packtool.packer.sources.sample import (
    MEDIA_TAGS,
    TAG_PATTERN,
    Conversation,
    Media,
    SampleError,
    json_member,
    tag_kinds,
)

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}

#: Member endings of each media kind.
EXTENSIONS: dict[MediaKind, frozenset[str]] = {"image": IMAGE_EXTENSIONS, "video": VIDEO_EXTENSIONS,
                                               "audio": AUDIO_EXTENSIONS}
#: Media formats packtool cannot read: a member with one of these endings quarantines its sample rather than being
#: left out of it.
UNSUPPORTED_EXTENSIONS = frozenset({"heic", "heif", "avif", "jxl", "svg", "mpg", "mpeg", "m4v", "wmv", "flv", "3gp",
                                    "ts", "aac", "opus", "wma", "aiff", "aif"})
#: Content-part types that stand for each media kind (OpenAI-style and transformers-style messages).
PART_TYPES: dict[str, MediaKind] = {"image": "image", "image_url": "image", "video": "video", "video_url": "video",
                                    "audio": "audio", "input_audio": "audio", "audio_url": "audio"}

PLURALS = {"image": "images", "video": "videos", "audio": "audio clips"}
_NUMBER = re.compile(r"(\d+)$")
_FRAME = re.compile(r"^(.+)\.(\d+)\.([A-Za-z0-9]+)$")


def _json_part(parts: dict[str, bytes]) -> str:
    if "json" in parts:
        return "json"
    for name in sorted(parts):
        if name.endswith("json"):
            return name
    raise SampleError("no json member")


def member_kind(part: str) -> MediaKind | None:
    """The media kind of a member by its extension (``None`` for anything else)."""
    ext = part.rsplit(".", 1)[-1].lower()
    return next((k for k, exts in EXTENSIONS.items() if ext in exts), None)


def _order(name: str):
    """Sort key: unnumbered names first by name, then numbered ones by number."""
    stem = name.rsplit(".", 1)[0] if "." in name else ""
    m = _NUMBER.search(stem)
    return (0, -1, name) if m is None else (1, int(m.group(1)), name)


def image_parts(parts) -> list[str]:
    """Image part names in placeholder order: unnumbered first by name, then numbered by number (frames of a
    frame-list video excluded)."""
    frames = {f for group in frame_lists(parts).values() for f in group}
    return sorted((p for p in parts if member_kind(p) == "image" and p not in frames), key=_order)


def frame_lists(parts) -> dict[str, tuple[str, ...]]:
    """Videos given as numbered image members ``<name>.<n>.<ext>``: name -> frame members in frame order. The
    numbers must run from 0 without gaps or repeats."""
    groups: dict[str, dict[int, str]] = {}
    for p in parts:
        m = _FRAME.match(p)
        if m and m.group(3).lower() in IMAGE_EXTENSIONS:
            numbered = groups.setdefault(m.group(1), {})
            if int(m.group(2)) in numbered:
                raise SampleError(f"frame {int(m.group(2))} of video {m.group(1)!r} appears twice")
            numbered[int(m.group(2))] = p
    out = {}
    for name, numbered in groups.items():
        if sorted(numbered) != list(range(len(numbered))):
            raise SampleError(f"frames of video {name!r} are not numbered 0..{len(numbered) - 1} without gaps")
        out[name] = tuple(numbered[i] for i in range(len(numbered)))
    return out


def member_media(parts) -> dict[str, list[Media]]:
    """The media members of a sample by kind, in placeholder order (frame lists among the videos, ordered by
    their name)."""
    frames = frame_lists(parts)
    videos = [(p, Media(part=p, kind="video")) for p in parts if member_kind(p) == "video"]
    videos += [(name + ".mp4", Media(part=f[0], kind="video", frames=f)) for name, f in frames.items()]
    return {
        "image": [Media(part=p) for p in image_parts(parts)],
        "video": [m for _, m in sorted(videos, key=lambda v: _order(v[0]))],
        "audio": [Media(part=p, kind="audio") for p in sorted(parts, key=_order) if member_kind(p) == "audio"],
    }


def _text(content, refs: list[tuple[str, object]] | None = None) -> str:
    """Turn content into text with media tags: a string, or a list of ``{"type": "text"|media type}`` parts. Each
    media part appends ``(kind, the member it names or None)`` to ``refs``."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") in PART_TYPES:
                kind = PART_TYPES[part["type"]]
                pieces.append(MEDIA_TAGS[kind])
                if refs is not None:
                    refs.append((kind, _part_ref(part)))
            else:
                raise SampleError(f"unsupported content part {str(part)[:60]!r}")
        return "".join(pieces)
    raise SampleError(f"unsupported content of type {type(content).__name__}")


def _part_ref(part: dict):
    """The member a media content part names (``None`` when it names none); inline data is refused."""
    value = part.get(part["type"])
    if isinstance(value, dict):  # {"url": ...} or {"data": ..., "format": ...}
        if "data" in value:
            raise SampleError(f"{part['type']} content part carries its data inline; store media as members")
        value = value.get("url", value.get("path"))
    if value is None:
        value = part.get("path", part.get("url"))
    if isinstance(value, str) and value.startswith("data:"):
        raise SampleError(f"{part['type']} content part carries its data inline; store media as members")
    if value is not None and not isinstance(value, (str, list)):
        raise SampleError(f"{part['type']} content part names {str(value)[:40]!r}, not a member")
    return value


def parse_turns(doc, refs: list[tuple[str, object]] | None = None) -> list[dict]:
    """Messages ``[{"role", "content"}]`` from the JSON document; raises :class:`SampleError` with a reason.
    ``refs`` collects the media content parts (see :func:`_text`)."""
    turns = doc
    if isinstance(doc, dict):
        turns = doc.get("conversations", doc.get("messages", doc.get("conversation")))
    if not isinstance(turns, list) or not turns:
        raise SampleError("json holds no conversation (expected a list of turns, or conversation(s)/messages)")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise SampleError("a turn is not an object")
        role = turn.get("role", turn.get("from"))
        if not isinstance(role, str) or role not in ROLES:
            raise SampleError(f"unknown role {str(role)[:40]!r}")
        content = turn["content"] if "content" in turn else turn.get("value")
        messages.append({"role": ROLES[role], "content": _text(content, refs)})
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleError("no assistant turn")
    return messages


def place_media(messages: list[dict], media: list[Media]) -> tuple[list[dict], list[Media], int]:
    """Match the media tags of the text with ``media`` kind by kind, and return the messages (untagged kinds placed
    before the first user text, images then videos then audio), the media in placeholder order and how many were
    untagged."""
    by_kind = {k: [m for m in media if m.kind == k] for k in MEDIA_TAGS}
    tags = [k for m in messages for k in tag_kinds(m["content"])]
    untagged = ""
    for kind, tag in MEDIA_TAGS.items():
        n_tags, n_media = tags.count(kind), len(by_kind[kind])
        if n_tags == 0 and n_media:
            untagged += tag * n_media
        elif n_tags != n_media:
            raise SampleError(f"{n_tags} {tag} tags but {n_media} {PLURALS[kind]}")
    placed = messages
    if untagged:
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            raise SampleError(f"{len(media)} media but no user turn to place them in")
        placed = [dict(m) for m in messages]
        placed[first_user]["content"] = untagged + placed[first_user]["content"]
    queues = {k: iter(v) for k, v in by_kind.items()}
    ordered = [next(queues[k]) for m in placed for k in tag_kinds(m["content"])]
    return placed, ordered, len(TAG_PATTERN.findall(untagged))


def conversation_adapter(parts: dict[str, bytes], *, allow_pickle: bool = False) -> Conversation:
    """The conversation of one raw sample (``{part: bytes}``)."""
    name = _json_part(parts)
    doc = json_member(name, parts[name])
    for p in parts:
        if p.rsplit(".", 1)[-1].lower() in UNSUPPORTED_EXTENSIONS:
            raise SampleError(f"member {p!r} is in a media format packtool cannot read")
    part_refs: list[tuple[str, object]] = []
    messages = parse_turns(doc, part_refs)
    found = member_media(parts)
    media: list[Media] = []
    for kind in MEDIA_TAGS:
        named = [ref for k, ref in part_refs if k == kind]
        doc_refs = _doc_refs(doc, kind)
        if any(ref is not None for ref in named):
            if any(ref is None for ref in named):
                raise SampleError(f"some {kind} content parts name their member and some do not")
            media += [_resolve(ref, kind, parts) for ref in named]
        elif doc_refs is not None:
            media += [_resolve(ref, kind, parts) for ref in doc_refs]
        else:
            media += found[kind]
    if "jpgs" in parts:
        if not allow_pickle:
            raise SampleError("pickled member 'jpgs' refused: pickles are read only with allow_pickle")
        items = load_bytes_list(parts["jpgs"])
        media += [Media(part="jpgs", item=i) for i in range(len(items))]
    if "videos" in parts:  # Megatron-Bridge's convert_to_qwenvl_wds.py writes one to every sample
        if not allow_pickle:
            raise SampleError("pickled member 'videos' refused (pickled members are read only when allowed)")
        media += [Media(part="videos", kind="video", item=i) for i in range(len(encoded_videos(parts["videos"])))]
    _check_all_used(found, media)
    messages, ordered, untagged = place_media(messages, media)
    return Conversation(messages=messages, media=ordered, untagged=untagged)


def _doc_refs(doc, kind: MediaKind) -> list | None:
    """The members the JSON document names for ``kind`` (``"video": "a.mp4"`` or ``"videos": [...]``), or None."""
    if not isinstance(doc, dict):
        return None
    refs = doc.get(kind, doc.get(kind + "s"))
    if refs is None:
        return None
    if isinstance(refs, str) or (kind == "video" and isinstance(refs, list) and refs
                                 and all(isinstance(r, str) for r in refs) and kind in doc
                                 and member_kind(refs[0]) == "image"):
        return [refs]  # one member, or one video as its list of frames
    if not isinstance(refs, list):
        raise SampleError(f"{kind} reference {str(refs)[:40]!r} is neither a name nor a list of names")
    return refs


def _resolve(ref, kind: MediaKind, parts: dict[str, bytes]) -> Media:
    """The media item a reference names; each named member must be in the sample and be of the kind."""
    if kind == "video" and isinstance(ref, list):
        if not ref:
            raise SampleError("video frame list is empty")
        frames = tuple(_member(r, parts, "image") for r in ref)
        return Media(part=frames[0], kind="video", frames=frames)
    return Media(part=_member(ref, parts, kind), kind=kind)


def _member(ref, parts: dict[str, bytes], kind: MediaKind) -> str:
    """The member of ``parts`` a name refers to (the name itself, its basename, or a member it ends with)."""
    if not isinstance(ref, str):
        raise SampleError(f"{kind} reference {str(ref)[:40]!r} is not a name")
    base = ref.rsplit("/", 1)[-1]
    match = next((p for p in (ref, base) if p in parts), None)
    if match is None:
        match = next((p for p in parts if base.endswith("." + p)), None)
    if match is None:
        raise SampleError(f"media {ref[:60]!r} referenced but missing")
    if member_kind(match) != kind:
        raise SampleError(f"member {match!r} is referenced as {kind} but is not a known {kind} format")
    return match


def _check_all_used(found: dict[str, list[Media]], media: list[Media]) -> None:
    """Every media member of the sample must be used: one the conversation leaves out would vanish from the pack."""
    used = {p for m in media for p in (m.frames or (m.part,))}
    for kind, items in found.items():
        for m in items:
            if not used.intersection(m.frames or (m.part,)):
                raise SampleError(f"{kind} member {m.part!r} is not referenced by the conversation")
