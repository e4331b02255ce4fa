"""Qwen2-VL's reader (:class:`Qwen2VLReader`): transformers' Qwen2-VL image processor with the manifest's image
settings, its video processor for the pack's videos, and the images resized first where the settings say so. Its
tensors are built in :mod:`.reader`, imported only when a pack is read."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.families.reading import FamilyReader

if TYPE_CHECKING:
    from packtool.families.qwen2_vl.family import Qwen2VL
    from packtool.format import PackRecord


class Qwen2VLReader(FamilyReader):
    """The base Qwen-VL layout (:func:`packtool.readkit.vision_media`) under Qwen2-VL's image and video settings."""

    family: Qwen2VL

    def processor(self, folder: Path | None = None) -> Any:
        """transformers' Qwen2-VL image processor (PIL backend) with the manifest's image settings."""
        from packtool.families.qwen2_vl.reader import qwen_image_processor

        return qwen_image_processor(self.family.image.manifest())

    def images(self, images: list[Any]) -> list[Any]:
        """As the convention decodes them, then resized first where the image settings say so (``prefit_*``:
        Megatron-Bridge's Qwen-VL path, :func:`.reader.prefit_image`)."""
        pil = super().images(images)
        if not self.family.image.prefit_factor:
            return pil
        from packtool.families.qwen2_vl.reader import prefit_image

        entry = self.family.image.manifest()
        return [prefit_image(image, entry) for image in pil]

    def image_patch_dim(self, processor: Any) -> int | None:
        """Qwen2-VL's patch rows: ``[patches, C·t·p·p]``."""
        return 3 * processor.temporal_patch_size * processor.patch_size ** 2

    def video_entry(self) -> Mapping[str, Any] | None:
        return self.family.manifest_entries()["video_processor"]

    def read_videos(self, record: PackRecord, where: str, decode: bool) -> dict[str, Any]:
        """video_grid_thw and second_per_grid_ts (+ pixel_values_videos) through transformers' Qwen2-VL video
        processor (:func:`.reader.video_media`); none without video settings."""
        video = self.video_entry()
        if not video:
            return {}
        from packtool.families.qwen2_vl.reader import video_media

        return video_media(record, video, where, decode)

    @property
    def temporal_patch_dim(self) -> int:
        family = self.family
        return family.video.video_temporal_patch_size if family.video is not None else family.image.temporal_patch_size
