"""``stats`` and ``failures`` on a damaged output: they report the ledger, then exit 1 with one line naming the
shard that is missing or cut short and pointing to ``verify``; on a whole output they exit 0 (control)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

PACKTOOL = [sys.executable, "-m", "packtool.cli"]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKTOOL, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing", "index missing"])
def test_stats_and_failures_see_a_damaged_shard(packed, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(packed, out)
    for command in ("stats", "failures"):  # control: the whole output is healthy
        p = run(command, out)
        assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    shard = sorted((out / "train").glob("*.tar"))[0]
    if damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "missing":
        shard.unlink()
    else:
        shard.with_name(shard.name + ".idx").unlink()
    for command in ("stats", "failures"):
        for target in (out, out / "ledger.parquet"):
            p = run(command, target)
            assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
            assert p.stdout.strip()  # the ledger's report is still printed
            lines = [ln for ln in p.stderr.splitlines() if ln.startswith("packtool: error:")]
            assert len(lines) == 1 and shard.name in lines[0] and f"packtool verify {out}" in lines[0], p.stderr
