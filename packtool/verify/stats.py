"""``packtool stats``: how well a run packed, from its ledger and manifest (no shard is read)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.errors import FormatError
from packtool.format import KEPT, MANIFEST, STATUSES, aligned_lengths, pack_numbers, read_mapping
from packtool.packer.ledger import SplitFill, read_ledger
from packtool.packer.mixing import NOT_DRAWN
from packtool.storage import location

#: The ledger columns the report reads (keys and shards are never needed: they are most of its bytes).
STATS_COLUMNS = ["split", "status", "reason", "tokens", "images", "image_tokens", "pack"]
#: A number standing alone (``4096``, ``2.5 s``), not one inside a word or a name (``mp4``, ``Qwen2.5-VL-3B``,
#: ``part0.jpg``): reasons that differ only in such numbers are grouped.
_NUMBER = re.compile(r"(?<![\w./\-])\d+(?:\.\d+)?(?![\w.]*[A-Za-z_])(?!\.\d)")


def group_reason(reason: str) -> str:
    """``reason`` with its standalone numbers folded to ``N``."""
    return _NUMBER.sub("N", reason)


def _ledger(path: Path, columns: list[str]) -> pa.Table:
    """The ledger of ``path``, or a one-line error when it is neither a packed output nor a ledger file."""
    from packtool.format import LEDGER

    if path.is_dir() and not (path / LEDGER).is_file():
        raise FormatError(f"{path} is not a packed output: it holds no {LEDGER}")
    try:
        return read_ledger(path, columns)
    except (pa.ArrowInvalid, KeyError) as exc:
        raise FormatError(f"{path} is not a packtool ledger ({str(exc).splitlines()[0]})") from None


def _manifest(path: Path) -> dict:
    """The manifest beside the ledger (empty when there is none); a one-line :class:`FormatError` when it is not
    a manifest (not JSON, not a mapping)."""
    folder = path if path.is_dir() else path.parent
    m = folder / MANIFEST
    return read_mapping(m, "manifest") if m.exists() else {}


def _settings(path: Path, pack_size: int | None = None) -> dict:
    folder = path if path.is_dir() else path.parent
    recorded = _manifest(path).get("settings", {})
    if not isinstance(recorded, dict):
        raise FormatError(f"{folder / MANIFEST}: its settings are a {type(recorded).__name__}, not a mapping")
    s = dict(recorded)
    if pack_size is not None:
        s["pack_size"] = pack_size
    if not s.get("pack_size"):
        raise FormatError(f"{path}: no manifest beside the ledger to take the pack size from; give pack_size")
    s.setdefault("align", 1)
    for key in ("pack_size", "align"):
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < 1:
            raise FormatError(f"{folder / MANIFEST}: its {key} is {s[key]!r}, not a positive integer")
    return s


def split_arrays(ledger, split: str) -> dict:
    """Per-split numpy views of the packed rows: lengths, images, image tokens and pack numbers."""
    t = ledger.filter(pc.and_(pc.equal(ledger.column("split"), split), pc.is_valid(ledger.column("pack"))))
    packs = pack_numbers(t.column("pack"))
    return {
        "lengths": t.column("tokens").to_numpy().astype(np.int64),
        "images": t.column("images").to_numpy().astype(np.int64),
        "image_tokens": t.column("image_tokens").to_numpy().astype(np.int64),
        "pack": packs,
    }


def compute(path: str | Path, *, balance_dp: int | None = None, pack_size: int | None = None) -> dict:
    """The report as a dict: per split packs, fill, L1 bound, padding by cause, segments/images per pack, statuses
    with reasons grouped (numbers folded to N), and DP-group imbalance when ``balance_dp`` is given."""
    from packtool.packer.algorithms import dp_imbalance

    path = location(path)
    ledger = _ledger(path, STATS_COLUMNS)
    st = _settings(path, pack_size)
    size, align = int(st["pack_size"]), int(st["align"])
    groups = balance_dp or st.get("balance_dp")
    splits: dict[str, dict[str, Any]] = {}
    report = {"pack_size": size, "align": align, "algorithm": st.get("algorithm"), "splits": splits}
    mixture = _mixture(path)
    for split in sorted(pc.unique(ledger.column("split")).to_pylist()):
        a = split_arrays(ledger, split)
        rows = ledger.filter(pc.equal(ledger.column("split"), split))
        counted = pc.value_counts(rows.column("status")).to_pylist()
        status = {s: 0 for s in STATUSES} | {c["values"]: c["counts"] for c in counted if c["values"] in STATUSES}
        failed = rows.filter(pc.not_equal(rows.column("status"), "packed"))  # only the reasons of what failed
        reasons: Counter[tuple[str, str]] = Counter()
        examples: dict[tuple[str, str], str] = {}  # a group's first full reason: the numbers folded out of it
        for s, r in zip(failed.column("status").to_pylist(), failed.column("reason").to_pylist()):
            reasons[(s, group_reason(r))] += 1
            examples.setdefault((s, group_reason(r)), r)
        lengths, pack = a["lengths"], a["pack"]
        n_packs = int(pack.max()) + 1 if pack.size else 0
        aligned = int(aligned_lengths(lengths, align).sum())
        f = SplitFill.of(int(lengths.sum()), aligned, n_packs, size)
        seg_per_pack = np.bincount(pack, minlength=n_packs) if n_packs else np.zeros(0, np.int64)
        img_per_pack = np.bincount(pack, weights=a["images"], minlength=n_packs) if n_packs else seg_per_pack
        entry: dict[str, Any] = {
            "samples": rows.num_rows,
            "status": status,
            "reasons": [{"status": s, "reason": r, "count": c, "example": examples[(s, r)]}
                        for (s, r), c in sorted(reasons.items())],
            "packs": n_packs,
            "l1_bound": f.l1_bound,
            "tokens": f.tokens,
            "fill": f.fill,
            "padding_align": aligned - f.tokens,
            "padding_tail": n_packs * size - aligned,
            "segments_per_pack": _summary(seg_per_pack),
            "images_per_pack": _summary(img_per_pack),
            "image_tokens": int(a["image_tokens"].sum()),
        }
        del rows, failed, a
        if groups and groups > 1 and n_packs:
            entry["dp_group"] = groups
            entry["dp_imbalance"] = float(dp_imbalance(pack, lengths, groups))
            natural = np.argsort(_first_index(pack, n_packs), kind="stable")
            entry["dp_imbalance_unbalanced_order"] = float(dp_imbalance(pack, lengths, groups, order=natural))
        entry["step_weights"] = step_weights(path, split)
        entry.update(mixture_entry(path, split, mixture, st))
        splits[split] = entry
    return report


def _mixture(path: Path) -> object:
    """The manifest's ``mixture`` beside the ledger (None for a ledger file alone, or no mixture)."""
    return _manifest(path).get("mixture") if path.is_dir() else None


