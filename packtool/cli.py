"""The ``packtool`` command: a thin Typer layer. Options are parsed into :mod:`packtool.settings` (defaults come
from there), the library does the work, and every :class:`~packtool.errors.PacktoolError` or I/O error becomes
one line on stderr starting with ``packtool``."""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import typer

from packtool.errors import ConfigError, LimitError, PacktoolError
from packtool.settings import (
    Algorithm,
    AlignFor,
    EncodeSettings,
    PlanSettings,
    Preset,
    RunOptions,
    choices,
    default,
    resolve_align,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline global sequence packing of Energon multimodal SFT datasets.")

T = TypeVar("T")
E, P, R = EncodeSettings, PlanSettings, RunOptions


#: The errno of an OSError subclass raised without one.
_ERRNO_OF = {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES, IsADirectoryError: errno.EISDIR,
             NotADirectoryError: errno.ENOTDIR, FileExistsError: errno.EEXIST}


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"packtool: error: {message}", err=True)
    raise typer.Exit(code)


def _one_line(call: Callable[[], T]) -> T:
    """Run ``call``; user-caused errors (and failed I/O: no space, read-only folders) exit with one line."""
    try:
        return call()
    except PacktoolError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _fail(message + (f"; pass --{exc.option.replace('_', '-')} to go ahead" if exc.option else ""),
              code=3 if isinstance(exc, LimitError) else 2)
    except OSError as exc:
        # a library may raise e.g. FileNotFoundError(path) with neither errno nor file name set (pyarrow does)
        bare = exc.strerror is None and len(exc.args) == 1 and isinstance(exc.args[0], str)
        reason = exc.strerror or (os.strerror(_ERRNO_OF[type(exc)]) if type(exc) in _ERRNO_OF else None) \
            or errno.errorcode.get(exc.errno or 0, "I/O error")
        where = exc.filename or (exc.args[0] if bare else None)
        _fail(f"{reason}" + (f" ({where})" if where else ""))
    raise AssertionError("unreachable")


def _version(value: bool) -> None:
    if value:
        from packtool import __version__

        typer.echo(f"packtool {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print packtool's version and exit.")) -> None:
    """Offline global sequence packing of Energon multimodal SFT datasets."""


