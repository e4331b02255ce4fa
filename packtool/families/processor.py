"""Processor mode: the model folder's own transformers processor expands the media placeholders.

For a model family packtool has no fast token rule for (Gemma 3, LLaVA, LLaVA-OneVision, InternVL, ...), the
folder's ``AutoProcessor`` is called on each sample with its rendered text and its decoded media; its
``input_ids`` are the sample's tokens, exact by construction (and slower: every media item is decoded).

Targets come from the tokenizer's ids of the unexpanded text, where the reply spans are known: the two id
sequences are identical outside the expansions (the processor tokenizes the expanded text with the same
tokenizer), so they are aligned by a sequence diff in which media placeholder tokens never match, every target
token must find its counterpart, and each region of the processor's ids with no counterpart that holds media
placeholders is one media item's span. Items with only spaces between them share one region (and its span);
their placeholder counts (a fast rule's, else the processor's on each item alone) tell them apart.

The media are decoded the way packtool's readers decode them: images as stored (no EXIF rotation), every frame
of a video with the metadata transformers' own video loader gives (frame rate, frame numbers), audio as a mono
waveform at the feature extractor's rate (cut to ``audio_max_seconds``).
"""

from __future__ import annotations

import difflib
import functools
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import ConfigError, SampleError
from packtool.families.base import Decoded, Family, ItemPlan, MediaTokens, NoRule, manifest_tokens
from packtool.families.conventions import TRANSFORMERS, Convention
from packtool.families.reading import FamilyReader, VisionMedia
from packtool.format import MediaRef, PackRecord

if TYPE_CHECKING:
    from packtool.item import MediaItem, Staged
    from packtool.media.audio import AudioFacts
    from packtool.media.video import VideoFacts
    from packtool.settings import EncodeSettings

#: Matched runs shorter than this (holding no target and no special token) do not end a media region: an
#: expansion's own text (a space, a digit of a frame label) can match a token of the unexpanded text by chance.
_ANCHOR = 4


