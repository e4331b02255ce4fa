#!/usr/bin/env python
"""Benchmark the planner: packs against lower bounds, fill and seconds for every algorithm on synthetic
length sets, with and without caps, beside TRL's BFD packing as a peer.

    python bench/bench_plan.py                                  # 100k items, all sets and algorithms
    python bench/bench_plan.py --sizes 100000,1000000,10000000  # sizes above --all-up-to run bfd alone

Sets (seeded):
  sft    lognormal lengths, mean ~1.3k tokens, many short samples; pack 16384
  vlm    70 % samples with 1-4 images (~500 image tokens each, part of the length), 30 % text only; pack 16384
  short  lognormal lengths, mean ~250 tokens; pack 4096
Caps: ``none``, or ``--max-segments`` (and ``--max-images`` on vlm).

Columns: packs; L1 = ceil(sum(cost) / pack_size); LB = the larger of L1 and the cap bounds (items / max_segments,
images / max_images); packs/L1; fill = tokens / (packs * pack_size); seconds; vs TRL = our seconds / TRL's for
the same set (TRL only plans without caps). TRL (``trl.data_utils.pack_dataset``, strategy "bfd", one batch
over the whole set so that it packs globally) runs on an Arrow table of the lengths (int8 zeros as tokens); its
time includes moving the token lists, which a planner does not do, so read the ratio as end-to-end cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packtool.packer.algorithms import ALGORITHMS, l1_bound, pack_lengths

SETS = ("sft", "vlm", "short")


def make_set(name: str, n: int, seed: int) -> tuple[int, dict]:
    """``(pack_size, arrays)`` with ``lengths`` and, for vlm, ``images`` and ``image_tokens``."""
    rng = np.random.default_rng(seed)
    if name == "sft":
        size = 16384
        return size, {"lengths": np.clip(rng.lognormal(6.5, 1.2, n).astype(np.int64) + 1, 1, size)}
    if name == "short":
        size = 4096
        return size, {"lengths": np.clip(rng.lognormal(5.2, 0.8, n).astype(np.int64) + 1, 1, size)}
    assert name == "vlm"
    size = 16384
    images = np.where(rng.random(n) < 0.7, rng.choice([1, 1, 1, 2, 2, 3, 4], n), 0)
    per_image = np.clip(rng.lognormal(6.0, 0.6, images.sum()), 16, 1280).astype(np.int64)
    owner = np.repeat(np.arange(n), images)
    image_tokens = np.bincount(owner, weights=per_image, minlength=n).astype(np.int64)
    text = np.where(images > 0, rng.lognormal(5.5, 0.9, n), rng.lognormal(6.5, 1.1, n)).astype(np.int64) + 1
    lengths = np.minimum(text + image_tokens + 2 * images, size)
    return size, {"lengths": lengths, "images": images, "image_tokens": image_tokens}


def trl_bfd(lengths: np.ndarray, pack_size: int) -> tuple[int, float]:
    """Packs and seconds of TRL's global BFD packing of these lengths."""
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int8)))
    dataset = datasets.Dataset(pa.table({"input_ids": tokens}))
    t0 = time.perf_counter()
    packed = pack_dataset(dataset, pack_size, strategy="bfd", map_kwargs={"batch_size": len(lengths)})
    return len(packed), time.perf_counter() - t0


def trl_available() -> str | None:
    try:
        import datasets  # noqa: F401
        import trl.data_utils  # noqa: F401
    except Exception as e:  # any import failure means no peer
        return f"{type(e).__name__}: {e}"
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000", help="comma-separated item counts")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--all-up-to", type=int, default=1_000_000,
                    help="larger sizes run bfd alone (the per-item algorithms take tens of seconds at 10M)")
    ap.add_argument("--max-segments", type=int, default=16)
    ap.add_argument("--max-images", type=int, default=16)
    ap.add_argument("--trl-up-to", type=int, default=1_000_000, help="largest size TRL runs at (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)

    trl_error = trl_available() if args.trl_up_to else "disabled"
    if trl_error:
        print(f"# TRL peer skipped ({trl_error})")
    rows = []
    header = (f"{'set':<6}{'n':>10}{'caps':>12}  {'algorithm':<26}{'packs':>9}{'L1':>9}{'LB':>9}{'packs/L1':>9}"
              f"{'fill':>8}{'seconds':>9}{'vs TRL':>8}")
    print(header)
    print("-" * len(header))
    for n in [int(x) for x in args.sizes.split(",")]:
        for name in args.sets.split(","):
            size, arrays = make_set(name, n, args.seed)
            lengths = arrays["lengths"]
            l1 = l1_bound(lengths, size)
            trl_seconds = None
            if not trl_error and n <= args.trl_up_to:
                packs, trl_seconds = trl_bfd(lengths, size)
                row = {"set": name, "n": n, "caps": "none", "algorithm": "trl bfd (peer)", "packs": packs,
                       "l1": l1, "lb": l1, "fill": lengths.sum() / (packs * size), "seconds": trl_seconds}
                rows.append(row)
                _print(row)
            caps_list = [("none", {}), (f"seg{args.max_segments}", {"max_segments": args.max_segments})]
            if "images" in arrays:
                caps_list.append((f"seg{args.max_segments}+img{args.max_images}",
                                  {"max_segments": args.max_segments, "images": arrays["images"],
                                   "max_images": args.max_images, "image_tokens": arrays["image_tokens"]}))
            for caps, kw in caps_list:
                lb = max(l1, -(-n // kw["max_segments"]) if "max_segments" in kw else 0,
                         -(-int(arrays["images"].sum()) // kw["max_images"]) if "max_images" in kw else 0)
                algorithms = args.algorithms.split(",") if n <= args.all_up_to else ["bfd"]
                for algorithm in algorithms:
                    t0 = time.perf_counter()
                    ids = pack_lengths(lengths, size, algorithm=algorithm, **kw)
                    seconds = time.perf_counter() - t0
                    packs = int(ids.max()) + 1
                    row = {"set": name, "n": n, "caps": caps, "algorithm": algorithm, "packs": packs, "l1": l1,
                           "lb": lb, "fill": lengths.sum() / (packs * size), "seconds": seconds}
                    if trl_seconds and caps == "none":
                        row["vs_trl"] = seconds / trl_seconds
                    rows.append(row)
                    _print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))


def _print(r: dict) -> None:
    ratio = f"{r['vs_trl']:8.3f}" if "vs_trl" in r else " " * 8
    print(f"{r['set']:<6}{r['n']:>10}{r['caps']:>12}  {r['algorithm']:<26}{r['packs']:>9}{r['l1']:>9}{r['lb']:>9}"
          f"{r['packs'] / r['l1']:>9.4f}{r['fill']:>8.4f}{r['seconds']:>9.3f}{ratio}", flush=True)


if __name__ == "__main__":
    main()
