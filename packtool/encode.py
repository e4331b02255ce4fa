"""Encode: conversation -> token ids, per-token targets and media spans, with over-long samples cut or dropped.

The tokenizer's own chat template renders each sample. Targets are each assistant reply plus the end-of-turn
token the template emits after it: from ``{% generation %}`` spans when the template has them, otherwise by
rendering the conversation up to each assistant turn (with the generation prompt) and taking the reply that
follows that prefix. A template proven to copy message text verbatim renders each conversation *shape* once
instead, with the same text and reply positions (:mod:`packtool.chatshape`). Each image placeholder token is
expanded to the image's exact token count.

Media of every kind (image, video, audio) are measured before tokenizing: a member that does not read, or a kind
the model folder has no rule for, quarantines the sample, so no sample is packed without its media.
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from packtool import hfcompat
from packtool.chatshape import ShapeRenderer
from packtool.errors import ConfigError, FatalSampleError, SampleError, is_data_error, sample_reason
from packtool.format import sha256
from packtool.media import (
    ImageRule,
    NemotronOmniSettings,
    Qwen2VLSettings,
    decode_audio,
    decode_frames,
    decode_video,
    image_size,
    is_nemotron_omni,
    load_image_rule,
    probe_audio,
    probe_frames,
    probe_video,
    read_folder,
)
from packtool.processor_mode import (
    align,
    load_processor,
    media_token_ids,
    open_pil,
    placeholder_token_ids,
    processor_ids,
)
from packtool.settings import EncodeSettings
from packtool.sources import Conversation, RawSample
from packtool.sources.conversation import conversation_adapter
from packtool.sources.custom import custom_adapter, load_function
from packtool.sources.mbridge import chatml_adapter, chatml_fields
from packtool.sources.safepickle import load_bytes_list, video_frames
from packtool.sources.sample import AUDIO_TAG, IMAGE_TAG, MEDIA_TAGS, TAG_PATTERN, VIDEO_TAG, Media, tag_kinds
from packtool.sources.typed import sample_type, typed_adapter
from packtool.tokenizing import Tokenizing, Tokens

#: Settings that only Qwen2-VL's rules (or a fixed image count) read: an error with a Nemotron Omni folder.
_QWEN_SETTINGS = ("min_pixels", "max_pixels", "image_tokens", "video_min_frames", "video_max_frames",
                  "video_min_pixels", "video_max_pixels")

#: Texts longer than this many characters per kept token are cut before tokenizing (see ``Encoder._bounded``).
_CHARS_PER_TOKEN = 64
#: Tokens past the kept ones that a cut text must still yield for the kept ones to be exact.
_STABLE_TOKENS = 64


@dataclass
class Encoded:
    """One encoded sample: what the ledger records and, unless dropped, what a pack segment holds."""

    key: str
    shard: str
    index: int
    status: str  # packed | truncated | dropped | error
    reason: str = ""
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    #: Media kept, in placeholder order: part, item, kind, ext, token_offset, tokens, span, grid_thw, width, height,
    #: offset, size (where the member lies in the source shard; for an item of a pickled list, the list's member);
    #: videos add frames (``[part, offset, size]`` of each frame of a frame list), total_frames, fps, duration,
    #: frame_indices, second_per_grid_ts and sha256 (of the bytes measured, checked again when the pack is
    #: written); audio adds samples.
    media: list[dict] = field(default_factory=list)
    #: Length before truncation (0 if encoding failed).
    source_tokens: int = 0
    #: False when a huge text was cut before tokenizing: ``source_tokens`` is then a lower bound.
    length_known: bool = True


def check_tokenizer_dir(tokenizer_dir: str | Path) -> None:
    """Raise :class:`ConfigError` if the folder cannot provide a fast tokenizer and a chat template."""
    d = Path(tokenizer_dir)
    if not d.is_dir():
        if not d.exists() and re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", str(tokenizer_dir)):
            raise ConfigError(f"tokenizer folder {d} does not exist; {tokenizer_dir} looks like a Hugging Face model "
                              f"id, and packtool reads local folders only: download it first (hf download "
                              f"{tokenizer_dir} --local-dir DIR) and pass that folder")
        raise ConfigError(f"tokenizer folder {d} " + ("is not a folder" if d.exists() else "does not exist"))
    if not (d / "tokenizer.json").exists():
        raise ConfigError(f"tokenizer folder {d} has no tokenizer.json (a fast tokenizer is required)")
    has_template = (d / "chat_template.jinja").exists() or (d / "chat_template.json").exists()
    if not has_template and (d / "tokenizer_config.json").exists():
        has_template = "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    if not has_template:
        raise ConfigError(f"tokenizer folder {d} has no chat template (chat_template.jinja)")


def _processor_template(tokenizer_dir: str | Path) -> str | None:
    """The template a VLM folder keeps for its processor (``chat_template.json``), when the tokenizer has none."""
    path = Path(tokenizer_dir) / "chat_template.json"
    return json.loads(path.read_text()).get("chat_template") if path.exists() else None


def load_tokenizer(tokenizer_dir: str | Path):
    """The folder's tokenizer class, imported by name (``AutoTokenizer`` would import torch: 300 MB per worker)."""
    import transformers

    cfg_path = Path(tokenizer_dir) / "tokenizer_config.json"
    name = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.exists() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if cls is None:
        cls = transformers.AutoTokenizer if name else transformers.PreTrainedTokenizerFast
    return cls.from_pretrained(str(tokenizer_dir), local_files_only=True)


