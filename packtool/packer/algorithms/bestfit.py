"""Best-fit decreasing: items largest first, each into the fullest pack it fits.

The rule, shared by both implementations (per cost over the histogram; per item, which also honours extra
resources): take items by cost, largest first (equal costs in index order); put each into the pack that minimises
``(remaining units, remaining segment slots, pack id)`` among the packs it fits (tokens, segment cap, every extra
resource); open a new pack when none fits.

Under a segment cap plain best fit degrades: it closes packs with the large and middle items and leaves the many
small ones to the end, where they fill packs only up to the cap (``max_segments`` tiny items per pack, fill ~75 %
on SFT-like sets). The ``auto`` algorithm (:mod:`packtool.packer.algorithms.pack`) therefore also tries other fills.
"""

from __future__ import annotations

import numpy as np

from packtool.packer.algorithms._cells import Cells, cost_classes, few_per_cost
from packtool.packer.algorithms._common import Resource, decreasing_order, scatter
from packtool.packer.algorithms._rows import place_by_rows


def best_fit_decreasing(units: np.ndarray, cap: int, max_segments: int | None = None,
                        resources: tuple[Resource, ...] = (), samples: np.ndarray | None = None) -> np.ndarray:
    """Pack id per item (see module doc). ``units``: aligned costs divided by the alignment; ``cap``: pack size
    in the same units; ``samples``: per item the sample it copies (-1: none): see :func:`spread_order`."""
    if samples is not None:
        return place_by_rows(units, cap, spread_order(units, samples), max_segments, resources, samples=samples)
    if resources or few_per_cost(units):  # the histogram sweep pays per distinct cost: per item is faster here
        return place_by_rows(units, cap, decreasing_order(units, cap), max_segments, resources)
    return bfd_by_cost(units, cap, max_segments)


def bfd_by_cost(units: np.ndarray, cap: int, max_segments: int | None = None) -> np.ndarray:
    """Best-fit decreasing over the cost histogram (no extra resources); same result as :func:`bfd_by_item`.

    All items of one cost ``c`` are placed together (:mod:`packtool.packer.algorithms._cells`): best fit sends them to
    the cells in key order, and a pack that receives one stays the best fit until it has taken ``min(r // c, t)``,
    so each cell takes ``count * min(r // c, t)`` items and moves as a block.
    """
    n = units.size
    cells = Cells(cap, max_segments)
    out = np.empty(n, dtype=np.int64)  #: pack of the i-th item in decreasing order
    costs, bounds = cost_classes(units, cap)
    for c, s, e in zip(costs, bounds[:-1], bounds[1:]):
        need = e - s
        ids_parts, each = [], []  #: packs that take items of this cost, and how many each
        for key in cells.keys_from(c):
            r, t = cells.state(key)
            m = cells.takes(key, c)
            if int(cells.count[key]) * m <= need:
                ids = cells.take(key)
                ids_parts.append(ids)
                each.append(np.full(ids.size, m))
                cells.put(r - m * c, t - m, ids)
                need -= ids.size * m
            else:  # the items run out in this cell: q packs, the last may take fewer
                q = -(-need // m)
                last = need - (q - 1) * m
                ids = cells.take(key, q)
                ids_parts.append(ids)
                each.append(np.full(q, m))
                each[-1][-1] = last
                cells.put(r - m * c, t - m, ids[:-1])
                cells.put(r - last * c, t - last, ids[-1:])
                need = 0
            if not need:
                break
        if need:
            ids, took = cells.open(c, need)
            ids_parts.append(ids)
            each.append(took)
        out[s:e] = np.repeat(np.concatenate(ids_parts), np.concatenate(each))
    return scatter(out, decreasing_order(units, cap))


#: Rounds a sample's copies are spread over (:func:`spread_order`).
COPY_ROUNDS = 16


def spread_order(units: np.ndarray, samples: np.ndarray, rounds: int = COPY_ROUNDS) -> np.ndarray:
    """The item order of best fit over a mixture's copies (``samples``: per item the sample it copies, -1: none):
    the k-th of a sample's n copies goes in round ``floor(k * rounds / n)``, items not copied in round 0, and each
    round largest first (equal costs in index order). A copy never joins a pack that holds its sample (a new pack
    opens when none other fits). In plain decreasing order the copies of one short sample come last, together,
    and each needs a pack of its own; spread over rounds they fill the room earlier rounds leave (on a demo blend
    of 57 copies per caption: 302 packs, none shared, against 301 packs with 17 holding a caption many times)."""
    copied = np.flatnonzero(samples >= 0)
    rank = np.zeros(samples.size, np.int64)
    count = np.ones(samples.size, np.int64)
    if copied.size:
        by = copied[np.argsort(samples[copied], kind="stable")]
        _, start, n = np.unique(samples[by], return_index=True, return_counts=True)
        rank[by] = np.arange(by.size) - np.repeat(start, n)
        count[by] = np.repeat(n, n)
    return np.lexsort((-units, rank * rounds // count)).astype(np.int64)
