"""First fit: each item, in a given order, goes to the lowest-numbered pack it fits; a new pack when none does.

``ffd`` takes items largest first (equal costs in index order); ``first_fit_shuffle`` takes them in a seeded
random order, which keeps a mix of lengths in every pack at some cost in fill.

:func:`first_fit` places one item at a time: open packs are the leaves of a max segment tree over pack ids
holding each pack's remaining units (``-1`` once its segment cap is reached), so the first leaf with at least an
item's cost is found in ``O(log P)``; with extra resources the tree holds them too
(:class:`~packtool.packer.algorithms._tree.MaxTree`) and skips packs they do not fit.
:func:`ffd_by_cost` gives the same result as ``ffd`` by placing all items of one cost together.
"""

from __future__ import annotations

import numpy as np

from packtool.packer.algorithms._cells import Cells, cost_classes, few_per_cost
from packtool.packer.algorithms._common import Resource, decreasing_order, scatter
from packtool.packer.algorithms._tree import NEG, MaxTree

_CHUNK = 1 << 16


def ffd(units: np.ndarray, cap: int, max_segments: int | None = None,
        resources: tuple[Resource, ...] = ()) -> np.ndarray:
    """First-fit decreasing."""
    if resources or few_per_cost(units):
        return first_fit(units, cap, decreasing_order(units, cap), max_segments, resources)
    return ffd_by_cost(units, cap, max_segments)


