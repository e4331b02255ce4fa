"""Hand a reader batch to Megatron: the batch Megatron-Bridge's training steps consume, or tensors on a device plus
THD `PackedSeqParams` for a Megatron-Core model called directly.

`megatron_bridge_batch(batch)` gives exactly what Megatron-Bridge's `vlm_step` (Qwen2.5-VL and other VLMs) and
`gpt_step` (LLMs) read from their data iterator, on the host (the steps move it to the GPU themselves):

| key | dtype, shape | from the reader batch |
|---|---|---|
| `tokens`, `labels`, `position_ids` | int64 `[1, ΣL]` | same (`B > 1` rows of `collate_packs` flattened) |
| `loss_mask` | float32 `[1, ΣL]` | same |
| `padding_mask` | bool `[1, ΣL]` | same (True on padding; `gpt_step` hands it to MoE routing) |
| `cu_seqlens_q`, `cu_seqlens_kv` | int32 `[S + 1]` | `cu_seqlens_unpadded` (real boundaries) |
| `cu_seqlens_q_padded`, `cu_seqlens_kv_padded` | int32 `[S + 1]` | `cu_seqlens_padded` (`[-1]` = row length) |
| `max_seqlen_q`, `max_seqlen_kv` | int32 0-d tensor (host key) | `max_seqlen` |
| `total_tokens` | int | row length (Megatron-Core derives `seq_idx` for hybrid/Mamba models from it) |
| `attention_mask` | None | THD attention builds its own |
| `visual_inputs` | `VisualInputs` | `pixel_values` float32 `[Σpatches, C·t·p·p]`, `image_grid_thw` int64 `[n, 3]` |
| `keys`, `pack_key` | list / str | same (ignored by the steps) |

The steps treat a batch as packed only when it has `cu_seqlens_q`; they build `PackedSeqParams(qkv_format="thd")`
from the `cu_seqlens_*`/`max_seqlen_*` keys and read the host keys with `.cpu()` (so they are tensors, not ints).
`visual_inputs` (None for a batch without images) is moved to the GPU attribute by attribute and expanded with
`normalized_for_model()` into the model's keyword arguments.

`to_megatron(batch, device)` is the same batch with its tensors on `device` plus `packed_seq_params`, for training
loops that call a Megatron-Core model themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from packtool.read import ROW_KEYS

#: Keys Megatron-Bridge's steps keep on the host (`.cpu()`); every other tensor goes to the GPU.
HOST_KEYS = ("max_seqlen_q", "max_seqlen_kv")


@dataclass
class VisualInputs:
    """Image tensors of a batch, in the shape Megatron-Bridge's VLM step expects: every attribute a tensor or None
    (the step moves them one by one), `normalized_for_model()` the model's keyword arguments."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device) -> VisualInputs:
        return VisualInputs(*(None if v is None else v.to(device, non_blocking=True)
                              for v in (self.pixel_values, self.image_grid_thw)))


def megatron_bridge_batch(batch: dict) -> dict:
    """Reader batch (one pack, or several from `collate_packs`) -> Megatron-Bridge step batch (table above)."""
    out = {key: batch[key].reshape(1, -1) for key in ROW_KEYS}
    length = out["tokens"].shape[1]
    cu = batch["cu_seqlens_unpadded"].to(torch.int32)
    cu_padded = batch["cu_seqlens_padded"].to(torch.int32)
    if int(cu_padded[-1]) != length:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu_padded[-1])}, the row has {length} tokens")
    max_seqlen = int(batch["max_seqlen"])
    visual = None
    if batch.get("pixel_values") is not None and len(batch["pixel_values"]):
        visual = VisualInputs(batch["pixel_values"], batch["image_grid_thw"])
    out.update(
        cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=torch.tensor(max_seqlen, dtype=torch.int32),
        max_seqlen_kv=torch.tensor(max_seqlen, dtype=torch.int32),
        total_tokens=length, attention_mask=None, visual_inputs=visual,
        keys=batch["keys"], pack_key=batch["pack_key"],
    )
    return out


def packed_seq_params(mb: dict):
    """THD `PackedSeqParams` of a Megatron-Bridge batch (or a dict of its fields without `megatron.core`)."""
    params = dict(qkv_format="thd", cu_seqlens_q=mb["cu_seqlens_q"], cu_seqlens_kv=mb["cu_seqlens_kv"],
                  cu_seqlens_q_padded=mb["cu_seqlens_q_padded"], cu_seqlens_kv_padded=mb["cu_seqlens_kv_padded"],
                  max_seqlen_q=int(mb["max_seqlen_q"]), max_seqlen_kv=int(mb["max_seqlen_kv"]))
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return params
    return PackedSeqParams(**params)


def to_megatron(batch: dict, device: torch.device | str = "cuda") -> dict:
    """Reader batch -> `megatron_bridge_batch` with its tensors on `device` (host keys stay on the host) and
    `packed_seq_params` for a Megatron-Core model's `forward(..., packed_seq_params=...)`."""
    out = megatron_bridge_batch(batch)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and key not in HOST_KEYS:
            out[key] = value.to(device, non_blocking=True)
    if out["visual_inputs"] is not None:
        out["visual_inputs"] = out["visual_inputs"].to(device)
    out["packed_seq_params"] = packed_seq_params(out)
    return out
