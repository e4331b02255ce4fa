"""Do workers pay on videos? ``packtool pack --media-check decode`` with 1 and 2 workers against a decode-only floor.

    .venv/bin/python bench/bench_video_workers.py [--videos 60] [--seconds 2] [--width 320] [--height 240]
                                                  [--shards 4] [--repeat 1] [--out bench/out/video_workers]

Builds (offline, PyAV; cached under ``--out``) ``--videos`` samples, each one short mp4 (H.264) with a one-turn
conversation about it, as Energon datasets (Energon's own preparator) in two layouts holding the same samples:
spread over ``--shards`` shards, and all in ONE shard. Every video is distinct (its frames start at its own offset).

Then, interleaved and best of ``--repeat``, with ``--media-check decode`` (every frame decoded once, what the
default check does): ``pack`` with 1 and with 2 workers on each layout (fresh CLI runs, so start-ups count), and
the floor: the same videos decoded alone (``probe_video(decode=True)``, the check's own call) by 2 processes, each
decoding half of them with the decoder threads a worker of a 2-worker pack gets
(:func:`packtool.media.video.decoder_threads_for`); its time includes its processes' start-up. Printed per layout:
the encode tasks the layout gives (ranges of at most 1,024 samples or about 32 MB of shard), pack(1) / pack(2)
(the 2-worker speedup) and pack(2) / floor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's packtool, also in the floor's processes

import demo  # noqa: E402

PIXEL_LIMIT = 1 << 28  # far above the videos' frames: the check decodes, it never refuses a size here
LAYOUTS = ("spread", "one-shard")


def encode_video(args: tuple[int, int, int, int, int]) -> bytes:
    """An mp4 (H.264, yuv420p) of ``frames`` frames of :func:`demo.frame_pixels` from frame ``offset`` on."""
    import io

    import av

    offset, width, height, frames, fps = args
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "threads": "1"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(demo.frame_pixels(offset + i, width, height), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def sample(i: int, video: bytes) -> tuple[str, dict[str, bytes]]:
    turns = [{"role": "user", "content": f"<video>\nWhat happens in clip {i}?"},
             {"role": "assistant", "content": "The colours drift slowly from left to right."}]
    return f"v{i:06d}", {"mp4": video, "json": json.dumps({"messages": turns}).encode()}


def write_layout(root: Path, samples: list[tuple[str, dict[str, bytes]]], shards: int) -> None:
    """``samples`` over ``shards`` shards (consecutive runs of about equal count), split ``train``."""
    per = -(-len(samples) // shards)
    names = []
    for k in range(0, len(samples), per):
        name = f"shards/train-{k // per:04d}.tar"
        demo.write_shard(root / name, samples[k:k + per])
        names.append(name)
    demo.prepare_energon(root, names, {"train": names},
                         dataset_yaml={"__module__": "megatron.energon", "__class__": "CrudeWebdataset"})


def build(args: argparse.Namespace) -> dict[str, Path]:
    """The two layouts and the model folder, cached under ``--out`` for these settings."""
    key = f"{args.videos}-{args.seconds:g}-{args.width}x{args.height}-{args.fps_source}-{args.shards}"
    paths = {"spread": args.out / "spread", "one-shard": args.out / "one-shard", "model": args.out / "model"}
    stamp = args.out / "built.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        return paths
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    frames = max(2, round(args.seconds * args.fps_source))
    jobs = [(i * 7, args.width, args.height, frames, args.fps_source) for i in range(args.videos)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        videos = pool.map(encode_video, jobs, chunksize=4)
    samples = [sample(i, v) for i, v in enumerate(videos)]
    write_layout(paths["spread"], samples, args.shards)
    write_layout(paths["one-shard"], samples, 1)
    demo.build_tokenizer(paths["model"])
    stamp.write_text(json.dumps({"key": key, "bytes": sum(len(v) for v in videos)}))
    return paths


def encode_tasks(root: Path) -> list[int]:
    """Samples of each encode task ``pack`` makes of the layout (its own range rule)."""
    from packtool.packer.sources import open_source
    from packtool.packer.sources.energon import shard_layout
    from packtool.packer.store import BYTES_PER_RANGE, SAMPLES_PER_RANGE

    sizes = []
    for shard in open_source(root).splits["train"]:
        layout = shard_layout(root, shard)
        bounds = [r.first for r in layout.ranges(SAMPLES_PER_RANGE, BYTES_PER_RANGE)] + [len(layout.starts)]
        sizes += [b - a for a, b in zip(bounds, bounds[1:])]
    return sizes


def video_members(root: Path) -> list[tuple[str, int, int]]:
    """(shard path, offset, size) of every video of the layout, in order."""
    from packtool.packer.sources import open_source

    out = []
    for shard in open_source(root).splits["train"]:
        with tarfile.open(root / shard) as tar:
            out += [(str(root / shard), m.offset_data, m.size) for m in tar if m.name.endswith(".mp4")]
    return out


def floor_init(threads: int) -> None:
    from packtool.media.video import set_decoder_threads

    set_decoder_threads(threads)


def floor_decode(members: list[tuple[str, int, int]]) -> int:
    """Read and decode every frame of some videos, as the decode check does; returns frames."""
    from packtool.media.video import probe_video

    frames = 0
    for path, offset, size in members:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        frames += probe_video(data, max_pixels=PIXEL_LIMIT, decode=True).frames
    return frames


def run_floor(members: list[tuple[str, int, int]], processes: int) -> tuple[float, int]:
    """Wall seconds (start-up included) and frames of decoding ``members`` split in halves over ``processes``."""
    from packtool.media.video import decoder_threads_for

    per = -(-len(members) // processes)
    parts = [members[k:k + per] for k in range(0, len(members), per)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(processes, initializer=floor_init,
                                                   initargs=(decoder_threads_for(processes),)) as pool:
        frames = sum(pool.map(floor_decode, parts))
    return time.perf_counter() - start, frames


def run_pack(src: Path, model: Path, out: Path, workers: int, fps: float) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "packtool", "pack", str(src), str(out), "--tokenizer", str(model),
           "--pack-size", "16384", "--split", "train", "--workers", str(workers), "--no-progress",
           "--media-check", "decode", "--video-fps", str(fps)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # this checkout's packtool
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"packtool: error: the benchmark's pack failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
    return wall


def _segments(out: Path) -> Iterator[object]:
    """Every sample the pack at ``out`` kept."""
    from packtool.format import PackRecord, split_shard_paths
    from packtool.shards import iter_records

    for shard in split_shard_paths(out, "train"):
        for key, members in iter_records(shard):
            yield from PackRecord.from_members(key, members).segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--height", type=int, default=240)
    ap.add_argument("--fps-source", type=int, default=24, help="the videos' frame rate")
    ap.add_argument("--fps", type=float, default=2.0, help="video frames sampled per second (--video-fps)")
    ap.add_argument("--shards", type=int, default=4, help="shards of the spread layout")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; each number is the best round")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "video_workers")
    args = ap.parse_args()
    if args.videos < 2 or args.shards < 1 or args.repeat < 1:
        ap.error("--videos must be at least 2, --shards and --repeat at least 1")

    t = time.perf_counter()
    paths = build(args)
    total = json.loads((args.out / "built.json").read_text())["bytes"]
    print(f"source: {args.videos} videos (mp4/H.264 {args.width}x{args.height}, {args.seconds:g} s at "
          f"{args.fps_source} fps, {total / 1e6:.1f} MB); built or loaded in {time.perf_counter() - t:.1f} s")
    members = video_members(paths["spread"])

    times: dict[str, float] = {}
    frames = 0
    for _ in range(args.repeat):
        for layout in LAYOUTS:
            for w in (1, 2):
                time.sleep(1)  # the last run's processes are still exiting: let them, before timing alone
                name = f"{layout} pack {w}"
                times[name] = min(times.get(name, float("inf")),
                                  run_pack(paths[layout], paths["model"], args.out / "packed", w, args.fps))
        time.sleep(1)
        wall, frames = run_floor(members, 2)
        times["floor 2"] = min(times.get("floor 2", float("inf")), wall)
    kept = sum(1 for _ in _segments(args.out / "packed"))
    if kept != args.videos:
        sys.exit(f"packtool: error: the last pack kept {kept} of {args.videos} samples (see its ledger)")

    floor = times["floor 2"]
    print(f"floor: {len(members)} videos ({frames} frames) decoded by 2 processes: {floor:.2f} s")
    for layout in LAYOUTS:
        tasks = encode_tasks(paths[layout])
        p1, p2 = times[f"{layout} pack 1"], times[f"{layout} pack 2"]
        print(f"{layout}: {len(tasks)} encode task(s) of {tasks} samples; pack 1 worker {p1:.2f} s, 2 workers "
              f"{p2:.2f} s: 2 workers / 1 worker speedup {p1 / p2:.2f}x; pack(2) / floor {p2 / floor:.2f}x")


if __name__ == "__main__":
    main()
