"""Builders of a small demo tokenizer and demo Energon datasets for packtool.

Everything here is generated offline and deterministically from a seed: no hub, no downloads.

* :func:`build_tokenizer` trains a tiny byte-level BPE and saves a Hugging Face model folder (tokenizer,
  ChatML chat template in the Qwen2-VL style, Qwen2-VL image processor config).
* :func:`build_dataset` writes a crude Energon dataset of WebDataset shards with conversation samples in the
  input styles packtool accepts (ShareGPT, ChatML, bare list of turns; single, numbered or no images; `<image>`
  tags or none; tiny / large / odd-shaped images; long multi-turn samples that need truncation).
  With ``video_fraction`` / ``audio_fraction`` it also holds samples with a short generated video (mp4, webm, mkv
  or a frame list) or audio clip (wav, flac); :func:`build_omni_dataset` is such a dataset with audio, video and
  images for a model folder that takes all three (``examples/nemotron_omni_model.py``).
* :func:`build_vqa_dataset` and :func:`build_captioning_dataset` write small typed Energon datasets.

Used by ``make run`` (``python examples/demo.py OUTDIR``), by the test suite and by the benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import multiprocessing
import random
import re
import shutil
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

# ---------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------

#: Special tokens of the demo tokenizer, in id order (ids 0..6).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: Pre-tokenizer split pattern of Qwen2 (byte-level BPE applied to each piece). Shared with
#: ``scripts/qwen_tokenizer.py`` so the demo tokenizer splits text the way the real one does.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: CLIP normalisation used by Qwen2-VL's image processor.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

#: Pixel bounds of the demo image processor (kept small so demo packs stay small).
DEMO_MIN_PIXELS = 3136
DEMO_MAX_PIXELS = 200704

#: The train sample that ``.nv-meta/split.yaml`` excludes (entry ``"shards/train-0000.tar/<key>"``).
#: A scanner that honours ``exclude`` must never report it.
EXCLUDED_KEY = "s000003"
EXCLUDED_SHARD = "shards/train-0000.tar"

#: Name of the ground-truth file written beside the shards of :func:`build_dataset` (one JSON object per
#: sample: key, split, shard, style, images, tags, long, excluded ...). Energon ignores it.
MANIFEST_NAME = "demo-manifest.jsonl"

# ---------------------------------------------------------------------------------------------------------------
# Word list and text generation
# ---------------------------------------------------------------------------------------------------------------

NOUNS = """
time year people way day man woman child world life hand part place case week company system program question
work government number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end member law car city
community name president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy music market sense nation plan college interest death experience effect class control care
field development role effort rate heart drug show leader light voice wife police mind price report decision son
view relationship town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star table need court
oil situation cost industry figure street image phone data picture practice piece land product doctor wall patient
worker news test movie north love support technology step baby computer type attention film tree source truth
river mountain garden window kitchen bridge island forest ocean cloud train engine signal pattern letter answer
""".split()

VERBS = """
is was has had does did says made goes took sees came knows gets gives finds thinks tells becomes shows leaves
feels brings begins keeps holds writes stands hears lets means sets meets runs pays sits speaks lies leads reads
grows loses falls sends builds stays understands draws breaks spends cuts rises drives buys wears chooses seeks
throws catches deals wins forgets opens walks carries paints counts measures explains describes follows changes
watches moves plays turns starts helps calls tries asks needs wants looks uses works seems learns""".split()

ADJECTIVES = """
other new good high old great big small large national young different black long little important political bad
white real best right social only public sure low early able human local late hard major better economic strong
possible whole free military true federal international full special easy clear recent certain personal open red
difficult available likely short single medical current wrong private past foreign fine common poor natural
significant similar hot dead central happy serious ready simple left physical general environmental financial blue
democratic dark various entire close legal religious cold final main green nice huge popular traditional cultural
bright quiet gentle heavy narrow wide shallow deep rough smooth quick slow curious careful brave calm""".split()

FUNCTION_WORDS = """
the a an this that these those some every each any no many few several most of in on at by for with about
against between into through during before after above below to from up down over under again further then once
here there when where why how all both and but or because as until while although""".split()

QUESTION_OPENERS = (
    "What", "Why", "How", "Where", "When", "Which", "Can you explain why", "Could you describe how",
    "Please tell me what", "Do you know where",
)

#: Every word the generator may emit (the tokenizer is trained on the same vocabulary).
WORDS = tuple(dict.fromkeys(NOUNS + VERBS + ADJECTIVES + FUNCTION_WORDS))

_PREPOSITIONS = ("of", "in", "on", "at", "by", "for", "with", "about", "between", "into", "through", "under")
_DETERMINERS = ("the", "a", "this", "that", "every", "some", "each", "the", "the", "a")
_CONJUNCTIONS = ("and", "but", "because", "while", "although", "so", "then")


def _noun_phrase(rng: random.Random) -> list[str]:
    """A determiner, optional adjectives and a noun."""
    words = [rng.choice(_DETERMINERS)]
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return words


def _clause(rng: random.Random) -> list[str]:
    """Subject, verb, object and optional prepositional phrases."""
    words = _noun_phrase(rng) + [rng.choice(VERBS)] + _noun_phrase(rng)
    for _ in range(rng.choice((0, 1, 1, 2))):
        words += [rng.choice(_PREPOSITIONS)] + _noun_phrase(rng)
    return words


def sentence(rng: random.Random, *, question: bool = False) -> str:
    """One English-like sentence (or question) from the demo word list."""
    words = _clause(rng)
    if rng.random() < 0.35:
        words += [","] + [rng.choice(_CONJUNCTIONS)] + _clause(rng)
    if question:
        text = rng.choice(QUESTION_OPENERS) + " " + " ".join(words)
        end = "?"
    else:
        text = " ".join(words)
        text = text[0].upper() + text[1:]
        end = "!" if rng.random() < 0.05 else "."
    return text.replace(" ,", ",") + end


def paragraph(rng: random.Random, n_words: int, *, question: bool = False) -> str:
    """Sentences totalling about ``n_words`` words; the last one is a question if ``question``."""
    parts: list[str] = []
    count = 0
    while count < n_words:
        is_last = count + 14 >= n_words
        s = sentence(rng, question=question and is_last)
        parts.append(s)
        count += s.count(" ") + 1
    if question and not parts[-1].endswith("?"):
        parts.append(sentence(rng, question=True))
    text = " ".join(parts)
    # Occasional paragraph breaks, so newlines appear inside contents too.
    if n_words > 120 and rng.random() < 0.5:
        cut = text.find(". ", len(text) // 2)
        if cut > 0:
            text = text[: cut + 1] + "\n\n" + text[cut + 2 :]
    return text


def training_corpus(n_sentences: int = 4000, seed: int = 1234) -> Iterator[str]:
    """Deterministic training text for the demo BPE (sentences, questions, a few chat-like lines)."""
    rng = random.Random(seed)
    for i in range(n_sentences):
        yield sentence(rng, question=(i % 4 == 0))
        if i % 50 == 0:
            yield "<image>\n" + sentence(rng, question=True)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def chat_template(*, generation_tags: bool = False) -> str:
    """The ChatML chat template (Qwen2-VL style) as Jinja source.

    ``content`` is a string or a list of parts ``{"type": "image"}`` / ``{"type": "video"}`` /
    ``{"type": "text", "text": ...}``; an image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``.
    A literal ``<image>`` inside a string stays text. With ``generation_tags`` the assistant content and its
    ``<|im_end|>`` are wrapped in ``{% generation %}`` (the role header and the trailing newline are not).
    """
    gen_open, gen_close = ("{% generation %}", "{% endgeneration %}") if generation_tags else ("", "")
    return (
        "{%- macro render_content(content) -%}\n"
        "{%- if content is string -%}\n"
        "{{- content -}}\n"
        "{%- else -%}\n"
        "{%- for part in content -%}\n"
        "{%- if part['type'] == 'image' -%}\n"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
        "{%- elif part['type'] == 'video' -%}\n"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
        "{%- elif part['type'] == 'text' -%}\n"
        "{{- part['text'] -}}\n"
        "{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- endif -%}\n"
        "{%- endmacro -%}\n"
        "{%- if messages and messages[0]['role'] != 'system' -%}\n"
        f"{{{{- '<|im_start|>system\\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\\n' -}}}}\n"
        "{%- endif -%}\n"
        "{%- for message in messages -%}\n"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
        "{%- if message['role'] == 'assistant' -%}\n"
        f"{gen_open}{{{{- render_content(message['content']) + '<|im_end|>' -}}}}{gen_close}\n"
        "{%- else -%}\n"
        "{{- render_content(message['content']) + '<|im_end|>' -}}\n"
        "{%- endif -%}\n"
        "{{- '\\n' -}}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "{{- '<|im_start|>assistant\\n' -}}\n"
        "{%- endif -%}\n"
    )


def tokenizer_config(*, tokenizer_class: str = "PreTrainedTokenizerFast", model_max_length: int = 32768) -> dict:
    """``tokenizer_config.json`` content shared by the demo and the Qwen2 tokenizer folders."""
    return {
        "tokenizer_class": tokenizer_class,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
    }


def image_processor_config(*, min_pixels: int = DEMO_MIN_PIXELS, max_pixels: int = DEMO_MAX_PIXELS) -> dict:
    """``preprocessor_config.json`` for transformers' ``Qwen2VLImageProcessor``."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def write_model_folder(
    out_dir: Path,
    tokenizer: Any,
    *,
    generation_tags: bool,
    tokenizer_class: str = "PreTrainedTokenizerFast",
    min_pixels: int = DEMO_MIN_PIXELS,
    max_pixels: int = DEMO_MAX_PIXELS,
) -> Path:
    """Save a ``tokenizers.Tokenizer`` plus config, chat template and image processor config as an HF folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer_class=tokenizer_class))
    _write_json(out_dir / "special_tokens_map.json", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    (out_dir / "chat_template.jinja").write_text(chat_template(generation_tags=generation_tags))
    _write_json(
        out_dir / "preprocessor_config.json",
        image_processor_config(min_pixels=min_pixels, max_pixels=max_pixels),
    )
    return out_dir


def qwen2_style_tokenizer(model: Any) -> Any:
    """Wrap a BPE model in a Qwen2-style pipeline: NFC, regex split, byte level."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer(out_dir: str | Path, *, generation_tags: bool = False, vocab_size: int = 1024) -> Path:
    """Train a small byte-level BPE on generated text and save it as a Hugging Face model folder.

    The special tokens (:data:`SPECIAL_TOKENS`) get ids 0..6. The folder loads offline with
    ``AutoTokenizer.from_pretrained`` and ``AutoImageProcessor.from_pretrained``.
    """
    from tokenizers import AddedToken, models, pre_tokenizers, trainers

    tok = qwen2_style_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return write_model_folder(Path(out_dir), tok, generation_tags=generation_tags)


