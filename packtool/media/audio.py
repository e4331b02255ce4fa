"""Audio facts from bytes (sample count, rate, channels) and the waveform a speech processor is given.

Token rules need the clip's length in samples at the processor's rate. PCM (WAV) and FLAC headers state the
exact sample count; for compressed formats (MP3, Ogg, M4A) the decoder decides how many samples come out (encoder
delay and padding), so those are decoded and counted — the same decoder :func:`decode_audio` uses, so the count
and the waveform always agree. An AAC clip (M4A) is cut to the length its container declares, whatever the FFmpeg
build does with the encoder's end padding.

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
        declared = _declared_samples(stream)
        try:
            samples = sum(frame.samples for frame in container.decode(stream))
        except Exception as exc:
            raise ValueError(f"undecodable audio: {type(exc).__name__}: {exc}") from None
        if exact_header and samples != header_samples:
            raise ValueError(f"audio header says {header_samples} samples but {samples} decode")
    return AudioFacts(samples if declared is None else min(samples, declared), rate, channels, "decode")


def _declared_samples(stream) -> int | None:
    """An AAC stream's length in samples as its container declares it (the MP4 edit list, which leaves out the
    encoder's end padding), or None. FFmpeg builds differ on whether decoding drops that padding (PyAV 18 keeps
    it, 19 drops it), so packtool always cuts the decoded samples to this length, which every build reports."""
    rate = int(stream.codec_context.sample_rate or 0)
    if stream.codec_context.name != "aac" or not stream.duration or stream.time_base != Fraction(1, rate):
        return None
    return int(stream.duration)


def resampled_length(samples: int, native_rate: int, rate: int) -> int:
    """Samples of a clip of ``samples`` native samples after :func:`decode_audio` brings it to ``rate``."""
    if native_rate == rate:
        return samples
    return math.ceil(samples * rate / native_rate)


#: Native samples past the cut that :func:`decode_audio` resamples, per unit of the native-to-target rate ratio:
#: soxr's ``soxr_hq`` output up to the cut then equals, to the bit, that of the whole clip (checked for 8 Hz to
#: 384 kHz clips brought to 16 kHz); the rest of a long clip is neither decoded nor resampled.
_RESAMPLE_MARGIN = 4096


def decode_audio(data: bytes, *, rate: int, max_samples: int | None = None) -> np.ndarray:
    """The clip as a mono float32 waveform at ``rate`` Hz, cut to ``max_samples`` when given.

    Its length is ``min(resampled_length(...), max_samples)`` exactly, which is what the token rules count. A cut
    clip is decoded and resampled only up to the cut (and a margin that keeps the samples before it exact), so the
    work is bounded by ``max_samples``, not by the clip. Any channel count is read: the decoder's samples are
    converted to packed float (one plane; PyAV's planar arrays of 8 or more channels crash the process) and the
    channels averaged.
    """
    import av
    import soxr

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        native_rate = int(stream.codec_context.sample_rate)
        need = _declared_samples(stream)  # no more than the container declares (see there)
        if max_samples is not None:
            ratio = max(1, math.ceil(native_rate / rate))
            cut = math.ceil(max_samples * native_rate / rate) + (_RESAMPLE_MARGIN * ratio if native_rate != rate
                                                                  else 0)
            need = cut if need is None else min(need, cut)
        # Packed float at the native rate and layout: a pure sample-format conversion, no resampling delay.
        to_float = av.AudioResampler(format="flt", layout=stream.codec_context.layout, rate=native_rate)
        chunks: list[np.ndarray] = []
        got = 0
        for frame in container.decode(stream):
            for f in to_float.resample(frame):
                chunks.append(_planes(f))
                got += chunks[-1].shape[1]
            if need is not None and got >= need:
                break
        else:
            chunks.extend(_planes(f) for f in to_float.resample(None))
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((1, 0), np.float32)
    if need is not None:
        wave = wave[:, :need]
    wave = wave.mean(axis=0) if wave.shape[0] > 1 else wave[0]
    if native_rate != rate:
        length = resampled_length(wave.shape[-1], native_rate, rate)
        wave = soxr.resample(wave, native_rate, rate, quality="soxr_hq")
        wave = np.pad(wave, (0, max(0, length - len(wave))))[:length]
    if max_samples is not None:
        wave = wave[:max_samples]
    return np.ascontiguousarray(wave, dtype=np.float32)


def _planes(frame) -> np.ndarray:
    """A packed-float PyAV frame as a contiguous ``(channels, samples)`` array."""
    channels = len(frame.layout.channels)
    return np.ascontiguousarray(frame.to_ndarray().reshape(-1, channels).T)
