"""The model-family interface: what packtool must know of a model family, on every side.

A :class:`Family` is built from a model folder (:meth:`Family.load`, encode side) or read back from a manifest
(:meth:`Family.from_manifest`, verify and runtime sides). See :mod:`packtool.families` for the registry and how
to add a family or a convention.
"""

from __future__ import annotations

import bisect
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from packtool.errors import ConfigError, SampleError
from packtool.families.conventions import Convention, add_variant
from packtool.format import AUDIO_TAG, MediaRef

if TYPE_CHECKING:
    from packtool.item import MediaItem, Staged
    from packtool.media.audio import AudioFacts
    from packtool.media.video import VideoFacts
    from packtool.settings import EncodeSettings

#: Where a family's placeholders become their expansion: the placeholder token repeated in the token ids
#: (Qwen2-VL), the expansion written into the text before tokenizing (Nemotron Omni), or the folder's own
#: processor (the processor mode).
ExpandIn = Literal["ids", "text", "processor"]


#: Most images past a cut considered when matching a truncated segment's image plan (see
#: :meth:`Family.image_counts`).
MAX_CUT_IMAGES = 256


class NoRule(SampleError):
    """A media item of a kind the family has no token rule for (the sample is quarantined with the reason)."""


@dataclass(frozen=True)
class ItemPlan:
    """What one media item becomes for a family: its placeholder tokens and what the manifest records of it."""

    tokens: int
    grid_thw: tuple[int, ...] = ()
    #: Video: the frames the processor is given.
    frame_indices: tuple[int, ...] = ()
    #: Qwen2-VL video: seconds one temporal patch spans.
    second_per_grid_ts: float | None = None
    #: Audio: samples of the waveform the processor is given (None: not counted by the family).
    samples: int | None = None
    #: The text the placeholder becomes (families that expand in the text).
    text: str | None = None


@dataclass(frozen=True, eq=False)
class Decoded:
    """An item's media decoded for a processor that expands the placeholders itself (the processor mode)."""

    #: What the processor is given: an image, a video's frames with their metadata, an audio waveform.
    input: object
    #: Audio: samples of the waveform (at the processor's rate, after any length cap).
    samples: int | None = None


@dataclass(frozen=True)
class MediaTokens:
    """The tokens a family's placeholders are made of, and the text each tag becomes in a rendered template."""

    #: The image placeholder (as text) and the id the model fills with image embeddings.
    image_token: str | None = None
    image_token_id: int | None = None
    #: Markers around an image's (and a video's) placeholders.
    vision_start_id: int | None = None
    vision_end_id: int | None = None
    #: Video placeholder id (None: videos expand into image tokens, or the folder takes no video).
    video_token_id: int | None = None
    #: What a ``<video>`` / ``<audio>`` tag becomes in a template that renders text only.
    video_text: str = "<|video_pad|>"
    audio_text: str = AUDIO_TAG
    #: Audio placeholder id and its markers.
    audio_token_id: int | None = None
    audio_start_id: int | None = None
    audio_end_id: int | None = None

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int]) -> MediaTokens:
        """The tokens a Qwen-style vocabulary names (``<|image_pad|>`` or ``<image>``, the vision markers,
        ``<|video_pad|>``)."""
        image = next((t for t in ("<|image_pad|>", "<image>") if t in vocab), None)
        start = vocab.get("<|vision_start|>")
        return cls(image_token=image, image_token_id=vocab.get(image) if image else None, vision_start_id=start,
                   vision_end_id=vocab.get("<|vision_end|>"), video_token_id=vocab.get("<|video_pad|>"),
                   video_text="<|vision_start|><|video_pad|><|vision_end|>" if start is not None else "<|video_pad|>")

    def image_text(self, structured: bool) -> str:
        """What an ``<image>`` tag becomes in the rendered text (``structured``: the template writes media parts
        itself): the placeholder, wrapped in the vision markers for a Qwen-style folder."""
        if structured or self.vision_start_id is None or self.image_token != "<|image_pad|>":
            return self.image_token or ""
        return "<|vision_start|><|image_pad|><|vision_end|>"


