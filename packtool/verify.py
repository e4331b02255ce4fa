"""``packtool verify``: prove a packed OUTPUT is whole and consistent; with ``--source``, that it is faithful.

Returns a list of problems (empty = ok): each a line naming the file or key and what is wrong.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

from packtool.ledger import read_ledger
from packtool.write import index_tar

MAX_LISTED = 200


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _records(path: Path):
    """(key, {part: bytes}) of every record in a shard, in order."""
    import tarfile

    with tarfile.open(path, "r:") as tar:
        key, parts = None, {}
        for m in tar:
            k, _, part = m.name.partition(".")
            if k != key:
                if key is not None:
                    yield key, parts
                key, parts = k, {}
            parts[part] = tar.extractfile(m).read()
        if key is not None:
            yield key, parts


def check_pack(key: str, parts: dict[str, bytes], manifest: dict) -> list[str]:
    """Problems of one pack record against the format (DESIGN §4)."""
    problems = []
    try:
        tokens, targets, seqlens = (_npy(parts[p]) for p in ("tokens.npy", "targets.npy", "seqlens.npy"))
        meta = json.loads(parts["json"])
    except Exception as exc:
        return [f"{key}: unreadable record ({type(exc).__name__}: {exc})"]
    size, align = int(meta.get("pack_size", 0)), int(meta.get("align", 1))
    if tokens.dtype != np.int32 or targets.dtype != np.uint8 or seqlens.dtype != np.int32:
        problems.append(f"{key}: wrong dtypes {tokens.dtype}/{targets.dtype}/{seqlens.dtype}")
    if tokens.shape != targets.shape or tokens.ndim != 1:
        problems.append(f"{key}: tokens {tokens.shape} and targets {targets.shape} differ")
        return problems
    if int(seqlens.sum()) != len(tokens) or (seqlens <= 0).any():
        problems.append(f"{key}: seqlens {seqlens.tolist()} do not cover {len(tokens)} tokens")
        return problems
    cost = int((-(-seqlens.astype(np.int64) // align) * align).sum())
    if cost > size:
        problems.append(f"{key}: aligned length {cost} exceeds pack size {size}")
    if not set(np.unique(targets).tolist()) <= {0, 1}:
        problems.append(f"{key}: targets hold values other than 0/1")
    segs = meta.get("segments", [])
    if len(segs) != len(seqlens):
        problems.append(f"{key}: {len(segs)} segments in json, {len(seqlens)} seqlens")
        return problems
    image_id = manifest.get("image_token_id")
    starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
    members = {p for p in parts if p not in ("tokens.npy", "targets.npy", "seqlens.npy", "json")}
    named = []
    for seg, start, n in zip(segs, starts, seqlens):
        t, g = tokens[start:start + n], targets[start:start + n]
        where = f"{key}/{seg.get('key')}"
        if g[0]:
            problems.append(f"{where}: first token is a target")
        if not g.any():
            problems.append(f"{where}: no targets")
        media_tokens = 0
        for m in seg.get("media", []):
            named.append(m["member"])
            if m["member"] not in parts:
                problems.append(f"{where}: media member {m['member']} missing")
            off, cnt = int(m["token_offset"]), int(m["tokens"])
            if off + cnt > n or (image_id is not None and not (t[off:off + cnt] == image_id).all()):
                problems.append(f"{where}: media {m['member']} does not cover image tokens at {off}+{cnt}")
            if g[off:off + cnt].any():
                problems.append(f"{where}: media {m['member']} tokens marked as targets")
            media_tokens += cnt
        if image_id is not None and int((t == image_id).sum()) != media_tokens:
            problems.append(f"{where}: {int((t == image_id).sum())} image tokens, media account for {media_tokens}")
    if sorted(named) != sorted(members):
        problems.append(f"{key}: media members {sorted(members)} differ from the json's {sorted(named)}")
    return problems


def verify_output(output: str | Path, *, source: str | Path | None = None) -> list[str]:
    """Every check; see the module docstring."""
    out = Path(output)
    meta = out / ".nv-meta"
    problems: list[str] = []
    if not (meta / "packtool.json").exists():
        return [f"{out}: no .nv-meta/packtool.json (not a packtool output, or the run did not finish)"]
    manifest = json.loads((meta / "packtool.json").read_text())
    info = json.loads((meta / ".info.json").read_text())
    splits = yaml.safe_load((meta / "split.yaml").read_text())["split_parts"]
    counts = info.get("shard_counts", {})
    shards = [s for ss in splits.values() for s in ss]
    if sorted(counts) != sorted(shards):
        problems.append(f".info.json lists {sorted(counts)}, split.yaml {sorted(shards)}")
    placed: Counter = Counter()  # (split, pack, shard, key) occurrences
    pack_keys: set[str] = set()
    indexes = {}
    for split, split_shards in splits.items():
        for shard in split_shards:
            path = out / shard
            if not path.exists():
                problems.append(f"{shard}: missing")
                continue
            try:
                index = index_tar(path)
            except Exception as exc:
                problems.append(f"{shard}: unreadable tar ({exc})")
                continue
            indexes[shard] = index
            if counts.get(shard) != len(index):
                problems.append(f"{shard}: .info.json says {counts.get(shard)} samples, the tar holds {len(index)}")
            idx_path = path.with_name(path.name + ".idx")
            if not idx_path.exists():
                problems.append(f"{shard}.idx: missing")
            else:
                idx = np.fromfile(idx_path, dtype=np.uint64)
                expect = [r.offset for r in index] + ([index[-1].offset + index[-1].size] if index else [0])
                if idx.tolist() != expect:
                    problems.append(f"{shard}.idx: offsets do not match the tar")
            for key, parts in _records(path):
                if key in pack_keys:
                    problems.append(f"{key}: duplicate pack key")
                pack_keys.add(key)
                problems += check_pack(key, parts, manifest)
                try:
                    for seg in json.loads(parts["json"])["segments"]:
                        placed[(seg["split"], key, seg["shard"], seg["key"])] += 1
                except Exception:
                    pass
    problems += _check_sqlite(meta / "index.sqlite", shards, indexes)
    problems += _check_ledger(out, manifest, placed)
    if source is not None:
        from packtool.verify_source import check_against_source

        problems += check_against_source(out, Path(source), manifest)
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more"]
    return problems


def _check_sqlite(path: Path, shards: list[str], indexes: dict) -> list[str]:
    if not path.exists():
        return ["index.sqlite: missing"]
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM samples "
                           "ORDER BY tar_file_id, sample_index").fetchall()
    finally:
        con.close()
    expect = [(fid, r.key, i, r.offset, r.size) for fid, s in enumerate(shards) for i, r in
              enumerate(indexes.get(s, []))]
    return [] if rows == expect else ["index.sqlite: samples table does not match the tars"]


def _check_ledger(out: Path, manifest: dict, placed: Counter) -> list[str]:
    problems = []
    try:
        ledger = read_ledger(out).to_pylist()
    except Exception as exc:
        return [f"ledger.parquet: unreadable ({exc})"]
    seen: Counter = Counter((r["split"], r["shard"], r["key"]) for r in ledger)
    for k, n in seen.items():
        if n > 1:
            problems.append(f"ledger: {k[1]}/{k[2]} appears {n} times")
    by_sample = {(s, sh, k): p for (s, p, sh, k), n in placed.items()}
    for (s, p, sh, k), n in placed.items():
        if n > 1:
            problems.append(f"{p}: segment {sh}/{k} appears {n} times")
    for r in ledger:
        where = (r["split"], r["shard"], r["key"])
        if r["status"] in ("packed", "truncated"):
            if by_sample.get(where) != r["pack"]:
                problems.append(f"ledger: {r['shard']}/{r['key']} should be in {r['pack']}, "
                                f"found in {by_sample.get(where)}")
        else:
            if not r["reason"]:
                problems.append(f"ledger: {r['shard']}/{r['key']} is {r['status']} without a reason")
            if where in by_sample:
                problems.append(f"ledger: {r['shard']}/{r['key']} is {r['status']} but lies in {by_sample[where]}")
    for (s, sh, k) in by_sample:
        if (s, sh, k) not in seen:
            problems.append(f"{by_sample[(s, sh, k)]}: segment {sh}/{k} has no ledger row")
    for split, c in manifest.get("counts", {}).items():
        n = sum(1 for r in ledger if r["split"] == split)
        if c.get("samples") != n:
            problems.append(f"manifest counts {c.get('samples')} samples for {split}, the ledger {n}")
    return problems
