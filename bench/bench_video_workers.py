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
the encode tasks the layout gives (:func:`packtool.packer.store.shard_ranges`), pack(1) / pack(2)
(the 2-worker speedup) and pack(2) / floor.

A whole run also pays costs that do not grow with the videos: the command's and its workers' start-ups (an
interpreter, transformers and the tokenizer each) and the planning, writing and closing after the last sample. So
each layout is also packed (2 workers) from its first half of the videos, and the floor decodes that half too: the
marginal ratio (pack(all) - pack(half)) / (floor(all) - floor(half)) is what each further video costs against its
bare decode, the ratio a large source tends to.
Each pack's stages (as it prints them) are split the same way: the marginal seconds of its encode stage and of
its write stage (the output's copy of the videos' bytes) against the floor's.
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
#: Each layout, also made of the first half of the videos (``<layout>-half``).
HALF = "-half"


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
    """The two layouts, their halves and the model folder, cached under ``--out`` for these settings."""
    key = f"{args.videos}-{args.seconds:g}-{args.width}x{args.height}-{args.fps_source}-{args.shards}"
    paths = {name: args.out / name for name in (*LAYOUTS, *(layout + HALF for layout in LAYOUTS), "model")}
    stamp = args.out / "built.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        if not all(paths[layout + HALF].exists() for layout in LAYOUTS):  # a cache from before the halves
            write_halves(paths, read_samples(paths["one-shard"]), args.shards)
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
    write_halves(paths, samples, args.shards)
    demo.build_tokenizer(paths["model"])
    stamp.write_text(json.dumps({"key": key, "bytes": sum(len(v) for v in videos)}))
    return paths


def write_halves(paths: dict[str, Path], samples: list[tuple[str, dict[str, bytes]]], shards: int) -> None:
    """Each layout of the first half of ``samples`` (the spread one over half the shards)."""
    half = samples[:len(samples) // 2]
    for layout, count in (("spread", max(1, shards // 2)), ("one-shard", 1)):
        shutil.rmtree(paths[layout + HALF], ignore_errors=True)
        write_layout(paths[layout + HALF], half, count)


def read_samples(root: Path) -> list[tuple[str, dict[str, bytes]]]:
    """The samples of a layout's shards, in order."""
    from packtool.packer.sources import open_source

    out: dict[str, dict[str, bytes]] = {}
    for shard in open_source(root).splits["train"]:
        with tarfile.open(root / shard) as tar:
            for m in tar:
                key, part = m.name.split(".", 1)
                data = tar.extractfile(m)
                assert data is not None
                out.setdefault(key, {})[part] = data.read()
    return list(out.items())


def encode_tasks(root: Path) -> list[int]:
    """Samples of each encode task ``pack`` makes of the layout (its own range rule)."""
    from packtool.packer.sources import open_source
    from packtool.packer.sources.energon import shard_layout
    from packtool.packer.store import shard_ranges

    sizes = []
    for shard in open_source(root).splits["train"]:
        layout = shard_layout(root, shard)
        bounds = [r.first for r in shard_ranges(layout)] + [len(layout.starts)]
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


def run_pack(src: Path, model: Path, out: Path, workers: int, fps: float) -> tuple[float, dict[str, float]]:
    """Wall seconds of one pack command, and the seconds of its stages as it prints them."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "packtool", "pack", str(src), str(out), "--tokenizer", str(model),
           "--pack-size", "16384", "--split", "train", "--workers", str(workers), "--no-progress",
           "--media-check", "decode", "--video-fps", str(fps)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # this checkout's packtool
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"packtool: error: the benchmark's pack failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
    line = next((x for x in done.stdout.splitlines() if x.startswith("seconds: ")), "seconds: ")
    stages = {k: float(v) for k, v in (part.rsplit(" ", 1) for part in line[len("seconds: "):].split(", ") if part)}
    return wall, stages


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
    half_members = video_members(paths["spread" + HALF])

    times: dict[str, float] = {}
    stages: dict[str, dict[str, float]] = {}  # of each pack's best run
    frames = 0

    def best(name: str, wall: float | tuple[float, dict[str, float]]) -> None:
        wall, stage = wall if isinstance(wall, tuple) else (wall, {})
        if wall < times.get(name, float("inf")):
            times[name], stages[name] = wall, stage

    for _ in range(args.repeat):
        for layout in LAYOUTS:
            for w in (1, 2):
                time.sleep(1)  # the last run's processes are still exiting: let them, before timing alone
                best(f"{layout} pack {w}", run_pack(paths[layout], paths["model"], args.out / "packed", w, args.fps))
                kept = sum(1 for _ in _segments(args.out / "packed"))
                if kept != args.videos:
                    sys.exit(f"packtool: error: the pack of {layout} kept {kept} of {args.videos} samples (see its "
                             f"ledger)")
            time.sleep(1)
            best(f"{layout}{HALF} pack 2", run_pack(paths[layout + HALF], paths["model"], args.out / "packed", 2,
                                                     args.fps))
        time.sleep(1)
        wall, frames = run_floor(members, 2)
        best("floor 2", wall)
        time.sleep(1)
        best(f"floor{HALF} 2", run_floor(half_members, 2)[0])

    floor, floor_half = times["floor 2"], times[f"floor{HALF} 2"]
    print(f"floor: {len(members)} videos ({frames} frames) decoded by 2 processes: {floor:.2f} s "
          f"(the first {len(half_members)}: {floor_half:.2f} s)")
    for layout in LAYOUTS:
        tasks = encode_tasks(paths[layout])
        p1, p2, half = times[f"{layout} pack 1"], times[f"{layout} pack 2"], times[f"{layout}{HALF} pack 2"]
        print(f"{layout}: {len(tasks)} encode task(s) of {tasks} samples; pack 1 worker {p1:.2f} s, 2 workers "
              f"{p2:.2f} s: 2 workers / 1 worker speedup {p1 / p2:.2f}x; pack(2) / floor {p2 / floor:.2f}x; "
              f"half the videos {half:.2f} s: marginal pack(2) / floor {(p2 - half) / (floor - floor_half):.2f}x; "
              f"at no videos (extrapolated) pack(2) {2 * half - p2:.2f} s, floor {2 * floor_half - floor:.2f} s")
        full, part = stages[f"{layout} pack 2"], stages[f"{layout}{HALF} pack 2"]
        print("  stages of pack(2), all / half the videos: " + ", ".join(
            f"{k} {full[k]:.2f} / {part.get(k, 0.0):.2f}" for k in full)
            + "; the marginal seconds of each against the floor's: " + ", ".join(
            f"{k} {(full[k] - part.get(k, 0.0)) / (floor - floor_half):.2f}x" for k in full))


if __name__ == "__main__":
    main()
