"""Train a Hugging Face model with TRL's SFTTrainer on a packtool OUTPUT (packs made ahead of time).

    packtool pack SOURCE OUTPUT --tokenizer MODEL_DIR --pack-size 8192
    python examples/trl_sft.py OUTPUT MODEL_DIR RUN_DIR --max-steps 100

On CPU, from the demo (`make run` packs it and writes a tiny random Qwen2.5-VL of its vocabulary,
`examples/tiny_model.py`): `python examples/trl_sft.py examples/demo/packed examples/demo/model /tmp/trl-run
--max-steps 2 --cpu`.

Each dataset item is one pack as a padding-free packed row (`packtool.runtime.hf.HFPackDataset`: unshifted labels,
positions restarting per segment, varlen keywords, media); the collator concatenates the packs of a micro-batch
(`HFPackCollator`). TRL's own preparation and packing are switched off by its documented settings:

- `dataset_kwargs={"skip_prepare_dataset": True}`: no tokenizing, no chat template, no truncation of the rows;
- `packing=False`, `padding_free=False`: TRL packs nothing again (the rows are packed already and carry their own
  positions and boundaries);
- `remove_unused_columns=False`: the packed keys (`position_ids`, `cu_seq_lens_q`, media) reach the model;
- `max_length=None`: the row length is the pack's (set at pack time).

`check_model` refuses attention implementations that would let segments see each other (eager, sdpa and flash
attention keep them apart) and turns the model's cache off (Qwen2.5-VL's text config keeps it on otherwise, and with
a cache transformers attends across segments). The loss is summed over target tokens and divided by the target
tokens of the global batch (Trainer's `num_items_in_batch`), as an unpacked run of the same samples would.

`--loss-mode token|sample|square` trains under a packtool loss mode (sample weights from the sources' `loss_weight`,
per-sample or square averaging): the rows carry `loss_weights` and the trainer is SFTTrainer with
`packtool.runtime.hf.PackedLossTrainer` mixed in, which divides by the weights summed over the global batch (every
accumulated micro-batch, every process), so the step is the same samples' unpacked weighted mean exactly.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def sft_config(run_dir: str | Path, *, max_steps: int, packs_per_step: int = 1, learning_rate: float = 1e-5,
               use_cpu: bool = False, **overrides):
    """TRL's SFTConfig for pre-packed rows (see the module docstring)."""
    from trl import SFTConfig

    if use_cpu:
        overrides.setdefault("bf16", False)  # SFTConfig's default bf16 needs a GPU
    return SFTConfig(output_dir=str(run_dir), max_steps=max_steps, per_device_train_batch_size=packs_per_step,
                     learning_rate=learning_rate, dataset_kwargs={"skip_prepare_dataset": True}, packing=False,
                     padding_free=False, remove_unused_columns=False, max_length=None, report_to=[],
                     save_strategy="no", use_cpu=use_cpu, dataloader_num_workers=0, **overrides)


def build_trainer(packs: str | Path, model, processing_class, run_dir: str | Path, *, loss_mode: str | None = None,
                  **config):
    """An SFTTrainer over OUTPUT's train split with packtool's dataset and collator (``loss_mode``: with
    ``PackedLossTrainer`` mixed in, see the module docstring)."""
    from trl import SFTTrainer

    from packtool.runtime.hf import HFPackCollator, HFPackDataset, PackedLossTrainer, check_model

    folder = getattr(processing_class, "name_or_path", None)
    dataset = HFPackDataset(packs, "train", model_folder=folder or None, loss_mode=loss_mode)
    check_model(model, dataset)  # segments kept apart, the cache off, and packs made for this model
    trainer_class = SFTTrainer if loss_mode is None else type("PackedSFTTrainer", (PackedLossTrainer, SFTTrainer), {})
    # SFTTrainer takes a `datasets.Dataset` only: items `{"pack": i}`, each read by the collator.
    return trainer_class(model=model, args=sft_config(run_dir, **config), train_dataset=dataset.index_dataset(),
                         data_collator=HFPackCollator(dataset, loss_mode=loss_mode), processing_class=processing_class)


def main(argv: list[str] | None = None):
    """Train as the command line says; returns the trainer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packs", help="packtool OUTPUT")
    parser.add_argument("model", help="Hugging Face model folder (the one the packs were made with)")
    parser.add_argument("run_dir")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--packs-per-step", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--attn", default="sdpa", help="eager, sdpa, flash_attention_2 or flash_attention_3")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (fp32)")
    parser.add_argument("--loss-mode", choices=("token", "sample", "square"), default=None,
                        help="weigh the step by a packtool loss mode (default: Trainer's per-token mean)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, PretrainedConfig

    config = PretrainedConfig.get_config_dict(args.model)[0]
    if "vision_config" in config:
        model = AutoModelForImageTextToText.from_pretrained(args.model, attn_implementation=args.attn)
        processing_class = AutoProcessor.from_pretrained(args.model)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn)
        processing_class = AutoTokenizer.from_pretrained(args.model)
    trainer = build_trainer(args.packs, model, processing_class, args.run_dir, max_steps=args.max_steps,
                            packs_per_step=args.packs_per_step, learning_rate=args.learning_rate,
                            use_cpu=args.cpu, loss_mode=args.loss_mode)
    result = trainer.train()
    print(f"{result.global_step} steps, training loss {result.training_loss:.4f}")
    return trainer


if __name__ == "__main__":
    main()
