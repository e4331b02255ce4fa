"""``packtool pack``, the orchestration: scan + encode per source shard, plan per split, write per output shard,
then the ledger, Energon's metadata and the manifest, last.

Each stage commits its own results (:mod:`packtool.commit`); the manifest is written last, so an OUTPUT with a
manifest is complete and a rerun of an interrupted run finishes it with the same bytes, whatever the worker
count, the engine or where it was interrupted. SOURCE and OUTPUT may be object-store locations
(``msc://PROFILE/path``, :mod:`packtool.storage`): the same stages read by ranged requests and commit by whole
objects, the manifest still last.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool import __version__
from packtool.commit import commit_bytes, commit_path, temporary_name
from packtool.config import recorded_config
from packtool.errors import ConfigError, FormatError, SourceError
from packtool.format import (
    FORMAT_VERSION,
    MANIFEST,
    META,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    Manifest,
    check_split_name,
    shard_path,
    tokenizer_fingerprint,
    write_energon_metadata,
)
from packtool.packer.assemble import MIXTURE_COLUMNS, SEGMENT_COLUMNS, WriteTask, write_part, write_shard
from packtool.packer.engine import Engine
from packtool.packer.holdout import TRAIN, VAL, held_out
from packtool.packer.ledger import SplitFill, weight_summary, write_ledger
from packtool.packer.mixing import all_failed, dataset_loss_weights, repeat, repetitions, with_datasets, with_groups
from packtool.packer.output import WRITE, OutputDir, check_paths
from packtool.packer.sources import SourceDataset, open_source
from packtool.packer.sources.energon import ScanTask, ShardLayout, scan_layout
from packtool.packer.sources.files import (
    FileDataset,
    FileSource,
    chunk_digest,
    open_files,
    recorded_source,
    stamp_chunk,
)
from packtool.packer.split_plan import SplitPlan, load_encoded, plan_split
from packtool.packer.store import (
    EncodeTask,
    FailureLimits,
    SourceStamp,
    encode_range,
    shard_ranges,
)
from packtool.packer.workers import FactsTask, model_facts, pack_engine
from packtool.settings import PackSettings, RunOptions
from packtool.shards import ShardIndex, idx_path, index_tar, join_tar
from packtool.storage import is_remote, location, remove_tree, resolved


@dataclass
class PackResult:
    """What a run did, for the caller to report."""

    output: Path
    counts: dict = field(default_factory=dict)
    packs: dict = field(default_factory=dict)
    #: Seconds per stage of this invocation (scan+encode, plan, write, finalize).
    seconds: dict = field(default_factory=dict)
    #: ``(status, count, total, limit)`` for each ledger status above its limit (``RunOptions.limits``): the run
    #: wrote everything, and failed.
    over_limits: list = field(default_factory=list)
    #: Each split's fill, from the plans of this invocation (empty when it found the run already finished).
    fills: dict[str, SplitFill] = field(default_factory=dict)


class _Clock:
    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self.last
        self.last = now


def pack(source: str | Path | FileSource, output: str | Path, settings: PackSettings, run: RunOptions | None = None, *,
         started_engine: Engine | None = None, **options: object) -> PackResult:
    """Pack every requested split of ``source`` into ``output`` (see the module docstring). ``run`` (or its
    fields as keyword ``options``) says how the run goes. ``started_engine``: an entered engine from
    :func:`packtool.packer.workers.pack_engine` for the same source and settings, started early by the caller (by
    default the run starts its own once the source and settings check out).

    >>> pack("dataset", "packed", PackSettings(EncodeSettings(tokenizer="model", pack_size=8192)),
    ...      workers=2, progress=False)  # doctest: +SKIP
    """
    run = run or RunOptions(**options)  # type: ignore[arg-type]
    clock = _Clock()
    output = resolved(output)
    src = check_inputs(source, output, settings)
    source = src.root
    # A mixture is known by its file (its datasets' common folder changes as entries come and go; each shard's
    # own stamp says whether its encoding still holds).
    fingerprints = settings.fingerprints(src.mixture.path if src.mixture is not None else source,
                                         tokenizer_fingerprint(settings.encode.tokenizer))
    if src.mixture is not None:  # the declared proportions decide the output: other weights are another output
        fingerprints["output"]["mixture"] = json.loads(json.dumps(src.mixture.describe()))
    # The engine is up (Ray reached) and the model folder proven by a worker before OUTPUT is touched; the OUTPUT
    # lock outlives every worker.
    if started_engine is not None:
        return _pack(started_engine, src, output, settings, run, fingerprints, clock)
    with pack_engine(source, settings.encode, run) as own:
        return _pack(own, src, output, settings, run, fingerprints, clock)


def check_inputs(source: str | Path | FileSource, output: str | Path, settings: PackSettings) -> SourceDataset:
    """Every check that needs no sample, in a fraction of a second (the caller runs it before starting workers):
    the source's metadata and shards, OUTPUT's place, the model folder's files. Returns the opened source (a
    file source: OUTPUT and the model folder are checked first, then its records are found, see
    :func:`~packtool.packer.sources.files.open_files`)."""
    from packtool.packer.encoder import check_tokenizer_dir

    if isinstance(source, FileSource):
        assert source.path is not None
        check_paths(source.path.resolve(), resolved(output), location(settings.encode.tokenizer))
        if not is_remote(settings.encode.tokenizer):
            check_tokenizer_dir(settings.encode.tokenizer)
        files = open_files(source, list(settings.splits) or None)
        for split in files.splits:
            try:
                check_split_name(split)
            except FormatError as exc:
                raise ConfigError(str(exc)) from None
        return _check_holdout(files, settings)
    source, output = resolved(source), resolved(output)
    src = open_source(source, list(settings.splits) or None)
    check_paths(source, output, location(settings.encode.tokenizer))
    for entries in (src.mixture.splits.values() if src.mixture is not None else ()):
        for e in entries:  # every dataset of a mixture lies outside OUTPUT, and OUTPUT outside it
            check_paths(e.root, output)
    for split in src.splits:
        try:
            check_split_name(split)
        except FormatError as exc:
            raise ConfigError(str(exc)) from None
    if not is_remote(settings.encode.tokenizer):  # a model folder in an object store is fetched by the workers
        check_tokenizer_dir(settings.encode.tokenizer)
    return _check_holdout(src, settings)


def _check_holdout(src: SourceDataset, settings: PackSettings) -> SourceDataset:
    """A hold-out is taken from the source's ``train`` split, and never merged into a validation split the
    source already has."""
    if settings.holdout is None:
        return src
    if TRAIN not in src.splits:
        raise ConfigError(f"val_ratio/val_count hold samples out of the {TRAIN!r} split, and the source packs none "
                          f"(its splits: {', '.join(src.splits) or 'none'})")
    if VAL in src.splits:
        raise ConfigError(f"the source already has a {VAL!r} split; drop val_ratio/val_count, or pack only "
                          f"{TRAIN!r} (--split {TRAIN}) to hold a new one out of it")
    return src


def _pack(engine: Engine, src: SourceDataset, output: Path, settings: PackSettings, run: RunOptions,
          fingerprints: dict, clock: _Clock) -> PackResult:
    source = src.root
    facts = engine.map(model_facts, [FactsTask(settings.encode, src.dataset_yaml)], progress=False)[0]
    with OutputDir(output, fingerprints, overwrite=run.overwrite) as out:
        stamps = _stamps(engine, src, run)
        if out.drop_stale_encodings(stamps, src.splits):
            out.clear_output()  # a source shard changed since it was encoded: every plan is stale
        done = None if out.replacing else _finished(output, run)
        if done is not None:
            return done
        enc_dirs = _encode(engine, out, src, settings, run, stamps)
        clock.lap("scan+encode")
        tables = {split: load_encoded(enc_dirs[split]) for split in src.splits}
        names = src.mixture.names() if src.mixture is not None else []
        if names:  # each row's dataset, for the hold-out per dataset, the proportions and the segments
            tables = {split: with_datasets(t, src.dataset_of, names) for split, t in tables.items()}
            entries = src.mixture.splits if src.mixture is not None else {}
            for split, t in tables.items():
                failed = all_failed(t, names)
                if failed is not None and src.mixture is not None:
                    name, n, reason = failed
                    raise SourceError(f"{src.mixture.path}: split {split!r}, dataset {name}: all {n} of its samples "
                                      f"failed (first reason: {reason}); see `packtool failures {output}`, fix the "
                                      f"entry or remove it")
            tables = {split: with_groups(dataset_loss_weights(t, entries.get(split, []), names),
                                         entries.get(split, []), names) for split, t in tables.items()}
        if settings.holdout is not None:  # the validation split: some of train's encoded samples, its stores shared
            groups = tables[TRAIN].column("dataset").to_numpy() if names else None
            val = held_out(tables[TRAIN], settings.holdout, settings.plan.seed, groups)
            tables[VAL], tables[TRAIN] = tables[TRAIN].filter(val), tables[TRAIN].filter(~val)
            enc_dirs[VAL] = enc_dirs[TRAIN]
        reps: dict[str, dict[str, float]] = {}
        if src.mixture is not None:  # each of the mixture's splits in its declared proportions (a hold-out: once)
            for split in src.splits:
                times = repetitions(tables[split], src.mixture.splits[split], names)
                reps[split] = {names[i]: r for i, r in sorted(times.items())}
                tables[split] = repeat(tables[split], times, settings.plan.seed, names)
        plans = {split: plan_split(split, table, settings) for split, table in tables.items()}
        for split, plan in plans.items():
            _check_packable(split, plan, settings)
        clock.lap("plan")
        out.make_room()  # the output this run replaces goes only now, when its replacement is ready to write
        out_shards = {split: [shard_path(split, k) for k in range(plan.n_shards)] for split, plan in plans.items()}
        indexes = {} if run.dry_run else _write(engine, source, output, settings, run, plans, out_shards, enc_dirs,
                                                stamps, src.chunks,
                                                tuple(names))
        engine.release_workers()  # the last stage with tasks: the rest of the run is this process's alone
        clock.lap("write")
        counts, packs = write_ledger(output, plans, tuple(names))
        if not run.dry_run:
            write_energon_metadata(output, {k: v for k, v in out_shards.items() if v}, indexes,
                                   version("megatron-energon"))
            _copy_tokenizer(location(settings.encode.tokenizer), output / TOKENIZER_DIR)
        manifest = _manifest(settings, fingerprints, src.mixture.path if src.mixture is not None else source,
                             out_shards, counts, packs, run.dry_run, facts)
        if src.mixture is not None:
            manifest.mixture = {**src.mixture.describe(), "repetitions": reps}
        manifest.loss_weights = weight_summary(plans)
        if isinstance(src, FileDataset) and src.source is not None and manifest.run_config is not None:
            manifest.run_config.update(recorded_source(src.source))
        commit_bytes(output / MANIFEST, manifest.to_bytes())
        clock.lap("finalize")
        fills = {split: plan.fill(settings.encode.pack_size, settings.encode.align) for split, plan in plans.items()}
        return PackResult(output, counts, packs, clock.seconds, over_limits(counts, run), fills)


def _stamps(engine: Engine, src: SourceDataset, run: RunOptions) -> dict[str, SourceStamp]:
    """Each source shard's stamp. A file source's chunks are stamped by the workers (each record's bytes and
    each media file's stat, see :mod:`packtool.packer.sources.files`); ``src.chunks`` then hold their records'
    stamps, which the write stage checks each record against. A mixture has both kinds."""
    stamps = {s: SourceStamp.of(src.root, s, src.metadata_of(s)) for shards in src.splits.values() for s in shards
              if s not in src.chunks}
    names = list(src.chunks)
    if names:
        stamped = engine.map(stamp_chunk, [src.chunks[n] for n in names], desc="stamp", unit="chunk",
                             progress=run.progress, names=names)
        src.chunks.update(zip(names, stamped))
    stamps.update({n: SourceStamp(n, c.count, 0, 0, chunk_digest(c)) for n, c in src.chunks.items()})
    return stamps


def over_limits(counts: dict, run: RunOptions) -> list[tuple[str, int, int, float]]:
    """``(status, count, total, limit)`` for each status whose share of all splits' samples exceeds its limit."""
    total = sum(c["samples"] for c in counts.values())
    out = []
    for status, limit in run.limits().items():
        n = sum(c[status] - (c.get("not_drawn", 0) if status == "dropped" else 0) for c in counts.values())
        if total and n / total > limit:
            out.append((status, n, total, limit))
    return out


def _finished(output: Path, run: RunOptions) -> PackResult | None:
    """The result of a run already complete with these settings; a dry run's manifest is dropped when a full
    run finishes it (on the same encode work)."""
    path = output / MANIFEST
    if not path.exists():
        return None
    manifest = Manifest.read(output)
    if _missing(output, manifest):  # a file of the output deleted since: the run writes it again
        return None
    if run.dry_run or not manifest.dry_run:
        return PackResult(output, manifest.counts, manifest.packs, over_limits=over_limits(manifest.counts, run))
    path.unlink()
    return None


def _missing(output: Path, manifest: Manifest) -> list[str]:
    """The files a finished output must hold that are not there (relative to ``output``): the ledger, and unless
    a dry run made it, every pack shard with its index and Energon's split and dataset files."""
    need = ["ledger.parquet"]
    if not manifest.dry_run:
        need += [f"{META}/split.yaml", f"{META}/dataset.yaml"]
        need += [name for shards in manifest.splits.values() for s in shards for name in (s, f"{s}.idx")]
    if is_remote(output):  # one listing instead of a request per file
        present = {f.relative_to(output).as_posix() for f in output.files()}  # type: ignore[attr-defined]
        return [n for n in need if n not in present]
    return [n for n in need if not (output / n).is_file()]


def _encode(engine: Engine, out: OutputDir, src: SourceDataset, settings: PackSettings, run: RunOptions,
            stamps: dict[str, SourceStamp]) -> dict[str, list[Path]]:
    """Walk every shard's headers, then encode its ranges; returns each split's range stores in order."""
    shards = [(split, shard) for split, names in src.splits.items() for shard in names]
    files = src.chunks
    # A chunk's records are its samples, one after another; a shard's are found by a walk over its headers.
    tars = [shard for _, shard in shards if shard not in files]
    scans = [ScanTask(src.root, shard, src.excluded_samples) for shard in tars]
    scanned = dict(zip(tars, engine.map(scan_layout, scans, desc="scan", unit="shard", progress=run.progress,
                                        names=tars))) if tars else {}
    layouts = [scanned[shard] if shard not in files else
               ShardLayout(shard, range(files[shard].count), frozenset(), frozenset()) for _, shard in shards]
    tasks: list[EncodeTask] = []
    names: list[str] = []
    enc_dirs: dict[str, list[Path]] = {split: [] for split in src.splits}
    # An upper bound of the run's samples (a lost tail adds an error row per shard), so stopping early on it is
    # certain to fail a rate limit.
    total = sum(max(len(layout.starts), src.shard_counts.get(shard) or 0) + 1
                for (_, shard), layout in zip(shards, layouts))
    limits = FailureLimits(run.max_failures_in_a_row, run.max_same_failures, total,
                           tuple((status, limit) for status, limit in run.limits().items() if status != "truncated"))
    for (split, shard), layout in zip(shards, layouts):
        for k, span in enumerate(shard_ranges(layout)):
            store = out.encode_dir(split, shard, k)
            enc_dirs[split].append(store)
            tasks.append(EncodeTask(str(src.root), layout, span, src.excluded_samples, settings.encode,
                                    src.yaml_of(shard), src.shard_counts.get(shard), stamps[shard], run.strict,
                                    str(store), limits, files.get(shard)))
            names.append(f"{shard} (samples from {span.first})")
    engine.map(encode_range, tasks, desc="encode", unit="range", progress=run.progress, names=names)
    return enc_dirs


def _write(engine: Engine, source: Path, output: Path, settings: PackSettings, run: RunOptions,
           plans: dict[str, SplitPlan],
           out_shards: dict[str, list[str]], enc_dirs: dict[str, list[Path]],
           stamps: dict[str, SourceStamp], files: dict,
           datasets: tuple[str, ...] = ()) -> dict[str, ShardIndex]:
    """One task per output shard, its rows of the plan in a file of OUTPUT's work folder (the command's process
    holds one shard's rows at a time, and each task is a few names); with fewer shards than workers, each shard
    is written as parts by several tasks and joined (same bytes). A shard already committed is indexed."""
    work = output / WRITE
    n_shards = sum(plan.n_shards for plan in plans.values())
    # Parts are joined where the output is (a local file system): an object store only takes whole objects.
    parts = 1 if not n_shards or n_shards >= engine.workers or is_remote(output) else engine.workers // n_shards
    tasks: list[WriteTask] = []
    pieces: list[list[Path]] = []  # with parts: each shard's part files, in order (none: already committed)
    for split, plan in plans.items():
        if not plan.n_shards:
            continue
        rows = np.flatnonzero(plan.pack >= 0)
        rows = rows[np.lexsort((rows, plan.pack[rows]))]
        bounds = np.searchsorted(plan.shard_of_pack[plan.pack[rows]], np.arange(plan.n_shards + 1))
        table = plan.table.append_column("pack", pa.array(plan.pack)).select(
            list(SEGMENT_COLUMNS + (MIXTURE_COLUMNS if datasets else ())))
        split_stamps = {s: stamps[s] for s in src_shards(plan)}
        media_rows = np.flatnonzero(pc.not_equal(table.column("media"), "[]").to_numpy(zero_copy_only=False))
        for k, name in enumerate(out_shards[split]):
            mine = rows[bounds[k]:bounds[k + 1]]
            with_media = table.column("shard").take(np.intersect1d(mine, media_rows)) if files else []
            chunks = {s: files[s] for s in pc.unique(with_media).to_pylist() if s in files} if files else {}
            task = WriteTask(str(output / name), split, str(source), [str(d) for d in enc_dirs[split]],
                             split_stamps, "", settings.encode.pack_size, settings.encode.align, chunks, datasets)
            if parts == 1:
                tasks.append(replace(task, segments=_rows_file(work / f"{name}.parquet", table, mine)))
                continue
            path = output / name
            pieces.append([])
            if path.exists() and idx_path(path).exists():
                continue
            packs = plan.pack[mine]
            cuts = np.searchsorted(packs, np.linspace(packs[0], packs[-1] + 1, parts + 1)[1:-1])
            cut = [0, *cuts.tolist(), len(mine)]
            for a, b in zip(cut, cut[1:]):
                if a < b:
                    part = temporary_name(path.with_name(f"{path.name}.part{len(pieces[-1])}"))
                    pieces[-1].append(part)
                    tasks.append(replace(task, path=str(part), segments=_rows_file(
                        work / f"{name}.part{len(pieces[-1]) - 1}.parquet", table, mine[a:b])))
    # Taking the rows out of the split's table gathered its chunks a slice at a time: the allocator keeps what
    # that freed (about 70 B a sample), which would stay the command's through the whole write stage.
    pa.default_memory_pool().release_unused()
    names = [f"{t.path} (a part of an output shard)" if parts > 1 else t.path for t in tasks]
    written = engine.map(write_part if parts > 1 else write_shard, tasks, desc="write",
                         unit="part" if parts > 1 else "shard", progress=run.progress, names=names)
    if parts > 1:
        indexes = iter(written)
        shard_paths = [output / name for names_ in out_shards.values() for name in names_]
        written = [join_tar(path, [(part, next(indexes)) for part in parts_of]) if parts_of else index_tar(path)
                   for path, parts_of in zip(shard_paths, pieces)]
    remove_tree(work)
    return dict(zip((s for names_ in out_shards.values() for s in names_), written))  # tasks in this order


#: Rows of the plan copied at once into a write task's file (its row groups: a write task reads one at a time).
_ROWS_AT_ONCE = 1 << 13


def _rows_file(path: Path, table: pa.Table, rows: np.ndarray) -> str:
    """Commit rows ``rows`` of ``table`` (in that order) as ``path``, a slice at a time; returns its name for the
    task."""
    import pyarrow.parquet as pq

    with commit_path(path) as tmp, pq.ParquetWriter(tmp, table.schema) as writer:
        for a in range(0, len(rows), _ROWS_AT_ONCE):
            writer.write_table(table.take(rows[a:a + _ROWS_AT_ONCE]), row_group_size=_ROWS_AT_ONCE)
    return str(path)


def src_shards(plan: SplitPlan) -> list[str]:
    """Source shards of a split's encoded rows."""
    return plan.table.column("shard").unique().to_pylist() if plan.table.num_rows else []


def _check_packable(split: str, plan: SplitPlan, settings: PackSettings) -> None:
    """A split whose every encodable sample was dropped means the pack size is too small for this data."""
    status = plan.table.column("status").to_pylist()
    if status and all(s == "dropped" for s in status if s != "error") and "dropped" in status:
        need = [r for s, r in zip(status, plan.table.column("reason").to_pylist()) if s == "dropped"][0]
        raise ConfigError(f"split {split!r}: pack_size {settings.encode.pack_size} is smaller than any sample "
                          f"can be truncated to (first: {need})")


def _manifest(settings: PackSettings, fingerprints: dict, source: Path, out_shards: dict, counts: dict,
              packs: dict, dry_run: bool, facts: dict) -> Manifest:
    return Manifest(
        packtool=__version__, format=FORMAT_VERSION, fingerprint=fingerprints, settings=settings.describe(),
        source=str(source), splits=out_shards,
        tokenizer={"fingerprint": fingerprints["encode"]["tokenizer"], "dir": TOKENIZER_DIR},
        seed=settings.plan.seed, counts=counts, packs=packs, dry_run=dry_run, **facts,
        run_config=recorded_config(settings, source),
        convention=settings.encode.convention.record() if settings.encode.preset else None,
    )


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            commit_bytes(dst / name, (src / name).read_bytes())
