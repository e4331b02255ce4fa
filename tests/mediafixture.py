"""Videos, audio clips and images made offline for the media tests: PyAV encodes, numpy draws, PIL writes.

Every frame and every waveform is a deterministic function of its arguments, so the same call gives the same
bytes' content (the codecs themselves are deterministic for these settings) and tests can compare decoded pixels.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import av
import numpy as np
import yaml
from PIL import Image

#: Container name and video codec for each video extension (codecs PyAV's bundled FFmpeg can write).
VIDEO_FORMATS = {
    "mp4": ("mp4", "libx264"),
    "mov": ("mov", "mpeg4"),
    "mkv": ("matroska", "ffv1"),
    "webm": ("webm", "libvpx"),
    "avi": ("avi", "mjpeg"),
}

#: Container name and audio codec for each audio extension.
AUDIO_FORMATS = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "ogg": ("ogg", "libopus"),
    "m4a": ("ipod", "aac"),
}


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:
    """RGB frame ``index``: smooth gradients that move with the frame number (compresses well, decodes stably)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 127 + 100 * np.sin((x + 3 * index) / max(width, 1) * 2 * math.pi)
    g = 127 + 100 * np.cos((y + 2 * index) / max(height, 1) * 2 * math.pi)
    b = np.full_like(r, (40 + 9 * index) % 256)
    return np.stack([r, g, b], axis=-1).clip(0, 255).astype(np.uint8)


def waveform(samples: int, rate: int, channels: int, *, freq: float = 440.0) -> np.ndarray:
    """``(channels, samples)`` float32 tones in [-0.5, 0.5]; each channel a different pitch."""
    t = np.arange(samples, dtype=np.float64) / rate
    return np.stack([0.5 * np.sin(2 * math.pi * freq * (c + 1) * t) for c in range(channels)]).astype(np.float32)


def make_video(
    ext: str,
    *,
    width: int,
    height: int,
    frames: int,
    fps: int | float = 24,
    audio_rate: int | None = None,
    codec: str | None = None,
) -> bytes:
    """Encode ``frames`` frames of :func:`frame_pixels` at ``fps`` into a container for ``ext``; with
    ``audio_rate`` also a mono AAC/Opus/PCM track of the same duration."""
    container_format, default_codec = VIDEO_FORMATS[ext]
    codec = codec or default_codec
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as out:
        stream = out.add_stream(codec, rate=_rate(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = {"ffv1": "yuv444p", "mjpeg": "yuvj420p"}.get(codec, "yuv420p")
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "threads": "1"}
        audio = None
        if audio_rate is not None:
            audio_codec = {"webm": "libopus", "mkv": "flac", "avi": "pcm_s16le"}.get(ext, "aac")
            audio = out.add_stream(audio_codec, rate=audio_rate, layout="mono")
        out.start_encoding()  # writes the header even when no frame follows
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if audio is not None:
            _encode_audio(out, audio, waveform(round(frames / fps * audio_rate), audio_rate, 1))
    return buf.getvalue()


def make_audio(ext: str, *, samples: int, rate: int, channels: int = 1) -> bytes:
    """Encode ``samples`` samples per channel of :func:`waveform` at ``rate`` into a file of type ``ext``."""
    container_format, codec = AUDIO_FORMATS[ext]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as out:
        layout = {1: "mono", 2: "stereo"}[channels]
        stream = out.add_stream(codec, rate=rate, layout=layout)
        _encode_audio(out, stream, waveform(samples, rate, channels))
    return buf.getvalue()


def make_image(width: int, height: int, *, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image of :func:`frame_pixels` (frame ``seed``) in ``fmt``."""
    buf = io.BytesIO()
    Image.fromarray(frame_pixels(seed, width, height)).save(buf, format=fmt)
    return buf.getvalue()


def write_source(root: Path, samples: dict[str, dict[str, bytes]], *, dataset_yaml: dict | None = None) -> Path:
    """A one-shard Energon source (``shards/media.tar``, split ``train``) holding ``samples`` (key -> members)."""
    import demo

    demo.write_shard(root / "shards/media.tar", samples.items())
    meta = root / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": ["shards/media.tar"]}}))
    (meta / "dataset.yaml").write_text(yaml.safe_dump(dataset_yaml or {"__module__": "megatron.energon",
                                                                       "__class__": "CrudeWebdataset"}))
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"shards/media.tar": len(samples)}}))
    return root


def _encode_audio(out: av.container.OutputContainer, stream: av.audio.stream.AudioStream, wave: np.ndarray) -> None:
    """Feed ``wave`` (channels, samples) to ``stream`` in 1024-sample frames, converted to the codec's format."""
    channels = wave.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    resampler = av.AudioResampler(format=stream.codec_context.format, layout=layout, rate=stream.codec_context.rate)
    pts = 0
    for start in range(0, wave.shape[1], 1024):
        chunk = np.ascontiguousarray(wave[:, start:start + 1024])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = stream.codec_context.rate
        frame.pts = pts
        pts += chunk.shape[1]
        for converted in resampler.resample(frame):
            for packet in stream.encode(converted):
                out.mux(packet)
    for converted in resampler.resample(None):
        for packet in stream.encode(converted):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def _rate(fps: int | float):
    """``fps`` as the exact fraction PyAV wants for a stream rate."""
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)