class Family(ABC):
    """One model family under one convention: its token plan per media item, how its placeholders expand, its
    manifest entries, and (read back from a manifest) what verify re-derives.

    An instance from :meth:`load` serves the encoder; one from :meth:`from_manifest` serves verify and the
    family's reader (:class:`packtool.families.reading.FamilyReader`, registered beside it; no model folder, no
    tokenizer: ``tokens`` then holds the manifest's ids)."""

    #: The family's name (``image_processor.family`` in the manifest where it writes one).
    name: ClassVar[str]
    #: Where its placeholders expand (see :data:`ExpandIn`).
    expand_in: ClassVar[ExpandIn] = "ids"
    #: Subclasses of this family that a convention needs (convention name -> class); see :mod:`packtool.families`.
    variants: ClassVar[dict[str, type[Family]]] = {}
    #: Media kinds the family has a token rule for.
    kinds: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.variants = {}  # each family its own: a variant registered for one never serves another

    @classmethod
    def register_variant(cls, convention: str, variant: type[Family]) -> None:
        """Register ``variant`` (a subclass of this family) as the family under ``convention``; a convention
        registered twice for one family is refused."""
        add_variant(cls, cls.variants, convention, variant)

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str = "") -> None:
        self.tokens = tokens
        self.convention = convention
        self.folder = folder

    # -- which family -----------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        """Whether the model folder (with these settings) belongs to this family."""

    @classmethod
    @abstractmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> Family:
        """The family's settings from the folder plus the overrides in ``settings``; :class:`ConfigError` for a
        folder or setting it cannot take."""

    @classmethod
    @abstractmethod
    def owns(cls, manifest: Mapping) -> bool:
        """Whether a manifest was written by this family."""

    @classmethod
    @abstractmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> Family:
        """The family as a manifest describes it, under the convention its packs were made with (the one value
        the manifest records, :func:`packtool.families.recorded_convention`); ``ValueError`` for malformed
        settings."""

    # -- encode: each media item's plan ---------------------------------------------------------------------------
    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        """An image's tokens and grid (``n_images``: images of its sample)."""
        raise NoRule("sample has images but the model folder has no preprocessor_config.json (set "
                     "image_tokens for a fixed count per image, or use the processor mode)")

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        """A video's frames, grid and tokens from its container facts."""
        raise NoRule(f"media {part!r}: the model folder {Path(self.folder).name} has no rule for videos (the "
                     f"processor mode has)")

    def video_facts(self, data: list[bytes], framed: bool, facts: VideoFacts, part: str) -> VideoFacts:
        """The facts :meth:`plan_video` plans with and the pack records (``data``: the video's bytes, or its
        frames' when ``framed``): the probe's, unless the family's trainer reads its own."""
        return facts

    def plan_audio(self, facts: AudioFacts, part: str) -> ItemPlan:
        """An audio clip's tokens and the waveform length its processor is given."""
        raise NoRule(f"media {part!r}: the model folder {Path(self.folder).name} has no rule for audio (the "
                     f"processor mode has)")

    def limit_tokens(self, item: MediaItem) -> int:
        """An item's visual tokens as a per-sample limit counts them (``sample_max_visual_tokens``): its tokens."""
        return item.tokens

    def check_media(self, kinds: list[str]) -> None:
        """Refuse a sample's media kinds before its media are read (:class:`SampleError`)."""
        if self.tokens.image_token_id is None and "image" in kinds:
            raise SampleError("sample has images but the tokenizer has no image token")

    def media_input(self, kind: str, data: list[bytes], framed: bool, facts: Any) -> Decoded | None:
        """What an item needs besides its plan before expansion (the processor mode: the decoded media); None:
        nothing."""
        return None

    # -- encode: placeholders ------------------------------------------------------------------------------------
    def template_placeholder(self, kind: str) -> str | None:
        """What the chat template writes for a ``{"type": kind}`` content part, if it takes such parts (probed
        once per run); None: no part of that kind is probed."""
        return self.tokens.image_token if kind == "image" else None

    def placeholder_text(self, kind: str, structured: bool) -> str:
        """What a tag of ``kind`` becomes in the text the template renders."""
        if kind == "image":
            return self.tokens.image_text(structured)
        return self.tokens.video_text if kind == "video" else self.tokens.audio_text

    def expand_text(self, text: str, spans: list[tuple[int, int]],
                    media: list[Staged]) -> tuple[str, list[tuple[int, int]], list[Staged]]:
        """The rendered text with the placeholders expanded where the family does it in the text (and the reply
        spans moved to match), and the items as :meth:`place` takes them; unchanged for a family that expands in
        the ids."""
        return text, spans, media

    def place(self, encoding: Any, ids: np.ndarray, targets: np.ndarray, media: list[Staged], cut: bool,
              text_len: int, special_ids: frozenset[int]) -> tuple[np.ndarray, np.ndarray, list[MediaItem]]:
        """Tokens, targets and each kept item with its ``token_offset`` and ``span``: each placeholder token
        repeated to its item's count (``cut``: items past a cut text are left out)."""
        placeholder = {"image": self.tokens.image_token_id, "video": self.tokens.video_token_id}
        pads = _positions(ids, [t for t in placeholder.values() if t is not None])
        if cut:
            media = media[:len(pads)]
        if len(pads) != len(media):
            raise SampleError(f"template produced {len(pads)} media placeholders for {len(media)} media items")
        if not media:  # text only: nothing to expand
            return ids.astype(np.int32), targets, []
        items = [p.item for p in media]
        if any(int(ids[p]) != placeholder.get(m.kind) for p, m in zip(pads, items)):
            raise SampleError("the template's media placeholders are not in the order of the media kinds")
        if np.any(targets[pads]):
            raise SampleError("a media placeholder lies inside an assistant reply")
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[pads] = [m.tokens for m in items]
        new_start = np.concatenate([[0], np.cumsum(repeat)[:-1]])
        items = [replace(m, token_offset=int(new_start[p])) for m, p in zip(items, pads)]
        tokens = np.repeat(ids, repeat).astype(np.int32)
        targets = np.repeat(targets, repeat)
        return tokens, targets, [replace(m, span=self.media_span(tokens, m)) for m in items]

    def media_span(self, tokens: np.ndarray, m: MediaItem) -> tuple[int, int]:
        """``[start, end)`` of an item's whole expansion: recorded (``span``), else its placeholder tokens widened
        by the vision markers around them."""
        if m.span:
            return m.span
        return self.widen(tokens, m.token_offset, m.token_offset + m.tokens)

    def widen(self, tokens: np.ndarray, s: int, e: int) -> tuple[int, int]:
        """``[s, e)`` widened by the vision markers right around it."""
        start, end = self.tokens.vision_start_id, self.tokens.vision_end_id
        if s > 0 and start is not None and tokens[s - 1] == start:
            s -= 1
        if e < len(tokens) and end is not None and tokens[e] == end:
            e += 1
        return s, e

    # -- the manifest ---------------------------------------------------------------------------------------------
    @abstractmethod
    def manifest_entries(self) -> dict[str, Any]:
        """The manifest's media entries: ``image_processor``, ``video_processor`` and the media token ids."""

    def placeholder_ids(self) -> dict[str, int | None]:
        """Placeholder token id of each media kind in the packs (verify and the reader check spans with them)."""
        return {"image": self.tokens.image_token_id, "video": self.tokens.video_token_id}

    # -- verify: what it re-derives ---------------------------------------------------------------------------------
    #: Whether verify can derive each item's grid, frames and tokens again from the manifest's settings.
    rederives: ClassVar[bool] = True

    def check_image(self, width: int, height: int, n_images: int) -> tuple[list[int], int] | None:
        """``(grid_thw, tokens)`` the manifest's rule gives an image; None when it has no image rule."""
        try:
            plan = self.plan_image(width, height, n_images)
        except NoRule:
            return None
        return list(plan.grid_thw), plan.tokens

    def check_video(self, facts: VideoFacts) -> tuple[list[int], int, list[int], float | None] | None:
        """``(grid_thw, tokens, frame_indices, second_per_grid_ts)`` for a video; None without a video rule."""
        try:
            plan = self.plan_video(facts, "")
        except NoRule:
            return None
        return list(plan.grid_thw), plan.tokens, list(plan.frame_indices), plan.second_per_grid_ts

    def check_audio(self, facts: AudioFacts) -> tuple[int, int] | None:
        """``(samples, tokens)`` the manifest's rule gives an audio clip; None without an audio rule."""
        try:
            plan = self.plan_audio(facts, "")
        except NoRule:
            return None
        return (plan.samples if plan.samples is not None else facts.samples), plan.tokens

    def audio_input(self) -> tuple[int, int | None] | None:
        """``(sampling rate, most samples)`` of the waveform the family's processor is given (verify decodes each
        clip so and compares its length with the recorded samples); None where the family's audio plan counted
        the decoded clip itself."""
        return None

    #: Whether an image's plan depends on its sample's text (all images of a sample planned together): verify
    #: then re-derives the grids of a whole segment (:meth:`segment_image_grids`) and cannot those of a cut one.
    plans_sample_images: ClassVar[bool] = False

    def video_problems(self, where: str, ref: MediaRef, data: bytes) -> list[str] | None:
        """Problems of a recorded video (``ref``: its :class:`~packtool.format.MediaRef`; ``data``: its bytes) for a
        family whose video plan comes from the container as another reader sees it; None: verify compares
        :meth:`check_video`'s plan with the record."""
        return None

    def segment_image_grids(self, tokens: np.ndarray, media: list[MediaRef]) -> list[list[int]] | None:
        """The image grids an untruncated segment's plan gives (``tokens``: its tokens; ``media``: its
        :class:`~packtool.format.MediaRef` items) for a family that :attr:`plans_sample_images`; else None."""
        return None

    #: Whether the images of one sample share the processor's token budget (an image's plan then depends on how
    #: many images the sample gave the processor: a truncated segment's images may have been planned with more).
    shared_image_budget: ClassVar[bool] = False

    def image_counts(self, n_images: int, truncated: bool) -> range:
        """The image counts a segment's image may have been planned with: the segment's own, and for a family
        whose images share a budget and a cut segment, also larger ones (the cut dropped images past it from
        the segment but not from the count the sample was encoded with)."""
        if truncated and self.shared_image_budget:
            return range(n_images, n_images + 1 + MAX_CUT_IMAGES)
        return range(n_images, n_images + 1)

    #: Whether the family's placeholders were expanded in the text (verify's round trip through the tokenizer
    #: then keeps them as they are; else each run collapses back to one placeholder first).
    @property
    def expanded_in_text(self) -> bool:
        return self.expand_in != "ids"


