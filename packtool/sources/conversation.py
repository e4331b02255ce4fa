"""Adapter for chat JSON samples: LLaVA/ShareGPT (``from``/``value``) and ChatML (``role``/``content``).

A ``json`` member holds a list of turns or ``{"conversations"|"messages"|"conversation": [...]}``. Images are the
members whose part name ends in an image extension (``jpg``, ``img0.png``, ``1.webp``), numbered ones in number
order; or, with ``allow_pickle``, a ``jpgs`` member holding a pickled list of image bytes or decoded image
arrays (a pickled ``videos`` member holding any video quarantines the sample: videos are not supported yet).
``<image>`` in the text marks where each image goes; without tags, images go before the first user text.
"""

from __future__ import annotations

import json
import re

from packtool.media import IMAGE_EXTENSIONS
from packtool.sources.safepickle import load_bytes_list, refuse_videos
from packtool.sources.sample import IMAGE_TAG, Conversation, Media, SampleError

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}

_NUMBER = re.compile(r"(\d+)$")


def _json_part(parts: dict[str, bytes]) -> str:
    if "json" in parts:
        return "json"
    for name in sorted(parts):
        if name.endswith("json"):
            return name
    raise SampleError("no json member")


def image_parts(parts) -> list[str]:
    """Image part names in placeholder order: unnumbered first by name, then numbered by number."""

    def order(name: str):
        stem = name.rsplit(".", 1)[0] if "." in name else ""
        m = _NUMBER.search(stem)
        return (0, -1, name) if m is None else (1, int(m.group(1)), name)

    return sorted((p for p in parts if p.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS), key=order)


def _text(content) -> str:
    """Turn content into text with ``<image>`` tags: a string, or a list of ``{"type": "text"|"image"}`` parts."""
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
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                pieces.append(IMAGE_TAG)
            else:
                raise SampleError(f"unsupported content part {str(part)[:60]!r}")
        return "".join(pieces)
    raise SampleError(f"unsupported content of type {type(content).__name__}")


def parse_turns(doc) -> list[dict]:
    """Messages ``[{"role", "content"}]`` from the JSON document; raises :class:`SampleError` with a reason."""
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
        if role not in ROLES:
            raise SampleError(f"unknown role {str(role)[:40]!r}")
        content = turn["content"] if "content" in turn else turn.get("value")
        messages.append({"role": ROLES[role], "content": _text(content)})
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleError("no assistant turn")
    return messages


def place_images(messages: list[dict], n_images: int) -> list[dict]:
    """Check ``<image>`` tags against the image count; without tags put all images before the first user text."""
    tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    if tags == n_images:
        return messages
    if tags:
        raise SampleError(f"{tags} <image> tags but {n_images} images")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise SampleError(f"{n_images} images but no user turn to place them in")
    placed = [dict(m) for m in messages]
    placed[first_user]["content"] = IMAGE_TAG * n_images + placed[first_user]["content"]
    return placed


def conversation_adapter(parts: dict[str, bytes], *, allow_pickle: bool = False) -> Conversation:
    """The conversation of one raw sample (``{part: bytes}``)."""
    name = _json_part(parts)
    try:
        doc = json.loads(parts[name].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleError(f"invalid json in {name!r}: {exc}") from None
    messages = parse_turns(doc)
    media = [Media(part=p) for p in image_parts(parts)]
    if isinstance(doc, dict) and isinstance(doc.get("image", doc.get("images")), (str, list)):
        media = _referenced_media(doc.get("image", doc.get("images")), parts)
    if "jpgs" in parts:
        if not allow_pickle:
            raise SampleError("pickled member 'jpgs' refused: pickles are read only with allow_pickle")
        items = load_bytes_list(parts["jpgs"])
        media += [Media(part="jpgs", item=i) for i in range(len(items))]
    if "videos" in parts:  # Megatron-Bridge's convert_to_qwenvl_wds.py writes one to every sample
        if not allow_pickle:
            raise SampleError("pickled member 'videos' refused (pickled members are read only when allowed)")
        refuse_videos(parts["videos"])
    return Conversation(messages=place_images(messages, len(media)), media=media)


def _referenced_media(refs, parts: dict[str, bytes]) -> list[Media]:
    """Media named by the JSON (``"image": "0.jpg"`` or a list); each must be a member of the sample."""
    refs = [refs] if isinstance(refs, str) else refs
    media = []
    for ref in refs:
        if not isinstance(ref, str):
            raise SampleError(f"image reference {str(ref)[:40]!r} is not a name")
        base = ref.rsplit("/", 1)[-1]
        match = next((p for p in (ref, base) if p in parts), None)
        if match is None:
            match = next((p for p in parts if base.endswith("." + p)), None)
        if match is None:
            raise SampleError(f"media {ref[:60]!r} referenced but missing")
        media.append(Media(part=match))
    return media
