"""``packtool pack``: scan + encode per source shard, plan per split, write per output shard, then metadata.

Every stage commits its results atomically under ``OUTPUT/.packtool/`` (encode) or under their final names
(shards), and the manifest ``.nv-meta/packtool.json`` is written last: a rerun with the same settings skips what
is committed and finishes the job; the bytes never depend on workers, engine or interruptions.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packtool import __version__
from packtool.encode import TOKENIZER_FILES, EncodeSettings, get_encoder, tokenizer_fingerprint
from packtool.engine import run_tasks
from packtool.ledger import LEDGER_SCHEMA, STATUSES
from packtool.plan import balance_dp, pack_lengths
from packtool.sources import SourceError, open_source, read_raw_samples
from packtool.sources.safepickle import load_bytes_list
from packtool.write import IndexedSample, atomic_write, index_tar, npy_bytes, write_energon_meta, write_tar

WORK = ".packtool"
#: Raw bytes of source samples held at once by an encode task (at most 256 samples, fewer if media are large).
CHUNK_BYTES = 64 * 2**20
MANIFEST = ".nv-meta/packtool.json"
#: Columns of an encoded source shard (``samples.parquet``), one row per sample in on-disk order.
ENCODED_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("status", pa.string()), ("reason", pa.string()),
    ("tokens", pa.int32()), ("source_tokens", pa.int32()), ("targets", pa.int32()), ("images", pa.int32()),
    ("image_tokens", pa.int32()), ("truncated", pa.bool_()), ("tok_offset", pa.int64()), ("media", pa.string()),
])


class PackError(ValueError):
    """The job cannot run as asked (one clear line for the user)."""


@dataclass(frozen=True)
class PackSettings:
    """Every setting that changes the output bytes (workers and engine do not)."""

    encode: EncodeSettings
    splits: tuple[str, ...] = ()
    algorithm: str = "bfd"
    balanced_delta: int = 0
    max_segments: int | None = None
    seed: int = 0
    #: ``"512MB"``-style byte size or a plain pack count per output shard.
    shard_size: str = "512MB"
    balance_dp: int | None = None
    strict: bool = False
    dry_run: bool = False

    def fingerprint(self) -> dict:
        """The settings that decide the bytes, as JSON values (tuples become lists) so a stamp read back compares
        equal. ``strict`` (stop or go on) and ``dry_run`` (stop after planning) do not change what gets written:
        a strict run may be resumed without it, and a dry run may be finished by a full one."""
        d = asdict(self)
        d["encode"]["tokenizer"] = tokenizer_fingerprint(self.encode.tokenizer)
        del d["strict"], d["dry_run"]
        return json.loads(json.dumps(d))


@dataclass
class PackResult:
    """What a run did, for the CLI to report."""

    output: Path
    counts: dict = field(default_factory=dict)
    packs: dict = field(default_factory=dict)
    #: Seconds per stage of this invocation (scan+encode, plan, write, finalize).
    seconds: dict = field(default_factory=dict)


def parse_shard_size(text: str) -> tuple[str, int]:
    """``"1000"`` -> ("packs", 1000); ``"512MB"`` -> ("bytes", 512·2^20)."""
    t = str(text).strip().upper().replace(" ", "")
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, "B": 1}
    for suffix, mult in units.items():
        if t.endswith(suffix) and t[: -len(suffix)].replace(".", "", 1).isdigit():
            return "bytes", max(1, int(float(t[: -len(suffix)]) * mult))
    if t.isdigit() and int(t) > 0:
        return "packs", int(t)
    raise PackError(f"--shard-size must be a pack count or a size like 512MB, got {text!r}")


# -- stage 1: scan + encode one source shard ----------------------------------------------------------------
def encode_shard(root: str, shard: str, excluded: frozenset, settings: EncodeSettings, dataset_yaml: dict,
                 strict: bool, out_dir: str) -> dict:
    """Encode every sample of one shard into ``out_dir`` (``samples.parquet``, ``tokens.npy``, ``targets.npy``).

    The folder appears atomically (written under a temporary name, then renamed). Returns status counts.
    """
    out = Path(out_dir)
    if (out / "samples.parquet").exists():
        return _status_counts(pq.read_table(out / "samples.parquet", columns=["status"]))
    encoder = get_encoder(settings, dataset_yaml)
    rows, encoded, chunk, chunk_bytes = [], [], [], 0
    unreadable = None
    samples = read_raw_samples(Path(root), shard, excluded)
    while True:
        try:
            raw = next(samples)
        except StopIteration:
            break
        except SourceError as exc:
            if strict:
                raise
            unreadable = str(exc)
            break
        chunk.append(raw)
        chunk_bytes += sum(len(v) for v in raw.parts.values())
        if len(chunk) >= 256 or chunk_bytes >= CHUNK_BYTES:  # a chunk's raw bytes stay bounded, whatever the media
            encoded += encoder.encode_many(chunk, strict=strict)
            chunk, chunk_bytes = [], 0
    encoded += encoder.encode_many(chunk, strict=strict)
    offset = 0
    for e in encoded:
        keep = e.status in ("packed", "truncated")
        rows.append({
            "key": e.key, "shard": e.shard, "status": e.status, "reason": e.reason,
            "tokens": len(e.tokens) if keep else 0, "source_tokens": e.source_tokens,
            "targets": int(e.targets.sum()) if keep else 0, "images": len(e.media) if keep else 0,
            "image_tokens": sum(m["tokens"] for m in e.media) if keep else 0,
            "truncated": e.status == "truncated", "tok_offset": offset if keep else -1,
            "media": json.dumps(e.media if keep else [], separators=(",", ":")),
        })
        offset += len(e.tokens) if keep else 0
    if unreadable is not None:
        rows.append({"key": f"#unreadable-after-{len(encoded)}", "shard": shard, "status": "error",
                     "reason": unreadable, "tokens": 0, "source_tokens": 0, "targets": 0, "images": 0,
                     "image_tokens": 0, "truncated": False, "tok_offset": -1, "media": "[]"})
    kept = [e for e in encoded if e.status in ("packed", "truncated")]
    tokens = np.concatenate([e.tokens for e in kept]).astype(np.int32) if kept else np.zeros(0, np.int32)
    targets = np.concatenate([e.targets for e in kept]).astype(np.uint8) if kept else np.zeros(0, np.uint8)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    atomic_write(tmp / "tokens.npy", npy_bytes(tokens))
    atomic_write(tmp / "targets.npy", npy_bytes(targets))
    table = pa.Table.from_pylist(rows, schema=ENCODED_SCHEMA)
    pq.write_table(table, tmp / "samples.parquet")
    with open(tmp / "samples.parquet", "rb") as f:
        os.fsync(f.fileno())
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return _status_counts(table)


def _status_counts(table: pa.Table) -> dict:
    statuses = table.column("status").to_pylist()
    return {s: statuses.count(s) for s in STATUSES}


# -- stage 2: plan one split -----------------------------------------------------------------------------------
@dataclass
class SplitPlan:
    """The packs of one split and the output shards they go to."""

    split: str
    #: Encoded rows of the split (concatenated over its source shards, on-disk order), with ``src`` (source
    #: shard position) and ``row`` (row in that shard's table).
    table: pa.Table
    #: Pack number (in output order) of each row; -1 if not packed.
    pack: np.ndarray
    #: Output shard of each pack.
    shard_of_pack: np.ndarray


def plan_split(split: str, enc_dirs: list[Path], settings: PackSettings) -> SplitPlan:
    """Load the split's encoded rows, pack them globally, order packs, cut them into output shards."""
    tables = []
    for src, d in enumerate(enc_dirs):
        t = pq.read_table(d / "samples.parquet")
        n = t.num_rows
        tables.append(t.append_column("src", pa.array(np.full(n, src, np.int32)))
                      .append_column("row", pa.array(np.arange(n, dtype=np.int32))))
    table = pa.concat_tables(tables) if tables else ENCODED_SCHEMA.empty_table()
    status = np.asarray(table.column("status").to_pylist() if table.num_rows else [], dtype=object)
    keep = np.flatnonzero((status == "packed") | (status == "truncated"))
    pack = np.full(table.num_rows, -1, dtype=np.int64)
    if keep.size == 0:
        return SplitPlan(split, table, pack, np.zeros(0, np.int64))
    lengths = table.column("tokens").to_numpy()[keep].astype(np.int64)
    images = table.column("images").to_numpy()[keep].astype(np.int64)
    image_tokens = table.column("image_tokens").to_numpy()[keep].astype(np.int64)
    enc = settings.encode
    ids = pack_lengths(
        lengths, enc.pack_size, algorithm=settings.algorithm, align=enc.align,
        max_segments=settings.max_segments, images=images, max_images=enc.max_images,
        image_tokens=image_tokens, max_image_tokens=enc.max_image_tokens, seed=settings.seed,
        balanced_delta=settings.balanced_delta,
    )
    n_packs = int(ids.max()) + 1
    if settings.balance_dp and settings.balance_dp > 1:
        order = np.asarray(balance_dp(ids, lengths, settings.balance_dp, align=enc.align, seed=settings.seed),
                           dtype=np.int64)
    else:
        # Packs in order of their first item (on-disk order of the source): stable and easy to audit.
        first = np.full(n_packs, len(ids), dtype=np.int64)
        np.minimum.at(first, ids, np.arange(len(ids)))
        order = np.argsort(first, kind="stable")
    rank = np.empty(n_packs, dtype=np.int64)
    rank[order] = np.arange(n_packs)
    pack[keep] = rank[ids]
    kind, size = parse_shard_size(settings.shard_size)
    if kind == "packs":
        shard_of_pack = np.arange(n_packs) // size
    else:
        media_bytes = np.asarray([sum(m["size"] + 1024 for m in json.loads(s)) for s in
                                  table.column("media").to_pylist()], dtype=np.int64)[keep]
        est = np.zeros(n_packs, dtype=np.int64)
        np.add.at(est, pack[keep], lengths * 5 + media_bytes + 512)
        est += 4096
        shard_of_pack = np.zeros(n_packs, dtype=np.int64)
        cur, acc = 0, 0
        for p in range(n_packs):
            if acc and acc + est[p] > size:
                cur, acc = cur + 1, 0
            shard_of_pack[p] = cur
            acc += est[p]
    return SplitPlan(split, table, pack, shard_of_pack)


