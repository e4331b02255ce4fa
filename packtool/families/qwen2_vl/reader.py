"""The reader's side of Qwen2-VL / Qwen2.5-VL: transformers' image and video processors built from a manifest's
settings, a pack's video tensors, Megatron-Bridge's two-step resizes (qwen_vl_utils' ``fetch_image`` /
``fetch_video``) and the per-segment 3-D rope (:func:`mrope_position_ids`).

The base layout's image path (:func:`packtool.runtime.read.vision_media`) is shared with the other families that
lay their images out as Qwen2-VL does; the family object hands it this module's pieces (:class:`.family.Qwen2VL`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from packtool.errors import FormatError
from packtool.format import PackRecord
from packtool.readkit import check_video_grids, decode_planned_videos


def qwen_image_processor(settings: Mapping):
    """transformers' Qwen2-VL image processor (PIL backend: the same numbers with or without torchvision) with the
    image settings ``settings`` (a manifest's ``image_processor`` entry). Cached: one per process and settings."""
    return _cached_processor(json.dumps(dict(settings), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _cached_processor(settings_json: str):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import is_torchvision_available

    s = json.loads(settings_json)
    cls: Any = Qwen2VLImageProcessorPil
    # The backend the manifest names (a convention's), else the one AutoProcessor picks: torchvision when it is
    # installed (the two resize differently, so the pixels are always the model processor's).
    if s.get("backend", "torchvision" if is_torchvision_available() else "pil") == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        cls = Qwen2VLImageProcessor
    return cls(
        min_pixels=s["min_pixels"], max_pixels=s["max_pixels"], patch_size=s["patch_size"],
        merge_size=s["merge_size"], temporal_patch_size=s["temporal_patch_size"],
        image_mean=s["image_mean"], image_std=s["image_std"],
    )


@functools.lru_cache(maxsize=8)
def _cached_video_processor(settings_json: str):
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    s = json.loads(settings_json)
    config = {k: v for k, v in s["config"].items() if not k.endswith(("_type", "_class", "_auto_map"))}
    config.update(size={"shortest_edge": s["video_min_pixels"], "longest_edge": s["video_max_pixels"]},
                  patch_size=s["video_patch_size"], temporal_patch_size=s["video_temporal_patch_size"],
                  merge_size=s["video_merge_size"], do_sample_frames=False,
                  cap_pixels_per_frame=s["cap_pixels_per_frame"], max_video_tokens=s["max_video_tokens"])
    config.pop("min_pixels", None), config.pop("max_pixels", None)
    return Qwen2VLVideoProcessor(**config)


def video_processor_from_manifest(manifest: Mapping):
    """transformers' Qwen2-VL video processor with the settings the tokens were counted with, told not to sample
    (the reader hands it the planned frames); None when the dataset has no video settings. Needs torchvision."""
    from packtool.families import reader_of

    settings = reader_of(manifest).video_entry()
    return None if settings is None else _video_processor(settings)


def _video_processor(settings: Mapping):
    """The video processor of a ``video_processor`` entry (cached per settings)."""
    return _cached_video_processor(json.dumps(dict(settings), sort_keys=True))


def video_media(record: PackRecord, settings: Mapping, where: str, decode: bool) -> dict:
    """video_grid_thw and second_per_grid_ts of the pack's videos (+ pixel_values_videos when ``decode``): only
    the planned frames are decoded, and the processor is told not to sample again."""

    videos = [m for m in record.media_refs if m.kind == "video"]
    grids = np.array([m.grid_thw for m in videos], dtype=np.int64).reshape(-1, 3)
    out = {"video_grid_thw": torch.from_numpy(grids),
           "second_per_grid_ts": torch.tensor([float(m.second_per_grid_ts or 0.0) for m in videos],
                                              dtype=torch.float32)}
    if not decode:
        return out
    if not videos:  # the same keys in every batch, without building a processor
        dim = 3 * settings["video_temporal_patch_size"] * settings["video_patch_size"] ** 2
        out["pixel_values_videos"] = torch.zeros((0, dim), dtype=torch.float32)
        return out
    proc = _video_processor(settings)
    arrays, metadata = decode_planned_videos(record, videos, where)
    clips: list[Any] = arrays
    # Frames are THWC (a video 1 or 3 pixels high would otherwise be read as channels first).
    extra: dict[str, Any] = {"video_metadata": metadata, "input_data_format": "channels_last"}
    if settings.get("fetch_video"):  # as Megatron-Bridge hands them over: no metadata
        clips, extra = [fetch_video_frames(a, settings) for a in arrays], {}
    try:
        result = proc(videos=clips, do_sample_frames=False, return_tensors="pt", **extra)
    except (ValueError, TypeError, RuntimeError) as exc:
        members = ", ".join(m.member for m in videos)
        raise FormatError(f"{where}: the video processor refuses its videos ({members}; "
                          f"{type(exc).__name__}: {exc})") from None
    check_video_grids(result["video_grid_thw"], grids, videos, where)
    out["pixel_values_videos"] = result["pixel_values_videos"].to(torch.float32).contiguous()
    return out


def fetch_video_frames(frames: np.ndarray, settings: Mapping) -> torch.Tensor:
    """Frames ``(T, H, W, 3)`` as qwen_vl_utils' ``fetch_video`` hands them to the processor in Megatron-Bridge's
    Qwen-VL path: each resized as an image (bicubic), the last repeated to an even count, then the clip resized
    (torchvision, bicubic, antialiased) and made float: ``(T', 3, h, w)``."""
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    from packtool.families.qwen2_vl.family import Qwen2VLSettings, fetch_image_resize

    rule = Qwen2VLSettings.from_manifest(settings)
    factor = 2 * rule.video_patch_size * rule.video_merge_size
    t, height, width = frames.shape[:3]
    h, w = fetch_image_resize(height, width, factor, 4 * factor**2, 16384 * factor**2)
    resized = [np.asarray(Image.fromarray(f).convert("RGB").resize((w, h), Image.Resampling.BICUBIC)) for f in frames]
    resized += resized[-1:] * (t % 2)
    clip = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2)
    size = list(rule.fetched_size(height, width, len(resized)))
    return F.resize(clip, size, interpolation=InterpolationMode.BICUBIC, antialias=True).float()


def prefit_image(image, settings: Mapping):
    """The image resized first as the manifest's image settings say (``prefit_*``: qwen_vl_utils' ``fetch_image``
    in Megatron-Bridge's Qwen-VL path, which receives RGB images from Energon's decoder), before the processor."""
    from PIL import Image

    from packtool.families.qwen2_vl.family import ImageRule

    width, height = ImageRule.from_manifest(settings).prefit(image.width, image.height)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


def mrope_position_ids(
    tokens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    video_token_id: int | None = None,
    tokens_per_second: int = 2,
) -> torch.Tensor:
    """Qwen2/2.5-VL 3-D RoPE positions `[3, 1, L]` for a packed row, computed per segment.

    Each segment starts again at 0: text tokens advance all three rows by one; an image's or a video's
    `t·(h/m)·(w/m)` tokens get (temporal, row, column) offsets from the current position, after which the position
    advances by `max(h, w) / m`. A video's temporal offsets are `int(k · tokens_per_second · second_per_grid_ts)`
    for temporal patch `k` (transformers' `get_rope_index`; `tokens_per_second` is the model's
    `vision_config.tokens_per_second`), an image's are 0. Padding continues counting like text. Images and videos
    are taken from their grids in order. For transformers' Qwen2.5-VL packed forward use
    `torch.cat([batch["position_ids"][None], mrope_position_ids(...)])` (`[4, 1, L]`, row 0 the per-segment text
    positions) with `attention_mask=None, use_cache=False`.
    """
    row = tokens.reshape(-1).cpu().numpy()
    bounds = cu_seqlens_padded.cpu().numpy().astype(np.int64)

    def grids(thw: torch.Tensor | None):
        return iter([] if thw is None else thw.cpu().numpy().astype(np.int64).tolist())

    queues = {image_token_id: grids(image_grid_thw), video_token_id: grids(video_grid_thw)}
    seconds: Iterator[torch.Tensor] = iter(
        [] if second_per_grid_ts is None else second_per_grid_ts.cpu().to(torch.float32).reshape(-1))
    media_ids = [t for t in (image_token_id, video_token_id) if t is not None]
    out = np.empty((3, len(row)), dtype=np.int64)
    m = spatial_merge_size
    for a, b in zip(bounds[:-1], bounds[1:]):
        media_at = np.flatnonzero(np.isin(row[a:b], media_ids)) + a
        pos, i = 0, a
        while i < b:
            nxt = media_at[np.searchsorted(media_at, i)] if len(media_at) and media_at[-1] >= i else b
            out[:, i:nxt] = pos + np.arange(nxt - i)
            pos += nxt - i
            if nxt == b:
                break
            token = int(row[nxt])
            kind = "video" if token == video_token_id else "image"
            grid = next(queues[token], None)
            if grid is None:
                raise ValueError(f"{kind} tokens at {nxt} but no {kind} grid left")
            t, h, w = grid
            h, w = h // m, w // m
            n = t * h * w
            if (row[nxt:nxt + n] != token).any():
                raise ValueError(f"{kind} at {nxt} has fewer than its {n} tokens")
            temporal = np.zeros(t, dtype=np.int64)
            if kind == "video":
                spgt = next(seconds, None)
                if spgt is None:
                    raise ValueError(f"video at {nxt} has no second_per_grid_ts")
                temporal = (torch.arange(t) * (tokens_per_second * spgt)).long().numpy()
            tt, hh, ww = np.meshgrid(temporal, np.arange(h), np.arange(w), indexing="ij")
            out[:, nxt:nxt + n] = pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
            pos += max(h, w)
            i = nxt + n
    for queued, queue in queues.items():
        if queued is not None and next(queue, None) is not None:
            kind = "video" if queued == video_token_id else "image"
            raise ValueError(f"more {kind} grids than {kind}s in the tokens")
    return torch.from_numpy(out)[:, None, :].to(tokens.device)


def hf_positions(row: Mapping, context: Mapping, tokens_per_second: int | None) -> torch.Tensor:
    """The Hugging Face layout's ``position_ids`` ``[4, 1, T]`` of a packed row (real tokens only: ``input_ids``,
    ``cu``, ``position_ids``, media grids): row 0 the per-segment text positions, then the per-segment 3-D rope
    (:func:`mrope_position_ids`); ``context``: the batch's token ids (:func:`packtool.readkit.layout_context`)."""
    image_id = context.get("image_token_id")
    if image_id is None:
        raise ValueError("packtool: error: the Qwen2-VL layout needs the packs' image_token_id (a packtool reader "
                         "batch carries it)")
    videos = row.get("video_grid_thw")
    if videos is not None and len(videos) and tokens_per_second is None:
        raise ValueError("packtool: error: the batch has videos but no tokens_per_second (the model config's "
                         "vision_config.tokens_per_second); pass tokens_per_second=")
    rope = mrope_position_ids(
        row["input_ids"], row["cu"], row.get("image_grid_thw"), image_token_id=image_id, video_grid_thw=videos,
        second_per_grid_ts=row.get("second_per_grid_ts"), video_token_id=context.get("video_token_id"),
        tokens_per_second=tokens_per_second or 0)
    return torch.cat([row["position_ids"][None], rope])