def mixture_entry(path: Path, split: str, mixture: object, st: dict | None = None) -> dict[str, Any]:
    """A mixture split's part of the report (read from the ledger): per dataset its shares (``datasets``), the
    packs holding a sample twice, and per packing group its fill; empty for a split no mixture made (nothing
    read). ``st``: the run's settings (by default the manifest's)."""
    if not isinstance(mixture, dict) or split not in mixture.get("repetitions", {}):
        return {}
    st = st if st is not None else _settings(path)
    entry: dict[str, Any] = {"datasets": per_dataset(path, split, mixture, st),
                             "packs_sharing_a_sample": packs_sharing_a_sample(path, split)}
    grouping = per_group(path, split, mixture, st)
    if grouping is not None:
        entry["groups"], entry["one_plan_packs"] = grouping
    return entry


def step_weights(path: Path, split: str) -> dict | None:
    """How the split's packed samples weigh in the step: per dataset of a mixture (and overall) the share of
    samples, of target tokens and of gradient weight under the ``token`` and ``sample`` loss modes (each sample's
    ``loss_weight``); and, for a trainer that keeps the per-pack mean (each pack one micro-batch, averaged on its
    own), each sample's weight relative to ``sample``'s: min, median, max. None without packed samples."""
    wanted = ["split", "pack", "targets", "loss_weight", "dataset"]
    columns = [c for c in wanted if c in _ledger_names(path)]
    t = read_ledger(path, columns)
    t = t.filter(pc.and_(pc.equal(t.column("split"), split), pc.is_valid(t.column("pack"))))
    if not t.num_rows:
        return None
    n = t.column("targets").to_numpy().astype(np.float64)
    w = t.column("loss_weight").to_numpy() if "loss_weight" in columns else np.ones(t.num_rows)
    datasets = t.column("dataset").to_pylist() if "dataset" in columns else [None] * t.num_rows
    pack = pack_numbers(t.column("pack"))
    token, sample = w * n, w.copy()
    per_pack = np.bincount(pack, weights=token)
    packs = int(pack.max()) + 1
    mean = np.divide(token, per_pack[pack], out=np.zeros_like(token), where=per_pack[pack] > 0) / packs
    chosen = sample / (sample.sum() or 1)
    ratio = np.divide(mean, chosen, out=np.zeros_like(mean), where=chosen > 0)[chosen > 0]

    def shares(mask: np.ndarray) -> dict:
        return {"samples": float(mask.mean()), "targets": float(n[mask].sum() / (n.sum() or 1)),
                "token": float(token[mask].sum() / (token.sum() or 1)),
                "sample": float(sample[mask].sum() / (sample.sum() or 1))}

    rows = [{"dataset": name, **shares(np.asarray([d == name for d in datasets]))}
            for name in dict.fromkeys(datasets) if name is not None]
    return {"weighted": "loss_weight" in columns, "datasets": rows,
            "per_pack_mean": {"min": float(ratio.min()), "median": float(np.median(ratio)),
                              "max": float(ratio.max())} if ratio.size else None}