# -- stage 3: write one output shard ---------------------------------------------------------------------------
#: Columns of a write task's segment table (``pack`` first), in the order :func:`_pack_record` unpacks them.
SEGMENT_COLUMNS = ("pack", "src", "row", "key", "shard", "truncated", "tok_offset", "tokens", "media")


class _NpyReader:
    """Slices of a 1-D ``.npy`` file by positioned reads: unlike a memory map, what was read does not stay in
    the process's resident memory."""

    def __init__(self, path: Path):
        self.file = open(path, "rb")
        version = np.lib.format.read_magic(self.file)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        _, _, self.dtype = read_header(self.file)
        self.start = self.file.tell()

    def __getitem__(self, s: slice) -> np.ndarray:
        size = self.dtype.itemsize
        data = os.pread(self.file.fileno(), (s.stop - s.start) * size, self.start + s.start * size)
        return np.frombuffer(data, self.dtype)


def write_shard(out_path: str, split: str, root: str, enc_dirs: list[str], segments: pa.Table,
                pack_size: int, align: int) -> list[IndexedSample]:
    """Write the packs of one output shard. ``segments``: :data:`SEGMENT_COLUMNS`, sorted by pack, then source
    order. Returns the shard's record index; a shard already committed is indexed, not rewritten."""
    path = Path(out_path)
    if path.exists() and path.with_name(path.name + ".idx").exists():
        return index_tar(path)
    readers: dict[int, tuple[_NpyReader, _NpyReader]] = {}
    files: dict[str, object] = {}

    def arrays(src: int):
        if src not in readers:
            readers[src] = (_NpyReader(Path(enc_dirs[src]) / "tokens.npy"),
                            _NpyReader(Path(enc_dirs[src]) / "targets.npy"))
        return readers[src]

    def media_bytes(shard: str, m: dict) -> bytes:
        if shard not in files:
            files[shard] = open(Path(root) / shard, "rb")
        f = files[shard]
        f.seek(m["offset"])
        data = f.read(m["size"])
        if len(data) != m["size"]:
            raise OSError(f"{shard}: short read of {m['part']}")
        return data if m["item"] is None else load_bytes_list(data)[m["item"]]

    def rows():  # a batch of rows at a time as Python values
        for batch in segments.to_batches(max_chunksize=1024):
            yield from zip(*(batch.column(c).to_pylist() for c in SEGMENT_COLUMNS))

    def records():
        for p, group in itertools.groupby(rows(), key=lambda row: row[0]):
            yield _pack_record(split, p, list(group), arrays, media_bytes, pack_size, align)

    try:
        index = write_tar(path, records())
    finally:
        for f in [*files.values(), *(r.file for pair in readers.values() for r in pair)]:
            f.close()
    return index


