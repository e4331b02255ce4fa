"""Packed == unpacked with real varlen attention: a tiny random Llama-style model, forward and backward.

Each pack from `read_packs` -> `to_megatron` runs as ONE row through a varlen attention kernel fed with
`cu_seqlens_q_padded` (flash-attn's `flash_attn_varlen_func`, or torch's `varlen_attn`, or a per-segment SDPA
loop); every segment is then run alone with plain causal SDPA. Per-token losses and parameter gradients must agree.
A control run that treats the row as one sequence must NOT agree (the check can fail).

    python scripts/gpu_parity.py                 # CUDA: fp32 per-segment SDPA + bf16 varlen kernel
    python scripts/gpu_parity.py --device cpu    # same script on CPU (fp32, per-segment SDPA)
    python scripts/gpu_parity.py --packed OUTPUT # packs of a real `packtool pack` output instead of synthetic ones

Prints max differences and PASS/FAIL per check; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from packtool.runtime.megatron_batch import to_megatron  # noqa: E402
from packtool.runtime.read import IGNORE_INDEX, read_packs  # noqa: E402

TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (6e-2, 6e-2)}  # (per-token loss abs, grad rel)


def kernel_for(name: str, device: torch.device, dtype: torch.dtype):
    """(label, fn(q, k, v, cu, max_len, scale) -> out) with q/k/v `[T, H, D]`, causal within each cu segment.

    A kernel that fails to import or to run a tiny smoke call falls back to the per-segment SDPA loop, unless it
    was asked for by name."""
    candidates = []
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if name in ("auto", "flash"):
            candidates.append(("flash_attn_varlen_func", _flash))
        if name in ("auto", "torch"):
            candidates.append(("torch varlen_attn", _torch_varlen))
    for label, make in candidates:
        try:
            fn = make()
            q = torch.randn(16, 4, 32, device=device, dtype=dtype)
            k = torch.randn(16, 2, 32, device=device, dtype=dtype)
            cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=device)
            torch.testing.assert_close(fn(q, k, k, cu, 11, 0.2).float(), sdpa_loop(q, k, k, cu, 11, 0.2).float(),
                                       atol=2e-2, rtol=2e-2)
            return label, fn
        except Exception as error:  # report and fall back
            if name != "auto":
                raise
            print(f"note: {label} unavailable ({type(error).__name__}: {error}); trying the next kernel")
    return "per-segment SDPA", sdpa_loop


def _flash():
    from flash_attn import flash_attn_varlen_func

    return lambda q, k, v, cu, m, s: flash_attn_varlen_func(q, k, v, cu, cu, m, m, softmax_scale=s, causal=True)


def _torch_varlen():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return lambda q, k, v, cu, m, s: varlen_attn(q, k, v, cu, cu, m, m, scale=s, window_size=(-1, 0),
                                                     enable_gqa=True)

    def expanded(q, k, v, cu, m, s):
        """Older torch (2.11) takes no `enable_gqa`: repeat each key/value head for its group of query heads."""
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, m, m, scale=s, window_size=(-1, 0))

    return expanded


def sdpa_loop(q, k, v, cu, max_len, scale):
    """Reference varlen attention: causal SDPA on each `[cu[i], cu[i+1])` separately."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
    return out


def register_varlen(kernel) -> str:
    """Register a transformers attention function that runs `kernel` on the row's `cu_seq_lens_q`."""
    from transformers import AttentionInterface

    def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, D]
        out = kernel(q, k, v, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scaling)
        return out[None], None  # [1, T, H, D]

    AttentionInterface.register("packtool_varlen", varlen_attention)
    return "packtool_varlen"


def tiny_llama(vocab: int, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def summed_loss(logits, labels):
    return F.cross_entropy(logits[0].float(), labels[0], ignore_index=IGNORE_INDEX, reduction="none")


def run_pack(model, batch, attn: str, cu: torch.Tensor, max_len: int):
    """Per-token loss of the packed row and the gradients of its summed target loss."""
    model.zero_grad()
    model.set_attn_implementation(attn)
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len).logits
    loss = summed_loss(logits, batch["labels"])
    loss.sum().backward()
    return loss.detach(), [p.grad.detach().float().clone() for p in model.parameters()]


