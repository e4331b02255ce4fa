"""``packtool verify --source``: re-derive every sample from the source and compare it with the packs."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

import numpy as np

from packtool.encode import EncodeSettings, get_encoder
from packtool.ledger import read_ledger
from packtool.sources import SourceError, open_source, read_raw_samples
from packtool.sources.safepickle import load_bytes_list
from packtool.verify import _npy


def _settings(out: Path, manifest: dict) -> EncodeSettings:
    s = manifest["settings"]
    names = {f.name for f in fields(EncodeSettings)}
    kw = {k: v for k, v in s.items() if k in names}
    kw["tokenizer"] = str(out / ".nv-meta" / "tokenizer")
    return EncodeSettings(**kw)


def check_against_source(out: Path, source: Path, manifest: dict) -> list[str]:
    """Problems found by re-encoding the source: missing or extra samples, changed tokens, targets or media."""
    problems: list[str] = []
    settings = _settings(out, manifest)
    splits = list(manifest.get("counts", {}))
    try:
        src = open_source(source, splits)
    except SourceError as exc:
        return [f"--source: {exc}"]
    encoder = get_encoder(settings, src.dataset_yaml)
    ledger = {(r["shard"], r["key"]): r for r in read_ledger(out).to_pylist()}
    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    shards = list(info["shard_counts"])
    con = sqlite3.connect(out / ".nv-meta" / "index.sqlite")

    @lru_cache(maxsize=64)
    def record(pack_key: str) -> dict:
        fid, index = con.execute("SELECT tar_file_id, sample_index FROM samples WHERE sample_key=?",
                                 (pack_key,)).fetchone()
        parts = {}
        with open(out / shards[fid], "rb") as f:
            for part, off, size in con.execute("SELECT part_name, content_byte_offset, content_byte_size FROM "
                                               "sample_parts WHERE tar_file_id=? AND sample_index=?", (fid, index)):
                f.seek(off)
                parts[part] = f.read(size)
        return parts

    seen = set()
    for split, split_shards in src.splits.items():
        for shard in split_shards:
            try:
                raws = list(read_raw_samples(src.root, shard, src.excluded_samples))
            except SourceError as exc:
                problems.append(f"--source: {exc}")
                continue
            for raw, enc in zip(raws, encoder.encode_many(raws)):
                where = f"{shard}/{raw.key}"
                seen.add((shard, raw.key))
                row = ledger.get((shard, raw.key))
                if row is None:
                    problems.append(f"{where}: in the source, not in the ledger")
                    continue
                if row["status"] != enc.status:
                    problems.append(f"{where}: ledger says {row['status']}, re-encoding gives {enc.status}")
                    continue
                if enc.status not in ("packed", "truncated"):
                    continue
                problems += _compare_segment(where, raw, enc, record(row["pack"]))
    for (shard, key), row in ledger.items():
        if (shard, key) not in seen and not key.startswith("#"):
            problems.append(f"{shard}/{key}: in the ledger, not in the source")
    con.close()
    return problems


def _compare_segment(where: str, raw, enc, parts: dict) -> list[str]:
    meta = json.loads(parts["json"])
    seqlens = _npy(parts["seqlens.npy"])
    starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
    for seg, start, n in zip(meta["segments"], starts, seqlens):
        if seg["shard"] != raw.shard or seg["key"] != raw.key:
            continue
        tokens = _npy(parts["tokens.npy"])[start:start + n]
        targets = _npy(parts["targets.npy"])[start:start + n]
        problems = []
        if not np.array_equal(tokens, enc.tokens) or not np.array_equal(targets, enc.targets):
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
