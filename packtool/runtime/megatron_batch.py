"""Hand a reader batch to Megatron: the batch Megatron-Bridge's training steps consume, or tensors on a device plus
THD `PackedSeqParams` for a Megatron-Core model called directly.

`megatron_bridge_batch(batch)` gives exactly what Megatron-Bridge's `vlm_step` (Qwen2.5-VL and other VLMs) and
`gpt_step` (LLMs) read from their data iterator, on the host (the steps move it to the GPU themselves):

| key | dtype, shape | from the reader batch |
|---|---|---|
| `tokens`, `labels`, `position_ids` | int64 `[1, ΣL]` | same (`B > 1` rows of `collate_packs` flattened) |
| `loss_mask` | float32 `[1, ΣL]` | `loss_weights` (the target mask under `token` without weights; see below) |
| `padding_mask` | bool `[1, ΣL]` | same (True on padding; `gpt_step` hands it to MoE routing) |
| `cu_seqlens_q`, `cu_seqlens_kv` | int32 `[S + 1]` | `cu_seqlens_unpadded` (real boundaries) |
| `cu_seqlens_q_padded`, `cu_seqlens_kv_padded` | int32 `[S + 1]` | `cu_seqlens_padded` (`[-1]` = row length) |
| `max_seqlen_q`, `max_seqlen_kv` | int32 0-d tensor (host key) | `max_seqlen` |
| `total_tokens` | int | row length (Megatron-Core derives `seq_idx` for hybrid/Mamba models from it) |
| `attention_mask` | None | THD attention builds its own |
| `visual_inputs` | `VisualInputs` | images: `pixel_values` float32 `[Σpatches, C·t·p·p]`, `image_grid_thw` int64 |
| | | `[n, 3]`; videos: `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts` float32 `[v]` |
| `keys`, `pack_key` | list / str | same (ignored by the steps) |

A kind of media the batch lacks leaves its `VisualInputs` fields None (Qwen2.5-VL's forward skips them).

Nemotron Omni batches (reader batches with `image_grid_hw`, see `packtool.families.nemotron_omni.reader`) are laid
out (`packtool.families.nemotron_omni.bridge_batch`) for Megatron-Bridge's `nemotron_omni_step` and its
processor-expanded `NemotronOmniModel` instead:

| key | dtype, shape | content |
|---|---|---|
| `visual_inputs` | `VisualInputs`, or None | `pixel_values` float32 `[1, Σpatches, 3·p·p]`: image, frame patches |
| `imgs_sizes` | int64 `[n_images + Σframes, 2]` | pixel (height, width) of each image and each video frame |
| `num_frames` | int64 `[n_images + n_videos]` | 1 per image, a video's frame count |
| `sound_clips` | float32 `[clips, mel frames, mel bins]`, or None | the feature extractor's `input_features` |
| `sound_length` | int64 `[clips]`, or None | `input_features_mask.sum(-1) + 1` (or the reader's, see below) |
| `num_image_tiles` | int32 `[images + tubelets]` | only under Megatron-Bridge's preset (see below) |

Patches follow placeholder order: images and video chunks share the `<image>` placeholder, and the model replaces
them in order. A one-frame video is repeated to `temporal_patch_dim` frames, as Megatron-Bridge's own collate
does, so the temporal embedder (not the image one) takes it. `sound_length` is the length transformers' model gives
the audio encoder's subsampling rule (`get_audio_features`), so the encoder yields exactly each clip's
`<so_embedding>` count (Megatron-Bridge's own collate counts tokens from `mask.sum(-1)` and would differ by one
for some lengths).

Packs of `--preset megatron-bridge-nemotron-omni` (`packtool.families.nemotron_omni.mbridge_reader`) carry their own
`sound_length` and `num_image_tiles`, as Megatron-Bridge's collate gives them.

The steps treat a batch as packed only when it has `cu_seqlens_q`; they build `PackedSeqParams(qkv_format="thd")`
from the `cu_seqlens_*`/`max_seqlen_*` keys and read the host keys with `.cpu()` (so they are tensors, not ints).
`visual_inputs` (None for a batch without images) is moved to the GPU attribute by attribute and expanded with
`normalized_for_model()` into the model's keyword arguments.

`to_megatron(batch, device)` is the same batch with its tensors on `device` plus `packed_seq_params`, for training
loops that call a Megatron-Core model themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from packtool.readkit import VisualInputs, vision_fields, vision_inputs  # noqa: F401 (importable from here too)
from packtool.runtime.read import LOSS_MODE, ROW_KEYS, WHOLE_WEIGHTS
from packtool.runtime.registry import spec_of_batch

#: Keys Megatron-Bridge's steps keep on the host (`.cpu()`); every other tensor goes to the GPU.
HOST_KEYS = ("max_seqlen_q", "max_seqlen_kv")


def megatron_bridge_batch(batch: dict, *, temporal_patch_dim: int = 2) -> dict:
    """Reader batch (one pack, or several from `collate_packs`) -> Megatron-Bridge step batch (tables above; the
    media fields as the batch's family lays them out: its registered `TrainerLayouts.megatron_bridge`).
    `temporal_patch_dim`: frames per video tubelet of the model (`FamilyReader.temporal_patch_dim`; a Nemotron Omni
    model's processor's `video_temporal_patch_dim`, unused by the Qwen-VL layout)."""
    out = {key: batch[key].reshape(1, -1) for key in ROW_KEYS if key != "loss_weights"}
    out["loss_mask"] = megatron_loss_mask(batch)
    length = out["tokens"].shape[1]
    cu = batch["cu_seqlens_unpadded"].to(torch.int32)
    cu_padded = batch["cu_seqlens_padded"].to(torch.int32)
    if int(cu_padded[-1]) != length:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu_padded[-1])}, the row has {length} tokens")
    max_seqlen = int(batch["max_seqlen"])
    layouts = spec_of_batch(batch).layouts
    if layouts.megatron_bridge_refused is not None:
        raise ValueError(layouts.megatron_bridge_refused)
    layout = layouts.function("megatron_bridge")
    assert layout is not None  # every family has one (the shared one by default)
    out.update(layout(batch, temporal_patch_dim))
    out.update(
        cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=torch.tensor(max_seqlen, dtype=torch.int32),
        max_seqlen_kv=torch.tensor(max_seqlen, dtype=torch.int32),
        total_tokens=length, attention_mask=None, keys=batch["keys"], pack_key=batch["pack_key"],
    )
    return out


#: The factor on a ``sample`` / ``square`` batch's weights in Megatron-Bridge's ``loss_mask`` (see
#: :func:`megatron_loss_mask`), and on a ``token`` batch's of an output with fractional weights.
MEGATRON_WEIGHT_SCALE = 2 ** 16
MEGATRON_TOKEN_SCALE = 2 ** 8


def megatron_loss_mask(batch: Mapping) -> torch.Tensor:
    """The ``loss_mask`` Megatron-Bridge's loss multiplies each token's loss by: the reader batch's
    ``loss_weights`` (float32 ``[1, ΣL]``).

    With ``calculate_per_token_loss``, Megatron-Core divides the step's summed loss by the sum of every
    micro-batch's ``loss_mask``, counted as a whole number (``masked_next_token_loss`` truncates it to an int). Under
    ``token`` with whole-number weights (the target mask where none is given) the count is exact and the weights
    go as they are. Otherwise they are fractions: they are scaled by :data:`MEGATRON_WEIGHT_SCALE`
    (``sample``, ``square``) or :data:`MEGATRON_TOKEN_SCALE` (``token``), and by ``1 + 0.5 / T`` (``T`` the
    micro-batch's scaled sum), so that the truncated count is the nearest whole number to ``T``: the step is then
    the weighted mean to within ``0.5 / T`` (below 1e-5 for a micro-batch of one sample of weight 1). The scale
    cancels in the step; the count stays in int32 for up to 32,767 samples of weight 1 per global batch
    (``sample``) or 8.3M weighted target tokens (``token`` with fractional weights)."""
    weights = batch["loss_weights"].reshape(1, -1)
    mode = batch.get(LOSS_MODE, "token")
    if mode == "token" and batch.get(WHOLE_WEIGHTS, True):
        return weights.float()
    scale = MEGATRON_TOKEN_SCALE if mode == "token" else MEGATRON_WEIGHT_SCALE
    total = float(batch["loss_weight_sum"].double().sum()) * scale
    if total <= 0:
        return weights.float()
    return (weights.double() * (scale * (1 + 0.5 / total))).float()


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