def pack_key(split: str, number: int) -> str:
    return f"{split}-{number:09d}"


def _pack_record(split, number, group, arrays, media_bytes, pack_size, align):
    toks, tgts, seqlens, segs, members = [], [], [], [], []
    m_index = 0
    for _, src, _, key, shard, truncated, tok_offset, length, media_json in group:
        tok, tgt = arrays(src)
        toks.append(np.asarray(tok[tok_offset: tok_offset + length]))
        tgts.append(np.asarray(tgt[tok_offset: tok_offset + length]))
        seqlens.append(length)
        media_meta = []
        for m in json.loads(media_json):
            member = f"m{m_index}.{m['ext']}"
            m_index += 1
            members.append((member, media_bytes(shard, m)))
            media_meta.append({"member": member, "kind": m["kind"], "token_offset": m["token_offset"],
                               "tokens": m["tokens"], "grid_thw": m["grid_thw"], "width": m["width"],
                               "height": m["height"]})
        segs.append({"key": key, "split": split, "shard": shard, "truncated": bool(truncated),
                     "media": media_meta})
    meta = {"pack_size": pack_size, "align": align, "packtool": __version__, "segments": segs}
    parts = [
        ("tokens.npy", npy_bytes(np.concatenate(toks).astype(np.int32))),
        ("targets.npy", npy_bytes(np.concatenate(tgts).astype(np.uint8))),
        ("seqlens.npy", npy_bytes(np.asarray(seqlens, dtype=np.int32))),
        ("json", json.dumps(meta, separators=(",", ":")).encode()),
    ] + members
    return pack_key(split, number), parts


