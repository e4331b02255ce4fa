"""Reader throughput: `read_packs` on text packs (tokens/s) and image packs (packs/s), against bare PIL decode +
Qwen2-VL image processor on the same images in the same run (the floor any reader of these packs pays).

    .venv/bin/python bench/bench_read.py [--text-packs 200] [--image-packs 40] [--out bench/out/read]

Builds synthetic packed datasets with the test fixture writer (same on-disk format as `packtool pack`), or reads
`--packed OUTPUT` if given (a real `packtool pack` output; its split `--split`).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import packfixture as fx  # noqa: E402
from packtool.format import load_manifest, split_shard_paths  # noqa: E402
from packtool.runtime.read import image_processor_from_manifest, read_packs  # noqa: E402
from packtool.shards import iter_records  # noqa: E402

PROCESSOR = {**fx.QWEN_PROCESSOR, "min_pixels": 3136, "max_pixels": 1003520}


def photo(width: int, height: int, rng: np.random.Generator) -> bytes:
    """A JPEG that compresses like a photo (smooth gradients plus mild noise), not like white noise."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def text_packs(n: int, pack_size: int, align: int, rng) -> list[list[dict]]:
    packs = []
    for p in range(n):
        segs, used = [], 0
        while True:
            length = int(rng.integers(64, 2048))
            if used + -(-length // align) * align > pack_size:
                break
            segs.append({"key": f"t{p}-{len(segs)}", "tokens": rng.integers(0, 256, length).tolist(),
                         "targets": (rng.random(length) < 0.4).astype(int).tolist()})
            used += -(-length // align) * align
        packs.append(segs)
    return packs


def image_packs(n: int, per_pack: int, rng) -> list[list[dict]]:
    packs = []
    for p in range(n):
        segs = []
        for s in range(per_pack):
            w, h = int(rng.integers(320, 800)), int(rng.integers(240, 640))
            segs.append(fx.chat_segment(f"v{p}-{s}", "describe the image", "a picture " * 20,
                                        [(photo(w, h, rng), "jpg")], processor=PROCESSOR))
        packs.append(segs)
    return packs


def timed(fn, repeat: int = 2) -> float:
    """Best wall time of `repeat` runs (after the first, which warms caches and imports)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def baseline(path: Path, split: str) -> int:
    """PIL decode + image processor of every image of the split (media read straight from the tars)."""
    from PIL import Image

    processor = image_processor_from_manifest(load_manifest(path))
    images = 0
    for shard in split_shard_paths(path, split):
        for _, members in iter_records(shard):
            media = [m for s in json.loads(members["json"])["segments"] for m in s["media"]]
            if media:
                processor(images=[Image.open(io.BytesIO(members[m["member"]])) for m in media], return_tensors="np")
            images += len(media)
    return images


def count(path: Path, split: str, **kw) -> tuple[int, int, int]:
    packs = tokens = images = 0
    for b in read_packs(path, split, **kw):
        packs += 1
        tokens += int(b["cu_seqlens_unpadded"][-1])
        images += len(b.get("image_grid_thw", ()))
    return packs, tokens, images


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text-packs", type=int, default=200)
    ap.add_argument("--pack-size", type=int, default=8192)
    ap.add_argument("--image-packs", type=int, default=40)
    ap.add_argument("--images-per-pack", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "read")
    ap.add_argument("--packed", type=Path, help="an existing packed OUTPUT to read instead of synthetic data")
    ap.add_argument("--split", default="train")
    args = ap.parse_args()

    rows = []
    if args.packed:
        datasets = {"given": (args.packed, args.split)}
    else:
        rng = np.random.default_rng(0)
        text_dir, image_dir = args.out / "text", args.out / "images"
        fx.write_packs(text_dir, {"train": text_packs(args.text_packs, args.pack_size, 8, rng)},
                       pack_size=args.pack_size, align=8, image_processor=None, with_tokenizer=False)
        fx.write_packs(image_dir, {"train": image_packs(args.image_packs, args.images_per_pack, rng)},
                       pack_size=args.pack_size, align=8, image_processor=PROCESSOR, with_tokenizer=False)
        datasets = {"text": (text_dir, "train"), "images": (image_dir, "train")}

    for name, (path, split) in datasets.items():
        packs, tokens, images = count(path, split)
        t_full = timed(partial(count, path, split))
        t_lean = timed(partial(count, path, split, images=False))
        rows.append((f"{name}: read_packs", packs, tokens, images, t_full))
        if images:
            rows.append((f"{name}: read_packs(images=False)", packs, tokens, 0, t_lean))
            t_base = timed(partial(baseline, path, split))
            rows.append((f"{name}: PIL decode + processor only", packs, 0, images, t_base))

    print(f"{'what':40} {'packs':>6} {'s':>8} {'packs/s':>9} {'tokens/s':>12} {'images/s':>9}")
    for what, packs, tokens, images, secs in rows:
        print(f"{what:40} {packs:6d} {secs:8.3f} {packs / secs:9.1f} {tokens / secs:12,.0f} {images / secs:9.1f}")
    by = {r[0]: r for r in rows}
    for name in datasets:
        base = by.get(f"{name}: PIL decode + processor only")
        if base:
            full, lean = by[f"{name}: read_packs"], by[f"{name}: read_packs(images=False)"]
            print(f"{name}: read_packs time / (decode + processor) time = {full[4] / base[4]:.2f}; "
                  f"everything but the images: {1e3 * lean[4] / lean[1]:.2f} ms/pack "
                  f"= {lean[4] / base[4]:.1%} of the image work")


if __name__ == "__main__":
    main()