@app.command()
def pack(
    source: Path = typer.Argument(..., help="Energon dataset (WebDataset shards + .nv-meta)."),
    output: Path = typer.Argument(..., help="Output folder: a packed Energon dataset."),
    tokenizer: Path = typer.Option(..., help="Local Hugging Face model folder (tokenizer, chat template, "
                                             "optional preprocessor_config.json)."),
    pack_size: int = typer.Option(..., help="Tokens per pack."),
    split: list[str] | None = typer.Option(None, help="Split to pack (repeatable); default: all in split.yaml."),
    algorithm: str = typer.Option(default(P, "algorithm"), help=", ".join(choices(Algorithm))),
    balanced_delta: int = typer.Option(default(P, "balanced_delta"), help="Extra packs for balanced_greedy_knapsack."),
    align: int | None = typer.Option(None, help="Per-segment alignment (default: from --cp-size etc.)."),
    cp_size: int = typer.Option(1, min=1, help="Context-parallel size (align = 2·cp when cp > 1)."),
    tp_size: int = typer.Option(1, min=1, help="Tensor-parallel size (with --sequence-parallel)."),
    sequence_parallel: bool = typer.Option(False, help="Sequence parallelism (align includes cp·tp)."),
    align_for: str = typer.Option("megatron", help=", ".join(choices(AlignFor)) + ": whose rule derives the "
                                                   "alignment from the parallel sizes: megatron (2·cp, cp·tp with "
                                                   "SP) or nemo-rl (make_sequence_length_divisible_by, tp·cp·2)."),
    max_segments: int | None = typer.Option(None, help="At most this many samples per pack."),
    max_images: int | None = typer.Option(None, help="At most this many media items (images, videos, audio) "
                                                        "per pack."),
    max_image_tokens: int | None = typer.Option(None, help="At most this many media tokens per pack."),
    video_fps: float | None = typer.Option(default(E, "video_fps"), help="Sample video frames at this rate "
                                                                            "(overrides the model folder)."),
    video_frames: int | None = typer.Option(default(E, "video_frames"), help="Sample this many frames per video."),
    video_min_frames: int | None = typer.Option(default(E, "video_min_frames"),
                                                   help="Fewest frames rate sampling keeps."),
    video_max_frames: int | None = typer.Option(default(E, "video_max_frames"),
                                                   help="Most frames rate sampling keeps."),
    video_min_pixels: int | None = typer.Option(default(E, "video_min_pixels"),
                                                   help="Override the video processor's min pixels per frame."),
    video_max_pixels: int | None = typer.Option(default(E, "video_max_pixels"),
                                                   help="Override the video processor's max pixels per frame."),
    audio_max_seconds: float | None = typer.Option(default(E, "audio_max_seconds"),
                                                   help="Cut audio clips to this many seconds (Nemotron Omni)."),
    overlong: str = typer.Option(default(E, "overlong"), help="truncate (cut at a safe boundary) or drop."),
    min_pixels: int | None = typer.Option(None, help="Override the processor's min_pixels."),
    max_pixels: int | None = typer.Option(None, help="Override the processor's max_pixels."),
    image_tokens: int | None = typer.Option(None, help="Fixed tokens per image (non-Qwen models)."),
    adapter: str | None = typer.Option(None, help="Custom adapter module:function."),
    allow_pickle: bool = typer.Option(default(E, "allow_pickle"),
                                      help="Read pickled media lists (through a restricted unpickler)."),
    pixel_limit: int = typer.Option(default(E, "pixel_limit"), help="Images with more pixels are quarantined."),
    max_sample_bytes: int = typer.Option(default(E, "max_sample_bytes"),
                                         help="Samples with more bytes (read, or media written) are "
                                              "quarantined."),
    max_sample_pixels: int = typer.Option(default(E, "max_sample_pixels"),
                                          help="Samples whose media give a processor more decoded pixels (images "
                                               "and frames together) are quarantined."),
    max_turns: int = typer.Option(default(E, "max_turns"), help="Conversations with more messages are "
                                                                "quarantined."),
    media_tokens: str = typer.Option(default(E, "media_tokens"), help="rule (packtool's exact rules from media "
                                                                      "headers) or processor (the model folder's "
                                                                      "own processor on every sample; any family, "
                                                                      "slower)."),
    media_check: str = typer.Option(default(E, "media_check"), help="decode (prove every image decodes) or "
                                                                    "header (size only)."),
    caption_prompt: str = typer.Option(default(E, "caption_prompt"), help="User text for captioning datasets."),
    template_date: str = typer.Option(default(E, "template_date"), help="Date the chat template sees "
                                                                        "(strftime_now), fixed for reproducible "
                                                                        "output."),
    preset: str | None = typer.Option(None, help="Named conventions: " + ", ".join(choices(Preset)) + "."),
    target_newline_after_eot: bool = typer.Option(default(E, "target_newline_after_eot"),
                                                  help="Also train on the newline after each end-of-turn token."),
    media_first: bool = typer.Option(default(E, "media_first"), help="Move each turn's images before its text."),
    workers: int | None = typer.Option(None, help="Worker processes (default: all cores)."),
    engine: str = typer.Option(default(R, "engine"), help="local or ray."),
    ray_address: str | None = typer.Option(None, help="Ray cluster address host:port (with --engine ray)."),
    shard_size: str = typer.Option(str(default(P, "shard_size")),
                                   help="Output shard size: bytes (512MB) or a pack count (1000)."),
    seed: int = typer.Option(default(P, "seed"), help="Seed for seeded algorithms."),
    balance_dp: int | None = typer.Option(None, help="Order packs so each group of N ranks balances."),
    strict: bool = typer.Option(default(R, "strict"), help="Stop at the first bad sample."),
    max_error_rate: float = typer.Option(default(R, "max_error_rate"), help="Exit 3 above this share of error "
                                                                           "samples."),
    max_drop_rate: float = typer.Option(default(R, "max_drop_rate"), help="Exit 3 above this share of dropped "
                                                                         "samples."),
    max_truncate_rate: float = typer.Option(default(R, "max_truncate_rate"), help="Exit 3 above this share of "
                                                                                 "truncated samples."),
    max_failures_in_a_row: int = typer.Option(default(R, "max_failures_in_a_row"),
                                              help="Stop at once when this many samples in a row fail (0: never)."),
    max_same_failures: int = typer.Option(default(R, "max_same_failures"),
                                          help="Stop at once when this many samples of a shard range fail for the "
                                               "same reason (0: never)."),
    dry_run: bool = typer.Option(default(R, "dry_run"), help="Stop after planning: ledger and plan statistics."),
    overwrite: bool = typer.Option(default(R, "overwrite"), help="Replace an OUTPUT made with other settings."),
    progress: bool = typer.Option(default(R, "progress"), help="Show progress bars."),
) -> None:
    """Pack SOURCE into OUTPUT."""
    from packtool.build.engine import default_workers
    from packtool.build.workers import pack_engine
    from packtool.settings import PackSettings

    def build() -> tuple[PackSettings, RunOptions]:
        if preset == "megatron-bridge-qwen-vl" and cp_size > 1:
            raise ConfigError("--preset megatron-bridge-qwen-vl with --cp-size > 1: Megatron-Bridge's Qwen2.5-VL "
                              "model does not split sequences across context-parallel ranks (its recipes use CP 1); "
                              "pack with --cp-size 1 and train with context parallel 1")
        aligned = resolve_align(align, align_for, cp_size=cp_size, tp_size=tp_size,  # type: ignore[arg-type]
                                sequence_parallel=sequence_parallel)
        enc = EncodeSettings(
            tokenizer=str(tokenizer.resolve() if tokenizer.exists() else tokenizer),  # unresolved: a model id?
            pack_size=pack_size, align=aligned, overlong=overlong,  # type: ignore[arg-type]
            min_pixels=min_pixels, max_pixels=max_pixels, image_tokens=image_tokens, max_images=max_images,
            max_image_tokens=max_image_tokens, adapter=adapter, allow_pickle=allow_pickle, pixel_limit=pixel_limit,
            media_check=media_check, caption_prompt=caption_prompt, template_date=template_date,  # type: ignore[arg-type]
            max_sample_bytes=max_sample_bytes, max_sample_pixels=max_sample_pixels, max_turns=max_turns,
            target_newline_after_eot=target_newline_after_eot,
            media_first=media_first, preset=preset, video_fps=video_fps, video_frames=video_frames,  # type: ignore[arg-type]
            video_min_frames=video_min_frames, video_max_frames=video_max_frames, video_min_pixels=video_min_pixels,
            video_max_pixels=video_max_pixels, audio_max_seconds=audio_max_seconds,
            media_tokens=media_tokens,  # type: ignore[arg-type]
        )
        plan = PlanSettings(algorithm=algorithm, balanced_delta=balanced_delta, max_segments=max_segments,  # type: ignore[arg-type]
                            seed=seed, shard_size=shard_size, balance_dp=balance_dp)  # type: ignore[arg-type]
        options = RunOptions(workers=workers or default_workers(), engine=engine, ray_address=ray_address,  # type: ignore[arg-type]
                             strict=strict, dry_run=dry_run, overwrite=overwrite, progress=progress,
                             max_error_rate=max_error_rate, max_drop_rate=max_drop_rate,
                             max_truncate_rate=max_truncate_rate, max_failures_in_a_row=max_failures_in_a_row,
                             max_same_failures=max_same_failures)
        return PackSettings(enc, plan, tuple(split or ())), options

    settings, options = _one_line(build)
    from packtool.build.pipeline import check_inputs
    from packtool.build.pipeline import pack as run_pack

    _one_line(lambda: check_inputs(source, output, settings))  # what needs no sample fails before any worker
    with ExitStack() as stack:
        pool = _one_line(lambda: stack.enter_context(pack_engine(source, settings.encode, options)))

        result = _one_line(lambda: run_pack(source, output, settings, options, started_engine=pool))
    from packtool.verify.stats import compute

    fills = compute(result.output)["splits"]
    for name, c in result.counts.items():
        f = fills.get(name, {})
        typer.echo(f"{name}: {c['samples']} samples -> {result.packs.get(name, 0)} packs "
                   f"(L1 bound {f.get('l1_bound', 0)}, fill {f.get('fill', 0.0):.4f}; packed {c['packed']}, "
                   f"truncated {c['truncated']}, dropped {c['dropped']}, error {c['error']})")
    if result.seconds:
        typer.echo("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    typer.echo(f"wrote {result.output}" + (" (dry run: ledger only)" if dry_run else ""))
    if result.over_limits:
        flag = {"error": "--max-error-rate", "dropped": "--max-drop-rate", "truncated": "--max-truncate-rate"}
        _fail("; ".join(f"{status} rate {n / total:.2%} ({n} of {total}) exceeds {flag[status]} {limit:.2%}"
                        for status, n, total, limit in result.over_limits)
              + f" (see {result.output / 'ledger.parquet'})", code=3)


@app.command()
def stats(
    path: Path = typer.Argument(..., help="A packed OUTPUT folder, or a ledger.parquet."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Path | None = typer.Option(None, help="Write a PNG: fill, segments per pack, lengths."),
    compare: str | None = typer.Option(None, help="Replan the ledger with these algorithms (comma-separated)."),
    pack_size: int | None = typer.Option(None, help="Pack size for --compare (default: the run's)."),
    balance_dp: int | None = typer.Option(None, help="Report DP-group imbalance for this many ranks."),
) -> None:
    """Report how well OUTPUT packed."""
    from packtool.verify import stats as st

    def run() -> dict:
        report = st.compute(path, balance_dp=balance_dp, pack_size=pack_size)
        if compare:
            report["compare"] = st.compare(path, [a.strip() for a in compare.split(",") if a.strip()],
                                           pack_size=pack_size)
        if plot is not None:
            st.plot(path, plot)
        return report

    report = _one_line(run)
    typer.echo(json.dumps(report, indent=1) if as_json else st.format_report(report))


@app.command()
def verify(
    output: Path = typer.Argument(..., help="A packed OUTPUT folder."),
    source: Path | None = typer.Option(None, help="Also check media bytes and tokens against SOURCE."),
    workers: int | None = typer.Option(None, help="Worker processes (default: all cores)."),
    engine: str = typer.Option(default(R, "engine"), help="local or ray."),
    ray_address: str | None = typer.Option(None, help="Ray cluster address host:port (with --engine ray)."),
    retokenize: bool = typer.Option(False, help="Also encode every segment's text again where the pack's array "
                                                "digest already proves its tokens intact."),
) -> None:
    """Check OUTPUT: every pack well-formed, every source sample accounted for, metadata consistent."""
    from packtool.build.engine import default_workers
    from packtool.verify.packs import verify_output

    problems = _one_line(lambda: verify_output(
        output, source=source, workers=workers or default_workers(), engine=engine,  # type: ignore[arg-type]
        ray_address=ray_address, retokenize=retokenize))
    if problems:
        for p in problems:
            typer.echo(p, err=True)
        _fail(f"{len(problems)} problem(s) in {output}", code=1)
    typer.echo(f"{output}: ok")


@app.command()
def inspect(
    output: Path = typer.Argument(..., help="A packed OUTPUT folder."),
    key: str | None = typer.Argument(None, help="Pack key (default: the first pack)."),
    split: str | None = typer.Option(None, help="Split to look in (default: the first)."),
) -> None:
    """Show one pack: segments, decoded text with targets marked, media."""
    from packtool.verify.inspect import inspect_pack

    typer.echo(_one_line(lambda: inspect_pack(output, key=key, split=split)))


def main() -> None:
    """The ``packtool`` command. Once it has returned and its output is flushed, the process ends without the
    interpreter's teardown: everything a command writes is committed (and its workers gone) by then, and tearing
    down the modules a run loads (numpy, pyarrow, the pool's bookkeeping) adds a tenth of a second to every run."""
    try:
        app()
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):  # what sys.exit would print
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    main()
