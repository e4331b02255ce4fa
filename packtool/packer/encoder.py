"""Encode: conversation -> token ids, per-token targets and media spans, with over-long samples cut or dropped.

The tokenizer's own chat template renders each sample. Targets are each assistant reply plus the end-of-turn
token the template emits after it: from ``{% generation %}`` spans when the template has them, otherwise by
rendering the conversation up to each assistant turn (with the generation prompt) and taking the reply that
follows that prefix. A template proven to copy message text verbatim renders each conversation *shape* once
instead, with the same text and reply positions (:mod:`packtool.packer.chatshape`). Each image placeholder token is
expanded to the image's exact token count.

Media of every kind (image, video, audio) are measured before tokenizing: a member that does not read, or a kind
the model folder has no rule for, quarantines the sample, so no sample is packed without its media.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from packtool import families
from packtool.errors import (
    ConfigError,
    FatalSampleError,
    SampleError,
    UserCodeExit,
    bug_in,
    is_data_error,
    sample_reason,
    user_code,
)
from packtool.families import Family
from packtool.format import sha256
from packtool.item import MediaItem, Staged
from packtool.media import AudioFacts, VideoFacts, image_size, probe_audio, probe_frames, probe_video
from packtool.packer import hfcompat
from packtool.packer.chatshape import ShapeRenderer
from packtool.packer.sources import Conversation, RawSample
from packtool.packer.sources.formats import input_format
from packtool.packer.sources.safepickle import load_bytes_list, video_frames
from packtool.packer.sources.sample import MEDIA_TAGS, TAG_PATTERN, Media, loss_weight, tag_kinds
from packtool.packer.tokenizing import Tokenizing, Tokens
from packtool.settings import EncodeSettings

#: Texts longer than this many characters per kept token are cut before tokenizing (see ``Encoder._bounded``).
_CHARS_PER_TOKEN = 64
#: Tokens past the kept ones that a cut text must still yield for the kept ones to be exact.
_STABLE_TOKENS = 64


@dataclass(frozen=True)
class Encoded:
    """One encoded sample: what the ledger records and, unless dropped, what a pack segment holds (frozen: the
    per-pack limits make a new one)."""

    key: str
    shard: str
    index: int
    status: str  # packed | truncated | dropped | error
    reason: str = ""
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    #: Media kept, in placeholder order.
    media: tuple[MediaItem, ...] = ()
    #: Length before truncation (0 if encoding failed).
    source_tokens: int = 0
    #: False when a huge text was cut before tokenizing: ``source_tokens`` is then a lower bound.
    length_known: bool = True
    #: Facts of the sample before any cut, so another pack size can be judged without encoding again: its
    #: first target token, and ``[start, end, placeholder tokens]`` of every media item's span.
    first_target: int = -1
    source_media: tuple[tuple[int, int, int], ...] = ()
    #: The sample's loss weight (:func:`~packtool.packer.sources.sample.loss_weight`; 1 unless it gives one).
    loss_weight: float = 1.0


@dataclass(frozen=True, eq=False)
class _Measured:
    """A media item measured, before its family plans it (:meth:`Encoder._plan`): the item (where its bytes lie,
    its size, a video's container facts; no tokens yet), the bytes its processor is given (each frame's for a
    video given as frames: ``framed``), and the probe's facts of a video or an audio clip."""

    item: MediaItem
    data: list[bytes]
    framed: bool = False
    facts: VideoFacts | AudioFacts | None = None


@dataclass(frozen=True, eq=False)
class _Rendered:
    """A sample rendered before tokenizing: its text (placeholders expanded where the family does it in the text),
    the character spans of its replies, its media measured and planned, and its ledger note
    (:meth:`Encoder._convention_note`)."""

    raw: RawSample
    text: str
    spans: list[tuple[int, int]]
    media: list[Staged]
    note: str
    loss_weight: float = 1.0


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
    read = {name: _json_file(d / name) for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json",
                                                     "preprocessor_config.json", "processor_config.json",
                                                     "video_preprocessor_config.json")
            if (d / name).exists()}
    has_template = (d / "chat_template.jinja").exists() or "chat_template.json" in read
    if not has_template and "tokenizer_config.json" in read:
        has_template = "chat_template" in read["tokenizer_config.json"]
    if not has_template:
        raise ConfigError(f"tokenizer folder {d} has no chat template (chat_template.jinja)")


