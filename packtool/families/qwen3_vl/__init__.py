"""Qwen3-VL (and Qwen3-VL-MoE): images by Qwen2-VL's image rule (patch 16 from the folder), videos by
``Qwen3VLVideoProcessor``'s sampling and resize with ``Qwen3VLProcessor``'s timestamped expansion, each written
into the text as the processor writes it (:mod:`.rule`); its reader (:mod:`.reading`) and the reader's pixels and
per-segment rope (:mod:`.reader`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packtool.families.qwen3_vl.family import Qwen3VL
from packtool.families.qwen3_vl.reading import Qwen3VLReader
from packtool.families.qwen3_vl.rule import Qwen3VLVideoPlan, Qwen3VLVideoRule
from packtool.families.spec import QWEN_VL_MEDIA_KEYS, TrainerLayouts


def _hf_positions(row: Mapping, context: Mapping, tokens_per_second: int | None) -> Any:
    """The Hugging Face layout's positions (:func:`.reader.hf_positions`; the reader, and torch, imported only when a
    row is laid out)."""
    from packtool.families.qwen3_vl.reader import hf_positions

    return hf_positions(row, context, tokens_per_second)


#: Qwen3-VL's trainer layouts: no Megatron-Bridge batch (its step's rope spans the whole row); Hugging Face rows.
QWEN3_VL_LAYOUTS = TrainerLayouts(megatron_bridge_refused=(
    "a Qwen3-VL reader batch has no Megatron-Bridge batch: Megatron-Bridge's qwen3_vl_step treats each batch row "
    "as one sequence (it ignores a batch's cu_seqlens and computes the rope over the whole row), so packtool gives "
    "Qwen3-VL packs no Megatron-Bridge batch; use its in-batch packing (pack_sequences_in_batch) on unpacked data, "
    "or read the packs with the per-segment rope (packtool.families.qwen3_vl.reader.position_ids)"),
    # Hugging Face rows: its per-segment rope; its videos carry no second_per_grid_ts (their times are text)
    hugging_face=_hf_positions,
    hugging_face_model_types=("qwen3_vl", "qwen3_vl_moe"),
    hugging_face_media_keys=tuple(k for k in QWEN_VL_MEDIA_KEYS if k != "second_per_grid_ts"))

__all__ = ["QWEN3_VL_LAYOUTS", "Qwen3VL", "Qwen3VLReader", "Qwen3VLVideoPlan", "Qwen3VLVideoRule"]
