"""The ``packtool`` command: a thin Typer layer. Options are parsed into :mod:`packtool.settings` (defaults come
from there), the library does the work, and every :class:`~packtool.errors.PacktoolError` or I/O error becomes
one line on stderr starting with ``packtool``."""

from __future__ import annotations

import difflib
import errno
import inspect as pyinspect
import json
import os
import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

import typer
import typer.main
from typer._click import core as click_core
from typer._click import exceptions as click  # the Click that Typer ships

from packtool.errors import LimitError, PacktoolError
from packtool.settings import RunOptions, ShardSize, default, help_of

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"max_content_width": 80},
                  help="Offline global sequence packing of Energon multimodal SFT datasets.")

if TYPE_CHECKING:
    from packtool.packer.pipeline import PackResult

T = TypeVar("T")


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
    except Exception as exc:
        from packtool.storage import object_store_error

        store = object_store_error(exc)
        if store is None:
            raise
        _fail(store)
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


def _option_type(kind: Any) -> Any:
    """The type a generated option parses from the command line: a choice or a shard size as text (the settings
    check it and name the choices), a list as a repeatable option, an optional as its type or nothing."""
    if get_origin(kind) in (Union, UnionType):
        args = [a for a in get_args(kind) if a is not type(None)]
        if any(get_origin(a) is list for a in args):
            return list[str] | None
        inner = _option_type(args[0]) if len(args) == 1 else str
        return inner | None if type(None) in get_args(kind) else inner
    return str if get_origin(kind) is Literal or kind is ShardSize else kind


