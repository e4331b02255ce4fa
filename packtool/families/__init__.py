"""Model families behind one interface (:class:`~packtool.families.base.Family`), and their registry.

A family knows, for one kind of model folder: how to detect it (:meth:`Family.detect`), its settings from the
folder plus the overrides (:meth:`Family.load`), the token plan of each media item from the item's facts
(``plan_image``, ``plan_video``, ``plan_audio``), where its placeholders expand (``expand_in``: in the ids, in the
text, or by the processor; ``placeholder_text``, ``expand_text``, ``place``), its manifest entries
(``manifest_entries``) and how to read them back (``owns``, ``from_manifest``), the placeholder ids verify and the
reader check spans with (``placeholder_ids``), what verify re-derives (``check_image``, ``check_video``,
``check_audio``, ``image_counts``, ``expanded_in_text``). What a pack becomes in a reader batch is no method of
the family but its reader (:class:`~.reading.FamilyReader`, registered beside it: the processor, the media fields
and tensors, the frames per tubelet; :func:`reader_of` builds it from a manifest), and where its packs meet each
trainer's batch (Megatron-Bridge's step fields, NeMo-RL's media, patch size and recipe options, Hugging Face's
rope) is its registration's :class:`~.spec.TrainerLayouts`, found for a reader batch by the family the batch names
(:func:`of_batch`). The encoder, verify, the reader and the loaders ask the family, its reader and its layouts;
they hold no family branches of their own.

Families: :class:`~.qwen2_vl.Qwen2VL`, :class:`~.qwen3_vl.Qwen3VL`, :class:`~.nemotron_omni.NemotronOmni`,
:class:`~.fixed.FixedCount` (``image_tokens``), :class:`~.base.NoMedia` (no media rule), and
:class:`~.processor.ProcessorMode` (the folder's own processor expands the placeholders), which wraps the folder's
family when packtool has one.

Adding a family: one module (or a home package holding its rule, family and reader code, as :mod:`.qwen2_vl`,
:mod:`.qwen3_vl` and :mod:`.nemotron_omni` do) with a :class:`Family` subclass (``detect``, ``load``, ``owns``,
``from_manifest``, ``manifest_entries``, and the ``plan_*`` of the kinds it takes; a family that expands in the text
subclasses :class:`~.base.ExpandsInText` and gives ``placeholders``), its reader where its batches differ from the
shared Qwen-VL layout (a :class:`~.reading.FamilyReader` subclass in a ``reading`` module of its home: ``processor``,
``read_media``, ``batch_keys``; its tensor code imported only when a pack is read), its trainer layouts where they
differ from the shared ones (:class:`~.spec.TrainerLayouts`), one registry line below
(``register(FamilySpec(name, cls, layouts, reader))``,
in detection order: first match wins; a name registered twice is refused), and its tests (``tests/test_families.py``
shows it for :mod:`.fixed`). Media items are frozen (:class:`packtool.item.MediaItem`; while a sample is
encoded, a :class:`~packtool.item.Staged` with what only encoding needs): ``expand_text`` and ``place``
return new ones (``dataclasses.replace``), never change them.

Adding a convention (the same family under another trainer's data path, :mod:`.conventions`):

1. Register a :class:`~.conventions.Convention` value (:func:`~.conventions.register_convention`; a name registered
   twice is refused) under its ``--preset`` name (``--preset`` takes its names from the registry). Settings only it
   takes are its ``options``; a run records the resolved convention in its manifest, and readers take it from there.
   Its fields are the choices every family shares: which tokens are targets (``target_newline_after_eot``; override
   :meth:`Convention.mark_targets` for other rules), the layout of a turn around its media (``media_first``;
   :meth:`Convention.turn_text`), the image resize rule's pixel bounds (``min_pixels``, ``max_pixels``). The preset
   fills the matching encode settings.
2. Where it changes one family's media, subclass that family and override: ``plan_image`` (the image resize
   rule), ``video_facts`` (the video facts a trainer reads, e.g. Energon's duration), ``plan_video`` (frame sampling,
   frame labels and canvas), ``plan_audio`` (audio counts),
   ``placeholder_text`` / ``expand_text`` (headers and joins around media), ``manifest_entries`` /
   ``from_manifest`` (what a reader needs to reproduce its pixels), and register the subclass in the family's
   variants under the convention's name: ``NemotronOmni.register_variant("my-convention", MyNemotronOmni)``
   (each family holds its own variants; a name registered twice is refused).
   :func:`load` builds the variant when the settings name that convention. A convention for one family can keep
   both in one module that registers them (:func:`~.conventions.register_convention`, imported here), as
   :mod:`.nemotron_omni.mbridge` does.
3. Where it changes the family's reader batches, subclass the family's reader the same way and register it under
   the convention's name: ``NemotronOmniReader.register_variant("my-convention", MyReader)``
   (:func:`reader_for` builds it for a manifest of that convention), as :mod:`.nemotron_omni.reading` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.errors import ConfigError
from packtool.families.base import Family, ItemPlan, MediaTokens, NoMedia, NoRule
from packtool.families.conventions import CONVENTIONS, TRANSFORMERS, Convention, from_record
from packtool.families.fixed import FixedCount
from packtool.families.nemotron_omni import (  # registers its variants
    NEMOTRON_OMNI_LAYOUTS,
    NemotronOmni,
    NemotronOmniReader,
)
from packtool.families.processor import ProcessorMode, ProcessorReader
from packtool.families.qwen2_vl import QWEN2_VL_LAYOUTS, Qwen2VL, Qwen2VLReader
from packtool.families.qwen3_vl import QWEN3_VL_LAYOUTS, Qwen3VL, Qwen3VLReader
from packtool.families.reading import FamilyReader, NoMediaReader
from packtool.families.spec import REGISTRY, FamilySpec, TrainerLayouts, hf_text, register, spec_named
from packtool.format import BATCH_FAMILY

if TYPE_CHECKING:
    from packtool.settings import EncodeSettings

__all__ = ["CONVENTIONS", "FAMILIES", "PROCESSOR_MODE", "REGISTRY", "TRANSFORMERS", "Convention", "Family",
           "FamilyReader", "FamilySpec", "ItemPlan", "MediaTokens", "NoRule", "TrainerLayouts", "from_manifest", "load",
           "named", "of_batch", "owner", "reader_for", "reader_of", "readers", "recorded_convention", "register",
           "spec_named"]

# The registry: one line per family, in detection order (the first whose ``detect`` takes a folder wins).
register(FamilySpec("nemotron_omni", NemotronOmni, NEMOTRON_OMNI_LAYOUTS, NemotronOmniReader))
register(FamilySpec("qwen3_vl", Qwen3VL, QWEN3_VL_LAYOUTS, Qwen3VLReader))
register(FamilySpec("fixed", FixedCount))
register(FamilySpec("qwen2_vl", Qwen2VL, QWEN2_VL_LAYOUTS, Qwen2VLReader))
register(FamilySpec("none", NoMedia, TrainerLayouts(hugging_face=hf_text), NoMediaReader))

#: The processor mode's registration: no folder is detected as it (``--media-tokens processor`` picks it, wrapping
#: the folder's family) and its batches follow the folder's family's layouts, so it is not in :data:`REGISTRY`; a
#: manifest it wrote is still read by its reader.
PROCESSOR_MODE = FamilySpec("processor", ProcessorMode, reader=ProcessorReader)

#: The families a model folder is matched against, in order (the registry's).
FAMILIES: tuple[type[Family], ...] = tuple(spec.family for spec in REGISTRY.values())


def load(settings: EncodeSettings, tok: Any) -> Family:
    """The family of the model folder ``settings.tokenizer`` under the convention the settings name, with the
    settings' overrides; the processor mode wraps it. :class:`ConfigError` for a folder or setting it cannot
    take."""
    convention = settings.convention
    folder = Path(settings.tokenizer)
    cls = next(c for c in FAMILIES if c.detect(folder, settings))
    if convention.family is not None and cls.name != convention.family:
        raise ConfigError(f"{settings.tokenizer}: --preset {convention.name} is for {convention.family} model folders")
    family: Family = cls.variants.get(convention.name, cls).load(settings, tok, convention)
    if ProcessorMode.detect(folder, settings):
        wrapped = ProcessorMode.wrap(None if isinstance(family, NoMedia) else family, settings, tok)
        wrapped.audio_max_seconds = settings.audio_max_seconds
        return wrapped
    if settings.audio_max_seconds is not None and "audio" not in family.kinds:
        raise ConfigError(f"{settings.tokenizer}: audio_max_seconds applies to Nemotron Omni model folders (or the "
                          f"processor mode) only")
    return family


def recorded_convention(manifest: Mapping) -> Convention:
    """The convention a manifest's packs were made under, as the run resolved it (its ``convention`` record); a
    manifest of an older packtool without the record: the convention its settings' ``preset`` names, else the
    default."""
    recorded = manifest.get("convention")
    if isinstance(recorded, Mapping):
        return from_record(recorded)
    preset = (manifest.get("settings") or {}).get("preset")
    return CONVENTIONS.get(str(preset), TRANSFORMERS)


def owner(manifest: Mapping) -> type[Family] | None:
    """The family class (its variant for the manifest's convention, where it has one) that owns a manifest,
    without reading its settings; None when no family owns it."""
    return _owner(manifest, recorded_convention(manifest))


def _owner(manifest: Mapping, convention: Convention) -> type[Family] | None:
    owners: tuple[type[Family], ...] = (ProcessorMode, *FAMILIES)
    return next((cls.variants.get(convention.name, cls) for cls in owners if cls.owns(manifest)), None)


def from_manifest(manifest: Mapping) -> Family:
    """The family a manifest was written by, built under the convention it records
    (:func:`recorded_convention`; the family's variant for it, where it has one); ``ValueError`` for one no family
    owns or malformed settings."""
    convention = recorded_convention(manifest)
    cls = _owner(manifest, convention)
    if cls is None:
        entry = manifest.get("image_processor")
        raise ValueError(f"unsupported image processor {entry!r}")
    return cls.from_manifest(manifest, convention)


def reader_for(family: Family) -> FamilyReader:
    """The reader of ``family`` (one read back from a manifest): its registration's reader class, that reader's
    variant for the family's convention where it has one."""
    spec = PROCESSOR_MODE if isinstance(family, ProcessorMode) else spec_named(family.name)
    cls = spec.reader.variants.get(family.convention.name, spec.reader)
    return cls(family)


def reader_of(manifest: Mapping) -> FamilyReader:
    """The reader of a manifest's packs: its family's (:func:`from_manifest`), built under the convention the
    manifest records; ``ValueError`` for one no family owns or malformed settings."""
    return reader_for(from_manifest(manifest))


def readers() -> tuple[type[FamilyReader], ...]:
    """Every registered reader class with its convention variants, in registration order (the processor mode's
    last)."""
    out: list[type[FamilyReader]] = []
    for spec in (*REGISTRY.values(), PROCESSOR_MODE):
        for cls in (spec.reader, *spec.reader.variants.values()):
            if cls not in out:
                out.append(cls)
    return tuple(out)


def named(name: str) -> type[Family]:
    """The registered family called ``name``; ``ValueError`` for a name no family has."""
    return spec_named(name).family


def of_batch(batch: Mapping[str, Any]) -> type[Family]:
    """The family whose layouts a reader batch follows: the one its ``family`` entry names (the reader writes it,
    :meth:`FamilyReader.batch_family`); ``ValueError`` for a batch without one (not a packtool reader batch)."""
    name = batch.get(BATCH_FAMILY)
    if not isinstance(name, str):
        raise ValueError("the batch names no family (its 'family' entry): only batches of packtool's reader "
                         "(pack_to_batch, read_packs, collate_packs, the loaders) have a trainer layout")
    return named(name)
