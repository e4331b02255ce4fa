"""Adapter given by the user as ``module:function``.

The function receives the raw sample (``{part: bytes}`` plus ``"__key__"``) and returns a
:class:`~packtool.packer.sources.sample.Conversation`, or a dict ``{"messages": [...], "media": [part names]}`` with
``<image>``/``<video>``/``<audio>`` tags in the text (or none: media then go before the first user text; a part's
kind follows its extension). It raises
:class:`~packtool.packer.sources.sample.SampleError` (or any exception) to reject a sample with a reason: whatever it
raises quarantines that sample with the adapter and its error as the reason; ``sys.exit`` in it stops the run with
an error naming the adapter and the sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from packtool.errors import ConfigError, user_code
from packtool.packer.sources.conversation import member_kind, parse_turns, place_media
from packtool.packer.sources.sample import Conversation, Media, SampleError
from packtool.storage import allow_pandas


def load_function(spec: str) -> Callable:
    """Import ``module:function``."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"adapter must be module:function, not {spec!r}")
    try:
        allow_pandas()  # the user's module may use it
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load adapter {spec!r}: {exc}") from None


def custom_adapter(parts: dict[str, bytes], key: str, function: Callable, name: str | None = None) -> Conversation:
    """Call the user's function (``name``: its ``module:function``) and normalise what it returns."""
    name = name or f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', function)}"
    with user_code(f"adapter {name}"):
        out = function({**parts, "__key__": key})
    if isinstance(out, Conversation):
        conv = out
    elif isinstance(out, dict) and "messages" in out:
        media = [m if isinstance(m, Media) else Media(part=str(m), kind=member_kind(str(m)) or "image")
                 for m in out.get("media", [])]
        conv = Conversation(messages=parse_turns(out["messages"]), media=media)
    else:
        raise SampleError(f"adapter returned {type(out).__name__}, not a conversation")
    for m in conv.media:
        if m.part not in parts:
            raise SampleError(f"media {m.part!r} referenced but missing")
    conv.messages, conv.media, conv.untagged = place_media(conv.messages, conv.media)
    return conv
