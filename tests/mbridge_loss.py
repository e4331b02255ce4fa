"""Run by Megatron-Bridge's pins environment (``.venv-mbridge``): the step Megatron-Bridge takes on a packtool OUTPUT
read with each loss mode, against the same samples trained unpacked. Prints one JSON object.

Real code: packtool's ``MegatronBridgeTaskEncoder`` batch (``megatron_bridge_batch``) and Megatron-Bridge's own
``masked_next_token_loss`` (its wheel, with the stand-ins of ``mbridge_validate.py`` for CUDA-only packages). The
normalization is Megatron-Core's schedule's, written out (it needs a process group): with
``calculate_per_token_loss`` every micro-batch's summed loss is added up and the gradient divided by the sum of the
micro-batches' integer ``num_tokens`` over all micro-batches and data-parallel ranks; without it each micro-batch's
loss is divided by its own ``num_tokens`` and averaged (the control).

usage: python mbridge_loss.py OUTPUT TOKENIZER_DIR
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lossgrad as lg
from mbridge_validate import _StandIns


def main() -> None:
    output, tokenizer = sys.argv[1], sys.argv[2]
    sys.meta_path.insert(0, _StandIns())
    warnings.simplefilter("ignore")
    import torch
    from megatron.bridge.training.losses import masked_next_token_loss
    from transformers import AutoTokenizer

    from packtool.runtime.megatron_batch import megatron_bridge_batch
    from packtool.runtime.read import read_packs

    model = lg.tiny_model(len(AutoTokenizer.from_pretrained(tokenizer)))
    result: dict = {}
    references = {}
    for mode in ("token", "sample", "square"):
        packs = list(read_packs(output, loss_mode=mode))
        ranks = [packs[0::2], packs[1::2]]  # 2 data-parallel ranks, one pack per micro-batch
        weights = [lg.WEIGHTS[int(k.split(":")[0])] for rank in ranks for b in rank for k in b["keys"]]
        want = references[mode] = lg.gradient(model, lg.unpacked_loss(model, [b for rank in ranks for b in rank],
                                                                    weights, mode))
        outputs = []
        for rank in ranks:
            for b in rank:
                mb = megatron_bridge_batch(b)
                losses = lg.shifted_token_losses(model, mb["tokens"], mb["position_ids"], mb["labels"])
                loss, num_tokens, _ = masked_next_token_loss(mb["loss_mask"], losses, check_for_nan_in_loss=False)
                assert num_tokens.dtype == torch.int32
                outputs.append((loss, num_tokens))
        total = sum(int(n) for _, n in outputs)  # the all-reduced int count
        per_token = lg.gradient(model, sum(loss for loss, _ in outputs) / total, retain=mode == "token")
        result[mode] = lg.relative(per_token, want)
        result[f"{mode}_count"] = total
        if mode == "token":  # the control: Megatron-Core without calculate_per_token_loss (the per-pack mean)
            mean = lg.gradient(model, sum(loss / n.clamp(min=1) for loss, n in outputs) / len(outputs))
            result["per_pack_mean_vs_token"] = lg.relative(mean, want)
            result["per_pack_mean_vs_sample"] = None
            control = mean
        else:
            result[f"{mode}_vs_token"] = lg.relative(want, references["token"])
    result["per_pack_mean_vs_sample"] = lg.relative(control, references["sample"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
