"""Benchmark what one shared worker pool saves over a new pool per stage (the engine before :class:`Engine`).

    .venv/bin/python bench/bench_engine.py [--workers 2] [--tasks 200] [--samples 2000]

Two measurements, old and new in the same run with their ratio:

* trivial tasks: two stages of N no-op tasks (a pack has two: encode and write), through ``run_tasks`` (one pool
  per stage) and through one :class:`Engine` (one pool for both);
* the encode stage of a demo dataset: ``run_tasks`` (pool start, module imports and tokenizer load in every
  stage) against a stage on an open engine whose workers loaded the tokenizer once, in their initializer.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402
from packtool.encode import EncodeSettings, get_encoder  # noqa: E402
from packtool.engine import Engine, run_tasks  # noqa: E402
from packtool.pipeline import encode_shard  # noqa: E402
from packtool.sources import open_source  # noqa: E402


def nothing(i: int) -> int:
    return i


def timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def encode_tasks(data: Path, tok: Path, out: Path) -> tuple[list[tuple], EncodeSettings, dict]:
    """The encode stage's tasks, as the pipeline builds them, writing under ``out`` (emptied first)."""
    shutil.rmtree(out, ignore_errors=True)
    src = open_source(data, None)
    settings = EncodeSettings(tokenizer=str(tok), pack_size=4096)
    tasks = [(str(data), shard, src.excluded_samples, settings, src.dataset_yaml, False, str(out / split / f"{i:06d}"))
             for split, shards in src.splits.items() for i, shard in enumerate(shards)]
    return tasks, settings, src.dataset_yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = ap.parse_args()
    w, n = args.workers, args.tasks

    trivial = [(i,) for i in range(n)]

    def old_trivial() -> None:
        for _ in range(2):
            run_tasks(nothing, trivial, workers=w, progress=False)

    def new_trivial() -> None:
        with Engine("local", w) as engine:
            for _ in range(2):
                engine.map(nothing, trivial, progress=False)

    old = min(timed(old_trivial) for _ in range(args.repeat))
    new = min(timed(new_trivial) for _ in range(args.repeat))
    print(f"trivial, 2 stages x {n} tasks, {w} workers: new pool per stage {old:.3f} s, one pool {new:.3f} s "
          f"(old/new {old / new:.2f}x)")

    work = Path(tempfile.mkdtemp(prefix="packtool-bench-engine-"))
    try:
        data, tok = work / "dataset", work / "tokenizer"
        demo.build_dataset(data, n_train=args.samples, n_val=0, samples_per_shard=max(1, args.samples // 8),
                           image_fraction=0.3, long_fraction=0.01)
        demo.build_tokenizer(tok)
        tasks, settings, dataset_yaml = encode_tasks(data, tok, work / "enc")
        olds, news, colds = [], [], []
        for _ in range(args.repeat):
            tasks, *_ = encode_tasks(data, tok, work / "enc")
            olds.append(timed(partial(run_tasks, encode_shard, tasks, workers=w, progress=False)))
            tasks, *_ = encode_tasks(data, tok, work / "enc")
            start = time.perf_counter()
            with Engine("local", w, initializer=get_encoder, initargs=(settings, dataset_yaml)) as engine:
                engine.map(nothing, [(i,) for i in range(w)], progress=False)  # an earlier stage: pool is up
                colds.append(time.perf_counter() - start)
                news.append(timed(partial(engine.map, encode_shard, tasks, progress=False)))
        old, new, cold = min(olds), min(news), min(colds)
        print(f"encode stage, {args.samples} samples in {len(tasks)} shards, {w} workers: "
              f"new pool {old:.3f} s, open engine {new:.3f} s (old/new {old / new:.2f}x); "
              f"the engine's one-off start (pool, imports, tokenizer) {cold:.3f} s, so a first stage on a fresh "
              f"engine {cold + new:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
