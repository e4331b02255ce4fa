"""Nemotron Omni: images, videos and audio expanded in the text as transformers' ``nemotron_h_omni`` processor
writes them (:mod:`.family`), its conventions' variants (Megatron-Bridge's collate, :mod:`.mbridge`; NeMo-RL's
encoder, :mod:`.nemo_rl`, its rules in :mod:`packtool.families.nemo_rl_rules`), and the reader's side: the
processors and media tensors (:mod:`.reader`, :mod:`.mbridge_reader`) and the trainer batch layouts
(:mod:`.bridge_batch`: Megatron-Bridge's ``nemotron_omni_step``; :mod:`.nemo_rl_batch`: NeMo-RL's packed batch).
Importing the package registers the variants under their ``--preset`` names."""

from __future__ import annotations

from packtool.families.nemotron_omni.family import NemotronOmni, NemotronOmniSettings
from packtool.families.nemotron_omni.mbridge import MBridgeNemotronOmni
from packtool.families.nemotron_omni.nemo_rl import NEMO_RL_PROMPT_FORMAT, NemoRLNemotronOmni
from packtool.families.spec import TrainerLayouts

_HERE = "packtool.families.nemotron_omni"
#: Nemotron Omni's trainer layouts: Megatron-Bridge's ``nemotron_omni_step`` fields (:mod:`.bridge_batch`), NeMo-RL's
#: per-item media and patch size (:mod:`.nemo_rl_batch`), its recipe's processor options compared with the packs'.
NEMOTRON_OMNI_LAYOUTS = TrainerLayouts(
    megatron_bridge=f"{_HERE}.bridge_batch:nemotron_inputs",
    nemo_rl_media=f"{_HERE}.nemo_rl_batch:family_inputs",
    nemo_rl_patch_dim=f"{_HERE}.nemo_rl_batch:patch_dim",
    nemo_rl_recipe=f"{_HERE}.reader:check_recipe_options",
    nemo_rl_prompt=f"{_HERE}.nemo_rl:check_thinking_trace_format",
    nemo_rl_prompt_formats=(NEMO_RL_PROMPT_FORMAT,),
)

__all__ = ["NEMOTRON_OMNI_LAYOUTS", "MBridgeNemotronOmni", "NemoRLNemotronOmni", "NemotronOmni",
           "NemotronOmniSettings"]
