"""Nemotron Omni: images, videos and audio expanded in the text as transformers' ``nemotron_h_omni`` processor
writes them (:mod:`.family`), its conventions' variants (Megatron-Bridge's collate, :mod:`.mbridge`; NeMo-RL's
encoder, :mod:`.nemo_rl`, its rules in :mod:`packtool.families.nemo_rl_rules`), and the reader's side: the
processors and media tensors (:mod:`.reader`, :mod:`.mbridge_reader`) and the trainer batch layouts
(:mod:`.bridge_batch`: Megatron-Bridge's ``nemotron_omni_step``; :mod:`.nemo_rl_batch`: NeMo-RL's packed batch).
Importing the package registers the variants under their ``--preset`` names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packtool.families.nemotron_omni.family import NemotronOmni, NemotronOmniSettings
from packtool.families.nemotron_omni.mbridge import MBridgeNemotronOmni
from packtool.families.nemotron_omni.nemo_rl import (
    NEMO_RL_PROMPT_FORMAT,
    NemoRLNemotronOmni,
    check_thinking_trace_format,
)
from packtool.families.nemotron_omni.reading import MBridgeNemotronOmniReader, NemotronOmniReader
from packtool.families.spec import TrainerLayouts

# The layouts import their modules (and torch) only when a batch is laid out.


def _bridge_inputs(batch: Mapping, temporal_patch_dim: int) -> dict:
    from packtool.families.nemotron_omni.bridge_batch import nemotron_inputs

    return nemotron_inputs(batch, temporal_patch_dim)


def _nemo_rl_media(reader: Any, record: Any, processor: Any, where: str) -> dict[str, list[Any]]:
    from packtool.families.nemotron_omni.nemo_rl_batch import family_inputs

    return family_inputs(reader, record, processor, where)


def _nemo_rl_patch_dim(reader: Any) -> int:
    from packtool.families.nemotron_omni.nemo_rl_batch import patch_dim

    return patch_dim(reader)


def _nemo_rl_recipe(manifest: Mapping, given: Mapping[str, Any], fields: Mapping[str, str],
                    processors: Any = None) -> None:
    from packtool.families.nemotron_omni.reader import check_recipe_options

    check_recipe_options(manifest, given, fields, processors)


#: Nemotron Omni's trainer layouts: Megatron-Bridge's ``nemotron_omni_step`` fields (:mod:`.bridge_batch`), NeMo-RL's
#: per-item media and patch size (:mod:`.nemo_rl_batch`), its recipe's processor options compared with the packs'.
NEMOTRON_OMNI_LAYOUTS = TrainerLayouts(
    megatron_bridge=_bridge_inputs,
    nemo_rl_media=_nemo_rl_media,
    nemo_rl_patch_dim=_nemo_rl_patch_dim,
    nemo_rl_recipe=_nemo_rl_recipe,
    nemo_rl_prompt=check_thinking_trace_format,
    nemo_rl_prompt_formats=(NEMO_RL_PROMPT_FORMAT,),
)

__all__ = ["NEMOTRON_OMNI_LAYOUTS", "MBridgeNemotronOmni", "MBridgeNemotronOmniReader", "NemoRLNemotronOmni",
           "NemotronOmni", "NemotronOmniReader", "NemotronOmniSettings"]