def _ledger_names(path: Path) -> list[str]:
    from packtool.format import LEDGER
    from packtool.storage import parquet_file

    p = location(path)
    return list(parquet_file(p / LEDGER if p.is_dir() else p).schema_arrow.names)


def packs_sharing_a_sample(path: Path, split: str) -> int:
    """How many packs of a mixture's split hold two or more copies of one sample (copies the planner could not
    keep apart)."""
    from packtool.packer.mixing import shared_packs

    t = read_ledger(path, ["split", "shard", "key", "pack"])
    t = t.filter(pc.and_(pc.equal(t.column("split"), split), pc.is_valid(t.column("pack"))))
    ident = [f"{a}\0{b}" for a, b in zip(t.column("shard").to_pylist(), t.column("key").to_pylist())]
    return shared_packs(pack_numbers(t.column("pack")), ident)


def per_dataset(path: Path, split: str, mixture: dict, st: dict) -> list[dict]:
    """A mixture's split per dataset: samples taken (copies counted), tokens, their shares against the declared
    share of samples, and the fill each dataset would have packed apart (the same planner, its samples alone),
    with the mixture's joint fill to compare."""
    t = _MixtureRows(path, split, st)
    size = t.size
    first = t.table.column("copy").to_numpy() == 0
    not_drawn = np.asarray([r is not None and r.startswith(NOT_DRAWN) for r in t.table.column("reason").to_pylist()])
    declared = {e["name"]: e for e in mixture["splits"].get(split, [])}
    rows = []
    for name in declared:
        mine = np.asarray([n == name for n in t.names])
        k = t.kept & mine
        pool = int((mine & first & (t.kept | not_drawn)).sum())  # the dataset's usable samples, once each
        rows.append({"dataset": name, "samples": int(k.sum()), "distinct": int((k & first).sum()), "pool": pool,
                     "tokens": int(t.lengths[k].sum()), "packs_apart": t.packs(k),
                     "targets": int(t.targets[k].sum()) if t.targets is not None else None,
                     "weight": declared[name].get("weight"), "repetitions": declared[name].get("repetitions")})
    total_samples = sum(r["samples"] for r in rows) or 1
    total_tokens = sum(r["tokens"] for r in rows) or 1
    total_targets = sum(r["targets"] or 0 for r in rows) or 1
    weighted = [r["repetitions"] * r["pool"] for r in rows if r["repetitions"] is not None]
    for r in rows:
        r["sample_share"] = r["samples"] / total_samples
        r["token_share"] = r["tokens"] / total_tokens
        r["target_share"] = r["targets"] / total_targets if r["targets"] is not None else None
        r["declared_share"] = r["weight"] if r["weight"] is not None else (
            r["repetitions"] * r["pool"] / (sum(weighted) or 1))
        r["fill_apart"] = r["tokens"] / (r["packs_apart"] * size) if r["packs_apart"] else 0.0
    return rows


