"""One real Megatron-Core forward and backward on packtool's Megatron-Bridge batches, against the same samples run
unpacked: a tiny random GPTModel (Transformer Engine layers, bf16), packed THD rows vs each sample alone.

    python scripts/megatron_step.py                               # one GPU, context parallel 1
    torchrun --nproc-per-node 2 scripts/megatron_step.py --cp 2   # context parallel 2 (two GPUs)
    python scripts/megatron_step.py --packed OUTPUT               # packs of a text `packtool pack` output

Each pack goes `read_packs` -> `megatron_bridge_batch` (the batch `MegatronBridgeTaskEncoder` yields) ->
`PackedSeqParams` built as Megatron-Bridge's `get_packed_seq_params` builds it (its own function when importable)
-> `GPTModel(..., packed_seq_params=...)`; under context parallelism the row is split as Megatron does for THD
(`thd_get_partitioned_indices` over the padded boundaries), each sample alone with the usual 2·cp zigzag split.
Checks, printed with their numbers: per-token loss of every real token and the parameter gradients agree between
packed and alone; a control (the packed row with no `packed_seq_params`, so samples see each other) must NOT
agree. Needs megatron-core (Python >= 3.12) and transformer-engine; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from packtool.runtime.megatron_batch import megatron_bridge_batch  # noqa: E402
from packtool.runtime.read import read_packs  # noqa: E402

LOSS_TOL, GRAD_TOL, CONTROL_FACTOR = 5e-2, 5e-2, 4.0


def init(cp: int):
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    if dist.get_world_size() != cp:
        raise SystemExit(f"--cp {cp} needs {cp} processes (torchrun --nproc-per-node {cp}), "
                         f"got {dist.get_world_size()}")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(0)
    return parallel_state.get_context_parallel_group()


def build_model(cp: int, vocab: int, max_len: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                               num_query_groups=2, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
                               init_method_std=0.05, context_parallel_size=cp, bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=vocab,
                     max_sequence_length=max_len, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.cuda()


def packed_seq_params(mb: dict):
    """`PackedSeqParams` from the batch, by Megatron-Bridge's own `get_packed_seq_params` when it imports."""
    try:
        from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    except ImportError:
        from packtool.runtime.megatron_batch import packed_seq_params as get_packed_seq_params
    keys = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
            "max_seqlen_kv")
    return get_packed_seq_params({k: mb[k].cuda() if k.startswith("cu_") else mb[k] for k in keys})


