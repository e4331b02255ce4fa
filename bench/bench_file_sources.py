"""Memory and disk of ``packtool pack`` on file sources read in place.

    .venv/bin/python bench/bench_file_sources.py [--images 1000] [--image-mb 4] [--jsonl-mb 600] [--workers 2]
                                                 [--keep DIR]

Two runs, each ``packtool pack`` in a subprocess with its own scratch and work folders (``TMPDIR``,
``PACKTOOL_SCRATCH``, ``PACKTOOL_WORK``):

* images: a JSONL file of ``--images`` records, each naming its own incompressible ``--image-mb`` MB PNG;
* text: a JSONL file of about ``--jsonl-mb`` MB of text-only conversations.

psutil samples the resident memory of the whole process tree (sum over processes) every 50 ms, and the bytes
held outside OUTPUT (files under the run's folder but OUTPUT, the inputs excepted: scratch, work, anything
beside the source). Printed per run: peak tree memory and its budget, peak bytes outside OUTPUT and its budget
(5 % of the media), the output's size, and seconds.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402

MB = 2**20


def noise_png(megabytes: float, seed: int) -> bytes:
    """A PNG of random pixels of about ``megabytes`` MB (PNG cannot compress noise)."""
    side = int((megabytes * MB / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def conversation(i: int, images: list[str], words: int = 12) -> dict:
    text = " ".join(f"word{(i * 7 + k) % 997}" for k in range(words))
    return {"id": f"r{i}", "messages": [
        {"role": "user", "content": "<image>\n" * len(images) + f"Question {i}: {text}"},
        {"role": "assistant", "content": f"Answer {i}: {text[: len(text) // 2]}"}], "images": images}


def _sizes(root: Path, skip: set[Path]) -> int:
    total = 0
    for p in root.rglob("*"):
        if any(p == s or p.is_relative_to(s) for s in skip):
            continue
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def measure(work: Path, source: Path, media: Path | None, tokenizer: Path, workers: int, pack_size: int,
            inputs: set[Path]) -> dict:
    """Pack ``source`` into ``work/out`` in a subprocess; peak tree memory and peak bytes outside OUTPUT."""
    scratch = work / "scratch"
    scratch.mkdir()
    env = {**__import__("os").environ, "TMPDIR": str(scratch), "PACKTOOL_SCRATCH": str(scratch),
           "PACKTOOL_WORK": str(scratch / "work")}
    out = work / "out"
    cmd = [sys.executable, "-m", "packtool.cli", "pack", str(source), str(out), "--tokenizer", str(tokenizer),
           "--pack-size", str(pack_size), "--workers", str(workers), "--media-check", "header", "--no-progress"]
    if media is not None:
        cmd += ["--media-dir", str(media)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"rss": 0, "outside": 0}

    def sample() -> None:
        k = 0
        while proc.poll() is None:
            try:
                root = psutil.Process(proc.pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                rss = 0
            peak["rss"] = max(peak["rss"], rss)
            if k % 10 == 0:  # every 0.5 s: a folder walk
                peak["outside"] = max(peak["outside"], _sizes(work, {out, *inputs}))
            k += 1
            time.sleep(0.05)

    watcher = threading.Thread(target=sample)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"pack failed ({proc.returncode}): {stderr[-2000:]}")
    peak["outside"] = max(peak["outside"], _sizes(work, {out, *inputs}))
    return {**peak, "seconds": time.perf_counter() - start, "output": _sizes(out, set()),
            "summary": stdout.strip().splitlines()[0] if stdout.strip() else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--image-mb", type=float, default=4.0)
    parser.add_argument("--jsonl-mb", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="work here (kept) instead of a temporary folder")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="bench-file-sources-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = base / "tokenizer"
        if not tokenizer.is_dir():
            demo.build_tokenizer(tokenizer)
        if args.images:
            work = base / "images"
            media = work / "media"
            media.mkdir(parents=True)
            blob = noise_png(args.image_mb, 0)
            for i in range(args.images):  # one file per record; the same pixels (the bytes are what count)
                (media / f"{i:06d}.png").write_bytes(blob)
            source = work / "d.jsonl"
            source.write_text("\n".join(json.dumps(conversation(i, [f"{i:06d}.png"])) for i in range(args.images)))
            media_bytes = args.images * len(blob)
            got = measure(work, source, media, tokenizer, args.workers, 4096, {media, source})
            print(f"images: {args.images} records x {len(blob) / MB:.1f} MB ({media_bytes / MB:.0f} MB of media): "
                  f"peak tree memory {got['rss'] / MB:.0f} MB (budget 1536 MB), peak bytes outside OUTPUT "
                  f"{got['outside'] / MB:.2f} MB (budget {0.05 * media_bytes / MB:.0f} MB), output "
                  f"{got['output'] / MB:.0f} MB, {got['seconds']:.1f} s; {got['summary']}")
            shutil.rmtree(work)
        if args.jsonl_mb:
            work = base / "text"
            work.mkdir()
            source = work / "t.jsonl"
            with open(source, "w") as f:
                i, written = 0, 0
                while written < args.jsonl_mb * MB:
                    line = json.dumps(conversation(i, [], words=60)) + "\n"
                    f.write(line)
                    written += len(line)
                    i += 1
            got = measure(work, source, None, tokenizer, args.workers, 4096, {source})
            print(f"text: {i} records, {written / MB:.0f} MB of JSONL: peak tree memory {got['rss'] / MB:.0f} MB "
                  f"(budget 1024 MB), peak bytes outside OUTPUT {got['outside'] / MB:.2f} MB, output "
                  f"{got['output'] / MB:.0f} MB, {got['seconds']:.1f} s; {got['summary']}")
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
