"""Peak memory of ``packtool pack`` against the budget of 300 MB + 100 B per sample.

    .venv/bin/python bench/bench_memory.py [--samples 100000] [--workers 1 2] [--keep DIR] [--no-big-media]

Generates a demo dataset (mostly text, 5 % with images) and, unless ``--no-big-media``, a twin with the very same
samples and image sizes but incompressible (noise) pictures, so only the media bytes differ. Each run is
``packtool pack`` in a subprocess; psutil samples the resident memory of its whole process tree every 20 ms.
Printed per run: peak resident memory of the tree (sum over processes), of its anonymous part (resident minus
file-backed pages: shared libraries, mapped files), of the largest single process, and the budget.
Two sample counts (a fifth of the shards, then all of them) give the per-sample slope apart from the fixed cost.
A last line measures the fixed cost alone: one process that imports the encoder and loads the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402

BASE_MB = 300
PER_SAMPLE_B = 100
MB = 2**20


def noise_images() -> None:
    """Make the demo draw noise of the same size as its usual pictures (same tokens, far more bytes)."""

    def render(width, height, seed, *, mode="RGB", smooth=True):
        from PIL import Image

        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        pic = Image.fromarray(pixels, "RGB")
        return pic if mode == "RGB" else pic.convert(mode)

    demo.render_image = render


def build(path: Path, samples: int, per_shard: int, big_media: bool) -> Path:
    """The dataset (reused when ``path`` already holds one of that size)."""
    done = path / ".bench.json"
    want = {"samples": samples, "per_shard": per_shard, "big_media": big_media}
    if done.exists() and json.loads(done.read_text()) == want:
        return path
    if big_media:
        noise_images()
    t = time.perf_counter()
    demo.build_dataset(path, n_train=samples, n_val=0, image_fraction=0.05, samples_per_shard=per_shard)
    print(f"built {path.name}: {samples} samples in {time.perf_counter() - t:.0f} s", flush=True)
    done.write_text(json.dumps(want))
    return path


def shard_names(dataset: Path) -> list[str]:
    import braceexpand

    split = yaml.safe_load((dataset / ".nv-meta/split.yaml").read_text())
    return [s for p in split["split_parts"]["train"] for s in braceexpand.braceexpand(p)]


def view(dataset: Path, path: Path, shards: int) -> Path:
    """A dataset made of the first ``shards`` shards of ``dataset`` (its shard folder linked, not copied)."""
    names = shard_names(dataset)[:shards]
    (path / ".nv-meta").mkdir(parents=True, exist_ok=True)
    if not (path / "shards").exists():
        (path / "shards").symlink_to(dataset / "shards")
    (path / ".nv-meta/split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": names}, "exclude": []}))
    shutil.copy(dataset / ".nv-meta/dataset.yaml", path / ".nv-meta/dataset.yaml")
    return path


def dataset_facts(dataset: Path) -> tuple[int, int]:
    """(samples, bytes of image members) from the tar headers of the dataset's shards."""
    keys, media = 0, 0
    for shard in shard_names(dataset):
        with tarfile.open(dataset / shard) as tar:
            seen = set()
            for m in tar:
                seen.add(m.name.split(".", 1)[0])
                if m.name.rsplit(".", 1)[-1] in ("jpg", "png", "webp"):
                    media += m.size
            keys += len(seen)
    return keys, media


def peak_rss(cmd: list[str]) -> tuple[int, int, int, float]:
    """Run ``cmd``; return peak RSS summed over its process tree, the same for anonymous memory only, peak RSS
    of one process, and seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(proc.pid)
    tree_peak = anon_peak = one_peak = 0
    while proc.poll() is None:
        rss, anon = [], 0
        for p in [root, *root.children(recursive=True)]:
            try:
                m = p.memory_info()
            except psutil.Error:
                continue
            rss.append(m.rss)
            anon += m.rss - m.shared
        if rss:
            tree_peak, one_peak = max(tree_peak, sum(rss)), max(one_peak, max(rss))
            anon_peak = max(anon_peak, anon)
        time.sleep(0.02)
    err = proc.stderr.read().decode()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return tree_peak, anon_peak, one_peak, time.perf_counter() - start


def pack_command(dataset: Path, out: Path, tok: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "packtool.cli", "pack", str(dataset), str(out), "--tokenizer", str(tok),
            "--pack-size", "4096", "--workers", str(workers), "--no-progress", "--max-error-rate", "1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--per-shard", type=int, default=2000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-big-media", action="store_true", help="skip the twin dataset with noise pictures")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep and reuse (default: temporary)")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="packtool-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        demo.build_tokenizer(tok)
    variants = [("small-media", False)] + ([] if args.no_big_media else [("big-media", True)])
    n_shards = -(-args.samples // args.per_shard)
    print(f"{'dataset':<12} {'samples':>8} {'media MB':>9} {'workers':>7} {'tree MB':>8} {'anon MB':>8} "
          f"{'process MB':>10} {'budget MB':>9} {'s':>5}", flush=True)
    for name, big in variants:
        full = build(work / name, args.samples, args.per_shard, big)
        for shards in sorted({max(1, n_shards // 5), n_shards}):
            dataset = full if shards == n_shards else view(full, work / f"{name}-{shards}", shards)
            samples, media = dataset_facts(dataset)
            for workers in args.workers:
                out = work / f"out-{name}-{shards}-{workers}"
                shutil.rmtree(out, ignore_errors=True)
                tree, anon, one, seconds = peak_rss(pack_command(dataset, out, tok, workers))
                budget = BASE_MB * MB + PER_SAMPLE_B * samples
                print(f"{name:<12} {samples:>8} {media / MB:>9.0f} {workers:>7} {tree / MB:>8.0f} {anon / MB:>8.0f} "
                      f"{one / MB:>10.0f} {budget / MB:>9.0f} {seconds:>5.0f}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    probe = ("from packtool.packer.encoder import get_encoder; from packtool.settings import EncodeSettings; "
             f"get_encoder(EncodeSettings(tokenizer={str(tok)!r}, pack_size=4096))")
    _, anon, fixed, _ = peak_rss([sys.executable, "-c", probe])
    print(f"fixed cost of one process (python + transformers + tokenizer): "
          f"{fixed / MB:.0f} MB resident, {anon / MB:.0f} MB anonymous")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
