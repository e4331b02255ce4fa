"""A mixture's plan side (:mod:`packtool.packer.sources.mixture`): each encoded row's dataset, the copies its
declared proportion asks for, and copies of one sample kept out of one pack."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.format import KEPT
from packtool.packer.holdout import first_by_digest
from packtool.packer.sources.mixture import MixtureEntry


def with_datasets(table: pa.Table, dataset_of: dict[str, str], names: list[str]) -> pa.Table:
    """``table`` with ``dataset`` (the index of each row's dataset in ``names``) and ``copy`` (0) columns."""
    index = {n: i for i, n in enumerate(names)}
    ds = np.asarray([index[dataset_of[s]] for s in table.column("shard").to_pylist()], np.int32)
    return table.append_column("dataset", pa.array(ds)).append_column("copy", pa.array(np.zeros(len(ds), np.int32)))


#: The encoded table's column of a packing group's index (added only where a split has groups).
GROUP_COLUMN = "group"


def with_groups(table: pa.Table, entries: list[MixtureEntry], names: list[str]) -> pa.Table:
    """``table`` (with ``dataset``) with :data:`GROUP_COLUMN`: each row's packing group (its index in the split's
    groups, in order of first appearance); the table itself where the split has no groups."""
    groups: list[str] = []
    of = np.zeros(len(names), np.int32)
    for e in entries:
        if e.group is None:
            return table
        if e.group not in groups:
            groups.append(e.group)
        of[names.index(e.name)] = groups.index(e.group)
    if not groups:
        return table
    return table.append_column(GROUP_COLUMN, pa.array(of[table.column("dataset").to_numpy()]))


def all_failed(table: pa.Table, names: list[str]) -> tuple[str, int, str] | None:
    """The first dataset of a mixture's split (``table`` with ``dataset``) that has samples and none that
    encoded (each an error row): its name, its sample count and its most common reason; None if there is none."""
    ds = table.column("dataset").to_numpy()
    error = pc.equal(table.column("status"), "error").to_numpy(zero_copy_only=False)
    for i in first_seen(ds):
        rows = ds == i
        if error[rows].all():
            reasons = Counter(r for r, bad in zip(table.column("reason").to_pylist(), rows.tolist()) if bad)
            return names[i], int(rows.sum()), reasons.most_common(1)[0][0] or ""
    return None


def first_seen(values: np.ndarray) -> list[int]:
    """The distinct values in order of first appearance."""
    _, first = np.unique(values, return_index=True)
    return [int(values[i]) for i in np.sort(first)]


def dataset_loss_weights(table: pa.Table, entries: list[MixtureEntry], names: list[str]) -> pa.Table:
    """``table`` (with ``dataset``) with each row's ``loss_weight`` times its dataset's factor
    (``packtool: {loss_weight: F}`` of its entry; the table itself where every factor is 1)."""
    factors = {names.index(e.name): e.loss_weight for e in entries if e.loss_weight != 1.0}
    if not factors:
        return table
    scale = np.ones(len(names), np.float64)
    for i, f in factors.items():
        scale[i] = f
    weights = table.column("loss_weight").to_numpy() * scale[table.column("dataset").to_numpy()]
    return table.set_column(table.schema.get_field_index("loss_weight"), "loss_weight", pa.array(weights))


def repetitions(table: pa.Table, entries: list[MixtureEntry], names: list[str]) -> dict[int, float]:
    """How many times each dataset's kept samples are taken (dataset index -> r). ``blend_epochized``: the
    declared repetitions. ``blend``: one pass of ``N = max_i(n_i / w_i)`` samples (weights normalized), dataset
    i's samples ``N w_i / n_i`` times, so the dataset that needs the longest pass is taken once."""
    kept = pc.is_in(table.column("status"), value_set=pa.array(list(KEPT))).to_numpy(zero_copy_only=False)
    ds = table.column("dataset").to_numpy()
    n = {names.index(e.name): int((kept & (ds == names.index(e.name))).sum()) for e in entries}
    if entries and entries[0].weight is None:
        return {names.index(e.name): float(e.repetitions or 1.0) for e in entries}
    w = {names.index(e.name): float(e.weight or 0.0) for e in entries}
    total = sum(w.values())
    w = {i: v / total for i, v in w.items()}
    needed = [n[i] / w[i] for i in n if n[i]]
    if not needed:
        return {i: 1.0 for i in n}
    big = max(needed)
    return {i: (big * w[i] / n[i] if n[i] else 1.0) for i in n}


def copies_of(count: int, r: float) -> int:
    """The samples a dataset of ``count`` kept samples contributes at ``r`` repetitions (rounded half up)."""
    return math.floor(r * count + 0.5 + 1e-9)


#: How the reason of a sample a fractional repetition below 1 leaves out begins (its status: ``dropped``; not
#: counted against ``max_drop_rate``: the mixture asked for it).
NOT_DRAWN = "not drawn"


def repeat(table: pa.Table, reps: dict[int, float], seed: int, names: list[str] | None = None) -> pa.Table:
    """``table`` (with ``dataset``) with each kept row of dataset i taken ``floor(r_i)`` times, plus once more
    for the ``copies_of(n, r) - floor(r) n`` of them of smallest digest (seed, shard, key); copy k of a row has
    ``copy`` k. Rows not kept stay once (their ledger rows); so does a row ``r < 1`` leaves out, ``dropped``
    with a :data:`NOT_DRAWN` reason."""
    kept = pc.is_in(table.column("status"), value_set=pa.array(list(KEPT))).to_numpy(zero_copy_only=False)
    ds = table.column("dataset").to_numpy()
    shards, keys = table.column("shard").to_pylist(), table.column("key").to_pylist()
    times = np.ones(table.num_rows, np.int64)
    for i, r in reps.items():
        rows = np.flatnonzero(kept & (ds == i))
        if not rows.size:
            continue
        whole = math.floor(r + 1e-9)
        extra = copies_of(rows.size, r) - whole * rows.size
        times[rows] = whole
        if extra > 0:
            times[first_by_digest(seed, rows, shards, keys, extra)] += 1
    left_out = np.flatnonzero(times == 0)
    if left_out.size:  # one ledger row each: nothing is lost silently
        table = _not_drawn(table, left_out, reps, names)
        times[left_out] = 1
    if (times == 1).all():
        return table
    take = np.repeat(np.arange(table.num_rows), times)
    copy = np.concatenate([np.arange(t) for t in times]) if take.size else np.zeros(0, np.int64)
    out = table.take(pa.array(take))
    return out.set_column(out.schema.get_field_index("copy"), "copy", pa.array(copy.astype(np.int32)))


def _not_drawn(table: pa.Table, rows: np.ndarray, reps: dict[int, float], names: list[str] | None) -> pa.Table:
    """``table`` with ``rows`` marked ``dropped``, their reason saying which repetitions left them out."""
    ds = table.column("dataset").to_numpy()
    status = np.asarray(table.column("status").to_pylist(), object)
    reason = np.asarray(table.column("reason").to_pylist(), object)
    mask = np.zeros(table.num_rows, bool)
    mask[rows] = True
    for i in np.unique(ds[rows]).tolist():
        name = names[i] if names else str(i)
        reason[mask & (ds == i)] = f"{NOT_DRAWN}: dataset {name} takes its samples {reps[i]:g} times"
    status[mask] = "dropped"
    out = table.set_column(table.schema.get_field_index("status"), "status", pa.array(status.tolist(), pa.string()))
    out = out.set_column(out.schema.get_field_index("reason"), "reason", pa.array(reason.tolist(), pa.string()))
    for col in ("tokens", "targets", "images", "image_tokens"):
        values = out.column(col).to_numpy().copy()
        values[mask] = 0
        out = out.set_column(out.schema.get_field_index(col), col, pa.array(values, out.schema.field(col).type))
    return out


def separate_copies(ids: np.ndarray, ident: list[str], lengths: np.ndarray, capacity: int,
                    caps: list[tuple[np.ndarray, int | None]]) -> np.ndarray:
    """Pack ids (one per kept row) with copies of one sample moved out of a shared pack. Each copy after the first
    in a pack moves to the emptiest pack that takes it, else trades places with the segment of nearest length of
    another pack that the trade leaves both packs able to hold (at most :data:`SWAP_SCAN` segments each side of its
    length tried). Both packs must still fit ``capacity`` (``lengths``: aligned) and every per-pack cap of
    ``caps`` (``(per-row amount, cap or None)``), and neither may then hold a sample twice. Passes repeat while one
    parts a copy; copies that no move or trade parts stay together (:func:`shared_packs` counts them). The pack
    count never changes."""
    ids = np.asarray(ids, np.int64).copy()
    if not ids.size:
        return ids
    _, code = np.unique(np.asarray(ident, dtype=object), return_inverse=True)
    code = code.astype(np.int64)
    width = int(code.max()) + 1
    members = Counter((ids * width + code).tolist())  # (pack, sample) -> copies there
    if max(members.values()) < 2:
        return ids
    lengths = np.asarray(lengths, np.int64)
    n_packs = int(ids.max()) + 1
    load = np.bincount(ids, weights=lengths, minlength=n_packs).astype(np.int64)
    limited = [(np.asarray(amount, np.int64), int(cap)) for amount, cap in caps if cap is not None]
    used = [np.bincount(ids, weights=amount, minlength=n_packs).astype(np.int64) for amount, _ in limited]
    order = np.argsort(lengths, kind="stable")
    by_length = lengths[order]

    def place(row: int, p: int, q: int) -> None:
        members[p * width + code[row]] -= 1
        members[q * width + code[row]] += 1
        ids[row] = q
        load[p] -= lengths[row]
        load[q] += lengths[row]
        for (amount, _), u in zip(limited, used):
            u[p] -= amount[row]
            u[q] += amount[row]

    def move(row: int, p: int) -> bool:
        """Move ``row`` into the emptiest pack that takes it (the copy left behind keeps ``p`` non-empty)."""
        ok = load + lengths[row] <= capacity
        for (amount, cap), u in zip(limited, used):
            ok &= u + amount[row] <= cap
        ok[p] = False
        for q in np.flatnonzero(ok)[np.argsort(load[ok], kind="stable")].tolist():
            if not members[q * width + code[row]]:
                place(row, p, q)
                return True
        return False

    def trade(row: int, p: int) -> bool:
        """Trade places with a segment of another pack: the nearest length that leaves both packs within their
        limits and neither holding a sample twice."""
        at = int(np.searchsorted(by_length, lengths[row]))
        cand = order[max(0, at - SWAP_SCAN):at + SWAP_SCAN]
        q = ids[cand]
        delta = lengths[cand] - lengths[row]  # what p gains, q loses
        ok = (q != p) & (code[cand] != code[row]) & (load[p] + delta <= capacity) & (load[q] - delta <= capacity)
        for (amount, cap), u in zip(limited, used):
            d = amount[cand] - amount[row]
            ok &= (u[p] + d <= cap) & (u[q] - d <= cap)
        cand, q = cand[ok], q[ok]
        for k in np.argsort(np.abs(delta[ok]), kind="stable").tolist():
            other, pack = int(cand[k]), int(q[k])
            if members[pack * width + code[row]] or members[p * width + code[other]]:
                continue
            place(row, p, pack)
            place(other, pack, p)
            return True
        return False

    while True:
        parted, seen = 0, set()
        for row, key in enumerate((ids * width + code).tolist()):
            if key not in seen:
                seen.add(key)
                continue
            p = int(ids[row])
            if members[p * width + code[row]] > 1 and (move(row, p) or trade(row, p)):
                parted += 1
        if not parted:
            return ids


def copy_samples(ident: list[str]) -> np.ndarray:
    """Per row, the sample it is a copy of (the planner's ``samples``): the index of its ``ident`` among the
    distinct ones for rows whose sample is there more than once, -1 for the others."""
    _, code, count = np.unique(np.asarray(ident, dtype=object), return_inverse=True, return_counts=True)
    return np.where(count[code] > 1, code, -1).astype(np.int64)


def shared_packs(ids: np.ndarray, ident: list[str]) -> int:
    """How many packs hold some sample more than once (``ids``: each row's pack; ``ident``: its sample)."""
    if not len(ids):
        return 0
    _, code = np.unique(np.asarray(ident, dtype=object), return_inverse=True)
    keys, counts = np.unique(np.asarray(ids, np.int64) * (int(code.max()) + 1) + code, return_counts=True)
    return int(np.unique(keys[counts > 1] // (int(code.max()) + 1)).size)


#: Segments of nearest length each side that a copy's trade tries before it stays where the plan put it.
SWAP_SCAN = 1 << 15
