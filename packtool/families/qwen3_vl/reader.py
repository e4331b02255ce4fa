"""The reader's side of Qwen3-VL: a pack's pixels through transformers' processors, and its 3-D rope per segment.

Images go through Qwen2-VL's image processor with the manifest's settings (the base layout's code); videos
through ``Qwen3VLVideoProcessor`` given the planned frames with their metadata (it samples nothing again). The rope
(:func:`position_ids`) restarts with each segment and equals the model's own ``get_rope_index`` run on that
segment alone: a video is split into its temporal groups (``t = 1`` each), every group's tokens sit between its
own vision markers after its timestamp text, so a group is placed as an image of one frame.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from packtool.errors import FormatError

if TYPE_CHECKING:
    from packtool.families.qwen3_vl.reading import Qwen3VLReader
    from packtool.format import PackRecord


def qwen3_vl_media(reader: Qwen3VLReader, record: PackRecord, processor: Any, where: str,
                   decode: bool) -> dict[str, Any]:
    """``image_grid_thw`` (+ ``pixel_values``) of the pack's images and ``video_grid_thw`` (+
    ``pixel_values_videos``) of its videos, each checked against the stored grids."""
    from packtool.readkit import vision_media

    for m in record.media_refs:
        if m.kind not in ("image", "video"):
            raise FormatError(f"{where}: media kind {m.kind!r} (member {m.member}) is not Qwen3-VL's")
    images_only = replace(record, segments=[replace(s, media=[m for m in s.media if m.kind == "image"])
                                            for s in record.segments])
    out = vision_media(reader, images_only, processor, where, decode)
    family = reader.family
    videos = [m for m in record.media_refs if m.kind == "video"]
    grids = np.array([m.grid_thw for m in videos], dtype=np.int64).reshape(-1, 3)
    out["video_grid_thw"] = torch.from_numpy(grids)
    if not decode:
        return out
    if family.video is None:
        if videos:
            raise FormatError(f"{where}: the pack holds videos but the manifest describes no video processor")
        return out
    rule = family.video
    if not videos:
        dim = 3 * rule.temporal_patch_size * rule.patch_size ** 2
        out["pixel_values_videos"] = torch.zeros((0, dim), dtype=torch.float32)
        return out
    from packtool.readkit import check_video_grids, decode_planned_videos

    arrays, metadata = decode_planned_videos(record, videos, where)
    proc = video_processor(rule.manifest(), family.video_config or {})
    try:
        result = proc(videos=arrays, video_metadata=metadata, do_sample_frames=False, return_tensors="pt",
                      input_data_format="channels_last")
    except (ValueError, TypeError, RuntimeError) as exc:
        raise FormatError(f"{where}: the video processor refuses its videos ({type(exc).__name__}: {exc})") from None
    check_video_grids(result["video_grid_thw"], grids, videos, where)
    out["pixel_values_videos"] = result["pixel_values_videos"].to(torch.float32).contiguous()
    return out


def video_processor(settings: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    """transformers' ``Qwen3VLVideoProcessor`` with a manifest's video settings (over the folder's ``config``),
    told not to sample (cached per settings)."""
    return _cached_video_processor(json.dumps({"rule": dict(settings), "config": dict(config)}, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _cached_video_processor(key: str) -> Any:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    s = json.loads(key)
    rule, config = s["rule"], s["config"]
    kwargs = {k: v for k, v in config.items() if not k.endswith(("_type", "_class", "_auto_map"))}
    kwargs.update(size={"shortest_edge": rule["min_pixels"], "longest_edge": rule["max_pixels"]},
                  patch_size=rule["patch_size"], temporal_patch_size=rule["temporal_patch_size"],
                  merge_size=rule["merge_size"], do_sample_frames=False,
                  cap_pixels_per_frame=rule["cap_pixels_per_frame"], max_video_tokens=rule["max_video_tokens"])
    return Qwen3VLVideoProcessor(**kwargs)


def position_ids(tokens: torch.Tensor, cu_seqlens_padded: torch.Tensor, image_grid_thw: torch.Tensor | None,
                 video_grid_thw: torch.Tensor | None, *, image_token_id: int, video_token_id: int | None,
                 spatial_merge_size: int = 2) -> torch.Tensor:
    """Qwen3-VL's 3-D rope positions ``[3, 1, L]`` of a packed row, per segment (each starts again at 0): what a
    training hook (Hugging Face's packed forward, with ``position_ids`` given) needs. Each segment's equal the
    model's ``get_rope_index`` on that segment alone; padding counts on like text."""
    from packtool.families.qwen2_vl.reader import mrope_position_ids

    frames = None
    if video_grid_thw is not None and len(video_grid_thw):
        frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        frames[:, 0] = 1
    return mrope_position_ids(tokens, cu_seqlens_padded, image_grid_thw, image_token_id=image_token_id,
                              spatial_merge_size=spatial_merge_size, video_grid_thw=frames,
                              second_per_grid_ts=None if frames is None else torch.zeros(len(frames)),
                              video_token_id=video_token_id)


def batch_position_ids(batch: Mapping[str, Any], manifest: Mapping[str, Any]) -> torch.Tensor:
    """:func:`position_ids` of a reader batch (:func:`packtool.runtime.read.pack_to_batch`) of a Qwen3-VL pack."""
    merge = int(manifest["image_processor"]["merge_size"])
    return position_ids(batch["tokens"], batch["cu_seqlens_padded"], batch.get("image_grid_thw"),
                        batch.get("video_grid_thw"), image_token_id=int(manifest["image_token_id"]),
                        video_token_id=manifest.get("video_token_id"), spatial_merge_size=merge)


def hf_positions(row: Mapping, context: Mapping, tokens_per_second: int | None) -> torch.Tensor:
    """The Hugging Face layout's ``position_ids`` ``[4, 1, T]`` of a packed row: row 0 the per-segment text
    positions, then Qwen3-VL's per-segment rope (:func:`position_ids`; its videos' times are text in the tokens, so
    ``tokens_per_second`` is not used)."""
    image_id, merge = context.get("image_token_id"), context.get("spatial_merge_size")
    if image_id is None or merge is None:
        raise ValueError("packtool: error: the Qwen3-VL layout needs the packs' image_token_id and merge size (a "
                         "packtool reader batch carries them)")
    rope = position_ids(row["input_ids"], row["cu"], row.get("image_grid_thw"), row.get("video_grid_thw"),
                        image_token_id=image_id, video_token_id=context.get("video_token_id"),
                        spatial_merge_size=int(merge))
    return torch.cat([row["position_ids"][None], rope])
