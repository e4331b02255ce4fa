"""Qwen3-VL's video rule: transformers' ``Qwen3VLVideoProcessor`` frame sampling, its resize over the whole clip
(the pixel budget spans every sampled frame, optionally capped per frame) and ``Qwen3VLProcessor``'s expansion of
one ``<|video_pad|>``: per temporal group of frames, ``<t seconds>`` (the group's mean frame time, one decimal)
then the group's tokens between the vision markers.

Images follow Qwen2-VL's image rule (:class:`packtool.families.qwen2_vl.ImageRule`, patch 16 from the folder).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from packtool.media.folder import read_folder
from packtool.media.video import VideoFacts

#: The frame rate ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor`` assume for a video given without one.
DEFAULT_FPS = 24.0


@dataclass(frozen=True)
class Qwen3VLVideoPlan:
    """One video as the processor treats it."""

    #: Frames the processor is given (indices into the video).
    indices: tuple[int, ...]
    #: ``(groups, h, w)`` in patches: ``video_grid_thw``.
    grid_thw: tuple[int, int, int]
    #: Seconds of each temporal group, as written in its ``<t seconds>`` label.
    timestamps: tuple[float, ...]
    merge_size: int

    @property
    def frame_tokens(self) -> int:
        """Tokens of one temporal group."""
        return self.grid_thw[1] * self.grid_thw[2] // self.merge_size**2

    @property
    def tokens(self) -> int:
        """``<|video_pad|>`` tokens of the whole video."""
        return self.grid_thw[0] * self.frame_tokens


@dataclass(frozen=True)
class Qwen3VLVideoRule:
    """The settings of ``Qwen3VLVideoProcessor`` that decide a video's frames, grid and text."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    #: ``size.shortest_edge`` / ``size.longest_edge``: pixel bounds of the whole resized clip (all its frames).
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    do_sample_frames: bool = True
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    #: Per-frame pixel cap as qwen-vl-utils applies it (``max_video_tokens`` per frame at most).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames",
                     "max_frames", "max_video_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"video {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps!r}")
        if self.num_frames is not None and self.num_frames <= 0:
            raise ValueError(f"video num_frames must be positive, got {self.num_frames!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"video min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, fps: float | None = None, num_frames: int | None = None,
                    min_frames: int | None = None, max_frames: int | None = None, min_pixels: int | None = None,
                    max_pixels: int | None = None) -> Qwen3VLVideoRule:
        """The rule of a video processor config (keys as in ``video_preprocessor_config.json``), with overrides."""
        size = cfg.get("size") or {}
        d = cls
        folder_frames = cfg.get("num_frames")
        if num_frames is not None or fps is not None:
            folder_fps = fps
            folder_frames = num_frames
        else:
            folder_fps = cfg.get("fps", d.fps) if folder_frames is None else None
        return cls(
            patch_size=int(cfg.get("patch_size", d.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", d.merge_size)),
            min_pixels=int(min_pixels if min_pixels is not None else size.get("shortest_edge", d.min_pixels)),
            max_pixels=int(max_pixels if max_pixels is not None else size.get("longest_edge", d.max_pixels)),
            do_sample_frames=bool(cfg.get("do_sample_frames", d.do_sample_frames)),
            fps=None if folder_fps is None else float(folder_fps),
            num_frames=None if folder_frames is None else int(folder_frames),
            min_frames=int(min_frames if min_frames is not None else cfg.get("min_frames", d.min_frames)),
            max_frames=int(max_frames if max_frames is not None else cfg.get("max_frames", d.max_frames)),
            cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(cfg.get("max_video_tokens", d.max_video_tokens)),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, **overrides: Any) -> Qwen3VLVideoRule:
        """The rule of a model folder's video processor settings."""
        return cls.from_config(read_folder(folder).video, **overrides)

    def sample_indices(self, facts: VideoFacts) -> tuple[int, ...]:
        """Frames the processor keeps (``Qwen3VLVideoProcessor.sample_frames``): evenly spread over the video,
        first and last included, rounded; all when it does not sample."""
        total = facts.frames
        if not self.do_sample_frames:
            return tuple(range(total))
        n = self.num_frames
        if n is None and self.fps is not None:
            rate = facts.fps if facts.fps is not None else DEFAULT_FPS
            n = min(max(int(total / rate * self.fps), self.min_frames), self.max_frames, total)
        if n is None:
            n = min(max(total, self.min_frames), self.max_frames)
        return tuple(int(i) for i in np.linspace(0, total - 1, n).round().astype(int).tolist())

    def resize(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` of the resized frames: sides to multiples of patch·merge, the whole clip's pixels
        (frames rounded to the temporal patch) within the bounds; a side under one factor is first scaled up."""
        tps, factor = self.temporal_patch_size, self.patch_size * self.merge_size
        if frames < tps:
            raise ValueError(f"video gives the processor {frames} frame(s), fewer than its temporal patch of {tps}")
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"video aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        t_bar = round(frames / tps) * tps
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt(frames * height * width / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def timestamps(self, indices: tuple[int, ...], fps: float | None) -> tuple[float, ...]:
        """Each temporal group's time: the mean of its first and last frame's seconds (the last frame repeated to
        fill the last group), at the video's rate (``DEFAULT_FPS`` without one)."""
        rate = fps if fps is not None else DEFAULT_FPS
        tps = self.temporal_patch_size
        padded = list(indices) + [indices[-1]] * (-len(indices) % tps)
        seconds = [i / rate for i in padded]
        return tuple((seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps))

    def video(self, facts: VideoFacts) -> Qwen3VLVideoPlan:
        """The processor's treatment of one video, from its facts alone; ``ValueError`` (with the reason) for a
        video the processor refuses."""
        indices = self.sample_indices(facts)
        h, w = self.resize(len(indices), facts.height, facts.width)
        groups = -(-len(indices) // self.temporal_patch_size)
        grid = (groups, h // self.patch_size, w // self.patch_size)
        return Qwen3VLVideoPlan(indices, grid, self.timestamps(indices, facts.fps), self.merge_size)

    def text(self, plan: Qwen3VLVideoPlan, video_token: str, start: str, end: str) -> str:
        """What the processor writes in place of one ``<|video_pad|>``."""
        group = start + video_token * plan.frame_tokens + end
        return "".join(f"<{t:.1f} seconds>{group}" for t in plan.timestamps)

    @classmethod
    def from_manifest(cls, settings: Mapping[str, Any]) -> Qwen3VLVideoRule:
        """The rule :meth:`manifest` wrote; ``ValueError`` for another family or malformed settings."""
        if settings.get("family") != "qwen3_vl":
            raise ValueError(f"unsupported video processor family {settings.get('family')!r}")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in settings.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"malformed video processor ({exc})") from None

    def manifest(self) -> dict:
        """The settings, for the pack manifest and the reader."""
        return {"family": "qwen3_vl", **asdict(self)}
