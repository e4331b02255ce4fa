"""``packtool failures`` reads the ledger a batch at a time: a ledger of many row groups read in batches of two rows
gives the report that grouping the whole table at once gives, and the whole table is never read."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtool.errors import FormatError
from packtool.format import LEDGER, LEDGER_SCHEMA
from packtool.verify import failures as fl
from packtool.verify.stats import group_reason

STATUS = ["packed", "error", "dropped", "packed", "truncated", "error", "packed"]


def _ledger(folder, n: int = 70):
    rows = {"key": [f"k{i:03d}" for i in range(n)], "split": ["train" if i % 5 else "val" for i in range(n)],
            "shard": [f"part-{i // 20}.tar" for i in range(n)], "status": [STATUS[i % len(STATUS)] for i in range(n)],
            "reason": [("" if STATUS[i % len(STATUS)] == "packed" else f"line {i} of a.jsonl: reason {i % 3}")
                       for i in range(n)],
            "tokens": [i for i in range(n)], "targets": [0] * n, "images": [0] * n, "image_tokens": [0] * n,
            "pack": [None] * n, "source_tokens": [2 * i for i in range(n)]}
    table = pa.table(rows, schema=LEDGER_SCHEMA)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / LEDGER, row_group_size=9)
    return table


def test_the_report_streams_and_equals_grouping_the_whole_ledger(tmp_path, monkeypatch):
    table = _ledger(tmp_path / "out")
    monkeypatch.setattr(fl, "BATCH_ROWS", 2)
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("the whole ledger was read"))
    for split in (None, ["val"]):
        report = fl.failures(tmp_path / "out", split=split, limit=None)
        rows = [r for r in table.to_pylist() if r["status"] != "packed" and (split is None or r["split"] in split)]
        expected = Counter((r["status"], group_reason(r["reason"])) for r in rows)
        assert report["total"] == len(rows) > 0
        assert {(g["status"], g["reason"]): g["count"] for g in report["groups"]} == dict(expected)
        assert sorted(s["key"] for g in report["groups"] for s in g["samples"]) == sorted(r["key"] for r in rows)
        counts = [g["count"] for g in report["groups"]]
        assert counts == sorted(counts, reverse=True)
    limited = fl.failures(tmp_path / "out", status=["error"], limit=1)
    assert all(len(g["samples"]) == 1 for g in limited["groups"])
    assert {g["status"] for g in limited["groups"]} == {"error"}


def test_what_is_not_a_ledger_is_one_line(tmp_path):
    with pytest.raises(FormatError, match="holds no"):
        fl.failures(tmp_path)
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(FormatError, match="is not a packtool ledger"):
        fl.failures(tmp_path / "x.parquet")
    pq.write_table(pa.table({"key": ["a"]}), tmp_path / "y.parquet")
    with pytest.raises(FormatError, match="no column 'split'"):
        fl.failures(tmp_path / "y.parquet")
    _ledger(tmp_path / "out")
    with pytest.raises(FormatError, match="unknown split 'test'"):
        fl.failures(tmp_path / "out", split=["test"])