def _first_index(pack: np.ndarray, n: int) -> np.ndarray:
    first = np.full(n, len(pack), dtype=np.int64)
    np.minimum.at(first, pack, np.arange(len(pack)))
    return first


def _summary(x: np.ndarray) -> dict:
    if not len(x):
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": float(np.mean(x)), "min": int(np.min(x)), "max": int(np.max(x))}


def compare(path: str | Path, algorithms: list[str], *, pack_size: int | None = None) -> dict:
    """Replan each split with every named algorithm under the run's constraints; at another ``pack_size`` the
    samples are first cut as a run at that size would cut them (:mod:`packtool.verify.candidates`)."""
    from packtool.errors import ConfigError
    from packtool.packer.algorithms import ALGORITHMS
    from packtool.packer.algorithms import compare as plan_compare
    from packtool.verify.candidates import load_rows, outcome

    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}; choose from {', '.join(ALGORITHMS)}")
    path = location(path)
    ledger = _ledger(path, [*STATS_COLUMNS, "source_tokens"])
    st = _settings(path, pack_size)
    size, align = int(st["pack_size"]), int(st["align"])
    if size < align:
        raise ConfigError(f"pack size {size} is smaller than the alignment {align}")
    out = {}
    for split in sorted(set(ledger.column("split").to_pylist())):
        rows = ledger.filter(pc.equal(ledger.column("split"), split))
        o, _ = outcome(load_rows(_folder(path), split, rows.to_pydict()), size, st)
        keep = (o.status == "packed") | (o.status == "truncated")
        if not keep.any():
            continue
        out[split] = plan_compare(
            o.tokens[keep], size, algorithms, align=align, max_segments=st.get("max_segments"),
            images=o.images[keep], max_images=st.get("max_images"), image_tokens=o.image_tokens[keep],
            max_image_tokens=st.get("max_image_tokens"), seed=st.get("seed", 0),
        )
    return out


