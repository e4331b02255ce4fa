"""``packtool pack`` and the reader on a video-heavy source: samples/s, and how much is container reading vs decoding.

    .venv/bin/python bench/bench_video_pack.py [--samples 160] [--repeat 2] [--read-packs 4] [--workers 1 2]

Builds (offline, PyAV; cached under ``--out``) a source where most samples carry one 2-6 s video (mp4/H.264,
webm/VP8, mkv/FFV1, avi/MJPEG, up to 640x360, some with an audio track) or a list of JPEG frames, a few carry an
audio clip (wav/flac) and the rest are text. Qwen2.5-VL has no audio rule, so its copy of the source leaves the
clips out; the Nemotron Omni copy (``examples/nemotron_omni_model.py``) keeps them.

Then, in one process, interleaved and best of ``--repeat``, for each family: ``pack`` (what the CLI runs) with 1
and 2 workers, ``media_check`` header and decode (the CLI's ``--media-check``); the media work of the same samples
timed alone in this process: container reading (``probe_video`` / ``probe_frames`` / ``probe_audio`` from headers,
packets counted where the container gives no frame count) and the decoding a ``decode`` check adds; the rest of a
1-worker pack (read shards, render, tokenize, plan, write) is its time minus those. Last, ``read_packs`` on each
packed output with the media decoded and processed, against the same read without media and a bare decode of the
planned frames (and clips), so the reader's time splits into decode, processor and the rest.

Videos are sampled at ``--fps`` (as ``--video-fps``); a frame list records no rate, so those samples are
quarantined ("video has no frame rate") and count as handled samples of the pack run. Encoding works in ranges of
even work (:func:`packtool.packer.store.shard_ranges`), so a shard of videos is several tasks a second worker shares.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import random
import shutil
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]

import demo  # noqa: E402
import mediafixture as mf  # noqa: E402
import nemotron_omni_model  # noqa: E402
from packtool.format import PackRecord, split_shard_paths  # noqa: E402
from packtool.media import decode_audio, decode_frames, decode_video, probe_audio, probe_frames, probe_video  # noqa: E402
from packtool.packer.pipeline import pack  # noqa: E402
from packtool.runtime.read import read_packs  # noqa: E402
from packtool.settings import EncodeSettings, PackSettings, RunOptions  # noqa: E402
from packtool.shards import iter_records  # noqa: E402

PIXEL_LIMIT = EncodeSettings(tokenizer="x", pack_size=8).pixel_limit
CONTAINERS = ("mp4", "webm", "mkv", "avi")
SIZES = ((640, 360), (480, 270), (320, 180), (256, 144))


def make_sample(i: int, rng: random.Random) -> tuple[dict[str, bytes], str]:
    """One sample's members and its kind: ``video`` (a container), ``frames`` (JPEG list), ``audio`` or ``text``."""
    r = rng.random()
    kind = "video" if r < 0.75 else "frames" if r < 0.85 else "audio" if r < 0.95 else "text"
    words = " ".join(demo.sentence(rng) for _ in range(rng.randint(1, 3)))
    reply = " ".join(demo.sentence(rng) for _ in range(rng.randint(2, 8)))
    members: dict[str, bytes] = {}
    tag = ""
    if kind in ("video", "frames"):
        width, height = rng.choice(SIZES)
        fps = rng.choice((24, 25, 30))
        frames = round(rng.uniform(2.0, 6.0) * fps)
        tag = "<video>\n"
        if kind == "video":
            ext = CONTAINERS[i % len(CONTAINERS)]
            audio = 16000 if rng.random() < 0.3 else None
            members[ext] = mf.make_video(ext, width=width, height=height, frames=frames, fps=fps, audio_rate=audio)
        else:  # a short list: frame lists are sampled clips, not whole streams
            for f in range(rng.randint(4, 16)):
                members[f"clip.{f}.jpg"] = demo.encode_image(demo.Image.fromarray(mf.frame_pixels(f, width, height)),
                                                             "jpg")
    elif kind == "audio":
        ext, rate = rng.choice((("wav", 16000), ("flac", 22050)))
        members[ext] = mf.make_audio(ext, samples=int(rate * rng.uniform(2.0, 6.0)), rate=rate)
        tag = "<audio>\n"
    turns = [{"role": "user", "content": tag + words}, {"role": "assistant", "content": reply}]
    members["json"] = json.dumps({"messages": turns}).encode()
    return members, kind


