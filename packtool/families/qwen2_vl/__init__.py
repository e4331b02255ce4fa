"""Qwen2-VL / Qwen2.5-VL: images by transformers' ``smart_resize`` and videos by ``Qwen2VLVideoProcessor``'s
sampling, each expanded in the ids (:mod:`.family`, its rules and the family); its reader (:mod:`.reading`) and the
reader's processors, video tensors and per-segment 3-D rope (:mod:`.reader`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packtool.families.qwen2_vl.family import (
    FETCH_IMAGE_TOKENS,
    FETCH_VIDEO_TOKENS,
    FETCH_VIDEO_TOTAL_TOKENS,
    QWEN2_VL_IMAGE_PROCESSORS,
    QWEN2_VL_MODEL_TYPES,
    QWEN2_VL_PROCESSORS,
    QWEN2_VL_VIDEO_PROCESSORS,
    ImageRule,
    Qwen2VL,
    Qwen2VLSettings,
    QwenVideoPlan,
    fetch_image_resize,
    qwen_resize,
)
from packtool.families.qwen2_vl.reading import Qwen2VLReader
from packtool.families.spec import QWEN_VL_MEDIA_KEYS, TrainerLayouts


def _hf_positions(row: Mapping, context: Mapping, tokens_per_second: int | None) -> Any:
    """The Hugging Face layout's positions (:func:`.reader.hf_positions`; the reader, and torch, imported only when a
    row is laid out)."""
    from packtool.families.qwen2_vl.reader import hf_positions

    return hf_positions(row, context, tokens_per_second)


#: Qwen2-VL's trainer layouts: Megatron-Bridge's shared Qwen-VL ``visual_inputs``, NeMo-RL's reader media fields
#: with ``mm_token_type_ids``, Hugging Face rows with the per-segment 3-D rope (Qwen2-VL and Qwen2.5-VL models).
QWEN2_VL_LAYOUTS = TrainerLayouts(nemo_rl_token_types=True,
                                  hugging_face=_hf_positions,
                                  hugging_face_model_types=("qwen2_vl", "qwen2_5_vl"),
                                  hugging_face_media_keys=QWEN_VL_MEDIA_KEYS)

__all__ = ["FETCH_IMAGE_TOKENS", "FETCH_VIDEO_TOKENS", "FETCH_VIDEO_TOTAL_TOKENS", "QWEN2_VL_IMAGE_PROCESSORS",
           "QWEN2_VL_LAYOUTS", "QWEN2_VL_MODEL_TYPES", "QWEN2_VL_PROCESSORS", "QWEN2_VL_VIDEO_PROCESSORS", "ImageRule",
           "Qwen2VL", "Qwen2VLReader", "Qwen2VLSettings", "QwenVideoPlan", "fetch_image_resize", "qwen_resize"]