def knows_exactly(folder: Path, settings: EncodeSettings, known: Mapping[str, frozenset[str]], family: str) -> bool:
    """Whether a folder states only names ``family``'s rule knows (``known``: names per kind
    of name, :func:`packtool.media.folder.stated_names`). One that states another name is a one-line
    :class:`ConfigError` naming the processor mode, never read by the nearest rule; in that mode, False (the folder's
    own processor counts its tokens)."""
    from packtool.media.folder import stated_names, unknown_name

    unknown = unknown_name(stated_names(folder), known)
    if unknown is None:
        return True
    if settings.media_tokens == "processor":
        return False
    raise ConfigError(f"{folder}: {unknown} is no {family} one packtool knows, so packtool has no exact token rule "
                      f"for this folder; use --media-tokens processor (the folder's own processor counts the tokens)")


def manifest_tokens(manifest: Mapping) -> MediaTokens:
    """The media token ids a manifest records."""
    return MediaTokens(image_token_id=manifest.get("image_token_id"),
                       vision_start_id=manifest.get("vision_start_token_id"),
                       vision_end_id=manifest.get("vision_end_token_id"),
                       video_token_id=manifest.get("video_token_id"), audio_token_id=manifest.get("audio_token_id"),
                       audio_start_id=manifest.get("audio_start_token_id"),
                       audio_end_id=manifest.get("audio_end_token_id"))


