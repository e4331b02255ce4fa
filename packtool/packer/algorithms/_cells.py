"""Open packs grouped by state, for the algorithms that place all items of one cost together.

A *cell* holds the packs with ``r`` units and ``t`` segment slots left, under the key ``r*T + t`` (``T = K+1``
with a segment cap ``K``; ``T = 1`` and ``t = 0`` without one), as sorted id arrays. Key order is best-fit order:
fullest first, then fewest slots left. Counts per cell and per block of cells make the occupied keys above a
cost cheap to find, so the work is per cell touched, not per pack.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

_BLOCK = 10  #: log2 of the cells per occupancy block


class Cells:
    """The open packs, by state (module doc)."""

    def __init__(self, cap: int, max_segments: int | None):
        self.cap = cap
        self.K = max_segments
        self.T = max_segments + 1 if max_segments else 1
        n_keys = (cap + 1) * self.T
        self.count = np.zeros(n_keys, dtype=np.int64)  #: packs per cell
        self.block = np.zeros((n_keys >> _BLOCK) + 1, dtype=np.int64)  #: packs per block of cells
        self.ids: dict[int, list[np.ndarray]] = {}  #: key -> sorted id arrays
        self.next_id = 0

    def state(self, key: int) -> tuple[int, int]:
        """``(r, t)`` of a cell key."""
        return divmod(key, self.T)

    def takes(self, key: int, c: int) -> int:
        """Items of cost ``c`` a pack of this cell takes before it no longer fits one."""
        r, t = divmod(key, self.T)
        return min(r // c, t) if self.K else r // c

    def keys_from(self, c: int) -> Iterator[int]:
        """Occupied keys of packs with at least ``c`` units left, in key order."""
        lo = c * self.T
        b0 = lo >> _BLOCK
        for b in (np.flatnonzero(self.block[b0:]) + b0).tolist():
            a = max(lo, b << _BLOCK)
            yield from (np.flatnonzero(self.count[a:(b + 1) << _BLOCK]) + a).tolist()

    def take(self, key: int, q: int | None = None) -> np.ndarray:
        """Remove the first ``q`` packs (default all) of a cell, lowest ids first."""
        parts = self.ids.pop(key)
        ids = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
        if q is not None and q < ids.size:
            self.ids[key] = [ids[q:]]
            ids = ids[:q]
        self.count[key] -= ids.size
        self.block[key >> _BLOCK] -= ids.size
        return ids

    def put(self, r: int, t: int, ids: np.ndarray) -> None:
        """File packs with ``r`` units and ``t`` slots left (sorted ids); packs that are full are dropped."""
        if ids.size and r > 0 and (t > 0 or not self.K):
            key = r * self.T + (t if self.K else 0)
            self.ids.setdefault(key, []).append(ids)
            self.count[key] += ids.size
            self.block[key >> _BLOCK] += ids.size

    def put_keys(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """File packs by key (``ids`` sorted; the order within a key is kept)."""
        o = np.argsort(keys, kind="stable")
        keys, ids = keys[o], ids[o]
        cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), keys.size]):
            r, t = divmod(int(keys[a]), self.T)
            self.put(r, t, ids[a:b])

    def open(self, c: int, need: int) -> tuple[np.ndarray, np.ndarray]:
        """Open new packs for ``need`` items of cost ``c``, each taking as many as fit; returns their ids and
        items per pack."""
        K = self.K
        M = min(self.cap // c, K) if K else self.cap // c
        n_new = -(-need // M)
        last = need - (n_new - 1) * M
        ids = np.arange(self.next_id, self.next_id + n_new, dtype=np.int64)
        self.next_id += n_new
        each = np.full(n_new, M)
        each[-1] = last
        self.put(self.cap - M * c, (K - M) if K else 0, ids[:-1])
        self.put(self.cap - last * c, (K - last) if K else 0, ids[-1:])
        return ids, each


def cost_classes(units: np.ndarray, cap: int) -> tuple[list[int], list[int]]:
    """Costs present, largest first, and the offsets of their items in decreasing order (one more entry)."""
    counts = np.bincount(units, minlength=cap + 1)
    present = np.flatnonzero(counts)[::-1]
    return present.tolist(), np.concatenate(([0], np.cumsum(counts[present]))).tolist()


def few_per_cost(units: np.ndarray) -> bool:
    """Whether items are too few per distinct cost for the per-cost sweep to beat a per-item loop."""
    return bool(units.size < 32 * np.count_nonzero(np.bincount(units)))