def ffd_by_cost(units: np.ndarray, cap: int, max_segments: int | None = None) -> np.ndarray:
    """First-fit decreasing over the cost histogram (no extra resources).

    The items of one cost ``c`` go to the packs they fit in id order, each taking ``min(r // c, t)`` of them
    (it stays the first fit until then). Those packs are few in practice (a handful per cost on SFT-like sets),
    so they are gathered from the cells, sorted by id, and the untouched ones filed back.
    """
    cells = Cells(cap, max_segments)
    T = cells.T
    out = np.empty(units.size, dtype=np.int64)  #: pack of the i-th item in decreasing order
    costs, bounds = cost_classes(units, cap)
    for c, s, e in zip(costs, bounds[:-1], bounds[1:]):
        need = e - s
        ids_parts, each = [], []
        keys = list(cells.keys_from(c))
        if keys:
            parts = [cells.take(key) for key in keys]
            ids = np.concatenate(parts)
            key_of = np.repeat(np.asarray(keys, dtype=np.int64), [p.size for p in parts])
            by_id = np.argsort(ids)
            ids, key_of = ids[by_id], key_of[by_id]
            r, t = key_of // T, key_of % T
            m = np.minimum(r // c, t) if max_segments else r // c
            cum = np.cumsum(m)
            j = int(np.searchsorted(cum, need)) + 1 if cum[-1] >= need else ids.size  #: packs used
            took = m[:j].copy()
            if cum[-1] >= need:
                took[-1] = need - (int(cum[j - 2]) if j > 1 else 0)
            need -= int(took.sum())
            ids_parts.append(ids[:j])
            each.append(took)
            cells.put_keys((r[:j] - took * c) * T + ((t[:j] - took) if max_segments else 0), ids[:j])
            if j < ids.size:
                cells.put_keys(key_of[j:], ids[j:])
        if need:
            ids, took = cells.open(c, need)
            ids_parts.append(ids)
            each.append(took)
        out[s:e] = np.repeat(np.concatenate(ids_parts), np.concatenate(each))
    return scatter(out, decreasing_order(units, cap))


def first_fit_shuffle(units: np.ndarray, cap: int, max_segments: int | None = None,
                      resources: tuple[Resource, ...] = (), seed: int = 0) -> np.ndarray:
    """First fit over a random order drawn from ``numpy.random.default_rng(seed)``."""
    order = np.random.default_rng(seed).permutation(units.size)
    return first_fit(units, cap, order, max_segments, resources)


def first_fit(units: np.ndarray, cap: int, order: np.ndarray, max_segments: int | None = None,
              resources: tuple[Resource, ...] = ()) -> np.ndarray:
    """Pack id per item, placing items in ``order`` by first fit."""
    if resources:
        return _first_fit_resources(units, cap, order, max_segments, resources)
    n = units.size
    K = max_segments
    size = 1024
    tree = [-1] * (2 * size)  #: max remaining units over each range of pack ids; -1 for closed packs
    rem: list[int] = []
    segs: list[int] = []
    ids = np.empty(n, dtype=np.int64)
    for a in range(0, n, _CHUNK):
        idx = order[a:a + _CHUNK]
        got = []
        for c in units[idx].tolist():
            if tree[1] >= c:  # descend to the leftmost pack with room
                i = 1
                while i < size:
                    i <<= 1
                    if tree[i] < c:
                        i += 1
                p = i - size
            else:
                p = len(rem)
                if p == size:  # grow the tree
                    old = tree
                    size *= 2
                    tree = [-1] * (2 * size)
                    tree[size:size + p] = old[p:2 * p]
                    for i in range(size - 1, 0, -1):
                        tree[i] = max(tree[2 * i], tree[2 * i + 1])
                rem.append(cap)
                segs.append(0)
            rem[p] -= c
            segs[p] += 1
            i = p + size
            tree[i] = rem[p] if not K or segs[p] < K else -1
            i >>= 1
            while i:
                m = tree[2 * i] if tree[2 * i] > tree[2 * i + 1] else tree[2 * i + 1]
                if tree[i] == m:
                    break
                tree[i] = m
                i >>= 1
            got.append(p)
        ids[idx] = got
    return ids


def _first_fit_resources(units, cap, order, max_segments, resources):
    """:func:`first_fit` with extra resources, on a :class:`MaxTree` over pack ids.

    A tree of per-pack maxima can be fooled when one pack has the room and another the resource budget. The
    resource with the smallest demands (images: a few per item) is therefore folded into the room: component
    ``k`` of a pack holds its remaining units if it has at least ``k`` of that resource left, so an item needing
    ``k`` asks component ``k`` for its cost and the search skips exactly the packs without room for both. Other
    resources are components of their own.
    """
    n = units.size
    K = max_segments
    limits = [lim for _, lim in resources]
    lev = min(range(len(resources)), key=lambda j: int(resources[j][0].max()))  #: the folded resource
    levels = int(resources[lev][0].max()) + 1
    others = [j for j in range(len(resources)) if j != lev]
    dims = levels + len(others)
    closed = [NEG] * dims
    tree = MaxTree(1024, dims)
    rem: list[int] = []
    segs: list[int] = []
    left: list[list[int]] = [[] for _ in resources]
    ids = np.empty(n, dtype=np.int64)
    for a in range(0, n, _CHUNK):
        idx = order[a:a + _CHUNK]
        demand = [v[idx].tolist() for v, _ in resources]
        got = []
        for i, c in enumerate(units[idx].tolist()):
            need = [NEG] * dims
            need[demand[lev][i]] = c
            for k, j in enumerate(others):
                need[levels + k] = demand[j][i]
            p = tree.leftmost(0, need)
            if p < 0:
                p = len(rem)
                tree.grow(p + 1)
                rem.append(cap)
                segs.append(0)
                for j, lim in enumerate(limits):
                    left[j].append(lim)
            rem[p] -= c
            segs[p] += 1
            for j, d in enumerate(demand):
                left[j][p] -= d[i]
            if rem[p] > 0 and (not K or segs[p] < K):
                folded = left[lev][p]
                tree.set(p, [rem[p] if k <= folded else NEG for k in range(levels)]
                         + [left[j][p] for j in others])
            else:
                tree.set(p, closed)
            got.append(p)
        ids[idx] = got
    return ids
