"""Input checks and small helpers shared by the packing algorithms.

Every algorithm works in *units*: an item's cost divided by the alignment, so the capacity of a pack is
``pack_size // align`` units and a pack is valid when the units of its items sum to at most that. Extra additive
limits (images, image tokens per pack) travel as ``resources``: a tuple of ``(per-item values, per-pack limit)``.
"""

from __future__ import annotations

from typing import Literal, overload

import numpy as np

from packtool.format import aligned_lengths

#: A per-pack additive limit other than tokens: per-item amounts (int64) and the most a pack may hold.
Resource = tuple[np.ndarray, int]


def as_int_array(values, name: str, n: int | None = None) -> np.ndarray:
    """``values`` as a 1-D int64 array of non-negative integers (of length ``n`` when given)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    if a.size and not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.bool_)):
        if not np.issubdtype(a.dtype, np.floating) or not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise ValueError(f"{name} must hold integers")
    a = a.astype(np.int64, copy=False)
    if n is not None and a.size != n:
        raise ValueError(f"{name} has {a.size} entries, expected {n}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name} must be non-negative (entry {int(np.argmin(a))} is {int(a.min())})")
    return a


@overload
def positive_int(value: object, name: str, allow_none: Literal[False]) -> int: ...
@overload
def positive_int(value: object, name: str, allow_none: bool = True) -> int | None: ...
def positive_int(value, name: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def aligned_costs(lengths: np.ndarray, align: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``align`` (the format's rule,
    :func:`packtool.format.aligned_lengths`)."""
    return aligned_lengths(lengths, align)


def check_fits(costs: np.ndarray, pack_size: int, resources_named: list[tuple[str, np.ndarray, int]]) -> None:
    """Raise ``ValueError`` naming the first item that cannot fit an empty pack, with its cost."""
    bad = costs > pack_size
    for _, values, limit in resources_named:
        bad |= values > limit
    if not bad.any():
        return
    i = int(np.argmax(bad))
    why = [f"cost {int(costs[i])} > pack_size {pack_size}"] if costs[i] > pack_size else []
    why += [f"{name} {int(v[i])} > {limit}" for name, v, limit in resources_named if v[i] > limit]
    raise ValueError(f"item {i} (cost {int(costs[i])}) cannot fit in a pack: {', '.join(why)}")


def decreasing_order(units: np.ndarray, cap: int) -> np.ndarray:
    """Item indices by cost, largest first; equal costs keep index order (a stable sort)."""
    if cap < 1 << 16:
        return np.argsort((cap - units).astype(np.uint16), kind="stable")  # radix sort, ~5x faster
    return np.argsort(-units, kind="stable")


def increasing_order(units: np.ndarray, cap: int) -> np.ndarray:
    """Item indices by cost, smallest first; equal costs keep index order (a stable sort)."""
    return np.argsort(units.astype(np.uint16) if cap < 1 << 16 else units, kind="stable")


def scatter(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``out[order[i]] = values[i]``: per-item results given in ``order`` put back in item order."""
    out = np.empty(values.size, dtype=np.int64)
    out[order.astype(np.int32) if order.size < 1 << 31 else order] = values  # int32 indices: ~2x faster
    return out


def renumber(ids: np.ndarray) -> np.ndarray:
    """Pack ids made dense (0..P-1) keeping their relative order; used where packs can end up empty."""
    used = np.zeros(int(ids.max()) + 1 if ids.size else 0, dtype=bool)
    used[ids] = True
    new = np.cumsum(used) - 1
    return new[ids].astype(np.int64)
