"""Megatron-Bridge's Nemotron Omni Energon path, run as is on a dataset: each sample's batch, saved for the test.

``python mbridge_nemotron_ref.py ROOT DATASET MODEL_FOLDER OUT`` imports Megatron-Bridge from ``ROOT`` (the 0.6.2
wheel's folder, or main's ``src/``) with :mod:`mbridge_ref`'s stubs, builds ``NemotronOmniTaskEncoder`` with its
Energon recipe's settings around transformers' own Nemotron Omni processor of ``MODEL_FOLDER``, reads ``DATASET``
with Energon's loader one sample a batch, and saves ``{key: fields}`` to ``OUT`` (``torch.save``). It runs in a
process of its own, so the two Megatron-Bridge versions (and the stubs) never share one. ``PACKTOOL_DECORD_DIR`` names
a folder holding decord (which Megatron-Bridge decodes encoded videos with) where ``ROOT`` has none.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

#: Megatron-Bridge's Energon recipe for Nemotron Omni (``_make_nemotron_omni_energon_dataset``).
RECIPE = {"seq_length": 4096, "max_audio_duration": 10.0, "num_mel_bins": 128, "visual_keys": ("pixel_values",),
          "temporal_patch_size": 2, "video_fps": 1.0, "video_nframes": 8, "use_temporal_video_embedder": True,
          "patch_dim": 16}


def run(root: Path, dataset: Path, folder: Path) -> dict[str, dict]:
    import mbridge_ref

    energon = mbridge_ref.load("data.energon.nemotron_omni_task_encoder", root)
    collate = mbridge_ref.load("models.nemotron_omni.data.collate_fn", root)
    if os.environ.get("PACKTOOL_DECORD_DIR"):  # decord (its video decoder) from another folder, after Megatron-Bridge
        sys.path.append(os.environ["PACKTOOL_DECORD_DIR"])
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    class Keyed(energon.NemotronOmniTaskEncoder):
        """Megatron-Bridge's encoder, its batch also naming its sample (its ``encode_batch`` drops the keys)."""

        def encode_batch(self, batch):
            return {**super().encode_batch(batch), "key": batch.__keys__[0]}

    encoder = Keyed(processor, **RECIPE)
    loader = get_loader(get_val_dataset(dataset, split_part="train", batch_size=1, task_encoder=encoder,
                                        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0)))
    per_tubelet = collate._pixel_shuffled_token_count(height=collate.VISION_FRAME_SIZE,
                                                      width=collate.VISION_FRAME_SIZE, patch_dim=RECIPE["patch_dim"])
    out = {}
    for batch in loader:
        real = batch["attention_mask"][0].bool() if batch.get("attention_mask") is not None else \
            torch.ones_like(batch["input_ids"][0], dtype=torch.bool)
        vi = batch.get("visual_inputs")
        out[batch["key"]] = {
            "tokens": batch["input_ids"][0][real], "labels": batch["labels"][0][real],
            "loss_mask": batch["loss_mask"][0][real],
            "pixel_values": None if vi is None else vi.pixel_values,
            **{k: batch.get(k) for k in ("imgs_sizes", "num_frames", "num_image_tiles", "sound_clips",
                                         "sound_length")},
            "per_tubelet": per_tubelet, "version": mbridge_ref.version(root),
        }
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    root, dataset, folder, target = (Path(a) for a in sys.argv[1:5])
    torch.save(run(root, dataset, folder), target)
