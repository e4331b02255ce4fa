"""The Megatron-Bridge batch fields of a Nemotron Omni reader batch (Megatron-Bridge's ``nemotron_omni_step``):
``visual_inputs``, ``imgs_sizes``, ``num_frames``, ``sound_clips``, ``sound_length`` (and ``num_image_tiles`` for
packs of ``--preset megatron-bridge-nemotron-omni``). The family hands them to
:func:`packtool.runtime.megatron_batch.megatron_bridge_batch` (Nemotron Omni's registered Megatron-Bridge layout)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from packtool.readkit import VisualInputs


def nemotron_inputs(batch: Mapping, temporal_patch_dim: int) -> dict:
    """`visual_inputs`, `imgs_sizes`, `num_frames`, `sound_clips`, `sound_length` of a Nemotron Omni batch."""
    out: dict = {"visual_inputs": None, "imgs_sizes": None, "num_frames": None, "sound_clips": None,
                 "sound_length": None}
    kinds = [k for k in batch["media_kinds"] if k != "audio"]
    if kinds and batch.get("pixel_values") is not None:
        patch = {key: round((batch[key].shape[-1] // 3) ** 0.5) for key in ("pixel_values", "pixel_values_videos")}
        images = _split(batch["pixel_values"], batch["image_grid_hw"].prod(-1))
        videos = _split(batch["pixel_values_videos"], batch["video_grid_thw"].prod(-1))
        image_grids, video_grids = iter(batch["image_grid_hw"].tolist()), iter(batch["video_grid_thw"].tolist())
        patches, sizes, frames = [], [], []
        for kind in kinds:
            if kind == "image":
                h, w = next(image_grids)
                patches.append(next(images))
                sizes.append([h * patch["pixel_values"], w * patch["pixel_values"]])
                frames.append(1)
            else:
                n, h, w = next(video_grids)
                video = next(videos)
                if n == 1 and temporal_patch_dim > 1:  # one frame: repeated, or the model takes it for an image
                    video, n = video.repeat(temporal_patch_dim, 1), temporal_patch_dim
                patches.append(video)
                sizes += [[h * patch["pixel_values_videos"], w * patch["pixel_values_videos"]]] * n
                frames.append(n)
        out.update(visual_inputs=VisualInputs(pixel_values=torch.cat(patches)[None]),
                   imgs_sizes=torch.tensor(sizes, dtype=torch.int64),
                   num_frames=torch.tensor(frames, dtype=torch.int64))
    if batch.get("input_features") is not None and len(batch["input_features"]):
        length = batch.get("sound_length")  # the reader's own count (Megatron-Bridge's preset), else transformers'
        out.update(sound_clips=batch["input_features"],
                   sound_length=length if length is not None else batch["input_features_mask"].sum(-1).to(
                       torch.int64) + 1)
    if kinds and batch.get("num_image_tiles") is not None:  # Megatron-Bridge's preset: one per image, per tubelet
        out["num_image_tiles"] = batch["num_image_tiles"]
    return out


def _split(values: torch.Tensor, rows: torch.Tensor):
    """Iterator over consecutive blocks of `values` holding `rows[i]` rows each."""
    return iter(torch.split(values, rows.tolist()))


