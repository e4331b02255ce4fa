"""The ``packtool`` command: a thin Typer layer over the pipeline, stats, verify and inspect."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline global sequence packing of Energon multimodal SFT datasets.")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"packtool: error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def pack(
    source: Path = typer.Argument(..., help="Energon dataset (WebDataset shards + .nv-meta)."),
    output: Path = typer.Argument(..., help="Output folder: a packed Energon dataset."),
    tokenizer: Path = typer.Option(..., help="Local Hugging Face model folder (tokenizer, chat template, "
                                             "optional preprocessor_config.json)."),
    pack_size: int = typer.Option(..., min=1, help="Tokens per pack."),
    split: Optional[list[str]] = typer.Option(None, help="Split to pack (repeatable); default: all in split.yaml."),
    algorithm: str = typer.Option("bfd", help="bfd, ffd, greedy_knapsack, balanced_greedy_knapsack, "
                                              "first_fit_shuffle, sequential."),
    balanced_delta: int = typer.Option(0, min=0, help="Extra packs for balanced_greedy_knapsack."),
    align: Optional[int] = typer.Option(None, min=1, help="Per-segment alignment (default: from --cp-size etc.)."),
    cp_size: int = typer.Option(1, min=1, help="Context-parallel size (align = 2·cp when cp > 1)."),
    tp_size: int = typer.Option(1, min=1, help="Tensor-parallel size (with --sequence-parallel)."),
    sequence_parallel: bool = typer.Option(False, help="Sequence parallelism (align includes cp·tp)."),
    max_segments: Optional[int] = typer.Option(None, min=1, help="At most this many samples per pack."),
    max_images: Optional[int] = typer.Option(None, min=1, help="At most this many images per pack."),
    max_image_tokens: Optional[int] = typer.Option(None, min=1, help="At most this many image tokens per pack."),
    overlong: str = typer.Option("truncate", help="truncate (cut at a safe boundary) or drop."),
    min_pixels: Optional[int] = typer.Option(None, min=1, help="Override the processor's min_pixels."),
    max_pixels: Optional[int] = typer.Option(None, min=1, help="Override the processor's max_pixels."),
    image_tokens: Optional[int] = typer.Option(None, min=1, help="Fixed tokens per image (non-Qwen models)."),
    adapter: Optional[str] = typer.Option(None, help="Custom adapter module:function."),
    allow_pickle: bool = typer.Option(False, help="Read pickled jpgs lists (through a global-refusing unpickler)."),
    pixel_limit: int = typer.Option(89_478_485, min=1, help="Images with more pixels are quarantined."),
    media_check: str = typer.Option("decode", help="decode (prove every image decodes) or header (size only)."),
    caption_prompt: str = typer.Option("", help="User text for captioning datasets."),
    template_date: str = typer.Option("2026-01-01", help="Date the chat template sees (strftime_now), fixed for "
                                                         "reproducible output."),
    workers: Optional[int] = typer.Option(None, min=1, help="Local worker processes (default: all cores)."),
    engine: str = typer.Option("local", help="local or ray."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster address (with --engine ray)."),
    shard_size: str = typer.Option("512MB", help="Output shard size: bytes (512MB) or a pack count (1000)."),
    seed: int = typer.Option(0, help="Seed for seeded algorithms."),
    balance_dp: Optional[int] = typer.Option(None, min=1, help="Order packs so each group of N ranks balances."),
    strict: bool = typer.Option(False, help="Stop at the first bad sample."),
    max_error_rate: float = typer.Option(0.01, min=0.0, max=1.0, help="Exit non-zero above this error rate."),
    dry_run: bool = typer.Option(False, help="Stop after planning: ledger and plan statistics only."),
    overwrite: bool = typer.Option(False, help="Replace an OUTPUT made with other settings."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Pack SOURCE into OUTPUT."""
    from packtool.encode import EncodeConfigError, EncodeSettings
    from packtool.engine import default_workers
    from packtool.errors import PacktoolError
    from packtool.pipeline import PackError, PackSettings, pack as run_pack
    from packtool.plan import ALGORITHMS, derive_align
    from packtool.sources import SampleError, SourceError

    if algorithm not in ALGORITHMS:
        _fail(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    if overlong not in ("truncate", "drop"):
        _fail("--overlong must be truncate or drop")
    if media_check not in ("decode", "header"):
        _fail("--media-check must be decode or header")
    if engine not in ("local", "ray"):
        _fail("--engine must be local or ray")
    aligned = align or derive_align(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel)
    if pack_size < aligned:
        _fail(f"--pack-size {pack_size} is smaller than the alignment {aligned}")
    enc = EncodeSettings(
        tokenizer=str(tokenizer.resolve()), pack_size=pack_size, align=aligned, overlong=overlong,
        min_pixels=min_pixels, max_pixels=max_pixels, image_tokens=image_tokens, max_images=max_images,
        max_image_tokens=max_image_tokens, adapter=adapter, allow_pickle=allow_pickle, pixel_limit=pixel_limit,
        media_check=media_check, caption_prompt=caption_prompt, template_date=template_date,
    )
    settings = PackSettings(encode=enc, splits=tuple(split or ()), algorithm=algorithm,
                            balanced_delta=balanced_delta, max_segments=max_segments, seed=seed,
                            shard_size=shard_size, balance_dp=balance_dp, strict=strict, dry_run=dry_run)
    try:
        result = run_pack(source, output, settings, workers=workers or default_workers(), engine=engine,
                          ray_address=ray_address, overwrite=overwrite, progress=progress)
    except (PackError, SourceError, EncodeConfigError, SampleError, PacktoolError) as exc:
        _fail(str(exc))
    total = sum(c["samples"] for c in result.counts.values())
    errors = sum(c["error"] for c in result.counts.values())
    from packtool.stats import compute

    fills = compute(result.output)["splits"]
    for split, c in result.counts.items():
        f = fills.get(split, {})
        typer.echo(f"{split}: {c['samples']} samples -> {result.packs.get(split, 0)} packs "
                   f"(L1 bound {f.get('l1_bound', 0)}, fill {f.get('fill', 0.0):.4f}; packed {c['packed']}, "
                   f"truncated {c['truncated']}, dropped {c['dropped']}, error {c['error']})")
    typer.echo(f"wrote {result.output}" + (" (dry run: ledger only)" if dry_run else ""))
    if total and errors / total > max_error_rate:
        _fail(f"error rate {errors / total:.2%} exceeds --max-error-rate {max_error_rate:.2%} "
              f"(see {result.output / 'ledger.parquet'})", code=3)


@app.command()
def stats(
    path: Path = typer.Argument(..., help="A packed OUTPUT folder, or a ledger.parquet."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG: fill, segments per pack, lengths."),
    compare: Optional[str] = typer.Option(None, help="Replan the ledger with these algorithms (comma-separated)."),
    pack_size: Optional[int] = typer.Option(None, help="Pack size for --compare (default: the run's)."),
    balance_dp: Optional[int] = typer.Option(None, help="Report DP-group imbalance for this many ranks."),
) -> None:
    """Report how well OUTPUT packed."""
    from packtool import stats as st

    try:
        report = st.compute(path, balance_dp=balance_dp)
        if compare:
            report["compare"] = st.compare(path, [a.strip() for a in compare.split(",") if a.strip()],
                                           pack_size=pack_size)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    if plot is not None:
        st.plot(path, plot)
    typer.echo(json.dumps(report, indent=1) if as_json else st.format_report(report))


@app.command()
def verify(
    output: Path = typer.Argument(..., help="A packed OUTPUT folder."),
    source: Optional[Path] = typer.Option(None, help="Also check media bytes and tokens against SOURCE."),
) -> None:
    """Check OUTPUT: every pack well-formed, every source sample accounted for, metadata consistent."""
    from packtool.verify import verify_output

    problems = verify_output(output, source=source)
    if problems:
        for p in problems:
            typer.echo(p, err=True)
        _fail(f"{len(problems)} problem(s) in {output}", code=1)
    typer.echo(f"{output}: ok")


@app.command()
def inspect(
    output: Path = typer.Argument(..., help="A packed OUTPUT folder."),
    key: Optional[str] = typer.Argument(None, help="Pack key (default: the first pack)."),
    split: Optional[str] = typer.Option(None, help="Split to look in (default: the first)."),
) -> None:
    """Show one pack: segments, decoded text with targets marked, media."""
    from packtool.inspect import inspect_pack

    try:
        typer.echo(inspect_pack(output, key=key, split=split))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        _fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
