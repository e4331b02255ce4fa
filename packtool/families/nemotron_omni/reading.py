"""Nemotron Omni's readers: transformers' processors for its images, videos and audio (:class:`NemotronOmniReader`,
:mod:`.reader`), and under Megatron-Bridge's convention the tensors its collate builds from the manifest alone
(:class:`MBridgeNemotronOmniReader`, :mod:`.mbridge_reader`). The tensor code is imported only when a pack is
read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from packtool.families.nemotron_omni.mbridge import MB_NEMOTRON
from packtool.families.reading import FamilyReader

if TYPE_CHECKING:
    from packtool.families.nemotron_omni.family import NemotronOmni
    from packtool.families.nemotron_omni.mbridge import MBridgeNemotronOmni
    from packtool.format import PackRecord


class NemotronOmniReader(FamilyReader):
    """Images, videos and audio through transformers' ``nemotron_h_omni`` processors, configured as the model folder
    copy says with the manifest's settings on top."""

    family: NemotronOmni
    batch_keys: ClassVar[tuple[str, ...]] = ("media_kinds", "image_grid_hw", "video_grid_thw", "pixel_values",
                                             "pixel_values_videos", "input_features", "input_features_mask")
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
    batch_keys = (*NemotronOmniReader.batch_keys, "sound_length", "num_image_tiles")
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