# ---------------------------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------------------------


def image_size(rng: random.Random) -> tuple[int, int]:
    """A (width, height): mostly ordinary, some tiny, some large, some with odd aspect ratios."""
    r = rng.random()
    if r < 0.10:  # tiny: below min_pixels -> upscaled
        return rng.randint(12, 50), rng.randint(12, 50)
    if r < 0.20:  # large: above max_pixels (even Qwen's default 1,003,520) -> downscaled
        width, height = rng.randint(1160, 1500), rng.randint(880, 1100)
        return (width, height) if rng.random() < 0.7 else (height, width)
    if r < 0.30:  # odd aspect ratio (< 200 as Qwen2-VL requires)
        long_side, short_side = rng.randint(300, 900), rng.randint(24, 60)
        return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
    return rng.randint(96, 640), rng.randint(96, 640)


def render_image(width: int, height: int, seed: int, *, mode: str = "RGB", smooth: bool = True) -> Image.Image:
    """A cheap deterministic picture: a few seeded colour cells upsampled to ``width`` x ``height``.

    ``smooth`` blends the cells (photo-like, for JPEG); otherwise they stay flat blocks (diagram-like, which
    PNG and WebP compress quickly).
    """
    g = np.random.default_rng(seed)
    grid = g.integers(0, 256, size=(int(g.integers(2, 6)), int(g.integers(2, 6)), 3), dtype=np.uint8)
    resample = Image.Resampling.BILINEAR if smooth else Image.Resampling.NEAREST
    pic = Image.fromarray(grid, "RGB").resize((width, height), resample)
    return pic if mode == "RGB" else pic.convert(mode)


