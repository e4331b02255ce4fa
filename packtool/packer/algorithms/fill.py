"""Packs filled one at a time from the pool of unplaced items.

Each pack opens with the largest remaining item, then repeatedly takes the largest remaining item no larger than
a *target* (among equal costs the lowest index), until nothing fits or the segment cap is reached.

- ``greedy_knapsack``: the target is the remaining room, so every step takes the largest item that fits.
- slot-balanced fill (a candidate of ``auto`` when ``max_segments`` binds): each pack aims at ``n_t`` items, the
  remaining items per remaining pack of the estimate ``max(ceil(sum/cap), ceil(N/max_segments))``, capped at
  ``max_segments``. With ``s`` of those slots still to fill the target is ``room // s``, the average size per
  remaining slot; when nothing that small is left it takes the largest item that fits. Packs thus draw small,
  middle and large items at the rate the pool holds them, instead of leaving all the small items to the end
  where a segment cap would strand them in packs of ``max_segments`` tiny items.

Two implementations give identical results: :func:`_fill_by_cost` over the cost histogram (no extra resources)
repeats a pack's composition for as many packs as the counts allow, so its work is per distinct composition;
:func:`_fill_by_item` walks items one at a time and honours extra resources (images, image tokens).
"""

from __future__ import annotations

import numpy as np

from packtool.packer.algorithms._common import Resource, decreasing_order, increasing_order, scatter
from packtool.packer.algorithms._tree import NEG, MaxTree


def greedy_knapsack(units: np.ndarray, cap: int, max_segments: int | None = None,
                    resources: tuple[Resource, ...] = ()) -> np.ndarray:
    """Pack id per item: fill one pack at a time with the largest remaining item that fits, then open the next."""
    return _fill(units, cap, max_segments, resources, balanced=False)


def slot_balanced_fill(units: np.ndarray, cap: int, max_segments: int,
                       resources: tuple[Resource, ...] = ()) -> np.ndarray:
    """Pack id per item: one pack at a time, aiming at the average size per remaining slot (module doc)."""
    return _fill(units, cap, max_segments, resources, balanced=True)


def _fill(units: np.ndarray, cap: int, max_segments: int | None, resources: tuple[Resource, ...],
          balanced: bool) -> np.ndarray:
    if not units.size:
        return np.zeros(0, dtype=np.int64)
    if resources:
        return _fill_by_item(units, cap, max_segments, resources, balanced)
    return _fill_by_cost(units, cap, max_segments, balanced)


def _segment_cap(max_segments: int | None, balanced: bool) -> int:
    """``max_segments`` as an int, 0 for none; the slot-balanced fill aims at a share of it, so it needs one."""
    if max_segments is None:
        if balanced:
            raise ValueError("the slot-balanced fill needs max_segments")
        return 0
    return max_segments


