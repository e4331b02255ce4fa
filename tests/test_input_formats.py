"""The input format is chosen once per source, from what the source declares and the settings
(``packtool.packer.sources.formats``): each ``dataset.yaml`` shape picks its format, an adapter wins over any
declaration, and a ``sample_loader`` without an adapter is refused in one line."""

from __future__ import annotations

import json

import pytest

from packtool.errors import ConfigError
from packtool.packer.sources.energon import RawSample
from packtool.packer.sources.formats import FORMATS, input_format
from packtool.settings import EncodeSettings

CHATML = {"__class__": "ChatMLWebdataset", "field_map": {"conversation": "json", "imgs": "jpgs"}}
TYPED = {"sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
         "field_map": {"image": "jpg", "caption": "txt"}}


def _settings(**kw) -> EncodeSettings:
    return EncodeSettings(tokenizer="unused", pack_size=1024, **kw)


def _raw(parts: dict[str, bytes]) -> RawSample:
    return RawSample(key="s0", shard="a.tar", index=0, parts=parts)


def adapter(sample):
    """A user's adapter (``test_input_formats:adapter``): the sample's parts and ``__key__`` in, a conversation out."""
    return {"messages": [{"role": "user", "content": sample["__key__"]}, {"role": "assistant", "content": "ok"}]}


@pytest.mark.parametrize("declared,name", [(None, "conversation"), ({}, "conversation"), (TYPED, "typed"),
                                           (CHATML, "chatml"), ({"__class__": "CrudeWebdataset"}, "conversation")])
def test_each_declaration_picks_its_format(declared, name):
    assert input_format(declared, _settings()).name == name


def test_an_adapter_wins_and_a_sample_loader_needs_one():
    spec = "test_input_formats:adapter"
    assert input_format(TYPED, _settings(adapter=spec)).name == "custom"
    assert input_format({"sample_loader": "x.py:f"}, _settings(adapter=spec)).name == "custom"
    with pytest.raises(ConfigError, match="sample_loader: give an adapter"):
        input_format({"sample_loader": "x.py:f"}, _settings())
    assert [name for name, _ in FORMATS] == ["custom", "typed", "chatml", "conversation"]
    conv = input_format(None, _settings(adapter=spec)).conversation(_raw({"json": b"{}"}))
    assert [m["content"] for m in conv.messages] == ["s0", "ok"]


def test_the_chosen_format_reads_a_sample():
    doc = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    conv = input_format(None, _settings()).conversation(_raw({"json": json.dumps(doc).encode()}))
    assert [m["content"] for m in conv.messages] == ["hi", "hello"]
    typed = input_format(TYPED, _settings()).conversation(_raw({"jpg": b"\xff\xd8", "txt": b"a cat"}))
    assert typed.messages[-1]["content"] == "a cat" and [m.kind for m in typed.media] == ["image"]
