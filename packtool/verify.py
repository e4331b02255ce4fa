"""``packtool verify``: prove a packed OUTPUT is whole and consistent; with ``--source``, that it is faithful.

Without the source it checks every pack against the format (DESIGN §4), every token id against the embedded
tokenizer (in its vocabulary; and, for byte-level BPE tokenizers, equal to what the tokenizer makes of the
segment's own decoded text), every segment against its ledger row (tokens, targets, images), and the Energon
metadata (``.info.json``, ``.tar.idx``, ``index.sqlite``, ``split.yaml``) against the tars. With ``--source`` it
re-encodes every source sample and compares tokens, targets and media bytes (:mod:`packtool.verify_source`).

Returns a list of problems (empty = ok): each a line naming the file or key and what is wrong.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from packtool.format import ARRAYS, KEPT, STATUSES
from packtool.ledger import read_ledger
from packtool.shards import index_tar, scan_records

MAX_LISTED = 200


class MetadataError(ValueError):
    """A metadata file is missing or unreadable (the message is the problem line)."""


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _load(path: Path, parse) -> dict:
    if not path.exists():
        raise MetadataError(f"{path.parent.name}/{path.name}: missing")
    try:
        data = parse(path.read_text())
    except Exception as exc:
        raise MetadataError(f"{path.parent.name}/{path.name}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise MetadataError(f"{path.parent.name}/{path.name}: not a mapping")
    return data


# -- token ids -------------------------------------------------------------------------------------------------
class TokenCheck:
    """Checks token ids against the tokenizer embedded in the output.

    Every id must lie in the vocabulary. For byte-level BPE tokenizers (Qwen, GPT-2 style) decoding is lossless,
    so a segment's ids (each media span collapsed back to its one placeholder) must be exactly what the tokenizer
    makes of their own decoded text; for a truncated segment, up to the last pre-token piece, which a cut may
    leave tokenized differently. Other tokenizers get the range check only.
    """

    def __init__(self, tokenizer_dir: Path, image_token_id: int | None):
        from tokenizers import decoders
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.size = len(self.tok)
        self.image_token_id = image_token_id
        backend = self.tok.backend_tokenizer
        self.exact = isinstance(backend.decoder, decoders.ByteLevel)
        self.pre_tokenizer = backend.pre_tokenizer

    def problems(self, segments: list[tuple[str, np.ndarray, list[dict], bool]]) -> list[str]:
        """Problems of ``(where, tokens, media, truncated)`` segments (checked as one batch)."""
        problems, staged = [], []
        for where, tokens, media, truncated in segments:
            bad = np.flatnonzero((tokens < 0) | (tokens >= self.size))
            if bad.size:
                problems.append(f"{where}: token id {int(tokens[bad[0]])} at {int(bad[0])} is outside the "
                                f"vocabulary of {self.size}")
            elif self.exact:
                staged.append((where, self._collapse(tokens, media), truncated))
        if not staged:
            return problems
        texts = self.tok.batch_decode([ids for _, ids, _ in staged], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
        again = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        for (where, ids, truncated), text, new, offsets in zip(staged, texts, again["input_ids"],
                                                               again["offset_mapping"]):
            n = len(ids)
            if truncated:
                stable = self._last_piece_start(text)
                n = sum(1 for _, end in offsets if end <= stable)
            elif len(new) != len(ids):
                n = -1
            if n < 0 or list(ids[:n]) != list(new[:n]):
                problems.append(f"{where}: token ids differ from the tokenizer's encoding of their own text "
                                f"(corrupted tokens)")
        return problems

    def _collapse(self, tokens: np.ndarray, media: list[dict]) -> list[int]:
        keep = np.ones(len(tokens), dtype=bool)
        for m in media:
            keep[int(m["token_offset"]) + 1: int(m["token_offset"]) + int(m["tokens"])] = False
        return tokens[keep].tolist()

    def _last_piece_start(self, text: str) -> int:
        pieces = self.pre_tokenizer.pre_tokenize_str(text) if self.pre_tokenizer is not None else []
        return pieces[-1][1][0] if pieces else 0


# -- one pack --------------------------------------------------------------------------------------------------
@dataclass
class Segment:
    """What a pack holds of one source sample, as the ledger records it."""

    pack: str
    tokens: int
    targets: int
    images: int
    image_tokens: int


def check_pack(key: str, parts: dict[str, bytes], manifest: dict,
               segments: list[tuple[str, np.ndarray, list[dict], bool]] | None = None) -> list[str]:
    """Problems of one pack record against the format (DESIGN §4). Appends each segment's
    ``(where, tokens, media, truncated)`` to ``segments`` for the token check."""
    try:
        tokens, targets, seqlens = (_npy(parts[p]) for p in ARRAYS)
        meta = json.loads(parts["json"])
    except Exception as exc:
        return [f"{key}: unreadable record ({type(exc).__name__}: {exc})"]
    problems = []
    size, align = int(meta.get("pack_size", 0)), int(meta.get("align", 1))
    settings = manifest.get("settings", {})
    if (size, align) != (settings.get("pack_size", size), settings.get("align", align)):
        problems.append(f"{key}: pack_size/align {size}/{align} differ from the manifest's")
    if tokens.dtype != np.int32 or targets.dtype != np.uint8 or seqlens.dtype != np.int32:
        problems.append(f"{key}: wrong dtypes {tokens.dtype}/{targets.dtype}/{seqlens.dtype}")
    if tokens.shape != targets.shape or tokens.ndim != 1:
        return problems + [f"{key}: tokens {tokens.shape} and targets {targets.shape} differ"]
    if int(seqlens.sum()) != len(tokens) or (seqlens <= 0).any():
        return problems + [f"{key}: seqlens {seqlens.tolist()} do not cover {len(tokens)} tokens"]
    cost = int((-(-seqlens.astype(np.int64) // align) * align).sum())
    if cost > size:
        problems.append(f"{key}: aligned length {cost} exceeds pack size {size}")
    if not set(np.unique(targets).tolist()) <= {0, 1}:
        problems.append(f"{key}: targets hold values other than 0/1")
    segs = meta.get("segments", [])
    if len(segs) != len(seqlens):
        return problems + [f"{key}: {len(segs)} segments in json, {len(seqlens)} seqlens"]
    image_id = manifest.get("image_token_id")
    starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
    named = []
    for seg, start, n in zip(segs, starts, seqlens):
        t, g = tokens[start:start + n], targets[start:start + n]
        where = f"{key}/{seg.get('key')}"
        problems += _check_segment(where, t, g, seg.get("media", []), parts, image_id)
        named += [m["member"] for m in seg.get("media", [])]
        if segments is not None:
            segments.append((where, t, seg.get("media", []), bool(seg.get("truncated"))))
    caps = (("max_segments", len(segs), "segments"), ("max_images", len(named), "images"),
            ("max_image_tokens", sum(int(m["tokens"]) for s in segs for m in s.get("media", [])), "image tokens"))
    for setting, value, what in caps:
        if settings.get(setting) is not None and value > int(settings[setting]):
            problems.append(f"{key}: {value} {what} exceed {setting} {settings[setting]}")
    members = sorted(p for p in parts if p not in ARRAYS and p != "json")
    if sorted(named) != members:
        problems.append(f"{key}: media members {members} differ from the json's {sorted(named)}")
    return problems


def _check_segment(where: str, t: np.ndarray, g: np.ndarray, media: list[dict], parts: dict,
                   image_id: int | None) -> list[str]:
    problems = []
    if g[0]:
        problems.append(f"{where}: first token is a target")
    if not g.any():
        problems.append(f"{where}: no targets")
    media_tokens = 0
    for m in media:
        if m["member"] not in parts:
            problems.append(f"{where}: media member {m['member']} missing")
        off, cnt = int(m["token_offset"]), int(m["tokens"])
        if off + cnt > len(t) or (image_id is not None and not (t[off:off + cnt] == image_id).all()):
            problems.append(f"{where}: media {m['member']} does not cover image tokens at {off}+{cnt}")
        if g[off:off + cnt].any():
            problems.append(f"{where}: media {m['member']} tokens marked as targets")
        media_tokens += cnt
    if image_id is not None and int((t == image_id).sum()) != media_tokens:
        problems.append(f"{where}: {int((t == image_id).sum())} image tokens, media account for {media_tokens}")
    return problems


def _segment_facts(key: str, parts: dict[str, bytes]) -> list[tuple[str, str, Segment]]:
    """``(shard, key, Segment)`` of each segment of a well-formed record (empty if it is not)."""
    try:
        targets, seqlens = _npy(parts["targets.npy"]), _npy(parts["seqlens.npy"])
        segs = json.loads(parts["json"])["segments"]
        starts = np.concatenate([[0], np.cumsum(seqlens)[:-1]])
        return [(seg["shard"], seg["key"], Segment(key, int(n), int(targets[s:s + n].sum()), len(seg["media"]),
                                                   sum(int(m["tokens"]) for m in seg["media"])))
                for seg, s, n in zip(segs, starts, seqlens)]
    except Exception:
        return []


# -- the whole output -----------------------------------------------------------------------------------------
@dataclass
class Found:
    """What the tars hold: per split, every segment by (shard, key), and the pack count."""

    segments: dict[str, dict[tuple[str, str], list[Segment]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    packs: Counter = field(default_factory=Counter)
    indexes: dict = field(default_factory=dict)


def verify_output(output: str | Path, *, source: str | Path | None = None) -> list[str]:
    """Every check; see the module docstring."""
    out = Path(output)
    meta = out / ".nv-meta"
    try:
        manifest = _load(meta / "packtool.json", json.loads)
    except MetadataError as exc:
        return [f"{exc} (not a packtool output, or the run did not finish)"]
    problems: list[str] = []
    found = Found()
    shards: list[str] = []
    if not manifest.get("dry_run"):
        try:
            info = _load(meta / ".info.json", json.loads)
            splits = _load(meta / "split.yaml", yaml.safe_load).get("split_parts") or {}
        except MetadataError as exc:
            return [str(exc)]
        shards = [s for ss in splits.values() for s in ss]
        counts = info.get("shard_counts", {})
        if list(counts) != shards:
            problems.append(f".info.json lists {list(counts)}, split.yaml {shards}")
        tokens = _token_check(out, manifest, problems)
        for split, split_shards in splits.items():
            for shard in split_shards:
                problems += _check_shard(out, split, shard, counts.get(shard), manifest, tokens, found)
        problems += _check_sqlite(meta / "index.sqlite", shards, found.indexes)
    problems += _check_ledger(out, manifest, found)
    if source is not None:
        from packtool.verify_source import check_against_source

        problems += check_against_source(out, Path(source), manifest)
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more"]
    return problems


def _token_check(out: Path, manifest: dict, problems: list[str]) -> TokenCheck | None:
    tok_dir = out / (manifest.get("tokenizer") or {}).get("dir", ".nv-meta/tokenizer")
    if not (tok_dir / "tokenizer.json").exists():
        problems.append(f"{tok_dir.relative_to(out)}: no tokenizer.json (readers need it; token ids unchecked)")
        return None
    try:
        return TokenCheck(tok_dir, manifest.get("image_token_id"))
    except Exception as exc:
        problems.append(f"{tok_dir.relative_to(out)}: unreadable tokenizer ({type(exc).__name__}: {exc})")
        return None


def _check_shard(out: Path, split: str, shard: str, count: int | None, manifest: dict, tokens: TokenCheck | None,
                 found: Found) -> list[str]:
    """Problems of one shard: its tar, ``.tar.idx``, ``.info.json`` count and every record in it."""
    path = out / shard
    if not path.exists():
        return [f"{shard}: missing"]
    try:
        index = index_tar(path)
    except Exception as exc:
        return [f"{shard}: unreadable tar ({exc})"]
    found.indexes[shard] = index
    problems = []
    if count != len(index):
        problems.append(f"{shard}: .info.json says {count} samples, the tar holds {len(index)}")
    problems += _check_idx(path, shard, index)
    segments: list = []
    for key, parts in scan_records(path):
        found.packs[split] += 1
        if not key.startswith(f"{split}-"):
            problems.append(f"{shard}: record {key} does not belong to split {split}")
        problems += check_pack(key, parts, manifest, segments)
        for src_shard, src_key, seg in _segment_facts(key, parts):
            found.segments[split][(src_shard, src_key)].append(seg)
        if tokens is not None and len(segments) >= 256:
            problems += tokens.problems(segments)
            segments = []
    if tokens is not None:
        problems += tokens.problems(segments)
    return problems


def _check_idx(path: Path, shard: str, index: list) -> list[str]:
    idx_path = path.with_name(path.name + ".idx")
    if not idx_path.exists():
        return [f"{shard}.idx: missing"]
    data = idx_path.read_bytes()
    expect = [r.offset for r in index] + ([index[-1].offset + index[-1].size] if index else [0])
    if len(data) % 8 or np.frombuffer(data, dtype=np.uint64).tolist() != expect:
        return [f"{shard}.idx: offsets do not match the tar"]
    return []


def _check_sqlite(path: Path, shards: list[str], indexes: dict) -> list[str]:
    if not path.exists():
        return ["index.sqlite: missing"]
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM samples "
                           "ORDER BY tar_file_id, sample_index").fetchall()
        parts = con.execute("SELECT tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size "
                            "FROM sample_parts ORDER BY tar_file_id, sample_index, content_byte_offset").fetchall()
    except sqlite3.Error as exc:
        return [f"index.sqlite: unreadable ({exc})"]
    finally:
        con.close()
    index_of = [(fid, indexes.get(s, [])) for fid, s in enumerate(shards)]
    problems = []
    if rows != [(fid, r.key, i, r.offset, r.size) for fid, idx in index_of for i, r in enumerate(idx)]:
        problems.append("index.sqlite: samples table does not match the tars")
    if parts != [(fid, i, p, o, n) for fid, idx in index_of for i, r in enumerate(idx) for p, o, n in r.parts]:
        problems.append("index.sqlite: sample_parts table does not match the tars")
    return problems


def _check_ledger(out: Path, manifest: dict, found: Found) -> list[str]:
    """Every ledger row against the packs: kept samples lie exactly once in their pack with the recorded
    lengths; the others lie nowhere and have a reason; the manifest's counts match."""
    try:
        ledger = read_ledger(out).to_pylist()
    except Exception as exc:
        return [f"ledger.parquet: unreadable ({exc})"]
    problems = []
    kept: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in ledger:
        where = f"ledger: {r['shard']}/{r['key']}"
        if r["status"] not in STATUSES:
            problems.append(f"{where} has unknown status {r['status']!r}")
        elif r["status"] in KEPT:
            kept[(r["split"], r["shard"], r["key"])].append(r)
        elif not r["reason"]:
            problems.append(f"{where} is {r['status']} without a reason")
    if not manifest.get("dry_run"):
        problems += _check_placement(kept, found)
    problems += _check_counts(ledger, manifest, found)
    return problems


