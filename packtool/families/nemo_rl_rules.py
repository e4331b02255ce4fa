"""NeMo-RL's Nemotron Omni rules (its ``nemotron_multimodal`` task encoder, prompt format ``nemotron6-moe``), used by
the ``nemo-rl-nemotron-omni`` convention (:mod:`packtool.families.nemotron_omni.nemo_rl`) and by verify.

They differ from transformers' processor, which packtool follows by default:

* Images: one patch budget for all images and video frames of a sample, from the tokens the sample's text leaves
  in the sequence (``max_sequence_length - text tokens - 4``, the text counted with each image as
  ``<img><image></img>``), times the pixel-shuffle area; frames are scaled down together until they fit
  (:func:`sample_image_grids`). The budget depends on the pack size, so packtool applies it per sample with the pack
  size as the sequence length, as NeMo-RL's encoder does per sample before packing.
* Videos: frames chosen by the Megatron rule (:func:`video_timestamps`: 8 to 32 frames at 2 fps, one at the centre
  of each of equal segments of ``duration - 1`` seconds; a video of fewer than 8 frames keeps its frame count), each
  resized to one tile of about ``video_target_num_patches`` patches (the frame's aspect), the frames sharing the
  sample's image budget; the text is ``This is a video:``, one line per tubelet of 2 frames with its frames' labels
  and ``<img>…</img>``, and a trailing newline (:func:`video_prompt`). Duration and frame count are Energon's
  (:func:`energon_video_metadata`), as NeMo-RL's cooker reads them.
* Audio: cut into clips of 30 s at the feature extractor's rate (the last one at least 0.1 s); each clip's valid
  mel frames are its samples // hop, its ``<so_embedding>`` tokens those frames through the encoder's stride-2
  convolutions (:func:`audio_plan`). The batch carries each clip's mel features and valid frames
  (``sound_clips``, ``sound_length``).
* Replies: a reply without a thinking trace starts with an empty ``<think></think>``; a trace is normalised to
  ``<think>\\n…\\n</think>\\n``, or under ``thinking_trace_format: ultra`` ``<think>\\n…</think>`` and the answer right
  after (:func:`assistant_text`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Tokens NeMo-RL keeps back from the budget (``max_sequence_length - length - 4``).
BUDGET_RESERVE = 4
#: Rounds of joint down-scaling before the last grids are taken.
SCALING_ROUNDS = 10


@dataclass(frozen=True)
class Frame:
    """One image, or one frame of a video, of a sample: its stored size."""

    width: int
    height: int
    is_video: bool = False


def _image_grid(frame: Frame, available: int, patch: int, merge: int, min_patches: int) -> tuple[int, int]:
    """``(grid_h, grid_w)`` of an image given ``available`` patches: its own patch grid scaled into the budget (up
    to the minimum when there is room for it), each side then made a multiple of ``merge``."""
    h0, w0 = round(frame.height / patch + 0.5), round(frame.width / patch + 0.5)
    scale = min(math.sqrt(available / (h0 * w0)), 1.0)
    gh, gw = math.floor(scale * h0), math.floor(scale * w0)
    if available > min_patches and gh * gw < min_patches:
        up = math.sqrt(min_patches / max(gh * gw, 1))
        uh, uw = math.ceil(up * gh), math.ceil(up * gw)
        if available > uh * uw:
            gh, gw = uh, uw
    if rem := gh % merge:
        gh = gh + merge - rem if (gh + merge - rem) * gw <= available else max(merge, gh - rem)
    if rem := gw % merge:
        gw = gw + merge - rem if gh * (gw + merge - rem) <= available else max(merge, gw - rem)
    return gh, gw


def _video_grid(frame: Frame, target: int, merge: int, keep_aspect: bool) -> tuple[int, int]:
    """``(grid_h, grid_w)`` of a video frame: a tile of about ``target`` patches (the frame's aspect, or square)."""
    if keep_aspect:
        aspect = frame.width / frame.height
        gh, gw = max(1, round(math.sqrt(target / aspect))), max(1, round(math.sqrt(target * aspect)))
    else:
        gh = gw = max(1, int(math.sqrt(target)))
    down_h, down_w = gh - gh % merge, gw - gw % merge
    up_h = down_h if gh % merge == 0 else down_h + merge
    up_w = down_w if gw % merge == 0 else down_w + merge
    if up_h * up_w <= target:
        return up_h, up_w
    return max(merge, down_h), max(merge, down_w)


def sample_image_grids(frames: Sequence[Frame], tokens_available: int, *, patch: int, merge: int, min_patches: int,
                       max_patches: int, video_target_patches: int, video_keep_aspect: bool,
                       temporal_patch: int = 2) -> list[tuple[int, int]]:
    """The patch grid ``(h, w)`` of every image and video frame of one sample, planned together under one budget of
    ``tokens_available`` tokens (see the module docstring). Video frames keep their fixed tile; they count toward
    the budget (a tubelet of ``temporal_patch`` frames costs one frame's tokens)."""
    if not frames:
        return []
    budget = tokens_available * merge**2
    videos = sum(f.is_video for f in frames)
    if temporal_patch > 1 and videos:
        if videos == len(frames):
            budget *= temporal_patch
        else:
            images = len(frames) - videos
            budget = int(budget * (images / len(frames) + videos / len(frames) * temporal_patch))
    budget = max(budget, min_patches * len(frames))
    allowances = [max(min(budget, max_patches), min_patches)] * len(frames)
    grids: list[tuple[int, int]] = []
    for _ in range(SCALING_ROUNDS):
        grids = [_video_grid(f, video_target_patches, merge, video_keep_aspect) if f.is_video
                 else _image_grid(f, a, patch, merge, min_patches) for f, a in zip(frames, allowances)]
        sizes = [h * w for h, w in grids]
        total = sum(sizes)
        if total <= budget:
            break
        shrunk = [max(min_patches, int(s * budget / total)) for s in sizes]
        allowances = shrunk if any(n < o for n, o in zip(shrunk, allowances)) else [min_patches] * len(frames)
    return grids


#: NeMo-RL's video sampling (its encoder's defaults ``video_min_num_frames``, ``video_max_num_frames``,
#: ``video_default_fps``) and the longest video it takes without ``allow_large_videos``, in seconds.
VIDEO_MIN_FRAMES, VIDEO_MAX_FRAMES, VIDEO_FPS, VIDEO_MAX_SECONDS = 8, 32, 2, 600.0
#: The line before a video's frames.
VIDEO_HEADER = "This is a video:"


def video_timestamps(duration: float, source_frames: int, *, temporal_patch: int = 2,
                     min_frames: int = VIDEO_MIN_FRAMES, max_frames: int = VIDEO_MAX_FRAMES,
                     fps: int = VIDEO_FPS) -> tuple[float, ...]:
    """Seconds of the frames NeMo-RL takes from a video of ``duration`` seconds and ``source_frames`` frames (no
    augmentation, no jitter): ``fps`` frames a second, at least ``min_frames`` (or all frames of a shorter video)
    and at most ``max_frames``, made a multiple of ``temporal_patch``; frame ``i`` at ``(i + 0.5)`` segments of
    ``(duration - 1) / n`` seconds, in float32. ``ValueError`` for a duration that is not positive or over
    :data:`VIDEO_MAX_SECONDS`."""
    import torch

    if not duration > 0 or source_frames <= 0:
        raise ValueError(f"video of {duration} s and {source_frames} frames has no clip to sample")
    if duration > VIDEO_MAX_SECONDS:
        raise ValueError(f"video of {duration:.1f} s is longer than NeMo-RL's {VIDEO_MAX_SECONDS:.0f} s")
    n = source_frames if source_frames < min_frames else min(max(int(fps * duration), min_frames), max_frames)
    if n % temporal_patch:
        down = n // temporal_patch * temporal_patch
        up = down + temporal_patch
        n = up if up <= source_frames and up <= max_frames else max(temporal_patch, down)
    segment = float(duration - 1) / n
    seconds = segment * (torch.arange(n, dtype=torch.float32) + 0.5)
    return tuple(float(v) for v in seconds.tolist())


def video_prompt(seconds: Sequence[float], chunk: str, temporal_patch: int = 2) -> str:
    """A video's text: :data:`VIDEO_HEADER`, then per tubelet its frames' labels and ``chunk`` (its
    ``<img>…</img>``), one line each, and a trailing newline."""
    lines = [VIDEO_HEADER]
    for start in range(0, len(seconds), temporal_patch):
        labels = [f"{'Frame' if k == start else 'frame'} {k + 1} sampled at {seconds[k]:.2f} seconds"
                  for k in range(start, min(start + temporal_patch, len(seconds)))]
        lines.append(" and ".join(labels) + ": " + chunk)
    return "\n".join(lines) + "\n"


def video_frame_grid(width: int, height: int, settings) -> tuple[int, int]:
    """``(grid_h, grid_w)`` of every frame of a ``width``×``height`` video (a Nemotron Omni folder's settings,
    ``NemotronOmniSettings``); ``ValueError`` for a square tile of a target that is not a square."""
    target, keep = settings.video_target_num_patches, settings.video_maintain_aspect_ratio
    if not keep and int(math.sqrt(target)) ** 2 != target:
        raise ValueError("video_target_num_patches must be square when the aspect ratio is not kept")
    return _video_grid(Frame(width, height, True), target, round(1 / settings.downsample_ratio), keep)


def energon_video_metadata(data: bytes) -> tuple[float, int]:
    """``(duration in seconds, frames)`` of an encoded video as Energon's ``AVDecoder.get_metadata`` reads them
    (what NeMo-RL's cooker gives its encoder); ``ValueError`` when it gives neither."""
    import io

    from megatron.energon.av import AVDecoder

    try:
        meta = AVDecoder(io.BytesIO(data)).get_metadata()
    except Exception as exc:  # PyAV's own error types
        raise ValueError(f"Energon cannot read the video ({type(exc).__name__}: {exc})") from None
    if meta.video_duration is None or not meta.video_num_frames:
        raise ValueError("Energon finds no video duration or frame count")
    return float(meta.video_duration), int(meta.video_num_frames)


@dataclass(frozen=True)
class AudioPlan:
    """How NeMo-RL cuts one audio item: samples of each clip (at the target rate), valid mel frames of each clip,
    and the item's ``<so_embedding>`` tokens."""

    clip_samples: tuple[int, ...]
    frames: tuple[int, ...]
    tokens: int

    @property
    def samples(self) -> int:
        """Samples of the whole waveform the clips cover."""
        return sum(self.clip_samples)


def audio_plan(samples: int, sample_rate: int, *, target_rate: int, hop: int, subsampling: int,
               clip_seconds: float = 30.0, min_seconds: float = 0.1, max_seconds: float = 1800.0) -> AudioPlan:
    """The clips, mel frames and tokens of ``samples`` samples at ``sample_rate`` (see the module docstring);
    ``ValueError`` for a clip shorter than ``min_seconds`` or longer than ``max_seconds``."""
    seconds = samples / sample_rate
    if seconds < min_seconds or seconds > max_seconds:
        raise ValueError(f"audio of {seconds:.3f} s is outside NeMo-RL's {min_seconds}-{max_seconds} s")
    total = round(max(min_seconds, seconds) * target_rate)
    clip = round(clip_seconds * target_rate)
    rest = total % clip
    last = clip if rest == 0 else max(rest, round(min_seconds * target_rate))
    clips = (clip,) * (math.ceil(total / clip) - 1) + (last,)
    frames = tuple(n // hop for n in clips)
    if min(frames) <= 0:
        raise ValueError("an audio clip gives no mel frames")
    tokens = 0
    for f in frames:
        for _ in range(int(math.log2(subsampling))):
            f = (f + 1) // 2
        tokens += max(1, f)
    return AudioPlan(clips, frames, tokens)


def settings_audio_plan(samples: int, sample_rate: int, settings) -> AudioPlan:
    """:func:`audio_plan` with a Nemotron Omni folder's audio settings (``NemotronOmniSettings``)."""
    return audio_plan(samples, sample_rate, target_rate=settings.audio_sampling_rate, hop=settings.audio_hop_length,
                      subsampling=settings.audio_subsampling_factor)


_TRACE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_AFTER_TRACE = re.compile(r"</think>\s*")


def assistant_text(text: str, *, ultra: bool = False) -> str:
    """A reply as NeMo-RL's ``nemotron6-moe`` renders it: ``<think></think>`` before a reply without a trace (the
    reply stripped), a trace's content stripped inside ``<think>\\n…\\n</think>`` and one newline after it
    (``thinking_trace_format: normalized``), or with ``ultra`` inside ``<think>\\n…</think>`` and the answer right
    after it; ``ValueError`` unless the reply has no ``<think>`` tags or exactly one pair in order."""
    opened, closed = text.count("<think>"), text.count("</think>")
    if opened == closed == 0:
        return "<think></think>" + text.strip()
    if opened != 1 or closed != 1 or text.find("<think>") > text.find("</think>"):
        raise ValueError("a reply needs exactly one <think>…</think> pair, in order, or none")
    before_close = "" if ultra else "\n"

    def trace(match: re.Match[str]) -> str:
        content = match.group(1).strip()
        return f"<think>\n{content}{before_close}</think>" if content else "<think></think>"

    return _AFTER_TRACE.sub("</think>" if ultra else "</think>\n", _TRACE.sub(trace, text))
