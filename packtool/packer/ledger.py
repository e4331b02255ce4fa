"""The ledger: one row per source sample (:data:`~packtool.format.LEDGER_SCHEMA`), written once per run from the
plans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packtool.commit import commit_path
from packtool.errors import FormatError
from packtool.format import LEDGER, LEDGER_SCHEMA, STATUSES, WEIGHT_LEDGER_COLUMN, pack_keys
from packtool.packer.mixing import NOT_DRAWN
from packtool.storage import location, read_parquet

if TYPE_CHECKING:
    from packtool.packer.split_plan import SplitPlan


@dataclass(frozen=True)
class SplitFill:
    """How full a split's packs are: what a run reports from its plan and ``packtool stats`` from the ledger."""

    packs: int
    #: Tokens of the packed samples.
    tokens: int
    #: The fewest packs the packed samples could take (their aligned tokens over the pack size, rounded up).
    l1_bound: int
    #: ``tokens / (packs * pack_size)``.
    fill: float

    @classmethod
    def of(cls, tokens: int, aligned: int, packs: int, pack_size: int) -> SplitFill:
        """Of packed samples holding ``tokens`` tokens, ``aligned`` once each is aligned up
        (:func:`~packtool.format.aligned_lengths`), in ``packs`` packs."""
        return cls(packs, tokens, -(-aligned // pack_size) if aligned else 0,
                   tokens / (packs * pack_size) if packs else 0.0)


def read_ledger(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """The ledger of a packed output folder, or a ledger file itself (only ``columns``, when given)."""
    p = location(path)
    file = p / LEDGER if p.is_dir() else p
    try:
        return read_parquet(file, columns=columns)
    except (pa.ArrowException, KeyError) as exc:  # not Parquet, or a Parquet file without the ledger's columns
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FormatError(f"{file} is not a packtool ledger ({reason})") from None


def ledger_table(split: str, plan: SplitPlan, datasets: tuple[str, ...] = (), weighted: bool = False) -> pa.Table:
    """The ledger rows of one planned split (pack keys computed by Arrow: no Python string per row); a
    mixture's (``datasets``: its names) add :data:`~packtool.format.MIXTURE_LEDGER_COLUMNS`, a row per copy;
    ``weighted`` adds :data:`~packtool.format.WEIGHT_LEDGER_COLUMN`."""
    t, n = plan.table, plan.table.num_rows
    pack_col = pack_keys(split, plan.pack)
    table = pa.table({
        "key": t.column("key"), "split": pa.array([split] * n, pa.string()), "shard": t.column("shard"),
        "status": t.column("status"), "reason": t.column("reason"), "tokens": t.column("tokens"),
        "targets": t.column("targets"), "images": t.column("images"), "image_tokens": t.column("image_tokens"),
        "pack": pack_col, "source_tokens": t.column("source_tokens"),
    }, schema=LEDGER_SCHEMA)
    if datasets:
        names = pa.array(datasets, pa.string())
        table = table.append_column("dataset", names.take(t.column("dataset"))).append_column("copy",
                                                                                            t.column("copy"))
    if weighted:
        table = table.append_column(WEIGHT_LEDGER_COLUMN, t.column("loss_weight"))
    return table


def weight_summary(plans: Mapping[str, SplitPlan]) -> dict | None:
    """The manifest's ``loss_weights``: the packed samples' smallest and largest weight and whether every weight is
    a whole number; None where every weight is 1."""
    if not is_weighted(plans):
        return None
    weights = np.concatenate([p.table.column("loss_weight").to_numpy()[p.pack >= 0] for p in plans.values()])
    if not weights.size:
        return {"min": 1.0, "max": 1.0, "whole": True}
    return {"min": float(weights.min()), "max": float(weights.max()),
            "whole": bool(np.all(weights == np.round(weights)))}


def is_weighted(plans: Mapping[str, SplitPlan]) -> bool:
    """Whether some sample of the plans has a loss weight other than 1."""
    return any(not pc.all(pc.equal(p.table.column("loss_weight"), 1.0)).as_py() for p in plans.values()
               if p.table.num_rows)


def write_ledger(output: Path, plans: Mapping[str, SplitPlan], datasets: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Write ``ledger.parquet`` and return the counts per split and status, and the packs per split."""
    tables: list[pa.Table] = []
    counts: dict[str, dict[str, int]] = {}
    packs: dict[str, int] = {}
    weighted = is_weighted(plans)
    for split, plan in plans.items():
        tables.append(ledger_table(split, plan, datasets, weighted))
        statuses = {v["values"]: v["counts"] for v in pc.value_counts(plan.table.column("status")).to_pylist()}
        counts[split] = {"samples": plan.table.num_rows, **{s: statuses.get(s, 0) for s in STATUSES}}
        if datasets:  # a mixture's samples its repetitions left out (dropped, and no failure)
            counts[split]["not_drawn"] = int(pc.sum(pc.starts_with(plan.table.column("reason"), NOT_DRAWN)).as_py()
                                             or 0)
        packs[split] = plan.n_packs
    table = pa.concat_tables(tables) if tables else LEDGER_SCHEMA.empty_table()
    with commit_path(output / LEDGER) as tmp:
        pq.write_table(table, tmp)
    return counts, packs
