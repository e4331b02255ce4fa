"""Adapter for Energon typed datasets: ``VQASample`` and ``CaptioningSample`` through their ``field_map``.

VQA becomes one user turn (image, then the context) and one assistant turn (the first answer); captioning one
user turn (the image, plus an optional prompt) and the caption as the reply.
"""

from __future__ import annotations

import json
import re

from packtool.sources.sample import IMAGE_TAG, Conversation, Media, SampleError

TYPED = ("VQASample", "CaptioningSample")
_ACCESS = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]+\])*)$")


def sample_type(dataset_yaml: dict) -> str | None:
    """The typed sample class named by ``dataset.yaml``, or ``None`` for crude/conversation datasets."""
    st = dataset_yaml.get("sample_type")
    name = st.get("__class__") if isinstance(st, dict) else None
    if name is None:
        legacy = dataset_yaml.get("__class__", "")
        name = {"VQAWebdataset": "VQASample", "CaptioningWebdataset": "CaptioningSample"}.get(legacy)
    return name


def _decode(part: str, data: bytes):
    ext = part.rsplit(".", 1)[-1].lower()
    if ext == "json":
        return json.loads(data.decode("utf-8"))
    if ext in ("txt", "text"):
        return data.decode("utf-8")
    return data


def _field(parts: dict[str, bytes], spec: str):
    """Energon's field access: ``part``, ``part[key][0]``, alternatives separated by commas."""
    for option in spec.split(","):
        m = _ACCESS.match(option.strip())
        if not m or m.group(1) not in parts:
            continue
        value = _decode(m.group(1), parts[m.group(1)])
        for key in re.findall(r"\[([^\[\]]+)\]", m.group(2)):
            try:
                value = value[int(key)] if isinstance(value, list) else value[key]
            except (KeyError, IndexError, TypeError, ValueError):
                raise SampleError(f"field {option!r} not found") from None
        return m.group(1), value
    raise SampleError(f"no member for field {spec!r}")


def typed_adapter(parts: dict[str, bytes], *, kind: str, field_map: dict[str, str], prompt: str = "") -> Conversation:
    """The conversation of one raw sample of a typed dataset."""
    image_part, _ = _field(parts, field_map.get("image", "jpg,png,jpeg,webp"))
    if kind == "VQASample":
        _, context = _field(parts, field_map["context"])
        _, answers = _field(parts, field_map.get("answers", "answers"))
        answer = answers[0] if isinstance(answers, list) and answers else answers
        if not isinstance(answer, str) or not isinstance(context, str):
            raise SampleError("VQA context/answer is not text")
        user = f"{IMAGE_TAG}{context}"
    elif kind == "CaptioningSample":
        _, answer = _field(parts, field_map.get("caption", "txt"))
        if not isinstance(answer, str):
            raise SampleError("caption is not text")
        user = f"{IMAGE_TAG}{prompt}"
    else:
        raise SampleError(f"unsupported sample type {kind}")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return Conversation(messages=messages, media=[Media(part=image_part)])
