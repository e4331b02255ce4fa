"""Qwen3-VL (and Qwen3-VL-MoE): images by Qwen2-VL's image rule (patch 16 from the folder), videos by
``Qwen3VLVideoProcessor``'s sampling and resize with ``Qwen3VLProcessor``'s timestamped expansion, each written
into the text as the processor writes it (:mod:`.rule`); the reader's pixels and per-segment rope
(:mod:`.reader`)."""

from __future__ import annotations

from packtool.families.qwen3_vl.family import Qwen3VL
from packtool.families.qwen3_vl.rule import Qwen3VLVideoPlan, Qwen3VLVideoRule

__all__ = ["Qwen3VL", "Qwen3VLVideoPlan", "Qwen3VLVideoRule"]
