"""Video facts from bytes: size, frame count, frame rate and duration from the container, and frame decoding.

Token rules need only the frame size, the frame count and the frame rate, which containers carry in their headers,
so probing opens the container and reads no picture. Matroska and WebM record no frame count: there the packets of
the video stream are counted (demuxing, no decoding). Decoding happens only when asked: to prove a video whole
(``decode=True``), or to hand the sampled frames to a processor (:func:`decode_video`).

Frames are read the way transformers' PyAV video loader reads them (the first video stream, frames in decode
order, ``rgb24`` arrays, the stream's ``average_rate`` as fps), so packtool's frame indices address the same frames.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from packtool.media.image import image_size

#: Part-name endings treated as videos.
VIDEO_EXTENSIONS = frozenset({"mp4", "webm", "mkv", "mov", "avi"})
#: Where a video's frame count came from: the container header, counted packets, decoded frames, or a list of
#: images.
FrameCountSource = Literal["header", "demux", "decode", "frames"]

#: Threads one decode check may use (0: FFmpeg's choice, one per core); a pack run's workers divide the cores.
_decoder_threads = 0


def set_decoder_threads(threads: int) -> None:
    """How many threads this process's decode checks use (0: FFmpeg's choice, one per core)."""
    global _decoder_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"decoder threads must be a non-negative integer, got {threads!r}")
    _decoder_threads = threads


def decoder_threads_for(workers: int) -> int:
    """The decoder threads each of ``workers`` processes on this machine gets: its cores divided among them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, workers))


@dataclass(frozen=True)
class VideoFacts:
    """What the token rules need to know about one video, read without decoding pictures."""

    #: Frame width and height in pixels (as decoded; display rotation and aspect are not applied).
    width: int
    height: int
    #: Number of frames in the video stream.
    frames: int
    #: Frames per second; ``None`` for a list of frames given without a rate.
    fps: float | None
    #: Seconds; ``None`` when neither the container nor a rate gives it.
    duration: float | None
    #: Where ``frames`` came from (:data:`FrameCountSource`).
    frame_count_source: FrameCountSource

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"video has no pixels ({self.width}x{self.height})")
        if self.frames <= 0:
            raise ValueError("video has no frames")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"video frame rate {self.fps} is not positive")

    def metadata(self) -> dict:
        """The fields of transformers' ``VideoMetadata`` that these facts fix (frame indices are the rule's)."""
        return {
            "total_num_frames": self.frames,
            "fps": self.fps,
            "width": self.width,
            "height": self.height,
            "duration": self.duration,
        }


def open_container(data: bytes, what: str) -> Any:
    """The PyAV container of a media member; ValueError with a ledger reason for empty or unparsable bytes."""
    import av

    if not data:
        raise ValueError(f"empty {what} member")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except Exception as exc:  # PyAV raises its own error types (and others) for bytes it cannot parse
        raise ValueError(f"unreadable {what}: {type(exc).__name__}: {exc}") from None