def encode_image(pic: Image.Image, fmt: str) -> bytes:
    """Encode to ``jpg``, ``png`` or ``webp`` bytes with fixed settings."""
    buf = io.BytesIO()
    if fmt == "jpg":
        pic.convert("RGB").save(buf, format="JPEG", quality=85)
    elif fmt == "png":
        pic.save(buf, format="PNG", compress_level=1)
    elif fmt == "webp":
        pic.convert("RGB").save(buf, format="WEBP", quality=80, method=0)
    else:
        raise ValueError(f"unknown image format {fmt!r}")
    return buf.getvalue()


def make_image(rng: random.Random, fmt: str) -> tuple[bytes, int, int]:
    """A random-size image in ``fmt``: (bytes, width, height)."""
    width, height = image_size(rng)
    mode = "RGB"
    if fmt == "png" and rng.random() < 0.2:
        mode = rng.choice(("L", "RGBA"))
    pic = render_image(width, height, rng.getrandbits(32), mode=mode, smooth=(fmt == "jpg"))
    return encode_image(pic, fmt), width, height


# ---------------------------------------------------------------------------------------------------------------
# Videos and audio (PyAV: the ``media`` extra)
# ---------------------------------------------------------------------------------------------------------------

#: Container name and video codec for each video extension (codecs PyAV's bundled FFmpeg can write).
VIDEO_FORMATS = {
    "mp4": ("mp4", "libx264"),
    "mov": ("mov", "mpeg4"),
    "mkv": ("matroska", "ffv1"),
    "webm": ("webm", "libvpx"),
    "avi": ("avi", "mjpeg"),
}