def _estimate(units: np.ndarray, cap: int, max_segments: int) -> int:
    """Packs the slot-balanced fill plans for: the larger of the token and the segment lower bounds."""
    return max(-(-int(units.sum()) // cap), -(-units.size // max_segments))


def _fill_by_cost(units: np.ndarray, cap: int, max_segments: int | None, balanced: bool) -> np.ndarray:
    n = units.size
    K = _segment_cap(max_segments, balanced)
    counts = np.bincount(units, minlength=cap + 1)
    cnt = counts.tolist()
    #: two-level bit set of the costs still present: 64-bit words and a summary of non-empty words
    words = [0] * (cap // 64 + 1)
    for u in np.flatnonzero(counts).tolist():
        words[u >> 6] |= 1 << (u & 63)
    summary = sum(1 << w for w, x in enumerate(words) if x)

    def largest(x: int) -> int:
        """Largest cost <= x still present, or -1."""
        w = x >> 6
        bits = words[w] & ((2 << (x & 63)) - 1)
        if bits:
            return (w << 6) | (bits.bit_length() - 1)
        s = summary & ((1 << w) - 1)
        if not s:
            return -1
        w = s.bit_length() - 1
        return (w << 6) | (words[w].bit_length() - 1)

    def drop(u: int) -> None:
        nonlocal summary
        w = u >> 6
        words[w] &= ~(1 << (u & 63))
        if not words[w]:
            summary &= ~(1 << w)

    estimate = _estimate(units, cap, K) if balanced else 0
    #: item blocks: cost, first pack, packs, items per pack
    ev_cost: list[int] = []
    ev_pack: list[int] = []
    ev_reps: list[int] = []
    ev_each: list[int] = []
    packs, left = 0, n
    while left:
        nt = min(K, max(1, -(-left // max(1, estimate - packs)))) if balanced else 0
        comp: dict[int, int] = {}
        room, k, x = cap, 0, cap
        while True:
            u = largest(x)
            if u < 0 and x < room:
                u = largest(room)
            if u < 0:
                break
            comp[u] = comp.get(u, 0) + 1
            cnt[u] -= 1
            if not cnt[u]:
                drop(u)
            room -= u
            k += 1
            if K and k >= K:
                break
            x = room // (nt - k) if balanced and nt - k >= 2 else room
        # The same composition repeats while every cost it used stays present before each of its takes
        # (and, balanced, while the per-pack target n_t stays the same).
        reps = min((cnt[u] + m) // m for u, m in comp.items())
        if balanced and reps > 1:
            reps = _same_target(reps, nt, left, k, estimate - packs, K)
        for u, m in comp.items():
            if reps > 1:
                cnt[u] -= (reps - 1) * m
                if not cnt[u]:
                    drop(u)
            ev_cost.append(u)
            ev_pack.append(packs)
            ev_reps.append(reps)
            ev_each.append(m)
        packs += reps
        left -= reps * k
    # Expand the blocks: items of one cost are taken in index order, block after block.
    block_cost = np.asarray(ev_cost, dtype=np.int64)
    block_each = np.asarray(ev_each, dtype=np.int64)
    ev_len = np.asarray(ev_reps, dtype=np.int64) * block_each
    by_cost = np.argsort(block_cost, kind="stable")
    taken = np.empty_like(ev_len)  #: items of the same cost taken by earlier blocks
    csum = np.cumsum(ev_len[by_cost])
    first_of_cost = np.searchsorted(block_cost[by_cost], block_cost[by_cost], side="left")
    before = np.concatenate(([0], csum[:-1]))
    taken[by_cost] = before - before[first_of_cost]
    order = increasing_order(units, cap)  #: items grouped by cost, index order within a cost
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    block = np.repeat(np.arange(ev_len.size), ev_len)
    within = np.arange(n) - np.repeat(np.cumsum(ev_len) - ev_len, ev_len)
    ids = np.empty(n, dtype=np.int64)
    ids[order[start[block_cost[block]] + taken[block] + within]] = (
        np.asarray(ev_pack, dtype=np.int64)[block] + within // block_each[block])
    return ids


def _same_target(reps: int, nt: int, left: int, k: int, est_left: int, K: int) -> int:
    """How many of ``reps`` packs of ``k`` items in a row keep the per-pack target ``nt``.

    The target of the i-th of them is ``clamp(ceil((left - i*k) / max(1, est_left - i)), 1, K)``; keeping
    ``est_left - i >= 1`` makes it monotone in ``i``, so the packs that keep ``nt`` are a prefix, found by
    bisection."""
    if est_left >= 2:
        reps = min(reps, est_left - 1)

    def target(i: int) -> int:
        return min(K, max(1, -(-(left - i * k) // max(1, est_left - i))))

    if target(reps - 1) == nt:
        return reps
    lo, hi = 0, reps - 1  #: target(lo) == nt != target(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if target(mid) == nt:
            lo = mid
        else:
            hi = mid
    return hi


def _fill_by_item(units: np.ndarray, cap: int, max_segments: int | None, resources: tuple[Resource, ...],
                  balanced: bool) -> np.ndarray:
    """The fill one item at a time, for extra resources: items in decreasing order are the leaves of a
    :class:`MaxTree` holding minus their demands (:data:`NEG` once taken), so "the largest remaining item no
    larger than x that the pack's resources allow" is a leftmost search from the first item of cost <= x."""
    n = units.size
    K = _segment_cap(max_segments, balanced)
    order = decreasing_order(units, cap)
    su = units[order]
    #: first position (in decreasing order) whose cost is <= x
    first_le = np.searchsorted(-su, -np.arange(cap + 1), side="left").tolist()
    cost = su.tolist()
    demand = [v[order] for v, _ in resources]
    limits = [lim for _, lim in resources]
    tree = MaxTree.from_leaves([-d for d in demand] or [np.zeros(n, dtype=np.int64)])
    demand = [d.tolist() for d in demand]
    gone = [NEG] * (len(resources) or 1)

    def largest(x: int, held: list[int]) -> int:
        p = tree.leftmost(first_le[x], [h - lim for h, lim in zip(held, limits)] or [0])
        return p if p >= 0 else n

    estimate = _estimate(units, cap, K) if balanced else 0
    out = np.empty(n, dtype=np.int64)
    where = []  #: positions in placement order
    packs, left = 0, n
    while left:
        nt = min(K, max(1, -(-left // max(1, estimate - packs)))) if balanced else 0
        room, k, x = cap, 0, cap
        held = [0] * len(resources)
        while True:
            p = largest(x, held)
            if p == n and x < room:
                p = largest(room, held)
            if p == n:
                break
            tree.set(p, gone)
            where.append(p)
            room -= cost[p]
            held = [h + d[p] for h, d in zip(held, demand)]
            k += 1
            if K and k >= K:
                break
            x = room // (nt - k) if balanced and nt - k >= 2 else room
        out[len(where) - k:len(where)] = packs
        packs += 1
        left -= k
    return scatter(out, order[np.asarray(where, dtype=np.int64)])