def _json_file(path: Path) -> dict:
    """A model folder's JSON file, which must hold an object; a one-line :class:`ConfigError` for a file that is
    cut short (an interrupted download) or is not JSON."""
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({str(exc).splitlines()[0]}): a download cut short? fetch "
                          f"the model folder again") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


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
        vocab = self.tok.get_vocab()
        self.tokenizing = Tokenizing(self.tok.backend_tokenizer, vocab)
        #: The model family under the settings' convention: media plans, placeholders, manifest entries.
        self.family: Family = families.load(settings, self.tok)
        self.special_ids = frozenset(self.tok.all_special_ids) | frozenset(self.tok.added_tokens_encoder.values())
        self.special_array = np.array(sorted(self.special_ids), dtype=np.int64)
        self.control_tokens = tuple(t for t in self.tok.added_tokens_encoder if t not in MEDIA_TAGS.values())
        self.control_starts = frozenset(t[0] for t in self.control_tokens if t)
        self.structured = any(self._template_takes_parts(kind, self.family.template_placeholder(kind))
                              for kind in ("image", "video", "audio"))
        self.placeholder_text = {kind: self.family.placeholder_text(kind, self.structured)
                                 for kind in ("image", "video", "audio")}
        self.input_format = input_format(dataset_yaml, settings, chatml_audio=self.family.convention.chatml_audio)
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
            text = self.family.convention.turn_text(m["content"], m["role"])
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
                for kind, tag in MEDIA_TAGS.items():  # in turn, as the template sees them
                    text = text.replace(tag, self.placeholder_text[kind])
                out.append({"role": m["role"], "content": text})
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template's text; whatever the template raises is about the sample (:func:`user_code`)."""
        with user_code("the chat template"):
            return self.template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )

    def _template_takes_parts(self, kind: str, placeholder: str | None) -> bool:
        """Whether the template renders a ``{"type": kind}`` content part as ``placeholder`` (a model without
        image input, such as Qwen2-Audio, is probed with its audio part)."""
        if not placeholder:
            return False
        probe: list[dict] = [
            {"role": "user", "content": [{"type": kind}, {"type": "text", "text": "x"}]},
            {"role": "assistant", "content": "y"},
        ]
        try:
            return placeholder in self.render(probe)
        except Exception:
            return False

    def target_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of each assistant reply (end-of-turn token added later)."""
        tm = self._template_messages(messages)
        if self.generation_tags:
            with user_code("the chat template"):
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

    # -- the source's input format ------------------------------------------------------------------------------
    def conversation(self, raw: RawSample) -> Conversation:
        """The raw sample as a conversation, read by the source's input format (:mod:`.sources.formats`)."""
        return self.input_format.conversation(raw)

    def _media_facts(self, raw: RawSample, conv: Conversation) -> list[Staged]:
        """What each media item costs and where its bytes lie; a member that does not read, or a kind the model
        folder has no rule for, raises :class:`SampleError` naming the member."""
        facts = []
        lists: dict[str, Sequence[bytes]] = {}
        n_images = sum(m.kind == "image" for m in conv.media)
        for m in conv.media:
            try:
                if m.kind == "image":
                    measured = self._measure_image(raw, m, lists)
                elif m.kind == "video":
                    measured = self._measure_video(raw, m)
                else:
                    measured = self._measure_audio(raw, m)
                facts.append(self._plan(measured, n_images))
            except SampleError:
                raise
            except ValueError as exc:  # the media layer's reasons name no member
                raise SampleError(f"media {m.part!r}: {exc}") from None
        self._check_media_budget(conv, facts, lists)
        return facts

    def _check_media_budget(self, conv: Conversation, facts: list[Staged],
                            lists: dict[str, Sequence[bytes]]) -> None:
        """A sample's media may write at most ``max_sample_bytes`` into the pack (an item of a pickled list is
        written once per reference) and hand its processor at most ``max_sample_pixels`` decoded pixels (each
        image, each frame it is given)."""
        st = self.settings
        written = pixels = 0
        for m, f in zip(conv.media, (p.item for p in facts)):
            written += len(lists[m.part][m.item]) if m.kind == "image" and m.item is not None else f.size
            pixels += f.pixels
        if written > st.max_sample_bytes:
            raise SampleError(f"its media would write {written} bytes into the pack > max_sample_bytes "
                              f"{st.max_sample_bytes}")
        if pixels > st.max_sample_pixels:
            raise SampleError(f"its media give the processor {pixels} decoded pixels > max_sample_pixels "
                              f"{st.max_sample_pixels}")

    def _measure_image(self, raw: RawSample, m: Media, lists: dict[str, Sequence[bytes]]) -> _Measured:
        """An image's size and format (``lists``: the sample's pickled lists read so far)."""
        if m.item is None:
            data = raw.parts[m.part]
            ext = m.part.rsplit(".", 1)[-1].lower()
        else:
            if m.part not in lists:
                lists[m.part] = load_bytes_list(raw.parts[m.part]) if self.settings.allow_pickle else []
            items = lists[m.part]
            if m.item >= len(items):
                raise SampleError(f"media {m.part}[{m.item}] referenced but missing")
            data, ext = items[m.item], ""
        offset, size = raw.ranges[m.part]  # of a list item: the list's (the writer re-reads it and takes the item)
        width, height, fmt = image_size(data, max_pixels=self.settings.pixel_limit,
                                        decode=self.settings.media_check == "decode")
        if not ext or len(ext) > 8 or not ext.isalnum():
            ext = {"jpeg": "jpg"}.get(fmt, fmt or "bin")
        return _Measured(MediaItem(m.part, m.item, "image", ext, width, height, offset, size, 0), [data])

    def _measure_video(self, raw: RawSample, m: Media) -> _Measured:
        """A video's container facts (or its frames' headers), as the family reads them, and where its bytes lie."""
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
        facts = self.family.video_facts(data, bool(named), facts, m.part)
        offset, _ = raw.ranges[m.part]
        # each frame's member and where it lies (a pickled list's frames: where the list lies)
        frames = tuple((f, *raw.ranges[f if m.item is None else m.part]) for f, _ in named)
        item = MediaItem(m.part, m.item, "video", m.part.rsplit(".", 1)[-1].lower(), facts.width, facts.height,
                         offset, sum(len(d) for d in data), 0, sha256=sha256(b"".join(data)), frames=frames,
                         total_frames=facts.frames, fps=facts.fps, duration=facts.duration)
        return _Measured(item, data, bool(named), facts)

    def _measure_audio(self, raw: RawSample, m: Media) -> _Measured:
        """An audio clip's facts (no grid, no pixels)."""
        data = raw.parts[m.part]
        offset, size = raw.ranges[m.part]
        item = MediaItem(m.part, None, "audio", m.part.rsplit(".", 1)[-1].lower(), 0, 0, offset, size, 0)
        return _Measured(item, [data], facts=probe_audio(data, decode=self.settings.media_check == "decode"))

    def _plan(self, measured: _Measured, n_images: int) -> Staged:
        """A measured item decoded where the family's processor mode needs it (:meth:`Family.media_input`), then
        planned by the family: its tokens, grid, frames and ``second_per_grid_ts``, and the length of the waveform
        an audio clip's processor is given (``samples``: the plan's, else the decoded waveform's).
        ``n_images``: images of the sample (Nemotron Omni's patch budget depends on how many images its
        processor is given at once)."""
        item, facts = measured.item, measured.facts
        decoded = self.family.media_input(item.kind, measured.data, measured.framed, facts)
        if isinstance(facts, VideoFacts):
            plan = self.family.plan_video(facts, item.part)
        elif isinstance(facts, AudioFacts):
            plan = self.family.plan_audio(facts, item.part)
        else:  # an image: planned from its size
            plan = self.family.plan_image(item.width, item.height, n_images)
        samples = decoded.samples if decoded is not None else None  # the processor mode's decoded waveform
        item = replace(item, tokens=plan.tokens, grid_thw=tuple(plan.grid_thw),
                       frame_indices=tuple(plan.frame_indices), second_per_grid_ts=plan.second_per_grid_ts,
                       samples=plan.samples if plan.samples is not None else samples, decoded=samples is not None)
        return Staged(item, text=plan.text, input=None if decoded is None else decoded.input)

    # -- encoding --------------------------------------------------------------------------------------------
    def encode_many(self, raws: list[RawSample], strict: bool = False) -> list[Encoded]:
        """Encode a batch of samples (one shard); tokenization runs batched. A sample that fails for a reason
        of its own data (a :class:`SampleError`) becomes an ``error`` row (``strict``: raises
        :class:`FatalSampleError` naming it); packtool's own bugs propagate with the sample named
        (:mod:`packtool.errors`)."""
        staged: list[_Rendered | Encoded] = []
        for raw in raws:
            with self._guard(raw, strict, staged):
                if raw.problem:
                    raise SampleError(raw.problem)
                weight = loss_weight(raw.parts)
                conv = self.conversation(raw)
                self._check_conversation(conv)
                self.family.check_media([m.kind for m in conv.media])
                media = self._media_facts(raw, conv)
                over = self._over_sample_limits(media)
                if over:
                    staged.append(Encoded(raw.key, raw.shard, raw.index, "dropped", f"over limit: {over}"))
                    continue
                text, spans = self.target_spans(conv.messages)
                text, spans, media = self.family.expand_text(text, spans, media)
                staged.append(_Rendered(raw, text, spans, media, self._convention_note(conv), weight))
        texts = [self._bounded(s.text) for s in staged if isinstance(s, _Rendered)]
        batch = iter(zip(texts, self._tokenize(texts)))
        out: list[Encoded] = []
        for s in staged:
            if isinstance(s, Encoded):
                out.append(s)
                continue
            tokenized, encoding = next(batch)
            with self._guard(s.raw, strict, out):
                while True:
                    if isinstance(encoding, Exception):
                        raise encoding
                    if len(tokenized) == len(s.text) or len(encoding) > self.settings.max_tokens + _STABLE_TOKENS:
                        break
                    tokenized = s.text[:len(tokenized) * 8]  # the cut left too few tokens: cut further out
                    encoding = self._tokenize([tokenized])[0]
                done = self._finish(s.raw, encoding, len(tokenized), s.spans, s.media, cut=len(tokenized) < len(s.text))
                if s.note and done.status in ("packed", "truncated"):
                    done = replace(done, reason="; ".join(r for r in (done.reason, s.note) if r))
                if s.loss_weight != 1.0:
                    done = replace(done, loss_weight=s.loss_weight)
                out.append(done)
        return out

    def _over_sample_limits(self, media: list[Staged]) -> str:
        """Why a sample is over the per-sample limits (``sample_max_images``, ``sample_max_visual_tokens``), or
        ``""``. Visual tokens are counted as Megatron-Bridge's Qwen-VL task encoder counts them for its limit: each
        image by the processor's rule from its stored size (without a first resize), each video as planned
        (:meth:`Family.limit_tokens`)."""
        st = self.settings
        images = [p for p in media if p.item.kind == "image"]
        if st.sample_max_images is not None and len(images) > st.sample_max_images:
            return f"{len(images)} images > sample_max_images {st.sample_max_images}"
        if st.sample_max_visual_tokens is None:
            return ""
        total = sum(self.family.limit_tokens(p.item) for p in media)
        if total > st.sample_max_visual_tokens:
            return f"{total} visual tokens > sample_max_visual_tokens {st.sample_max_visual_tokens}"
        return ""

    def _convention_note(self, conv: Conversation) -> str:
        """The ledger note of a sample the convention's own trainer path would treat otherwise, where the
        convention asks for one: media without tags (packtool trains them, placed before the first user text),
        video files (packtool decodes them; their frames go the way of a frame list)."""
        convention, notes = self.family.convention, []
        if conv.untagged and convention.untagged_note:
            notes.append(f"{conv.untagged} untagged media placed before the first user text "
                         f"({convention.untagged_note})")
        files = sum(m.kind == "video" and m.item is None and not m.frames for m in conv.media)
        if files and convention.video_file_note:
            notes.append(f"{files} video file{'s' if files > 1 else ''} decoded and trained as "
                         f"{'frame lists' if files > 1 else 'a frame list'} ({convention.video_file_note})")
        return "; ".join(notes)

    @contextmanager
    def _guard(self, raw: RawSample, strict: bool, into: list) -> Iterator[None]:
        """Turn a data error raised for ``raw`` into its ``error`` row appended to ``into``; user code that exits
        stops the run naming the sample; any other exception is a bug: it propagates with the sample named."""
        try:
            yield
        except UserCodeExit as exc:
            raise FatalSampleError(f"{raw.shard}/{raw.key}: {exc}") from None
        except Exception as exc:
            if not is_data_error(exc):
                bug_in(exc, f"{raw.shard}/{raw.key}")
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
        """Each text's :class:`~packtool.packer.tokenizing.Tokens`, batched; a text the tokenizer refuses gets a
        :class:`SampleError` instead."""
        return [SampleError(f"the tokenizer cannot encode the text: {type(t).__name__}: {t}")
                if isinstance(t, Exception) else t for t in self.tokenizing.encode(texts)]

    def _check_conversation(self, conv: Conversation) -> None:
        """Reasons a conversation cannot be trained on, found before rendering (so the reason says what is wrong,
        not how the template failed). Whatever the adapter, the media tags must name the media, kind for kind."""
        if len(conv.messages) > self.settings.max_turns:
            raise SampleError(f"{len(conv.messages)} messages > max_turns {self.settings.max_turns} (locating the "
                              f"replies costs the square of the turns)")
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

    def _finish(self, raw: RawSample, encoding: Tokens, text_len: int, spans: list[tuple[int, int]],
                media: list[Staged], cut: bool) -> Encoded:
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
        self.family.convention.mark_targets(ids, targets, self.special_array, self.newline_id)
        tokens, targets, items = self.family.place(encoding, ids, targets, media, cut, text_len, self.special_ids)
        enc = Encoded(raw.key, raw.shard, raw.index, "packed", "", tokens, targets, tuple(items), len(tokens),
                      not cut)
        if not targets.any() and not cut:  # cut: the replies lie past the cut, the sample is over-long (_fit)
            raise SampleError("no training targets")
        fitted = self._fit(enc)
        if fitted.status == "packed" and not targets.any():
            raise SampleError("no training targets")
        return fitted

    def _fit(self, enc: Encoded) -> Encoded:
        """Apply the per-pack limits to one sample: cut at a safe boundary, or drop, per ``overlong``; the result
        carries the uncut sample's facts (:attr:`Encoded.first_target`, :attr:`Encoded.source_media`)."""
        spans = [self.family.media_span(enc.tokens, m) for m in enc.media]
        first_target = int(np.argmax(enc.targets)) if enc.targets.any() else -1
        source_media = tuple((s, e, int(m.tokens)) for (s, e), m in zip(spans, enc.media))
        cut, reason = self._safe_cut(enc, spans)
        if cut == len(enc.tokens):
            return replace(enc, first_target=first_target, source_media=source_media)
        if self.settings.overlong == "drop" or not enc.targets[:cut].any():
            why = (f"over limit: {reason}" if self.settings.overlong == "drop" else
                   f"no training target fits before a safe cut at {cut} tokens ({reason})")
            return Encoded(enc.key, enc.shard, enc.index, "dropped", why, source_tokens=enc.source_tokens,
                           length_known=enc.length_known, first_target=first_target, source_media=source_media)
        kept = tuple(m for m, (_, e) in zip(enc.media, spans) if e <= cut)
        return replace(enc, status="truncated", reason=f"truncated to {cut}: {reason}",
                       tokens=enc.tokens[:cut].copy(), targets=enc.targets[:cut].copy(), media=kept,
                       first_target=first_target, source_media=source_media)

    def _safe_cut(self, enc: Encoded, spans: list[tuple[int, int]]) -> tuple[int, str]:
        """Where the per-pack limits cut the sample (its length: nowhere), never inside a media span (``spans``:
        each item's), and why."""
        st = self.settings
        cut, why = len(enc.tokens), []
        if cut > st.max_tokens:
            at_least = "" if enc.length_known else "at least "
            cut, why = st.max_tokens, [f"{at_least}{len(enc.tokens)} tokens > {st.max_tokens}"]
        image_total = 0
        for j, (m, (s, _)) in enumerate(zip(enc.media, spans)):
            image_total += m.tokens
            over_images = st.max_images is not None and j + 1 > st.max_images
            over_tokens = st.max_image_tokens is not None and image_total > st.max_image_tokens
            if over_images or over_tokens:
                if s < cut:
                    cut = s
                    why.append(f"{m.kind} {j + 1} over the per-pack " + ("image cap" if over_images else
                                                                               "image-token cap"))
                break
        for s, e in spans:  # never cut inside a media span
            if s < cut < e:
                cut = s
        return cut, "; ".join(why)


def model_facts(settings: EncodeSettings, dataset_yaml: dict | None = None) -> dict:
    """What the manifest records of the model folder (token ids, image rule), from this process's encoder: the
    pipeline runs it as its first task, so a model folder that cannot encode fails before OUTPUT is touched, and
    the parent never loads a tokenizer it does not use."""
    encoder = get_encoder(settings, dataset_yaml)
    tok = encoder.tok
    pad = next((int(c) for c in (tok.pad_token_id, tok.eos_token_id) if c is not None), 0)
    return {"pad_token_id": pad, "eos_token_id": tok.eos_token_id, **encoder.family.manifest_entries()}


@lru_cache(maxsize=4)
def _cached_encoder(settings: EncodeSettings, dataset_yaml_json: str) -> Encoder:
    return Encoder(settings, json.loads(dataset_yaml_json))


def get_encoder(settings: EncodeSettings, dataset_yaml: dict | None = None) -> Encoder:
    """The encoder for these settings, built once per process (a model folder in an object store is fetched to
    this machine's cache first)."""
    from packtool.storage import fetched

    return _cached_encoder(fetched(settings), json.dumps(dataset_yaml or {}, sort_keys=True, default=str))