def _pack_parameters() -> pyinspect.Signature:
    """``pack``'s parameters, generated from the run's keys (:data:`packtool.config.SPEC`: each setting's name,
    type, default and help declared once): SOURCE and OUTPUT as arguments, every other key an option, and the
    command's own two (``--config``, ``--print-config``)."""
    from packtool import config as cfg

    def param(name: str, kind: Any, info: Any) -> pyinspect.Parameter:
        return pyinspect.Parameter(name, pyinspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)

    out = [pyinspect.Parameter("ctx", pyinspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    first = ("source", "output", "tokenizer", "pack_size", "split")  # what every run gives, listed first
    for key in sorted(cfg.SPEC.values(), key=lambda k: first.index(k.name) if k.name in first else len(first)):
        if key.name in ("source", "output"):
            out.append(param(key.name, str | None, typer.Argument(None, help=key.help)))
            if key.name == "output":
                out += [param("config", Path | None, typer.Option(None, help="YAML file of settings (flags "
                                                                            "override it).")),
                        param("print_config", bool, typer.Option(False, help="Print the run's settings as a config "
                                                                             "file and stop."))]
            continue
        value = None if isinstance(key.default, tuple) else key.default
        out.append(param(key.name, _option_type(key.kind), typer.Option(value, help=key.help)))
    return pyinspect.Signature(out)


def pack(ctx: typer.Context, **params: Any) -> None:
    """Pack SOURCE into OUTPUT."""
    from packtool import config as cfg
    from packtool.packer.workers import pack_engine

    config, print_config = params["config"], params["print_config"]

    def given(name: str) -> bool:  # typed on the command line (even if equal to the default)
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    explicit = {name: value for name, value in ctx.params.items()
                if name not in ("config", "print_config") and given(name)}

    def build() -> cfg.PackRun:
        file = cfg.read(config) if config is not None else None
        if file and file.get("source") is not None and "source" in explicit and "output" not in explicit:
            explicit["output"] = explicit.pop("source")  # one argument beside a config file naming the source
        values, given = cfg.merge(file, explicit)
        return cfg.build(values, given, cfg.origins(file, explicit, config), need_output=not print_config)

    run = _one_line(build)
    if print_config:
        typer.echo(cfg.dump(run.config), nl=False)
        return
    settings, options, out = run.settings, run.options, run.output
    from packtool.packer.sources.files import resolve_source

    src = _one_line(lambda: resolve_source(run.source, media_dir=run.media_dir,
                                           absolute_media_paths=run.absolute_media_paths))
    from packtool.packer.pipeline import check_inputs
    from packtool.packer.pipeline import pack as run_pack

    opened = _one_line(lambda: check_inputs(src, out, settings))  # what needs no sample fails before any worker
    with ExitStack() as stack:  # the workers start first: their start-ups overlap this process's imports
        pool = _one_line(lambda: stack.enter_context(pack_engine(opened.root, settings.encode, options)))

        result = _one_line(lambda: run_pack(src, out, settings, options, started_engine=pool))
    _report(result, dry_run=options.dry_run)


def _report(result: PackResult, *, dry_run: bool) -> None:
    """What a finished pack run prints: each split's counts and fill, the stage times, and (exit 3) the limits it
    went over, with their top reasons."""
    from packtool.verify.stats import compute, mixture_report

    if result.fills:  # this invocation planned: its fills come from the plans (no ledger read but a mixture's)
        fills: dict = {name: vars(f) for name, f in result.fills.items()}
    else:  # a run found finished: its fills are read back from the ledger
        fills = compute(result.output)["splits"]
    for name, c in result.counts.items():
        f = fills.get(name, {})
        typer.echo(f"{name}: {c['samples']} samples -> {result.packs.get(name, 0)} packs "
                   f"(L1 bound {f.get('l1_bound', 0)}, fill {f.get('fill', 0.0):.4f}; packed {c['packed']}, "
                   f"truncated {c['truncated']}, dropped {c['dropped']}, error {c['error']})")
        for line in mixture_report(result.output, name, f):  # each dataset against its declared share
            typer.echo(line)
    if result.seconds:
        typer.echo("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in result.seconds.items()))
    typer.echo(f"wrote {result.output}" + (" (dry run: ledger only)" if dry_run else ""))
    if result.over_limits:
        flag = {"error": "--max-error-rate", "dropped": "--max-drop-rate", "truncated": "--max-truncate-rate"}
        _fail("; ".join(f"{status} rate {n / total:.2%} ({n} of {total}) exceeds {flag[status]} {limit:.2%}"
                        for status, n, total, limit in result.over_limits)
              + f" (see {result.output / 'ledger.parquet'})"
              + (f"; {why}" if (why := _top_reasons(result.output, [s for s, *_ in result.over_limits])) else "")
              + f"; `packtool failures {result.output}` lists them", code=3)


pack.__signature__ = _pack_parameters()  # type: ignore[attr-defined]
app.command()(pack)


def _top_reasons(output: Path, statuses: list[str]) -> str:
    from packtool.verify.failures import top_reasons

    try:
        return top_reasons(output, statuses)
    except PacktoolError:
        return ""


@app.command()
def stats(
    path: str = typer.Argument(..., help="A packed OUTPUT folder, or a ledger.parquet."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Path | None = typer.Option(None, help="Write a PNG: fill, segments per pack, lengths."),
    html: Path | None = typer.Option(None, help="Write one self-contained HTML report with the plots."),
    candidates: str | None = typer.Option(None, help="Pack sizes to judge from the source lengths, e.g. "
                                                     "4096,8192 (no encoding again)."),
    dp: int | None = typer.Option(None, help="Data-parallel ranks, for the global batch and steps per epoch "
                                             "(default: 1, said as an assumption)."),
    recommend: bool = typer.Option(False, help="Choose a pack size (among --candidates, default 1024 to 32768) "
                                               "and global batch for --tokens-per-step or --global-batch-samples, "
                                               "and say why."),
    tokens_per_step: int | None = typer.Option(None, help="Target tokens per optimizer step, for --recommend."),
    global_batch_samples: int | None = typer.Option(None, help="Target samples per optimizer step, for "
                                                               "--recommend."),
    micro_batches: int = typer.Option(1, help="Micro-batches per step per rank (gradient accumulation)."),
    micro_batch_size: int = typer.Option(1, help="Packs per micro-batch."),
    algorithm: str | None = typer.Option(None, help="Algorithm for --candidates (default: the run's)."),
    compare: str | None = typer.Option(None, help="Replan the ledger with these algorithms (comma-separated)."),
    pack_size: int | None = typer.Option(None, help="Pack size for --compare (default: the run's)."),
    balance_dp: int | None = typer.Option(None, help="Report DP-group imbalance for this many ranks."),
) -> None:
    """Report how well OUTPUT packed; judge other pack sizes and batch sizes."""
    from packtool.verify import stats as st

    def run() -> dict:
        report = st.compute(path, balance_dp=balance_dp, pack_size=pack_size)
        if compare:
            report["compare"] = st.compare(path, [a.strip() for a in compare.split(",") if a.strip()],
                                           pack_size=pack_size)
        if (tokens_per_step is not None or global_batch_samples is not None) and not recommend:
            raise PacktoolError("--tokens-per-step and --global-batch-samples are targets of --recommend; "
                                "add --recommend")
        if recommend and (tokens_per_step is None) == (global_batch_samples is None):
            raise PacktoolError("--recommend needs one target: --global-batch-samples G (the samples per step of "
                                "your unpacked run) or --tokens-per-step T")
        if candidates or html is not None or recommend:
            from packtool.verify.candidates import DEFAULT_SIZES, check_sizes

            align = int(report.get("align") or 1)
            sizes = check_sizes(candidates) if candidates else sorted(
                {s for s in DEFAULT_SIZES if s >= align} | {report["pack_size"]})
            report["decide"] = st.decide(path, sizes, dp=dp, micro_batches=micro_batches,
                                         micro_batch_size=micro_batch_size, algorithm=algorithm,
                                         tokens_per_step=tokens_per_step, global_batch_samples=global_batch_samples)
        if plot is not None:
            st.plot(path, plot)
        if html is not None:
            from packtool.verify.report import write_html

            write_html(path, report, html)
        return report

    report = _one_line(run)
    typer.echo(json.dumps(report, indent=1) if as_json else st.format_report(report))
    _check_shards(path)


@app.command()
def failures(
    path: str = typer.Argument(..., help="A packed OUTPUT folder, or a ledger.parquet."),
    status: list[str] | None = typer.Option(None, help="Only this status (repeatable): error, dropped or "
                                                      "truncated."),
    split: list[str] | None = typer.Option(None, help="Only this split (repeatable)."),
    limit: int = typer.Option(5, help="Samples listed per reason (0: counts only)."),
    all_samples: bool = typer.Option(False, "--all", help="List every sample (no --limit)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the samples that failed, were dropped or truncated: full reasons, split, source shard and key,
    grouped by reason with counts."""
    from packtool.verify.failures import failures as find
    from packtool.verify.failures import format_failures

    report = _one_line(lambda: find(path, status=status, split=split, limit=None if all_samples else limit))
    typer.echo(json.dumps(report, indent=1) if as_json else format_failures(report), nl=as_json)
    _check_shards(path)


def _check_shards(path: str) -> None:
    """Exit 1 with one line when a shard the manifest names is missing or cut short (what the ledger cannot show)."""
    from packtool.verify.extent import shard_problems

    problems = _one_line(lambda: shard_problems(path))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        from packtool.storage import location

        folder = path if location(path).is_dir() else str(location(path).parent)
        _fail(f"the output is damaged: {problems[0]}{more}; the report above is the ledger's; run `packtool verify "
              f"{folder}`", code=1)


@app.command()
def verify(
    output: str = typer.Argument(..., help="A packed OUTPUT folder (or msc://PROFILE/path)."),
    source: str | None = typer.Option(None, help="Also check media bytes and tokens against SOURCE (for a "
                                                 "JSON/Parquet source: the file as it is now, read in place)."),
    workers: int | None = typer.Option(None, help="Worker processes (default: all cores)."),
    engine: str = typer.Option(default(RunOptions, "engine"), help=help_of(RunOptions, "engine")),
    ray_address: str | None = typer.Option(None, help="Ray cluster address host:port (with --engine ray)."),
    retokenize: bool = typer.Option(False, help="Also encode every segment's text again where the pack's array "
                                                "digest already proves its tokens intact."),
) -> None:
    """Check OUTPUT: every pack well-formed, every source sample accounted for, metadata consistent."""
    from packtool.packer.engine import default_workers
    from packtool.packer.sources.files import source_for_verify
    from packtool.verify.packs import verify_output

    checked = None
    if source is not None:
        given = source
        checked = _one_line(lambda: source_for_verify(given, output))
    problems = _one_line(lambda: verify_output(
        output, source=checked, workers=workers or default_workers(), engine=engine,  # type: ignore[arg-type]
        ray_address=ray_address, retokenize=retokenize))
    if problems:
        for p in problems:
            typer.echo(p, err=True)
        _fail(f"{len(problems)} problem(s) in {output}", code=1)
    typer.echo(f"{output}: ok")


@app.command()
def inspect(
    output: str = typer.Argument(..., help="A packed OUTPUT folder."),
    key: str | None = typer.Argument(None, help="Pack key (default: the first pack)."),
    split: str | None = typer.Option(None, help="Split to look in (default: the first)."),
    config: bool = typer.Option(False, "--config", help="Print the settings OUTPUT was packed with, as a "
                                                       "config file for `pack --config`."),
    out: Path | None = typer.Option(None, help="With --config: write the config file here, its local paths "
                                               "relative to its folder (a portable file)."),
) -> None:
    """Show one pack: segments, decoded text with targets marked, media."""
    from packtool.verify.inspect import inspect_pack

    if config:
        from packtool.config import recorded

        if out is None:
            typer.echo(_one_line(lambda: recorded(output)), nl=False)
            return
        target = out
        text = _one_line(lambda: recorded(output, relative_to=target.resolve().parent))
        _one_line(lambda: target.write_text(text))
        typer.echo(f"wrote {target}")
        return
    if out is not None:
        _fail("--out writes the config file: give it with --config")

    typer.echo(_one_line(lambda: inspect_pack(output, key=key, split=split)))


def _usage_line(exc: click.ClickException) -> str:
    """One line for a command line Click refuses: a mistyped option or command names the nearest one."""
    if isinstance(exc, click.NoSuchOption):
        arguments = [p.name for p in (exc.ctx.command.params if exc.ctx is not None else [])
                     if p.param_type_name == "argument" and p.name]
        if exc.option_name.lstrip("-").replace("-", "_") in arguments:
            named = " ".join(a.upper() for a in arguments)
            where = exc.ctx.command_path if exc.ctx is not None else "packtool"
            return (f"{exc.option_name.lstrip('-').upper()} is an argument, not an option: {where} "
                    f"{named} ...")
        near = exc.possibilities or difflib.get_close_matches(exc.option_name, _options_of(exc.ctx), n=1)
        return f"no such option {exc.option_name}" + (f"; did you mean {near[0]}?" if near else "")
    message = exc.format_message()
    if isinstance(exc, click.UsageError) and (typed := re.match(r"No such command '(.*?)'\.", message)):
        commands = list(getattr(typer.main.get_command(app), "commands", {}))
        near = difflib.get_close_matches(typed.group(1), commands, n=1)
        return f"no such command {typed.group(1)}" + (f"; did you mean {near[0]}?" if near else "")
    where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx is not None else "packtool"
    return f"{message[:1].lower()}{message[1:].rstrip('.')} (see {where} --help)"


def _options_of(ctx: click_core.Context | None) -> list[str]:
    return [name for param in (ctx.command.params if ctx is not None else []) if param.param_type_name == "option"
            for name in param.opts]


#: The exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def main() -> None:
    """The ``packtool`` command. Once it has returned and its output is flushed, the process ends without the
    interpreter's teardown: everything a command writes is committed (and its workers gone) by then, and tearing
    down the modules a run loads (numpy, pyarrow, the pool's bookkeeping) adds a tenth of a second to every run.

    A command line Click refuses is one ``packtool: error:`` line (naming the nearest option or command for a
    mistyped one); Ctrl-C says that the same command resumes (a run keeps what it committed) and exits 130."""
    from packtool.storage import own_process

    own_process()
    code: object
    try:
        code = app(standalone_mode=False)  # Typer turns KeyboardInterrupt into exit status 130
    except click.NoArgsIsHelpError as exc:
        exc.show()
        code = exc.exit_code
    except click.ClickException as exc:
        print(f"packtool: error: {_usage_line(exc)}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:  # outside the command Typer runs
        code = INTERRUPTED
    except typer.Abort:  # end of input at a prompt
        print("packtool: aborted", file=sys.stderr)
        code = 1
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):  # what sys.exit would print
            print(code, file=sys.stderr)
    if code == INTERRUPTED:
        print("packtool: interrupted; rerun the same command to resume", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    main()