def _folder(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def decide(path: str | Path, sizes: list[int], *, dp: int | None = None, micro_batches: int = 1,
           micro_batch_size: int = 1, algorithm: str | None = None, tokens_per_step: int | None = None,
           global_batch_samples: int | None = None) -> dict:
    """Per split: the source-length distribution (before any cut) and one row per candidate pack size
    (:func:`packtool.verify.candidates.evaluate`)."""
    from packtool.verify.candidates import distribution, evaluate, load_rows, recommend

    path = Path(path)
    ledger = _ledger(path, ["split", "status", "source_tokens"])
    st = _settings(path)
    out = {}
    for split in sorted(set(ledger.column("split").to_pylist())):
        rows = ledger.filter(pc.equal(ledger.column("split"), split)).to_pydict()
        out[split] = {"source": distribution(load_rows(_folder(path), split, rows)),
                      "candidates": evaluate(_folder(path), split, rows, sizes, st, dp=dp or 1,
                                             micro_batches=micro_batches, micro_batch_size=micro_batch_size,
                                             algorithm=algorithm)}
        for c in out[split]["candidates"]:
            c["dp_assumed"] = dp is None
        if tokens_per_step is not None or global_batch_samples is not None:
            out[split]["recommend"] = recommend(_folder(path), split, rows, sizes, st, dp=dp or 1,
                                                micro_batches=micro_batches, tokens_per_step=tokens_per_step,
                                                global_batch_samples=global_batch_samples, algorithm=algorithm)
    return out


class _MixtureRows:
    """A mixture's split from its ledger, planned again on any subset of its kept rows (copies kept apart, as
    the run's plan keeps them)."""

    def __init__(self, path: Path, split: str, st: dict):
        from packtool.packer.mixing import copy_samples

        wanted = ["split", "status", "reason", "tokens", "images", "image_tokens", "dataset", "copy", "shard", "key",
                  "pack", "targets"]
        t = read_ledger(path, [c for c in wanted if c in _ledger_names(path)])
        self.table = t = t.filter(pc.equal(t.column("split"), split))
        self.st, self.size, self.align = st, int(st["pack_size"]), int(st["align"])
        self.samples = copy_samples([f"{a}\0{b}" for a, b in zip(t.column("shard").to_pylist(),
                                                                 t.column("key").to_pylist())])
        self.kept = pc.is_in(t.column("status"), value_set=pa.array(list(KEPT))).to_numpy(zero_copy_only=False)
        self.names = t.column("dataset").to_pylist()
        self.lengths = t.column("tokens").to_numpy().astype(np.int64)
        self.targets = t.column("targets").to_numpy().astype(np.int64) if "targets" in t.column_names else None
        self.images, self.image_tokens = t.column("images").to_numpy(), t.column("image_tokens").to_numpy()

    def packs(self, rows: np.ndarray) -> int:
        """The packs the run's planner makes of ``rows`` (a mask of kept rows) alone."""
        from packtool.packer.algorithms import pack_lengths

        if not rows.any():
            return 0
        st, samples = self.st, self.samples[rows]
        ids = pack_lengths(self.lengths[rows], self.size, algorithm=st.get("algorithm", "auto"), align=self.align,
                           max_segments=st.get("max_segments"), images=self.images[rows],
                           max_images=st.get("max_images"), image_tokens=self.image_tokens[rows],
                           max_image_tokens=st.get("max_image_tokens"), seed=int(st.get("seed", 0)),
                           samples=samples if (samples >= 0).any() else None)
        return int(ids.max()) + 1


def per_group(path: Path, split: str, mixture: dict, st: dict) -> tuple[list[dict], int] | None:
    """A mixture's packing groups in a split: each group's datasets, samples, tokens, packs and fill, and the
    packs one plan of the whole split would take (what grouping costs); None where the split has no groups."""
    entries = mixture["splits"].get(split, [])
    group_of = {e["name"]: e["group"] for e in entries if e.get("group") is not None}
    if not group_of:
        return None
    t = _MixtureRows(path, split, st)
    pack = t.table.column("pack").to_numpy(zero_copy_only=False)
    rows = []
    for group in dict.fromkeys(group_of.values()):
        mine = t.kept & np.asarray([group_of.get(n) == group for n in t.names])
        packs = int(np.unique(pack[mine]).size)
        tokens = int(t.lengths[mine].sum())
        rows.append({"group": group, "datasets": [n for n, g in group_of.items() if g == group],
                     "samples": int(mine.sum()), "tokens": tokens, "packs": packs,
                     "fill": tokens / (packs * t.size) if packs else 0.0})
    return rows, t.packs(t.kept)


def mixture_lines(e: dict, pack_size: int) -> list[str]:
    """A mixture split's lines of the report (``e``: the split's entry): per dataset its samples, tokens and
    shares against the declared one, what packing apart would take, and per packing group its fill."""
    lines: list[str] = []
    if e.get("datasets"):
        apart = sum(d["packs_apart"] for d in e["datasets"])
        lines.append(f"  {'dataset':<24}{'samples':>9}{'distinct':>9}{'tokens':>11}{'declared':>10}"
                     f"{'samples%':>10}{'tokens%':>9}{'fill apart':>11}{'targets':>11}{'targets%':>9}")
        for d in e["datasets"]:
            targets = (f"{d['targets']:>11}{d['target_share']:>9.2%}" if d.get("targets") is not None
                       else f"{'-':>11}{'-':>9}")
            lines.append(f"  {d['dataset'][:24]:<24}{d['samples']:>9}{d['distinct']:>9}{d['tokens']:>11}"
                         f"{d['declared_share']:>10.2%}{d['sample_share']:>10.2%}{d['token_share']:>9.2%}"
                         f"{d['fill_apart']:>11.4f}{targets}")
        if apart:
            lines.append(f"  packed apart: {apart} packs, fill {e['tokens'] / (apart * pack_size):.4f}; "
                         f"jointly: {e['packs']} packs, fill {e['fill']:.4f} ({apart - e['packs']:+d} packs "
                         f"apart)")
        lines.append(f"  copies together: {e.get('packs_sharing_a_sample', 0)} packs hold a sample more than "
                     f"once")
    if e.get("groups"):
        for g in e["groups"]:
            lines.append(f"  group {g['group']:<18}{g['samples']:>9} samples{g['packs']:>8} packs  fill "
                         f"{g['fill']:.4f}  ({', '.join(g['datasets'])})")
        one = e["one_plan_packs"]
        lines.append(f"  grouping costs {e['packs'] - one:+d} packs against one plan of the split ({one} packs, "
                     f"fill {e['tokens'] / (one * pack_size) if one else 0.0:.4f})")
    return lines


def mixture_report(path: str | Path, split: str, entry: dict) -> list[str]:
    """:func:`mixture_lines` of a split of the output at ``path``. ``entry``: the split's entry of
    :func:`compute`, or just its ``packs``, ``tokens`` and ``fill`` (the mixture's part is then read from the
    ledger). Empty for a split no mixture made."""
    path = location(path)
    if "datasets" not in entry:
        more = mixture_entry(path, split, _mixture(path))
        if not more:
            return []
        entry = {**entry, **more}
    return mixture_lines(entry, int(_settings(path)["pack_size"]))


def format_report(report: dict) -> str:
    lines = [f"pack size {report['pack_size']}, align {report['align']}, algorithm {report['algorithm']}"]
    for split, e in report["splits"].items():
        lines += [
            "",
            f"[{split}] {e['samples']} samples: " + ", ".join(f"{k} {v}" for k, v in e["status"].items()),
            f"  packs            {e['packs']}  (L1 bound {e['l1_bound']})",
            f"  fill             {e['fill']:.4f}",
            f"  tokens           {e['tokens']}  (image tokens {e['image_tokens']})",
            f"  padding          alignment {e['padding_align']}, tail {e['padding_tail']}",
            "  segments/pack    mean {mean:.2f}  min {min}  max {max}".format(**e["segments_per_pack"]),
            "  images/pack      mean {mean:.2f}  min {min}  max {max}".format(**e["images_per_pack"]),
        ]
        lines += mixture_lines(e, report["pack_size"])
        sw = e.get("step_weights")
        if sw and sw["per_pack_mean"]:
            r = sw["per_pack_mean"]
            lines.append(f"  step weights     a per-pack mean weighs a sample {r['min']:.2f}x to {r['max']:.2f}x "
                         f"(median {r['median']:.2f}x) its per-sample weight")
            lines.append("                   (per-token normalization with loss_mode token or sample: exact)")
            for d in sw["datasets"]:
                lines.append(f"  {d['dataset'][:24]:<24} gradient share: token {d['token']:.2%}, sample "
                             f"{d['sample']:.2%} (samples {d['samples']:.2%}, target tokens {d['targets']:.2%})")
        if "dp_imbalance" in e:
            lines.append(f"  DP imbalance     {e['dp_imbalance']:.4f} over groups of {e['dp_group']} "
                         f"(natural order {e['dp_imbalance_unbalanced_order']:.4f})")
        for r in e["reasons"]:
            lines.append(f"  {r['status']:<10} {r['count']:>7}  {r['reason']}")
            if r.get("example", r["reason"]) != r["reason"]:
                lines.append(f"  {'':<10} {'':>7}  e.g. {r['example']}")
    for split, rows in report.get("compare", {}).items():
        lines += ["", f"[{split}] replanned", f"  {'algorithm':<26}{'packs':>8}{'L1':>8}{'fill':>9}{'seconds':>10}"]
        for r in rows:
            lines.append(f"  {r['algorithm']:<26}{r['packs']:>8}{r['l1_bound']:>8}{r['fill']:>9.4f}"
                         f"{r['seconds']:>10.3f}")
    for split, d in report.get("decide", {}).items():
        lines += _decide_lines(split, d)
    return "\n".join(lines)


def _decide_lines(split: str, d: dict) -> list[str]:
    from packtool.verify.candidates import steps_text

    src = d["source"]
    t, m = src["tokens"], src["media"]
    lines = ["", f"[{split}] source, before any cut ({src['samples']} samples without errors)",
             f"  tokens/sample    mean {t['mean']:.0f}  p50 {t['p50']}  p90 {t['p90']}  p99 {t['p99']}  "
             f"max {t['max']}",
             f"  media/sample     mean {m['mean']:.2f}  p50 {m['p50']}  p90 {m['p90']}  max {m['max']}"]
    rows = d["candidates"]
    if not rows:
        return lines
    lines += ["", f"[{split}] candidate pack sizes ({rows[0]['algorithm']})",
              f"  {'size':>7}{'packs':>8}{'fill':>8}{'trunc':>7}{'drop':>6}{'samples/pack':>22}{'media/pack':>12}"]
    for r in rows:
        sp, mp = r["samples_per_pack"], r["media_per_pack"]
        spread = f"{sp['mean']:.2f} ± {sp['std']:.2f} [{sp['min']:.0f}-{sp['max']:.0f}]"
        lines.append(f"  {r['pack_size']:>7}{r['packs']:>8}{r['fill']:>8.4f}{r['truncated']:>7}{r['dropped']:>6}"
                     f"{spread:>22}{mp['mean']:>12.2f}")
        lines.append(f"  {'':>7}  {steps_text(r)}")
    if "recommend" in d:
        lines.append(f"  recommended: {d['recommend']['why']}")
    estimated = sum(r["estimated"] for r in rows)
    if estimated:
        lines.append(f"  estimates: {estimated} cut sample(s) judged from incomplete facts (text cut before "
                     f"tokenizing, or an encode store without source facts): their media past the cut are "
                     f"unknown and a target is assumed before the cut")
    return lines


def plot(path: str | Path, png: str | Path) -> None:
    """Fill per pack, segments per pack and sample lengths, one row per split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = location(path)
    ledger = _ledger(path, STATS_COLUMNS)
    size = int(_settings(path)["pack_size"])
    splits = sorted(set(ledger.column("split").to_pylist()))
    fig, axes = plt.subplots(len(splits) or 1, 3, figsize=(13, 3.2 * max(1, len(splits))), squeeze=False)
    for row, split in zip(axes, splits):
        a = split_arrays(ledger, split)
        n = int(a["pack"].max()) + 1 if a["pack"].size else 0
        fill = np.bincount(a["pack"], weights=a["lengths"], minlength=n) / size if n else np.zeros(0)
        row[0].hist(fill, bins=40, range=(0, 1))
        row[0].set_title(f"{split}: fill per pack")
        row[1].hist(np.bincount(a["pack"], minlength=n) if n else [], bins=30)
        row[1].set_title(f"{split}: segments per pack")
        row[2].hist(a["lengths"], bins=50)
        row[2].set_title(f"{split}: sample length (tokens)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
