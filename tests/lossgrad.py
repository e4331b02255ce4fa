"""What the loss-weight proofs share: a packed output of conversations with very different reply lengths and
weights, a tiny random text model in float64, each token's loss, and the unpacked step each loss mode stands for.

Used by ``tests/test_loss_weights.py`` and by ``tests/mbridge_loss.py`` (in Megatron-Bridge's pins environment)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

#: Reply lengths (words) and loss weights of the samples; packed at PACK_SIZE they give packs of 1 to 8 samples.
REPLIES = [3, 100, 1, 30, 2, 2, 60, 5, 1, 40, 4, 8, 1, 90, 3, 20, 2, 6, 1, 1, 50, 2]
WEIGHTS = [1, 2.5, 1, 0.5, 3, 1, 1, 0, 1, 1.5, 1, 2, 1, 1, 0.25, 1, 1, 4, 1, 1, 1, 2]
PACK_SIZE = 512


def write_conversations(path: Path, weights: bool = True) -> Path:
    """A JSONL of chats (``loss_weight`` on each record where ``weights``)."""
    with open(path, "w") as f:
        for i, (n, w) in enumerate(zip(REPLIES, WEIGHTS)):
            rec: dict = {"messages": [{"role": "user", "content": f"question {i}: " + "why " * (1 + i % 5)},
                                      {"role": "assistant", "content": " ".join("ok" for _ in range(n))}]}
            if weights:
                rec["loss_weight"] = w
            f.write(json.dumps(rec) + "\n")
    return path


def tiny_model(vocab: int):
    """A random two-layer Qwen2 text model in float64 (sdpa: packed rows attend within their segments)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).double()


def shifted_token_losses(model, tokens: torch.Tensor, position_ids: torch.Tensor,
                         labels: torch.Tensor) -> torch.Tensor:
    """Each position's loss of predicting its (already shifted, reader's) label; 0 where the label is -100."""
    logits = model(input_ids=tokens, position_ids=position_ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="none").reshape(labels.shape)


def segments_alone(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sample of a reader batch alone: its tokens ``[1, n]`` and shifted labels ``[1, n]``."""
    cu, cu_padded = batch["cu_seqlens_unpadded"].tolist(), batch["cu_seqlens_padded"].tolist()
    out = []
    for i in range(len(cu) - 1):
        start, n = cu_padded[i], cu[i + 1] - cu[i]
        out.append((batch["tokens"][:, start:start + n], batch["labels"][:, start:start + n]))
    return out


def unpacked_loss(model, batches: list[dict], weights: list[float], mode: str) -> torch.Tensor:
    """The step an unpacked run takes on the same samples (one sample a row) under ``mode``: ``token`` the
    weighted per-token mean, ``sample`` the weighted mean of per-sample means, ``square`` weights ``w / sqrt(n)``."""
    num, den = torch.zeros((), dtype=torch.float64), 0.0
    samples = [s for b in batches for s in segments_alone(b)]
    assert len(samples) == len(weights)
    for (tokens, labels), w in zip(samples, weights):
        losses = shifted_token_losses(model, tokens, torch.arange(tokens.shape[1])[None], labels)
        n = int((labels != -100).sum())
        if n == 0:
            continue
        scale = {"token": w, "sample": w / n, "square": w / np.sqrt(n)}[mode]
        num = num + scale * losses.sum()
        den += scale * n
    return num / den


def gradient(model, loss: torch.Tensor, retain: bool = False) -> torch.Tensor:
    """The model's gradient of ``loss``, flattened (``retain``: keep the graph for another loss of it)."""
    model.zero_grad()
    loss.backward(retain_graph=retain)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``."""
    return float((a - b).abs().max() / b.abs().max())
