"""The two private transformers functions the encoder relies on, behind one seam.

transformers renders chat templates with a sandboxed Jinja environment that knows its extensions (the
``{% generation %}`` tag, ``raise_exception``, ``tojson`` with its own options). packtool renders the same way,
so its text is exactly what ``apply_chat_template`` makes, but the public API renders one conversation per call
and returns no character spans. ``tests/test_hfcompat.py`` pins the behaviour packtool needs from these private
functions, so a transformers release that changes them fails there, loudly, not in a quietly different encoding.
transformers is imported on first use: a process that never renders (the parent of a run with workers) does not
pay its second of import time.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def _ctu() -> ModuleType:
    from transformers.utils import chat_template_utils

    return chat_template_utils


def compile_template(source: str) -> Any:
    """The compiled Jinja template transformers would render ``source`` with."""
    return _ctu()._compile_jinja_template(source)


def render_with_spans(template: Any, messages: list[dict], **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` (no tools, no documents, no generation prompt) and return the text and the character
    spans of every ``{% generation %}`` block, in order."""
    text, spans = _ctu()._render_with_assistant_indices(template, messages, None, None, False, **kwargs)
    return text, [(int(s), int(e)) for s, e in spans]
