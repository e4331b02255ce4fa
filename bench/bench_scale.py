"""A million samples on this machine: every verb timed and measured on a text-heavy source.

    .venv/bin/python bench/bench_scale.py [--samples 1000000] [--workers 2] [--keep bench/out/scale]

Builds (or reuses, with ``--keep``) a demo dataset of mostly text samples (1 % with images), then runs, each as a
CLI subprocess: ``pack`` (its per-stage seconds as it prints them), ``stats``, ``verify``, ``inspect KEY``. For
each: wall and CPU seconds, peak resident memory of the whole process tree and of its largest process (psutil,
sampled every 20 ms); for ``pack`` also the bytes of the work folder (``.packtool``) and of the dataset it wrote.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402

MB = 2**20


def measured(cmd: list[str]) -> dict:
    """Run ``cmd``; wall and CPU seconds, peak RSS of its tree and of one process, and its stdout."""
    cpu0 = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    tree = one = 0
    while proc.poll() is None:
        rss = []
        for p in [root, *root.children(recursive=True)]:
            try:
                rss.append(p.memory_info().rss)
            except psutil.Error:
                continue
        if rss:
            tree, one = max(tree, sum(rss)), max(one, max(rss))
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return {"wall": time.perf_counter() - start, "cpu": _children_cpu() - cpu0, "tree_mb": tree / MB,
            "process_mb": one / MB, "stdout": out}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def folder_bytes(path: Path, *, inside: str | None = None, skip: str | None = None) -> int:
    root = path / inside if inside else path
    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and (skip is None or skip not in p.relative_to(path).parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--per-shard", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep and reuse (default: temporary)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="packtool-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    tok, data, out = work / "tokenizer", work / "dataset", work / "out"
    if not (tok / "tokenizer.json").exists():
        demo.build_tokenizer(tok)
    want = {"samples": args.samples, "per_shard": args.per_shard}
    if not (data / ".bench.json").exists() or json.loads((data / ".bench.json").read_text()) != want:
        t = time.perf_counter()
        demo.build_dataset(data, n_train=args.samples, n_val=0, image_fraction=0.01, samples_per_shard=args.per_shard)
        (data / ".bench.json").write_text(json.dumps(want))
        print(f"built {args.samples} samples in {time.perf_counter() - t:.0f} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    cli = [sys.executable, "-m", "packtool"]
    runs = {
        "pack": cli + ["pack", str(data), str(out), "--tokenizer", str(tok), "--pack-size", "8192", "--workers",
                       str(args.workers), "--no-progress", "--max-error-rate", "1"],
        "stats": cli + ["stats", str(out)],
        "verify": cli + ["verify", str(out)],
        "inspect": cli + ["inspect", str(out), "train-000000777"],
    }
    print(f"{'verb':<8} {'wall s':>8} {'cpu s':>8} {'tree MB':>8} {'process MB':>10}", flush=True)
    for verb, cmd in runs.items():
        r = measured(cmd)
        print(f"{verb:<8} {r['wall']:>8.1f} {r['cpu']:>8.1f} {r['tree_mb']:>8.0f} {r['process_mb']:>10.0f}",
              flush=True)
        if verb == "pack":
            stages = [line for line in r["stdout"].splitlines() if line.startswith("seconds:")]
            print(f"         {stages[0] if stages else ''}")
            print(f"         work folder {folder_bytes(out, inside='.packtool') / MB:.0f} MB, "
                  f"dataset {folder_bytes(out, skip='.packtool') / MB:.0f} MB, "
                  f"source {folder_bytes(data) / MB:.0f} MB", flush=True)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
