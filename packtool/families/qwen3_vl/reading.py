"""Qwen3-VL's reader (:class:`Qwen3VLReader`): the Qwen-VL layout without ``second_per_grid_ts`` (its videos' times
are text in the tokens), images through transformers' Qwen2-VL image processor with the manifest's settings, videos
through Qwen3-VL's video processor. Its tensors are built in :mod:`.reader`, imported only when a pack is read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.families.reading import FamilyReader

if TYPE_CHECKING:
    from packtool.families.qwen3_vl.family import Qwen3VL
    from packtool.format import PackRecord


class Qwen3VLReader(FamilyReader):
    """Qwen3-VL's media fields (:func:`.reader.qwen3_vl_media`)."""

    family: Qwen3VL
    batch_keys = ("image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos")

    def image_patch_dim(self, processor: Any) -> int | None:
        """Qwen3-VL's patch rows, as Qwen2-VL's: ``[patches, C·t·p·p]``."""
        return 3 * processor.temporal_patch_size * processor.patch_size ** 2

    def processor(self, folder: Path | None = None) -> Any:
        """transformers' Qwen2-VL image processor (PIL backend) with the manifest's image settings (Qwen3-VL's)."""
        from packtool.families.qwen2_vl.reader import qwen_image_processor

        return qwen_image_processor(self.family.image.manifest())

    def read_media(self, record: PackRecord, processor: Any, where: str, decode: bool) -> dict[str, Any]:
        from packtool.families.qwen3_vl.reader import qwen3_vl_media

        return qwen3_vl_media(self, record, processor, where, decode)

    @property
    def temporal_patch_dim(self) -> int:
        family = self.family
        return family.video.temporal_patch_size if family.video is not None else family.image.temporal_patch_size
