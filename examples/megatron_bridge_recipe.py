"""Train Megatron-Bridge on a packtool OUTPUT: the configuration fields to set, as code.

Pack first, with the conventions of Megatron-Bridge's own Qwen-VL data path and the alignment that context
parallelism needs (2·cp; with sequence parallelism also a multiple of tp·cp):

    packtool pack SOURCE OUTPUT --tokenizer MODEL_DIR --pack-size 8192 --cp-size 2 --preset megatron-bridge-qwen-vl

Then, where Megatron-Bridge is installed (it is not a packtool dependency):

    python examples/megatron_bridge_recipe.py OUTPUT --context-parallel 2      # Qwen2.5-VL 3B SFT recipe

What changes against a stock Megatron-Bridge VLM recipe, and why:

| field | value | why |
|---|---|---|
| `cfg.dataset` | `PacktoolDataset(path=OUTPUT, ...)` | Energon loader with packtool's `MegatronBridgeTaskEncoder` |
| `cfg.dataset.dataloader_type` | `"external"` | the Energon loader is the iterator; no Megatron sampler |
| `cfg.model.seq_length`, `cfg.dataset.seq_length` | the pack size | one pack is one row of exactly this many tokens |
| `cfg.train.micro_batch_size` | 1 | one pack per micro-batch: a THD row (the packs already hold many samples) |
| `cfg.train.global_batch_size` | packs per step | Megatron counts packs, not source samples |
| `cfg.model.context_parallel_size` | cp | the packs' alignment must be a multiple of 2·cp (checked below) |
| in-batch / Energon packing | off | the packs are already packed; no `packing_buffer_size`, no in-batch packing |
| forward step | `vlm_step.forward_step` (VLMs), `gpt_step.forward_step` (LLMs) | reads the packs' THD keys (below) |

Both forward steps (`megatron.bridge.training.vlm_step`, `megatron.bridge.training.gpt_step`) read the THD keys
`cu_seqlens_q/kv(_padded)`, `max_seqlen_q/kv`; Qwen3-VL's own step refuses pre-packed batches.

The declarative `EnergonDatasetConfig` accepts only Megatron-Bridge's own task encoders, so the dataset is a small
`DatasetProvider` that builds Energon's data module with packtool's task encoder.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


def packed_settings(output: str | Path, *, context_parallel: int = 1, tensor_parallel: int = 1,
                    sequence_parallel: bool = False) -> dict:
    """`seq_length` and `micro_batch_size` for a packed OUTPUT, after checking its alignment suits the parallelism
    (the THD context-parallel split cuts each padded segment into 2·cp equal chunks)."""
    from packtool.build.algorithms import derive_align
    from packtool.format import load_manifest

    settings = load_manifest(output)["settings"]
    pack_size, align = int(settings["pack_size"]), int(settings["align"])
    need = derive_align(cp_size=context_parallel, tp_size=tensor_parallel, sequence_parallel=sequence_parallel)
    if align % need:
        raise ValueError(f"{output} was packed with align {align}; context parallel {context_parallel} (tensor "
                         f"parallel {tensor_parallel}, sequence parallel {sequence_parallel}) needs a multiple of "
                         f"{need}: pack again with --cp-size/--tp-size/--sequence-parallel to match")
    return {"seq_length": pack_size // align * align, "micro_batch_size": 1}


def dataset_provider(output: str, seq_length: int, *, num_workers: int = 2, shuffle_buffer_size: int = 100):
    """A Megatron-Bridge dataset config that loads OUTPUT through packtool's `MegatronBridgeTaskEncoder`."""
    from megatron.bridge.data.base import DatasetProvider

    @dataclass(kw_only=True)
    class PacktoolDataset(DatasetProvider):
        path: str
        seq_length: int
        micro_batch_size: int = 1
        shuffle_buffer_size: int = 100

        def build_datasets(self, context):
            from megatron.bridge.data.energon.base_energon_datamodule import EnergonMultiModalDataModule

            from packtool.runtime.loader import MegatronBridgeTaskEncoder

            module = EnergonMultiModalDataModule(
                path=self.path, tokenizer=context.tokenizer, seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory,
                shuffle_buffer_size=self.shuffle_buffer_size, max_samples_per_sequence=None,
                task_encoder=MegatronBridgeTaskEncoder(), packing_buffer_size=None,
                pg_collection=context.pg_collection,
            )
            train = module.train_dataloader() if context.train_samples > 0 else None
            valid = iter(module.val_dataloader()) if context.valid_samples > 0 else None
            return train, valid, None

    return PacktoolDataset(path=output, seq_length=seq_length, dataloader_type="external", num_workers=num_workers,
                           shuffle_buffer_size=shuffle_buffer_size)


def configure(cfg, output: str, *, context_parallel: int = 1, global_batch_size: int | None = None):
    """Point a Megatron-Bridge `ConfigContainer` (e.g. a stock VLM SFT recipe) at a packtool OUTPUT."""
    tp, sp = cfg.model.tensor_model_parallel_size, bool(cfg.model.sequence_parallel)
    packed = packed_settings(output, context_parallel=context_parallel, tensor_parallel=tp, sequence_parallel=sp)
    cfg.model.seq_length = packed["seq_length"]
    cfg.model.context_parallel_size = context_parallel
    cfg.train.micro_batch_size = packed["micro_batch_size"]
    if global_batch_size is not None:
        cfg.train.global_batch_size = global_batch_size
    cfg.dataset = dataset_provider(output, packed["seq_length"])
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="a packtool OUTPUT folder")
    parser.add_argument("--context-parallel", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=None, help="packs per optimizer step")
    args = parser.parse_args()

    from megatron.bridge.recipes.qwen_vl.qwen25_vl import qwen25_vl_3b_sft_config
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.vlm_step import forward_step

    cfg = configure(qwen25_vl_3b_sft_config(), args.output, context_parallel=args.context_parallel,
                    global_batch_size=args.global_batch_size)
    finetune(config=cfg, forward_step_func=forward_step)


if __name__ == "__main__":
    main()
