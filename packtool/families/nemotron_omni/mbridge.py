"""Nemotron Omni under Megatron-Bridge's Energon path (``--preset megatron-bridge-nemotron-omni``).

Megatron-Bridge's ``NemotronOmniTaskEncoder`` (its Energon recipe: ``use_temporal_video_embedder=True``,
``temporal_patch_size`` 2, ``video_fps`` 1.0, ``patch_dim`` 16, ``max_audio_duration`` 10 s, ``num_mel_bins`` 128)
hands each sample to its ``nemotron_omni_collate_fn``. This module is the convention (:class:`MBridgeNemotron`: turn
layout and targets) and the family variant (:class:`MBridgeNemotronOmni`: media) that reproduce it:

* Turns with ``<image>``/``<video>`` tags are cut at the tags; the text pieces, stripped of edge spaces, and the
  media are joined with newlines (an empty piece between two tags stays: two newlines). Turns without those tags are
  unchanged.
* Images: every image on a fixed square canvas (:data:`CANVAS` pixels, aspect not kept), one
  ``<img>`` + ``<image>``×256 + ``</img>`` block each (the processor-expanded contract of Megatron-Bridge's main
  branch, one placeholder per projected feature).
* Videos: ``This is a video:`` then one line per 2-frame tubelet, ``Frame 1 sampled at 0.00 seconds and frame 2
  sampled at 1.00 seconds: `` + the tubelet's block, each frame on the canvas. A frame list gives all its frames at
  ``video_fps`` 1; an encoded video (decord in Megatron-Bridge, PyAV here: the same frame count, rate and RGB) one
  frame a second of its duration, evenly spaced (:func:`sampled_frames`), each through a JPEG round trip, labelled
  at the rate of the frames taken. A one-frame video is given to the model twice (its temporal embedder takes it).
* Audio (the ``ChatMLSample.audio`` member, one clip, never tagged in the text): cut to 10 s at 16 kHz, Parakeet
  features with 128 mel bins; its block ``<so_start>`` + ``<so_embedding>``×n + ``<so_end>`` goes right after the
  sample's last ``</img>``, else right after its first token. n: three ceil-halvings of the features' valid length
  (the feature extractor's attention mask, Megatron-Bridge main), or of their frame count (Megatron-Bridge 0.6.2,
  ``audio_count="frames"``).
* Targets: each reply, its ``<|im_end|>`` and the newline after it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from packtool.errors import ConfigError, SampleError
from packtool.families.base import ItemPlan
from packtool.families.conventions import NEMOTRON_FAMILY, Convention, register_convention
from packtool.families.nemotron_omni.family import NemotronOmni, NemotronOmniSettings, RunFacts
from packtool.format import AUDIO_TAG, IMAGE_TAG, VIDEO_TAG

if TYPE_CHECKING:
    from packtool.item import Staged
    from packtool.media import AudioFacts, VideoFacts
    from packtool.settings import EncodeSettings

#: The preset.
MB_NEMOTRON = "megatron-bridge-nemotron-omni"
#: Side of the square canvas every image and video frame is resized to (Megatron-Bridge's ``VISION_FRAME_SIZE``).
CANVAS = 512
#: Megatron-Bridge's Energon recipe for Nemotron Omni.
TEMPORAL_PATCH = 2
VIDEO_FPS = 1.0
PATCH = 16
AUDIO_SECONDS = 10.0
AUDIO_RATE = 16_000
MEL_BINS = 128
HOP = 160
_VISUAL_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")


@dataclass(frozen=True)
class MBridgeNemotron(Convention):
    """Megatron-Bridge's Nemotron Omni collate: its joins around media (module docstring) and its targets (the
    newline after each ``<|im_end|>`` too: ``target_newline_after_eot``)."""

    def turn_text(self, text: str, role: str = "user") -> str:
        """A turn with image or video tags cut at them, each text piece stripped of edge spaces, the pieces and
        the tags joined with newlines (an audio tag, which only packtool's untagged placement writes, is kept in
        front: the family moves the clip to Megatron-Bridge's place)."""
        if IMAGE_TAG not in text and VIDEO_TAG not in text:
            return text
        audio = text.count(AUDIO_TAG)
        text = text.replace(AUDIO_TAG, "")
        parts = [p if _VISUAL_TAGS.fullmatch(p) else p.strip(" ") for p in _VISUAL_TAGS.split(text) if p]
        return AUDIO_TAG * audio + "\n".join(parts)


register_convention(MBridgeNemotron(
    MB_NEMOTRON, target_newline_after_eot=True, family=NEMOTRON_FAMILY, chatml_audio=True, options=("audio_count",),
    untagged_note="Megatron-Bridge's Nemotron Omni path would leave them out and train the text only"))


class MBridgeNemotronOmni(NemotronOmni):
    """Nemotron Omni's media as Megatron-Bridge's temporal Energon collate lays them out (module docstring)."""

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> NemotronOmni:
        if settings.audio_max_seconds is not None:
            raise ConfigError(f"--preset {MB_NEMOTRON} cuts audio at {AUDIO_SECONDS:g} s (Megatron-Bridge's "
                              f"max_audio_duration); --audio-max-seconds does not apply")
        if settings.video_fps is not None or settings.video_frames is not None:
            raise ConfigError(f"--preset {MB_NEMOTRON} takes videos at {VIDEO_FPS:g} fps (every frame of a "
                              f"frame list, one a second of an encoded video); --video-fps / --video-frames do not "
                              f"apply")
        return super().load(settings, tok, convention)

    @classmethod
    def variant_rule(cls, rule: NemotronOmniSettings, settings: EncodeSettings) -> NemotronOmniSettings:
        """The folder's audio features at Megatron-Bridge's rate and hop, cut at its clip length."""
        if rule.audio_sampling_rate != AUDIO_RATE or rule.audio_hop_length != HOP:
            raise ConfigError(f"{settings.tokenizer}: --preset {MB_NEMOTRON} computes audio features at "
                              f"{AUDIO_RATE} Hz with a hop of {HOP} samples; the folder's processor says "
                              f"{rule.audio_sampling_rate} Hz and {rule.audio_hop_length}")
        return replace(rule, audio_max_seconds=AUDIO_SECONDS)

    @classmethod
    def run_facts(cls, settings: EncodeSettings, tok: Any) -> RunFacts:
        """The tokenizer (the collate's text measured as it cuts) and how audio tokens are counted."""
        return RunFacts(tok=tok, audio_count=settings.audio_count)

    @classmethod
    def recorded_facts(cls, manifest: Mapping) -> RunFacts:
        entry = manifest["image_processor"].get("megatron_bridge") or {}
        return RunFacts(audio_count=entry.get("audio_count", "valid"))

    # -- plans ----------------------------------------------------------------------------------------------------
    @property
    def per_block(self) -> int:
        """``<image>`` tokens of one image or tubelet on the canvas (2×2 pixel shuffle)."""
        return (CANVAS // PATCH // 2) ** 2

    def block(self) -> str:
        r = self.rule
        return r.image_start_token + r.image_token * self.per_block + r.image_end_token

    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        """Grid: the canvas in patches."""
        return ItemPlan(self.per_block, (1, CANVAS // PATCH, CANVAS // PATCH), text=self.block())

    def video_facts(self, data: list[bytes], framed: bool, facts: VideoFacts, part: str) -> VideoFacts:
        """An encoded video as decord reads it (its frame count and average rate equal PyAV's header and stream
        rate); refused where Megatron-Bridge's path cannot take it (no rate, or a width decord misreads)."""
        if framed:
            return facts
        if facts.fps is None:
            raise SampleError(f"media {part!r}: the video stream has no frame rate (Megatron-Bridge's Nemotron "
                              f"Omni path samples encoded videos at {VIDEO_FPS:g} fps of the stream's average rate)")
        if (channels := decord_channels(facts.width)) != 3:
            raise SampleError(f"media {part!r}: decord (Megatron-Bridge's Nemotron Omni video decoder) reads frames "
                              f"{facts.width} pixels wide as {channels} channels (its row padding), which its JPEG "
                              f"step cannot take (Energon skips the sample)")
        return facts

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        """Grid: the frames taken, then the canvas in patches; one block per tubelet (labels: each frame's number
        over the sampled rate, :func:`sampled_frames`)."""
        if facts.frame_count_source == "frames":
            indices, rate = tuple(range(facts.frames)), VIDEO_FPS
        else:
            assert facts.fps is not None  # video_facts refuses a video without a rate
            indices, rate = sampled_frames(facts.frames, facts.fps)
        n = len(indices)
        lines = ["This is a video:"]
        for start in range(0, n, TEMPORAL_PATCH):
            labels = [f"{'Frame' if k == start else 'frame'} {k + 1} sampled at {k / rate:.2f} seconds"
                      for k in range(start, min(start + TEMPORAL_PATCH, n))]
            lines.append(" and ".join(labels) + ": " + self.block())
        tubelets = len(lines) - 1
        return ItemPlan(self.per_block * tubelets, (n, CANVAS // PATCH, CANVAS // PATCH), indices, None,
                        text="\n".join(lines))

    def plan_audio(self, facts: AudioFacts, part: str) -> ItemPlan:
        self.refuse_audio(facts, part)
        samples = self.rule.audio_samples(facts)
        r = self.rule
        n = audio_tokens(samples, self.run.audio_count)
        return ItemPlan(n, samples=samples, text=r.audio_start_token + r.audio_token * n + r.audio_end_token)

    # -- placement ------------------------------------------------------------------------------------------------
    def expand_text(self, text: str, spans: list[tuple[int, int]],
                    media: list[Staged]) -> tuple[str, list[tuple[int, int]], list[Staged]]:
        """Images and videos expanded where their tags are; the audio clip moved to Megatron-Bridge's place: right
        after the last ``</img>``, else right after the first token (the media then listed in text order)."""
        audio = [p for p in media if p.item.kind == "audio"]
        if not audio:
            return super().expand_text(text, spans, media)
        if len(audio) > 1:
            raise SampleError(f"{len(audio)} audio clips: Megatron-Bridge's Nemotron Omni path takes one per sample")
        token = self.rule.audio_token
        at = text.find(token)
        if at < 0 or text.find(token, at + 1) >= 0:
            raise SampleError("the chat template renders no single audio placeholder for the clip")
        text = text[:at] + text[at + len(token):]
        spans = [(s - len(token) if s > at else s, e - len(token) if e > at else e) for s, e in spans]
        visual = [p for p in media if p.item.kind != "audio"]
        text, spans, visual = super().expand_text(text, spans, visual)
        clip = audio[0]
        end = text.rfind(self.rule.image_end_token)
        where = end + len(self.rule.image_end_token) if end >= 0 else self._first_token_end(text)
        if any(s < where < e for s, e in spans):
            raise SampleError("Megatron-Bridge's place for the audio clip lies inside an assistant reply")
        expansion = clip.text
        if expansion is None:
            raise TypeError(f"{self.name}: the audio item has no expansion text")
        text = text[:where] + expansion + text[where:]
        clip = replace(clip, text=None, chars=(where, where + expansion.index(token), where + len(expansion)))
        spans = [(s + len(expansion), e + len(expansion)) if s >= where else (s, e) for s, e in spans]
        placed = sorted([*visual, clip], key=lambda p: p.chars[0] if p.chars else -1)
        return text, spans, placed

    def _first_token_end(self, text: str) -> int:
        """Characters of the text's first token."""
        head = self.run.tok.backend_tokenizer.encode(text[:256], add_special_tokens=False)
        return head.offsets[0][1] if head.ids else 0

    # -- the manifest and the runtime side ------------------------------------------------------------------------
    def manifest_entries(self) -> dict[str, Any]:
        out = super().manifest_entries()
        out["image_processor"] = {**out["image_processor"], "megatron_bridge": self.mbridge_entry()}
        return out

    def mbridge_entry(self) -> dict[str, Any]:
        """What the reader needs besides the Nemotron Omni settings: the canvas, the tubelet, the audio features."""
        return {"canvas": CANVAS, "patch_dim": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "video_fps": VIDEO_FPS,
                "max_audio_duration": AUDIO_SECONDS, "num_mel_bins": MEL_BINS, "audio_count": self.run.audio_count}

    def audio_input(self) -> tuple[int, int | None] | None:
        return AUDIO_RATE, int(AUDIO_SECONDS * AUDIO_RATE)


def audio_tokens(samples: int, count: str = "valid") -> int:
    """``<so_embedding>`` tokens of a clip of ``samples`` at 16 kHz: the feature length (valid: ``samples // hop``;
    frames: one more) halved three times, rounding up (at least one)."""
    length = samples // HOP + (1 if count == "frames" else 0)
    for _ in range(3):
        length = (length + 1) // 2
    return max(1, length)


def sampled_frames(total: int, fps: float) -> tuple[tuple[int, ...], float]:
    """The frames Megatron-Bridge's Nemotron Omni path takes of an encoded video of ``total`` frames at an average
    ``fps`` (``nemotron_vl_utils.sample_video_frames_to_data_urls`` at ``fps=int(video_fps)``), and the rate its
    labels use: ``int(duration · video_fps)`` frames (at least one) evenly spaced, rounded half to even, duplicates
    dropped (every frame when there are that few; the first for one); the rate ``(n - 1)`` over the span of their
    times (1.0 for a zero span; ``video_fps`` for one frame)."""
    import numpy as np

    wanted = max(1, int(total / max(1e-6, fps) * int(VIDEO_FPS)))
    if wanted >= total:
        indices = list(range(total))
    elif wanted == 1:
        indices = [0]
    else:
        indices = [int(i) for i in np.unique(np.round(np.linspace(0, total - 1, wanted)).astype(int))]
    if len(indices) == 1:
        return tuple(indices), VIDEO_FPS
    span = indices[-1] / fps - indices[0] / fps
    return tuple(indices), (len(indices) - 1) / span if span > 0 else 1.0


def decord_channels(width: int) -> int:
    """Channels decord 0.6 gives a decoded RGB frame ``width`` pixels wide (measured on every even width up to 398):
    as if its rows were padded to a multiple of 32 pixels and the padded row over the width, where that divides
    evenly, were the channel count (3 for every width of 96 and more, or a multiple of 32; 4 for 24, 48 and 72
    pixels, more for narrower ones)."""
    row = -(-width // 32) * 32 * 3
    return row // width if row != 3 * width and row % width == 0 else 3


NemotronOmni.register_variant(MB_NEMOTRON, MBridgeNemotronOmni)
