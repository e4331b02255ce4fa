"""Qwen3-VL's reader (:class:`Qwen3VLReader`): the Qwen-VL layout without ``second_per_grid_ts`` (its videos' times
are text in the tokens), images through transformers' Qwen2-VL image processor with the manifest's settings, videos
through Qwen3-VL's video processor. Its tensors are built in :mod:`.reader`, imported only when a pack is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.families.reading import FamilyReader
from packtool.mediapart import MediaPart

if TYPE_CHECKING:
    import torch

    from packtool.families.qwen3_vl.family import Qwen3VL
    from packtool.format import PackRecord


@dataclass(eq=False)
class Qwen3VLMedia(MediaPart):
    """Qwen3-VL's media: the Qwen-VL layout's without ``second_per_grid_ts`` (None: the batch has none of it)."""

    #: int64 ``[images, 3]``: each image's stored (t, h, w) patch grid.
    image_grid_thw: torch.Tensor | None = None
    #: float32 ``[Σ patches, C·t·p·p]``: the images' patch rows (only when the reader decodes media).
    pixel_values: torch.Tensor | None = None
    #: int64 ``[videos, 3]``: each video's (t, h, w) grid.
    video_grid_thw: torch.Tensor | None = None
    #: float32 ``[Σ patches, C·t·p·p]``: the videos' patch rows (only when the reader decodes media).
    pixel_values_videos: torch.Tensor | None = None


class Qwen3VLReader(FamilyReader):
    """Qwen3-VL's media fields (:func:`.reader.qwen3_vl_media`)."""

    family: Qwen3VL
    media_part = Qwen3VLMedia

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