def build(out: Path, n: int) -> dict[str, Path]:
    """The two sources (``qwen``: without the audio samples; ``omni``: all) and the two model folders, cached."""
    stamp = out / f"built-{n}.json"
    paths = {"qwen_src": out / "src-qwen", "omni_src": out / "src-omni",
             "qwen_model": out / "model-qwen", "omni_model": out / "model-omni"}
    if stamp.exists():
        return paths
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = random.Random(0)
    samples = {f"v{i:05d}": make_sample(i, rng) for i in range(n)}
    mf.write_source(paths["omni_src"], {k: m for k, (m, _) in samples.items()})
    mf.write_source(paths["qwen_src"], {k: m for k, (m, kind) in samples.items() if kind != "audio"})
    demo.build_tokenizer(paths["qwen_model"])
    nemotron_omni_model.write_model_folder(paths["omni_model"])
    kinds = [kind for _, kind in samples.values()]
    stamp.write_text(json.dumps({k: kinds.count(k) for k in sorted(set(kinds))}))
    return paths


def source_media(src: Path) -> list[tuple[str, object]]:
    """(kind, data) of every media item of the source: a container's bytes, a frame list, or an audio clip."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(src / "shards/media.tar") as tar:
        for info in tar:
            key, part = info.name.split(".", 1)
            samples.setdefault(key, {})[part] = tar.extractfile(info).read()  # type: ignore[union-attr]
    items: list[tuple[str, object]] = []
    for members in samples.values():
        frames = sorted((k for k in members if k.startswith("clip.")), key=lambda k: int(k.split(".")[1]))
        if frames:
            items.append(("frames", [members[k] for k in frames]))
        for ext in CONTAINERS:
            if ext in members:
                items.append(("video", members[ext]))
        for ext in ("wav", "flac"):
            if ext in members:
                items.append(("audio", members[ext]))
    return items


def probe(items: list[tuple[str, object]], decode: bool) -> None:
    """What the encoder's media check does for each item (``decode``: every frame / sample decoded once)."""
    for kind, data in items:
        if kind == "video":
            probe_video(data, max_pixels=PIXEL_LIMIT, decode=decode)  # type: ignore[arg-type]
        elif kind == "frames":
            probe_frames(data, max_pixels=PIXEL_LIMIT, decode=decode)  # type: ignore[arg-type]
        else:
            probe_audio(data, decode=decode)  # type: ignore[arg-type]


def run_pack(src: Path, model: Path, out: Path, workers: int, check: str, fps: float) -> tuple[float, dict, dict]:
    shutil.rmtree(out, ignore_errors=True)
    encode = EncodeSettings(tokenizer=str(model), pack_size=16384, media_check=check, video_fps=fps)  # type: ignore[arg-type]
    settings = PackSettings(encode, splits=("train",))
    start = time.perf_counter()
    result = pack(src, out, settings, RunOptions(workers=workers, progress=False))
    return time.perf_counter() - start, result.seconds, result.counts["train"]


def first_records(path: Path, n: int) -> Iterator[PackRecord]:
    records = (PackRecord.from_members(k, m) for shard in split_shard_paths(path, "train")
               for k, m in iter_records(shard))
    return itertools.islice(records, n)


def bare_decode(path: Path, n: int) -> None:
    """The reader's media decoding alone: the first ``n`` packs' planned video frames, audio at 16 kHz, images."""
    from PIL import Image

    for record in first_records(path, n):
        for m in record.media_refs:
            if m.kind == "video" and m.frames:
                decode_frames([record.media[f] for f in m.frames], m.frame_indices)
            elif m.kind == "video":
                decode_video(record.media[m.member], m.frame_indices)
            elif m.kind == "audio":
                decode_audio(record.media[m.member], rate=16000)
            else:
                Image.open(io.BytesIO(record.media[m.member])).convert("RGB")


def drain(path: Path, images: bool, n: int) -> int:
    return sum(1 for _ in itertools.islice(read_packs(path, "train", images=images), n))


