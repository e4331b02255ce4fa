"""The media inputs of a pack made with ``--preset megatron-bridge-nemotron-omni``, as Megatron-Bridge's Nemotron Omni
collate makes them (:mod:`.mbridge`).

Everything follows from the manifest's ``image_processor.megatron_bridge`` entry (no model folder is read). Per
pack, in media order:

* ``pixel_values`` bfloat16 ``[Σ images·(c/p)², 3·p·p]``: each image decoded to RGB, resized to the ``c``×``c``
  canvas (bicubic, antialiased, ``align_corners=False``; not resized when already that size), scaled to [0, 1],
  normalized with CLIP's mean and standard deviation (Megatron-Bridge's constants, not the model folder's), cut into
  row-major ``p``×``p`` patches, channel-major inside a patch, cast to bfloat16 as the collate casts it;
* ``pixel_values_videos``: every frame of each frame-list video the same way, and the taken frames of each encoded
  video (``frame_indices``, decoded with PyAV, each through a JPEG round trip with PIL's defaults as Megatron-Bridge
  does; ``video_grid_thw`` ``[n, 3]`` = frames, canvas in patches); ``megatron_bridge_batch`` repeats a one-frame
  video to the tubelet, as the collate does;
* ``input_features`` float32 ``[clips, mel frames, mel bins]`` / ``input_features_mask``: each clip (decoded at 16
  kHz, cut to ``max_audio_duration``) through transformers' ``ParakeetFeatureExtractor(feature_size=num_mel_bins,
  sampling_rate=16000)`` alone, padded with zeros to the pack's longest clip; ``sound_length`` int64 ``[clips]``:
  the features' valid length (``audio_count="valid"``) or frame count (``"frames"``);
* ``num_image_tiles`` int32: one per image and per video tubelet.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from packtool.errors import FormatError
from packtool.families.nemotron_omni.reader import CLIP_MEAN, CLIP_STD, _grids, _patches
from packtool.format import PackRecord
from packtool.readkit import pad_frames


def canvas_patches(image: Any, canvas: int, patch: int) -> torch.Tensor:
    """``[(canvas/patch)², 3·patch²]`` float32 patches of a PIL image on the square canvas (module docstring)."""
    import numpy as np

    pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8))
    x = pixels.permute(2, 0, 1)[None].to(torch.float32)
    if tuple(x.shape[-2:]) != (canvas, canvas):
        x = torch.nn.functional.interpolate(x, size=(canvas, canvas), mode="bicubic", align_corners=False,
                                            antialias=True)
    x = x[0] / 255.0
    x = (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    return _patches(x[None], patch)


def jpeg_frames(record: PackRecord, m: Any, where: str) -> list[Any]:
    """The taken frames of an encoded video (its ``frame_indices``, decoded with PyAV to RGB), each saved as a JPEG
    with PIL's defaults and opened again, as Megatron-Bridge hands decord's frames on as JPEG data URLs."""
    import io

    from PIL import Image

    from packtool.media import decode_video

    if len(m.frame_indices) != m.grid_thw[0]:
        raise FormatError(f"{where}: {m.member} takes {len(m.frame_indices)} frames, grid {m.grid_thw}")
    try:
        pixels = decode_video(record.media[m.member], m.frame_indices)
    except (ValueError, OSError) as exc:
        raise FormatError(f"{where}, member {m.member}: video does not decode ({exc})") from None
    out = []
    for frame in pixels:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="JPEG")
        out.append(Image.open(io.BytesIO(buffer.getvalue())))
    return out


@functools.lru_cache(maxsize=4)
def feature_extractor(mel_bins: int, rate: int) -> Any:
    from transformers import ParakeetFeatureExtractor

    return ParakeetFeatureExtractor(feature_size=mel_bins, sampling_rate=rate)


def mbridge_media(record: PackRecord, entry: Mapping[str, Any], where: str, decode: bool) -> dict[str, Any]:
    """The pack's media inputs (module docstring); without ``decode`` only the stored grids and kinds."""
    from packtool.readkit import open_stored_image

    refs = record.media_refs
    canvas, patch, step = int(entry["canvas"]), int(entry["patch_dim"]), int(entry["temporal_patch_size"])
    side = canvas // patch
    tiles = []
    for m in refs:
        if m.kind not in ("image", "video", "audio"):
            raise FormatError(f"{where}: media kind {m.kind!r} (member {m.member}) is not a Nemotron Omni kind")
        if m.kind != "audio" and list(m.grid_thw[1:]) != [side, side]:
            raise FormatError(f"{where}: {m.member} has grid {m.grid_thw}, not the {canvas}-pixel canvas's")
        if m.kind != "audio":
            tiles += [1] * (1 if m.kind == "image" else -(-m.grid_thw[0] // step))
    out: dict[str, Any] = {
        "media_kinds": [m.kind for m in refs],
        "image_grid_hw": _grids([m for m in refs if m.kind == "image"], where, 2),
        "video_grid_thw": _grids([m for m in refs if m.kind == "video"], where, 3),
        "num_image_tiles": torch.tensor(tiles, dtype=torch.int32),
    }
    if not decode:
        return out
    images, frames = [], []
    for m in refs:
        if m.kind == "image":
            images.append(canvas_patches(open_stored_image(record.media[m.member], f"{where}, member {m.member}"),
                                         canvas, patch))
        elif m.kind == "video" and m.frames:
            if len(m.frames) != m.grid_thw[0]:
                raise FormatError(f"{where}: {m.member} holds {len(m.frames)} frames, grid {m.grid_thw}")
            frames += [canvas_patches(open_stored_image(record.media[f], f"{where}, member {f}"), canvas, patch)
                       for f in m.frames]
        elif m.kind == "video":
            frames += [canvas_patches(image, canvas, patch) for image in jpeg_frames(record, m, where)]
    dim = 3 * patch * patch
    empty = torch.zeros((0, dim), dtype=torch.bfloat16)
    out["pixel_values"] = torch.cat(images).to(torch.bfloat16) if images else empty
    out["pixel_values_videos"] = torch.cat(frames).to(torch.bfloat16) if frames else empty
    out.update(_audio(record, entry, where))
    return out


def _audio(record: PackRecord, entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each clip's features alone (Megatron-Bridge extracts them clip by clip), padded to the pack's longest."""
    from packtool.families.nemotron_omni.mbridge import AUDIO_RATE, audio_tokens
    from packtool.media import decode_audio

    mel_bins = int(entry["num_mel_bins"])
    limit = int(float(entry["max_audio_duration"]) * AUDIO_RATE)
    features, masks, lengths = [], [], []
    for m in record.media_refs:
        if m.kind != "audio":
            continue
        try:
            wave = decode_audio(record.media[m.member], rate=AUDIO_RATE, max_samples=limit)
        except (ValueError, OSError, IndexError) as exc:
            raise FormatError(f"{where}, member {m.member}: audio does not decode ({exc})") from None
        tokens = audio_tokens(len(wave), entry["audio_count"])
        if (m.samples and len(wave) != m.samples) or tokens != m.tokens:
            raise FormatError(f"{where}: {m.member} decodes to {len(wave)} samples ({tokens} tokens), "
                              f"stored {m.samples} samples ({m.tokens} tokens)")
        result = feature_extractor(mel_bins, AUDIO_RATE)(wave, sampling_rate=AUDIO_RATE, return_tensors="pt",
                                                         return_attention_mask=True)
        mask = result["attention_mask"].to(torch.bool)
        features.append(result["input_features"].to(torch.float32))
        masks.append(mask)
        lengths.append(int(mask.sum()) if entry["audio_count"] == "valid" else mask.shape[1])
    if not features:
        return {"input_features": torch.zeros((0, 0, mel_bins), dtype=torch.float32),
                "input_features_mask": torch.zeros((0, 0), dtype=torch.bool),
                "sound_length": torch.zeros(0, dtype=torch.int64)}
    width = max(f.shape[1] for f in features)
    return {"input_features": torch.cat([pad_frames(f, width) for f in features]),
            "input_features_mask": torch.cat([pad_frames(m, width) for m in masks]),
            "sound_length": torch.tensor(lengths, dtype=torch.int64)}