def _compile(source: str, tokenizer_dir: str) -> Any:
    """The compiled chat template; one that Jinja refuses (a syntax error, an unknown filter or test) is a
    :class:`ConfigError` naming the model folder, raised before any sample is read."""
    import jinja2
    from jinja2 import nodes

    try:
        template = hfcompat.compile_template(source)
        env = template.environment
        # Jinja checks a filter or test only where it runs (inside a macro or a branch: at render time, for every
        # sample); every one the template names must exist.
        for node in env.parse(source).find_all((nodes.Filter, nodes.Test)):
            kind, known = ("filter", env.filters) if isinstance(node, nodes.Filter) else ("test", env.tests)
            if node.name not in known:
                raise jinja2.TemplateAssertionError(f"No {kind} named {node.name!r}.", node.lineno)
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ConfigError(f"{tokenizer_dir}: the chat template does not compile{where}: "
                          f"{exc.message or exc}") from None
    return template


class Encoder:
    """Turns raw samples into :class:`Encoded` rows; one per worker process (see :func:`get_encoder`)."""

    def __init__(self, settings: EncodeSettings, dataset_yaml: dict | None = None):
        check_tokenizer_dir(settings.tokenizer)
        self.settings = settings
        self.tok = load_tokenizer(settings.tokenizer)
        if not getattr(self.tok, "is_fast", False):
            raise ConfigError(f"{settings.tokenizer}: not a fast tokenizer")
        self.template_source = self.tok.chat_template or _processor_template(settings.tokenizer)
        if isinstance(self.template_source, dict):  # named templates: the default one renders conversations
            self.template_source = self.template_source.get("default")
        if not isinstance(self.template_source, str):
            raise ConfigError(f"{settings.tokenizer}: no default chat template")
        self.template = _compile(self.template_source, settings.tokenizer)
        self.template_kwargs = dict(self.tok.special_tokens_map)
        today = datetime.date.fromisoformat(settings.template_date)  # checked by EncodeSettings
        self.template_kwargs["strftime_now"] = today.strftime  # shadows the global that reads the clock
        self.generation_tags = re.search(r"\{%-?\s*generation\s*-?%\}", self.template_source) is not None
        #: Renders by conversation shape where the template provably copies message text verbatim (no
        #: generation tags: those spans come from the rendering itself).
        self.shapes = None if self.generation_tags else ShapeRenderer(
            self.template.environment.parse(self.template_source),
            lambda m, prompt: self.render(m, add_generation_prompt=prompt))
        self.rule: ImageRule | None = load_image_rule(
            Path(settings.tokenizer),
            min_pixels=settings.min_pixels,
            max_pixels=settings.max_pixels,
            image_tokens=settings.image_tokens,
            processor_mode=settings.media_tokens == "processor",
        )
        vocab = self.tok.get_vocab()
        self.tokenizing = Tokenizing(self.tok.backend_tokenizer, vocab)
        self.image_token = next((t for t in ("<|image_pad|>", "<image>") if t in vocab), None)
        self.image_token_id = vocab.get(self.image_token) if self.image_token else None
        self.vision_start_id = vocab.get("<|vision_start|>")
        self.vision_end_id = vocab.get("<|vision_end|>")
        self.video_token_id = vocab.get("<|video_pad|>")
        self.video_rule = self._video_rule()
        self.video_text = ("<|vision_start|><|video_pad|><|vision_end|>" if self.vision_start_id is not None
                           else "<|video_pad|>")
        #: Nemotron Omni: its processor expands every placeholder in the text before tokenizing, so this encoder
        #: does too (:meth:`_expand_in_text`); images, videos and audio all have exact rules.
        self.nemotron = self._nemotron_rule()
        self.audio_token_id = self.audio_start_id = self.audio_end_id = None
        #: What an ``<audio>`` tag becomes in a template that renders text only (Nemotron Omni: ``<so_embedding>``).
        self.audio_text = AUDIO_TAG
        if self.nemotron is not None:
            n = self.nemotron
            self.image_token, self.image_token_id = n.image_token, vocab[n.image_token]
            self.vision_start_id, self.vision_end_id = vocab[n.image_start_token], vocab[n.image_end_token]
            self.video_text = n.video_token
            self.audio_token_id = vocab[n.audio_token]
            self.audio_text = n.audio_token
            self.audio_start_id, self.audio_end_id = vocab[n.audio_start_token], vocab[n.audio_end_token]
        #: Processor mode: the folder's own processor expands the placeholders (:mod:`packtool.processor_mode`).
        self.processor = load_processor(settings.tokenizer) if settings.media_tokens == "processor" else None
        self.processor_media_ids = media_token_ids(self.processor) if self.processor is not None else frozenset()
        self.processor_placeholder_ids = placeholder_token_ids(self.processor) if self.processor else frozenset()
        placeholder = getattr(self.processor, "image_token", None)  # the processor's own (Gemma 3: <start_of_image>)
        if self.processor is not None and isinstance(placeholder, str) and placeholder in vocab:
            filled = [i for i in getattr(self.processor, "image_token_ids", []) if isinstance(i, int)]  # the model's
            self.image_token, self.image_token_id = placeholder, filled[0] if filled else vocab[placeholder]
        if self.nemotron is None and self.processor is None and settings.audio_max_seconds is not None:
            raise ConfigError(f"{settings.tokenizer}: audio_max_seconds applies to Nemotron Omni model folders (or "
                              f"the processor mode) only")
        self.special_ids = frozenset(self.tok.all_special_ids) | frozenset(self.tok.added_tokens_encoder.values())
        self.special_array = np.array(sorted(self.special_ids), dtype=np.int64)
        self.control_tokens = tuple(t for t in self.tok.added_tokens_encoder if t not in MEDIA_TAGS.values())
        self.control_starts = frozenset(t[0] for t in self.control_tokens if t)
        self.structured = self._template_takes_image_parts()
        if self.structured or self.vision_start_id is None or self.image_token != "<|image_pad|>":
            self.image_text = self.image_token or ""
        else:
            self.image_text = "<|vision_start|><|image_pad|><|vision_end|>"
        self.kind = sample_type(dataset_yaml or {})
        self.field_map = (dataset_yaml or {}).get("field_map") or {}
        if (dataset_yaml or {}).get("sample_loader") and not settings.adapter:
            raise ConfigError("dataset.yaml uses a sample_loader: give an adapter (module:function) for it")
        self.custom = load_function(settings.adapter) if settings.adapter else None
        self.chatml = chatml_fields(dataset_yaml or {})
        newline = self.tok.backend_tokenizer.encode("\n", add_special_tokens=False).ids
        self.newline_id = newline[0] if len(newline) == 1 else None
        if settings.target_newline_after_eot and self.newline_id is None:
            raise ConfigError(f"{settings.tokenizer}: no single newline token, so target_newline_after_eot cannot "
                              f"apply")

    # -- rendering -------------------------------------------------------------------------------------------
    def _template_messages(self, messages: list[dict]) -> list[dict]:
        """Messages as the template wants them: media parts (structured) or the placeholder text in place."""
        out = []
        for m in messages:
            text = media_first(m["content"]) if self.settings.media_first else m["content"]
            kinds = tag_kinds(text)
            if self.structured and kinds:
                pieces = TAG_PATTERN.split(text)
                content: list[dict[str, str]] = []
                for i, piece in enumerate(pieces):
                    if i:
                        content.append({"type": kinds[i - 1]})
                    if piece:
                        content.append({"type": "text", "text": piece})
                out.append({"role": m["role"], "content": content})
            else:
                out.append({"role": m["role"],
                            "content": text.replace(IMAGE_TAG, self.image_text).replace(VIDEO_TAG, self.video_text)
                            .replace(AUDIO_TAG, self.audio_text)})
        return out

    def _video_rule(self) -> Qwen2VLSettings | None:
        """Qwen2-VL's video rule for a Qwen-style folder (a ``<|video_pad|>`` token and a Qwen2-VL image rule),
        with the video settings applied; None for a folder that takes no video."""
        if self.video_token_id is None or self.rule is None or self.rule.type != "qwen2_vl":
            return None
        st = self.settings
        try:
            return Qwen2VLSettings.from_folder(
                st.tokenizer, min_pixels=st.min_pixels, max_pixels=st.max_pixels, video_min_pixels=st.video_min_pixels,
                video_max_pixels=st.video_max_pixels, fps=st.video_fps, num_frames=st.video_frames,
                min_frames=st.video_min_frames, max_frames=st.video_max_frames)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{st.tokenizer}: unreadable video settings ({exc})") from None

    def _nemotron_rule(self) -> NemotronOmniSettings | None:
        """Nemotron Omni's rules for a ``nemotron_h_omni`` folder, with the video and audio settings applied;
        None for any other folder. Its tokenizer must hold the media tokens as added tokens (each one token)."""
        st = self.settings
        if not is_nemotron_omni(st.tokenizer):
            return None
        given = [name for name in _QWEN_SETTINGS if getattr(st, name) is not None]
        if given:
            raise ConfigError(f"{st.tokenizer}: {', '.join(given)} do not apply to a Nemotron Omni model folder")
        try:
            rule = NemotronOmniSettings.from_folder(st.tokenizer, fps=st.video_fps, num_frames=st.video_frames,
                                                    audio_max_seconds=st.audio_max_seconds)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{st.tokenizer}: unreadable Nemotron Omni processor settings ({exc})") from None
        tokens = (rule.image_token, rule.image_start_token, rule.image_end_token, rule.audio_token,
                  rule.audio_start_token, rule.audio_end_token)
        missing = [t for t in tokens if t not in self.tok.added_tokens_encoder]
        if missing:
            raise ConfigError(f"{st.tokenizer}: the tokenizer lacks the Nemotron Omni media tokens {missing}")
        return rule

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _template_takes_image_parts(self) -> bool:
        if self.image_token is None:
            return False
        probe: list[dict] = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
            {"role": "assistant", "content": "y"},
        ]
        try:
            return self.image_token in self.render(probe)
        except Exception:
            return False

    def target_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of each assistant reply (end-of-turn token added later)."""
        tm = self._template_messages(messages)
        if self.generation_tags:
            return hfcompat.render_with_spans(self.template, tm, **self.template_kwargs)
        shaped = self.shapes.render(tm) if self.shapes is not None else None
        text = shaped[0] if shaped is not None else self.render(tm)
        spans = []
        for i, m in enumerate(tm):
            if m["role"] != "assistant":
                continue
            if shaped is not None:  # the length of the prefix rendering, proven a prefix of the text
                start = shaped[1][i]
            else:
                prefix = self.render(tm[:i], add_generation_prompt=True)
                if not text.startswith(prefix):
                    if not any(m["role"] == "user" for m in tm[:i]):
                        raise SampleError(f"the conversation starts with an assistant turn (turn {i}); the chat "
                                          f"template renders it differently without a user turn before it")
                    raise SampleError(f"the chat template renders the conversation up to assistant turn {i} "
                                      f"differently from its start in the whole conversation, so the reply "
                                      f"cannot be located; a template with {{% generation %}} tags avoids this")
                start = len(prefix)
            reply = m["content"] if isinstance(m["content"], str) else ""
            for candidate in (reply, reply.strip(), reply.lstrip()):
                if text.startswith(candidate, start):
                    spans.append((start, start + len(candidate)))
                    break
            else:
                raise SampleError(f"assistant reply {i} does not appear verbatim in the rendered chat")
        return text, spans

    # -- adapters --------------------------------------------------------------------------------------------
    def conversation(self, raw: RawSample) -> Conversation:
        if self.custom is not None:
            return custom_adapter(raw.parts, raw.key, self.custom)
        if self.kind is not None:
            return typed_adapter(raw.parts, kind=self.kind, field_map=self.field_map,
                                 prompt=self.settings.caption_prompt)
        if self.chatml is not None:
            return chatml_adapter(raw.parts, fields=self.chatml, allow_pickle=self.settings.allow_pickle)
        return conversation_adapter(raw.parts, allow_pickle=self.settings.allow_pickle)

    def _media_facts(self, raw: RawSample, conv: Conversation) -> list[dict]:
        """What each media item costs and where its bytes lie; a member that does not read, or a kind the model
        folder has no rule for, raises :class:`SampleError` naming the member."""
        facts = []
        lists: dict[str, Sequence[bytes]] = {}
        n_images = sum(m.kind == "image" for m in conv.media)
        for m in conv.media:
            try:
                if m.kind == "image":
                    facts.append(self._image_facts(raw, m, lists, n_images))
                elif m.kind == "video":
                    facts.append(self._video_facts(raw, m))
                else:
                    facts.append(self._audio_facts(raw, m))
            except SampleError:
                raise
            except ValueError as exc:  # the media layer's reasons name no member
                raise SampleError(f"media {m.part!r}: {exc}") from None
        return facts

    def _image_facts(self, raw: RawSample, m: Media, lists: dict[str, Sequence[bytes]], n_images: int) -> dict:
        """An image's size, grid and tokens; ``n_images``: images of the sample (Nemotron Omni's patch budget
        depends on how many images its processor is given at once)."""
        if m.item is None:
            data = raw.parts[m.part]
            offset, size = raw.ranges[m.part]
            ext = m.part.rsplit(".", 1)[-1].lower()
        else:
            if m.part not in lists:
                lists[m.part] = load_bytes_list(raw.parts[m.part]) if self.settings.allow_pickle else []
            items = lists[m.part]
            if m.item >= len(items):
                raise SampleError(f"media {m.part}[{m.item}] referenced but missing")
            data, ext = items[m.item], ""
            offset, size = raw.ranges[m.part]  # the writer re-reads the list and takes the item
        width, height, fmt = image_size(data, max_pixels=self.settings.pixel_limit,
                                        decode=self.settings.media_check == "decode")
        if not ext or len(ext) > 8 or not ext.isalnum():
            ext = {"jpeg": "jpg"}.get(fmt, fmt or "bin")
        item = {"part": m.part, "item": m.item, "kind": m.kind, "ext": ext, "width": width, "height": height,
                "offset": offset, "size": size}
        if self.processor is not None:
            item["input"] = open_pil(data)
        if self.nemotron is not None:
            gh, gw = self.nemotron.image_grid(width, height, n_images=n_images)
            return {**item, "tokens": self.nemotron.image_tokens(width, height, n_images=n_images),
                    "grid_thw": [1, gh, gw], "text": self.nemotron.image_text(width, height, n_images=n_images)}
        if self.rule is None:
            if self.processor is not None:  # its tokens come from the processor's ids
                return {**item, "tokens": 0, "grid_thw": []}
            raise SampleError("sample has images but the model folder has no preprocessor_config.json (set "
                              "image_tokens for a fixed count per image, or use the processor mode)")
        grid, n = self.rule.grid(width, height), self.rule.tokens(width, height)
        return {**item, "tokens": n, "grid_thw": list(grid)}

    def _video_facts(self, raw: RawSample, m: Media) -> dict:
        """A video's plan from its container facts (or its frames' headers): the frames the processor is given,
        the grid, the tokens and ``second_per_grid_ts``."""
        decode = self.settings.media_check == "decode"
        if m.item is not None:  # a video of a pickled list: its encoded frames as stored, named by format
            named = video_frames(raw.parts[m.part], m.part, m.item)
        else:
            named = [(f, raw.parts[f]) for f in m.frames]
        if named:
            data = [d for _, d in named]
            facts = probe_frames(data, max_pixels=self.settings.pixel_limit, decode=decode)
        else:
            data = [raw.parts[m.part]]
            facts = probe_video(data[0], max_pixels=self.settings.pixel_limit, decode=decode)
        offset, _ = raw.ranges[m.part]
        item: dict[str, Any] = {
            "part": m.part, "item": m.item, "kind": "video", "ext": m.part.rsplit(".", 1)[-1].lower(),
            "width": facts.width, "height": facts.height, "offset": offset, "size": sum(len(d) for d in data),
            "sha256": sha256(b"".join(data)),
            "frames": [[f, *raw.ranges[f if m.item is None else m.part]] for f, _ in named],
            "total_frames": facts.frames, "fps": facts.fps, "duration": facts.duration}
        if self.processor is not None:  # every frame, with the metadata transformers' own video loader gives
            every = list(range(facts.frames))
            frames = decode_frames(data, every) if named else decode_video(data[0], every)
            item["input"] = (frames, {**facts.metadata(), "frames_indices": every})
        if self.nemotron is not None:  # grid: frames given to the processor, and the tile in patches
            nplan = self.nemotron.video(facts)
            return {**item, "tokens": nplan.tokens, "grid_thw": [len(nplan.indices), *nplan.tile],
                    "frame_indices": list(nplan.indices), "second_per_grid_ts": None,
                    "text": self.nemotron.plan_text(nplan)}
        if self.video_rule is None:
            if self.processor is not None:  # its tokens come from the processor's ids
                return {**item, "tokens": 0, "grid_thw": [], "frame_indices": list(range(facts.frames)),
                        "second_per_grid_ts": None}
            raise SampleError(f"media {m.part!r}: the model folder {Path(self.settings.tokenizer).name} has no rule "
                              f"for videos (the processor mode has)")
        plan = self.video_rule.video(facts)
        return {**item, "tokens": plan.tokens, "grid_thw": list(plan.grid_thw), "frame_indices": list(plan.indices),
                "second_per_grid_ts": plan.second_per_grid_ts}

    def _audio_facts(self, raw: RawSample, m: Media) -> dict:
        """An audio clip's tokens and the length of the waveform its processor is given (``samples``, at the
        processor's rate after any length cap); no grid, no pixels."""
        data = raw.parts[m.part]
        facts = probe_audio(data, decode=self.settings.media_check == "decode")
        offset, size = raw.ranges[m.part]
        item: dict[str, Any] = {"part": m.part, "item": None, "kind": "audio", "ext": m.part.rsplit(".", 1)[-1].lower(),
                                "grid_thw": [], "width": 0, "height": 0, "offset": offset, "size": size}
        if self.processor is not None:  # the waveform at the feature extractor's rate, cut to the limit
            rate = int(self.processor.feature_extractor.sampling_rate)
            limit = self.settings.audio_max_seconds
            wave = decode_audio(data, rate=rate, max_samples=None if limit is None else int(limit * rate))
            item.update(input=wave, samples=len(wave))
        if self.nemotron is not None:
            return {**item, "tokens": self.nemotron.audio_tokens(facts), "samples": self.nemotron.audio_samples(facts),
                    "text": self.nemotron.audio_text(facts)}
        if self.processor is None:
            raise SampleError(f"media {m.part!r}: the model folder {Path(self.settings.tokenizer).name} has no "
                              f"rule for audio (the processor mode has)")
        return {**item, "tokens": 0}

    # -- encoding --------------------------------------------------------------------------------------------
    def encode_many(self, raws: list[RawSample], strict: bool = False) -> list[Encoded]:
        """Encode a batch of samples (one shard); tokenization runs batched. A sample that fails for a reason
        of its own data becomes an ``error`` row (``strict``: raises :class:`FatalSampleError` naming it);
        packtool's own bugs propagate (:func:`packtool.errors.is_data_error`)."""
        staged: list[tuple[RawSample, str, list, list[dict]] | Encoded] = []
        for raw in raws:
            with self._guard(raw, strict, staged):
                if raw.problem:
                    raise SampleError(raw.problem)
                conv = self.conversation(raw)
                self._check_conversation(conv)
                if self.processor is None and self.image_token_id is None and \
                        any(m.kind == "image" for m in conv.media):  # the processor mode checks its own
                    raise SampleError("sample has images but the tokenizer has no image token")
                media = self._media_facts(raw, conv)
                text, spans = self.target_spans(conv.messages)
                text, spans = self._expand_in_text(text, spans, media)
                staged.append((raw, text, spans, media))
        texts = [self._bounded(s[1]) for s in staged if not isinstance(s, Encoded)]
        batch = self._tokenize(texts)
        out: list[Encoded] = []
        j = 0
        for s in staged:
            if isinstance(s, Encoded):
                out.append(s)
                continue
            raw, text, spans, media = s
            encoding = batch[j]
            j += 1
            with self._guard(raw, strict, out):
                tokenized = texts[j - 1]
                while True:
                    if isinstance(encoding, Exception):
                        raise encoding
                    if len(tokenized) == len(text) or len(encoding) > self.settings.max_tokens + _STABLE_TOKENS:
                        break
                    tokenized = text[:len(tokenized) * 8]  # the cut left too few tokens: cut further out
                    encoding = self._tokenize([tokenized])[0]
                out.append(self._finish(raw, encoding, len(tokenized), spans, media, cut=len(tokenized) < len(text)))
        return out

    @contextmanager
    def _guard(self, raw: RawSample, strict: bool, into: list) -> Iterator[None]:
        """Turn a data error raised for ``raw`` into its ``error`` row appended to ``into``."""
        try:
            yield
        except Exception as exc:
            if not is_data_error(exc):
                raise
            if strict:
                raise FatalSampleError(f"{raw.shard}/{raw.key}: {sample_reason(exc)}") from exc
            into.append(Encoded(raw.key, raw.shard, raw.index, "error", sample_reason(exc)))

    def _bounded(self, text: str) -> str:
        """The text to tokenize: a sample keeps at most ``max_tokens`` tokens, so a huge text is cut far beyond
        that (``_CHARS_PER_TOKEN`` characters a token) before the tokenizer sees it; ``encode_many`` checks the
        cut left enough tokens to be exact, and tokenizes the whole text when not."""
        limit = max(_CHARS_PER_TOKEN * (self.settings.max_tokens + _STABLE_TOKENS), 1 << 16)
        return text if len(text) <= limit else text[:limit]

    def _tokenize(self, texts: list[str]) -> list[Tokens | SampleError]:
        """Each text's :class:`~packtool.tokenizing.Tokens`, batched; a text the tokenizer refuses gets a
        :class:`SampleError` instead."""
        return [SampleError(f"the tokenizer cannot encode the text: {type(t).__name__}: {t}")
                if isinstance(t, Exception) else t for t in self.tokenizing.encode(texts)]

    def _check_conversation(self, conv: Conversation) -> None:
        """Reasons a conversation cannot be trained on, found before rendering (so the reason says what is wrong,
        not how the template failed). Whatever the adapter, the media tags must name the media, kind for kind."""
        kinds = [tag_kinds(m["content"]) for m in conv.messages]
        tags = [k for turn in kinds for k in turn]
        if tags != [m.kind for m in conv.media]:
            raise SampleError(f"media tags in the text ({', '.join(tags) or 'none'}) do not match the sample's "
                              f"media ({', '.join(m.kind for m in conv.media) or 'none'})")
        for i, (m, turn) in enumerate(zip(conv.messages, kinds)):
            if m["role"] == "assistant" and not m["content"].strip():
                raise SampleError(f"assistant reply in turn {i} is empty")
            if m["role"] == "assistant" and turn:
                tag = MEDIA_TAGS[turn[0]]
                raise SampleError(f"a media tag {tag} lies in assistant turn {i}; media belong in user turns")
            text = m["content"]
            if any(c in text for c in self.control_starts):  # else no control token can be in it
                for t in self.control_tokens:
                    if t in text:
                        raise SampleError(f"{m['role']} text contains the control token {t!r}")
            if text.isascii():
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise SampleError(f"{m['role']} text of turn {i} is not valid Unicode "
                                  f"({exc.reason} at character {exc.start})") from None

    def _finish(self, raw: RawSample, encoding: Tokens, text_len: int, spans, media: list[dict],
                 cut: bool) -> Encoded:
        """Targets from the reply spans, placeholders expanded, limits applied. ``encoding`` is the tokenizer's
        of a text of ``text_len`` characters; ``cut``: the text was cut before tokenizing (its last tokens are
        dropped as unsettled, and so are the media past the cut)."""
        ids = encoding.ids
        if cut:
            ids = ids[:-_STABLE_TOKENS]
        n = len(ids)
        targets = np.zeros(n, dtype=np.uint8)
        for s, e in spans:  # the tokens that start inside the reply (their offsets looked up, not all converted)
            first, end = encoding.token_at(s, n), encoding.token_at(e, n)
            targets[first:end] = 1
            if not self.generation_tags:  # reply found by prefix rendering: add the end-of-turn token after it
                if end < n and int(ids[end]) in self.special_ids:
                    targets[end] = 1
        if self.settings.target_newline_after_eot:
            self._target_newlines(ids, targets)
        if self.processor is not None and media:  # the processor expanded them (see _call_processor)
            tokens, targets, media = self._processor_tokens(ids, targets, media, cut)
        elif self.nemotron is not None:  # the placeholders were expanded in the text (see _expand_in_text)
            tokens, media = ids.astype(np.int32), self._locate_in_text(encoding, ids, targets, media, text_len)
        else:
            tokens, targets, media = self._expand_ids(ids, targets, media, cut)
        enc = Encoded(raw.key, raw.shard, raw.index, "packed", "", tokens, targets, media, len(tokens), not cut)
        if not targets.any() and not cut:  # cut: the replies lie past the cut, the sample is over-long (_fit)
            raise SampleError("no training targets")
        fitted = self._fit(enc)
        if fitted.status == "packed" and not targets.any():
            raise SampleError("no training targets")
        return fitted

    def _expand_ids(self, ids: np.ndarray, targets: np.ndarray, media: list[dict],
                    cut: bool) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """Tokens and targets with each media placeholder token repeated to its item's exact token count (Qwen2-VL
        style), and the media past a cut left out; each item gets its ``token_offset`` and ``span``."""
        placeholder = {"image": self.image_token_id, "video": self.video_token_id}
        pads = _positions(ids, [t for t in placeholder.values() if t is not None])
        if cut:
            media = media[:len(pads)]
        if len(pads) != len(media):
            raise SampleError(f"template produced {len(pads)} media placeholders for {len(media)} media items")
        if not media:  # text only: nothing to expand
            return ids.astype(np.int32), targets, media
        if any(int(ids[p]) != placeholder.get(m["kind"]) for p, m in zip(pads, media)):
            raise SampleError("the template's media placeholders are not in the order of the media kinds")
        if np.any(targets[pads]):
            raise SampleError("a media placeholder lies inside an assistant reply")
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[pads] = [m["tokens"] for m in media]
        new_start = np.concatenate([[0], np.cumsum(repeat)[:-1]])
        for m, p in zip(media, pads):
            m["token_offset"] = int(new_start[p])
        tokens = np.repeat(ids, repeat).astype(np.int32)
        targets = np.repeat(targets, repeat)
        for m in media:
            m["span"] = list(self._media_span(tokens, m))
        return tokens, targets, media

    def _expand_in_text(self, text: str, spans: list[tuple[int, int]],
                        media: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """For a family whose processor expands its placeholders in the text and then tokenizes the whole text
        (Nemotron Omni), the same: each placeholder of the rendered text replaced by the next expansion of its
        kind (``media[i]["text"]``, as the processor does it kind by kind), the reply spans shifted to match, and
        each item's characters recorded as ``media[i]["chars"]`` (start, its first embedding placeholder, end).
        Expanding the ids instead would not be exact: a frame label merges with its neighbours under BPE. In the
        processor mode the processor does it (:meth:`_call_processor`). Other families: unchanged."""
        if self.processor is not None and media:
            self._call_processor(text, media)
            return text, spans
        if self.nemotron is None or not media:
            return text, spans
        n = self.nemotron
        placeholder = {"image": n.image_token, "video": n.video_token, "audio": n.audio_token}
        embed = {"image": n.image_token, "video": n.image_token, "audio": n.audio_token}
        queues: dict[str, list[dict]] = {}
        for m in media:
            queues.setdefault(placeholder[m["kind"]], []).append(m)
        pattern = re.compile("|".join(re.escape(t) for t in sorted(queues, key=len, reverse=True)))
        pieces: list[str] = []
        starts: list[int] = []  # where each placeholder starts and ends in the rendered text
        ends: list[int] = []
        shifts: list[int] = []  # how far the text after it moved
        last = shift = 0
        for found in pattern.finditer(text):
            queue = queues[found.group()]
            if not queue:
                raise SampleError(f"the chat template renders more {found.group()} placeholders than the sample "
                                  f"has media of that kind")
            m = queue.pop(0)
            expansion = m.pop("text")
            start = found.start() + shift
            m["chars"] = [start, start + expansion.index(embed[m["kind"]]), start + len(expansion)]
            pieces += [text[last:found.start()], expansion]
            last = found.end()
            shift += len(expansion) - len(found.group())
            starts.append(found.start())
            ends.append(found.end())
            shifts.append(shift)
        left = {tok: len(q) for tok, q in queues.items() if q}
        if left:
            raise SampleError("the chat template renders no placeholder for " + ", ".join(
                f"{k} {tok} item(s)" for tok, k in left.items()))
        pieces.append(text[last:])
        moved = []
        for s, e in spans:
            before = bisect.bisect_right(ends, s)  # placeholders that end before the reply starts
            if bisect.bisect_left(starts, e) > before:
                raise SampleError("a media placeholder lies inside an assistant reply")
            delta = shifts[before - 1] if before else 0
            moved.append((s + delta, e + delta))
        return "".join(pieces), moved

    def _call_processor(self, text: str, media: list[dict]) -> None:
        """Processor mode: the processor's ids for the rendered text and the decoded media, kept with the media
        (``processor_ids``, one array shared by the sample's items) until :meth:`_processor_tokens`."""
        inputs: dict[str, list] = {"image": [], "video": [], "audio": []}
        for m in media:
            m.pop("text", None)
            inputs[m["kind"]].append(m["input"])
        ids = processor_ids(self.processor, text, inputs["image"], inputs["video"], inputs["audio"])
        placeholders = np.fromiter(self.processor_media_ids, np.int64)
        for m in media:
            item = m.pop("input")
            placeholder = getattr(self.processor, f"{m['kind']}_token", None)
            if len(media) > 1 and m["tokens"] <= 0 and isinstance(placeholder, str):
                # Its count alone tells it from a neighbour it shares a region with (see _processor_tokens).
                alone = processor_ids(self.processor, placeholder, *([item] if k == m["kind"] else []
                                                                     for k in ("image", "video", "audio")))
                m["tokens"] = int(np.isin(alone, placeholders).sum())
            m["processor_ids"] = ids

    def _processor_tokens(self, ids: np.ndarray, targets: np.ndarray, media: list[dict],
                          cut: bool) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """Processor mode: the processor's ids as the tokens, targets aligned onto them from the tokenizer's ids of
        the unexpanded text (``ids``), and each item's tokens and span from the aligned media regions."""
        expanded = media[0]["processor_ids"]
        for m in media:
            del m["processor_ids"]
        if cut:
            raise SampleError("processor mode: the text is too long to align with the processor's tokens")
        aligned, regions = align(ids, targets, expanded, self.processor_media_ids | self.processor_placeholder_ids,
                                 self.special_ids)
        tokens = expanded.astype(np.int32)
        placeholders = np.isin(expanded, np.fromiter(self.processor_media_ids, np.int64))
        if len(regions) == len(media):  # one region per item: its placeholders are the region's
            for m, (s, e) in zip(media, regions):
                at = s + np.flatnonzero(placeholders[s:e])
                m["token_offset"], m["tokens"] = int(at[0]), len(at)
                m["span"] = list(self._media_span(tokens, {"token_offset": s, "tokens": e - s}))
            return tokens, aligned, media
        # Items with only spaces between them share a region: their counts (a rule's, else the processor's on each
        # item alone) tell their placeholders apart, and the region is split between them right after an item's
        # end marker (a special token after its last placeholder), so the spans stay disjoint and in order.
        at = np.flatnonzero(placeholders)
        if any(m["tokens"] <= 0 for m in media) or sum(m["tokens"] for m in media) != len(at):
            raise SampleError(f"processor mode: the processor's tokens hold {len(regions)} media regions for "
                              f"{len(media)} media items (items with no text between them cannot be told apart)")
        first = 0
        for k, m in enumerate(media):
            start, last = int(at[first]), int(at[first + m["tokens"] - 1])
            s, e = next(r for r in regions if r[0] <= start < r[1])
            if last >= e:
                raise SampleError("processor mode: a media item's placeholders differ from its count")
            first += m["tokens"]
            if k and media[k - 1]["span"][1] > s:  # shares the region with the item before it
                s = media[k - 1]["span"][1]
            if first < len(at) and at[first] < e:  # the next item shares it: end after this item's end marker
                e = last + 1 + int(int(tokens[last + 1]) in self.special_ids and last + 2 < at[first])
            m["token_offset"], m["span"] = start, list(self._media_span(tokens, {"token_offset": s, "tokens": e - s}))
        return tokens, aligned, media

    def _locate_in_text(self, encoding: Tokens, ids: np.ndarray, targets: np.ndarray, media: list[dict],
                        text_len: int) -> list[dict]:
        """Each item's ``token_offset`` (its first embedding placeholder) and ``span`` (its whole expansion) from
        the characters :meth:`_expand_in_text` recorded; items past a cut text are left out (one that runs past
        it ends at the last token: the sample is longer than a pack, and truncation never keeps it)."""
        n = len(ids)
        embed = {"image": self.image_token_id, "video": self.image_token_id, "audio": self.audio_token_id}
        kept: list[dict] = []
        previous_end = 0
        for m in media:
            start, first, end = m.pop("chars")
            if start < previous_end:
                raise SampleError("the chat template renders the media placeholders in another order than the "
                                  "sample's media")
            previous_end = end
            if start >= text_len:
                continue
            a = _covering_token(encoding, start, n)
            b = n if end > text_len else _covering_token(encoding, end - 1, n) + 1
            if a >= n:
                continue
            count = int((ids[a:b] == embed[m["kind"]]).sum())
            if b < n and count != m["tokens"]:
                raise SampleError(f"the tokenizer splits the placeholders of {m['kind']} {len(kept) + 1}: "
                                  f"{count} tokens for {m['tokens']}")
            if targets[a:b].any():
                raise SampleError("a media placeholder lies inside an assistant reply")
            m["token_offset"], m["span"] = (_covering_token(encoding, first, n) if first < text_len else n), [a, b]
            kept.append(m)
        return kept

    def _target_newlines(self, ids: np.ndarray, targets: np.ndarray) -> None:
        """Mark the newline token right after each reply's end-of-turn token as a target (in place): the token
        after a run of targets that ends on a special token."""
        t = targets.astype(bool)
        after = np.flatnonzero(t[:-1] & ~t[1:]) + 1
        ends_on_eot = np.isin(ids[after - 1], self.special_array)
        targets[after[ends_on_eot & (ids[after] == self.newline_id)]] = 1

    def _media_span(self, tokens: np.ndarray, m: dict) -> tuple[int, int]:
        """``[start, end)`` of an item's whole expansion: recorded (``span``), else its placeholder tokens widened
        by the vision markers around them."""
        if m.get("span"):
            return m["span"][0], m["span"][1]
        s, e = m["token_offset"], m["token_offset"] + m["tokens"]
        if s > 0 and self.vision_start_id is not None and tokens[s - 1] == self.vision_start_id:
            s -= 1
        if e < len(tokens) and self.vision_end_id is not None and tokens[e] == self.vision_end_id:
            e += 1
        return s, e

    def _fit(self, enc: Encoded) -> Encoded:
        """Apply the per-pack limits to one sample: cut at a safe boundary, or drop, per ``overlong``."""
        st = self.settings
        cut, why = len(enc.tokens), []
        if cut > st.max_tokens:
            at_least = "" if enc.length_known else "at least "
            cut, why = st.max_tokens, [f"{at_least}{len(enc.tokens)} tokens > {st.max_tokens}"]
        image_total = 0
        for j, m in enumerate(enc.media):
            image_total += m["tokens"]
            over_images = st.max_images is not None and j + 1 > st.max_images
            over_tokens = st.max_image_tokens is not None and image_total > st.max_image_tokens
            if over_images or over_tokens:
                s, _ = self._media_span(enc.tokens, m)
                if s < cut:
                    cut = s
                    why.append(f"{m['kind']} {j + 1} over the per-pack " + ("image cap" if over_images else
                                                                               "image-token cap"))
                break
        for m in enc.media:  # never cut inside a media span
            s, e = self._media_span(enc.tokens, m)
            if s < cut < e:
                cut = s
        if cut == len(enc.tokens):
            return enc
        reason = "; ".join(why)
        if st.overlong == "drop":
            return Encoded(enc.key, enc.shard, enc.index, "dropped", f"over limit: {reason}",
                           source_tokens=enc.source_tokens, length_known=enc.length_known)
        if not enc.targets[:cut].any():
            return Encoded(enc.key, enc.shard, enc.index, "dropped",
                           f"no training target fits before a safe cut at {cut} tokens ({reason})",
                           source_tokens=enc.source_tokens, length_known=enc.length_known)
        kept = [m for m in enc.media if self._media_span(enc.tokens, m)[1] <= cut]
        return Encoded(enc.key, enc.shard, enc.index, "truncated", f"truncated to {cut}: {reason}",
                       enc.tokens[:cut].copy(), enc.targets[:cut].copy(), kept, enc.source_tokens,
                       enc.length_known)


def _positions(ids: np.ndarray, values: list[int]) -> np.ndarray:
    """Indices of the ids equal to one of a few ``values`` (``np.isin`` costs several times more on a sample)."""
    hit = np.zeros(len(ids), dtype=bool)
    for v in values:
        hit |= ids == v
    return np.flatnonzero(hit)


def _covering_token(encoding: Tokens, pos: int, n: int) -> int:
    """Index of the token covering character ``pos`` (at most ``n``); a character no token covers is a
    :class:`SampleError` (media expansions start and end on marker tokens, which always cover their characters)."""
    token = encoding.covering(pos, n)
    if token is None:
        raise SampleError(f"no token covers character {pos} of a media expansion")
    return token


def model_facts(settings: EncodeSettings, dataset_yaml: dict | None = None) -> dict:
    """What the manifest records of the model folder (token ids, image rule), from this process's encoder: the
    pipeline runs it as its first task, so a model folder that cannot encode fails before OUTPUT is touched, and
    the parent never loads a tokenizer it does not use."""
    encoder = get_encoder(settings, dataset_yaml)
    tok = encoder.tok
    pad = next((int(c) for c in (tok.pad_token_id, tok.eos_token_id) if c is not None), 0)
    return {"pad_token_id": pad, "eos_token_id": tok.eos_token_id, "image_token_id": encoder.image_token_id,
            "vision_start_token_id": encoder.vision_start_id, "vision_end_token_id": encoder.vision_end_id,
            "image_processor": encoder.nemotron.manifest() if encoder.nemotron else
            encoder.rule.manifest() if encoder.rule else
            {"family": "processor", "processor_class": type(encoder.processor).__name__} if encoder.processor else None,
            "video_token_id": encoder.video_token_id if encoder.video_rule else None,
            "video_processor": {**encoder.video_rule.manifest(),
                                "config": read_folder(settings.tokenizer).video} if encoder.video_rule else None,
            "audio_token_id": encoder.audio_token_id, "audio_start_token_id": encoder.audio_start_id,
            "audio_end_token_id": encoder.audio_end_id}


def media_first(text: str) -> str:
    """The turn text with its media tags moved before the text pieces (in their order), each piece stripped of
    edge spaces (how Megatron-Bridge's Qwen-VL task encoder orders a turn); text without tags is unchanged."""
    kinds = tag_kinds(text)
    if not kinds:
        return text
    return "".join(MEDIA_TAGS[k] for k in kinds) + "".join(p.strip(" ") for p in TAG_PATTERN.split(text))


@lru_cache(maxsize=4)
def _cached_encoder(settings: EncodeSettings, dataset_yaml_json: str) -> Encoder:
    return Encoder(settings, json.loads(dataset_yaml_json))


def get_encoder(settings: EncodeSettings, dataset_yaml: dict | None = None) -> Encoder:
    """The encoder for these settings, built once per process."""
    return _cached_encoder(settings, json.dumps(dataset_yaml or {}, sort_keys=True, default=str))
