"""The media inputs of a Nemotron Omni pack, as transformers' ``nemotron_h_omni`` processor makes them.

A pack made for a Nemotron Omni model folder records its processor settings in the manifest
(``image_processor``: ``NemotronOmniSettings.manifest()``, ``family: nemotron_omni``). The normalisation and
feature-extraction settings those settings do not name (image mean/std, the video processor's ``norm_mean`` /
``norm_std``, the Parakeet feature extractor) come from the model folder copied into the output
(``.nv-meta/tokenizer/``), read the way transformers reads a folder (:func:`packtool.media.read_folder`). The
settings from the manifest win over the folder's, so CLI overrides made at packing time hold.

Per pack, in media order (the processor's own order within one sample):

* images: each sample's images go through the image processor in one call, as the processor does (the patch budget
  depends on how many images share the call): ``pixel_values`` float32 ``[Σ patches, 3·p·p]`` and
  ``image_grid_hw`` int64 ``[n, 2]``, exactly the processor's;
* videos: each video alone (the processor takes one video per call), only its planned frames decoded:
  the processor's ``pixel_values_videos`` ``[frames, 3, H, W]`` laid out as patches like the images
  (``[frames·h·w, 3·p·p]``, row-major patches, channel-major inside a patch: transformers'
  ``convert_image_to_patches``), so videos of different tiles share one tensor; ``video_grid_thw`` int64
  ``[n, 3]`` = (frames, tile height, tile width) in patches;
* audio: each sample's clips through the feature extractor in one call, as the processor does: ``input_features``
  float32 ``[clips, mel frames, mel bins]`` and ``input_features_mask`` bool ``[clips, mel frames]``, the
  processor's values padded with zeros (False) to the longest clip of the pack.

``media_kinds`` lists every item's kind in placeholder order, so images and video chunks (both ``<image>``
placeholders) can be interleaved back in token order. Each stored grid, frame count, sample count and token count
is checked against what the processor produced; a mismatch is a :class:`FormatError` naming the pack and member.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packtool.errors import FormatError
from packtool.families.nemotron_omni.family import NemotronOmniSettings
from packtool.format import MediaRef, PackRecord
from packtool.media import AudioFacts, read_folder
from packtool.readkit import pad_frames

#: CLIP's mean and standard deviation: Megatron-Bridge's temporal path and NeMo-RL's Nemotron visual path normalize
#: with these constants, not the model folder's.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: Keys of a sub-processor's saved settings that name its class rather than configure it.
_CLASS_KEYS = ("image_processor_type", "video_processor_type", "feature_extractor_type", "processor_class",
               "auto_map")


def settings_from_manifest(manifest: Mapping) -> NemotronOmniSettings:
    """The processor settings the pack's tokens were counted with."""
    return NemotronOmniSettings.from_manifest(manifest["image_processor"])


@dataclass(frozen=True)
class NemotronOmniProcessors:
    """transformers' Nemotron Omni image and video processors and Parakeet feature extractor, configured as the
    model folder says with the manifest's settings on top. Pass it as ``image_processor=`` to the reader."""

    settings: NemotronOmniSettings
    image: Any
    video: Any
    audio: Any

    @property
    def patch_dim(self) -> int:
        """Values per patch (``3·p·p``) of the image patches."""
        return 3 * self.settings.patch_size ** 2


def nemotron_processors(manifest: Mapping, model_dir: str | Path) -> NemotronOmniProcessors:
    """The processors for a Nemotron Omni dataset whose model folder copy is ``model_dir`` (an output's
    ``.nv-meta/tokenizer``). Cached per process, settings and folder. Needs torchvision."""
    return _cached(json.dumps(dict(manifest["image_processor"]), sort_keys=True), str(model_dir))


@functools.lru_cache(maxsize=8)
def _cached(entry_json: str, model_dir: str) -> NemotronOmniProcessors:
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
    )
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor,
    )
    from transformers.models.parakeet.feature_extraction_parakeet import ParakeetFeatureExtractor

    s = settings_from_manifest({"image_processor": json.loads(entry_json)})
    folder = read_folder(model_dir)

    def own(config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in _CLASS_KEYS}

    image = NemotronH_Omni_Reasoning_V3ImageProcessor(**{
        **own(folder.image), "patch_size": s.patch_size, "downsample_ratio": s.downsample_ratio,
        "min_num_patches": s.min_num_patches, "max_num_patches": s.max_num_patches,
        "max_model_len": s.max_model_len})
    video = NemotronH_Omni_Reasoning_V3VideoProcessor(**{
        **own(folder.video), "patch_size": s.video_patch_size, "downsample_ratio": s.video_downsample_ratio,
        "video_target_num_patches": s.video_target_num_patches,
        "video_maintain_aspect_ratio": s.video_maintain_aspect_ratio, "do_sample_frames": False})
    audio = ParakeetFeatureExtractor(**{**own(folder.audio), "sampling_rate": s.audio_sampling_rate})
    return NemotronOmniProcessors(s, image, video, audio)