#: Container name and audio codec for each audio extension.
AUDIO_FORMATS = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "ogg": ("ogg", "libopus"),
    "m4a": ("ipod", "aac"),
}


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:
    """RGB frame ``index``: smooth gradients that move with the frame number (compresses well, decodes stably)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 127 + 100 * np.sin((x + 3 * index) / max(width, 1) * 2 * math.pi)
    g = 127 + 100 * np.cos((y + 2 * index) / max(height, 1) * 2 * math.pi)
    b = np.full_like(r, (40 + 9 * index) % 256)
    return np.stack([r, g, b], axis=-1).clip(0, 255).astype(np.uint8)


def waveform(samples: int, rate: int, channels: int, *, freq: float = 440.0) -> np.ndarray:
    """``(channels, samples)`` float32 tones in [-0.5, 0.5]; each channel a different pitch."""
    t = np.arange(samples, dtype=np.float64) / rate
    return np.stack([0.5 * np.sin(2 * math.pi * freq * (c + 1) * t) for c in range(channels)]).astype(np.float32)


def make_video(
    ext: str,
    *,
    width: int,
    height: int,
    frames: int,
    fps: int | float = 24,
    audio_rate: int | None = None,
    codec: str | None = None,
) -> bytes:
    """Encode ``frames`` frames of :func:`frame_pixels` at ``fps`` into a container for ``ext``; with
    ``audio_rate`` also a mono AAC/Opus/PCM track of the same duration."""
    import av

    container_format, default_codec = VIDEO_FORMATS[ext]
    codec = codec or default_codec
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as out:
        stream = out.add_stream(codec, rate=_rate(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = {"ffv1": "yuv444p", "mjpeg": "yuvj420p"}.get(codec, "yuv420p")
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "threads": "1"}
        audio = None
        if audio_rate is not None:
            audio_codec = {"webm": "libopus", "mkv": "flac", "avi": "pcm_s16le"}.get(ext, "aac")
            audio = out.add_stream(audio_codec, rate=audio_rate, layout="mono")
        out.start_encoding()  # writes the header even when no frame follows
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if audio is not None:
            _encode_audio(out, audio, waveform(round(frames / fps * audio_rate), audio_rate, 1))
    return buf.getvalue()


def make_audio(ext: str, *, samples: int, rate: int, channels: int = 1) -> bytes:
    """Encode ``samples`` samples per channel of :func:`waveform` at ``rate`` into a file of type ``ext``."""
    import av

    container_format, codec = AUDIO_FORMATS[ext]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as out:
        layout = {1: "mono", 2: "stereo"}[channels]
        stream = out.add_stream(codec, rate=rate, layout=layout)
        _encode_audio(out, stream, waveform(samples, rate, channels))
    return buf.getvalue()


def _encode_audio(out: Any, stream: Any, wave: np.ndarray) -> None:
    """Feed ``wave`` (channels, samples) to ``stream`` (a PyAV audio stream of ``out``) in 1024-sample frames,
    converted to the codec's format."""
    import av

    channels = wave.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    resampler = av.AudioResampler(format=stream.codec_context.format, layout=layout, rate=stream.codec_context.rate)
    pts = 0
    for start in range(0, wave.shape[1], 1024):
        chunk = np.ascontiguousarray(wave[:, start:start + 1024])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = stream.codec_context.rate
        frame.pts = pts
        pts += chunk.shape[1]
        for converted in resampler.resample(frame):
            for packet in stream.encode(converted):
                out.mux(packet)
    for converted in resampler.resample(None):
        for packet in stream.encode(converted):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def _rate(fps: int | float):
    """``fps`` as the exact fraction PyAV wants for a stream rate."""
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)


#: Forms of the demo's videos: containers, and a list of JPEG frames (``clip.0.jpg``, ``clip.1.jpg``, ...).
DEMO_VIDEO_FORMS = ("mp4", "webm", "mkv", "frames")
#: Formats of the demo's audio clips.
DEMO_AUDIO_FORMATS = ("wav", "flac")


def make_demo_video(rng: random.Random) -> tuple[dict[str, bytes], dict]:
    """A short video (4-12 frames, 48-128 pixels a side, 2-12 fps) as members: one container member (``mp4``,
    ``webm`` or ``mkv``) or a frame list of JPEGs; and its facts."""
    form = rng.choice(DEMO_VIDEO_FORMS)
    width, height = 2 * rng.randint(24, 64), 2 * rng.randint(24, 64)  # even: 4:2:0 codecs need it
    frames, fps = rng.randint(4, 12), rng.choice((2, 4, 8, 12))
    if form == "frames":
        members = {f"clip.{i}.jpg": encode_image(Image.fromarray(frame_pixels(i, width, height)), "jpg")
                   for i in range(frames)}
    else:
        members = {form: make_video(form, width=width, height=height, frames=frames, fps=fps)}
    return members, {"form": form, "width": width, "height": height, "frames": frames,
                     "fps": None if form == "frames" else fps}


