"""A million samples on this machine: every verb timed and measured on a text-heavy source.

    .venv/bin/python bench/bench_scale.py [--samples 1000000] [--workers 2] [--keep bench/out/scale]
                                          [--source energon|jsonl]

Builds (or reuses, with ``--keep``) a demo dataset of mostly text samples (1 % with images), or one JSONL of text
conversations (``--source jsonl``: the records of ``bench_file_floor.py``), then runs, each as a CLI subprocess:
``pack`` (its per-stage seconds as it prints them), ``stats``, ``verify``, ``inspect KEY``. For each: wall and CPU
seconds, peak resident memory of the whole process tree and of its largest process (psutil, sampled every 20 ms);
for ``pack`` also the bytes of the work folder (``.packtool``), of the dataset it wrote, of its ledger and manifest.
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
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

import demo  # noqa: E402
from packtool.format import MANIFEST  # noqa: E402

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
    ap.add_argument("--source", choices=("energon", "jsonl"), default="energon",
                    help="an Energon dataset (1 %% images), or one JSONL of text conversations (60-word questions)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="packtool-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    tok, out = work / "tokenizer", work / "out"
    data = work / "dataset" if args.source == "energon" else work / "records" / "data.jsonl"
    if not (tok / "tokenizer.json").exists():
        demo.build_tokenizer(tok)
    want = {"samples": args.samples, "per_shard": args.per_shard, "source": args.source}
    stamp = data.parent / f".bench-{data.name}.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != want:
        t = time.perf_counter()
        if args.source == "energon":
            demo.build_dataset(data, n_train=args.samples, n_val=0, image_fraction=0.01,
                               samples_per_shard=args.per_shard)
        else:
            from bench_file_floor import conversation

            data.parent.mkdir(parents=True, exist_ok=True)
            with open(data, "w") as f:
                for i in range(args.samples):
                    f.write(json.dumps(conversation(i, 60)) + "\n")
        stamp.write_text(json.dumps(want))
        print(f"built {args.samples} samples in {time.perf_counter() - t:.0f} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    cli = [sys.executable, "-m", "packtool"]
    key = "train-000000777"
    runs = {
        "pack": cli + ["pack", str(data), str(out), "--tokenizer", str(tok), "--pack-size", "8192", "--workers",
                       str(args.workers), "--no-progress", "--max-error-rate", "1"],
        "stats": cli + ["stats", str(out)],
        "verify": cli + ["verify", str(out)],
        "inspect": cli + ["inspect", str(out), key],
    }
    print(f"{'verb':<8} {'wall s':>8} {'cpu s':>8} {'tree MB':>8} {'process MB':>10}", flush=True)
    for verb, cmd in runs.items():
        r = measured(cmd)
        print(f"{verb:<8} {r['wall']:>8.1f} {r['cpu']:>8.1f} {r['tree_mb']:>8.0f} {r['process_mb']:>10.0f}",
              flush=True)
        if verb == "pack":
            stages = [line for line in r["stdout"].splitlines() if line.startswith("seconds:")]
            print(f"         {stages[0] if stages else ''}")
            source_bytes = folder_bytes(data) if data.is_dir() else data.stat().st_size
            print(f"         work folder {folder_bytes(out, inside='.packtool') / MB:.0f} MB, "
                  f"dataset {folder_bytes(out, skip='.packtool') / MB:.0f} MB, "
                  f"source {source_bytes / MB:.0f} MB, ledger {(out / 'ledger.parquet').stat().st_size / MB:.1f} MB, "
                  f"manifest {(out / MANIFEST).stat().st_size / 1024:.1f} KB", flush=True)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
