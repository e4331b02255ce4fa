"""A tiny random Qwen2.5-VL model over a model folder's vocabulary, for trying the trainers' paths on CPU.

    python examples/tiny_model.py examples/demo/tokenizer examples/demo/model

MODEL_FOLDER gets the tokenizer files of TOKENIZER_FOLDER (the demo's Qwen2.5-VL-style folder), a ``config.json``
whose media token ids are that vocabulary's, and random weights (seed 0; 2 text and 2 vision layers, a few MB).
It learns nothing useful: it is there so that ``examples/trl_sft.py`` runs from the demo's packs with no download.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def build(tokenizer_folder: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny model folder ``out`` (see the module docstring) and return it."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    src, out = Path(tokenizer_folder), Path(out)
    tok = AutoTokenizer.from_pretrained(src)

    def token(text: str) -> int:
        ids = tok.convert_tokens_to_ids([text])
        if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
            raise SystemExit(f"{src}: its vocabulary has no {text} token (not a Qwen2.5-VL-style folder)")
        return int(ids[0])

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         bos_token_id=token("<|im_start|>"), eos_token_id=token("<|im_end|>"),
                         pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_folder", help="a Qwen2.5-VL-style model folder (the demo's tokenizer/)")
    parser.add_argument("model_folder", help="where the tiny model is written")
    args = parser.parse_args(argv)
    print(f"wrote {build(args.tokenizer_folder, args.model_folder)}")


if __name__ == "__main__":
    main()
