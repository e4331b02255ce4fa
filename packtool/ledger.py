"""The ledger: one row per source sample with its fate (``ledger.parquet``; DESIGN §4)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

STATUSES = ("packed", "truncated", "dropped", "error")

#: Contract columns first (DESIGN §4), then ``source_tokens`` (length before truncation).
LEDGER_SCHEMA = pa.schema([
    ("key", pa.string()), ("split", pa.string()), ("shard", pa.string()), ("status", pa.string()),
    ("reason", pa.string()), ("tokens", pa.int32()), ("targets", pa.int32()), ("images", pa.int32()),
    ("image_tokens", pa.int32()), ("pack", pa.string()), ("source_tokens", pa.int32()),
])


def read_ledger(path: str | Path) -> pa.Table:
    """The ledger of a packed output folder, or a ledger file itself."""
    p = Path(path)
    return pq.read_table(p / "ledger.parquet" if p.is_dir() else p)
