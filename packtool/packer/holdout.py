"""The validation split held out of ``train`` (``--val-ratio``/``--val-count``, :class:`~packtool.settings.Holdout`):
which encoded samples it takes, chosen by digest, never by position."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.format import KEPT
from packtool.settings import Holdout

#: The split a hold-out is written as, and the split it is taken from.
VAL, TRAIN = "val", "train"


def digest_ranks(seed: int, shards: list[str], keys: list[str]) -> np.ndarray:
    """Each sample's place in the draw: the first 8 bytes of the digest of (seed, source shard, key)."""
    out = np.empty(len(keys), np.uint64)
    for i, (shard, key) in enumerate(zip(shards, keys)):
        digest = hashlib.blake2b(f"{seed}\0{shard}\0{key}".encode(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "big")
    return out


def held_out(table: pa.Table, holdout: Holdout, seed: int, groups: np.ndarray | None = None) -> np.ndarray:
    """The rows of ``table`` (a split's encoded rows: ``shard``, ``key``, ``status``) that go to the validation
    split: in each group of ``groups`` (one per row; None: one group), :meth:`Holdout.size` of its kept samples,
    those of smallest rank (ties, impossible in practice, by shard and key). Samples that failed or were dropped
    stay where they were, in the ledger of their own split."""
    mask = np.zeros(table.num_rows, bool)
    kept = pc.is_in(table.column("status"), value_set=pa.array(list(KEPT))).to_numpy(zero_copy_only=False)
    shards = table.column("shard").to_pylist()
    keys = table.column("key").to_pylist()
    group_of = np.zeros(table.num_rows, np.int64) if groups is None else np.asarray(groups)
    for g in np.unique(group_of[kept]) if kept.any() else []:
        rows = np.flatnonzero(kept & (group_of == g))
        mask[first_by_digest(seed, rows, shards, keys, holdout.size(rows.size))] = True
    return mask


def first_by_digest(seed: int, rows: np.ndarray, shards: list[str], keys: list[str], count: int) -> np.ndarray:
    """The ``count`` of ``rows`` (indices into ``shards``/``keys``) of smallest :func:`digest_ranks` (ties,
    impossible in practice, by shard and key): a draw no order of arrival, worker count or rerun changes."""
    ranks = digest_ranks(seed, [shards[r] for r in rows], [keys[r] for r in rows])
    order = sorted(range(rows.size), key=lambda i: (int(ranks[i]), shards[rows[i]], keys[rows[i]]))
    return rows[order[:count]]
