"""Which input format a source's samples are in, chosen once per source: one interface (:class:`InputFormat`: a
name and ``conversation(raw) -> Conversation``) and an ordered registry of the formats packtool reads
(:data:`FORMATS`), each deciding from what the source declares (its ``dataset.yaml``; nothing for JSON/JSONL,
Parquet and Hugging Face datasets, whose records reach the encoder as chat JSON) and the settings whether it applies.

Order: a user's ``module:function`` adapter (``--adapter``) first, then Energon's typed samples (``sample_type`` with
a ``field_map``: VQA, captioning, ...), then Megatron-Bridge's ChatML webdataset fields, then the chat-JSON
conversation every other source holds. The encoder asks :func:`input_format` once and calls it per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from packtool.errors import ConfigError
from packtool.packer.sources.conversation import conversation_adapter
from packtool.packer.sources.custom import custom_adapter, load_function
from packtool.packer.sources.mbridge import ChatMLFields, chatml_adapter, chatml_fields
from packtool.packer.sources.sample import Conversation
from packtool.packer.sources.typed import sample_type, typed_adapter

if TYPE_CHECKING:
    from packtool.packer.sources.energon import RawSample
    from packtool.settings import EncodeSettings


class InputFormat(Protocol):
    """A raw sample of one format as a :class:`Conversation`."""

    #: The format's name (``custom``, ``typed``, ``chatml``, ``conversation``).
    @property
    def name(self) -> str: ...

    def conversation(self, raw: RawSample) -> Conversation: ...


@dataclass(frozen=True)
class CustomFormat:
    """A user's ``module:function`` (``--adapter``): it receives the sample's parts and key."""

    function: Callable
    spec: str
    name: str = "custom"

    def conversation(self, raw: RawSample) -> Conversation:
        return custom_adapter(raw.parts, raw.key, self.function, name=self.spec)


@dataclass(frozen=True)
class TypedFormat:
    """Energon's typed samples (``sample_type`` and ``field_map`` of ``dataset.yaml``: VQA, captioning, ...)."""

    kind: str
    field_map: Mapping[str, str]
    prompt: str
    name: str = "typed"

    def conversation(self, raw: RawSample) -> Conversation:
        return typed_adapter(raw.parts, kind=self.kind, field_map=dict(self.field_map), prompt=self.prompt)


@dataclass(frozen=True)
class ChatMLFormat:
    """Megatron-Bridge's ChatML webdataset (its fields in ``dataset.yaml``); ``audio``: whether the convention takes
    its ``audio`` member."""

    fields: ChatMLFields
    allow_pickle: bool
    audio: bool
    name: str = "chatml"

    def conversation(self, raw: RawSample) -> Conversation:
        return chatml_adapter(raw.parts, fields=self.fields, allow_pickle=self.allow_pickle, audio=self.audio)


@dataclass(frozen=True)
class ConversationFormat:
    """Chat JSON (ShareGPT, OpenAI messages, LLaVA, a bare list of turns) with its media as members or references."""

    allow_pickle: bool
    name: str = "conversation"

    def conversation(self, raw: RawSample) -> Conversation:
        return conversation_adapter(raw.parts, allow_pickle=self.allow_pickle)


def _custom(dataset_yaml: Mapping[str, Any], settings: EncodeSettings, chatml_audio: bool) -> InputFormat | None:
    if settings.adapter:
        return CustomFormat(load_function(settings.adapter), settings.adapter)
    if dataset_yaml.get("sample_loader"):
        raise ConfigError("dataset.yaml uses a sample_loader: give an adapter (module:function) for it")
    return None


def _typed(dataset_yaml: Mapping[str, Any], settings: EncodeSettings, chatml_audio: bool) -> InputFormat | None:
    kind = sample_type(dict(dataset_yaml))
    if kind is None:
        return None
    return TypedFormat(kind, dict(dataset_yaml.get("field_map") or {}), settings.caption_prompt)


def _chatml(dataset_yaml: Mapping[str, Any], settings: EncodeSettings, chatml_audio: bool) -> InputFormat | None:
    fields = chatml_fields(dict(dataset_yaml))
    return None if fields is None else ChatMLFormat(fields, settings.allow_pickle, chatml_audio)


def _conversation(dataset_yaml: Mapping[str, Any], settings: EncodeSettings, chatml_audio: bool) -> InputFormat:
    return ConversationFormat(settings.allow_pickle)


#: ``(dataset.yaml, settings, whether the convention takes ChatML audio) -> the format, or None where it does not
#: apply``, in the order they are tried (the last always applies).
FORMATS: tuple[tuple[str, Callable[[Mapping[str, Any], EncodeSettings, bool], InputFormat | None]], ...] = (
    ("custom", _custom),
    ("typed", _typed),
    ("chatml", _chatml),
    ("conversation", _conversation),
)


def input_format(dataset_yaml: Mapping[str, Any] | None, settings: EncodeSettings, *,
                 chatml_audio: bool = False) -> InputFormat:
    """The input format of a source that declares ``dataset_yaml`` (None or empty: none), under these settings:
    the first of :data:`FORMATS` that applies. :class:`ConfigError` for a declaration packtool cannot read alone
    (a ``sample_loader`` without an adapter)."""
    for _, choose in FORMATS:
        found = choose(dataset_yaml or {}, settings, chatml_audio)
        if found is not None:
            return found
    raise AssertionError("the conversation format always applies")
