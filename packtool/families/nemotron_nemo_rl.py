"""Nemotron Omni under NeMo-RL's conventions (``--preset nemo-rl-nemotron-omni``): the family variant.

Images: one budget for all images of a sample, from the tokens its text leaves in a pack (the pack size is the
sequence length NeMo-RL budgets with), re-planned when the sample's text is known (:meth:`expand_text`). Audio:
NeMo-RL's 30 s clips. Replies: the convention lays them out (:class:`packtool.families.conventions.NemoRLNemotron`).
Videos are not supported under this convention yet. The rules themselves: :mod:`packtool.families.nemo_rl_rules`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import ConfigError, SampleError
from packtool.families.base import ItemPlan, NoRule
from packtool.families.conventions import NEMO_RL_NEMOTRON, Convention
from packtool.families.nemo_rl_rules import BUDGET_RESERVE, Frame, sample_image_grids, settings_audio_plan
from packtool.families.nemotron_omni import NemotronOmni

if TYPE_CHECKING:
    from packtool.media import AudioFacts, VideoFacts
    from packtool.settings import EncodeSettings


class NemoRLNemotronOmni(NemotronOmni):
    """Nemotron Omni's media as NeMo-RL's ``nemotron_multimodal`` encoder lays them out."""

    tok: Any = None
    pack_size: int = 0

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> NemotronOmni:
        if settings.audio_max_seconds is not None:
            raise ConfigError(f"--preset {NEMO_RL_NEMOTRON} cuts audio into 30 s clips; --audio-max-seconds does not "
                              f"apply")
        family = super().load(settings, tok, convention)
        assert isinstance(family, NemoRLNemotronOmni)
        family.tok, family.pack_size = tok, settings.pack_size
        return family

    @classmethod
    def from_manifest(cls, manifest: Mapping) -> NemotronOmni:
        family = super().from_manifest(manifest)
        assert isinstance(family, NemoRLNemotronOmni)
        family.pack_size = int((manifest.get("settings") or {}).get("pack_size", 0))
        return family

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        raise NoRule(f"media {part!r}: video under --preset {NEMO_RL_NEMOTRON} is not supported yet (images and "
                     f"audio only)")

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
                    media: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        self._plan_images(text, media)
        return super().expand_text(text, spans, media)

    def _plan_images(self, text: str, media: list[dict]) -> None:
        """Re-plan the sample's images as NeMo-RL does (in place: grid, tokens, expansion text): one budget for all
        of them from the tokens the text leaves in a pack, the text counted with each image as
        ``<img><image></img>`` and each audio item expanded."""
        images = [m for m in media if m["kind"] == "image"]
        if not images:
            return
        r = self.rule
        compact = text.replace(r.image_token, r.image_start_token + r.image_token + r.image_end_token)
        length = len(self.tok.backend_tokenizer.encode(compact, add_special_tokens=False).ids)
        # an audio item's one placeholder becomes <so_start>, its tokens, <so_end> (all special tokens)
        length += sum(m["tokens"] + 1 for m in media if m["kind"] == "audio")
        merge = round(1 / r.downsample_ratio)
        grids = sample_image_grids(
            [Frame(m["width"], m["height"]) for m in images], self.pack_size - length - BUDGET_RESERVE,
            patch=r.patch_size, merge=merge, min_patches=r.min_num_patches, max_patches=r.max_num_patches,
            video_target_patches=r.video_target_num_patches, video_keep_aspect=r.video_maintain_aspect_ratio,
            temporal_patch=r.video_temporal_patch_dim)
        for m, (gh, gw) in zip(images, grids):
            m["grid_thw"], m["tokens"] = [1, gh, gw], gh * gw // merge**2
            m["text"] = r.image_start_token + r.image_token * m["tokens"] + r.image_end_token


    # -- verify ---------------------------------------------------------------------------------------------------
    plans_sample_images = True

    def audio_input(self) -> tuple[int, int | None] | None:
        """None: NeMo-RL's clips are counted from the decoded waveform (:meth:`plan_audio`)."""
        return None

    def segment_image_grids(self, tokens: np.ndarray, media: list[Any]) -> list[list[int]] | None:
        """The grids NeMo-RL's budget gives an untruncated segment's images: its text counted with each image as
        ``<img><image></img>`` (its tokens less each image's placeholders but one; audio stays expanded, as
        NeMo-RL counts it)."""
        r = self.rule
        images = [m for m in media if m.kind == "image"]
        compact = len(tokens) - sum(m.tokens - 1 for m in images)
        grids = sample_image_grids(
            [Frame(m.width, m.height) for m in images], self.pack_size - compact - BUDGET_RESERVE,
            patch=r.patch_size, merge=round(1 / r.downsample_ratio), min_patches=r.min_num_patches,
            max_patches=r.max_num_patches, video_target_patches=r.video_target_num_patches,
            video_keep_aspect=r.video_maintain_aspect_ratio, temporal_patch=r.video_temporal_patch_dim)
        return [[1, gh, gw] for gh, gw in grids]


NemotronOmni.variants = {**NemotronOmni.variants, NEMO_RL_NEMOTRON: NemoRLNemotronOmni}
