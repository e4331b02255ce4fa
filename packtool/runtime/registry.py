"""The runtime's one door to the family registry: the family, or its reader, that a manifest, a reader batch or a
name stands for.

The runtime's modules import no family module, not even inside a function: a family reaches the runtime through
its reader (:class:`packtool.families.reading.FamilyReader`: its processors, media fields and tensors) and its
trainer layouts (:class:`packtool.families.spec.TrainerLayouts`), and the family's own reader code stands on the
reader kit (:mod:`packtool.readkit`), never on the runtime. This module imports only the registry
(:mod:`packtool.families`, its ``__init__``), never a family's own module: the runtime's public entry points
(:func:`.read.pack_to_batch`, :func:`.read.read_packs`, the loaders, :func:`.megatron_batch.megatron_bridge_batch`,
:mod:`.nemo_rl`, :mod:`.hf`) take a manifest or a reader batch, as a training container holds them, and only the
registry knows which family wrote a manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packtool.families import (
    REGISTRY,
    Family,
    FamilyReader,
    FamilySpec,
    named,
    of_batch,
    owner,
    reader_of,
    readers,
    spec_named,
)

__all__ = ["Family", "FamilyReader", "FamilySpec", "family_class_of", "family_named", "family_of_batch",
           "reader_classes", "reader_of", "registered", "spec_of", "spec_of_batch"]


def reader_classes() -> tuple[type[FamilyReader], ...]:
    """Every registered reader class, convention variants included (:func:`packtool.families.readers`)."""
    return readers()


def family_class_of(manifest: Mapping) -> type[Family]:
    """The family class that owns a manifest, its settings not read (:func:`packtool.families.owner`); the base
    class where no family owns it."""
    return owner(manifest) or Family


def family_of_batch(batch: Mapping[str, Any]) -> type[Family]:
    """The family whose layout a reader batch has (:func:`packtool.families.of_batch`)."""
    return of_batch(batch)


def family_named(name: str) -> type[Family]:
    """The registered family called ``name`` (:attr:`Family.name`; :func:`packtool.families.named`)."""
    return named(name)


def spec_of(name: str) -> FamilySpec:
    """The registration of the family called ``name``: its class and trainer layouts
    (:class:`packtool.families.spec.FamilySpec`)."""
    return spec_named(name)


def spec_of_batch(batch: Mapping[str, Any]) -> FamilySpec:
    """The registration of the family a reader batch names (:func:`packtool.families.of_batch`)."""
    return spec_named(of_batch(batch).name)


def registered() -> Mapping[str, FamilySpec]:
    """Every registered family's registration, by name, in the registry's order (its trainer layouts: what a
    trainer's path looks up instead of a family list of its own)."""
    return REGISTRY
