"""``packtool verify`` with a source: re-derive every sample from the source and compare it with the packs.

One task per source shard (in parallel, like ``pack``'s encode stage). A task reads its shard as a stream (a chunk
of samples at a time), reads only its own ledger rows, and finds each sample's pack through ``index.sqlite``, so
memory does not grow with the dataset. A shard whose tail cannot be read (or that holds fewer samples than the
source's ``.info.json`` counts) must have the matching ``#unreadable-after-N`` ledger row; a key repeated in a
shard is matched to the ledger row of the same occurrence.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from packtool.errors import FormatError, SourceError
from packtool.format import KEPT, LEDGER, META, TOKENIZER_DIR, InfoJson, Manifest, PackRecord
from packtool.item import MediaItem
from packtool.packer.encoder import Encoded, get_encoder
from packtool.packer.engine import Engine
from packtool.packer.holdout import VAL
from packtool.packer.mixing import NOT_DRAWN
from packtool.packer.sources import open_source
from packtool.packer.sources.energon import ShardScan
from packtool.packer.sources.files import FileChunk, FileSource, open_files
from packtool.packer.sources.safepickle import load_bytes_list, video_frames
from packtool.packer.store import UNREADABLE, ChunkScan
from packtool.settings import EncodeSettings, recorded_settings
from packtool.storage import local_copy, location, open_read, read_parquet

CHUNK = 256
MAX_PER_SHARD = 200
#: Facts of a media item compared with a fresh encoding's (those the encoding gives: ``samples`` for audio,
#: ``frame_indices`` for video).
RECORDED = ("token_offset", "tokens", "span", "grid_thw", "frame_indices", "samples")


def _plain(value: object) -> object:
    """Lists and tuples alike (a record's lists against an encoding's tuples)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _settings(out: Path, manifest: Manifest) -> EncodeSettings:
    kw = recorded_settings(manifest.settings)
    kw["tokenizer"] = str(local_copy(out / TOKENIZER_DIR))
    return EncodeSettings(**kw)


def check_against_source(out: Path, source: Path | FileSource, manifest: Manifest, engine: Engine) -> list[str]:
    """Problems found by re-encoding the source: missing or extra samples, changed tokens, targets or media."""
    # The source's splits packed: a held-out validation split comes from train, not from the source's own.
    splits = [s for s in manifest.counts if not (s == VAL and manifest.settings.get("holdout"))]
    try:
        src = open_files(source, splits) if isinstance(source, FileSource) else open_source(source, splits)
    except SourceError as exc:
        return [f"source: {exc}"]
    shards = [s for ss in src.splits.values() for s in ss]
    chunks = src.chunks
    tasks = [SourceShardCheck(str(out), str(src.root), shard, src.excluded_samples, src.yaml_of(shard),
                              src.shard_counts.get(shard), manifest, chunks.get(shard)) for shard in shards]
    problems = [p for found in engine.map(check_source_shard, tasks, desc="verify source", unit="shard",
                                          progress=False) for p in found]
    try:
        ledger_shards = read_parquet(out / LEDGER, columns=["shard"]).column("shard").unique().to_pylist()
    except Exception:
        return problems
    for shard in sorted(set(ledger_shards) - set(shards)):
        problems.append(f"{LEDGER}: rows of {shard}, which the source does not list")
    return problems


def _ledger_rows(out: Path, shard: str) -> dict[tuple[str, int], dict]:
    """The ledger rows of one source shard by (key, occurrence of that key in the shard)."""
    table = read_parquet(out / LEDGER, filters=pc.field("shard") == shard)
    rows: dict[tuple[str, int], dict] = {}
    seen: Counter[str] = Counter()
    for r in table.to_pylist():
        if r.get("copy"):  # a mixture's further copies of a sample: the packs' check covers them
            continue
        seen[r["key"]] += 1
        rows[(r["key"], seen[r["key"]])] = r
    return rows


@dataclass(frozen=True)
class SourceShardCheck:
    """The re-encode task of one source shard."""

    output: str
    root: str
    shard: str
    #: Samples the dataset excludes (``shard/key``).
    excluded: frozenset[str]
    dataset_yaml: dict
    #: The shard's sample count from the dataset's ``.info.json`` (None if unknown).
    expected: int | None
    manifest: Manifest
    #: The shard is a chunk of a file source (:class:`~packtool.packer.sources.files.FileChunk`).
    files: FileChunk | None = None


