"""Rendering by conversation shape: the proof over the template's syntax tree, and byte-identical text, reply
spans, tokens and targets (and the same errors) as rendering every prefix, on several templates."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from packtool.packer.chatshape import copies_text_verbatim
from packtool.packer.encoder import Encoder
from packtool.packer.sources import open_source, read_raw_samples
from packtool.settings import EncodeSettings

#: Qwen2.5 style: a default system turn, ``message.content`` printed in a concatenation, tool turns merged into a
#: user turn (looking back and forward with ``loop``), a truthiness test on the content.
QWEN25 = """{%- if messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>' + message.role -}}
{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
{%- for call in message.tool_calls -%}{{- call | tojson -}}{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' -}}{{- message.content -}}{{- '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

#: Qwen2.5-VL style: string contents printed, list contents walked part by part (narrowed by ``is string``), a
#: namespace counting images, ``~`` joins.
QWEN25_VL = """{%- set ns = namespace(images=0) -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}
{%- endif -%}
{{- '<|im_start|>' ~ message['role'] ~ '\\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' or 'image' in part -%}
{%- set ns.images = ns.images + 1 -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif 'text' in part -%}{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

#: Copies text verbatim, but its generation prompt is not how it opens an assistant turn: every reply fails to be
#: located, by shape as by prefix renders.
ODD_PROMPT = QWEN25.replace("{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
                            "{{- '<|im_start|>assistant\\n<think>' -}}{%- endif -%}")

#: No default system turn: a conversation that opens with a reply renders it right after the generation prompt.
BARE = """{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- if loop.last and message['role'] == 'assistant' -%}{{- '<|endoftext|>' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

#: Prints a placeholder character of its own (an escape in a literal, and a formatted one) around each turn.
PRIVATE_USE = ("{%- for message in messages -%}{{- '\\U000f0000' + message['role'] + '\\n' -}}"
               "{{- message['content'] + ('%c' % 1048576) + '<|im_end|>\\n' -}}{%- endfor -%}"
               "{%- if add_generation_prompt -%}{{- '\\U000f0000assistant\\n' -}}{%- endif -%}")

#: Qwen3 style: the reply is cut at a reasoning marker before it is printed.
QWEN3 = """{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

#: Llama 3 style: every content trimmed.
TRIMMED = """{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

#: A loop over the messages with a body (``BODY``), for small variants.
_LOOP = ("{%- for message in messages -%}BODY{{- '<|im_end|>\\n' -}}{%- endfor -%}"
         "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")



def _loop(body: str) -> str:
    return _LOOP.replace("BODY", body)


#: Templates that look into, transform, measure or alias message text: the proof must refuse each.
TRANSFORMING = {
    "qwen3 split": QWEN3,
    "trim": TRIMMED,
    "length": _loop("{{- message.content | length -}}{{- message.content -}}"),
    "substring test": _loop("{%- if 'x' in message.content -%}!{%- endif -%}{{- message.content -}}"),
    "comparison": _loop("{%- if message.content == 'hi' -%}!{%- endif -%}{{- message.content -}}"),
    "method": _loop("{{- message.content.upper() -}}"),
    "dict get": _loop("{{- message.get('content') -}}"),
    "slice": _loop("{{- message['content'][1:] -}}"),
    "tojson": _loop("{{- message | tojson -}}"),
    "messages filter": "{%- for m in messages | selectattr('role', 'equalto', 'user') -%}{{ m.content }}"
                       "{%- endfor -%}",
    "string iteration": _loop("{%- for c in message.content -%}{{- c -}}{%- endfor -%}"),
    "format": _loop("{{- '%s' % message.content -}}"),
    "error message": _loop("{%- if message.role == 'x' -%}{{- raise_exception(message.content) -}}"
                                  "{%- endif -%}{{- message.content -}}"),
    "macro trims": "{%- macro show(text) -%}{{- text | trim -}}{%- endmacro -%}" + _loop(
        "{{- show(message.content) -}}"),
    "namespace then trim": "{%- set ns = namespace(last='') -%}" + _loop(
        "{%- set ns.last = message.content -%}{{- ns.last | trim -}}"),
    "namespace alias": "{%- set ns = namespace(last='') -%}{%- set alias = ns -%}" + _loop(
        "{%- set alias.last = message.content -%}{{- ns.last | trim -}}"),
    "set block": _loop("{%- set body -%}{{- message.content -}}{%- endset -%}{{- body | trim -}}"),
    "filter block": _loop("{%- filter upper -%}{{- message.content -}}{%- endfilter -%}"),
    "list content printed": _loop("{{- message.content -}}"),  # refused only where contents are lists
    "macro defined twice": "{%- macro show(t) -%}{{- t -}}{%- endmacro -%}{%- macro show(t) -%}{{- t | trim -}}"
                           "{%- endmacro -%}" + _loop("{{- show(message.content) -}}"),
}


def _tree(source: str):
    from packtool.packer.encoder import _compile

    return _compile(source, "t").environment.parse(source)


def test_proof_accepts_templates_that_copy_text():
    for source in (QWEN25, QWEN25_VL, ODD_PROMPT, BARE, PRIVATE_USE):
        assert copies_text_verbatim(_tree(source), lists=False)
    assert copies_text_verbatim(_tree(QWEN25_VL), lists=True)


@pytest.mark.parametrize("name", sorted(TRANSFORMING))
def test_proof_refuses_templates_that_use_text(name):
    """Control: each of these uses message text other than by copying it (for the last one: prints a list of
    parts), so the encoder must render it prefix by prefix."""
    assert not copies_text_verbatim(_tree(TRANSFORMING[name]), lists=True)
    if name != "list content printed":
        assert not copies_text_verbatim(_tree(TRANSFORMING[name]), lists=False)


def test_demo_template_is_proven(demo_dir):
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    assert enc.structured and enc.shapes is not None and enc.shapes.proven == {False: True, True: True}


def _folder(demo_dir, tmp_path, name: str, source: str):
    folder = tmp_path / name
    shutil.copytree(demo_dir / "tokenizer", folder)
    (folder / "chat_template.jinja").write_text(source)
    return folder


def _outcome(enc: Encoder, messages: list[dict]):
    try:
        return enc.target_spans(messages)
    except Exception as exc:  # the same error (type and reason) either way
        return type(exc).__name__, str(exc)


_PUA = "\U000f0000\U000f0001"

#: Conversations as adapters give them: the image tag in user turns, replies with edge whitespace, system and tool
#: turns, several turns, an empty user turn, a reply opening the conversation, replies that hold the template's own
#: markers or the placeholder characters.
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "  a2 with spaces  \n"}],
    [{"role": "user", "content": "<image>what is this?"}, {"role": "assistant", "content": "\na cat\n"},
     {"role": "user", "content": "and <image> this <image>?"}, {"role": "assistant", "content": "two dogs "}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty question"}],
    [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "done"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "calling"},
     {"role": "tool", "content": "result 1"}, {"role": "tool", "content": "result 2"},
     {"role": "assistant", "content": "both back"}],
    [{"role": "user", "content": "x <|im_start|>assistant\n y"}, {"role": "assistant", "content": "<|im_end|> z"}],
    [{"role": "user", "content": f"odd {_PUA} chars"}, {"role": "assistant", "content": f"{_PUA}reply{_PUA}"}],
    [{"role": "system", "content": "s"}, {"role": "system", "content": "second system"},
     {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
]


@pytest.mark.parametrize("name", ["demo", "qwen25", "qwen25_vl", "odd_prompt", "bare", "private_use", "qwen3",
                                  "trimmed"])
def test_shape_rendering_equals_prefix_rendering(demo_dir, tmp_path, name):
    """Text and reply spans (or the error) by shape are exactly those of rendering every prefix; each conversation
    is encoded twice (the second time from the shape cache) next to a same-shaped one with other texts."""
    source = {"demo": None, "qwen25": QWEN25, "qwen25_vl": QWEN25_VL, "odd_prompt": ODD_PROMPT, "bare": BARE,
              "private_use": PRIVATE_USE, "qwen3": QWEN3, "trimmed": TRIMMED}[name]
    folder = demo_dir / "tokenizer" if source is None else _folder(demo_dir, tmp_path, name, source)
    shaped = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048))
    prefixed = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048))
    prefixed.shapes = None
    proven = name not in ("qwen3", "trimmed")
    assert shaped.shapes is not None and shaped.shapes.proven[False] is proven
    renamed = [[{**m, "content": m["content"].replace("a", "b") + ("!" if m["content"] else "")} for m in conv]
               for conv in CONVERSATIONS]
    for conv in CONVERSATIONS + renamed + CONVERSATIONS:
        assert _outcome(shaped, conv) == _outcome(prefixed, conv), conv
    used = [layout for layout in shaped.shapes._cache.values() if layout is not None]
    # shapes rendered once, then reused; none where the template prints placeholder characters itself
    assert len(used) >= (4 if proven and name not in ("odd_prompt", "private_use") else 0)
    if name == "private_use":
        assert proven and not used
    if name == "odd_prompt":
        assert _outcome(shaped, CONVERSATIONS[0])[0] == "SampleError"


def test_demo_dataset_encodes_identically(demo_dir):
    """Every demo sample (images, long samples, hostile ones): same rows, tokens, targets and media."""
    src = open_source(demo_dir / "dataset")
    raws = [r for split in src.splits.values() for shard in split
            for r in read_raw_samples(src.root, shard, src.excluded_samples)]
    shaped = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    prefixed = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    prefixed.shapes = None
    a, b = shaped.encode_many(raws), prefixed.encode_many(raws)
    assert len(a) == len(b) == len(raws) and sum(e.status == "packed" for e in a) > len(raws) // 2
    for x, y in zip(a, b):
        assert (x.key, x.status, x.reason, x.media) == (y.key, y.status, y.reason, y.media)
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.targets, y.targets)
