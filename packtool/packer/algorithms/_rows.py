"""Item-at-a-time placement into the fullest (best fit) or emptiest (worst fit) pack that fits, under a segment
cap and extra resources.

Open packs sit in *rows* by remaining units ``r``; a row is a sorted list of entries ``(t, id)`` (best fit:
``t`` = slots left, so ties go to the fewest slots left, then the lowest id) or ``(0, id)`` (worst fit: lowest id).
A :class:`~packtool.packer.algorithms._tree.MaxTree` over rows holds, per row, whether it is occupied and the most of
each resource any of its packs has left, so an item skips rows where no pack has room for its images or image tokens.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from packtool.packer.algorithms._common import Resource
from packtool.packer.algorithms._tree import NEG, MaxTree

_CHUNK = 1 << 16
#: Without extra resources, rows up to this many are found through a bitset of the occupied rows (a Python int:
#: a shift and a lowest-bit test) rather than the tree; beyond it the int grows too large to copy per update.
_BITSET_ROWS = 1 << 16


def place_by_rows(units: np.ndarray, cap: int, order: np.ndarray, max_segments: int | None = None,
                  resources: tuple[Resource, ...] = (), worst: bool = False, start: int = 0,
                  samples: np.ndarray | None = None) -> np.ndarray:
    """Pack id per item, items taken in ``order``; ``worst``: emptiest pack instead of fullest; ``start``
    packs are open (empty) from the beginning. ``samples``: per item, the sample it is a copy of (-1: none):
    an item never goes to a pack that holds a copy of its sample (a new pack opens when every other is)."""
    n = units.size
    K = max_segments
    limits = [lim for _, lim in resources]
    m = len(resources)
    bitset = m == 0 and cap < _BITSET_ROWS
    occupied = 0  #: bitset: bit r set while row r holds a pack
    tree = MaxTree(1 if bitset else cap + 1, m or 1)  #: per row: most of each resource left (or 0), NEG when empty
    rows: dict[int, list[tuple[int, int]]] = {}
    row_left: list[dict[int, list[int]]] = [{} for _ in resources]  #: per resource: row -> sorted amounts left
    left: list[list[int]] = [[lim] * start for lim in limits]  #: per resource: amount each pack has left
    slots: list[int] = [K or 0] * start

    def refresh(r: int) -> None:
        nonlocal occupied
        if bitset:
            occupied = occupied | (1 << r) if r in rows else occupied & ~(1 << r)
        elif r not in rows:
            tree.set(r, [NEG] * (m or 1))
        else:
            tree.set(r, [row_left[j][r][-1] for j in range(m)] or [0])

    def add(r: int, p: int) -> None:
        insort(rows.setdefault(r, []), ((slots[p] if not worst else 0), p))
        for j in range(m):
            insort(row_left[j].setdefault(r, []), left[j][p])
        refresh(r)

    def remove(r: int, p: int) -> None:
        row = rows[r]
        row.pop(bisect_left(row, ((slots[p] if not worst else 0), p)))
        if not row:
            del rows[r]
        for j in range(m):
            values = row_left[j][r]
            values.pop(bisect_left(values, left[j][p]))
            if not values:
                del row_left[j][r]
        refresh(r)

    rem = [cap] * start
    if start:
        rows[cap] = [((K or 0) if not worst else 0, p) for p in range(start)]
        for j in range(m):
            row_left[j][cap] = [limits[j]] * start
        refresh(cap)
    ids = np.empty(n, dtype=np.int64)
    held: set[tuple[int, int]] = set()  #: (pack, sample) of the copies placed so far
    for a in range(0, n, _CHUNK):
        idx = order[a:a + _CHUNK]
        cost = units[idx].tolist()
        copy_of = samples[idx].tolist() if samples is not None else [-1] * len(cost)
        demand = [v[idx].tolist() for v, _ in resources]
        got = []
        for i, c in enumerate(cost):
            want = [d[i] for d in demand]
            need = want or [0]
            p = -1
            if bitset:  # the emptiest occupied row, or the fullest one with room (-1: none)
                above = occupied >> c
                r = occupied.bit_length() - 1 if worst else c + (above & -above).bit_length() - 1 if above else -1
            else:
                r = tree.rightmost(cap, need) if worst else tree.leftmost(c, need)
            s = copy_of[i]
            while r >= c:
                for _, q in rows[r]:
                    if all(left[j][q] >= want[j] for j in range(m)) and (s < 0 or (q, s) not in held):
                        p = q
                        break
                if p >= 0:
                    break
                if bitset:  # the next occupied row (-1: none)
                    if worst:
                        below = occupied & ((1 << r) - 1)
                        r = below.bit_length() - 1 if below else -1
                    else:
                        above = occupied >> (r + 1)
                        r = r + 1 + (above & -above).bit_length() - 1 if above else -1
                else:
                    r = tree.rightmost(r - 1, need) if worst else tree.leftmost(r + 1, need)
            if p < 0:
                p = len(rem)
                rem.append(cap)
                slots.append(K or 0)
                for j in range(m):
                    left[j].append(limits[j])
            else:
                remove(r, p)
            rem[p] -= c
            if K:
                slots[p] -= 1
            for j in range(m):
                left[j][p] -= want[j]
            if rem[p] > 0 and (slots[p] > 0 or not K):
                add(rem[p], p)
            if s >= 0:
                held.add((p, s))
            got.append(p)
        ids[idx] = got
    return ids
