"""Pack order for data parallelism: each step's group of ``n`` packs should cost the same to train on.

Estimated compute of a pack, in token-equivalents, over its segments (lengths rounded up to ``align``)::

    compute = sum(len) + sum(len**2) / (12 * hidden_size)

Per layer and token, the dense matmuls cost ~``24 * hidden**2`` FLOPs (attention projections ``8 h**2``, a
``4 h`` MLP ``16 h**2``); causal attention over a segment of ``len`` tokens adds ``4 * hidden * len / 2`` per
token on average, i.e. ``2 * hidden * len**2`` per segment. Dividing by the dense cost per token gives the
``len**2 / (12 * hidden)`` term (forward and backward scale both alike). With the default ``hidden_size=4096`` a
single 16k-token segment costs a third more than sixteen 1k segments with the same tokens.
"""

from __future__ import annotations

import numpy as np

from packtool.packer.algorithms._common import aligned_costs, as_int_array, positive_int


def pack_compute(pack_ids, lengths, align: int = 1, *, hidden_size: int = 4096) -> np.ndarray:
    """Estimated compute (token-equivalents, module doc) of every pack ``0..P-1``."""
    ids = as_int_array(pack_ids, "pack_ids")
    align = positive_int(align, "align", allow_none=False)
    cost = aligned_costs(as_int_array(lengths, "lengths", ids.size), align).astype(np.float64)
    n_packs = int(ids.max()) + 1 if ids.size else 0
    tokens = np.bincount(ids, weights=cost, minlength=n_packs)
    attention = np.bincount(ids, weights=cost * cost, minlength=n_packs)
    return tokens + attention / (12.0 * positive_int(hidden_size, "hidden_size", allow_none=False))


def balance_dp(pack_ids, lengths, n: int, align: int = 1, *, hidden_size: int = 4096, seed: int = 0) -> np.ndarray:
    """A permutation of the pack numbers (int64; ``order[i]`` is the pack trained at position ``i``) such that
    every consecutive group of ``n`` packs, one step across ``n`` data-parallel ranks, has near-equal compute.

    Packs are sorted by compute and cut into groups of ``n`` neighbours, which differ little; the groups are
    then shuffled with ``seed`` so that training does not run from heavy to light packs. A last, incomplete
    group (fewer than ``n`` packs) comes last.
    """
    n = positive_int(n, "n", allow_none=False)
    compute = pack_compute(pack_ids, lengths, align, hidden_size=hidden_size)
    by_compute = np.argsort(-compute, kind="stable")
    full = compute.size // n * n
    groups = by_compute[:full].reshape(-1, n)
    shuffled = groups[np.random.default_rng(seed).permutation(groups.shape[0])]
    return np.concatenate((shuffled.ravel(), by_compute[full:])).astype(np.int64)


def dp_imbalance(pack_ids, lengths, n: int, order=None, *, align: int = 1, hidden_size: int = 4096,
                 reduce: str = "mean") -> float:
    """Imbalance of data-parallel steps: for each complete group of ``n`` consecutive packs in ``order``
    (default: pack numbers ascending), max / mean compute; the mean over groups (``reduce="max"``: the worst
    group). 1.0 is perfect; with fewer than ``n`` packs the single partial group is measured."""
    n = positive_int(n, "n", allow_none=False)
    compute = pack_compute(pack_ids, lengths, align, hidden_size=hidden_size)
    if order is not None:
        order = as_int_array(order, "order", compute.size)
        compute = compute[order]
    if not compute.size:
        return 1.0
    full = compute.size // n * n
    groups = compute[:full].reshape(-1, n) if full else compute[None, :]
    ratio = groups.max(axis=1) / groups.mean(axis=1)
    if reduce == "mean":
        return float(ratio.mean())
    if reduce == "max":
        return float(ratio.max())
    raise ValueError(f"reduce must be 'mean' or 'max', got {reduce!r}")