def _positions(ids: np.ndarray, values: list[int]) -> np.ndarray:
    """Indices of the ids equal to one of a few ``values`` (``np.isin`` costs several times more on a sample)."""
    hit = np.zeros(len(ids), dtype=bool)
    for v in values:
        hit |= ids == v
    return np.flatnonzero(hit)


class ExpandsInText(Family):
    """A family whose processor writes each placeholder's expansion into the text and then tokenizes the whole
    text (Nemotron Omni): the encoder does the same, so the tokens are exactly the processor's. Expanding the ids
    instead would not be exact: a frame label merges with its neighbours under BPE."""

    expand_in: ClassVar[ExpandIn] = "text"

    def embed_ids(self) -> dict[str, int | None]:
        """Token each kind's embeddings fill (what an item's ``tokens`` counts)."""
        return self.placeholder_ids()

    def placeholders(self) -> dict[str, tuple[str, str]]:
        """``kind -> (placeholder in the rendered text, first embedding token of its expansion)``."""
        raise NotImplementedError

    def expand_text(self, text: str, spans: list[tuple[int, int]],
                    media: list[Staged]) -> tuple[str, list[tuple[int, int]], list[Staged]]:
        """Each placeholder of the rendered text replaced by the next expansion of its kind (the item's ``text``,
        as the processor does it kind by kind), the reply spans shifted to match, and the items with their
        characters (``chars``: start, its first embedding placeholder, end) instead of their text."""
        if not media:
            return text, spans, media
        marks = self.placeholders()
        queues: dict[str, list[int]] = {}
        for i, p in enumerate(media):
            queues.setdefault(marks[p.item.kind][0], []).append(i)
        out = list(media)
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
            i = queue.pop(0)
            expansion = out[i].text
            if expansion is None:
                raise TypeError(f"{self.name}: {out[i].item.kind} item {i} has no expansion text")
            start = found.start() + shift
            out[i] = replace(out[i], text=None, chars=(start, start + expansion.index(marks[out[i].item.kind][1]),
                                                       start + len(expansion)))
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
        return "".join(pieces), moved, out

    def place(self, encoding: Any, ids: np.ndarray, targets: np.ndarray, media: list[Staged], cut: bool,
              text_len: int, special_ids: frozenset[int]) -> tuple[np.ndarray, np.ndarray, list[MediaItem]]:
        """Each item's ``token_offset`` (its first embedding placeholder) and ``span`` (its whole expansion) from
        the characters :meth:`expand_text` recorded; items past a cut text are left out (one that runs past it
        ends at the last token: the sample is longer than a pack, and truncation never keeps it)."""
        n = len(ids)
        embed = self.embed_ids()
        kept: list[MediaItem] = []
        previous_end = 0
        for p in media:
            if p.chars is None:
                raise TypeError(f"{self.name}: a {p.item.kind} item was placed before its text was expanded")
            m, (start, first, end) = p.item, p.chars
            if start < previous_end:
                raise SampleError("the chat template renders the media placeholders in another order than the "
                                  "sample's media")
            previous_end = end
            if start >= text_len:
                continue
            a = covering_token(encoding, start, n)
            b = n if end > text_len else covering_token(encoding, end - 1, n) + 1
            if a >= n:
                continue
            count = int((ids[a:b] == embed[m.kind]).sum())
            if b < n and count != m.tokens:
                raise SampleError(f"the tokenizer splits the placeholders of {m.kind} {len(kept) + 1}: "
                                  f"{count} tokens for {m.tokens}")
            if targets[a:b].any():
                raise SampleError("a media placeholder lies inside an assistant reply")
            kept.append(replace(m, token_offset=covering_token(encoding, first, n) if first < text_len else n,
                                span=(a, b)))
        return ids.astype(np.int32), targets, kept


def covering_token(encoding: Any, pos: int, n: int) -> int:
    """Index of the token covering character ``pos`` (at most ``n``); a character no token covers is a
    :class:`SampleError` (media expansions start and end on marker tokens, which always cover their characters)."""
    token = encoding.covering(pos, n)
    if token is None:
        raise SampleError(f"no token covers character {pos} of a media expansion")
    return token


class NoMedia(Family):
    """A model folder with no media rule (a text model, or a VLM whose image settings packtool cannot read without
    the processor mode or a fixed count): text packs, and every sample with media is quarantined with the reason."""

    name = "none"

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        return True

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> NoMedia:
        return cls(MediaTokens.from_vocab(tok.get_vocab()), convention, str(settings.tokenizer))

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        return manifest.get("image_processor") is None

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> NoMedia:
        return cls(manifest_tokens(manifest), convention)

    def manifest_entries(self) -> dict[str, Any]:
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id, "image_processor": None, "video_token_id": None,
                "video_processor": None, "audio_token_id": None, "audio_start_token_id": None,
                "audio_end_token_id": None}