def best(times: dict, name: str, fn: Callable[[], object]) -> object:
    start = time.perf_counter()
    value = fn()
    times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds; each number is the best round")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--fps", type=float, default=2.0, help="video frames sampled per second (--video-fps)")
    ap.add_argument("--read-packs", type=int, default=4, help="packs the reader reads per family")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "video_pack")
    args = ap.parse_args()

    t = time.perf_counter()
    paths = build(args.out, args.samples)
    kinds = json.loads((args.out / f"built-{args.samples}.json").read_text())
    print(f"source: {args.samples} samples {kinds} (built or loaded in {time.perf_counter() - t:.1f} s)")
    families = {"qwen2.5-vl": ("qwen_src", "qwen_model"), "nemotron-omni": ("omni_src", "omni_model")}
    media = {fam: source_media(paths[src]) for fam, (src, _) in families.items()}
    for fam in families:  # warm PyAV's and PIL's codecs once
        probe(media[fam][:8], True)

    times: dict[str, float] = {}
    stages: dict[str, dict] = {}
    counts: dict[str, dict] = {}
    for _ in range(args.repeat):
        for fam, (src, model) in families.items():
            for check in ("header", "decode"):
                time.sleep(2)  # the last run's worker processes are still exiting: let them, before timing alone
                best(times, f"{fam} probe {check}", lambda f=fam, c=check: probe(media[f], c == "decode"))
                for w in args.workers:
                    name = f"{fam} pack w{w} {check}"
                    secs, seconds, counts[fam] = run_pack(paths[src], paths[model], args.out / f"packed-{fam}", w,
                                                          check, args.fps)
                    if secs < times.get(name, float("inf")):
                        stages[name] = seconds
                    times[name] = min(times.get(name, float("inf")), secs)
            out = args.out / f"packed-{fam}"  # the last pack of the round (decode check, same bytes as header)
            k = args.read_packs
            best(times, f"{fam} read", lambda o=out, k=k: drain(o, True, k))
            best(times, f"{fam} read no-media", lambda o=out, k=k: drain(o, False, k))
            best(times, f"{fam} read decode-only", lambda o=out, k=k: bare_decode(o, k))
            read = list(first_records(out, k))
            counts[fam]["read"] = (len(read), sum(len(r.segments) for r in read),
                                   sum(len(r.media_refs) for r in read))

    print(f"{'what':44} {'s':>7} {'samples/s':>10}")
    for fam in families:
        n = counts[fam]["samples"]
        items = media[fam]
        print(f"{fam}: {n} samples ({counts[fam]['packed']} packed, {counts[fam]['error']} quarantined, "
              f"{counts[fam]['dropped']} dropped), {len(items)} media items")
        for check in ("header", "decode"):
            for w in args.workers:
                name = f"{fam} pack w{w} {check}"
                st = ", ".join(f"{k} {v:.1f}" for k, v in stages[name].items())
                print(f"  pack --workers {w} --media-check {check:6} {times[name]:7.2f} {n / times[name]:10.1f}"
                      f"   ({st})")
        w1h, w1d = times[f"{fam} pack w1 header"], times[f"{fam} pack w1 decode"]
        ph, pd = times[f"{fam} probe header"], times[f"{fam} probe decode"]
        print(f"  media alone: container reading {ph:.2f} s ({len(items) / ph:,.0f} items/s), with the decode check "
              f"{pd:.2f} s ({len(items) / pd:,.1f} items/s)")
        print(f"  1-worker pack, header check: container reading {ph / w1h:.1%}, rest {1 - ph / w1h:.1%}")
        print(f"  1-worker pack, decode check: container reading {ph / w1d:.1%}, decoding {(pd - ph) / w1d:.1%}, "
              f"rest {1 - pd / w1d:.1%}; decode/header pack time {w1d / w1h:.2f}x")
        if 2 in args.workers:
            for check in ("header", "decode"):
                speedup = times[f"{fam} pack w1 {check}"] / times[f"{fam} pack w2 {check}"]
                print(f"  2 vs 1 workers, {check}: {speedup:.2f}x")
        r, lean, dec = times[f"{fam} read"], times[f"{fam} read no-media"], times[f"{fam} read decode-only"]
        packs, segs, items = counts[fam]["read"]
        print(f"  read_packs with media, {packs} packs ({segs} samples, {items} media): {r:.2f} s = "
              f"{segs / r:.1f} samples/s, {packs / r:.2f} packs/s: decode {dec / r:.1%}, processor "
              f"{(r - lean - dec) / r:.1%}, everything else {lean / r:.1%}")


if __name__ == "__main__":
    main()
