"""Train Megatron-Bridge on a packtool OUTPUT: the configuration fields to set, as code.

Pack first, with the conventions of Megatron-Bridge's own Qwen-VL data path (context parallel 1: Megatron-Bridge's
Qwen2.5-VL model does not split a sequence across context-parallel ranks):

    packtool pack SOURCE OUTPUT --tokenizer MODEL_DIR --pack-size 8192 --preset megatron-bridge-qwen-vl

Then, where Megatron-Bridge is installed (it is not a packtool dependency):

    python examples/megatron_bridge_recipe.py OUTPUT --samples-per-step 256 --epochs 1   # Qwen2.5-VL 3B SFT

What changes against a stock Megatron-Bridge VLM recipe, and why:

- `cfg.dataset` = `PacktoolDatasetConfig(path=OUTPUT, ...)`: Energon's loader with packtool's
  `MegatronBridgeTaskEncoder`; `dataloader_type="external"` (the Energon loader is the iterator, no sampler).
- `cfg.dataset.enable_offline_packing = True` with `offline_packing_specs = PackedSequenceSpecs(packed_sequence_size=
  seq_length)`: Megatron-Bridge's own declaration for a dataset packed ahead of time (nothing is packed again). The
  batches carry THD boundaries, and with pipeline parallel >= 3 the middle stages receive them only when the dataset
  declares packing; without it their samples attend across each other with no error. `ConfigContainer.validate()`
  takes it with micro batch 1; it refuses `enable_in_batch_packing` (the declaration for packing at collate time)
  unless a micro batch holds 2 or more samples.
- `cfg.dataset.do_validation`: whether OUTPUT has a `val` split (Energon refuses a split the dataset lacks).
- `cfg.model.seq_length`, `cfg.dataset.seq_length` = the row length: one pack is one row of that many tokens.
- `cfg.train.micro_batch_size = 1`: one pack (a THD row holding many samples) per micro-batch.
- `cfg.train.global_batch_size` (packs per step) and `cfg.train.train_iters` from the samples per pack and the
  packs of OUTPUT's `train` split, read from its manifest (`--samples-per-step`, `--epochs`).
- `cfg.model.context_parallel_size`: 1 for Qwen2.5-VL (refused otherwise); for other models the packs'
  alignment must be a multiple of 2·cp (checked).
- `cfg.model.calculate_per_token_loss = True` and `cfg.ddp.average_in_collective = False` at every CP: Megatron-Core
  then divides the step's summed loss by the sum of `loss_mask` over all micro-batches and data-parallel ranks.
  Without it each micro-batch (one pack) is averaged on its own, so every pack weighs the same and a sample's weight
  depends on what it was packed with. The batches' `loss_mask` carries packtool's `loss_weights`: choose the loss
  mode with the task encoder's `loss_mode=` (`token`: the per-token mean, the default; `sample`: the per-sample
  mean; `square`). Megatron-Bridge asserts the same under CP > 1 for its own SFT datasets.
- FP8 (`--fp8`): the row length must be a multiple of 16 (checked; pack with such a `--pack-size`).
- forward step: `vlm_step.forward_step` (VLMs), `gpt_step.forward_step` (LLMs); both read the THD keys.

The dataset is Megatron-Bridge's current dataset API (a `DataloaderConfig` with a builder, dispatched by its
dataset registry like its own `EnergonDatasetConfig`), not the deprecated `DatasetProvider`: its declarative
`EnergonDatasetConfig` accepts only Megatron-Bridge's own task encoders.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Families whose Megatron-Bridge model cannot split a sequence across context-parallel ranks.
NO_CONTEXT_PARALLEL = {"qwen2_vl": "Megatron-Bridge's Qwen2.5-VL model does not split sequences across context-"
                                   "parallel ranks (its own recipes use CP 1): train with context parallel 1"}


def packed_settings(output: str | Path, *, context_parallel: int = 1, tensor_parallel: int = 1,
                    sequence_parallel: bool = False, fp8: bool = False) -> dict:
    """`seq_length`, `micro_batch_size` and the splits of a packed OUTPUT, after checking its alignment suits the
    parallelism (the THD context-parallel split cuts each padded segment into 2·cp equal chunks), that the model
    can use context parallelism at all, and that FP8 gets a row length that is a multiple of 16."""
    from packtool.format import load_manifest, split_shard_paths
    from packtool.settings import derive_align

    manifest = load_manifest(output)
    settings = manifest["settings"]
    pack_size, align = int(settings["pack_size"]), int(settings["align"])
    need = derive_align(cp_size=context_parallel, tp_size=tensor_parallel, sequence_parallel=sequence_parallel)
    if align % need:
        raise ValueError(f"{output} was packed with align {align}; context parallel {context_parallel} (tensor "
                         f"parallel {tensor_parallel}, sequence parallel {sequence_parallel}) needs a multiple of "
                         f"{need}: pack again with --cp-size/--tp-size/--sequence-parallel to match")
    family = (manifest.get("image_processor") or {}).get("type")
    if context_parallel > 1 and family in NO_CONTEXT_PARALLEL:
        raise ValueError(f"{output}: {NO_CONTEXT_PARALLEL[family]}")
    seq_length = pack_size // align * align
    if fp8 and seq_length % 16:
        raise ValueError(f"{output}: FP8 needs a row length that is a multiple of 16, these packs have rows of "
                         f"{seq_length} tokens: pack again with a --pack-size that is a multiple of 16")
    splits = {name: bool(split_shard_paths(output, name)) for name in ("train", "val")
              if name in manifest["splits"]}
    return {"seq_length": seq_length, "micro_batch_size": 1, "has_val": splits.get("val", False)}


def schedule(output: str | Path, *, samples_per_step: int, epochs: float = 1.0, data_parallel: int = 1) -> dict:
    """Global batch size (packs per optimizer step) and iterations for OUTPUT's `train` split, from the samples
    per pack its manifest records: about `samples_per_step` source samples a step, a multiple of the data-parallel
    size (micro batch 1), and `epochs` passes over the packs."""
    from packtool.format import load_manifest

    manifest = load_manifest(output)
    counts, packs = manifest["counts"].get("train") or {}, int(manifest["packs"].get("train", 0))
    trained = int(counts.get("packed", 0)) + int(counts.get("truncated", 0))
    if packs <= 0 or trained <= 0:
        raise ValueError(f"{output} has no packed train samples")
    per_pack = trained / packs
    gbs = max(data_parallel, round(samples_per_step / per_pack / data_parallel) * data_parallel)
    gbs = min(gbs, packs // data_parallel * data_parallel or data_parallel)
    iters = max(1, math.floor(epochs * packs / gbs))
    return {"global_batch_size": gbs, "train_iters": iters, "samples_per_pack": per_pack, "packs": packs}


def dataset_config(output: str, seq_length: int, *, do_validation: bool, num_workers: int = 2,
                   shuffle_buffer_size: int = 100, loss_mode: str = "token") -> Any:
    """A Megatron-Bridge dataset config loading OUTPUT through packtool's `MegatronBridgeTaskEncoder`, registered
    with Megatron-Bridge's dataset registry (`megatron.bridge.data.utils`)."""
    from megatron.bridge.data import utils as mb_data
    from megatron.bridge.data.base import DataloaderConfig, DatasetBuildContext
    from megatron.bridge.data.packing.config import PackedSequenceSpecs

    @dataclass(kw_only=True)
    class PacktoolDatasetConfig(DataloaderConfig):
        path: str
        seq_length: int
        micro_batch_size: int = 1
        dataloader_type: str | None = "external"
        shuffle_buffer_size: int = 100
        do_validation: bool = True
        #: Megatron-Bridge's declaration of a dataset packed ahead of time, read by its steps (middle pipeline
        #: stages get the THD boundaries) and its validation (micro batch 1); nothing packs the packs again.
        enable_offline_packing: bool = True
        offline_packing_specs: Any = None
        #: How each target token weighs in the step (packtool's loss modes: token, sample, square).
        loss_mode: str = "token"

    def build(num_samples: list[int], config: PacktoolDatasetConfig, tokenizer: Any = None,
              pg_collection: Any = None) -> tuple[Any, Any, None]:
        from megatron.bridge.data.energon.base_energon_datamodule import EnergonMultiModalDataModule

        from packtool.runtime.loader import MegatronBridgeTaskEncoder

        context = DatasetBuildContext(train_samples=num_samples[0], valid_samples=num_samples[1],
                                      test_samples=num_samples[2], tokenizer=tokenizer, pg_collection=pg_collection)
        validation = config.do_validation and context.valid_samples > 0
        module = EnergonMultiModalDataModule(
            path=config.path, tokenizer=context.tokenizer, seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size, num_workers=config.num_workers, pin_memory=config.pin_memory,
            shuffle_buffer_size=config.shuffle_buffer_size, max_samples_per_sequence=None,
            task_encoder=MegatronBridgeTaskEncoder(loss_mode=config.loss_mode),
            validation_task_encoder=MegatronBridgeTaskEncoder(loss_mode=config.loss_mode),
            packing_buffer_size=None, pg_collection=context.pg_collection,
        )
        train = iter(module.train_dataloader()) if context.train_samples > 0 else None
        return train, iter(module.val_dataloader()) if validation else None, None

    mb_data._REGISTRY[PacktoolDatasetConfig] = build
    return PacktoolDatasetConfig(path=output, seq_length=seq_length, num_workers=num_workers,
                                 shuffle_buffer_size=shuffle_buffer_size, do_validation=do_validation,
                                 offline_packing_specs=PackedSequenceSpecs(packed_sequence_size=seq_length),
                                 loss_mode=loss_mode)