def thd_indices(cu_padded: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    if cp == 1:
        return torch.arange(total, device="cuda")
    import transformer_engine_torch as tex

    return tex.thd_get_partitioned_indices(cu_padded.cuda(), total, cp, rank).long()


def zigzag_indices(total: int, cp: int, rank: int) -> torch.Tensor:
    """Megatron's context-parallel split of an unpacked sequence: 2·cp chunks, rank r keeps r and 2·cp-1-r."""
    chunks = torch.arange(total, device="cuda").view(2 * cp, -1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def row_logits(model, tokens, positions, index, group, params=None) -> torch.Tensor:
    """fp32 logits `[T, V]` of the whole row: this rank runs its share `index` (with gradients), the other ranks'
    shares are gathered across the context-parallel group (without)."""
    logits = model(input_ids=tokens[:, index], position_ids=positions[:, index], attention_mask=None,
                   packed_seq_params=params)
    local = logits[0].float()
    total = tokens.shape[1]
    full = torch.zeros(total, local.shape[-1], device="cuda")
    world = dist.get_world_size(group)
    if world == 1:
        full[index] = local
    else:
        parts, idx = [torch.empty_like(local) for _ in range(world)], [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        dist.all_gather(idx, index.contiguous(), group=group)
        for p, i in zip(parts, idx):
            full[i] = p
        # gradients flow only through this rank's own share: put it back in place of the gathered copy
        full = full.index_put((index,), local)
    return full


def masked_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    return per_token * mask


def grads(model, group) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        g = torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float().clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(g, group=group)
        out[name] = g
    model.zero_grad(set_to_none=True)
    return out


def synthetic_packs(folder: Path, align: int) -> Path:
    import packfixture as fx

    rng = np.random.default_rng(0)
    packs = []
    for _ in range(2):
        segments = []
        for i in range(5):
            q = "".join(rng.choice(list("abcdefgh xyz"), size=int(rng.integers(5, 60))))
            a = "".join(rng.choice(list("0123456789 ."), size=int(rng.integers(3, 40))))
            segments.append(fx.chat_segment(f"s{len(packs)}{i}", q, a))
        packs.append(segments)
    return fx.write_packs(folder, {"train": packs}, pack_size=1024, align=align)


def check(name: str, value: float, ok: bool, failures: list[str]) -> None:
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3e}")
    if not ok:
        failures.append(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (= number of processes)")
    parser.add_argument("--packed", type=Path, default=None, help="a text-only packtool OUTPUT (default: synthetic)")
    args = parser.parse_args()
    group = init(args.cp)
    rank = dist.get_rank(group)
    path = args.packed or synthetic_packs(Path(tempfile.mkdtemp()), align=max(8, 2 * args.cp))
    batches = [megatron_bridge_batch(b) for b in read_packs(path, images=False)][:4]
    vocab = int(max(int(b["tokens"].max()) for b in batches)) + 1
    vocab = -(-vocab // 128) * 128
    model = build_model(args.cp, vocab, max(b["tokens"].shape[1] for b in batches))
    failures: list[str] = []
    for n, mb in enumerate(batches):
        tokens, positions = mb["tokens"].cuda(), mb["position_ids"].cuda()
        labels, mask = mb["labels"][0].cuda(), mb["loss_mask"][0].cuda()
        total = tokens.shape[1]
        cu, cu_padded = mb["cu_seqlens_q"].tolist(), mb["cu_seqlens_q_padded"].tolist()

        packed = row_logits(model, tokens, positions, thd_indices(mb["cu_seqlens_q_padded"], total, args.cp, rank),
                              group, packed_seq_params(mb))
        packed_loss = masked_loss(packed, labels, mask)
        packed_loss.sum().backward()
        packed_grads = grads(model, group)

        alone_loss = torch.zeros_like(packed_loss)
        for a, b, start in zip(cu[:-1], cu[1:], cu_padded[:-1]):
            length = b - a
            width = -(-length // (2 * args.cp)) * (2 * args.cp) if args.cp > 1 else length  # zigzag needs 2·cp chunks
            seg = torch.full((1, width), int(tokens[0, start + length - 1]), dtype=tokens.dtype, device="cuda")
            seg[0, :length] = tokens[0, start:start + length]
            logits = row_logits(model, seg, torch.arange(width, device="cuda")[None],
                                  zigzag_indices(width, args.cp, rank) if args.cp > 1 else torch.arange(width,
                                                                                                         device="cuda"),
                                  group)
            loss = masked_loss(logits[:length], labels[start:start + length], mask[start:start + length])
            loss.sum().backward()
            alone_loss[start:start + length] = loss.detach()
        alone_grads = grads(model, group)

        with torch.no_grad():
            leak = row_logits(model, tokens, positions, zigzag_indices(total, args.cp, rank) if args.cp > 1
                                else torch.arange(total, device="cuda"), group)
            leak_loss = masked_loss(leak, labels, mask)
        real = mask.bool()
        diff = (packed_loss.detach() - alone_loss)[real].abs().max().item()
        control = (leak_loss - alone_loss)[real].abs().max().item()
        grad_rel = max(((packed_grads[k] - alone_grads[k]).norm() / alone_grads[k].norm().clamp(min=1e-12)).item()
                       for k in packed_grads)
        if dist.get_rank() == 0:
            print(f"pack {n}: {len(cu) - 1} samples, {int(real.sum())} loss tokens of {total}; "
                  f"mean loss {packed_loss[real].mean().item():.4f}")
        check(f"pack {n} per-token loss |packed - alone| max", diff, diff <= LOSS_TOL, failures)
        check(f"pack {n} grad relative difference max", grad_rel, grad_rel <= GRAD_TOL, failures)
        check(f"pack {n} control (no packed_seq_params) |leaky - alone| max, must exceed "
              f"{CONTROL_FACTOR}x the packed difference", control, control > CONTROL_FACTOR * max(diff, 1e-6),
              failures)
    if dist.get_rank() == 0:
        print("FAILED: " + ", ".join(failures) if failures else f"ALL PASS (cp={args.cp})")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