def make_demo_audio(rng: random.Random) -> tuple[dict[str, bytes], dict]:
    """A short mono clip (0.5-2 s of tones at 16 or 22.05 kHz) as one ``wav`` or ``flac`` member; and its facts."""
    fmt, rate = rng.choice(DEMO_AUDIO_FORMATS), rng.choice((16000, 22050))
    samples = rate * rng.randint(2, 8) // 4
    return {fmt: make_audio(fmt, samples=samples, rate=rate)}, {"format": fmt, "rate": rate, "samples": samples}


# ---------------------------------------------------------------------------------------------------------------
# Conversation samples
# ---------------------------------------------------------------------------------------------------------------

_ROLE_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}
IMAGE_FORMATS = ("jpg", "png", "webp")


def _insert_tags(text: str, n: int, rng: random.Random, tag: str = "<image>") -> str:
    """Put ``n`` ``tag`` tags at the start, the end or between the sentences of ``text``."""
    where = rng.random()
    tags = tag * n if rng.random() < 0.5 else "\n".join([tag] * n)
    if where < 0.6:
        return tags + "\n" + text
    if where < 0.8:
        return text + "\n" + tags
    cut = text.find(". ")
    if cut < 0:
        return tags + "\n" + text
    return text[: cut + 1] + " " + tags + " " + text[cut + 2 :]


def make_turns(
    rng: random.Random, *, rounds: int, user_words: tuple[int, int], reply_words: tuple[int, int],
    system: bool, images: int, tagged: bool,
) -> tuple[list[tuple[str, str]], list[int]]:
    """(role, text) turns and, per image, the index of the user round whose text carries its tag."""
    turns: list[tuple[str, str]] = []
    if system:
        turns.append(("system", paragraph(rng, rng.randint(6, 30))))
    # Images are tagged in the first round, or spread over rounds for multi-image multi-turn samples.
    tag_rounds = [0] * images
    if images > 1 and rounds > 1 and rng.random() < 0.5:
        tag_rounds = sorted(rng.randrange(rounds) for _ in range(images))
    for r in range(rounds):
        question = paragraph(rng, rng.randint(*user_words), question=True)
        n_here = tag_rounds.count(r)
        if tagged and n_here:
            question = _insert_tags(question, n_here, rng)
        turns.append(("user", question))
        turns.append(("assistant", paragraph(rng, rng.randint(*reply_words))))
    return turns, tag_rounds


def conversation_json(turns: list[tuple[str, str]], style: str) -> Any:
    """Serialise turns in one of the accepted styles: sharegpt, chatml, list_sharegpt, list_chatml."""
    if style in ("sharegpt", "list_sharegpt"):
        body = [{"from": _ROLE_TO_SHAREGPT[role], "value": text} for role, text in turns]
        return {"conversations": body} if style == "sharegpt" else body
    body = [{"role": role, "content": text} for role, text in turns]
    return {"messages": body} if style == "chatml" else body


