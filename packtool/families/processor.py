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
from collections.abc import Sequence
from typing import Any

import numpy as np

from packtool.errors import ConfigError, SampleError

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
    if audio:
        call["audio"] = list(audio)
    try:
        out = processor(text=[text], return_tensors="np", **call)
    except Exception as exc:  # the processor's own checks (placeholder counts, sizes) raise many types
        raise SampleError(f"the model's processor refuses the sample: {type(exc).__name__}: {exc}") from None
    return np.asarray(out["input_ids"][0], dtype=np.int64)


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
