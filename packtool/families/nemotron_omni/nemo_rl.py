"""Nemotron Omni under NeMo-RL's conventions (``--preset nemo-rl-nemotron-omni``): the family variant.

Images: one budget for all images and video frames of a sample, from the tokens its text leaves in a pack (the
pack size is the sequence length NeMo-RL budgets with), re-planned when the sample's text is known
(:meth:`expand_text`). Videos: the Megatron frame rule on Energon's duration and frame count, a fixed tile per frame,
``This is a video:`` and a label per tubelet. Audio: NeMo-RL's 30 s clips. Replies: the convention lays them out
(:class:`packtool.families.conventions.NemoRLNemotron`). The rules themselves: :mod:`packtool.families.nemo_rl_rules`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import ConfigError, FormatError, SampleError
from packtool.families.base import ItemPlan, NoRule
from packtool.families.conventions import NEMO_RL_NEMOTRON, Convention
from packtool.families.nemo_rl_rules import (
    BUDGET_RESERVE,
    Frame,
    energon_video_metadata,
    sample_image_grids,
    settings_audio_plan,
    video_frame_grid,
    video_prompt,
    video_timestamps,
)
from packtool.families.nemotron_omni.family import NemotronOmni, RunFacts
from packtool.format import MediaRef

if TYPE_CHECKING:
    from packtool.item import Staged
    from packtool.media import AudioFacts, VideoFacts
    from packtool.settings import EncodeSettings


#: The prompt format the ``nemo-rl-nemotron-omni`` preset renders (NeMo-RL's ``prompt_format``).
NEMO_RL_PROMPT_FORMAT = "nemotron6-moe"


def check_thinking_trace_format(manifest: Mapping, recipe_value: str) -> None:
    """Refuse a recipe's ``thinking_trace_format`` other than the one the packs' replies were rendered with
    (``--thinking-trace-format`` under ``--preset nemo-rl-nemotron-omni``; ``normalized`` unless recorded)."""
    settings = manifest.get("settings", {})
    if settings.get("preset") != NEMO_RL_NEMOTRON:
        raise FormatError(f"the recipe sets thinking_trace_format {recipe_value!r}, but the packs were made without "
                          f"--preset {NEMO_RL_NEMOTRON}, which renders the traces")
    packed = settings.get("thinking_trace_format", "normalized")
    if recipe_value != packed:
        raise FormatError(f"the recipe sets thinking_trace_format {recipe_value!r}, the packs were made with "
                          f"{packed!r}: pack again with --thinking-trace-format {recipe_value}")


class NemoRLNemotronOmni(NemotronOmni):
    """Nemotron Omni's media as NeMo-RL's ``nemotron_multimodal`` encoder lays them out."""

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> NemotronOmni:
        if settings.audio_max_seconds is not None:
            raise ConfigError(f"--preset {NEMO_RL_NEMOTRON} cuts audio into 30 s clips; --audio-max-seconds does not "
                              f"apply")
        return super().load(settings, tok, convention)

    @classmethod
    def run_facts(cls, settings: EncodeSettings, tok: Any) -> RunFacts:
        """The tokenizer (its encoder measures each sample's text) and the pack size (its frame budget)."""
        return RunFacts(tok=tok, pack_size=settings.pack_size)

    @classmethod
    def recorded_facts(cls, manifest: Mapping) -> RunFacts:
        return RunFacts(pack_size=int((manifest.get("settings") or {}).get("pack_size", 0)))

    def video_facts(self, data: list[bytes], framed: bool, facts: VideoFacts, part: str) -> VideoFacts:
        """Duration and frame count as Energon reads them (NeMo-RL's cooker gives its encoder those)."""
        if framed:
            raise NoRule(f"media {part!r}: a video given as a list of frames is not a video NeMo-RL's "
                         f"{NEMO_RL_NEMOTRON} encoder decodes (it takes encoded videos)")
        try:
            duration, frames = energon_video_metadata(data[0])
        except ValueError as exc:
            raise SampleError(f"media {part!r}: {exc}") from None
        return replace(facts, duration=duration, frames=frames)

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        """Grid: the frames taken, then the tile in patches; the tokens: one tile per tubelet."""
        r = self.rule
        try:
            if facts.duration is None:
                raise ValueError("video has no duration")
            seconds = video_timestamps(facts.duration, facts.frames, temporal_patch=r.video_temporal_patch_dim)
            gh, gw = video_frame_grid(facts.width, facts.height, r)
        except ValueError as exc:
            raise SampleError(f"media {part!r}: {exc}") from None
        per = gh * gw // round(1 / r.downsample_ratio) ** 2
        chunk = r.image_start_token + r.image_token * per + r.image_end_token
        step = r.video_temporal_patch_dim
        return ItemPlan(per * (len(seconds) // step), (len(seconds), gh, gw),
                        text=video_prompt(seconds, chunk, step))

    def plan_audio(self, facts: AudioFacts, part: str) -> ItemPlan:
        self.refuse_audio(facts, part)
        try:
            plan = settings_audio_plan(facts.samples, facts.sample_rate, self.rule)
        except ValueError as exc:
            raise SampleError(f"media {part!r}: {exc}") from None
        r = self.rule
        return ItemPlan(plan.tokens, samples=plan.samples,
                        text=r.audio_start_token + r.audio_token * plan.tokens + r.audio_end_token)

    def expand_text(self, text: str, spans: list[tuple[int, int]],
                    media: list[Staged]) -> tuple[str, list[tuple[int, int]], list[Staged]]:
        return super().expand_text(text, spans, self._plan_images(text, media))

    def _plan_images(self, text: str, media: list[Staged]) -> list[Staged]:
        """The sample's items with its images re-planned as NeMo-RL does (grid, tokens, expansion text): one budget
        for all of them and the video frames from the tokens the text leaves in a pack, the text counted with each
        image and each video tubelet as ``<img><image></img>`` and each audio item expanded."""
        if not any(p.item.kind == "image" for p in media):
            return media
        r = self.rule
        compact_chunk = r.image_start_token + r.image_token + r.image_end_token
        compact = text.replace(r.image_token, compact_chunk)
        for p in media:  # the first <video> left is this video's (<image> runs of the expansion are not in `text`)
            m = p.item
            if m.kind == "video":
                per = m.tokens // (m.grid_thw[0] // r.video_temporal_patch_dim)
                chunk = r.image_start_token + r.image_token * per + r.image_end_token
                compact = compact.replace(r.video_token, (p.text or "").replace(chunk, compact_chunk), 1)
        items = [p.item for p in media]
        length = len(self.run.tok.backend_tokenizer.encode(compact, add_special_tokens=False).ids)
        # an audio item's one placeholder becomes <so_start>, its tokens, <so_end> (all special tokens)
        length += sum(m.tokens + 1 for m in items if m.kind == "audio")
        merge = round(1 / r.downsample_ratio)
        frames = [f for m in items if m.kind != "audio"
                  for f in ([Frame(m.width, m.height)] if m.kind == "image"
                            else [Frame(m.width, m.height, True)] * m.grid_thw[0])]
        grids = iter(sample_image_grids(
            frames, self.run.pack_size - length - BUDGET_RESERVE,
            patch=r.patch_size, merge=merge, min_patches=r.min_num_patches, max_patches=r.max_num_patches,
            video_target_patches=r.video_target_num_patches, video_keep_aspect=r.video_maintain_aspect_ratio,
            temporal_patch=r.video_temporal_patch_dim))
        out = []
        for p in media:
            if p.item.kind == "video":
                for _ in range(p.item.grid_thw[0]):
                    next(grids)  # a frame keeps its tile
            elif p.item.kind == "image":
                gh, gw = next(grids)
                tokens = gh * gw // merge**2
                p = replace(p, item=replace(p.item, grid_thw=(1, gh, gw), tokens=tokens),
                            text=r.image_start_token + r.image_token * tokens + r.image_end_token)
            out.append(p)
        return out


    # -- verify ---------------------------------------------------------------------------------------------------
    plans_sample_images = True

    def audio_input(self) -> tuple[int, int | None] | None:
        """None: NeMo-RL's clips are counted from the decoded waveform (:meth:`plan_audio`)."""
        return None

    def segment_image_grids(self, tokens: np.ndarray, media: list[MediaRef]) -> list[list[int]] | None:
        """The grids NeMo-RL's budget gives an untruncated segment's images: its text counted with each image, and
        each video tubelet, as ``<img><image></img>`` (its tokens less each item's placeholders but those; audio
        stays expanded, as NeMo-RL counts it), a video's frames in the budget too."""
        r = self.rule
        visual = [m for m in media if m.kind in ("image", "video")]
        compact = len(tokens) - sum(m.tokens - (1 if m.kind == "image" else m.grid_thw[0] // r.video_temporal_patch_dim)
                                    for m in visual)
        frames = [f for m in visual for f in ([Frame(m.width, m.height)] if m.kind == "image"
                                              else [Frame(m.width, m.height, True)] * m.grid_thw[0])]
        grids = sample_image_grids(
            frames, self.run.pack_size - compact - BUDGET_RESERVE, patch=r.patch_size,
            merge=round(1 / r.downsample_ratio), min_patches=r.min_num_patches, max_patches=r.max_num_patches,
            video_target_patches=r.video_target_num_patches, video_keep_aspect=r.video_maintain_aspect_ratio,
            temporal_patch=r.video_temporal_patch_dim)
        out, position = [], 0
        for m in visual:
            if m.kind == "image":
                out.append([1, *grids[position]])
            position += 1 if m.kind == "image" else m.grid_thw[0]
        return out

    def video_problems(self, where: str, ref: MediaRef, data: bytes) -> list[str] | None:
        """Energon's duration and frame count as recorded, the frames the Megatron rule takes from them, the tile,
        and one tile of tokens per tubelet."""
        r = self.rule
        try:
            duration, frames = energon_video_metadata(data)
            seconds = video_timestamps(duration, frames, temporal_patch=r.video_temporal_patch_dim)
            gh, gw = video_frame_grid(ref.width, ref.height, r)
        except ValueError as exc:
            return [f"{where}: {exc}"]
        if (duration, frames) != (ref.duration, ref.total_frames):
            return [f"{where}: Energon reads {duration} s and {frames} frames, recorded {ref.duration} s and "
                    f"{ref.total_frames} frames"]
        grid = [len(seconds), gh, gw]
        tokens = len(seconds) // r.video_temporal_patch_dim * gh * gw // round(1 / r.downsample_ratio) ** 2
        if (grid, tokens) != (list(ref.grid_thw), ref.tokens):
            return [f"{where}: NeMo-RL's video rule gives grid {grid} and {tokens} tokens, recorded "
                    f"{list(ref.grid_thw)} and {ref.tokens}"]
        return []


NemotronOmni.register_variant(NEMO_RL_NEMOTRON, NemoRLNemotronOmni)
