#!/usr/bin/env python
"""Benchmark a mixture packed jointly against the same proportions packed apart: packs, fill and planner seconds.

    python bench/bench_mixture.py [--samples 1000000] [--pack-size 16384] [--algorithm auto]

Five synthetic datasets (seeded lognormal lengths, capped at the pack size), in the proportions a VLM SFT mixture
might declare as ``blend_epochized`` repetitions:

  chat       short text turns, mean ~300 tokens        repetitions 1
  caption    one image and a caption, mean ~700        repetitions 2
  vqa        1-3 images and a question, mean ~1.2k     repetitions 1
  ocr        a document page, mean ~2.5k               repetitions 0.5
  video      a clip, mean ~7k                          repetitions 1.5

``--samples`` is the samples taken (copies counted) over all five. Joint: one plan over every copy, told which rows
copy one sample (:func:`packtool.packer.algorithms.pack_lengths` with ``samples``, as ``pack`` runs it), then
what is left together moved apart (:func:`packtool.packer.mixing.separate_copies`); apart: one plan per dataset,
its copies kept apart the same way. Printed: packs, the L1 bound,
fill, seconds of each, the packs apart / joint ratio, and the copies left sharing a pack.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packtool.packer.algorithms import l1_bound, pack_lengths
from packtool.packer.mixing import copy_samples, separate_copies

#: name -> (mean tokens, sigma of the log, repetitions, share of the distinct samples)
DATASETS = {"chat": (300, 0.8, 1.0, 0.40), "caption": (700, 0.4, 2.0, 0.15), "vqa": (1200, 0.5, 1.0, 0.25),
            "ocr": (2500, 0.5, 0.5, 0.12), "video": (7000, 0.4, 1.5, 0.08)}


def make(samples: int, pack_size: int, seed: int = 0) -> dict[str, tuple[np.ndarray, float]]:
    """Each dataset's distinct lengths and repetitions, sized so the copies total about ``samples``."""
    rng = np.random.default_rng(seed)
    per_distinct = sum(share * reps for _, _, reps, share in DATASETS.values())
    distinct = samples / per_distinct
    out = {}
    for name, (mean, sigma, reps, share) in DATASETS.items():
        n = max(1, round(distinct * share))
        lengths = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n).astype(np.int64)
        out[name] = (np.clip(lengths, 16, pack_size), reps)
    return out


def copies(n: int, reps: float) -> np.ndarray:
    """Row indices of the copies ``reps`` repetitions take of ``n`` samples (the fraction: the first ones)."""
    whole = math.floor(reps)
    extra = math.floor(reps * n + 0.5) - whole * n
    return np.concatenate([np.tile(np.arange(n), whole), np.arange(max(extra, 0))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--pack-size", type=int, default=16384)
    ap.add_argument("--algorithm", default="auto")
    args = ap.parse_args()
    sets = make(args.samples, args.pack_size)
    lengths, ident = [], []
    apart_packs, apart_seconds = 0, 0.0
    for name, (dist, reps) in sets.items():
        rows = copies(dist.size, reps)
        lengths.append(dist[rows])
        ident += [f"{name}\0{i}" for i in rows.tolist()]
        t = time.perf_counter()
        ids = pack_lengths(dist[rows], args.pack_size, algorithm=args.algorithm,
                           samples=copy_samples(ident[-rows.size:]))
        apart_seconds += time.perf_counter() - t
        apart_packs += int(ids.max()) + 1
        print(f"{name:<8} {rows.size:>9} samples ({dist.size} distinct x {reps:g}), {int(ids.max()) + 1} packs alone")
    all_lengths = np.concatenate(lengths)
    tokens = int(all_lengths.sum())
    t = time.perf_counter()
    ids = pack_lengths(all_lengths, args.pack_size, algorithm=args.algorithm, samples=copy_samples(ident))
    plan_seconds = time.perf_counter() - t
    t = time.perf_counter()
    ids = separate_copies(ids, ident, all_lengths, args.pack_size, [])
    separate_seconds = time.perf_counter() - t
    joint = int(ids.max()) + 1
    shared = len(ident) - len({(int(p), i) for p, i in zip(ids.tolist(), ident)})
    bound = l1_bound(all_lengths, args.pack_size)
    print(f"total    {all_lengths.size:>9} samples, {tokens} tokens, L1 bound {bound} packs of {args.pack_size}")
    print(f"joint:  {joint} packs, fill {tokens / (joint * args.pack_size):.4f}, plan {plan_seconds:.2f} s "
          f"+ copies apart {separate_seconds:.2f} s; {shared} copies still share a pack")
    apart_fill = tokens / (apart_packs * args.pack_size)
    print(f"apart:  {apart_packs} packs, fill {apart_fill:.4f}, plan {apart_seconds:.2f} s")
    print(f"apart / joint: {apart_packs / joint:.4f}x packs ({apart_packs - joint:+d}), "
          f"{(apart_seconds / (plan_seconds + separate_seconds)):.2f}x seconds")


if __name__ == "__main__":
    main()
