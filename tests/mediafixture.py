"""Videos, audio clips and images made offline for the media tests: PyAV encodes, numpy draws, PIL writes.

Every frame and every waveform is a deterministic function of its arguments, so the same call gives the same
bytes' content (the codecs themselves are deterministic for these settings) and tests can compare decoded pixels.
The video and audio generators live in ``examples/demo.py`` (the demo datasets hold such media too).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import yaml
from PIL import Image

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from demo import (  # noqa: E402
    AUDIO_FORMATS,
    VIDEO_FORMATS,
    frame_pixels,
    make_audio,
    make_video,
    waveform,
    write_shard,
)

__all__ = ["AUDIO_FORMATS", "VIDEO_FORMATS", "frame_pixels", "make_audio", "make_image", "make_sliced_h264",
           "make_video", "waveform", "write_source"]


def make_image(width: int, height: int, *, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image of :func:`frame_pixels` (frame ``seed``) in ``fmt``."""
    buf = io.BytesIO()
    Image.fromarray(frame_pixels(seed, width, height)).save(buf, format=fmt)
    return buf.getvalue()


def write_source(root: Path, samples: dict[str, dict[str, bytes]], *, dataset_yaml: dict | None = None) -> Path:
    """A one-shard Energon source (``shards/media.tar``, split ``train``) holding ``samples`` (key -> members)."""
    write_shard(root / "shards/media.tar", samples.items())
    meta = root / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": ["shards/media.tar"]}}))
    (meta / "dataset.yaml").write_text(yaml.safe_dump(dataset_yaml or {"__module__": "megatron.energon",
                                                                       "__class__": "CrudeWebdataset"}))
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"shards/media.tar": len(samples)}}))
    return root


def make_sliced_h264(width: int, height: int, *, frames: int, slices: int) -> bytes:
    """An MP4 of H.264 whose every frame is cut into ``slices`` slices (what encoders that thread by slice write),
    frames of :func:`frame_pixels` at 24 fps."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "threads": "1", "slices": str(slices)}
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