def nemotron_media(record: PackRecord, processors: NemotronOmniProcessors | None, where: str,
                   decode: bool) -> dict:
    """The pack's media inputs (module docstring). Without ``decode`` only the stored grids and kinds."""
    refs = record.media_refs
    for m in refs:
        if m.kind not in ("image", "video", "audio"):
            raise FormatError(f"{where}: media kind {m.kind!r} (member {m.member}) is not a Nemotron Omni kind")
    images = [m for m in refs if m.kind == "image"]
    videos = [m for m in refs if m.kind == "video"]
    out: dict[str, Any] = {
        "media_kinds": [m.kind for m in refs],
        "image_grid_hw": _grids(images, where, 2),
        "video_grid_thw": _grids(videos, where, 3),
    }
    if not decode:
        return out
    if processors is None:
        if refs:
            raise ValueError(f"{where} has Nemotron Omni media but no processors: pass image_processor="
                             f"packtool.families.nemotron_omni.reader.nemotron_processors(manifest, "
                             f"OUTPUT/.nv-meta/tokenizer) or images=False")
        return out
    out.update(_images(record, processors, where))
    out.update(_videos(record, videos, processors, where))
    out.update(_audio(record, processors, where))
    return out


def _grids(media: Sequence[MediaRef], where: str, width: int) -> torch.Tensor:
    """Stored grids of images (``[1, h, w]``, returned as ``[h, w]``: ``width`` 2) or of videos
    (``[frames, h, w]``: ``width`` 3)."""
    rows = []
    for m in media:
        if len(m.grid_thw) != 3 or (m.kind == "image" and m.grid_thw[0] != 1):
            raise FormatError(f"{where}: {m.member} has grid {m.grid_thw}, not a Nemotron Omni {m.kind} grid")
        rows.append(m.grid_thw[3 - width:])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, width)


