"""The planner entry point: lengths in, pack ids out, under every constraint, for each algorithm."""

from __future__ import annotations

import time

import numpy as np

from packtool.packer.algorithms._common import aligned_costs, as_int_array, check_fits, positive_int
from packtool.packer.algorithms.balanced import balanced_greedy_knapsack
from packtool.packer.algorithms.bestfit import best_fit_decreasing
from packtool.packer.algorithms.fill import greedy_knapsack, slot_balanced_fill
from packtool.packer.algorithms.firstfit import ffd, first_fit_shuffle
from packtool.packer.algorithms.nextfit import sequential
from packtool.packer.algorithms.registry import ALGORITHMS, Algorithm, Planner, check_registry


def pack_lengths(lengths, pack_size: int, *, algorithm: str = "auto", align: int = 1,
                 max_segments: int | None = None, images=None, max_images: int | None = None,
                 image_tokens=None, max_image_tokens: int | None = None, seed: int = 0,
                 balanced_delta: int = 0, samples=None) -> np.ndarray:
    """Assign every item to a pack; returns the int64 pack index of each item, packs numbered ``0..P-1`` in
    order of creation, none empty. Deterministic for given inputs and ``seed``.

    Cost of an item: its length rounded up to a multiple of ``align``; a pack holds items whose costs sum to at
    most ``pack_size``, at most ``max_segments`` items, at most ``max_images`` images (``images``: per-item
    counts) and at most ``max_image_tokens`` image tokens (``image_tokens``: per item). ``images`` /
    ``image_tokens`` without their limit are ignored. ``seed`` drives ``first_fit_shuffle`` (also inside
    ``auto``); ``balanced_delta``
    is the number of extra packs ``balanced_greedy_knapsack`` opens up front. ``samples`` (a mixture's copies):
    per item the sample it is a copy of (-1: not a copy); ``bfd`` and ``auto`` then never put two copies of one
    sample in a pack that another pack could take them from (other algorithms ignore it).

    Raises ``ValueError`` for an unknown algorithm, bad arguments, or an item that cannot fit an empty pack
    (the message names its index and cost).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    lengths = as_int_array(lengths, "lengths")
    if lengths.size and lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"item {i} has length {int(lengths[i])}; lengths must be at least 1")
    pack_size = positive_int(pack_size, "pack_size", allow_none=False)
    align = positive_int(align, "align", allow_none=False)
    max_segments = positive_int(max_segments, "max_segments")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if isinstance(balanced_delta, bool) or not isinstance(balanced_delta, (int, np.integer)) or balanced_delta < 0:
        raise ValueError(f"balanced_delta must be a non-negative integer, got {balanced_delta!r}")
    named = []
    for name, values, limit, limit_name in (("images", images, max_images, "max_images"),
                                            ("image_tokens", image_tokens, max_image_tokens, "max_image_tokens")):
        if limit is None:
            continue
        if values is None:
            raise ValueError(f"{limit_name} needs per-item {name}")
        named.append((name, as_int_array(values, name, lengths.size),
                      positive_int(limit, limit_name, allow_none=False)))
    costs = aligned_costs(lengths, align)
    check_fits(costs, pack_size, named)
    if not lengths.size:
        return np.zeros(0, dtype=np.int64)
    units, cap = costs // align, pack_size // align
    resources = tuple((v, lim) for _, v, lim in named if _can_bind(v, lim, max_segments))
    if samples is not None:
        samples = as_int_array(np.asarray(samples) + 1, "samples (-1 or more)", lengths.size) - 1
        if algorithm in ("auto", "bfd"):
            return auto(units, cap, max_segments, resources, int(seed), samples) if algorithm == "auto" else \
                best_fit_decreasing(units, cap, max_segments, resources, samples)
    return PLANNERS[algorithm](units, cap, max_segments, resources, seed=int(seed),
                               balanced_delta=int(balanced_delta))


def auto(units: np.ndarray, cap: int, max_segments: int | None, resources: tuple, seed: int,
         samples: np.ndarray | None = None) -> np.ndarray:
    """The fewest packs of best-fit decreasing and the fills that beat it where it is weak (ties keep the
    earlier candidate):

    - a segment cap that binds: best fit leaves the many small items to the end, where the cap strands them in
      packs of ``max_segments`` tiny items; the slot-balanced fill spreads them over packs up front.
    - an image cap that binds: best fit looks at tokens only and stacks image-heavy items together, closing
      packs early; a seeded shuffled first fit mixes them (about 2 % fewer packs on image-heavy sets).

    With ``samples`` best fit keeps copies of one sample apart; a fill that beats it may not (the caller parts
    what it can afterwards).
    """
    best = best_fit_decreasing(units, cap, max_segments, resources, samples)
    candidates = []
    if max_segments is not None and np.bincount(best).max() >= max_segments:
        candidates.append(lambda: slot_balanced_fill(units, cap, max_segments, resources))
    if resources:
        candidates.append(lambda: first_fit_shuffle(units, cap, max_segments, resources, seed))
    for make in candidates:
        alt = make()
        if alt.max() < best.max():
            best = alt
    return best


#: Each algorithm's implementation, by name (:mod:`packtool.packer.algorithms.registry`).
PLANNERS: dict[Algorithm, Planner] = {
    "auto": lambda u, c, m, r, *, seed, balanced_delta: auto(u, c, m, r, seed),
    "bfd": lambda u, c, m, r, *, seed, balanced_delta: best_fit_decreasing(u, c, m, r),
    "ffd": lambda u, c, m, r, *, seed, balanced_delta: ffd(u, c, m, r),
    "greedy_knapsack": lambda u, c, m, r, *, seed, balanced_delta: greedy_knapsack(u, c, m, r),
    "balanced_greedy_knapsack":
        lambda u, c, m, r, *, seed, balanced_delta: balanced_greedy_knapsack(u, c, m, r, balanced_delta),
    "first_fit_shuffle": lambda u, c, m, r, *, seed, balanced_delta: first_fit_shuffle(u, c, m, r, seed),
    "sequential": lambda u, c, m, r, *, seed, balanced_delta: sequential(u, c, m, r),
}
check_registry(PLANNERS)


def _can_bind(values: np.ndarray, limit: int, max_segments: int | None) -> bool:
    """Whether some pack could exceed ``limit``; if not (all values, or the ``max_segments`` largest, fit),
    the resource is left out and the faster paths for tokens and segments alone apply."""
    if max_segments and max_segments < values.size:
        values = np.partition(values, -max_segments)[-max_segments:]
    return int(values.sum()) > limit


def l1_bound(costs, pack_size: int) -> int:
    """The token lower bound on the number of packs: ``ceil(sum(costs) / pack_size)``."""
    total = int(as_int_array(costs, "costs").sum())
    return -(-total // positive_int(pack_size, "pack_size", allow_none=False))


def compare(lengths, pack_size: int, algorithms=None, **constraints) -> list[dict]:
    """Run :func:`pack_lengths` with each algorithm (default: all) under the same ``constraints`` (its keyword
    arguments). One row per algorithm: ``algorithm``, ``packs``, ``fill`` (real tokens / (packs * pack_size)),
    ``l1_bound`` (of the aligned costs) and ``seconds``."""
    lengths = as_int_array(lengths, "lengths")
    bound = l1_bound(aligned_costs(lengths, positive_int(constraints.get("align", 1), "align", False)), pack_size)
    rows = []
    for algorithm in algorithms or ALGORITHMS:
        t0 = time.perf_counter()
        ids = pack_lengths(lengths, pack_size, algorithm=algorithm, **constraints)
        seconds = time.perf_counter() - t0
        packs = int(ids.max()) + 1 if ids.size else 0
        rows.append({"algorithm": algorithm, "packs": packs,
                     "fill": float(lengths.sum()) / (packs * pack_size) if packs else 0.0,
                     "l1_bound": bound, "seconds": seconds})
    return rows
