"""Do workers pay? ``packtool pack`` with 1 and 2 workers against the tokenizer-only floor, in the same run.

    .venv/bin/python bench/bench_workers.py [--samples 20000] [--tokenizer DIR] [--repeat 2]

The floor is the least any packer must do: read each sample, render its chat template once, tokenize it (in
batches, with the tokenizer's ``encode_batch``, the call transformers' tokenizers make), with the same number of
processes, each taking whole shards. ``--ids-only`` makes the floor stricter: ``encode_batch_fast`` in batches of
64 (ids without offsets, what pack itself calls where it can prove the positions from byte lengths).
Runs are interleaved and repeated (the machine is shared); the best of each is reported with the ratios:
pack(1)/pack(2) (target >= 1.5x on 2 cores) and floor(2)/pack(2) (target >= 0.9x). Every run is a fresh CLI
process, so start-up costs count.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's packtool, also in the floor's processes

import demo  # noqa: E402


def floor_shards(args: tuple[str, str, list[str], bool]) -> int:
    """Read, render once and tokenize every sample of some shards; returns tokens."""
    from packtool.packer.encoder import get_encoder
    from packtool.packer.sources import open_source
    from packtool.packer.sources.conversation import conversation_adapter
    from packtool.settings import EncodeSettings

    root, tok, shards, ids_only = args
    src = open_source(root)
    encoder = get_encoder(EncodeSettings(tokenizer=tok, pack_size=1 << 20), src.dataset_yaml)
    backend, total, texts = encoder.tok.backend_tokenizer, 0, []
    call, batch = (backend.encode_batch_fast, 64) if ids_only else (backend.encode_batch, 256)
    for shard in shards:
        from packtool.packer.sources.energon import ShardScan

        for raw in ShardScan(Path(root), shard, src.excluded_samples):
            conv = conversation_adapter(raw.parts)
            texts.append(encoder.render(encoder._template_messages(conv.messages)))
            if len(texts) == batch:
                total += sum(len(e.ids) for e in call(texts, add_special_tokens=False))
                texts = []
    total += sum(len(e.ids) for e in call(texts, add_special_tokens=False)) if texts else 0
    return total


def run_floor(root: Path, tok: Path, processes: int, ids_only: bool = False) -> tuple[float, float]:
    """(wall, CPU) seconds of the floor over the train split with ``processes`` processes."""
    from packtool.packer.sources import open_source

    shards = open_source(root).splits["train"]
    groups = [(str(root), str(tok), shards[i::processes], ids_only) for i in range(processes)]
    start, cpu = time.perf_counter(), _children_cpu()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pool.map(floor_shards, groups)
    return time.perf_counter() - start, _children_cpu() - cpu


def run_pack(root: Path, tok: Path, out: Path, workers: int) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "packtool", "pack", str(root), str(out), "--tokenizer", str(tok),
           "--pack-size", "8192", "--split", "train", "--workers", str(workers), "--no-progress",
           "--media-check", "header"]
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)  # this checkout's packtool
    return time.perf_counter() - start, _children_cpu() - cpu


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    # One tokenizer thread per process everywhere, so "2 processes" means two cores' worth of work in each run.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--per-shard", type=int, default=5000)
    ap.add_argument("--tokenizer", type=Path, default=None, help="model folder (default: the demo tokenizer)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ids-only", action="store_true", help="the stricter floor (see the module docstring)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="packtool-bench-workers-"))
    try:
        data, tok = work / "dataset", args.tokenizer or work / "tokenizer"
        if args.tokenizer is None:
            demo.build_tokenizer(tok)
        demo.build_dataset(data, n_train=args.samples, n_val=0, samples_per_shard=args.per_shard,
                           image_fraction=0.0, long_fraction=0.01)
        runs: dict[str, list[tuple[float, float]]] = {"pack 1": [], "pack 2": [], "floor 2": [], "floor 1": []}
        for _ in range(args.repeat):
            runs["pack 1"].append(run_pack(data, tok, work / "out", 1))
            runs["floor 2"].append(run_floor(data, tok, 2, args.ids_only))
            runs["pack 2"].append(run_pack(data, tok, work / "out", 2))
            runs["floor 1"].append(run_floor(data, tok, 1, args.ids_only))
        best = {k: min(v) for k, v in runs.items()}
        for k, (wall, cpu) in best.items():
            print(f"{k:<8} wall {wall:7.2f} s  cpu {cpu:7.2f} s  ({args.samples / wall:,.0f} samples/s)")
        print(f"pack(1 worker) / pack(2 workers) wall: {best['pack 1'][0] / best['pack 2'][0]:.2f}x (target >= 1.5)")
        print(f"floor(2) / pack(2) wall: {best['floor 2'][0] / best['pack 2'][0]:.2f}x (target >= 0.9)")
        print(f"pack(2) / pack(1) cpu: {best['pack 2'][1] / best['pack 1'][1]:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
