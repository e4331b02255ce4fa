"""``packtool verify --source``: re-derive every sample from the source and compare it with the packs.

Source shards are read as a stream (a chunk of samples at a time), so memory does not grow with shard size. A
shard whose tail cannot be read must have the matching ``#unreadable-after-N`` ledger row; a key repeated in a
shard is matched to the ledger row of the same occurrence.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

import numpy as np

from packtool.encode import get_encoder
from packtool.encoded import UNREADABLE
from packtool.errors import SourceError
from packtool.ledger import read_ledger
from packtool.settings import EncodeSettings
from packtool.sources import open_source, read_raw_samples
from packtool.sources.safepickle import load_bytes_list
from packtool.verify import _npy

CHUNK = 256


def _settings(out: Path, manifest: dict) -> EncodeSettings:
    s = manifest["settings"]
    names = {f.name for f in fields(EncodeSettings)}
    kw = {k: v for k, v in s.items() if k in names}
    kw["tokenizer"] = str(out / ".nv-meta" / "tokenizer")
    return EncodeSettings(**kw)


def _ledger_rows(out: Path) -> dict[tuple[str, str, int], dict]:
    """Ledger rows by (shard, key, occurrence of that key in the shard)."""
    rows, seen = {}, Counter()
    for r in read_ledger(out).to_pylist():
        seen[(r["shard"], r["key"])] += 1
        rows[(r["shard"], r["key"], seen[(r["shard"], r["key"])])] = r
    return rows


def check_against_source(out: Path, source: Path, manifest: dict) -> list[str]:
    """Problems found by re-encoding the source: missing or extra samples, changed tokens, targets or media."""
    settings = _settings(out, manifest)
    try:
        src = open_source(source, list(manifest.get("counts", {})))
    except SourceError as exc:
        return [f"source: {exc}"]
    encoder = get_encoder(settings, src.dataset_yaml)
    ledger = _ledger_rows(out)
    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    records = _RecordReader(out, list(info["shard_counts"]))
    problems: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    try:
        for shard in (s for shards in src.splits.values() for s in shards):
            problems += _check_shard(src.root, shard, src.excluded_samples, encoder, ledger, records, seen)
    finally:
        records.close()
    for (shard, key, n), row in ledger.items():
        if (shard, key, n) not in seen:
            problems.append(f"{shard}/{key}: in the ledger, not in the source")
    return problems


def _check_shard(root: Path, shard: str, excluded, encoder, ledger: dict, records: "_RecordReader",
                 seen: set) -> list[str]:
    """Re-encode one source shard chunk by chunk and compare every sample with its ledger row and pack."""
    problems: list[str] = []
    occurrence: Counter = Counter()
    samples = read_raw_samples(root, shard, excluded)
    chunk, done, error = [], 0, None
    while True:
        try:
            raw = next(samples)
            chunk.append(raw)
        except StopIteration:
            raw = None
        except SourceError as exc:
            raw, error = None, str(exc)
        if chunk and (raw is None or len(chunk) >= CHUNK):
            for r, enc in zip(chunk, encoder.encode_many(chunk)):
                occurrence[r.key] += 1
                where = (shard, r.key, occurrence[r.key])
                seen.add(where)
                problems += _compare(f"{shard}/{r.key}", r, enc, ledger.get(where), records)
            done, chunk = done + len(chunk), []
        if raw is None:
            break
    if error is not None:
        problems += _check_unreadable(shard, done, error, ledger, seen)
    return problems


def _check_unreadable(shard: str, done: int, error: str, ledger: dict, seen: set) -> list[str]:
    """The source shard stops being readable after ``done`` samples: the ledger must say so."""
    where = (shard, f"{UNREADABLE}{done}", 1)
    if where not in ledger:
        return [f"source: {error} (the ledger has no {where[1]} row for {shard})"]
    seen.add(where)
    return []


def _compare(where: str, raw, enc, row: dict | None, records: "_RecordReader") -> list[str]:
    if row is None:
        return [f"{where}: in the source, not in the ledger"]
    if row["status"] != enc.status:
        return [f"{where}: ledger says {row['status']}, re-encoding gives {enc.status}"]
    if enc.status not in ("packed", "truncated"):
        return []
    return _compare_segment(f"{where} (in {row['pack']})", raw, enc, records.get(row["pack"]))


class _RecordReader:
    """Pack records by key, through ``index.sqlite`` (random access into the tars)."""

    def __init__(self, out: Path, shards: list[str]):
        self.out, self.shards = out, shards
        self.con = sqlite3.connect(out / ".nv-meta" / "index.sqlite")
        self.get = lru_cache(maxsize=64)(self._read)

    def _read(self, pack_key: str) -> dict[str, bytes]:
        hit = self.con.execute("SELECT tar_file_id, sample_index FROM samples WHERE sample_key=?",
                               (pack_key,)).fetchone()
        if hit is None:
            return {}
        fid, index = hit
        parts = {}
        with open(self.out / self.shards[fid], "rb") as f:
            for part, off, size in self.con.execute(
                    "SELECT part_name, content_byte_offset, content_byte_size FROM sample_parts "
                    "WHERE tar_file_id=? AND sample_index=?", (fid, index)):
                f.seek(off)
                parts[part] = f.read(size)
        return parts

    def close(self) -> None:
        self.con.close()


def _compare_segment(where: str, raw, enc, parts: dict) -> list[str]:
    try:
        meta = json.loads(parts["json"])
        seqlens, tokens, targets = (_npy(parts[p]) for p in ("seqlens.npy", "tokens.npy", "targets.npy"))
    except Exception:
        return [f"{where}: its pack is missing or unreadable"]
    starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
    for seg, start, n in zip(meta["segments"], starts, seqlens):
        if seg["shard"] != raw.shard or seg["key"] != raw.key:
            continue
        problems = []
        if not np.array_equal(tokens[start:start + n], enc.tokens) or \
                not np.array_equal(targets[start:start + n], enc.targets):
            problems.append(f"{where}: tokens or targets differ from a fresh encoding")
        if len(seg["media"]) != len(enc.media):
            problems.append(f"{where}: {len(seg['media'])} media in the pack, {len(enc.media)} in the source")
        for m, e in zip(seg["media"], enc.media):
            data = raw.parts[e["part"]]
            if e["item"] is not None:
                data = load_bytes_list(data)[e["item"]]
            if parts.get(m["member"]) != data:
                problems.append(f"{where}: media {m['member']} differs from source member {e['part']}")
        return problems
    return [f"{where}: not found in its pack"]