def _pick_style(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.45:
        return "sharegpt"
    if r < 0.80:
        return "chatml"
    return "list_sharegpt" if r < 0.90 else "list_chatml"


def make_sample(index: int, kind: str, seed: int, text_scale: float) -> tuple[dict[str, bytes], dict]:
    """Members ``{part: bytes}`` and a ground-truth record for one sample of ``kind`` text | image | long | video
    (one short video, some with an image too) | audio (one short clip, some with an image too)."""
    rng = random.Random(seed * 1_000_003 + index)
    style = _pick_style(rng)
    system = rng.random() < 0.3

    def span(lo: int, hi: int) -> tuple[int, int]:
        return max(1, int(lo * text_scale)), max(1, int(hi * text_scale))

    if kind == "long":
        rounds = rng.randint(5, 7)  # about 6000 tokens of the demo tokenizer
        user_words, reply_words = span(60, 140), span(480, 620)
        images = 1 if rng.random() < 0.5 else 0
    else:
        rounds = 1 if rng.random() < 0.5 else rng.randint(2, 4)
        # Typical samples: about 50..700 tokens in total.
        budget = rng.choice((30, 60, 100, 160, 240, 320))
        user_words = span(max(4, budget // (4 * rounds)), max(8, budget // (2 * rounds)))
        reply_words = span(max(6, budget // (2 * rounds)), max(12, budget // rounds))
        images = 0
        if kind == "image":
            images = rng.choices((1, 2, 3, 4), weights=(60, 25, 10, 5))[0]
        elif kind in ("video", "audio") and rng.random() < 0.3:
            images = 1
    tagged = (images > 0 or kind in ("video", "audio")) and rng.random() < 0.8
    turns, tag_rounds = make_turns(
        rng, rounds=rounds, user_words=user_words, reply_words=reply_words,
        system=system, images=images, tagged=tagged,
    )
    av_members: dict[str, bytes] = {}
    av_facts: dict = {}
    if kind in ("video", "audio"):
        av_members, av_facts = make_demo_video(rng) if kind == "video" else make_demo_audio(rng)
        if tagged:  # the clip's tag goes in the first user turn, as the images' do
            first_user = next(i for i, (role, _) in enumerate(turns) if role == "user")
            turns[first_user] = ("user", _insert_tags(turns[first_user][1], 1, rng, f"<{kind}>"))
    members: dict[str, bytes] = {"json": json.dumps(conversation_json(turns, style)).encode()}

    naming = "single"
    if images > 1 or (images == 1 and rng.random() < 0.1):
        naming = "img" if rng.random() < 0.8 else "digit"
    sizes = []
    for i in range(images):
        fmt = rng.choices(IMAGE_FORMATS, weights=(6, 3, 1))[0]
        data, width, height = make_image(rng, fmt)
        part = {"single": fmt, "img": f"img{i}.{fmt}", "digit": f"{i}.{fmt}"}[naming]
        members[part] = data
        sizes.append([width, height])
    members.update(av_members)
    record = {
        "kind": kind, "style": style, "system": system, "rounds": rounds, "images": images,
        "tagged": tagged, "tag_rounds": tag_rounds if tagged else [], "naming": naming,
        "image_sizes": sizes, "parts": list(members),
    }
    if av_facts:
        record[kind] = av_facts
    return members, record


def sample_kinds(n: int, *, long_fraction: float, image_fraction: float, rng: random.Random,
                 video_fraction: float = 0.0, audio_fraction: float = 0.0) -> list[str]:
    """Exact quotas of kinds (long, image, video, audio, text) for ``n`` samples, in a seeded random order."""
    n_long = min(n, round(n * long_fraction))
    if long_fraction > 0 and n_long == 0 and n >= 10:
        n_long = 1
    quotas = {"long": n_long}
    for kind, fraction in (("image", image_fraction), ("video", video_fraction), ("audio", audio_fraction)):
        quotas[kind] = min(n - sum(quotas.values()), round(n * fraction))
    kinds = [k for k, count in quotas.items() for _ in range(count)] + ["text"] * (n - sum(quotas.values()))
    rng.shuffle(kinds)
    return kinds


# ---------------------------------------------------------------------------------------------------------------
# Tar shards and Energon metadata
# ---------------------------------------------------------------------------------------------------------------


def _tar_member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_shard(path: Path, samples: Iterable[tuple[str, dict[str, bytes]]]) -> int:
    """Write ``(key, {part: bytes})`` samples to an uncompressed, reproducible USTAR tar; returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            assert "." not in key and "/" not in key, key
            for part, data in members.items():
                tar.addfile(_tar_member(f"{key}.{part}", len(data)), io.BytesIO(data))
            count += 1
    return count


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_yaml(path: Path, obj: Any) -> None:
    path.write_text(yaml.safe_dump(obj, sort_keys=False))


def prepare_energon(
    root: Path, shards: Sequence[str], splits: dict[str, Sequence[str]], *,
    dataset_yaml: dict, exclude: Sequence[str] = (),
) -> None:
    """Create ``root/.nv-meta`` with Energon's own preparator, then add the excludes and ``dataset.yaml``.

    Energon's ``prepare_dataset`` (the code behind ``energon prepare``) writes the ``.tar.idx`` files,
    ``index.sqlite``, ``index.uuid``, ``.info.json`` and ``split.yaml`` (shard lists brace-collapsed, e.g.
    ``shards/train-{0000..0007}.tar``); we add ``exclude`` to ``split.yaml`` and write ``dataset.yaml``.
    ``index.uuid`` (random in Energon) is replaced by a UUID derived from the shard bytes, so identical data
    gets an identical ``.nv-meta``.
    """
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    meta = root / ".nv-meta"
    if meta.exists():
        shutil.rmtree(meta)
    for idx in root.rglob("*.tar.idx"):
        idx.unlink()
    # prepare_dataset forces the multiprocessing start method to "fork"; restore the caller's choice.
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            BaseWebdatasetFactory.prepare_dataset(
                root,
                list(shards),
                split_parts_patterns=[(name, "|".join(map(re.escape, files))) for name, files in splits.items()],
                shuffle_seed=None,
                workers=1,
            )
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    # Keep Energon's brace-collapsed split_parts (e.g. shards/train-{0000..0007}.tar), add the excludes.
    split_parts = yaml.safe_load((meta / "split.yaml").read_text())["split_parts"]
    assert {k: _expand(v) for k, v in split_parts.items()} == {k: list(v) for k, v in splits.items()}, split_parts
    _write_yaml(meta / "split.yaml", {"split_parts": split_parts, "exclude": list(exclude)})
    _write_yaml(meta / "dataset.yaml", dataset_yaml)
    digest = hashlib.sha256()
    for name in shards:
        digest.update(name.encode())
        digest.update(hashlib.sha256((root / name).read_bytes()).digest())
    (meta / "index.uuid").write_text(str(uuid.UUID(bytes=digest.digest()[:16], version=4)))


def _expand(patterns: Sequence[str]) -> list[str]:
    import braceexpand

    return [name for pattern in patterns for name in braceexpand.braceexpand(pattern)]


def _shard_ranges(n: int, per_shard: int) -> list[range]:
    return [range(i, min(n, i + per_shard)) for i in range(0, n, per_shard)]


def build_dataset(
    out_dir: str | Path,
    *,
    n_train: int = 400,
    n_val: int = 60,
    seed: int = 0,
    samples_per_shard: int = 50,
    long_fraction: float = 0.02,
    image_fraction: float = 0.6,
    text_scale: float = 1.0,
    video_fraction: float = 0.0,
    audio_fraction: float = 0.0,
) -> Path:
    """Write the demo conversation dataset (a crude Energon dataset) to ``out_dir`` and return it.

    Layout: ``shards/train-0000.tar`` …, ``shards/val-0000.tar`` …, ``.nv-meta/`` from Energon's preparator,
    ``split.yaml`` with ``exclude: ["shards/train-0000.tar/<EXCLUDED_KEY>"]`` and :data:`MANIFEST_NAME` with
    the ground truth of every sample. Keys are ``s000000``… unique across splits (train first, then val).
    Same arguments → byte-identical shards and metadata.

    ``long_fraction`` / ``image_fraction`` are exact quotas per split (``round(n * fraction)``; at least one
    long sample per split of 10 or more when ``long_fraction > 0``); long samples are 5-7 rounds of about
    6000 demo tokens in all, half of them with one image. ``text_scale`` multiplies every text length.
    ``video_fraction`` / ``audio_fraction`` are quotas of samples with one short generated video (an ``mp4``,
    ``webm`` or ``mkv`` member, or a frame list ``clip.0.jpg`` …) or audio clip (``wav`` or ``flac``), 30 % of
    them with an image too; they need PyAV (the ``media`` extra). With both at 0 (the default) the bytes are those
    of a dataset without them.
    """
    out = Path(out_dir)
    if (out / "shards").exists():
        shutil.rmtree(out / "shards")
    out.mkdir(parents=True, exist_ok=True)
    plan_rng = random.Random(seed)
    split_sizes = {"train": n_train, "val": n_val}
    shards: list[str] = []
    splits: dict[str, list[str]] = {}
    records: list[dict] = []
    offset = 0
    for split, n in split_sizes.items():
        kinds = sample_kinds(n, long_fraction=long_fraction, image_fraction=image_fraction, rng=plan_rng,
                             video_fraction=video_fraction, audio_fraction=audio_fraction)
        splits[split] = []
        for shard_no, rows in enumerate(_shard_ranges(n, samples_per_shard)):
            name = f"shards/{split}-{shard_no:04d}.tar"

            def shard_samples(rows=rows, name=name, split=split, kinds=kinds,
                              offset=offset) -> Iterator[tuple[str, dict[str, bytes]]]:
                for i in rows:
                    key = f"s{offset + i:06d}"
                    members, record = make_sample(offset + i, kinds[i], seed, text_scale)
                    excluded = split == "train" and name == EXCLUDED_SHARD and key == EXCLUDED_KEY
                    records.append({"key": key, "split": split, "shard": name, "excluded": excluded, **record})
                    yield key, members

            write_shard(out / name, shard_samples())
            shards.append(name)
            splits[split].append(name)
        offset += n
    splits = {k: v for k, v in splits.items() if v}
    exclude = [f"{EXCLUDED_SHARD}/{EXCLUDED_KEY}"] if any(
        r["key"] == EXCLUDED_KEY and r["shard"] == EXCLUDED_SHARD for r in records) else []
    prepare_energon(
        out, shards, splits, exclude=exclude,
        dataset_yaml={"__module__": "megatron.energon", "__class__": "CrudeWebdataset",
                      "subflavors": {"source": "packtool-demo"}},
    )
    (out / MANIFEST_NAME).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return out


def build_omni_dataset(out_dir: str | Path, *, n: int = 40, seed: int = 0) -> Path:
    """The audio, video and image demo (one ``train`` shard): :func:`build_dataset` with 30 % video samples, 30 %
    audio samples, 20 % image samples and the rest text; for a model folder with rules for all three kinds."""
    return build_dataset(out_dir, n_train=n, n_val=0, seed=seed, samples_per_shard=max(n, 1), long_fraction=0.0,
                         image_fraction=0.2, video_fraction=0.3, audio_fraction=0.3)


def _build_typed(
    out_dir: str | Path, *, n: int, seed: int, make: Callable[[random.Random], dict[str, bytes]],
    dataset_yaml: dict, n_val: int = 0,
) -> Path:
    """Shared body of the typed dataset builders: one train shard (and optionally one val shard)."""
    out = Path(out_dir)
    if (out / "shards").exists():
        shutil.rmtree(out / "shards")
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {}
    offset = 0
    for split, count in (("train", n), ("val", n_val)):
        if count == 0:
            continue
        name = f"shards/{split}-0000.tar"
        samples = ((f"s{offset + i:06d}", make(random.Random(seed * 1_000_003 + offset + i))) for i in range(count))
        write_shard(out / name, samples)
        splits[split] = [name]
        offset += count
    prepare_energon(out, [s for v in splits.values() for s in v], splits, dataset_yaml=dataset_yaml)
    return out


def build_vqa_dataset(out_dir: str | Path, *, n: int = 40, seed: int = 0) -> Path:
    """A typed Energon VQA dataset: members ``jpg`` and ``json`` (``{"question", "answers"}``)."""

    def make(rng: random.Random) -> dict[str, bytes]:
        data, _, _ = make_image(rng, "jpg")
        qa = {"question": paragraph(rng, rng.randint(6, 20), question=True),
              "answers": [paragraph(rng, rng.randint(3, 30)) for _ in range(rng.randint(1, 3))]}
        return {"jpg": data, "json": json.dumps(qa).encode()}

    dataset_yaml = {
        "sample_type": {"__module__": "megatron.energon", "__class__": "VQASample"},
        "field_map": {"image": "jpg", "context": "json[question]", "answers": "json[answers]"},
    }
    return _build_typed(out_dir, n=n, seed=seed, make=make, dataset_yaml=dataset_yaml)


def build_captioning_dataset(out_dir: str | Path, *, n: int = 20, seed: int = 0) -> Path:
    """A typed Energon captioning dataset: members ``png`` and ``txt``."""

    def make(rng: random.Random) -> dict[str, bytes]:
        data, _, _ = make_image(rng, "png")
        return {"png": data, "txt": paragraph(rng, rng.randint(5, 40)).encode()}

    dataset_yaml = {
        "sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
        "field_map": {"image": "png", "caption": "txt"},
    }
    return _build_typed(out_dir, n=n, seed=seed, make=make, dataset_yaml=dataset_yaml)


def read_manifest(dataset_dir: str | Path) -> list[dict]:
    """The ground-truth records :func:`build_dataset` wrote (one per sample, on-disk order)."""
    text = (Path(dataset_dir) / MANIFEST_NAME).read_text()
    return [json.loads(line) for line in text.splitlines() if line]


# ---------------------------------------------------------------------------------------------------------------
# Script
# ---------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python examples/demo.py OUTDIR``: build dataset, tokenizer, tokenizer-gen, vqa and captioning."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--n-train", type=int, default=400)
    parser.add_argument("--n-val", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples-per-shard", type=int, default=50)
    parser.add_argument("--long-fraction", type=float, default=0.02)
    parser.add_argument("--image-fraction", type=float, default=0.6)
    parser.add_argument("--text-scale", type=float, default=1.0)
    parser.add_argument("--video-fraction", type=float, default=0.05)
    parser.add_argument("--n-omni", type=int, default=40)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    out: Path = args.outdir
    build_tokenizer(out / "tokenizer")
    build_tokenizer(out / "tokenizer-gen", generation_tags=True)
    build_dataset(
        out / "dataset", n_train=args.n_train, n_val=args.n_val, seed=args.seed,
        samples_per_shard=args.samples_per_shard, long_fraction=args.long_fraction,
        image_fraction=args.image_fraction, text_scale=args.text_scale, video_fraction=args.video_fraction,
    )
    build_omni_dataset(out / "omni", n=args.n_omni, seed=args.seed)
    build_vqa_dataset(out / "vqa", seed=args.seed)
    build_captioning_dataset(out / "captioning", seed=args.seed)
    print(f"demo built in {out} ({time.perf_counter() - start:.1f} s): "
          "dataset, omni, tokenizer, tokenizer-gen, vqa, captioning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
