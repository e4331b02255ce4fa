"""Audio facts from bytes (sample count, rate, channels) and the waveform a speech processor is given.

Token rules need the clip's length in samples at the processor's rate. PCM (WAV) and FLAC headers state the
exact sample count; for compressed formats (MP3, Ogg, M4A) the decoder decides how many samples come out (encoder
delay and padding), so those are decoded and counted — the same decoder :func:`decode_audio` uses, so the count
and the waveform always agree.

:func:`decode_audio` follows transformers' soundfile audio loader step for step: downmix by averaging channels,
``soxr_hq`` resampling, then padding or trimming to ``ceil(samples · rate / native_rate)`` samples
(:func:`resampled_length`). A rule can therefore count samples without decoding anything.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from packtool.media.video import open_container

#: Part-name endings treated as audio.
AUDIO_EXTENSIONS = frozenset({"wav", "flac", "mp3", "ogg", "m4a"})


@dataclass(frozen=True)
class AudioFacts:
    """What the token rules need to know about one audio clip."""

    #: Samples per channel at the native rate.
    samples: int
    #: Native sample rate in Hz.
    sample_rate: int
    channels: int
    #: Where ``samples`` came from: the header (PCM, FLAC) or counting decoded samples.
    sample_count_source: Literal["header", "decode"]

    def __post_init__(self) -> None:
        if self.samples <= 0:
            raise ValueError("audio has no samples")
        if self.sample_rate <= 0:
            raise ValueError(f"audio sample rate {self.sample_rate} is not positive")
        if self.channels <= 0:
            raise ValueError("audio has no channels")

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.samples / self.sample_rate


def probe_audio(data: bytes, *, decode: bool = False) -> AudioFacts:
    """Facts of an encoded audio clip (the first audio stream); raises ``ValueError`` with a reason when unusable.

    PCM and FLAC sample counts come from the header unless ``decode``, which decodes the clip once to prove it whole.
    """
    with open_container(data, "audio") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream in the container")
        stream = container.streams.audio[0]
        rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
        if rate <= 0 or channels <= 0:
            raise ValueError("audio stream has no sample rate or channels; the codec may be unsupported")
        header_samples = int(stream.duration or 0)
        exact_header = (stream.codec_context.name.startswith("pcm_") or stream.codec_context.name == "flac") and (
            header_samples and stream.time_base == Fraction(1, rate)
        )
        if exact_header and not decode:
            return AudioFacts(header_samples, rate, channels, "header")
        try:
            samples = sum(frame.samples for frame in container.decode(stream))
        except Exception as exc:
            raise ValueError(f"undecodable audio: {type(exc).__name__}: {exc}") from None
        if exact_header and samples != header_samples:
            raise ValueError(f"audio header says {header_samples} samples but {samples} decode")
    return AudioFacts(samples, rate, channels, "decode")


def resampled_length(samples: int, native_rate: int, rate: int) -> int:
    """Samples of a clip of ``samples`` native samples after :func:`decode_audio` brings it to ``rate``."""
    if native_rate == rate:
        return samples
    return math.ceil(samples * rate / native_rate)


def decode_audio(data: bytes, *, rate: int, max_samples: int | None = None) -> np.ndarray:
    """The clip as a mono float32 waveform at ``rate`` Hz, cut to ``max_samples`` when given.

    Its length is ``min(resampled_length(...), max_samples)`` exactly, which is what the token rules count.
    """
    import av
    import soxr

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        native_rate = int(stream.codec_context.sample_rate)
        # Planar float at the native rate and layout: a pure sample-format conversion, no resampling delay.
        to_float = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=native_rate)
        chunks: list[np.ndarray] = []
        for frame in container.decode(stream):
            chunks.extend(f.to_ndarray() for f in to_float.resample(frame))
        chunks.extend(f.to_ndarray() for f in to_float.resample(None))
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((1, 0), np.float32)
    wave = wave.mean(axis=0) if wave.shape[0] > 1 else wave[0]
    if native_rate != rate:
        length = resampled_length(wave.shape[-1], native_rate, rate)
        wave = soxr.resample(wave, native_rate, rate, quality="soxr_hq")
        wave = np.pad(wave, (0, max(0, length - len(wave))))[:length]
    if max_samples is not None:
        wave = wave[:max_samples]
    return np.ascontiguousarray(wave, dtype=np.float32)

