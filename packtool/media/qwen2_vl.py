"""Qwen2-VL / Qwen2.5-VL media token rules: an image's patch grid and token count from its width and height.

The rule is transformers' ``smart_resize``: sides rounded to multiples of patch·merge, then scaled into
``[min_pixels, max_pixels]``; the model folder's ``preprocessor_config.json`` gives the numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ImageRule:
    """How many tokens an image costs. Either the Qwen2-VL resize rule or a fixed count per image."""

    #: ``"qwen2_vl"`` or ``"fixed"``.
    type: str
    min_pixels: int = 3136
    max_pixels: int = 1003520
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    #: Tokens per image for ``type == "fixed"``.
    fixed_tokens: int = 0
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of one image (Qwen2-VL); ``(1, 1, 1)`` for fixed-count models."""
        if self.type == "fixed":
            return (1, 1, 1)
        h, w = qwen_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return (1, h // self.patch_size, w // self.patch_size)

    def tokens(self, width: int, height: int) -> int:
        """Tokens the image occupies in the text."""
        if self.type == "fixed":
            return self.fixed_tokens
        _, gh, gw = self.grid(width, height)
        return gh * gw // (self.merge_size**2)

    def manifest(self) -> dict:
        """The settings a reader needs to reproduce pixel values."""
        return {
            "type": self.type,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "fixed_tokens": self.fixed_tokens,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }


def qwen_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize: sides to multiples of ``factor`` (nearest), then scaled into [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image_rule(
    tokenizer_dir: Path,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    image_tokens: int | None = None,
) -> ImageRule | None:
    """The rule for a model folder: ``image_tokens`` wins, else ``preprocessor_config.json`` (Qwen2-VL style),
    with ``min_pixels``/``max_pixels`` overriding it; ``None`` when the model has no image processor."""
    if image_tokens is not None:
        return ImageRule(type="fixed", fixed_tokens=int(image_tokens))
    path = Path(tokenizer_dir) / "preprocessor_config.json"
    if not path.exists():
        if min_pixels is not None or max_pixels is not None:
            return ImageRule(type="qwen2_vl", min_pixels=min_pixels or 3136, max_pixels=max_pixels or 1003520)
        return None
    cfg = json.loads(path.read_text())
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 3136)))
    hi = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 1003520)))
    return ImageRule(
        type="qwen2_vl",
        min_pixels=int(min_pixels if min_pixels is not None else lo),
        max_pixels=int(max_pixels if max_pixels is not None else hi),
        patch_size=int(cfg.get("patch_size", 14)),
        merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        image_mean=tuple(cfg.get("image_mean", ImageRule.image_mean)),
        image_std=tuple(cfg.get("image_std", ImageRule.image_std)),
    )
