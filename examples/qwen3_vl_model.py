"""Write a small Qwen3-VL model folder offline, as the hub ships one (no weights): the demo's tokenizer and chat
template (``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` as special tokens),
``preprocessor_config.json`` (Qwen2-VL's image processor with patch 16, ``processor_class`` Qwen3VLProcessor),
``video_preprocessor_config.json`` (``Qwen3VLVideoProcessor``) and ``config.json`` (``model_type`` qwen3_vl).

transformers' ``AutoProcessor`` loads it as ``Qwen3VLProcessor``; packtool takes it as the Qwen3-VL family.

Usage: ``python examples/qwen3_vl_model.py OUT_DIR``
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo  # sibling module: the demo tokenizer

#: Qwen3-VL's processor settings (its released folders': patch 16, merge 2, mean and std 0.5).
IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
    "do_normalize": True, "do_convert_rgb": True, "do_resize": True,
}
VIDEO_PROCESSOR: dict[str, Any] = {
    "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4,
    "max_frames": 768, "do_sample_frames": True, "cap_pixels_per_frame": False,
}


def write_model_folder(out_dir: str | Path, *, tokenizer: str | Path | None = None, image: dict | None = None,
                       video: dict | None = None, model_type: str = "qwen3_vl") -> Path:
    """The folder at ``out_dir``: the demo tokenizer (copied from ``tokenizer``, else trained), the processor
    settings above updated by ``image`` and ``video``, and ``config.json`` of ``model_type``."""
    out = Path(out_dir)
    if tokenizer is not None:
        shutil.copytree(tokenizer, out, dirs_exist_ok=True)
    else:
        demo.build_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps({**IMAGE_PROCESSOR, **(image or {})}, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_PROCESSOR, **(video or {})}, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python examples/qwen3_vl_model.py OUT_DIR", file=sys.stderr)
        return 2
    print(write_model_folder(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
