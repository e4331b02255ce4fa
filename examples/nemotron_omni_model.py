"""Build a tiny Nemotron Omni model folder offline: what transformers' ``nemotron_h_omni`` processor loads.

The folder has no weights; it is a processor folder as ``NemotronH_Omni_Reasoning_V3Processor.save_pretrained``
writes it (transformers 5.23): ``tokenizer.json`` / ``tokenizer_config.json`` (a small byte-level BPE trained on
the demo corpus, with the Nemotron Omni media tokens ``<img>``, ``</img>``, ``<image>``, ``<so_start>``,
``<so_end>``, ``<so_embedding>`` as special tokens), ``chat_template.jinja`` (ChatML; image, video and audio parts
render as ``<image>``, ``<video>``, ``<so_embedding>``), and ``processor_config.json`` nesting the image
processor, video processor and Parakeet feature extractor settings beside the processor's own arguments.

``<video>`` is no token of the tokenizer (as in the released model): the processor replaces it before tokenizing.

Usage: ``python examples/nemotron_omni_model.py OUT_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo  # sibling module: corpus and Qwen2-style pre-tokenizer

#: Special tokens, in id order (ids 0..8).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<image>",
    "<so_start>",
    "<so_end>",
    "<so_embedding>",
)

#: Text the processor writes around media, so the tokenizer learns merges for it.
LABEL_TEXT = [
    f"Frame {i} sampled at {i / 2:.2f} seconds and frame {i + 1} sampled at {(i + 1) / 2:.2f} seconds: "
    for i in range(1, 200, 2)
] + [f"Frame {i} and frame {i + 1}: " for i in range(1, 50, 2)]


def image_processor_config(**overrides: Any) -> dict:
    """Settings of ``NemotronH_Omni_Reasoning_V3ImageProcessor`` (the released model's defaults)."""
    return {
        "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": list(demo.CLIP_MEAN),
        "image_std": list(demo.CLIP_STD),
        "patch_size": 16,
        "downsample_ratio": 0.5,
        "min_num_patches": 1024,
        "max_num_patches": 13312,
        "max_model_len": 16384,
        **overrides,
    }


def video_processor_config(**overrides: Any) -> dict:
    """Settings of ``NemotronH_Omni_Reasoning_V3VideoProcessor``; e.g. ``do_sample_frames=True, fps=2``."""
    return {
        "video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor",
        "norm_mean": list(demo.CLIP_MEAN),
        "norm_std": list(demo.CLIP_STD),
        "rescale_factor": 1 / 255,
        "patch_size": 16,
        "downsample_ratio": 0.5,
        "video_target_num_patches": 1024,
        "video_maintain_aspect_ratio": True,
        "return_metadata": False,
        **overrides,
    }


def feature_extractor_config(**overrides: Any) -> dict:
    """Settings of ``ParakeetFeatureExtractor`` (16 kHz, 80 mel bins, hop 160)."""
    return {
        "feature_extractor_type": "ParakeetFeatureExtractor",
        "feature_size": 80,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 512,
        "win_length": 400,
        "preemphasis": 0.97,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        **overrides,
    }


def chat_template() -> str:
    """ChatML; ``content`` is a string or parts ``{"type": "image"|"video"|"audio"|"text"}``."""
    return (
        "{%- for message in messages -%}\n"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
        "{%- if message['content'] is string -%}{{- message['content'] -}}\n"
        "{%- else -%}{%- for part in message['content'] -%}\n"
        "{%- if part['type'] == 'image' -%}{{- '<image>' -}}\n"
        "{%- elif part['type'] == 'video' -%}{{- '<video>' -}}\n"
        "{%- elif part['type'] == 'audio' -%}{{- '<so_embedding>' -}}\n"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}\n"
        "{%- endif -%}{%- endfor -%}{%- endif -%}\n"
        "{{- '<|im_end|>\\n' -}}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
    )


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on the demo corpus and the frame labels."""
    from tokenizers import AddedToken, models, pre_tokenizers, trainers

    tok = demo.qwen2_style_tokenizer(models.BPE())
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*demo.training_corpus(n_sentences=1500), *LABEL_TEXT], trainer=trainer)
    tok.add_special_tokens(specials)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def write_model_folder(
    out_dir: str | Path,
    *,
    image: dict | None = None,
    video: dict | None = None,
    audio: dict | None = None,
    processor: dict | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write the folder; ``image``/``video``/``audio`` override sub-processor settings, ``processor`` the
    processor's own arguments (``audio_sampling_rate``, ``video_temporal_patch_dim``, ...)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer()).save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "TokenizersBackend",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 16384,
        "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
    }
    _write_json(out / "tokenizer_config.json", tok_config)
    (out / "chat_template.jinja").write_text(chat_template())
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
            "audio_sampling_rate": 16000,
            "audio_hop_length": 160,
            "audio_subsampling_factor": 8,
            "video_temporal_patch_dim": 2,
            **(processor or {}),
            "image_processor": image_processor_config(**(image or {})),
            "video_processor": video_processor_config(**(video or {})),
            "feature_extractor": feature_extractor_config(**(audio or {})),
        },
    )
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    print(write_model_folder(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