def _check_placement(kept: dict[tuple[str, str, str], list[dict]], found: Found) -> list[str]:
    problems = []
    for (split, shard, key), rows in kept.items():
        where = f"{shard}/{key}"
        segs = found.segments[split].get((shard, key), [])
        if len(rows) > 1:
            problems.append(f"ledger: {where} is kept {len(rows)} times")
            continue
        r = rows[0]
        if [s.pack for s in segs] != [r["pack"]]:
            problems.append(f"ledger: {where} should be in {r['pack']}, found in {[s.pack for s in segs] or None}")
            continue
        held = (segs[0].tokens, segs[0].targets, segs[0].images, segs[0].image_tokens)
        recorded = (r["tokens"], r["targets"], r["images"], r["image_tokens"])
        if held != recorded:
            problems.append(f"{r['pack']}/{key}: tokens, targets, images, image tokens {held} in the pack, "
                            f"{recorded} in the ledger")
    for split, segments in found.segments.items():
        for (shard, key), segs in segments.items():
            if (split, shard, key) not in kept:
                problems.append(f"{segs[0].pack}: segment {shard}/{key} is not a kept sample of the ledger")
    return problems


def _check_counts(ledger: list[dict], manifest: dict, found: Found) -> list[str]:
    problems = []
    for split, c in manifest.get("counts", {}).items():
        statuses = Counter(r["status"] for r in ledger if r["split"] == split)
        got = {"samples": sum(statuses.values()), **{s: statuses[s] for s in STATUSES}}
        if {k: c.get(k) for k in got} != got:
            problems.append(f"manifest counts {c} for {split}, the ledger {got}")
    if not manifest.get("dry_run"):
        for split, n in (manifest.get("packs") or {}).items():
            if found.packs[split] != n:
                problems.append(f"manifest says {n} packs for {split}, the shards hold {found.packs[split]}")
    return problems
