"""Other pack sizes judged from one run, without encoding again: ``packtool stats OUTPUT --candidates 4096,8192``.

Each range of the encode store keeps, beside its rows, the facts of every sample *before* any cut
(:data:`~packtool.packer.store.SOURCE_FACTS`: its length, first target token and the span of each media item). For a
candidate size the encoder's own rule is replayed on them (cut at the largest aligned length, never inside a media
span, the per-pack media caps, dropped when no target is left before the cut or with ``overlong: drop``), then the
run's planner packs the kept lengths with the run's algorithm and constraints. The counts equal a real run's at that
size. Two cases are estimates, and counted as such in the report: a sample whose text was cut before tokenizing
(its length is a lower bound) and a store written before these facts were kept (the ledger's lengths are used,
a cut sample's media beyond its cut are unknown and a target is assumed before every cut).

With the number of data-parallel ranks and micro-batches, each candidate also says the global batch size in packs
and samples and the optimizer steps per epoch that follow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.errors import ConfigError, FormatError
from packtool.format import Manifest, aligned_lengths, row_length
from packtool.item import loads_media
from packtool.packer.holdout import TRAIN, VAL
from packtool.packer.ledger import read_ledger
from packtool.storage import read_parquet


@dataclass(frozen=True)
class SourceRows:
    """Every sample of one split, in the run's order, before any cut."""

    #: ``error`` rows stay errors at every size; the others are judged again.
    error: np.ndarray
    #: Tokens of the whole sample (a lower bound where ``exact`` is False).
    length: np.ndarray
    #: Position of the first target token (0 where unknown).
    first_target: np.ndarray
    #: Whether the facts are complete (false: an estimate, see the module doc).
    exact: np.ndarray
    #: ``[start, end, placeholder tokens]`` of every media item, per sample.
    media: list[list[list[int]]]


@dataclass(frozen=True)
class Outcome:
    """What the encoder would keep of every sample at one size."""

    status: np.ndarray  # packed | truncated | dropped | error
    tokens: np.ndarray
    images: np.ndarray
    image_tokens: np.ndarray


def store_dirs(output: Path, split: str) -> list[Path]:
    """The split's encode ranges in the order a run reads them: shards as the ledger lists them (stores are named
    by shard, not by position), each shard's ranges in order."""
    found = sorted(p.parent for p in (output / ".packtool" / "encode" / split).glob("*/*/samples.parquet"))
    try:
        shards = read_ledger(output, ["shard"]).column("shard").to_pylist()
    except (OSError, FormatError, KeyError, ValueError):
        return found
    order = {shard: i for i, shard in reversed(list(enumerate(shards)))}

    def position(store: Path) -> tuple[int, str]:
        recorded = _read_source(store / "source.json")
        return order.get(recorded, len(order)), store.name

    return sorted(found, key=position)


def _read_source(path: Path) -> str | None:
    """The source shard an encode range records (None where it records none)."""
    try:
        shard = json.loads(path.read_text()).get("shard")
    except (OSError, ValueError, AttributeError):
        return None
    return shard if isinstance(shard, str) else None


def _stores_of(output: Path, split: str) -> tuple[list[Path], set[tuple[str, str]] | None]:
    """The encode ranges holding ``split``'s samples, and which of their samples are the split's (None: all).
    A validation split held out of train (``holdout`` in the manifest) and what train kept share train's ranges."""
    try:
        held = bool(Manifest.read(output).settings.get("holdout"))
    except (OSError, FormatError):
        held = False
    if not held or split not in (VAL, TRAIN):
        return store_dirs(output, split), None
    ledger = read_ledger(output, ["split", "shard", "key"])
    ledger = ledger.filter(pc.equal(ledger.column("split"), split))
    return store_dirs(output, TRAIN), set(zip(ledger.column("shard").to_pylist(), ledger.column("key").to_pylist()))