@functools.lru_cache(maxsize=2)
def load_processor(folder: str) -> Any:
    """The folder's ``AutoProcessor`` (local files only); :class:`ConfigError` when it cannot be built."""
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a folder it cannot read
        raise ConfigError(f"{folder}: the model folder's processor cannot be loaded for the processor mode "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(processor, ProcessorMixin):
        raise ConfigError(f"{folder}: the model folder has no processor (a processor_config.json naming its "
                          f"processor_class), so the processor mode cannot run")
    return processor


def media_token_ids(processor: Any) -> frozenset[int]:
    """Ids of the tokens the model fills with media (image, video, audio; those the processor has): its
    ``{kind}_token_ids``, else the id of its text placeholder. They differ from the placeholder where the expansion
    wraps other tokens around them: Gemma 3 writes ``<start_of_image>`` in the text and fills
    ``<image_soft_token>``."""
    ids: set[int] = set()
    for kind in ("image", "video", "audio"):
        values = getattr(processor, f"{kind}_token_ids", None) or [getattr(processor, f"{kind}_token_id", None)]
        filled = {v for v in values if isinstance(v, int)}
        ids |= filled or placeholder_token_ids(processor, kinds=(kind,))
    if not ids:
        raise ConfigError("the model folder's processor names no media placeholder token")
    return frozenset(ids)


def placeholder_token_ids(processor: Any, kinds: Sequence[str] = ("image", "video", "audio")) -> frozenset[int]:
    """Ids of the processor's text placeholders (``{kind}_token``) that are tokens of its tokenizer."""
    tok = processor.tokenizer
    vocab = tok.get_vocab()
    tokens = (getattr(processor, f"{kind}_token", None) for kind in kinds)
    return frozenset(vocab[t] for t in tokens if isinstance(t, str) and t in vocab)


def processor_ids(processor: Any, text: str, images: Sequence[Any], videos: Sequence[tuple[np.ndarray, dict]],
                  audio: Sequence[np.ndarray]) -> np.ndarray:
    """The processor's ``input_ids`` for one sample; a call it refuses is a :class:`SampleError`."""
    from transformers.video_utils import VideoMetadata

    call: dict[str, Any] = {}
    if images:
        call["images"] = list(images)
    if videos:
        call["videos"] = [frames for frames, _ in videos]
        metadata = [VideoMetadata(**meta) for _, meta in videos]
        call["video_metadata"] = metadata[0] if len(metadata) == 1 else metadata  # some read one video's fields
        # Frames are THWC: said explicitly, or a video 1 or 3 pixels high is read as channels first.
        call["videos_kwargs"] = {"input_data_format": "channels_last"}
    if audio:
        call["audio"] = list(audio)
    try:
        # No tensors asked for: only the ids are used, and stacking them would refuse media of unequal shapes
        # (two videos of different frame counts).
        out = processor(text=[text], **call)
    except Exception as exc:  # the processor's own checks (placeholder counts, sizes) raise many types
        raise SampleError(f"the model's processor refuses the sample: {type(exc).__name__}: {exc}") from None
    for name, value in out.items():  # a clip too short for its feature frames normalizes to NaN, for one
        if name != "input_ids" and _has_nan(value):
            raise SampleError(f"the model's processor gives NaN in {name} (a media item too short or degenerate "
                              f"for it)")
    return np.asarray(out["input_ids"][0], dtype=np.int64)


def _has_nan(value: Any) -> bool:
    """Whether a processor output (an array, a tensor, or lists of them) holds a NaN float."""
    if isinstance(value, (list, tuple)):
        return any(_has_nan(v) for v in value)
    if hasattr(value, "numpy") and hasattr(value, "is_floating_point"):  # a torch tensor
        return bool(value.is_floating_point() and value.isnan().any())
    if isinstance(value, np.ndarray):
        return value.dtype.kind == "f" and bool(np.isnan(value).any())
    return isinstance(value, float) and value != value


def open_pil(data: bytes) -> Any:
    """An image as PIL gives it to a processor (no EXIF rotation, like every packtool path)."""
    from PIL import Image

    return Image.open(io.BytesIO(data))


def align(unexpanded: np.ndarray, targets: np.ndarray, expanded: np.ndarray, media_ids: frozenset[int],
          marker_ids: frozenset[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Targets of ``expanded`` (the processor's ids) from those of ``unexpanded`` (the tokenizer's ids of the same
    text before expansion), and the ``[start, end)`` regions of ``expanded`` that have no counterpart and hold
    media placeholders, in order. Two regions stay apart when the tokens matched between them are many, hold a
    target, or hold one of ``marker_ids`` (special tokens, which no text yields by chance). Raises
    :class:`SampleError` when a target token has no counterpart."""
    media = np.fromiter(media_ids, dtype=np.int64)
    a = np.where(np.isin(unexpanded, media), -1, unexpanded).tolist()  # placeholders never match
    b = np.where(np.isin(expanded, media), -2, expanded).tolist()
    out = np.zeros(len(expanded), dtype=np.uint8)
    markers = np.fromiter(marker_ids, dtype=np.int64)
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    mapped, previous = 0, 0
    gaps: list[list[int]] = []  # unmatched runs of the processor's ids, merged across stray matches
    for i, j, n in blocks:
        out[j:j + n] = targets[i:i + n]
        mapped += int(targets[i:i + n].sum())
        if j > previous:
            between = slice(gaps[-1][1], previous) if gaps else slice(0, 0)
            if gaps and previous - gaps[-1][1] < _ANCHOR and not out[between].any() and \
                    not np.isin(expanded[between], markers).any():
                gaps[-1][1] = j
            else:
                gaps.append([previous, j])
        previous = j + n
    if mapped != int(targets.sum()):
        raise SampleError("processor mode: the processor's tokens differ from the tokenizer's inside a reply, so "
                          "the targets cannot be aligned")
    return out, [(s, e) for s, e in gaps if np.isin(expanded[s:e], media).any()]


class ProcessorMode(Family):
    """The processor mode as a family: the folder's own processor expands every sample with media. A family
    with a rule for the folder (``inner``) still plans each item (its counts tell neighbouring items apart, its
    grids are recorded, its manifest entries written); without one, items are planned by the processor alone."""

    name = "processor"
    expand_in = "processor"
    kinds = ("image", "video", "audio")
    rederives = False

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str, processor: Any,
                 inner: Family | None, special_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(tokens, convention, folder)
        self.processor = processor
        self.inner = inner
        self.special_ids = special_ids
        if processor is not None:
            self.media_ids = media_token_ids(processor)
            self.placeholder_token_ids = placeholder_token_ids(processor)

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        return settings.media_tokens == "processor"

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> ProcessorMode:
        raise NotImplementedError("the processor mode wraps the folder's family: see packtool.families.load")

    @classmethod
    def wrap(cls, inner: Family | None, settings: EncodeSettings, tok: Any) -> ProcessorMode:
        """The processor mode over ``inner`` (the folder's family, None when packtool has no rule for it); the
        image token is the one the processor's model fills."""
        processor = load_processor(settings.tokenizer)
        vocab = tok.get_vocab()
        tokens = inner.tokens if inner is not None else MediaTokens.from_vocab(vocab)
        placeholder = getattr(processor, "image_token", None)  # the processor's own (Gemma 3: <start_of_image>)
        if isinstance(placeholder, str) and placeholder in vocab:
            filled = [i for i in getattr(processor, "image_token_ids", []) if isinstance(i, int)]  # the model's
            tokens = replace(tokens, image_token=placeholder,
                             image_token_id=filled[0] if filled else vocab[placeholder])
        convention = inner.convention if inner is not None else TRANSFORMERS
        special = frozenset(tok.all_special_ids) | frozenset(tok.added_tokens_encoder.values())
        return cls(tokens, convention, str(settings.tokenizer), processor, inner, special)

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        entry = manifest.get("image_processor")
        return isinstance(entry, Mapping) and entry.get("family") == "processor"

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> ProcessorMode:
        family = cls(manifest_tokens(manifest), convention, "", None, None)
        family.audio_max_seconds = (manifest.get("settings") or {}).get("audio_max_seconds")
        return family

    # -- plans: the inner family's, else the processor's own counts (found when it expands the sample) ---------
    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        try:
            return self.inner.plan_image(width, height, n_images) if self.inner else ItemPlan(0)
        except NoRule:
            return ItemPlan(0)

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        try:
            if self.inner is not None:
                return self.inner.plan_video(facts, part)
        except NoRule:
            pass
        return ItemPlan(0, (), tuple(range(facts.frames)))

    def plan_audio(self, facts: AudioFacts, part: str) -> ItemPlan:
        try:
            return self.inner.plan_audio(facts, part) if self.inner else ItemPlan(0)
        except NoRule:
            return ItemPlan(0)

    def media_input(self, kind: str, data: list[bytes], framed: bool, facts: Any) -> Decoded | None:
        """The media decoded the way packtool's readers decode them: images as stored, every frame of a video
        with the metadata transformers' own video loader gives, audio at the feature extractor's rate (cut to
        ``audio_max_seconds``)."""
        from packtool.media import decode_audio, decode_frames, decode_video

        if kind == "image":
            return Decoded(open_pil(data[0]))
        if kind == "video":
            every = list(range(facts.frames))
            frames = decode_frames(data, every) if framed else decode_video(data[0], every)
            return Decoded((frames, {**facts.metadata(), "frames_indices": every}))
        if getattr(self.processor, "feature_extractor", None) is None:
            raise SampleError(f"the model's processor ({type(self.processor).__name__}) takes no audio")
        rate = int(self.processor.feature_extractor.sampling_rate)
        limit = self.audio_max_seconds
        wave = decode_audio(data[0], rate=rate, max_samples=None if limit is None else int(limit * rate))
        return Decoded(wave, len(wave))

    #: ``audio_max_seconds`` of the settings (set by :func:`packtool.families.load`).
    audio_max_seconds: float | None = None

    def template_placeholder(self, kind: str) -> str | None:
        """The processor's own placeholder of each kind (a model without image input, such as Qwen2-Audio, is
        probed with its audio part)."""
        if kind == "image":
            return super().template_placeholder(kind)
        token = getattr(self.processor, f"{kind}_token", None)
        return token if isinstance(token, str) else None

    def check_media(self, kinds: list[str]) -> None:
        """The processor checks its own placeholders."""

    # -- expansion by the processor ---------------------------------------------------------------------------
    def expand_text(self, text: str, spans: list[tuple[int, int]],
                    media: list[Staged]) -> tuple[str, list[tuple[int, int]], list[Staged]]:
        """The processor's ids for the rendered text and the decoded media, kept with the items (``ids``, one array
        shared by the sample's items) until :meth:`place` instead of their decoded media; the text is unchanged."""
        if not media:
            return text, spans, media
        inputs: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
        for p in media:
            inputs[p.item.kind].append(p.input)
        ids = processor_ids(self.processor, text, inputs["image"], inputs["video"], inputs["audio"])
        placeholders = np.fromiter(self.media_ids, np.int64)
        out = []
        for p in media:
            m = p.item
            placeholder = getattr(self.processor, f"{m.kind}_token", None)
            if len(media) > 1 and m.tokens <= 0 and isinstance(placeholder, str):
                # Its count alone tells it from a neighbour it shares a region with (see place).
                own: dict[str, list[Any]] = {k: [p.input] if k == m.kind else [] for k in inputs}
                alone = processor_ids(self.processor, placeholder, own["image"], own["video"], own["audio"])
                m = replace(m, tokens=int(np.isin(alone, placeholders).sum()))
            out.append(replace(p, item=m, text=None, input=None, ids=ids))
        return text, spans, out

    def place(self, encoding: Any, ids: np.ndarray, targets: np.ndarray, media: list[Staged], cut: bool,
              text_len: int, special_ids: frozenset[int]) -> tuple[np.ndarray, np.ndarray, list[MediaItem]]:
        """The processor's ids as the tokens, targets aligned onto them from the tokenizer's ids of the unexpanded
        text (``ids``), and each item's tokens and span from the aligned media regions."""
        if not media:
            if self.inner is not None:
                return self.inner.place(encoding, ids, targets, media, cut, text_len, special_ids)
            return super().place(encoding, ids, targets, media, cut, text_len, special_ids)
        expanded = media[0].ids
        if expanded is None:
            raise TypeError("processor mode: items placed before the processor expanded their sample")
        items = [p.item for p in media]
        if cut:
            raise SampleError("processor mode: the text is too long to align with the processor's tokens")
        aligned, regions = align(ids, targets, expanded, self.media_ids | self.placeholder_token_ids, special_ids)
        tokens = expanded.astype(np.int32)
        placeholders = np.isin(expanded, np.fromiter(self.media_ids, np.int64))
        if len(regions) == len(media):  # one region per item: its placeholders are the region's
            placed = []
            for m, (s, e) in zip(items, regions):
                at = s + np.flatnonzero(placeholders[s:e])
                placed.append(replace(m, token_offset=int(at[0]), tokens=len(at), span=self.widen(tokens, s, e)))
            return tokens, aligned, placed
        # Items with only spaces between them share a region: their counts (a rule's, else the processor's on each
        # item alone) tell their placeholders apart, and the region is split between them right after an item's
        # end marker (a special token after its last placeholder), so the spans stay disjoint and in order.
        at = np.flatnonzero(placeholders)
        if any(m.tokens <= 0 for m in items) or sum(m.tokens for m in items) != len(at):
            raise SampleError(f"processor mode: the processor's tokens hold {len(regions)} media regions for "
                              f"{len(media)} media items (items with no text between them cannot be told apart)")
        first = 0
        placed = []
        for m in items:
            start, last = int(at[first]), int(at[first + m.tokens - 1])
            s, e = next(r for r in regions if r[0] <= start < r[1])
            if last >= e:
                raise SampleError("processor mode: a media item's placeholders differ from its count")
            first += m.tokens
            before = placed[-1].span if placed else None
            if before is not None and before[1] > s:  # shares the region with the item before it
                s = before[1]
            if first < len(at) and at[first] < e:  # the next item shares it: end after this item's end marker
                e = last + 1 + int(int(tokens[last + 1]) in special_ids and last + 2 < at[first])
            placed.append(replace(m, token_offset=start, span=self.widen(tokens, s, e)))
        return tokens, aligned, placed

    def manifest_entries(self) -> dict[str, Any]:
        if self.inner is not None:
            return {**self.inner.manifest_entries(), "image_token_id": self.tokens.image_token_id}
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id,
                "image_processor": {"family": "processor", "processor_class": type(self.processor).__name__},
                "video_token_id": None, "video_processor": None, "audio_token_id": None,
                "audio_start_token_id": None, "audio_end_token_id": None}


# -- reading processor-mode packs ---------------------------------------------------------------------------------
def processor_media(record: PackRecord, processor: Any, where: str, decode: bool,
                    audio_max_seconds: float | None) -> dict:
    """The media of a processor-mode pack (``record``: a :class:`~packtool.format.PackRecord`): ``media_kinds``
    (placeholder order) and, with ``decode``, ``media_inputs``: one dict per media item, in the same order, of
    what the model folder's own sub-processor (``image_processor``, ``video_processor``, ``feature_extractor``)
    gives for that item alone, decoded as at pack time (images as stored, a video's frames with their metadata
    with channels last, audio as a mono waveform at the extractor's rate, cut to ``audio_max_seconds``). Items are
    processed one at a time because this mode's processors differ in how (and whether) they batch unequal items."""
    from packtool.errors import FormatError

    refs = record.media_refs
    out: dict[str, Any] = {"media_kinds": [m.kind for m in refs]}
    if not decode:
        return out
    if processor is None:
        if refs:
            raise ValueError(f"{where} has media but no processor: pass image_processor=packtool.families.processor."
                             f"load_processor(OUTPUT/.nv-meta/tokenizer) or images=False")
        return out
    inputs = []
    for m in refs:
        try:
            inputs.append(_item_inputs(record, m, processor, audio_max_seconds))
        except FormatError:
            raise
        except Exception as exc:  # decoders and processors raise many types for media they refuse
            raise FormatError(f"{where}, member {m.member}: the model's processor refuses the {m.kind} "
                              f"({type(exc).__name__}: {exc})") from None
    out["media_inputs"] = inputs
    return out


def _item_inputs(record: PackRecord, m: MediaRef, processor: Any, audio_max_seconds: float | None) -> dict:
    """One media item through its kind's sub-processor (see :func:`processor_media`)."""
    from packtool.media import decode_audio, decode_frames, decode_video

    part = {"image": "image_processor", "video": "video_processor", "audio": "feature_extractor"}[m.kind]
    sub = getattr(processor, part, None)
    if sub is None:
        raise ValueError(f"the processor ({type(processor).__name__}) has no {part}")
    if m.kind == "image":
        result = sub(images=[open_pil(record.media[m.member])], return_tensors="pt")
    elif m.kind == "video":
        from transformers.video_utils import VideoMetadata

        frames = (decode_frames([record.media[f] for f in m.frames], m.frame_indices) if m.frames
                  else decode_video(record.media[m.member], m.frame_indices))
        meta = VideoMetadata(total_num_frames=m.total_frames, fps=m.fps, width=m.width, height=m.height,
                             duration=m.duration, frames_indices=list(m.frame_indices))
        result = sub(videos=[frames], video_metadata=[meta], input_data_format="channels_last", return_tensors="pt")
    else:
        rate = int(sub.sampling_rate)
        wave = decode_audio(record.media[m.member], rate=rate,
                            max_samples=None if audio_max_seconds is None else int(audio_max_seconds * rate))
        result = sub([wave], sampling_rate=rate, return_tensors="pt")
    return dict(result)


@dataclass(eq=False)
class ProcessorMedia(VisionMedia):
    """The processor mode's media: each item's kind and what the model's own processor gives for it
    (:func:`processor_media`), or the base layout's fields where the caller passed an image processor alone."""

    #: Each media item's kind ("image", "video", "audio"), in placeholder order.
    media_kinds: list[str] | None = None
    #: One dict per media item, in ``media_kinds`` order: the model's sub-processor's output for that item alone.
    media_inputs: list[dict[str, Any]] | None = None


class ProcessorReader(FamilyReader):
    """The processor mode's reader: each item through the model folder copy's own processor."""

    family: ProcessorMode
    media_part = ProcessorMedia
    reads_folder = True

    def batch_family(self) -> str:
        """The folder's family's layouts (its model is that family's); the base layout (``none``) without one."""
        inner = self.family.inner
        return inner.name if inner is not None else "none"

    def processor(self, folder: Path | None = None) -> Any:
        """The model folder copy's own processor (None without a folder)."""
        return None if folder is None else load_processor(str(folder))

    def image_patch_dim(self, processor: Any) -> int | None:
        """A model processor's patch rows where it lays images out so (one with a temporal patch: ``[patches,
        C·t·p·p]``); None for any other."""
        temporal = getattr(processor, "temporal_patch_size", None)
        return None if temporal is None else 3 * temporal * processor.patch_size ** 2

    def read_media(self, record: PackRecord, processor: Any, where: str, decode: bool) -> dict[str, Any]:
        """Each item through the model processor's own sub-processor (:func:`processor_media`); a caller that
        passed an image processor alone (not a whole model processor) has its images go through it as before."""
        if processor is not None:
            from transformers.processing_utils import ProcessorMixin

            if not isinstance(processor, ProcessorMixin):
                return super().read_media(record, processor, where, decode)
        return processor_media(record, processor, where, decode, self.family.audio_max_seconds)