def probe_video(data: bytes, *, max_pixels: int, decode: bool = False) -> VideoFacts:
    """Facts of an encoded video; raises ``ValueError`` with a reason when it is unusable.

    The header gives size, rate and (except in Matroska/WebM) the frame count; a missing count is found by counting
    packets. With ``decode`` every frame is decoded once, with FFmpeg's error detection on (``err_detect``: CRCs,
    bitstream and buffer checks, any error fatal), which proves the stream whole as far as a decoder can tell (a
    change that leaves a valid bitstream decodes to other pixels, and no decoder can see it) and makes the decoded
    count the count; a header that disagrees with it is an error. The decoder uses frame threads only (slice
    threads miss damage inside an H.264 slice), :func:`set_decoder_threads` of them. ``max_pixels`` bounds one
    frame, checked before decoding.
    """
    with open_container(data, "video") as container:
        if not container.streams.video:
            raise ValueError("no video stream in the container")
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if width <= 0 or height <= 0:
            raise ValueError(f"video stream has no frame size ({width}x{height}); the codec may be unsupported")
        if width * height > max_pixels:
            raise ValueError(f"video frame of {width}x{height} pixels exceeds the limit of {max_pixels}")
        fps = _stream_fps(stream)
        header_frames = int(stream.frames or 0)
        source: FrameCountSource
        try:
            if decode:
                # FFmpeg conceals what it cannot decode (a frame patched from its neighbours, no error); with
                # error detection on, a damaged slice, CRC or bitstream is an error instead
                stream.codec_context.options = {"err_detect": "crccheck+bitstream+buffer+explode"}
                # frame threading (each thread a whole frame) keeps that detection; slice threading, PyAV's
                # default, lets H.264 damage in the middle of a slice through as a logged, concealed error
                stream.thread_type = "FRAME"
                stream.codec_context.thread_count = _decoder_threads
                frames, source = sum(1 for _ in container.decode(stream)), "decode"
            elif header_frames:
                frames, source = header_frames, "header"
            else:
                frames, source = sum(1 for p in container.demux(stream) if p.size), "demux"
        except Exception as exc:  # PyAV's errors (some of them ValueErrors)
            raise ValueError(f"undecodable video: {type(exc).__name__}: {exc}") from None
        if decode and header_frames and header_frames != frames:
            raise ValueError(f"video header says {header_frames} frames but {frames} decode")
        duration = _duration(container, stream, frames, fps)
    return VideoFacts(width, height, frames, fps, duration, source)


def probe_frames(frames: Sequence[bytes], *, max_pixels: int, fps: float | None = None,
                 decode: bool = False) -> VideoFacts:
    """Facts of a video given as a list of encoded images (frames in order); all frames must share one size.

    ``fps`` is the rate the frames were taken at, when the source says so; without it the processors see no rate.
    """
    if not frames:
        raise ValueError("video frame list is empty")
    sizes = {image_size(f, max_pixels=max_pixels, decode=decode)[:2] for f in frames}
    if len(sizes) != 1:
        raise ValueError(f"video frames differ in size: {sorted(sizes)}")
    ((width, height),) = sizes
    duration = len(frames) / fps if fps else None
    return VideoFacts(width, height, len(frames), fps, duration, "frames")


def decode_video(data: bytes, indices: Sequence[int]) -> np.ndarray:
    """Frames ``indices`` (ascending, from a token rule) of an encoded video as a ``(T, H, W, 3)`` uint8 RGB array.

    Frames before the last wanted one are decoded (codecs need their predecessors) but only the wanted ones are
    converted to RGB. Raises ``ValueError`` when the stream ends before a wanted frame.
    """
    import av

    wanted = _check_indices(indices)
    out: list[np.ndarray] = []
    seen = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        for frame in container.decode(container.streams.video[0]):
            if seen in wanted:
                out.append(frame.to_ndarray(format="rgb24"))
                if len(out) == len(wanted):
                    break
            seen += 1
    if len(out) != len(wanted):
        raise ValueError(f"video ended after {seen} frames; frame {max(wanted)} was wanted")
    return np.stack(out)


def decode_frames(frames: Sequence[bytes], indices: Sequence[int]) -> np.ndarray:
    """Frames ``indices`` of a list of encoded images, as ``(T, H, W, 3)`` uint8 RGB."""
    from PIL import Image

    _check_indices(indices)
    return np.stack([np.asarray(Image.open(io.BytesIO(frames[i])).convert("RGB")) for i in indices])


def _check_indices(indices: Sequence[int]) -> set[int]:
    """The wanted frame numbers as a set; they must be distinct, ascending and non-negative."""
    values = [int(i) for i in indices]
    if not values or values != sorted(set(values)) or values[0] < 0:
        raise ValueError(f"frame indices must be distinct, ascending and non-negative: {values[:8]}")
    return set(values)


def _stream_fps(stream) -> float | None:
    """The stream's average frame rate (what transformers' PyAV loader uses), else FFmpeg's guess."""
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate:
            return float(rate)
    return None


def _duration(container, stream, frames: int, fps: float | None) -> float | None:
    """Seconds: the stream's own duration, else the container's, else frames over rate."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000
    return frames / fps if fps else None
