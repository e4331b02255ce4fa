"""``packtool stats OUTPUT --html report.html``: the stats report as one self-contained HTML file (its plots are
PNG images inside it, no file or network beside it), for people who would rather look than read."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np

from packtool.commit import commit_bytes

_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.4em; }
th, td { border: 1px solid #bbb; padding: 3px 9px; text-align: right; }
th { background: #eee; } td.l { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; }
.note { color: #555; font-size: 0.9em; }
"""


#: Marks on the page how many of its images the browser decoded (``data-images="decoded/all"`` on the body).
_CHECK = ("<script>window.addEventListener('load', function () { var i = document.images, n = 0;"
          " for (var k = 0; k < i.length; k++) { if (i[k].complete && i[k].naturalWidth > 0) { n++; } }"
          " document.body.setAttribute('data-images', n + '/' + i.length); });</script>")


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return base64.b64encode(buf.getvalue()).decode()


def _table(head: list[str], rows: list[list[Any]], left: int = 0) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td{' class=l' if i < left else ''}>{html.escape(str(c))}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _plots(path: Path, split: str, size: int, decide: dict | None) -> str:
    """Fill per pack, samples per pack, and the source lengths with the candidate sizes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from packtool.packer.ledger import read_ledger
    from packtool.verify.candidates import load_rows
    from packtool.verify.stats import split_arrays

    ledger = read_ledger(path, ["split", "status", "reason", "tokens", "images", "image_tokens", "pack",
                                "source_tokens"])
    a = split_arrays(ledger, split)
    n = int(a["pack"].max()) + 1 if a["pack"].size else 0
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    fill = np.bincount(a["pack"], weights=a["lengths"], minlength=n) / size if n else np.zeros(0)
    axes[0].hist(fill, bins=40, range=(0, 1))
    axes[0].set_title("fill per pack")
    axes[1].hist(np.bincount(a["pack"], minlength=n) if n else [], bins=30)
    axes[1].set_title("samples per pack")
    folder = path if path.is_dir() else path.parent
    rows = ledger.filter(ledger.column("split").to_numpy(zero_copy_only=False) == split).to_pydict()
    src = load_rows(folder, split, rows)
    axes[2].hist(src.length[~src.error], bins=50)
    for c in (decide or {}).get("candidates", []):
        axes[2].axvline(c["pack_size"], color="red", linestyle="--")
    axes[2].set_title("source tokens per sample (candidates dashed)")
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return f'<img alt="plots of {html.escape(split)}" src="data:image/png;base64,{data}">'


def _candidate_plots(split: str, decide: dict) -> str:
    """Every candidate pack size side by side: fill (and the L1 bound's), packs, samples cut, samples per pack, and
    the share of packs each epoch leaves over (the warning line dashed); the recommended size, if any, marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from packtool.verify.candidates import LEFTOVER_WARN, leftover_share

    cands = [c for c in decide["candidates"] if c["packs"]]
    if not cands:
        return ""
    x = [c["pack_size"] for c in cands]
    fig, axes = plt.subplots(1, 5, figsize=(16, 3.2))
    axes[0].plot(x, [c["fill"] for c in cands], "o-", label="packs")
    axes[0].plot(x, [c["tokens"] / (c["l1_bound"] * c["pack_size"]) if c["l1_bound"] else 0 for c in cands], "x--",
                 label="L1 bound")
    axes[0].set_title("fill")
    axes[0].legend(fontsize=7)
    axes[1].plot(x, [c["packs"] for c in cands], "o-", label="packs")
    axes[1].plot(x, [c["l1_bound"] for c in cands], "x--", label="L1 bound")
    axes[1].set_title("packs")
    axes[1].legend(fontsize=7)
    axes[2].plot(x, [c["truncated"] for c in cands], "o-", label="truncated")
    axes[2].plot(x, [c["dropped"] for c in cands], "x-", label="dropped")
    axes[2].set_title("samples cut")
    axes[2].legend(fontsize=7)
    axes[3].errorbar(x, [c["samples_per_pack"]["mean"] for c in cands],
                     yerr=[c["samples_per_pack"]["std"] for c in cands], fmt="o-", capsize=3)
    axes[3].set_title("samples/pack (mean ± std)")
    axes[4].plot(x, [100 * leftover_share(c) for c in cands], "o-")
    axes[4].axhline(100 * LEFTOVER_WARN, color="red", linestyle="--")
    axes[4].set_title(f"% packs left over (batch {cands[0]['global_batch_packs']})")
    chosen = (decide.get("recommend") or {}).get("choice")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x], fontsize=7)
        ax.set_xlabel("pack size", fontsize=8)
        if chosen:
            ax.axvline(chosen["pack_size"], color="green", alpha=0.5)
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return f'<img alt="candidate pack sizes of {html.escape(split)}" src="data:image/png;base64,{data}">'


def render(path: str | Path, report: dict) -> str:
    """The HTML text of ``report`` (from :func:`packtool.verify.stats.compute` plus ``decide``) for OUTPUT ``path``."""
    from packtool.verify.candidates import steps_text

    path = Path(path)
    parts = [f"<h1>packtool stats: {html.escape(str(path))}</h1>",
             f"<p>pack size {report['pack_size']}, align {report['align']}, algorithm "
             f"{html.escape(str(report['algorithm']))}</p>"]
    for split, e in report["splits"].items():
        parts.append(f"<h2>{html.escape(split)}</h2>")
        parts.append(_table(["samples", *e["status"], "packs", "L1 bound", "fill", "samples/pack (mean)"],
                            [[e["samples"], *e["status"].values(), e["packs"], e["l1_bound"], f"{e['fill']:.4f}",
                              f"{e['segments_per_pack']['mean']:.2f}"]]))
        if e["reasons"]:
            parts.append(_table(["status", "count", "reason"], [[r["status"], r["count"], r["reason"]]
                                                                for r in e["reasons"]], left=1))
        d = report.get("decide", {}).get(split)
        if d is not None:
            t, m = d["source"]["tokens"], d["source"]["media"]
            parts.append("<h3>source, before any cut</h3>")
            parts.append(_table(["", "mean", "p50", "p90", "p99", "max"],
                                [["tokens/sample", f"{t['mean']:.0f}", t["p50"], t["p90"], t["p99"], t["max"]],
                                 ["media/sample", f"{m['mean']:.2f}", m["p50"], m["p90"], m["p99"], m["max"]]],
                                left=1))
            parts.append("<h3>candidate pack sizes</h3>")
            parts.append(_table(
                ["pack size", "packs", "fill", "truncated", "dropped", "samples/pack", "media/pack", "batch"],
                [[c["pack_size"], c["packs"], f"{c['fill']:.4f}", c["truncated"], c["dropped"],
                  f"{c['samples_per_pack']['mean']:.2f} ± {c['samples_per_pack']['std']:.2f}",
                  f"{c['media_per_pack']['mean']:.2f}", steps_text(c)] for c in d["candidates"]]))
            parts.append(_candidate_plots(split, d))
            rec = d.get("recommend")
            if rec is not None:
                parts.append(f"<p><b>recommended:</b> {html.escape(rec['why'])}</p>")
        parts.append(_plots(path, split, int(report["pack_size"]), d))
    parts.append('<p class="note">Written by packtool stats; every figure is inside this file.</p>')
    parts.append(_CHECK)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>packtool stats</title>"
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_html(path: str | Path, report: dict, out: str | Path) -> None:
    """Write the report to ``out`` (one file, atomically)."""
    commit_bytes(Path(out), render(path, report).encode())