def run_alone(model, batch):
    """Every segment on its own (plain causal SDPA), gradients accumulated over segments."""
    model.zero_grad()
    model.set_attn_implementation("sdpa")
    cu, cup = batch["cu_seqlens_q"].tolist(), batch["cu_seqlens_q_padded"].tolist()
    losses = torch.zeros_like(batch["labels"][0], dtype=torch.float32)
    for k in range(len(cu) - 1):
        a, n = cup[k], cu[k + 1] - cu[k]
        logits = model(input_ids=batch["tokens"][:, a:a + n]).logits
        loss = summed_loss(logits, batch["labels"][:, a:a + n])
        loss.sum().backward()
        losses[a:a + n] = loss.detach()
    return losses, [p.grad.detach().float().clone() for p in model.parameters()]


def compare(packed, alone, real: torch.Tensor) -> tuple[float, float]:
    loss_diff = (packed[0] - alone[0])[real].abs().max().item()
    grad_rel = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(packed[1], alone[1]))
    return loss_diff, grad_rel


def synthetic(out: Path, align: int, packs: int, pack_size: int) -> Path:
    import packfixture as fx

    rng = np.random.default_rng(align)
    data = []
    for p in range(packs):
        segs, used = [], 0
        while True:
            n = int(rng.integers(8, pack_size // 3))
            if used + -(-n // align) * align > pack_size:
                break
            used += -(-n // align) * align
            segs.append({"key": f"p{p}s{len(segs)}", "tokens": rng.integers(0, fx.VOCAB_SIZE, n).tolist(),
                         "targets": (rng.random(n) < 0.5).astype(int).tolist()})
        data.append(segs)
    return fx.write_packs(out / f"align{align}", {"train": data}, pack_size=pack_size, align=align,
                          image_token_id=None, with_tokenizer=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernel", default="auto", choices=["auto", "flash", "torch", "loop"],
                    help="varlen kernel for the half-precision check on CUDA")
    ap.add_argument("--packs", type=int, default=3)
    ap.add_argument("--pack-size", type=int, default=1024)
    ap.add_argument("--packed", type=Path, help="read this packed OUTPUT (split train) instead of synthetic packs")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtypes = [(torch.float32, "loop")] + ([(torch.bfloat16, args.kernel)] if device.type == "cuda" else [])

    tmp = tempfile.TemporaryDirectory()
    if args.packed:
        sources = {"given": args.packed}
    else:
        sources = {f"align {a}": synthetic(Path(tmp.name), a, args.packs, args.pack_size) for a in (1, 8)}
    failed = False
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}")
    for dtype, kernel_name in dtypes:
        label, kernel = kernel_for(kernel_name, device, dtype)
        attn = register_varlen(kernel)
        loss_tol, grad_tol = TOLERANCE[dtype]
        for name, path in sources.items():
            batches = [to_megatron(b, device) for b in islice(read_packs(path, images=False), args.packs)]
            vocab = max(int(b["tokens"].max()) for b in batches) + 1
            model = tiny_llama(vocab, device, dtype)
            for i, batch in enumerate(batches):
                real = ~batch["padding_mask"][0]
                alone = run_alone(model, batch)
                packed = run_pack(model, batch, attn, batch["cu_seqlens_q_padded"], int(batch["max_seqlen_q"]))
                whole = torch.tensor([0, batch["tokens"].shape[1]], dtype=torch.int32, device=device)
                control = run_pack(model, batch, attn, whole, batch["tokens"].shape[1])
                loss_diff, grad_rel = compare(packed, alone, real)
                control_diff, _ = compare(control, alone, real)
                segments = len(batch["cu_seqlens_q"]) - 1
                # One segment: the whole-row control IS the right attention, so it cannot differ.
                ok = loss_diff <= loss_tol and grad_rel <= grad_tol and (segments == 1 or control_diff > loss_tol)
                failed |= not ok
                print(f"{'PASS' if ok else 'FAIL'}  {str(dtype):15} {label:22} {name:8} pack {i}: "
                      f"{segments} segments, {int(real.sum())}/{real.numel()} real tokens | "
                      f"max |Δloss| {loss_diff:.2e} (tol {loss_tol:.0e})  max grad rel diff {grad_rel:.2e} "
                      f"(tol {grad_tol:.0e})  control |Δloss| {control_diff:.2e} "
                      f"({'must exceed tol' if segments > 1 else 'one segment: not checked'})")
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