def _images(record: PackRecord, p: NemotronOmniProcessors, where: str) -> dict:
    """Each segment's images in one processor call (their shared patch budget is the sample's)."""
    from packtool.readkit import open_stored_image  # the reader's one image decoder

    merge = round(1 / p.settings.downsample_ratio)
    values, grids = [], []
    for seg in record.segments:
        media = [m for m in seg.media if m.kind == "image"]
        if not media:
            continue
        pil = [open_stored_image(record.media[m.member], f"{where}, member {m.member}") for m in media]
        try:
            result = p.image(images=pil, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise FormatError(f"{where}: the image processor refuses the images of segment {seg.key} "
                              f"({type(exc).__name__}: {exc})") from None
        grid = result["image_grid_hw"].to(torch.int64)
        for m, (gh, gw) in zip(media, grid.tolist()):
            if m.grid_thw != [1, gh, gw] or m.tokens != gh * gw // merge ** 2:
                raise FormatError(f"{where}: {m.member} processes to grid [1, {gh}, {gw}] "
                                  f"({gh * gw // merge ** 2} tokens), stored {m.grid_thw} ({m.tokens} tokens)")
        values.append(result["pixel_values"].to(torch.float32))
        grids.append(grid)
    return {"pixel_values": torch.cat(values) if values else torch.zeros((0, p.patch_dim), dtype=torch.float32),
            "image_grid_hw": torch.cat(grids) if grids else torch.zeros((0, 2), dtype=torch.int64)}


def _videos(record: PackRecord, videos: Sequence[MediaRef], p: NemotronOmniProcessors, where: str) -> dict:
    """Each video alone, its planned frames only, the processor told not to sample again."""
    from packtool.media import decode_frames, decode_video

    s = p.settings
    patch, step = s.video_patch_size, s.video_temporal_patch_dim
    values = []
    for m in videos:
        if not m.frame_indices:  # frames chosen by seconds (NeMo-RL's rule), not frame numbers
            raise FormatError(f"{where}, member {m.member}: a video packed with --preset nemo-rl-nemotron-omni takes "
                              f"NeMo-RL's frames by their seconds: read it with NeMo-RL's task encoder "
                              f"(packtool.runtime.nemo_rl)")
        try:
            if m.frames:
                frames = decode_frames([record.media[f] for f in m.frames], m.frame_indices)
            else:
                frames = decode_video(record.media[m.member], m.frame_indices)
        except (ValueError, OSError, IndexError) as exc:
            raise FormatError(f"{where}, member {m.member}: video does not decode ({exc})") from None
        try:  # frames are THWC (a video 1 or 3 pixels high would otherwise be read as channels first)
            result = p.video(videos=[frames], do_sample_frames=False, input_data_format="channels_last",
                             return_tensors="pt")
        except (ValueError, TypeError, RuntimeError) as exc:
            raise FormatError(f"{where}, member {m.member}: the video processor refuses the video "
                              f"({type(exc).__name__}: {exc})") from None
        pixels = result["pixel_values_videos"]
        n, _, height, width = pixels.shape
        grid = [n, height // patch, width // patch]
        tokens = -(-n // step) * int(result["num_tokens"][0])
        if m.grid_thw != grid or m.tokens != tokens:
            raise FormatError(f"{where}: {m.member} processes to grid {grid} ({tokens} tokens), "
                              f"stored {m.grid_thw} ({m.tokens} tokens)")
        values.append(_patches(pixels.to(torch.float32), patch))
    dim = 3 * patch ** 2
    return {"pixel_values_videos": torch.cat(values) if values else torch.zeros((0, dim), dtype=torch.float32)}


def _patches(frames: torch.Tensor, patch: int) -> torch.Tensor:
    """``[n, C, H, W]`` -> ``[n·(H/p)·(W/p), C·p·p]``: frame by frame, row-major patches, each channel-major (the
    layout of the image processor's ``pixel_values``)."""
    n, c, h, w = frames.shape
    x = frames.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * (h // patch) * (w // patch), c * patch * patch).contiguous()


def _audio(record: PackRecord, p: NemotronOmniProcessors, where: str) -> dict:
    """Each segment's clips through the feature extractor in one call, as the processor does per sample (so the
    features are the processor's to the bit), padded with zeros to the pack's longest clip."""
    from packtool.media import decode_audio

    s = p.settings
    features, masks = [], []
    for seg in record.segments:
        clips = [m for m in seg.media if m.kind == "audio"]
        if not clips:
            continue
        waves = []
        for m in clips:
            try:
                wave = decode_audio(record.media[m.member], rate=s.audio_sampling_rate,
                                    max_samples=s.max_audio_samples)
            except (ValueError, OSError, IndexError) as exc:
                raise FormatError(f"{where}, member {m.member}: audio does not decode ({exc})") from None
            tokens = s.audio_tokens(AudioFacts(len(wave), s.audio_sampling_rate, 1, "decode")) if len(wave) else 0
            if (m.samples and len(wave) != m.samples) or tokens != m.tokens:
                raise FormatError(f"{where}: {m.member} decodes to {len(wave)} samples ({tokens} tokens), "
                                  f"stored {m.samples} samples ({m.tokens} tokens)")
            waves.append(wave)
        result = p.audio(waves, sampling_rate=s.audio_sampling_rate, return_tensors="pt")
        features.append(result["input_features"].to(torch.float32))
        masks.append(result["attention_mask"].to(torch.bool))
    if not features:
        return {"input_features": torch.zeros((0, 0, int(p.audio.feature_size)), dtype=torch.float32),
                "input_features_mask": torch.zeros((0, 0), dtype=torch.bool)}
    width = max(f.shape[1] for f in features)
    return {"input_features": torch.cat([pad_frames(f, width) for f in features]),
            "input_features_mask": torch.cat([pad_frames(m, width) for m in masks])}


def check_recipe_options(manifest: Mapping, given: Mapping[str, Any], fields: Mapping[str, str],
                         processors: Any = None) -> None:
    """Refuse a trainer recipe's Nemotron Omni option (``given``: option -> value; ``fields``: option -> the
    processor setting it names) that differs from what the packs were made with, or that is given for packs of
    another model folder (``audio_num_mel_bins``: the model folder's feature extractor, checked when the media are
    read, ``processors`` holding it)."""
    family = (manifest.get("image_processor") or {}).get("family")
    for name, value in given.items():
        field_name = fields[name]
        if family != "nemotron_omni":
            raise FormatError(f"the recipe sets {name} {value!r}, a Nemotron Omni option, but the packs were made "
                              f"for a {family or 'text'} model folder: remove it")
        if field_name == "feature_size":
            audio = getattr(processors, "audio", None)
            if audio is None:
                continue  # media not read (images: false): no mel features to compare
            packed = getattr(audio, "feature_size", None)
        else:
            packed = getattr(settings_from_manifest(manifest), field_name)
        if value != packed:
            raise FormatError(f"the recipe sets {name} {value!r}, the packs were made with {packed!r} "
                              f"({field_name}): pack again with the recipe's setting, or set {name} to {packed!r}")
