"""A family's reader: its own role beside the family's rules (:class:`FamilyReader`), built from the family a
manifest describes and registered in the family's :class:`~packtool.families.spec.FamilySpec` (``reader=``).

The family (:class:`~packtool.families.base.Family`) says how samples were encoded and what verify re-derives; its
reader says what a pack becomes in a reader batch: the processor the reader gives its media by default
(:meth:`FamilyReader.processor`), the batch's media fields (:attr:`~FamilyReader.batch_keys`,
:meth:`~FamilyReader.read_media`), the frames per video tubelet a trainer layout needs
(:attr:`~FamilyReader.temporal_patch_dim`) and whose trainer layouts its batches follow
(:meth:`~FamilyReader.batch_family`). The base reader is the shared Qwen-VL layout (images and videos as
transformers' Qwen2-VL processors lay them out, :func:`packtool.readkit.vision_media`); a family whose batches look
otherwise gives its own subclass in its home, and a convention that changes a family's batches registers a variant
of the family's reader under the convention's name (:meth:`FamilyReader.register_variant`), as it registers its
variant of the family.

This module and the reader classes load no torch: their methods import the family's reader code (which builds
tensors) only when a pack is read, so registering the families, as every build worker does, stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from packtool.families.conventions import add_variant, trainer_image
from packtool.mediapart import MediaPart

if TYPE_CHECKING:
    import torch

    from packtool.families.base import Family
    from packtool.format import PackRecord

__all__ = ["FamilyReader", "NoMediaReader", "VisionMedia"]


@dataclass(eq=False)
class VisionMedia(MediaPart):
    """The shared Qwen-VL layout's media, as transformers' Qwen2-VL processors lay it out (None: the batch has none
    of it)."""

    #: int64 ``[images, 3]``: each image's stored (t, h, w) patch grid.
    image_grid_thw: torch.Tensor | None = None
    #: float32 ``[Σ patches, C·t·p·p]``: the images' patch rows (only when the reader decodes media).
    pixel_values: torch.Tensor | None = None
    #: int64 ``[videos, 3]``: each video's (t, h, w) grid.
    video_grid_thw: torch.Tensor | None = None
    #: float32 ``[videos]``: seconds per temporal patch of each video (its positions' time step).
    second_per_grid_ts: torch.Tensor | None = None
    #: float32 ``[Σ patches, C·t·p·p]``: the videos' patch rows (only when the reader decodes media).
    pixel_values_videos: torch.Tensor | None = None


class FamilyReader:
    """The reader side of one family under one convention: built from the family a manifest describes
    (:func:`packtool.families.reader_of`), it turns a pack record's media into the reader batch's media fields."""

    #: The typed media part of the family's reader batches (``ReaderBatch.media``,
    #: :func:`packtool.runtime.read.pack_to_batch`); the base layout is Qwen2-VL's. :class:`MediaPart` itself (no
    #: fields): the family's packs carry no media, and a pack without media gets no media fields.
    media_part: ClassVar[type[MediaPart]] = VisionMedia
    #: The media part's field names: the batch's media keys (set from :attr:`media_part`, never by hand).
    batch_keys: ClassVar[tuple[str, ...]] = VisionMedia.field_names()
    #: Whether the reader's processors read the model folder copied into the output (settings the manifest does
    #: not record: normalisation, feature extraction); a loader then makes a local copy of a remote one first.
    reads_folder: ClassVar[bool] = False
    #: Readers of this reader's family under a convention that changes its batches (convention name -> class).
    variants: ClassVar[dict[str, type[FamilyReader]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.variants = {}  # each reader its own: a variant registered for one never serves another
        cls.batch_keys = cls.media_part.field_names()

    @classmethod
    def register_variant(cls, convention: str, variant: type[FamilyReader]) -> None:
        """Register ``variant`` (a subclass of this reader) as the family's reader under ``convention``; a
        convention registered twice for one reader is refused."""
        add_variant(cls, cls.variants, convention, variant)

    def __init__(self, family: Family) -> None:
        #: The family as the manifest describes it (its tokens, convention and rules).
        self.family = family

    @property
    def name(self) -> str:
        """The family's name (what an error names)."""
        return self.family.name

    def batch_family(self) -> str:
        """The registered family whose trainer layouts (Megatron-Bridge, NeMo-RL, Hugging Face) this reader's
        batches follow: its family's own name. The reader writes it into every batch (``family``), so a layout takes
        a batch's family from the batch itself, never from which keys it happens to hold."""
        return self.family.name

    def processor(self, folder: Path | None = None) -> Any:
        """The processor the reader gives the family's media by default (what ``image_processor=`` of the reader
        replaces), built from the manifest's settings (and ``folder``, the model folder copied into the output,
        for a reader that :attr:`reads_folder`); None when the manifest cannot name one (the caller passes the
        model's own processor)."""
        return None

    def video_entry(self) -> Mapping[str, Any] | None:
        """The manifest's ``video_processor`` entry the base layout builds the video processor from; None: the
        family's packs hold no videos the reader can process."""
        return None

    def read_videos(self, record: PackRecord, where: str, decode: bool) -> dict[str, Any]:
        """The base layout's video fields of a pack record (video_grid_thw, second_per_grid_ts, + with ``decode``
        pixel_values_videos) through the family's video processor; none: the family has no video processor."""
        return {}

    def images(self, images: list[Any]) -> list[Any]:
        """A pack's decoded images as the family's trainer hands them to the base layout's image processor: as the
        convention decodes them (:func:`~packtool.families.conventions.trainer_image`)."""
        return [trainer_image(image, self.family.convention) for image in images]

    def image_patch_dim(self, processor: Any) -> int | None:
        """The width of a patch row of ``processor``'s ``pixel_values`` where the family lays images out as patch
        rows (a pack without images then gets an empty ``[0, dim]`` tensor); None: it gets no ``pixel_values``."""
        return None

    def read_media(self, record: PackRecord, processor: Any, where: str, decode: bool) -> dict[str, Any]:
        """The reader batch's media fields of a pack record (:class:`packtool.format.PackRecord`, its spans already
        checked): the stored grids, and with ``decode`` the processor's tensors (``processor``: the caller's or
        :meth:`processor`'s)."""
        from packtool.readkit import vision_media  # torch: loaded only where it reads

        return vision_media(self, record, processor, where, decode)

    @property
    def temporal_patch_dim(self) -> int:
        """Frames per video tubelet (temporal patch) of the model."""
        return 2


class NoMediaReader(FamilyReader):
    """The reader of packs without a media rule: no media fields."""

    media_part = MediaPart
