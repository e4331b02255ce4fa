"""Which samples did not make it into the packs whole, and why: the ledger's failed (``error``), ``dropped`` and
``truncated`` rows, grouped by reason (numbers folded, as ``stats`` groups them) with counts and examples that
keep the full reason, the record key and the source shard. Serves ``packtool failures`` and the reasons the
``pack`` command names when it exits over a rate limit."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from packtool.errors import FormatError
from packtool.format import STATUSES
from packtool.storage import location
from packtool.verify.stats import _ledger, group_reason

#: The statuses of samples not packed whole.
FAILED = tuple(s for s in STATUSES if s != "packed")
#: The ledger columns this report reads.
COLUMNS = ["key", "split", "shard", "status", "reason", "source_tokens", "tokens"]
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
    ledger = _ledger(location(path), COLUMNS)
    splits = set(ledger.column("split").to_pylist())
    missing = sorted(set(split or []) - splits)
    if missing:
        raise FormatError(f"unknown split {missing[0]!r} (the ledger has {', '.join(sorted(splits)) or 'none'})")
    wanted_status, wanted_split = set(status or FAILED), set(split or splits)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for row in ledger.to_pylist():
        if row["status"] not in wanted_status or row["split"] not in wanted_split:
            continue
        group = (row["status"], group_reason(row["reason"] or ""))
        counts[group] += 1
        if limit is None or len(groups[group]) < limit:
            groups[group].append({"split": row["split"], "shard": row["shard"], "key": row["key"],
                                  "reason": row["reason"], "source_tokens": row["source_tokens"],
                                  "tokens": row["tokens"]})
    order = sorted(counts, key=lambda g: (-counts[g], g))
    return {"total": sum(counts.values()),
            "groups": [{"status": s, "reason": r, "count": counts[(s, r)], "samples": groups[(s, r)]}
                       for s, r in order]}


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
