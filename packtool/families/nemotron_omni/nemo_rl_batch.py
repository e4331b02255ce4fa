"""NeMo-RL's Nemotron Omni inputs of a pack (its ``nemotron_multimodal`` path), for the packed batch of
:mod:`packtool.runtime.nemo_rl`: one segment per image or video (``pixel_values`` float32 ``[frames, 3, H, W]``,
``imgs_sizes``, ``num_frames``) and per audio item (``sound_clips``, ``sound_length``). The family hands them to the
runtime (Nemotron Omni's registered NeMo-RL layout, :func:`family_inputs`)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from packtool.errors import FormatError
from packtool.families.nemotron_omni.reader import CLIP_MEAN, CLIP_STD
from packtool.format import PackRecord
from packtool.readkit import open_stored_image


def nemotron_inputs(record: PackRecord, manifest: Mapping, where: str,
                    feature_extractor=None) -> dict[str, list[torch.Tensor]]:
    """NeMo-RL's Nemotron Omni inputs of a pack's images, videos and audio (its ``_process_media`` and
    ``_process_audio``): each image, and each video's frames (:func:`_nemotron_video_frames`), resized with PIL
    to its stored patch grid, scaled to [0, 1] and normalised with CLIP's mean and std; each audio item cut into
    NeMo-RL's 30 s clips (its stored sample count), each clip's mel features through the model folder's feature
    extractor (``feature_extractor``), zero-padded to the item's longest clip, with its valid frames. The waveform
    is packtool's decode (mono, resampled with soxr where the source has another rate; NeMo-RL resamples with
    librosa)."""
    refs = record.media_refs
    other = [m for m in refs if m.kind not in ("image", "video", "audio")]
    if other:
        raise FormatError(f"{where}: {other[0].kind} member {other[0].member}: the NeMo-RL batch of Nemotron Omni "
                          f"packs carries images, videos and audio")
    out = _nemotron_images(record, [m for m in refs if m.kind in ("image", "video")], manifest, where)
    audio = [m for m in refs if m.kind == "audio"]
    if audio:
        if feature_extractor is None:
            raise ValueError(f"{where} has audio but no feature extractor: pass the model folder's processors")
        out.update(_nemotron_sound(record, audio, manifest, where, feature_extractor))
    return out


def _nemotron_sound(record: PackRecord, refs: list, manifest: Mapping, where: str,
                    feature_extractor) -> dict[str, list[torch.Tensor]]:
    from packtool.families.nemo_rl_rules import settings_audio_plan
    from packtool.families.nemotron_omni.reader import settings_from_manifest
    from packtool.media import decode_audio

    s = settings_from_manifest(manifest)
    rate = s.audio_sampling_rate
    clips_out, lengths_out = [], []
    for m in refs:
        try:
            wave = decode_audio(record.media[m.member], rate=rate)
        except (ValueError, OSError, IndexError) as exc:
            raise FormatError(f"{where}, member {m.member}: audio does not decode ({exc})") from None
        plan = settings_audio_plan(m.samples, rate, s)
        wave = np.pad(wave, (0, max(0, plan.samples - len(wave))))[:plan.samples]
        mels, valid = [], []
        start = 0
        for n in plan.clip_samples:
            result = feature_extractor(wave[start:start + n], sampling_rate=rate, return_tensors="pt",
                                       return_attention_mask=True)
            mels.append(result["input_features"][0].to(torch.float32))
            valid.append(int(result["attention_mask"].sum()))
            start += n
        if tuple(valid) != plan.frames:
            raise FormatError(f"{where}: {m.member} gives {valid} mel frames, NeMo-RL's clips {list(plan.frames)}")
        clips = torch.zeros((len(mels), max(x.shape[0] for x in mels), mels[0].shape[1]), dtype=torch.float32)
        for i, mel in enumerate(mels):
            clips[i, :mel.shape[0]] = mel
        clips_out.append(clips)
        lengths_out.append(torch.tensor(valid, dtype=torch.long))
    return {"sound_clips": clips_out, "sound_length": lengths_out}


def _nemotron_images(record: PackRecord, refs: list, manifest: Mapping, where: str) -> dict[str, list[torch.Tensor]]:
    """NeMo-RL's ``_process_media`` of a pack's images and videos, one segment per item in placeholder order."""
    if not refs:
        return {}
    patch = int(manifest["image_processor"].get("patch_size", 16))
    mean = torch.tensor(CLIP_MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(CLIP_STD, dtype=torch.float32)[:, None, None]
    out: dict[str, list[torch.Tensor]] = {"pixel_values": [], "imgs_sizes": [], "num_frames": []}
    for m in refs:
        _, grid_h, grid_w = m.grid_thw
        if m.kind == "video":
            pictures = _nemotron_video_frames(record, m, manifest, where)
        else:
            pictures = [open_stored_image(record.media[m.member], f"{where}, member {m.member}")]
        pixels = []
        for picture in pictures:
            # as NeMo-RL's Energon decoder (pilrgb) hands it over: convert("RGB") drops an alpha channel (no
            # compositing onto a background), palette and CMYK converted by PIL
            resized = picture.convert("RGB").resize((grid_w * patch, grid_h * patch), Image.Resampling.BICUBIC)
            tensor = torch.from_numpy(np.array(resized, copy=True)).permute(2, 0, 1).to(torch.float32).div_(255)
            pixels.append((tensor - mean) / std)
        out["pixel_values"].append(torch.stack(pixels))
        out["imgs_sizes"].append(torch.tensor([[grid_h * patch, grid_w * patch]] * len(pixels), dtype=torch.int32))
        out["num_frames"].append(torch.tensor([len(pixels)], dtype=torch.long))
    return out


def _nemotron_video_frames(record: PackRecord, ref: Any, manifest: Mapping, where: str) -> list[Image.Image]:
    """The frames NeMo-RL's encoder takes from a video: the Megatron rule's seconds (from the recorded Energon
    duration and frame count), each decoded by Energon's ``AVDecoder.get_clips`` (its first frame at that time; a
    short decode repeats its last frame), as RGB pictures."""
    from megatron.energon.av import AVDecoder

    from packtool.families.nemo_rl_rules import video_timestamps

    temporal = int(manifest["image_processor"].get("video_temporal_patch_dim", 2))
    try:
        seconds = video_timestamps(float(ref.duration or 0), ref.total_frames, temporal_patch=temporal)
        if len(seconds) != ref.grid_thw[0]:
            raise ValueError(f"the frame rule takes {len(seconds)} frames, recorded {ref.grid_thw[0]}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # Energon's note on seeking by frames
            clips = list(AVDecoder(io.BytesIO(bytes(record.media[ref.member]))).get_clips(
                video_clip_ranges=[(t, t) for t in seconds], video_unit="seconds").video_clips)
    except Exception as exc:  # PyAV's own error types
        raise FormatError(f"{where}, member {ref.member}: video does not decode ({exc})") from None
    if not clips:
        raise FormatError(f"{where}, member {ref.member}: no frame decodes at NeMo-RL's times")
    clips += [clips[-1]] * (len(seconds) - len(clips))
    return [Image.fromarray(clip[0].permute(1, 2, 0).numpy()) for clip in clips[:len(seconds)]]




def family_inputs(reader: Any, record: PackRecord, processor: Any, where: str) -> dict[str, list[Any]]:
    """NeMo-RL's layout of a Nemotron Omni pack's media (the family's registered ``nemo_rl_media``, given the
    family's reader): images and audio (the feature extractor: ``processor.audio``); a convention's reader laid
    out for another trainer refuses (its ``nemo_rl_refused``)."""
    why = getattr(reader, "nemo_rl_refused", None)
    if why:
        raise ValueError(why)
    return nemotron_inputs(record, {"image_processor": reader.family.rule.manifest()}, where,
                           getattr(processor, "audio", None))


def patch_dim(reader: Any) -> int:
    """Pixels per patch side of the images in NeMo-RL's batch (the family's registered ``nemo_rl_patch_dim``,
    given the family's reader)."""
    return int(reader.family.rule.patch_size)
