"""Adapter for Energon typed datasets: ``VQASample`` and ``CaptioningSample`` through their ``field_map``.

VQA becomes one user turn (image, then the context) and one assistant turn (the first answer); captioning one
user turn (the image, plus an optional prompt) and the caption as the reply.
"""

from __future__ import annotations

from typing import Any

from packtool.packer.sources.sample import IMAGE_TAG, Conversation, Media, SampleError, json_member

TYPED = ("VQASample", "CaptioningSample")


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
    try:
        if ext == "json":
            return json_member(part, data)
        if ext in ("txt", "text"):
            return data.decode("utf-8")
    except ValueError as exc:
        raise SampleError(f"member {part!r} is not valid {ext}: {exc}") from None
    return data


def _access(value: dict, spec: str) -> Any:
    """``spec`` resolved in ``value`` by Energon's own field access (``part``, ``part[key][0]``, alternatives
    separated by commas: the first that resolves wins), so a field_map reads the same here as in Energon.
    Imported here: Energon's package imports torch, which encode workers otherwise never load."""
    from megatron.energon.flavors.webdataset.field_access import (
        field_access,
        split_field_access,
    )

    try:
        return field_access(value, split_field_access(spec))
    except (KeyError, ValueError, IndexError, TypeError) as exc:  # the sample's data is not shaped as the spec says
        raise SampleError(f"field {spec!r} not found ({exc})") from None


def _field(parts: dict[str, bytes], spec: str) -> Any:
    """The value of ``spec`` in a raw sample, its json/txt members decoded as Energon's default decoder would."""
    from megatron.energon.flavors.webdataset.field_access import split_field_access

    names = {option[0] for option in split_field_access(spec)}
    return _access({p: _decode(p, data) for p, data in parts.items() if p in names}, spec)


def _image_part(parts: dict[str, bytes], spec: str) -> str:
    """The member ``spec`` picks for the image (resolved over member names: the image is referenced, not read)."""
    part = _access({p: p for p in parts}, spec)
    if not isinstance(part, str):
        raise SampleError(f"field {spec!r} does not name an image member")
    return part


def typed_adapter(parts: dict[str, bytes], *, kind: str, field_map: dict[str, str], prompt: str = "") -> Conversation:
    """The conversation of one raw sample of a typed dataset."""
    image_part = _image_part(parts, field_map.get("image", "jpg,png,jpeg,webp"))
    if kind == "VQASample":
        context = _field(parts, field_map["context"])
        answers = _field(parts, field_map.get("answers", "answers"))
        answer = answers[0] if isinstance(answers, list) and answers else answers
        if not isinstance(answer, str) or not isinstance(context, str):
            raise SampleError("VQA context/answer is not text")
        user = f"{IMAGE_TAG}{context}"
    elif kind == "CaptioningSample":
        answer = _field(parts, field_map.get("caption", "txt"))
        if not isinstance(answer, str):
            raise SampleError("caption is not text")
        user = f"{IMAGE_TAG}{prompt}"
    else:
        raise SampleError(f"unsupported sample type {kind}")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return Conversation(messages=messages, media=[Media(part=image_part)])
