"""A fixed token count per image (``--image-tokens N``, e.g. 576 for LLaVA-1.5): any model whose image takes the
same number of placeholder tokens whatever its size. Images only; each placeholder token repeated in the ids.

This module is the whole family: its registry line is in :mod:`packtool.families`, its tests in
``tests/test_families.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.families.base import Family, ItemPlan, MediaTokens, manifest_tokens
from packtool.families.conventions import Convention
from packtool.families.qwen2_vl.family import ImageRule

if TYPE_CHECKING:
    from packtool.settings import EncodeSettings


class FixedCount(Family):
    """Every image costs ``count`` tokens; its grid is recorded as ``[1, 1, 1]``."""

    name = "fixed"
    kinds = ("image",)

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str, count: int) -> None:
        super().__init__(tokens, convention, folder)
        self.count = count

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        return settings.image_tokens is not None

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> FixedCount:
        assert settings.image_tokens is not None  # detect() saw it
        return cls(MediaTokens.from_vocab(tok.get_vocab()), convention, str(settings.tokenizer),
                   int(settings.image_tokens))

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        entry = manifest.get("image_processor")
        return isinstance(entry, Mapping) and entry.get("type") == "fixed" and "family" not in entry

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> FixedCount:
        return cls(manifest_tokens(manifest), convention, "",
                   ImageRule.from_manifest(manifest["image_processor"]).fixed_tokens)

    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        return ItemPlan(self.count, (1, 1, 1))

    def manifest_entries(self) -> dict[str, Any]:
        """The image processor entry keeps the layout of the image rule it was first written with (its pixel and
        patch fields are unused)."""
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id,
                "image_processor": ImageRule(type="fixed", fixed_tokens=self.count).manifest(),
                "video_token_id": None, "video_processor": None, "audio_token_id": None,
                "audio_start_token_id": None, "audio_end_token_id": None}
