"""One optimizer step of transformers' ``Trainer`` (or TRL's ``SFTTrainer``) with packtool's
:class:`~packtool.runtime.hf.PackedLossTrainer` over the first packs of an output, and the gradient it applies.

Run in-process by ``tests/test_loss_weights.py``, and as a script under ``torch.distributed.run`` (2 processes on
CPU, gloo): each process saves the gradient it applies after DDP's averaging::

    python -m torch.distributed.run --nproc_per_node 2 tests/hf_step.py OUTPUT TOKENIZER MODE GA RESULT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lossgrad as lg

#: The packs one step takes: processes x micro-batches x packs per micro-batch.
STEP_PACKS = 4


def step_gradient(output: Path, tokenizer: Path, mode: str, *, accumulation: int, per_device: int,
                  run_dir: Path, sft: bool = False) -> torch.Tensor:
    """The gradient the trainer's first optimizer step applies (clipping off), flattened."""
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from packtool.runtime.hf import HFPackCollator, HFPackDataset, PackedLossTrainer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    model = lg.tiny_model(len(tok))
    packs = HFPackDataset(output, loss_mode=mode, family="none")  # text rows for the text model
    seen: list[torch.Tensor] = []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone())

    common = dict(output_dir=str(run_dir), max_steps=1, per_device_train_batch_size=per_device,
                  gradient_accumulation_steps=accumulation, learning_rate=0.0, max_grad_norm=0.0, report_to=[],
                  save_strategy="no", use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False)
    if sft:
        from trl import SFTConfig, SFTTrainer

        class PackedSFTTrainer(PackedLossTrainer, SFTTrainer):
            pass

        args = SFTConfig(**common, bf16=False, dataset_kwargs={"skip_prepare_dataset": True}, packing=False,
                         padding_free=False, max_length=None)
        items = packs.index_dataset().select(range(STEP_PACKS))
        trainer = PackedSFTTrainer(model=model, args=args, train_dataset=items, processing_class=tok,
                                   data_collator=HFPackCollator(packs, loss_mode=mode), callbacks=[Grab()])
    else:
        class PackedTrainer(PackedLossTrainer, Trainer):
            pass

        trainer = PackedTrainer(model=model, args=TrainingArguments(**common),
                                train_dataset=torch.utils.data.Subset(packs, range(STEP_PACKS)),
                                data_collator=HFPackCollator(loss_mode=mode), callbacks=[Grab()])
    trainer.train()
    assert len(seen) == 1, seen
    return seen[0]


def main(argv: list[str]) -> None:
    import os

    output, tokenizer, mode, accumulation, result = argv
    grad = step_gradient(Path(output), Path(tokenizer), mode, accumulation=int(accumulation), per_device=1,
                         run_dir=Path(result) / "run")
    torch.save(grad, Path(result) / f"grad{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
