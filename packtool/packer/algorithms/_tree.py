"""A max segment tree whose leaves hold a small vector of integers, for searches under several limits at once.

A node holds the component-wise maximum of its leaves. :meth:`MaxTree.leftmost` / :meth:`MaxTree.rightmost`
find the first / last leaf whose *every* component reaches a demand vector: subtrees whose maximum falls short
in any component are skipped. A node can pass with its maxima coming from different leaves; the search then
backs out of it, so results are exact, and the pruning keeps searches short when most leaves fail (e.g. packs
whose image budget is spent).
"""

from __future__ import annotations

from array import array

import numpy as np

#: Value of an empty leaf: below any demand.
NEG = -(1 << 62)


class MaxTree:
    """Leaves ``0..n-1`` (growable), ``dims`` components each, all :data:`NEG` at first. ``compact`` stores
    them in int64 arrays (8 bytes a node) instead of lists, which index faster but cost ~5x the memory."""

    def __init__(self, n: int, dims: int, compact: bool = False):
        self.size = 1
        while self.size < max(n, 1):
            self.size *= 2
        self._new = (lambda k: array("q", [NEG]) * k) if compact else (lambda k: [NEG] * k)
        self.v = [self._new(2 * self.size) for _ in range(dims)]

    @classmethod
    def from_leaves(cls, leaves: list[np.ndarray]) -> MaxTree:
        """A compact tree over the given leaf values (one int64 array per component), built with numpy."""
        tree = cls(leaves[0].size if leaves else 1, len(leaves), compact=True)
        size = tree.size
        for d, values in enumerate(leaves):
            full = np.full(2 * size, NEG, dtype=np.int64)
            full[size:size + values.size] = values
            lo = size
            while lo > 1:  # parents of level [lo, 2*lo) are [lo/2, lo)
                full[lo // 2:lo] = np.maximum(full[lo:2 * lo:2], full[lo + 1:2 * lo:2])
                lo //= 2
            tree.v[d] = array("q", full.tobytes())
        return tree

    def grow(self, n: int) -> None:
        """Make room for leaves ``0..n-1``."""
        if n <= self.size:
            return
        old, size = self.size, self.size
        while size < n:
            size *= 2
        for d, dim in enumerate(self.v):
            new = self._new(2 * size)
            new[size:size + old] = dim[old:2 * old]
            for i in range(size - 1, 0, -1):
                a, b = new[2 * i], new[2 * i + 1]
                new[i] = a if a > b else b
            self.v[d] = new
        self.size = size

    def set(self, leaf: int, values) -> None:
        i = leaf + self.size
        if len(self.v) == 1:  # the common shapes, unrolled: this runs twice per placed item
            (a,), (x,) = self.v, values
            a[i] = x
            i >>= 1
            while i:
                m = a[2 * i] if a[2 * i] > a[2 * i + 1] else a[2 * i + 1]
                if a[i] == m:
                    return
                a[i] = m
                i >>= 1
            return
        if len(self.v) == 2:
            (a, b), (x, y) = self.v, values
            a[i], b[i] = x, y
            i >>= 1
            while i:
                ma = a[2 * i] if a[2 * i] > a[2 * i + 1] else a[2 * i + 1]
                mb = b[2 * i] if b[2 * i] > b[2 * i + 1] else b[2 * i + 1]
                if a[i] == ma and b[i] == mb:
                    return
                a[i], b[i] = ma, mb
                i >>= 1
            return
        if len(self.v) == 3:
            (a, b, e), (x, y, z) = self.v, values
            a[i], b[i], e[i] = x, y, z
            i >>= 1
            while i:
                ma = a[2 * i] if a[2 * i] > a[2 * i + 1] else a[2 * i + 1]
                mb = b[2 * i] if b[2 * i] > b[2 * i + 1] else b[2 * i + 1]
                me = e[2 * i] if e[2 * i] > e[2 * i + 1] else e[2 * i + 1]
                if a[i] == ma and b[i] == mb and e[i] == me:
                    return
                a[i], b[i], e[i] = ma, mb, me
                i >>= 1
            return
        for dim, x in zip(self.v, values):
            dim[i] = x
        i >>= 1
        while i:
            changed = False
            for dim in self.v:
                m = dim[2 * i] if dim[2 * i] > dim[2 * i + 1] else dim[2 * i + 1]
                if dim[i] != m:
                    dim[i] = m
                    changed = True
            if not changed:
                return
            i >>= 1

    def _test(self, need):
        """``ok(node)``: whether every component of the node reaches ``need`` (:data:`NEG`: no demand)."""
        pairs = [(dim, x) for dim, x in zip(self.v, need) if x > NEG]
        if len(pairs) == 1:
            ((a, x),) = pairs
            return lambda i: a[i] >= x
        if len(pairs) == 2:
            (a, x), (b, y) = pairs
            return lambda i: a[i] >= x and b[i] >= y
        if len(pairs) == 3:
            (a, x), (b, y), (e, z) = pairs
            return lambda i: a[i] >= x and b[i] >= y and e[i] >= z
        return lambda i: all(dim[i] >= x for dim, x in pairs)

    def leftmost(self, lo: int, need) -> int:
        """Smallest leaf ``>= lo`` whose components all reach ``need``, or -1."""
        if lo >= self.size:
            return -1
        pairs = [(dim, x) for dim, x in zip(self.v, need) if x > NEG]
        if len(pairs) == 1:
            return _leftmost1(*pairs[0], lo, self.size)
        if len(pairs) == 2:
            return _leftmost2(*pairs[0], *pairs[1], lo, self.size)
        ok, size = self._test(need), self.size
        i = lo + size
        while True:
            if ok(i):
                while i < size:
                    if ok(2 * i):
                        i = 2 * i
                    elif ok(2 * i + 1):
                        i = 2 * i + 1
                    else:
                        break  # the maxima came from different leaves: nothing here
                if i >= size:
                    return i - size
            while i & 1:  # next subtree to the right
                i >>= 1
            if not i:
                return -1
            i += 1

    def rightmost(self, hi: int, need) -> int:
        """Largest leaf ``<= hi`` whose components all reach ``need``, or -1."""
        if hi < 0:
            return -1
        ok, size = self._test(need), self.size
        i = min(hi, size - 1) + size
        while True:
            if ok(i):
                while i < size:
                    if ok(2 * i + 1):
                        i = 2 * i + 1
                    elif ok(2 * i):
                        i = 2 * i
                    else:
                        break
                if i >= size:
                    return i - size
            while i > 1 and not i & 1:  # next subtree to the left
                i >>= 1
            if i == 1:
                return -1
            i -= 1


# The same search as MaxTree.leftmost with one or two constrained components written out: the hot loop of the
# per-item algorithms under extra resources.


def _leftmost1(a, x: int, lo: int, size: int) -> int:
    i = lo + size
    while True:
        if a[i] >= x:
            while i < size:
                i *= 2
                if a[i] < x:
                    i += 1
            return i - size
        while i & 1:
            i >>= 1
        if not i:
            return -1
        i += 1


def _leftmost2(a, x: int, b, y: int, lo: int, size: int) -> int:
    i = lo + size
    while True:
        if a[i] >= x and b[i] >= y:
            while i < size:
                j = 2 * i
                if a[j] >= x and b[j] >= y:
                    i = j
                elif a[j + 1] >= x and b[j + 1] >= y:
                    i = j + 1
                else:
                    break
            if i >= size:
                return i - size
        while i & 1:
            i >>= 1
        if not i:
            return -1
        i += 1