def load_rows(output: Path, split: str, ledger: Any) -> SourceRows:
    """The split's samples before any cut, from the encode store (the ledger's lengths where it has no facts)."""
    dirs, only = _stores_of(output, split)
    error, length, first, exact, media = [], [], [], [], []
    if dirs:
        for d in dirs:
            t = read_parquet(d / "samples.parquet", columns=["status", "source_tokens", "media", "shard", "key"])
            mine = None if only is None else pa.array([(s, k) in only for s, k in zip(
                t.column("shard").to_pylist(), t.column("key").to_pylist())], pa.bool_())
            t = t if mine is None else t.filter(mine)
            status = t.column("status").to_pylist()
            error += [s == "error" for s in status]
            length += t.column("source_tokens").to_pylist()
            facts = d / "source_facts.parquet"
            if facts.exists():
                f = read_parquet(facts)
                f = f if mine is None else f.filter(mine)
                first += f.column("first_target").to_pylist()
                exact += f.column("length_known").to_pylist()
                media += [json.loads(m) for m in f.column("source_media").to_pylist()]
            else:
                first += [0] * len(status)
                exact += [False] * len(status)
                media += [[[*(m.span or (m.token_offset, m.token_offset + m.tokens)), m.tokens]
                           for m in loads_media(s)] for s in t.column("media").to_pylist()]
    else:  # only the ledger: lengths, and nothing of the media beyond a cut
        rows = ledger
        error = [s == "error" for s in rows["status"]]
        length = list(rows["source_tokens"])
        first = [0] * len(error)
        exact = [False] * len(error)
        media = [[] for _ in error]
    return SourceRows(np.asarray(error, bool), np.asarray(length, np.int64), np.asarray(first, np.int64),
                      np.asarray(exact, bool), media)


def outcome(rows: SourceRows, pack_size: int, settings: dict) -> tuple[Outcome, int]:
    """The encoder's limits (see ``Encoder._fit``) replayed at ``pack_size``; also how many samples were
    judged from incomplete facts and go past the cut (estimates)."""
    align = int(settings.get("align") or 1)
    max_tokens = row_length(pack_size, align)
    max_images, max_image_tokens = settings.get("max_images"), settings.get("max_image_tokens")
    drop = settings.get("overlong") == "drop"
    n = len(rows.length)
    # Samples without media (most of a dataset): array operations; the others one by one.
    has_media = np.fromiter((bool(m) for m in rows.media), bool, n)
    text = ~rows.error & ~has_media
    cut_text = np.minimum(rows.length, max_tokens)
    whole = text & (cut_text == rows.length)
    dropped = text & ~whole & (drop | (rows.first_target >= cut_text))
    cut = text & ~whole & ~dropped
    status = np.full(n, "", dtype=object)
    status[rows.error], status[whole], status[dropped], status[cut] = "error", "packed", "dropped", "truncated"
    tokens = np.where(whole | cut, cut_text, 0).astype(np.int64)
    images = np.zeros(n, np.int64)
    image_tokens = np.zeros(n, np.int64)
    estimated = int(np.count_nonzero(text & ~whole & ~rows.exact))
    for i in np.flatnonzero(~rows.error & has_media).tolist():
        length, spans = int(rows.length[i]), rows.media[i]
        cut = min(length, max_tokens)
        total = 0
        for j, (s, _, t) in enumerate(spans):
            total += t
            if (max_images is not None and j + 1 > max_images) or \
                    (max_image_tokens is not None and total > max_image_tokens):
                cut = min(cut, s)
                break
        for s, e, _ in spans:
            if s < cut < e:
                cut = s
        if cut < length and not rows.exact[i]:
            estimated += 1
        if cut == length:
            status[i], tokens[i] = "packed", length
            kept = spans
        elif drop or rows.first_target[i] >= cut:
            status[i] = "dropped"
            continue
        else:
            status[i], tokens[i] = "truncated", cut
            kept = [m for m in spans if m[1] <= cut]
        images[i], image_tokens[i] = len(kept), sum(m[2] for m in kept)
    return Outcome(status, tokens, images, image_tokens), estimated


