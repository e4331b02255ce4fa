"""A model family's one registration: :class:`FamilySpec` (its name, its rule class — detection, loading from a
model folder and from a manifest, the encode and verify rules —, its trainer layouts and its reader class), and
the registry that holds each name once (:func:`register`).

The trainer layouts (:class:`TrainerLayouts`) are where a family's packs meet each trainer's batch: functions, each
importing its reader module only when a batch is laid out (a layout builds torch tensors, and registering a family,
which the build side does in every worker, must not load torch; the import test sees these imports like any
other). A trainer's layout a family does not give is either the shared one (the base Qwen-VL ``visual_inputs`` for
Megatron-Bridge, the reader's media fields for NeMo-RL) or a refusal with its reason. Adding a trainer adds a field
here, never a method to :class:`~packtool.families.base.Family` or its reader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packtool.families.reading import FamilyReader

if TYPE_CHECKING:
    from packtool.families.base import Family

#: A trainer layout: a function of the batch (or the pack record) and what the layout's field says it takes.
Layout = Callable[..., Any]


def bridge_vision(batch: Mapping, temporal_patch_dim: int = 2) -> dict:
    """Megatron-Bridge's shared layout: the base Qwen-VL ``visual_inputs``
    (:func:`packtool.readkit.vision_fields`)."""
    from packtool.readkit import vision_fields

    return vision_fields(batch, temporal_patch_dim)


def hf_text(row: Mapping, context: Mapping, tokens_per_second: int | None) -> Any:
    """The Hugging Face layout of text-only packs: the reader's per-segment positions
    (:func:`packtool.readkit.text_positions`)."""
    from packtool.readkit import text_positions

    return text_positions(row, context, tokens_per_second)


#: The media keys of Qwen-VL models' forward.
QWEN_VL_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class TrainerLayouts:
    """How one family's reader batches and pack records become each trainer's batch (each a :data:`Layout`)."""

    #: Megatron-Bridge's step batch: ``(batch, temporal_patch_dim) -> media fields``
    #: (:func:`packtool.runtime.megatron_batch.megatron_bridge_batch`).
    megatron_bridge: Layout = bridge_vision
    #: Why the family's packs get no Megatron-Bridge batch (None: they do).
    megatron_bridge_refused: str | None = None
    #: NeMo-RL's packed batch media: ``(reader, record, processor, where) -> media key -> one tensor per item``
    #: (``reader``: the family's :class:`~packtool.families.reading.FamilyReader` of the manifest); None: the
    #: reader's media fields, one tensor per pack.
    nemo_rl_media: Layout | None = None
    #: Pixels per patch side of the images in NeMo-RL's batch (its patchify mode): ``(reader) -> int``; None: not
    #: patchified.
    nemo_rl_patch_dim: Layout | None = None
    #: Checks a NeMo-RL recipe's model-processor options against the packs:
    #: ``(manifest, given, fields, processors) -> None``; None: any such option is refused (the packs were made for
    #: a model folder those options do not describe).
    nemo_rl_recipe: Layout | None = None
    #: Checks a NeMo-RL recipe's ``thinking_trace_format`` against the packs' replies: ``(manifest, value) -> None``;
    #: None: the family's packs render no thinking traces, and the option is refused.
    nemo_rl_prompt: Layout | None = None
    #: The NeMo-RL ``prompt_format`` values the family's packs are laid out in (a recipe's other value is refused).
    nemo_rl_prompt_formats: tuple[str, ...] = ()
    #: Whether NeMo-RL's batch carries ``mm_token_type_ids`` (its Qwen2-VL processor's).
    nemo_rl_token_types: bool = False
    #: The Hugging Face packed row's ``position_ids``: ``(row, context, tokens_per_second) -> tensor``
    #: (:func:`packtool.runtime.hf.hf_batch`; ``context``: the batch's :func:`packtool.readkit.layout_context`); None:
    #: the family's packs get no Hugging Face row (refused in one line).
    hugging_face: Layout | None = None
    #: transformers ``model_type`` values of the models this family's packs are made for (``check_model`` and the
    #: pairing check match a model by them); none: text-only models (any without a vision or audio tower).
    hugging_face_model_types: tuple[str, ...] = ()
    #: The media keys the Hugging Face model takes (those of media a row has are passed on, with
    #: ``mm_token_type_ids``); none: a text model.
    hugging_face_media_keys: tuple[str, ...] = ()

    def function(self, trainer: str) -> Layout | None:
        """The layout a field holds (None where the field is None)."""
        layout = getattr(self, trainer)
        if layout is not None and not callable(layout):
            raise TypeError(f"trainer layout {trainer!r} is {layout!r}, not a function")
        return layout


@dataclass(frozen=True)
class FamilySpec:
    """One model family, registered once: its ``name`` (what manifests, reader batches and ``--preset`` conventions
    call it), its rule class ``family`` (``detect``, ``load``, ``owns``, ``from_manifest``, the media rules), its
    :class:`TrainerLayouts` and its ``reader`` (:class:`~packtool.families.reading.FamilyReader`: the reader's
    processors and media tensors, built from the family a manifest describes)."""

    name: str
    family: type[Family]
    layouts: TrainerLayouts = TrainerLayouts()
    reader: type[FamilyReader] = FamilyReader

    def __post_init__(self) -> None:
        if self.family.name != self.name:
            raise ValueError(f"family spec {self.name!r} names the class {self.family.__name__}, which is called "
                             f"{self.family.name!r}")
        if not (isinstance(self.reader, type) and issubclass(self.reader, FamilyReader)):
            raise TypeError(f"family spec {self.name!r}: its reader {self.reader!r} is not a FamilyReader class")


#: Every registered family by name, in detection order (the first whose ``detect`` takes a folder wins).
REGISTRY: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family; a name registered twice is refused."""
    if spec.name in REGISTRY:
        raise ValueError(f"a family called {spec.name!r} is already registered ({REGISTRY[spec.name].family.__name__})")
    REGISTRY[spec.name] = spec
    return spec


def spec_named(name: str) -> FamilySpec:
    """The registered family called ``name``; ``ValueError`` for a name no family has."""
    if name not in REGISTRY:
        raise ValueError(f"no family is called {name!r} (families: {', '.join(REGISTRY)})")
    return REGISTRY[name]
