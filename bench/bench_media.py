"""Media probing throughput on a video-heavy set: container reading vs decoding.

Generates (offline, PyAV) a mix of videos — mp4/H.264, webm/VP8, mkv/FFV1, mov/MPEG-4, avi/MJPEG, some with an
audio track — and audio clips, then times, single-threaded, per sample:

* ``probe``        what the token rules need: header (and packet counting for mkv/webm); no picture decoded;
* ``plan+decode``  the reader's work for Qwen2.5-VL at 2 fps: the rule's frame indices, then those frames decoded
                   to RGB (all earlier frames are decoded too; only the kept ones converted);
* ``full decode``  ``probe_video(decode=True)``: every frame decoded once (the strict check).

Audio: ``probe`` (header for wav/flac, decode for mp3/ogg/m4a) and ``decode`` (waveform at 16 kHz).

Usage: ``python bench/bench_media.py [--videos 40] [--seconds 4] [--width 480] [--height 270]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mediafixture as mf  # noqa: E402
from packtool.families.qwen2_vl import ImageRule, Qwen2VLSettings  # noqa: E402
from packtool.media import decode_audio, decode_video, probe_audio, probe_video  # noqa: E402

MAX_PIXELS = 8192 * 8192


def make_set(n: int, seconds: float, width: int, height: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    exts = ["mp4", "webm", "mkv", "mov", "avi"]
    out = []
    for i in range(n):
        ext = exts[i % len(exts)]
        fps = rng.choice([24, 25, 30])
        dur = seconds * rng.uniform(0.5, 1.5)
        audio = 16000 if (ext in ("mp4", "mkv") and i % 2 == 0) else None
        out.append((ext, mf.make_video(ext, width=width, height=height, frames=max(2, round(dur * fps)), fps=fps,
                                       audio_rate=audio)))
    return out


def timed(fn, items) -> tuple[float, int]:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return time.perf_counter() - start, len(items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--width", type=int, default=480)
    ap.add_argument("--height", type=int, default=270)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    videos = make_set(args.videos, args.seconds, args.width, args.height)
    audio = [mf.make_audio(ext, samples=16000 * 5, rate=rate, channels=2)
             for ext, rate in [("wav", 16000), ("flac", 44100), ("mp3", 44100), ("ogg", 48000), ("m4a", 44100)] * 4]
    total_mb = sum(len(d) for _, d in videos) / 1e6
    frames = sum(probe_video(d, max_pixels=MAX_PIXELS).frames for _, d in videos)
    print(f"set: {len(videos)} videos ({args.width}x{args.height}, ~{args.seconds:g} s, {frames} frames, "
          f"{total_mb:.1f} MB) + {len(audio)} audio clips of 5 s; built in {time.perf_counter() - t0:.1f} s")

    settings = Qwen2VLSettings(image=ImageRule(type="qwen2_vl"), do_sample_frames=True, fps=2.0)

    def plan_decode(data: bytes) -> None:
        facts = probe_video(data, max_pixels=MAX_PIXELS)
        decode_video(data, settings.video(facts).indices)

    rows = [
        ("video probe (container only)", timed(lambda v: probe_video(v[1], max_pixels=MAX_PIXELS), videos)),
        ("video probe, mp4/mov/avi (header)",
         timed(lambda v: probe_video(v[1], max_pixels=MAX_PIXELS),
               [v for v in videos if v[0] in ("mp4", "mov", "avi")])),
        ("video probe, mkv/webm (packet count)",
         timed(lambda v: probe_video(v[1], max_pixels=MAX_PIXELS), [v for v in videos if v[0] in ("mkv", "webm")])),
        ("video plan + decode sampled frames (2 fps)", timed(lambda v: plan_decode(v[1]), videos)),
        ("video full decode (probe decode=True)",
         timed(lambda v: probe_video(v[1], max_pixels=MAX_PIXELS, decode=True), videos)),
        ("audio probe", timed(probe_audio, audio)),
        ("audio decode to 16 kHz", timed(lambda a: decode_audio(a, rate=16000), audio)),
    ]
    print(f"{'step':45s} {'samples/s':>10s} {'ms/sample':>10s}")
    for name, (secs, n) in rows:
        print(f"{name:45s} {n / secs:10.1f} {1000 * secs / n:10.2f}")
    probe_s, full_s = rows[0][1][0], rows[4][1][0]
    print(f"container reading is {100 * probe_s / full_s:.1f}% of a full decode of the same videos")
    return 0


if __name__ == "__main__":
    sys.exit(main())