def evaluate(output: Path, split: str, ledger: Any, sizes: list[int], settings: dict, *, dp: int = 1,
             micro_batches: int = 1, micro_batch_size: int = 1, algorithm: str | None = None) -> list[dict]:
    """One row per candidate size: statuses, packs, fill, samples and media per pack, global batch and steps."""
    from packtool.packer.algorithms import ALGORITHMS, pack_lengths
    from packtool.packer.split_plan import packs_by_first_item

    algo = algorithm or settings.get("algorithm") or "auto"
    if algo not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGORITHMS)}")
    for name, value in (("dp", dp), ("micro_batches", micro_batches), ("micro_batch_size", micro_batch_size)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, not {value}")
    align = int(settings.get("align") or 1)
    rows = load_rows(output, split, ledger)
    batch = dp * micro_batches * micro_batch_size
    out = []
    for size in sizes:
        if size < align:
            raise ConfigError(f"candidate pack size {size} is smaller than the alignment {align}")
        o, estimated = outcome(rows, size, settings)
        keep = np.flatnonzero((o.status == "packed") | (o.status == "truncated"))
        entry: dict[str, Any] = {"pack_size": size, "algorithm": algo,
                                 **{s: int(np.count_nonzero(o.status == s)) for s in
                                    ("packed", "truncated", "dropped", "error")}, "estimated": estimated}
        if keep.size:
            ids = pack_lengths(o.tokens[keep], size, algorithm=algo, align=align,
                               max_segments=settings.get("max_segments"), images=o.images[keep],
                               max_images=settings.get("max_images"), image_tokens=o.image_tokens[keep],
                               max_image_tokens=settings.get("max_image_tokens"), seed=settings.get("seed", 0),
                               balanced_delta=settings.get("balanced_delta", 0))
            n_packs = int(ids.max()) + 1
            per_pack = np.bincount(ids, minlength=n_packs)
            media = np.bincount(ids, weights=o.images[keep], minlength=n_packs)
            cost = int(aligned_lengths(o.tokens[keep], align).sum())
            order = packs_by_first_item(ids, n_packs)
            steps = n_packs // batch
            per_step = per_pack[order][:steps * batch].reshape(steps, batch).sum(axis=1) if steps else per_pack[:0]
            entry.update({
                "packs": n_packs, "l1_bound": -(-cost // size), "tokens": int(o.tokens[keep].sum()),
                "fill": float(o.tokens[keep].sum() / (n_packs * size)),
                "samples_per_pack": _spread(per_pack), "media_per_pack": _spread(media),
                "global_batch_packs": batch, "steps_per_epoch": steps, "packs_left_over": n_packs - steps * batch,
                "samples_per_step": _spread(per_step),
            })
        else:
            entry.update({"packs": 0, "l1_bound": 0, "tokens": 0, "fill": 0.0, "samples_per_pack": _spread(
                np.zeros(0)), "media_per_pack": _spread(np.zeros(0)), "global_batch_packs": batch,
                "steps_per_epoch": 0, "packs_left_over": 0, "samples_per_step": _spread(np.zeros(0))})
        out.append(entry)
    return out


def _spread(x: np.ndarray) -> dict:
    if not len(x):
        return {"mean": 0.0, "std": 0.0, "min": 0, "max": 0}
    return {"mean": float(np.mean(x)), "std": float(np.std(x)), "min": float(np.min(x)), "max": float(np.max(x))}


def distribution(rows: SourceRows) -> dict:
    """Source lengths and media per sample (errors left out): percentiles, before any cut."""
    ok = ~rows.error
    lengths = rows.length[ok]
    media = np.asarray([len(m) for m, e in zip(rows.media, rows.error) if not e], np.int64)
    qs = (50, 90, 99)

    def pct(x: np.ndarray) -> dict:
        if not len(x):
            return {"mean": 0.0, **{f"p{q}": 0 for q in qs}, "max": 0}
        return {"mean": float(x.mean()), **{f"p{q}": int(np.percentile(x, q, method="higher")) for q in qs},
                "max": int(x.max())}

    return {"samples": int(ok.sum()), "tokens": pct(lengths), "media": pct(media),
            "lower_bounds": int(np.count_nonzero(~rows.exact[ok] & (rows.length[ok] > 0)))}


def check_sizes(text: str) -> list[int]:
    """``"4096,8192"`` -> sizes."""
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"candidate pack sizes must be integers separated by commas, not {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ConfigError(f"candidate pack sizes must be positive integers, not {text!r}")
    return sizes


#: Above this share of an epoch's packs left over (no full global batch), the report flags the candidate.
LEFTOVER_WARN = 0.05
#: The pack sizes judged when none are given (those below the alignment are skipped).
DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def leftover_share(entry: dict) -> float:
    """The share of an epoch's packs that fill no global batch."""
    return entry["packs_left_over"] / entry["packs"] if entry["packs"] else 0.0


def steps_text(entry: dict) -> str:
    """The global batch and the steps per epoch of one candidate, in words (with the ranks it assumes when they
    were not given, and a warning when more than :data:`LEFTOVER_WARN` of the packs are left over)."""
    assumed = ("assuming 1 data-parallel rank (give --dp, and --micro-batches for gradient accumulation): "
               if entry.get("dp_assumed") else "")
    if not entry["steps_per_epoch"]:
        return (f"{assumed}{entry['global_batch_packs']} packs/step: more than the {entry['packs']} packs an epoch "
                f"holds; take fewer ranks or micro-batches")
    left = leftover_share(entry)
    return (f"{assumed}global batch {entry['global_batch_packs']} packs ≈ "
            f"{entry['samples_per_step']['mean']:.1f} samples (min {entry['samples_per_step']['min']:.0f}, "
            f"max {entry['samples_per_step']['max']:.0f}), {entry['global_batch_packs'] * entry['pack_size']} "
            f"tokens/step; {entry['steps_per_epoch']} steps/epoch"
            + (f" (+{entry['packs_left_over']} packs left over, {left:.0%})" if entry["packs_left_over"] else "")
            + (f"; WARNING: {left:.0%} of the packs are left over each epoch" if left > LEFTOVER_WARN else ""))


def recommend(output: Path, split: str, ledger: Any, sizes: list[int], settings: dict, *, dp: int = 1,
              micro_batches: int = 1, tokens_per_step: int | None = None,
              global_batch_samples: int | None = None, algorithm: str | None = None) -> dict:
    """The pack size and global batch (in packs, a multiple of ``dp × micro_batches``) to choose for a target of
    ``tokens_per_step`` or ``global_batch_samples``, and why: per size, the global batch nearest the target, its
    steps per epoch and leftover packs. The choice: among sizes with at most :data:`LEFTOVER_WARN` left over (all
    if none), the fewest truncated and dropped samples, then the best fill."""
    if (tokens_per_step is None) == (global_batch_samples is None):
        raise ConfigError("give one target: tokens per step or a global batch in samples")
    if (tokens_per_step or global_batch_samples or 0) < 1:
        raise ConfigError("the target must be at least 1")
    unit = dp * micro_batches
    rows = []
    for one in evaluate(output, split, ledger, sizes, settings, dp=1, algorithm=algorithm):
        if not one["packs"]:
            continue
        want = (tokens_per_step / one["pack_size"] if tokens_per_step is not None
                else global_batch_samples / max(one["samples_per_pack"]["mean"], 1e-9))
        batch = max(unit, round(want / unit) * unit)
        row = evaluate(output, split, ledger, [one["pack_size"]], settings, dp=batch, algorithm=algorithm)[0]
        rows.append(row)
    usable = [r for r in rows if r["steps_per_epoch"]]
    few_left = [r for r in usable if leftover_share(r) <= LEFTOVER_WARN] or usable
    if not few_left:
        return {"choice": None, "rows": rows, "why": "no candidate size gives one full global batch per epoch"}
    best = min(few_left, key=lambda r: (r["truncated"] + r["dropped"], -r["fill"], r["pack_size"]))
    why = (f"pack size {best['pack_size']}, global batch {best['global_batch_packs']} packs "
           f"({best['global_batch_packs'] * best['pack_size']} tokens/step, ≈ {best['samples_per_step']['mean']:.1f} "
           f"samples): fill {best['fill']:.4f}, {best['truncated']} truncated, {best['dropped']} dropped, "
           f"{best['steps_per_epoch']} steps/epoch, {best['packs_left_over']} packs left over "
           f"({leftover_share(best):.1%})"
           + ("" if leftover_share(best) <= LEFTOVER_WARN else f"; WARNING: every size leaves more than "
                                                                 f"{LEFTOVER_WARN:.0%} of the packs over"))
    return {"choice": {"pack_size": best["pack_size"], "global_batch_packs": best["global_batch_packs"]},
            "rows": rows, "why": why}

