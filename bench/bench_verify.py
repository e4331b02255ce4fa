"""CPU and peak memory of ``packtool verify`` against the ``pack`` that made the output.

    .venv/bin/python bench/bench_verify.py [--samples 200000] [--workers 1 2] [--tokenizer DIR] [--work bench/out]

Builds (or reuses, under ``--work``) a text-heavy demo dataset (5 % of samples with an image, as
``bench_memory.py``), then for each worker count packs it afresh and verifies the output, each in a subprocess.
CPU is user + system time of the whole process tree (``RUSAGE_CHILDREN``: pool workers are reaped by their
parent); peak memory is the resident memory of the tree summed over processes, sampled every 20 ms (psutil).
Targets: verify CPU at most half of pack CPU, verify peak at most 500 MB at a million samples.
``--tokenizer`` packs with another model folder (``scripts/qwen_tokenizer.py`` builds Qwen2's real vocabulary).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import build, pack_command, peak_rss  # noqa: E402

import demo  # noqa: E402  (on sys.path through bench_memory)

MB = 2**20
TARGET_RATIO = 0.5
TARGET_MB = 500


def measured(cmd: list[str]) -> tuple[float, float, int]:
    """(CPU seconds of the whole process tree, wall seconds, peak tree RSS) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree, _, _, wall = peak_rss(cmd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--per-shard", type=int, default=2000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokenizer", type=Path, default=None, help="model folder (default: the demo tokenizer)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out", help="folder for datasets and outputs")
    ap.add_argument("--keep-output", action="store_true", help="keep the packed outputs")
    args = ap.parse_args()

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = args.tokenizer or work / "tokenizer"
    if args.tokenizer is None and not (tok / "tokenizer.json").exists():
        demo.build_tokenizer(tok)
    dataset = build(work / f"verify-{args.samples}", args.samples, args.per_shard, big_media=False)
    print(f"{'samples':>8} {'workers':>7} {'pack cpu s':>10} {'pack wall s':>11} {'verify cpu s':>12} "
          f"{'verify wall s':>13} {'cpu ratio':>9} {'verify peak MB':>14} {'pack peak MB':>12}", flush=True)
    failed = False
    for workers in args.workers:
        out = work / f"verify-{args.samples}-out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        pack_cpu, pack_wall, pack_peak = measured(pack_command(dataset, out, tok, workers))
        verify_cmd = [sys.executable, "-m", "packtool.cli", "verify", str(out), "--workers", str(workers)]
        verify_cpu, verify_wall, verify_peak = measured(verify_cmd)
        ratio = verify_cpu / pack_cpu
        print(f"{args.samples:>8} {workers:>7} {pack_cpu:>10.1f} {pack_wall:>11.1f} {verify_cpu:>12.1f} "
              f"{verify_wall:>13.1f} {ratio:>9.2f} {verify_peak / MB:>14.0f} {pack_peak / MB:>12.0f}", flush=True)
        failed |= ratio > TARGET_RATIO or verify_peak > TARGET_MB * MB
        if not args.keep_output:
            shutil.rmtree(out, ignore_errors=True)
    print(f"targets: verify/pack CPU <= {TARGET_RATIO}, verify peak <= {TARGET_MB} MB: "
          f"{'missed' if failed else 'met'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
