"""Balanced greedy knapsack: a fixed set of packs filled evenly, largest items first.

``ceil(sum(cost) / pack_size) + delta`` packs are opened up front. Items, largest first (equal costs in index
order), each go to the *emptiest* pack they fit (most remaining units, then lowest id); only when none fits is a
new pack opened, and it joins the set. Packs left empty at the end are dropped.

Spreading items this way gives every pack a similar mix of long and short items and a similar number of
segments, which suits a segment cap and makes packs cost about the same to train on. The price is fill: the
load is levelled across the packs opened up front, so each extra pack in ``delta`` adds about ``1/P`` of a pack
of padding spread over all packs (fill at best ``sum(cost) / ((L1 + delta) * pack_size)``), while too few (delta
0 on a set that cannot be packed perfectly) leaves the last, smallest items to open extra packs of their own.
"""

from __future__ import annotations

import heapq

import numpy as np

from packtool.packer.algorithms._common import Resource, decreasing_order, renumber
from packtool.packer.algorithms._rows import place_by_rows

_CHUNK = 1 << 16


def balanced_greedy_knapsack(units: np.ndarray, cap: int, max_segments: int | None = None,
                             resources: tuple[Resource, ...] = (), delta: int = 0) -> np.ndarray:
    """Pack id per item (see module doc); ``delta`` extra packs are opened up front."""
    n = units.size
    if not n:
        return np.zeros(0, dtype=np.int64)
    K = max_segments
    start = max(1, -(-int(units.sum()) // cap) + delta)
    order = decreasing_order(units, cap)
    if resources:
        return renumber(place_by_rows(units, cap, order, K, resources, worst=True, start=start))
    heap = [(-cap, p) for p in range(start)]  #: (-remaining, id) of open packs; sorted, hence a heap
    rem = [cap] * start
    segs = [0] * start
    ids = np.empty(n, dtype=np.int64)
    for a in range(0, n, _CHUNK):
        idx = order[a:a + _CHUNK]
        got = []
        for c in units[idx].tolist():
            if heap and -heap[0][0] >= c:  # the emptiest pack fits: update it in place
                p = heap[0][1]
                rem[p] -= c
                segs[p] += 1
                if rem[p] > 0 and (not K or segs[p] < K):
                    heapq.heapreplace(heap, (-rem[p], p))
                else:
                    heapq.heappop(heap)
            else:
                p = len(rem)
                rem.append(cap - c)
                segs.append(1)
                if rem[p] > 0 and (not K or K > 1):
                    heapq.heappush(heap, (-rem[p], p))
            got.append(p)
        ids[idx] = got
    return renumber(ids)
