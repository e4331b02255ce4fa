"""Nemotron Omni's readers: transformers' processors for its images, videos and audio (:class:`NemotronOmniReader`,
:mod:`.reader`), and under Megatron-Bridge's convention the tensors its collate builds from the manifest alone
(:class:`MBridgeNemotronOmniReader`, :mod:`.mbridge_reader`). The tensor code is imported only when a pack is
read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.families.nemotron_omni.mbridge import MB_NEMOTRON
from packtool.families.reading import FamilyReader
from packtool.mediapart import MediaPart

if TYPE_CHECKING:
    import torch

    from packtool.families.nemotron_omni.family import NemotronOmni
    from packtool.families.nemotron_omni.mbridge import MBridgeNemotronOmni
    from packtool.format import PackRecord


@dataclass(eq=False)
class NemotronOmniMedia(MediaPart):
    """Nemotron Omni's media as transformers' processors give it (None: the batch has none of it)."""

    #: Each media item's kind ("image", "video", "audio"), in placeholder order.
    media_kinds: list[str] | None = None
    #: int64 ``[images, 2]``: each image's stored (h, w) patch grid.
    image_grid_hw: torch.Tensor | None = None
    #: int64 ``[videos, 3]``: each video's (t, h, w) grid.
    video_grid_thw: torch.Tensor | None = None
    #: The images' patch rows (only when the reader decodes media).
    pixel_values: torch.Tensor | None = None
    #: The videos' patch rows (only when the reader decodes media).
    pixel_values_videos: torch.Tensor | None = None
    #: float32 ``[clips, frames, mel bins]``: each audio clip's features, padded to the longest clip.
    input_features: torch.Tensor | None = None
    #: bool ``[clips, frames]``: which feature frames are the clip's.
    input_features_mask: torch.Tensor | None = None


@dataclass(eq=False)
class MBridgeNemotronOmniMedia(NemotronOmniMedia):
    """Nemotron Omni's media as Megatron-Bridge's collate builds it: transformers' entries and two of its own."""

    #: int64 ``[clips]``: each clip's length in feature frames, counted as the convention's audio rule counts.
    sound_length: torch.Tensor | None = None
    #: int32 ``[tiles]``: one entry per image and per video tubelet (the collate's tile counts).
    num_image_tiles: torch.Tensor | None = None


class NemotronOmniReader(FamilyReader):
    """Images, videos and audio through transformers' ``nemotron_h_omni`` processors, configured as the model folder
    copy says with the manifest's settings on top."""

    family: NemotronOmni
    media_part = NemotronOmniMedia
    reads_folder = True

    def processor(self, folder: Path | None = None) -> Any:
        """transformers' image and video processors and feature extractor, configured as the model folder copy says
        with the manifest's settings on top (None without a folder)."""
        from packtool.families.nemotron_omni.reader import nemotron_processors

        return None if folder is None else nemotron_processors({"image_processor": self.family.rule.manifest()},
                                                               folder)

    def read_media(self, record: PackRecord, processor: Any, where: str, decode: bool) -> dict[str, Any]:
        from packtool.families.nemotron_omni.reader import nemotron_media

        return nemotron_media(record, processor, where, decode)

    @property
    def temporal_patch_dim(self) -> int:
        return self.family.rule.video_temporal_patch_dim


class MBridgeNemotronOmniReader(NemotronOmniReader):
    """Megatron-Bridge's Nemotron Omni collate's tensors, from the manifest alone (:mod:`.mbridge_reader`)."""

    family: MBridgeNemotronOmni
    media_part = MBridgeNemotronOmniMedia
    reads_folder = False
    #: Why NeMo-RL's batch refuses these packs (:func:`.nemo_rl_batch.family_inputs` reads it).
    nemo_rl_refused = f"packs of --preset {MB_NEMOTRON} are laid out for Megatron-Bridge, not NeMo-RL"

    def processor(self, folder: Path | None = None) -> Any:
        """None: the reader's tensors follow from the manifest alone (:mod:`.mbridge_reader`)."""
        return None

    def read_media(self, record: PackRecord, processor: Any, where: str, decode: bool) -> dict[str, Any]:
        from packtool.families.nemotron_omni.mbridge_reader import mbridge_media

        return mbridge_media(record, self.family.mbridge_entry(), where, decode)


NemotronOmniReader.register_variant(MB_NEMOTRON, MBridgeNemotronOmniReader)
