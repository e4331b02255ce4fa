"""The two private transformers functions packtool renders chat templates with (:mod:`packtool.packer.hfcompat`):
``chat_template_utils._compile_jinja_template`` and ``chat_template_utils._render_with_assistant_indices``. A
transformers release that renames them, changes their arguments, or renders other text or other spans than
``apply_chat_template`` fails here, not in a quietly different encoding."""

from __future__ import annotations

import inspect

import jinja2
import pytest

import demo
from packtool.packer import hfcompat
from packtool.packer.encoder import load_tokenizer

CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it? {{ not jinja }}"}]},
    {"role": "assistant", "content": "  A red river, {% raw %} as written.\n"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Because of the light."},
]
REPLIES = ["  A red river, {% raw %} as written.\n", "Because of the light."]


def test_the_private_functions_take_the_arguments_packtool_passes():
    from transformers.utils import chat_template_utils as ctu

    assert list(inspect.signature(ctu._compile_jinja_template).parameters) == ["chat_template"]
    params = inspect.signature(ctu._render_with_assistant_indices).parameters
    assert list(params)[:5] == ["compiled_template", "messages", "tools", "documents", "add_generation_prompt"]
    assert params[list(params)[5]].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("generation_tags", [True, False])
def test_render_with_spans_gives_apply_chat_template_text_and_the_generation_spans(demo_dir, generation_tags):
    """The text is ``apply_chat_template``'s; the spans are the ``{% generation %}`` blocks (each reply and its
    ``<|im_end|>``), none for a template without them (the control)."""
    folder = demo_dir / ("tokenizer-gen" if generation_tags else "tokenizer")
    tok = load_tokenizer(folder)
    source = demo.chat_template(generation_tags=generation_tags)
    assert tok.chat_template == source
    template = hfcompat.compile_template(source)
    kwargs = dict(tok.special_tokens_map)
    text, spans = hfcompat.render_with_spans(template, CONVERSATION, **kwargs)
    assert text == tok.apply_chat_template(CONVERSATION, tokenize=False)
    if generation_tags:
        assert [text[s:e] for s, e in spans] == [r + "<|im_end|>" for r in REPLIES]
        assert all(isinstance(s, int) and isinstance(e, int) for s, e in spans)
    else:
        assert spans == []


def test_the_compiled_template_has_transformers_extensions():
    """``raise_exception`` raises a Jinja TemplateError with the template's message (a sample's ledger reason),
    ``tojson`` keeps non-ASCII text, and an unknown tag is refused when the template compiles."""
    refusing = hfcompat.compile_template("{{ raise_exception('refused by the template') }}")
    with pytest.raises(jinja2.TemplateError, match="refused by the template"):
        refusing.render(messages=[])
    assert hfcompat.compile_template("{{ messages | tojson }}").render(messages=["é"]) == '["é"]'
    with pytest.raises(jinja2.TemplateError):
        hfcompat.compile_template("{% nosuchtag %}")


def cited_tests(texts: dict) -> set[tuple[str, str]]:
    """(citing file, test file) for every ``tests/NAME.py`` the texts name."""
    import re

    return {(p.name, t) for p, text in texts.items() for t in re.findall(r"tests/[A-Za-z0-9_]+\.py", text)}


def test_the_docs_cite_only_what_exists(tmp_path):
    """Every test file packtool's modules, README and docs pages cite exists, and every name the format's layout
    (the format package's docstring) gives for a file is defined in the format package."""
    import re
    from pathlib import Path

    import packtool.format as fmt

    root = Path(__file__).resolve().parents[1]
    docs = sorted((root / "docs").glob("*.md"))
    texts = {p: p.read_text() for p in [root / "README.md", *docs, *sorted((root / "packtool").rglob("*.py"))]}
    cited = cited_tests(texts)
    assert cited and [c for c in cited if not (root / c[1]).exists()] == []
    assert docs and any(name.endswith(".md") for name, _ in cited)  # the docs pages are read and cite tests
    # the control: a page citing a test file that does not exist is caught
    page = tmp_path / "page.md"
    page.write_text("tested in `tests/test_hf.py` and `tests/test_no_such_file.py`")
    assert [c for c in cited_tests({page: page.read_text()}) if not (root / c[1]).exists()] == \
        [("page.md", "tests/test_no_such_file.py")]
    layout = fmt.__doc__.split("OUTPUT layout::", 1)[1].split("\n\n", 2)[1]
    names = set(re.findall(r"\b(?:[A-Z][a-z]+[A-Z]\w*|[A-Z]+_[A-Z_]+|[a-z]+_[a-z_]+)\b", layout))
    assert {"PackRecord", "SplitYaml", "LEDGER_SCHEMA", "write_energon_metadata"} <= names
    assert sorted(n for n in names if not hasattr(fmt, n) and n not in {"CrudeWebdataset"}) == []
