"""Hand a reader batch to Megatron: tensors on the device plus THD `PackedSeqParams`.

`to_megatron(batch, device)` returns the keys Megatron-Bridge's VLM/GPT forward steps read from a batch:

| key | from the reader batch |
|---|---|
| `tokens`, `labels`, `loss_mask`, `position_ids`, `padding_mask` | same, `[1, ΣL]` (`B > 1` rows flattened) |
| `cu_seqlens_q`, `cu_seqlens_kv` | `cu_seqlens` (int32, device) |
| `cu_seqlens_q_padded`, `cu_seqlens_kv_padded` | `cu_seqlens_padded` (int32, device) |
| `max_seqlen_q`, `max_seqlen_kv` | `max_seqlen` (int32 `[1]`, host) |
| `visual_inputs` | `VisualInputs(pixel_values, image_grid_thw)` on the device, or None |
| `attention_mask` | None (THD attention builds its own) |
| `packed_seq_params` | `PackedSeqParams(qkv_format="thd", ...)` of the above (dict without `megatron.core`) |

Megatron-Bridge builds its own `PackedSeqParams` from the flat `cu_seqlens_*`/`max_seqlen_*` keys; Megatron-Core
models take `packed_seq_params=` directly. The tail padding of a fixed-size row lies inside the last padded
segment (see `packtool.read`), so `cu_seqlens_q_padded[-1]` equals the row length as THD kernels require.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from packtool.read import ROW_KEYS


@dataclass
class VisualInputs:
    """Image tensors of a batch, in the shape Megatron-Bridge's VLM step expects (`normalized_for_model()`)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int):
    """THD `PackedSeqParams` (same q and kv boundaries), or a dict with its fields without `megatron.core`."""
    params = dict(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                  cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                  max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return params
    return PackedSeqParams(**params)


def to_megatron(batch: dict, device: torch.device | str = "cuda") -> dict:
    """Reader batch (one pack, or several from `collate_packs`) -> Megatron inputs on `device` (table above)."""
    out = {key: batch[key].reshape(1, -1).to(device, non_blocking=True) for key in ROW_KEYS}
    cu = batch["cu_seqlens"].to(device, torch.int32, non_blocking=True)
    cu_padded = batch["cu_seqlens_padded"].to(device, torch.int32, non_blocking=True)
    if int(batch["cu_seqlens_padded"][-1]) != out["tokens"].shape[1]:
        raise ValueError("cu_seqlens_padded does not cover the row")
    max_seqlen = int(batch["max_seqlen"])
    host_max = torch.tensor([max_seqlen], dtype=torch.int32)
    out.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
               max_seqlen_q=host_max, max_seqlen_kv=host_max, attention_mask=None,
               packed_seq_params=packed_seq_params(cu, cu_padded, max_seqlen))
    visual = None
    if batch.get("pixel_values") is not None and len(batch["pixel_values"]):
        visual = VisualInputs(batch["pixel_values"].to(device, non_blocking=True),
                              batch["image_grid_thw"].to(device, non_blocking=True))
    out["visual_inputs"] = visual
    return out
