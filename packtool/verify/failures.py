"""Which samples did not make it into the packs whole, and why: the ledger's failed (``error``), ``dropped`` and
``truncated`` rows, grouped by reason (numbers folded, as ``stats`` groups them) with counts and examples that
keep the full reason, the record key and the source shard. Serves ``packtool failures`` and the reasons the
``pack`` command names when it exits over a rate limit."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from packtool.errors import FormatError
from packtool.format import LEDGER, STATUSES
from packtool.storage import location, parquet_file
from packtool.verify.stats import group_reason

#: The statuses of samples not packed whole.
FAILED = tuple(s for s in STATUSES if s != "packed")
#: The ledger columns this report reads.
COLUMNS = ["key", "split", "shard", "status", "reason", "source_tokens", "tokens"]
#: Ledger rows read at a time (the report never holds the whole ledger).
BATCH_ROWS = 65_536
#: Words of a reason that say a sample's media file was not where the run looked.
_MEDIA_NOT_FOUND = ("media file", "not found in")


def failures(path: str | Path, *, status: list[str] | None = None, split: list[str] | None = None,
             limit: int | None = 5) -> dict[str, Any]:
    """The not-packed samples of ``path`` (an output folder or its ledger), grouped by status and reason, most
    frequent first; each group lists up to ``limit`` samples (``None``: all) with their full reasons."""
    unknown = sorted(set(status or []) - set(FAILED))
    if unknown:
        raise FormatError(f"unknown status {unknown[0]!r} (choose from {', '.join(FAILED)})")
    if limit is not None and limit < 0:
        raise FormatError(f"limit must be at least 0, not {limit}")
    wanted_status = set(status or FAILED)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    splits: set[str] = set()
    for batch in _batches(location(path)):
        splits.update(batch.column("split").unique().to_pylist())
        # only the rows not packed whole become Python objects: memory holds a batch and the groups' examples
        keep = pc.is_in(batch.column("status"), pa.array(sorted(wanted_status), pa.string()))
        if split:
            keep = pc.and_(keep, pc.is_in(batch.column("split"), pa.array(sorted(set(split)), pa.string())))
        for row in batch.filter(keep).to_pylist():
            group = (row["status"], group_reason(row["reason"] or ""))
            counts[group] += 1
            if limit is None or len(groups[group]) < limit:
                groups[group].append({"split": row["split"], "shard": row["shard"], "key": row["key"],
                                      "reason": row["reason"], "source_tokens": row["source_tokens"],
                                      "tokens": row["tokens"]})
    missing = sorted(set(split or []) - splits)
    if missing:
        raise FormatError(f"unknown split {missing[0]!r} (the ledger has {', '.join(sorted(splits)) or 'none'})")
    order = sorted(counts, key=lambda g: (-counts[g], g))
    return {"total": sum(counts.values()),
            "groups": [{"status": s, "reason": r, "count": counts[(s, r)], "samples": groups[(s, r)]}
                       for s, r in order]}


def _batches(path: Any) -> Iterator[pa.RecordBatch]:
    """The ledger of ``path`` (an output folder or its ledger file), :data:`COLUMNS` only, a row group's batches at
    a time; a one-line error when it is neither."""
    file = path / LEDGER if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise FormatError(f"{path} is not a packed output: it holds no {LEDGER}")
    try:
        reader = parquet_file(file)
        missing = [c for c in COLUMNS if c not in reader.schema_arrow.names]
        if missing:
            raise FormatError(f"{file} is not a packtool ledger (no column {missing[0]!r})")
        yield from reader.iter_batches(batch_size=BATCH_ROWS, columns=COLUMNS)
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FormatError(f"{file} is not a packtool ledger ({reason})") from None


def format_failures(report: dict[str, Any]) -> str:
    """``failures``' report as a table: one heading line per group, one line per listed sample."""
    if not report["total"]:
        return "no failed, dropped or truncated samples\n"
    lines = [f"{report['total']} samples not packed whole"]
    for g in report["groups"]:
        lines += ["", f"{g['status']} {g['count']}: {g['reason']}"]
        for s in g["samples"]:
            lines.append(f"  {s['split']}  {s['shard']}  {s['key']}: {s['reason']}")
        if g["count"] > len(g["samples"]):
            lines.append(f"  ... {g['count'] - len(g['samples'])} more")
    return "\n".join(lines) + "\n"


def top_reasons(path: str | Path, statuses: list[str], n: int = 3) -> str:
    """The ``n`` most frequent reasons of ``statuses`` as one phrase (one full example each), with a hint when
    media files were not found (a JSON/Parquet source's media folder defaults to the source's folder)."""
    report = failures(path, status=statuses, limit=1)
    if not report["groups"]:
        return ""
    parts = [f"{g['count']} × {g['samples'][0]['reason']}" for g in report["groups"][:n]]
    text = "top reasons: " + "; ".join(parts)
    if any(all(w in g["reason"] for w in _MEDIA_NOT_FOUND) for g in report["groups"][:n]):
        text += "; media files were not found: is --media-dir the folder they lie in?"
    return text