def configure(cfg, output: str, *, context_parallel: int = 1, samples_per_step: int | None = None,
              epochs: float = 1.0, fp8: bool = False, loss_mode: str = "token"):
    """Point a Megatron-Bridge `ConfigContainer` (e.g. a stock VLM SFT recipe) at a packtool OUTPUT."""
    tp, sp = cfg.model.tensor_model_parallel_size, bool(cfg.model.sequence_parallel)
    packed = packed_settings(output, context_parallel=context_parallel, tensor_parallel=tp, sequence_parallel=sp,
                             fp8=fp8)
    cfg.model.seq_length = packed["seq_length"]
    cfg.model.context_parallel_size = context_parallel
    # At every CP: the step divides by the global sum of the batches' loss_mask (packtool's loss_weights), so a
    # sample weighs as its loss mode says whatever it was packed with (at CP > 1 Megatron-Bridge asserts it too).
    cfg.model.calculate_per_token_loss = True
    cfg.ddp.average_in_collective = False
    cfg.train.micro_batch_size = packed["micro_batch_size"]
    if samples_per_step is not None:
        model_parallel = tp * context_parallel * cfg.model.pipeline_model_parallel_size
        world = int(os.environ.get("WORLD_SIZE", model_parallel))
        steps = schedule(output, samples_per_step=samples_per_step, epochs=epochs,
                         data_parallel=max(1, world // model_parallel))
        cfg.train.global_batch_size, cfg.train.train_iters = steps["global_batch_size"], steps["train_iters"]
    cfg.dataset = dataset_config(output, packed["seq_length"], do_validation=packed["has_val"], loss_mode=loss_mode)
    if not packed["has_val"]:
        cfg.validation.eval_iters = 0
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="a packtool OUTPUT folder")
    parser.add_argument("--context-parallel", type=int, default=1)
    parser.add_argument("--samples-per-step", type=int, default=None,
                        help="source samples per optimizer step (the global batch size in packs follows)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--fp8", action="store_true", help="check the row length suits FP8 (a multiple of 16)")
    parser.add_argument("--loss-mode", choices=("token", "sample", "square"), default="token",
                        help="how each target token weighs in the step (sample: the per-sample mean)")
    args = parser.parse_args()

    from megatron.bridge.recipes.qwen_vl.qwen25_vl import qwen25_vl_3b_sft_config
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.vlm_step import forward_step

    cfg = configure(qwen25_vl_3b_sft_config(), args.output, context_parallel=args.context_parallel,
                    samples_per_step=args.samples_per_step, epochs=args.epochs, fp8=args.fp8,
                    loss_mode=args.loss_mode)
    finetune(config=cfg, forward_step_func=forward_step)


if __name__ == "__main__":
    main()
