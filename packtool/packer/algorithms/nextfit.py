"""Sequential packing (next fit): items in input order; a pack is closed as soon as the next item does not fit.

Vectorized: prefix sums give, for every possible start ``s``, the end of a pack that starts there (the furthest
item that keeps tokens, segments and every resource within their limits); the packs are then the chain
``0 -> end[0] -> end[end[0]] -> ...``, walked once per pack.
"""

from __future__ import annotations

import numpy as np

from packtool.packer.algorithms._common import Resource


def sequential(units: np.ndarray, cap: int, max_segments: int | None = None,
               resources: tuple[Resource, ...] = ()) -> np.ndarray:
    """Pack id per item; packs hold consecutive items."""
    n = units.size
    if not n:
        return np.zeros(0, dtype=np.int64)
    end = _ends(units, cap)
    if max_segments:
        np.minimum(end, np.arange(1, n + 1) + (max_segments - 1), out=end)
    for values, limit in resources:
        np.minimum(end, _ends(values, limit), out=end)
    starts: list[int] = []
    s = 0
    while s < n:  # one step per pack
        starts.append(s)
        s = int(end[s])
    bounds = np.asarray(starts + [n], dtype=np.int64)
    sizes = bounds[1:] - bounds[:-1]
    return np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)


def _ends(values: np.ndarray, limit: int) -> np.ndarray:
    """For each start s, one past the last item e with sum(values[s:e]) <= limit."""
    csum = np.concatenate(([0], np.cumsum(values)))
    return np.searchsorted(csum, csum[:-1] + limit, side="right") - 1
