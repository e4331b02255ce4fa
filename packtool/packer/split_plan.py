"""Plan one split: its encoded samples packed globally, the packs ordered, and cut into output shards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.format import KEPT, aligned_lengths, row_length
from packtool.packer.algorithms import balance_dp, pack_lengths
from packtool.packer.assemble import estimate_pack_bytes, media_bytes_of
from packtool.packer.ledger import SplitFill
from packtool.packer.mixing import GROUP_COLUMN, copy_samples, first_seen, separate_copies
from packtool.packer.store import ENCODED_SCHEMA
from packtool.settings import PackSettings, ShardSize
from packtool.storage import location, read_parquet


@dataclass
class SplitPlan:
    """The packs of one split and the output shards they go to."""

    split: str
    #: Encoded rows of the split (its source shards concatenated, on-disk order), with ``src`` (source shard
    #: position) and ``row`` (row in that shard's table).
    table: pa.Table
    #: Pack number (in output order) of each row; -1 if not packed.
    pack: np.ndarray
    #: Output shard of each pack.
    shard_of_pack: np.ndarray

    @property
    def n_packs(self) -> int:
        return int(self.shard_of_pack.size)

    @property
    def n_shards(self) -> int:
        return int(self.shard_of_pack.max()) + 1 if self.shard_of_pack.size else 0

    def fill(self, pack_size: int, align: int) -> SplitFill:
        """The split's fill and L1 bound, from the rows the plan packed."""
        lengths = self.table.column("tokens").to_numpy()[self.pack >= 0].astype(np.int64)
        return SplitFill.of(int(lengths.sum()), int(aligned_lengths(lengths, align).sum()), self.n_packs, pack_size)


def load_encoded(enc_dirs: list[Path]) -> pa.Table:
    """The encoded rows of a split's source shards, with their ``src`` and ``row`` positions."""
    tables = []
    for src, d in enumerate(enc_dirs):
        t = read_parquet(location(d) / "samples.parquet")
        n = t.num_rows
        tables.append(t.append_column("src", pa.array(np.full(n, src, np.int32)))
                      .append_column("row", pa.array(np.arange(n, dtype=np.int32))))
    if not tables:
        return ENCODED_SCHEMA.empty_table().append_column("src", pa.array([], pa.int32())).append_column(
            "row", pa.array([], pa.int32()))
    return pa.concat_tables(tables)


def plan_split(split: str, table: pa.Table, settings: PackSettings) -> SplitPlan:
    """Pack the split's kept rows globally, order the packs, cut them into output shards."""
    kept = pc.is_in(table.column("status"), value_set=pa.array(list(KEPT))).to_numpy(zero_copy_only=False)
    keep = np.flatnonzero(kept)
    pack = np.full(table.num_rows, -1, dtype=np.int64)
    if keep.size == 0:
        return SplitPlan(split, table, pack, np.zeros(0, np.int64))
    lengths = table.column("tokens").to_numpy()[keep].astype(np.int64)
    images = table.column("images").to_numpy()[keep].astype(np.int64)
    image_tokens = table.column("image_tokens").to_numpy()[keep].astype(np.int64)
    enc, plan = settings.encode, settings.plan
    copied = "copy" in table.column_names and bool((table.column("copy").to_numpy()[keep] > 0).any())
    ident = None
    if copied:  # a mixture's copies: the planner keeps copies of one sample apart
        sub = table.take(pa.array(keep))
        ident = [f"{a}\0{b}" for a, b in zip(sub.column("shard").to_pylist(), sub.column("key").to_pylist())]

    def pack_part(part: np.ndarray) -> np.ndarray:
        """Pack ids of the kept rows ``part`` (positions in ``keep``), planned on their own."""
        ln, im, it = lengths[part], images[part], image_tokens[part]
        who = None if ident is None else [ident[i] for i in part.tolist()]
        ids = pack_lengths(
            ln, enc.pack_size, algorithm=plan.algorithm, align=enc.align, max_segments=plan.max_segments,
            images=im, max_images=enc.max_images, image_tokens=it, max_image_tokens=enc.max_image_tokens,
            seed=plan.seed, balanced_delta=plan.balanced_delta, samples=None if who is None else copy_samples(who),
        )
        if who is not None:  # what the plan still put together is moved apart where a move or a trade can
            ids = separate_copies(ids, who, aligned_lengths(ln, enc.align), row_length(enc.pack_size, enc.align),
                                  [(np.ones_like(ln), plan.max_segments), (im, enc.max_images),
                                   (it, enc.max_image_tokens)])
        return np.asarray(ids, np.int64)

    if GROUP_COLUMN in table.column_names:  # packing groups: each planned globally on its own, packs never shared
        group = table.column(GROUP_COLUMN).to_numpy()[keep]
        ids = np.empty(keep.size, np.int64)
        first = 0
        for g in first_seen(group):
            part = np.flatnonzero(group == g)
            ids[part] = pack_part(part) + first
            first = int(ids[part].max()) + 1
    else:
        ids = pack_part(np.arange(keep.size))
    n_packs = int(ids.max()) + 1
    if plan.balance_dp and plan.balance_dp > 1:
        order = np.asarray(balance_dp(ids, lengths, plan.balance_dp, align=enc.align, seed=plan.seed), np.int64)
    else:
        order = packs_by_first_item(ids, n_packs)  # on-disk order of the source: stable and easy to audit
    rank = np.empty(n_packs, dtype=np.int64)
    rank[order] = np.arange(n_packs)
    pack[keep] = rank[ids]
    media = media_bytes_of(table.column("media").to_pylist())[keep]
    return SplitPlan(split, table, pack, cut_shards(estimate_pack_bytes(pack[keep], lengths, media, n_packs),
                                                    plan.shard_size))


def packs_by_first_item(ids: np.ndarray, n_packs: int) -> np.ndarray:
    """Pack numbers in the order of their first item."""
    first = np.full(n_packs, len(ids), dtype=np.int64)
    np.minimum.at(first, ids, np.arange(len(ids)))
    return np.argsort(first, kind="stable")


def cut_shards(pack_bytes: np.ndarray, size: ShardSize) -> np.ndarray:
    """Output shard of each pack (in output order): ``size.value`` packs a shard, or as many as fit the byte
    size by estimate (at least one)."""
    n = pack_bytes.size
    if size.unit == "packs":
        return np.arange(n, dtype=np.int64) // size.value
    shard_of_pack = np.zeros(n, dtype=np.int64)
    cur, acc = 0, 0
    for p, b in enumerate(pack_bytes.tolist()):
        if acc and acc + b > size.value:
            cur, acc = cur + 1, 0
        shard_of_pack[p] = cur
        acc += b
    return shard_of_pack
