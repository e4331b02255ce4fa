"""Nemotron Omni: images, videos and audio expanded in the text as transformers' ``nemotron_h_omni`` processor
writes them (:mod:`.family`), its conventions' variants (Megatron-Bridge's collate, :mod:`.mbridge`; NeMo-RL's
encoder, :mod:`.nemo_rl`, its rules in :mod:`packtool.families.nemo_rl_rules`), and the reader's side: the
processors and media tensors (:mod:`.reader`, :mod:`.mbridge_reader`) and the trainer batch layouts
(:mod:`.bridge_batch`: Megatron-Bridge's ``nemotron_omni_step``; :mod:`.nemo_rl_batch`: NeMo-RL's packed batch).
Importing the package registers the variants under their ``--preset`` names."""

from __future__ import annotations

from packtool.families.nemotron_omni.family import NemotronOmni, NemotronOmniSettings
from packtool.families.nemotron_omni.mbridge import MBridgeNemotronOmni
from packtool.families.nemotron_omni.nemo_rl import NemoRLNemotronOmni

__all__ = ["MBridgeNemotronOmni", "NemoRLNemotronOmni", "NemotronOmni", "NemotronOmniSettings"]