# -- the verb ----------------------------------------------------------------------------------------------------
def _check_output(output: Path, fingerprint: dict, overwrite: bool):
    """Refuse an OUTPUT made with other settings (unless ``overwrite``) or being written by another run; start or
    resume otherwise. Returns the open lock file, held (``flock``) until the caller closes it."""
    import fcntl

    stamp = output / WORK / "settings.json"
    manifest = output / MANIFEST
    ours = stamp.exists() or manifest.exists() or (output / WORK).is_dir()
    if output.exists() and not ours and any(output.iterdir()) and not overwrite:
        raise PackError(f"{output} exists and was not made by packtool; pass --overwrite to replace it")
    (output / WORK).mkdir(parents=True, exist_ok=True)
    lock = open(output / WORK / "lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise PackError(f"another packtool run is writing {output}") from None
    previous = None
    if stamp.exists():
        previous = json.loads(stamp.read_text())
    elif manifest.exists():
        previous = json.loads(manifest.read_text()).get("fingerprint")
    committed = manifest.exists() or any((output / WORK / "encode").glob("*/*/samples.parquet"))
    if previous is not None and previous != fingerprint and not committed:
        overwrite = True  # an earlier run stopped before committing anything: nothing to protect
    if previous is not None and previous != fingerprint and not overwrite:
        lock.close()
        raise PackError(f"{output} was packed with other settings ({'; '.join(_changes(previous, fingerprint))}); "
                        f"pass --overwrite to replace it")
    if overwrite and (previous is None or previous != fingerprint):
        for child in output.iterdir():  # everything but the lock we hold
            if child.name == WORK:
                for inner in child.iterdir():
                    if inner.name != "lock":
                        shutil.rmtree(inner) if inner.is_dir() else inner.unlink()
            else:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    if not stamp.exists():
        atomic_write(stamp, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
    return lock


def _changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``name: old -> new`` for each setting that differs (nested ones as ``encode.pack_size``)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:12] + "…" + text[-8:]


#: A temporary file or folder (``.NAME.tmpPID``, ``NNNNNN.tmpPID``, ``.NAME.tmp``): what a commit renames.
_TEMPORARY = re.compile(r"\.tmp\d*$")


def _remove_temporaries(output: Path) -> None:
    """Remove what interrupted runs left under temporary names (any process id). Every file and folder is
    committed by a rename from such a name, so none of them is part of the output."""
    for root, dirs, files in os.walk(output):
        for name in [d for d in dirs if _TEMPORARY.search(d)]:
            shutil.rmtree(Path(root, name), ignore_errors=True)
            dirs.remove(name)
        for name in files:
            if _TEMPORARY.search(name):
                Path(root, name).unlink(missing_ok=True)


def pack(source: str | Path, output: str | Path, settings: PackSettings, *, workers: int = 1,
         engine: str = "local", ray_address: str | None = None, overwrite: bool = False,
         progress: bool = True) -> PackResult:
    """Pack every requested split of ``source`` into ``output`` (see the module docstring)."""
    import time

    from importlib.metadata import version

    clock = {"start": time.perf_counter()}

    def lap(stage: str) -> None:
        now = time.perf_counter()
        clock[stage] = now - clock.pop("last", clock["start"])
        clock["last"] = now

    source, output = Path(source).resolve(), Path(output).resolve()
    src = open_source(source, list(settings.splits) or None)
    for split in src.splits:
        if not split or "." in split or "/" in split:
            raise PackError(f"split name {split!r} cannot name packs (no dots or slashes)")
    fingerprint = settings.fingerprint()
    fingerprint["source"] = str(source)
    get_encoder(settings.encode, src.dataset_yaml)  # fail fast on a bad tokenizer folder, before OUTPUT is touched
    with _check_output(output, fingerprint, overwrite):  # holds the OUTPUT lock until the run ends
        _remove_temporaries(output)
        manifest_path = output / MANIFEST
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            if settings.dry_run or not manifest.get("dry_run"):
                return PackResult(output, manifest.get("counts", {}), manifest.get("packs", {}))
            manifest_path.unlink()  # a dry run's output, now finished by a full run on the same encode work

        enc_root = output / WORK / "encode"
        enc_dirs = {split: [enc_root / split / f"{i:06d}" for i in range(len(shards))]
                    for split, shards in src.splits.items()}
        tasks = [(str(source), shard, src.excluded_samples, settings.encode, src.dataset_yaml, settings.strict,
                  str(enc_dirs[split][i])) for split, shards in src.splits.items() for i, shard in enumerate(shards)]
        run_tasks(encode_shard, tasks, workers=workers, engine=engine, ray_address=ray_address,
                  desc="scan+encode", unit="shard", progress=progress)
        lap("scan+encode")

        plans = {split: plan_split(split, enc_dirs[split], settings) for split in src.splits}
        for split, plan in plans.items():
            _check_packable(split, plan, settings)
        lap("plan")

        out_shards: dict[str, list[str]] = {}
        write_tasks = []
        for split, plan in plans.items():
            n_shards = int(plan.shard_of_pack.max()) + 1 if plan.shard_of_pack.size else 0
            out_shards[split] = [f"{split}/pack-{k:06d}.tar" for k in range(n_shards)]
            if settings.dry_run or not n_shards:
                continue
            rows = np.flatnonzero(plan.pack >= 0)
            rows = rows[np.lexsort((rows, plan.pack[rows]))]
            bounds = np.searchsorted(plan.shard_of_pack[plan.pack[rows]], np.arange(n_shards + 1))
            table = plan.table.append_column("pack", pa.array(plan.pack)).select(SEGMENT_COLUMNS)
            for k in range(n_shards):  # each task gets a compact table of its own rows, no Python object per row
                write_tasks.append((str(output / out_shards[split][k]), split, str(source),
                                    [str(d) for d in enc_dirs[split]], table.take(rows[bounds[k]:bounds[k + 1]]),
                                    settings.encode.pack_size, settings.encode.align))
        written = run_tasks(write_shard, write_tasks, workers=workers, engine=engine, ray_address=ray_address,
                            desc="write", unit="shard", progress=progress)
        lap("write")

        counts, packs = _write_ledger(output, plans)
        if not settings.dry_run:
            indexes = dict(zip((s for shards in out_shards.values() for s in shards), written))  # tasks in this order
            write_energon_meta(output, {k: v for k, v in out_shards.items() if v}, indexes,
                               version("megatron-energon"))
            _copy_tokenizer(Path(settings.encode.tokenizer), output / ".nv-meta" / "tokenizer")
        encoder = get_encoder(settings.encode, src.dataset_yaml)
        manifest = {
            "packtool": __version__,
            "format": 1,
            "fingerprint": fingerprint,
            "settings": {**asdict(settings.encode), **{k: v for k, v in asdict(settings).items()
                                                       if k not in ("encode", "strict", "dry_run")},
                         "tokenizer": Path(settings.encode.tokenizer).name},
            "source": str(source),
            "splits": {k: v for k, v in out_shards.items()},
            "tokenizer": {"fingerprint": tokenizer_fingerprint(settings.encode.tokenizer), "dir": ".nv-meta/tokenizer"},
            "pad_token_id": _pad_id(encoder.tok),
            "eos_token_id": encoder.tok.eos_token_id,
            "image_token_id": encoder.image_token_id,
            "vision_start_token_id": encoder.vision_start_id,
            "vision_end_token_id": encoder.vision_end_id,
            "image_processor": encoder.rule.manifest() if encoder.rule else None,
            "seed": settings.seed,
            "counts": counts,
            "packs": packs,
            "dry_run": settings.dry_run,
        }
        atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
        if not settings.dry_run:  # the job is complete: the encoded copies of every token are no longer needed
            shutil.rmtree(enc_root, ignore_errors=True)
        lap("finalize")
        return PackResult(output, counts, packs, {k: v for k, v in clock.items() if k not in ("start", "last")})


def _pad_id(tok) -> int:
    for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _check_packable(split: str, plan: SplitPlan, settings: PackSettings) -> None:
    """A split whose every encodable sample was dropped means the pack size is too small for this data."""
    status = plan.table.column("status").to_pylist()
    if status and all(s == "dropped" for s in status if s != "error") and "dropped" in status:
        need = [r for s, r in zip(status, plan.table.column("reason").to_pylist()) if s == "dropped"][0]
        raise PackError(f"split {split!r}: --pack-size {settings.encode.pack_size} is smaller than any sample "
                        f"can be truncated to (first: {need})")


def _write_ledger(output: Path, plans: dict[str, SplitPlan]) -> tuple[dict, dict]:
    """Write ``ledger.parquet`` (one row per source sample) and return counts per split and status."""
    tables, counts, packs = [], {}, {}
    for split, plan in plans.items():
        t = plan.table
        n = t.num_rows
        # pack_key() of every packed row, null for the others, computed by Arrow (no Python string per row).
        number = pc.utf8_lpad(pc.cast(pa.array(plan.pack, mask=plan.pack < 0), pa.string()), 9, "0")
        pack_col = pc.binary_join_element_wise(pa.scalar(f"{split}-"), number, "")
        ledger = pa.table({
            "key": t.column("key"), "split": pa.array([split] * n, pa.string()), "shard": t.column("shard"),
            "status": t.column("status"), "reason": t.column("reason"), "tokens": t.column("tokens"),
            "targets": t.column("targets"), "images": t.column("images"), "image_tokens": t.column("image_tokens"),
            "pack": pack_col, "source_tokens": t.column("source_tokens"),
        }, schema=LEDGER_SCHEMA)
        tables.append(ledger)
        statuses = {v["values"]: v["counts"] for v in pc.value_counts(t.column("status")).to_pylist()}
        counts[split] = {"samples": n, **{s: statuses.get(s, 0) for s in STATUSES}}
        packs[split] = int(plan.pack.max()) + 1 if n and plan.pack.max() >= 0 else 0
    table = pa.concat_tables(tables) if tables else LEDGER_SCHEMA.empty_table()
    tmp = output / ".ledger.parquet.tmp"
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output / "ledger.parquet")
    return counts, packs


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            atomic_write(dst / name, (src / name).read_bytes())