def check_source_shard(task: SourceShardCheck) -> list[str]:
    """Re-encode one source shard chunk by chunk and compare every sample with its ledger row and pack (a task)."""
    root, shard, excluded, dataset_yaml = task.root, task.shard, task.excluded, task.dataset_yaml
    expected, manifest = task.expected, task.manifest
    out = location(task.output)
    encoder = get_encoder(_settings(out, manifest), dataset_yaml)
    try:
        ledger = _ledger_rows(out, shard)
    except Exception:
        return []
    try:
        records = _RecordReader(out)
    except (FormatError, sqlite3.Error) as exc:
        return [f"{shard}: packs cannot be looked up ({exc})"]
    problems: list[str] = []
    occurrence: Counter = Counter()
    scan: ShardScan | ChunkScan = ShardScan(location(root), shard, excluded,
                                            max_sample_bytes=encoder.settings.max_sample_bytes) \
        if task.files is None else ChunkScan(task.files, None, encoder.settings.max_sample_bytes)
    samples = iter(scan)
    chunk, done, error = [], 0, None
    try:
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
                    row = ledger.pop((r.key, occurrence[r.key]), None)
                    problems += _compare(f"{shard}/{r.key}", r, enc, row, records)
                done, chunk = done + len(chunk), []
            if raw is None:
                break
    finally:
        records.close()
    tail = ledger.pop((f"{UNREADABLE}{done}", 1), None)
    short = expected is not None and scan.seen < expected
    if (error is not None or short) and tail is None:
        why = error or f"{scan.seen} samples, the source's .info.json counts {expected}"
        problems.append(f"{shard}: {why} (the ledger has no {UNREADABLE}{done} row for it)")
    elif error is None and not short and tail is not None:
        problems.append(f"{LEDGER}: {shard}/{UNREADABLE}{done} says the shard stops early, it reads to its end")
    for key, _ in list(ledger)[:MAX_PER_SHARD]:
        problems.append(f"{LEDGER}: {shard}/{key} is not in the source")
    return problems[:MAX_PER_SHARD] + ([f"{shard}: ... and {len(problems) - MAX_PER_SHARD} more"]
                                       if len(problems) > MAX_PER_SHARD else [])


def _compare(where: str, raw, enc, row: dict | None, records: _RecordReader) -> list[str]:
    if row is None:
        return [f"{where}: in the source, not in the ledger"]
    if row["status"] == "dropped" and str(row["reason"]).startswith(NOT_DRAWN):  # a mixture left it out
        return [] if enc.status in KEPT else [f"{where}: ledger says a mixture left it out, re-encoding gives "
                                              f"{enc.status}"]
    if row["status"] != enc.status:
        return [f"{where}: ledger says {row['status']}, re-encoding gives {enc.status}"]
    if enc.status not in KEPT:
        return []
    try:
        record, shard = records.get(row["pack"])
    except FormatError as exc:
        return [f"{where}: its pack {row['pack']} is unreadable ({exc})"]
    if record is None:
        return [f"{where}: its pack {row['pack']} is not in {META}/index.sqlite"]
    return _compare_segment(f"{shard}: pack {record.key} segment {raw.shard}/{raw.key}", raw, enc, record)


class _RecordReader:
    """Pack records by key, through ``index.sqlite`` (random access into the tars)."""

    def __init__(self, out: Path):
        self.out, self.shards = out, list(InfoJson.read(out).shard_counts)
        self.con = sqlite3.connect(f"file:{local_copy(out / META / 'index.sqlite')}?mode=ro", uri=True)
        self.get = lru_cache(maxsize=16)(self._read)

    def _read(self, pack_key: str) -> tuple[PackRecord | None, str]:
        hit = self.con.execute("SELECT tar_file_id, sample_index FROM samples WHERE sample_key=?",
                               (pack_key,)).fetchone()
        if hit is None or not 0 <= hit[0] < len(self.shards):
            return None, ""
        fid, index = hit
        members = {}
        with open_read(self.out / self.shards[fid]) as f:
            for part, off, size in self.con.execute(
                    "SELECT part_name, content_byte_offset, content_byte_size FROM sample_parts "
                    "WHERE tar_file_id=? AND sample_index=?", (fid, index)):
                f.seek(off)
                members[part] = f.read(size)
        return PackRecord.from_members(pack_key, members), self.shards[fid]

    def close(self) -> None:
        self.con.close()


def _compare_segment(where: str, raw, enc: Encoded, record: PackRecord) -> list[str]:
    starts = record.segment_starts()
    for seg, start, end in zip(record.segments, starts[:-1], starts[1:]):
        if seg.shard != raw.shard or seg.key != raw.key:
            continue
        problems = []
        if not np.array_equal(record.tokens[start:end], enc.tokens) or \
                not np.array_equal(record.targets[start:end], enc.targets):
            problems.append(f"{where}: tokens or targets differ from a fresh encoding")
        if len(seg.media) != len(enc.media):
            problems.append(f"{where}: {len(seg.media)} media in the pack, {len(enc.media)} in the source")
        for m, e in zip(seg.media, enc.media):
            packed, source = [record.media.get(n) for n in m.members], _source_members(raw, e)
            if packed != source:
                member = next((n for n, a, b in zip(m.members, packed, source) if a != b), m.member)
                problems.append(f"{where}: media {member} differs from source member {e.part}")
            fresh = {name: getattr(e, name) for name in RECORDED if getattr(e, name) is not None}
            differ = [name for name, value in fresh.items() if _plain(getattr(m, name)) != _plain(value)]
            if differ:
                problems.append(f"{where}: media {m.member}: {', '.join(differ)} differ from a fresh encoding "
                                f"({', '.join(f'{getattr(m, n)} vs {fresh[n]}' for n in differ)})")
        return problems
    return [f"{where}: not found in its pack"]


def _source_members(raw, e: MediaItem) -> list[bytes]:
    """The source bytes of each pack member of one encoded media item: the member (or the item of a pickled image
    list), or each frame of a frame list (numbered members, or a video of a pickled list)."""
    if e.frames and e.item is not None:
        return [frame for _, frame in video_frames(raw.parts[e.part], e.part, e.item)]
    if e.frames:
        return [raw.parts[f] for f, _, _ in e.frames]
    data = raw.parts[e.part]
    return [data if e.item is None else load_bytes_list(data)[e.item]]
