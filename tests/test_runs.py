"""Runs: no flag removes what packtool did not write, a user error fails before any worker starts, a run that
goes systematically wrong stops early, and what used to go wrong silently or late is a clear error.

Small datasets written here (real tar shards, the demo's trained tokenizer), driven through the ``packtool``
command (Typer's runner in this process, or a subprocess where the exit path matters).
"""

from __future__ import annotations

import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

import packtool
from packtool.cli import app
from packtool.packer.output import store_name
from test_trust import cli, dataset, mount, pack_args, sample, tree  # noqa: F401 (mount: a fixture)

RUNNER = CliRunner()


def run(*args: str | Path):
    return RUNNER.invoke(app, [str(a) for a in args])


def refused(result, *needles: str) -> str:
    """The command failed with exit 2 and one line starting with ``packtool`` (no traceback)."""
    text = result.output.strip()
    assert result.exit_code == 2, (result.exit_code, text[-3000:], result.exception)
    assert "\n" not in text and text.startswith("packtool: error:"), text[-3000:]
    for needle in needles:
        assert needle in text, text
    return text


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    import demo

    return demo.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture
def src(tmp_path) -> Path:
    return dataset(tmp_path / "src", {"shards/a.tar": [sample(i) for i in range(6)]})


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".packtool" not in p.parts}


def test_a_damaged_encode_store_is_encoded_again_and_overwrite_keeps_the_output_until_it_can_write(tok, src,
                                                                                                  tmp_path):
    from packtool.format import Manifest

    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    finished = _snapshot(out)
    store = next((out / ".packtool/encode").glob("*/*/*"))
    # a deleted part of the encode store: a rerun with --overwrite encodes that range again and writes
    for seed, part in enumerate(("tokens.npy", "samples.parquet"), 1):
        (store / part).unlink()
        again = run(*pack_args(src, out, tok, "--overwrite", "--seed", str(seed)))
        assert again.exit_code == 0, again.output
        assert (store / part).exists() and Manifest.read(out).seed == seed
    # a part cut short: the same
    (store / "targets.npy").write_bytes((store / "targets.npy").read_bytes()[:-3])
    again = run(*pack_args(src, out, tok, "--overwrite"))
    assert again.exit_code == 0, again.output
    assert _snapshot(out) == finished  # the original settings again: the same bytes
    # a pack shard deleted from the finished output: the rerun writes it again, the same bytes
    shard = next(out.glob("train/pack-*.tar"))
    shard.unlink()
    assert run(*pack_args(src, out, tok)).exit_code == 0 and _snapshot(out) == finished
    # a run that fails after encoding (every sample dropped) leaves the finished output as it was
    failed = run(*pack_args(src, out, tok, "--overwrite", "--overlong", "drop"), "--pack-size", "8")
    assert failed.exit_code == 2 and "pack_size 8" in failed.output, failed.output
    assert _snapshot(out) == finished
    assert run(*pack_args(src, out, tok)).exit_code == 0 and _snapshot(out) == finished  # still finished


# -- 1. --overwrite only removes what packtool wrote -------------------------------------------------------------
def test_overwrite_never_empties_a_folder_packtool_did_not_make(tok, src, tmp_path):
    out = tmp_path / "f"
    (out / "sub").mkdir(parents=True)
    (out / "sub/notes.txt").write_text("precious")
    before = tree(out)
    for extra in ((), ("--overwrite",)):
        text = refused(run(*pack_args(src, out, tok, *extra)), "not made by packtool", "sub", "new or empty folder")
        assert "--overwrite" not in text  # the suggestion that used to delete everything is gone
        assert tree(out) == before


def test_overwrite_refuses_and_keeps_foreign_files_inside_a_packtool_output(tok, src, tmp_path):
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    (out / "notes.txt").write_text("mine")
    (out / "train/plot.png").write_bytes(b"png")
    before = tree(out)
    refused(run(*pack_args(src, out, tok, "--seed", "3", "--overwrite")), "did not write", "notes.txt",
            "train/plot.png")
    assert tree(out) == before
    # control: without the foreign files the same command replaces the output
    (out / "notes.txt").unlink()
    (out / "train/plot.png").unlink()
    assert run(*pack_args(src, out, tok, "--seed", "3", "--overwrite")).exit_code == 0


# -- 11. the model folder inside OUTPUT --------------------------------------------------------------------------
def test_a_model_folder_inside_the_output_is_refused_and_kept(tok, src, tmp_path):
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    own_copy = out / ".nv-meta/tokenizer"
    before = tree(out)
    for extra in ((), ("--overwrite", "--seed", "5")):
        args = pack_args(src, out, own_copy, *extra)
        refused(run(*args), "lies inside the output")
        assert tree(out) == before
    fresh = tmp_path / "fresh"
    shutil.copytree(tok, fresh / "model")
    kept = tree(fresh)
    refused(run(*pack_args(src, fresh, fresh / "model", "--overwrite")), "lies inside the output")
    assert tree(fresh) == kept
    # control: the output's own copy is a working model folder for another output
    assert run(*pack_args(src, tmp_path / "other", own_copy)).exit_code == 0


# -- 3. the first minutes ---------------------------------------------------------------------------------------
@pytest.fixture
def no_pool(monkeypatch):
    """Starting the worker pool raises: a command that gets past its checks says so."""
    import packtool.packer.workers

    class PoolStarted(Exception):
        pass

    def refuse(*_args, **_kwargs):
        raise PoolStarted

    monkeypatch.setattr(packtool.packer.workers, "pack_engine", refuse)
    return PoolStarted


def test_user_errors_that_need_no_sample_fail_before_the_pool_starts(tok, src, tmp_path, no_pool, monkeypatch):
    out = tmp_path / "out"
    refused(run(*pack_args(src, out, tmp_path / "nosuch")), "tokenizer folder", "does not exist")
    monkeypatch.chdir(tmp_path)
    hub = refused(run(*pack_args(src, out, Path("Qwen/Qwen2.5-VL-3B-Instruct"))), "Hugging Face model id",
                  "hf download Qwen/Qwen2.5-VL-3B-Instruct")
    missing = refused(run(*pack_args(tmp_path / "nosuch-src", out, tok)), "does not exist")
    bare = tmp_path / "bare"
    bare.mkdir()
    no_meta = refused(run(*pack_args(bare, out, tok)), "no .nv-meta", "energon prepare", "Crude sample")
    assert missing != no_meta and "energon prepare" not in missing and "Hugging Face" not in missing + no_meta
    assert "energon" not in hub
    # control: healthy input gets as far as the pool
    result = run(*pack_args(src, out, tok))
    assert isinstance(result.exception, no_pool), result.output


def test_the_version_is_the_package_version():
    assert packtool.__version__ == version("packtool")
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"packtool {version('packtool')}", proc


def test_make_run_does_not_download_what_only_the_tests_use():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    stamps = makefile.split("\n\n")
    install = next(block for block in stamps if block.startswith("$(STAMP):"))
    assert "pip download" not in install and "qwen-agent" in makefile


# -- 2. runs that go systematically wrong ------------------------------------------------------------------------
def test_drops_and_truncations_count_against_limits(tok, tmp_path):
    long = [(f"l{i:03d}", {"json": b'{"conversations": [{"from": "human", "value": "'
                           + b"tell me" + b'"}, {"from": "gpt", "value": "' + b"sure " * 4000 + b'"}]}'})
            for i in range(3)]
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(i) for i in range(4)] + long})
    out = tmp_path / "out"
    result = run(*pack_args(src, out, tok, "--overlong", "drop"))
    assert result.exit_code == 3, result.output
    assert "dropped rate 42.86% (3 of 7) exceeds --max-drop-rate 5.00%" in result.output, result.output
    assert (out / "ledger.parquet").exists()  # everything written, then failed
    trunc = run(*pack_args(src, tmp_path / "t", tok, "--max-truncate-rate", "0.2"))
    assert trunc.exit_code == 3 and "truncated rate" in trunc.output, trunc.output
    # control: limits the user raised let the same runs pass
    assert run(*pack_args(src, tmp_path / "d2", tok, "--overlong", "drop", "--max-drop-rate", "0.5")).exit_code == 0
    assert run(*pack_args(src, tmp_path / "t2", tok)).exit_code == 0


def test_an_alignment_below_what_context_parallelism_needs_is_an_error(tok, src, tmp_path):
    from packtool.settings import resolve_align

    refused(run(*pack_args(src, tmp_path / "o", tok, "--align", "2", "--cp-size", "2")), "align 2 conflicts",
            "multiple of 4")
    assert resolve_align(8, cp_size=2) == 8 and resolve_align(None, cp_size=2) == 4 and resolve_align(2) == 2


def test_a_model_folder_without_an_image_rule_stops_the_run_early(tok, tmp_path):
    """Every image sample fails for the same reason: the run stops within the first shard (the second is never
    encoded, no ledger is written), instead of failing the error rate after the whole run."""
    no_rule = tmp_path / "no-rule"
    shutil.copytree(tok, no_rule)
    (no_rule / "preprocessor_config.json").unlink()
    images = [sample(i, image=True) for i in range(25)]
    src = dataset(tmp_path / "src", {"shards/a.tar": images, "shards/b.tar": images})
    out = tmp_path / "out"
    result = run(*pack_args(src, out, no_rule))
    assert result.exit_code == 3, result.output
    text = result.output.strip()
    assert "\n" not in text and "stopped early: 20 samples of shards/a.tar failed for the same reason" in text, text
    assert "preprocessor_config.json" in text
    assert not (out / "ledger.parquet").exists()
    assert not (out / ".packtool/encode/train" / store_name("shards/b.tar")).exists()
    # control: with the rule off, the whole run happens and fails the error rate at the end
    late = run(*pack_args(src, tmp_path / "late", no_rule, "--max-same-failures", "0"))
    assert late.exit_code == 3 and "error rate 100.00%" in late.output, late.output
    assert (tmp_path / "late/ledger.parquet").exists()


def test_failures_in_a_row_stop_the_run(tok, tmp_path):
    long = [(f"l{i:03d}", {"json": b'{"conversations": [{"from": "human", "value": "'
                           + b"word " * (3000 + i) + b'"}, {"from": "gpt", "value": "ok"}]}'}) for i in range(12)]
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), *long, sample(1)]})
    args = pack_args(src, tmp_path / "o", tok, "--overlong", "drop", "--max-drop-rate", "0.5")
    result = run(*args, "--max-failures-in-a-row", "10")
    assert result.exit_code == 3 and "stopped early: 10 samples in a row of shards/a.tar failed" in result.output, \
        result.output
    assert "l000 to l009" in result.output
    assert "10 dropped already exceed max_drop_rate 50.00%" in result.output, result.output
    late = run(*args, "--max-failures-in-a-row", "13")  # control: 12 in a row only, failed at the end
    assert late.exit_code == 3 and "stopped early" not in late.output and "dropped rate" in late.output, late.output
    # 12 in a row, but within a drop limit of 90 %: the run is never stopped early (it passes its limit)
    assert run(*pack_args(src, tmp_path / "p", tok, "--overlong", "drop", "--max-drop-rate", "0.9"),
               "--max-failures-in-a-row", "10").exit_code == 0


def _watch_stops(statuses: list[tuple[str, str]], total: int | None, **rates: float) -> int | None:
    """Feed a failure watch these ``(status, reason)`` samples in chunks of 64; the sample it stops at, or None."""
    from packtool.errors import LimitError
    from packtool.packer.encoder import Encoded
    from packtool.packer.store import FailureLimits, _FailureWatch

    limits = FailureLimits(100, 20, total, tuple({"error": 0.01, "dropped": 0.05, **rates}.items()))
    watch = _FailureWatch(limits, "shards/a.tar")
    samples = [Encoded(f"k{i}", "shards/a.tar", i, status, reason) for i, (status, reason) in enumerate(statuses)]
    for start in range(0, len(samples), 64):
        try:
            watch.see(samples[start:start + 64])
        except LimitError as exc:
            assert "stopped early" in str(exc)
            return watch.statuses.total()
    return None


def test_early_stop_only_when_the_run_is_certain_to_exceed_its_limit():
    ok = ("packed", "")
    empty = ("dropped", "no training targets: the reply is empty")
    # 25 empty replies in 5,000 samples (0.5 %, the drop limit is 5 %): 20 with one reason never stop the run
    assert _watch_stops([empty if i % 200 == 0 else ok for i in range(5000)], 5000) is None
    # 110 too long in a row in 3,000 (3.7 %): within the limit, no stop
    long = ("dropped", "longer than the pack")
    assert _watch_stops([long] * 110 + [ok] * 2890, 3000) is None
    # the first 200 all failing for one reason: systematic and past the 1 % error limit of 5,000 (50) -> stops
    broken = ("error", "no rule for video in this model folder")
    assert _watch_stops([broken] * 200 + [ok] * 4800, 5000) == 51
    # the same drops past the limit of a smaller run stop as soon as they exceed it (150 of 3,000)
    assert _watch_stops([long] * 200 + [ok] * 2800, 3000) == 151
    # a total unknown: never stops; failures that are not systematic (scattered, each reason once) never stop
    assert _watch_stops([broken] * 200, None) is None
    assert _watch_stops([("error", f"bad sample {i}") if i % 2 else ok for i in range(400)], 400) is None


def test_limit_settings_are_checked():
    from packtool.errors import ConfigError
    from packtool.settings import RunOptions

    for bad in ({"max_drop_rate": 1.5}, {"max_truncate_rate": -0.1}, {"max_failures_in_a_row": -1},
                {"max_same_failures": 1.5}, {"max_error_rate": float("nan")}):
        with pytest.raises(ConfigError):
            RunOptions(**bad)


# -- 13. silent or late ------------------------------------------------------------------------------------------
def test_stats_of_a_file_that_is_no_ledger_and_of_an_unknown_algorithm_are_one_line(tok, src, tmp_path):
    note = tmp_path / "notes.txt"
    note.write_text("hello")
    refused(run("stats", note), "is not a packtool ledger")
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    refused(run("stats", out, "--compare", "bfd,nosuchalgo"), "unknown algorithm 'nosuchalgo'")
    assert run("stats", out, "--compare", "bfd").exit_code == 0  # control


def test_stats_on_a_garbage_manifest_and_a_cut_tokenizer_json_are_one_line(tok, src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    manifest = out / ".nv-meta/packtool.json"
    good = manifest.read_text()
    for text, needle in (("garbage{", "unreadable manifest"), ("[1, 2]", "manifest must be a mapping"),
                         ('{"settings": 3}', "its settings are a int"),
                         ('{"settings": {"pack_size": "x"}}', "its pack_size is 'x'")):
        manifest.write_text(text)
        refused(run("stats", out), str(manifest), needle)
    manifest.write_text(good)
    assert run("stats", out).exit_code == 0  # the control
    # a hub snapshot whose tokenizer.json was cut short (an interrupted download)
    snapshot = tmp_path / "hub/models--Acme--Cut/snapshots/abc"
    shutil.copytree(tok, snapshot)
    data = (snapshot / "tokenizer.json").read_bytes()
    (snapshot / "tokenizer.json").write_bytes(data[:len(data) // 2])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    args = pack_args(src, tmp_path / "o2", tok)
    args[args.index("--tokenizer") + 1] = "Acme/Cut"
    refused(run(*args), "tokenizer.json is not valid JSON", "download cut short")
    (snapshot / "tokenizer.json").write_bytes(data)
    assert run(*args).exit_code == 0  # the control: the whole file packs


def test_pack_with_workers_at_a_scripts_module_level_runs_once(tok, src, tmp_path):
    """docs/usage.md's example as a script without ``if __name__ == "__main__":``: the workers do not run the script
    again (spawn would import it in each), so the run packs once and says so once."""
    import subprocess
    import sys

    script = tmp_path / "my_pack.py"
    script.write_text(f"""import packtool
print("script started", flush=True)
summary = packtool.pack({str(src)!r}, {str(tmp_path / 'out')!r}, tokenizer={str(tok)!r}, pack_size=2048,
                        workers=2, progress=False)
print("packs", summary.splits["train"].packs, flush=True)
""")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("script started") == 1 and p.stdout.count("packs ") == 1, p.stdout
    assert (tmp_path / "out/.nv-meta/packtool.json").exists()


def test_a_shard_listed_twice_or_in_two_splits_is_refused(tok, tmp_path):
    shards = {"shards/a.tar": [sample(i) for i in range(3)], "shards/b.tar": [sample(i) for i in range(3, 6)]}
    twice = dataset(tmp_path / "twice", shards, split_parts={"train": ["shards/a.tar", "shards/b.tar",
                                                                       "shards/a.tar"]})
    refused(run(*pack_args(twice, tmp_path / "o1", tok)), "lists shard shards/a.tar twice")
    both = dataset(tmp_path / "both", shards, split_parts={"train": ["shards/a.tar", "shards/b.tar"],
                                                           "val": ["shards/b.tar"]})
    refused(run(*pack_args(both, tmp_path / "o2", tok)), "in splits 'train' and 'val'", "leak")
    apart = dataset(tmp_path / "apart", shards, split_parts={"train": ["shards/a.tar"], "val": ["shards/b.tar"]})
    assert run(*pack_args(apart, tmp_path / "o3", tok)).exit_code == 0  # control


def test_a_shard_linking_outside_the_source_is_refused(tok, tmp_path):
    elsewhere = dataset(tmp_path / "elsewhere", {"shards/x.tar": [sample(i) for i in range(3)]})
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(i) for i in range(3)]},
                  split_parts={"train": ["shards/a.tar", "shards/x.tar"]})
    (src / "shards/x.tar").symlink_to(elsewhere / "shards/x.tar")
    refused(run(*pack_args(src, tmp_path / "o", tok)), "shards/x.tar is a link to", "outside the dataset folder")
    (src / "shards/x.tar").unlink()
    (src / "shards/x.tar").symlink_to("a.tar")  # control: a link inside SOURCE is a shard like any other
    assert run(*pack_args(src, tmp_path / "o2", tok)).exit_code == 0


def test_ledger_reasons_carry_no_memory_address(tok, tmp_path):
    import pyarrow.parquet as pq

    bad = ("bad", {"json": sample(0, image=True)[1]["json"], "jpg": b"\xff\xd8 not really a jpeg"})
    src = dataset(tmp_path / "src", {"shards/a.tar": [bad, *(sample(i) for i in range(1, 4))]})
    reasons = []
    for name in ("o1", "o2"):
        assert run(*pack_args(src, tmp_path / name, tok, "--max-error-rate", "1")).exit_code == 0
        reasons.append(pq.read_table(tmp_path / name / "ledger.parquet").column("reason").to_pylist())
    assert reasons[0] == reasons[1] and " at 0x" not in " ".join(reasons[0]), reasons
    assert any("cannot identify image file" in r for r in reasons[0]), reasons  # PIL's text, address removed
    (tmp_path / "o1/ledger.parquet").unlink()


def test_a_corrupt_manifest_stops_the_energon_loader(tmp_path):
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from megatron.energon.errors import FatalSampleError

    import packfixture as fx
    from packtool.runtime.loader import PackTaskEncoder

    for name in ("good", "bad"):
        fx.write_packs(tmp_path / name, {"train": [[fx.chat_segment("t0", "hi", "hello")],
                                                   [fx.chat_segment("t1", "yo", "hey")]]}, pack_size=128, align=1)
    (tmp_path / "bad/.nv-meta/packtool.json").write_text("{not json")

    def keys(path, encoder):
        ds = get_val_dataset(path, split_part="train", batch_size=1, task_encoder=encoder,
                             worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        return [b["pack_key"] for b in get_loader(ds)]

    assert keys(tmp_path / "good", PackTaskEncoder()) == ["train-000000000", "train-000000001"]  # control
    for on_error in ("raise", "skip"):
        with pytest.raises(FatalSampleError, match="could not read the manifest"):
            keys(tmp_path / "bad", PackTaskEncoder(on_error=on_error))


def test_a_dead_worker_is_named_with_its_task():
    import os

    from packtool.errors import EngineError
    from packtool.packer.engine import Engine

    with Engine("local", 2) as engine:
        with pytest.raises(EngineError, match=r"worker process died .* while working on .*shards/x\.tar"):
            engine.map(os._exit, [3], names=["shards/x.tar"], progress=False)


def test_inspect_escapes_terminal_controls(tok, tmp_path):
    evil = "\x1b[2J\x1b]0;pwned\x07 red \u202e"
    src = dataset(tmp_path / "src", {"shards/a.tar": [("k\x1bx", {"json": __import__("json").dumps(
        {"conversations": [{"from": "human", "value": f"look {evil}"}, {"from": "gpt", "value": "ok"}]}).encode()})]})
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    shown = run("inspect", out)
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.output and "\x07" not in shown.output and "\u202e" not in shown.output
    assert "\\x1b[2J" in shown.output and "\\u202e" in shown.output, shown.output


def test_a_full_disk_while_shards_are_written_in_parts_names_the_file(tok, tmp_path, mount):  # noqa: F811
    """Two workers, one output shard: the shard is written as parts by both (``write_part``), and the full disk
    is reported with the file being written."""
    from test_trust import chat, jpeg

    src = dataset(tmp_path / "src", {"shards/a.tar": [(f"s{i:05d}", {"json": chat("<image> what?", "a photo"),
                                                                      "jpg": jpeg(256, 256, i)}) for i in range(8)]})
    full = mount("full", "size=200k")
    proc = cli(*pack_args(src, full / "out", tok, "--workers", "2", "--shard-size", "100"))
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and "No space left on device" in err, err[-3000:]
    assert f"({full / 'out' / 'train'}/" in err, err


@pytest.mark.parametrize("filter_name", ["nosuchfilter", "trim"])
def test_an_unknown_filter_inside_a_macro_is_refused_before_encoding(tok, src, tmp_path, filter_name):
    model = tmp_path / "model"
    shutil.copytree(tok, model)
    template = (model / "chat_template.jinja").read_text()
    # Jinja itself checks a filter in a branch only when the branch runs: for every sample, after the encode
    macro = "{% macro clean(x) %}{% if x is string %}{{ x | " + filter_name + " }}{% else %}{{ x }}{% endif %}" \
            "{% endmacro %}"
    (model / "chat_template.jinja").write_text(macro + template.replace("message['content']",
                                                                        "clean(message['content'])"))
    assert "clean(message['content'])" in (model / "chat_template.jinja").read_text()
    out = tmp_path / "out"
    result = run(*pack_args(src, out, model))
    if filter_name == "trim":  # control: a filter Jinja has
        assert result.exit_code == 0, result.output
        return
    refused(result, "chat template does not compile", "No filter named 'nosuchfilter'")
    assert not (out / ".packtool/encode").exists()


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_sample_whose_replies_lie_past_a_huge_prompt_is_dropped_not_an_error(tok, tmp_path, overlong):
    """A user turn far longer than a pack (the text is cut before tokenizing) followed by its reply: over-long,
    so dropped with the cut named, like any over-long sample; it was an error row "no training targets"."""
    import json

    import pyarrow.parquet as pq

    huge = " ".join(f"w{i}" for i in range(40_000))
    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(0), ("huge", {"json": json.dumps(
        {"conversations": [{"from": "human", "value": huge}, {"from": "gpt", "value": "ok"}]}).encode()})]})
    out = tmp_path / "out"
    result = run(*pack_args(src, out, tok, "--overlong", overlong, "--max-drop-rate", "1"))
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "ledger.parquet").to_pylist()
    row = next(r for r in rows if r["key"] == "huge")
    assert row["status"] == "dropped", row
    assert ("over limit: at least" if overlong == "drop" else "no training target fits before a safe cut") \
        in row["reason"], row


@pytest.mark.parametrize("member", ["tokens.npy", "jpg"])
def test_the_reader_checks_the_digests_each_pack_carries(tok, tmp_path, member):
    """One byte of a token array (still valid token ids) or of an image's entropy data (still decodes) changed
    on disk: the reader refuses the pack, naming it, instead of training on it."""
    import tarfile

    from packtool import read_packs
    from packtool.errors import FormatError

    src = dataset(tmp_path / "src", {"shards/a.tar": [sample(i, image=True) for i in range(3)]})
    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    assert len(list(read_packs(out, images=False))) >= 1  # control
    shard = out / "train/pack-000000.tar"
    with tarfile.open(shard) as tar:
        m = next(m for m in tar.getmembers() if m.name.endswith(member))
    data = bytearray(shard.read_bytes())
    at = m.offset_data + 128 if member == "tokens.npy" else m.offset_data + m.size // 2
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    what = r"(: the token arrays|, member m0\.jpg: its bytes)"
    with pytest.raises(FormatError, match=rf"pack-000000\.tar: pack train-0+{what} differ.* SHA-256.*\(corrupt\)"):
        list(read_packs(out, images=False))


def test_verify_sees_a_changed_subflavor_and_an_edited_model_copy(tok, src, tmp_path):
    from packtool.verify.packs import verify_output

    out = tmp_path / "out"
    assert run(*pack_args(src, out, tok)).exit_code == 0
    assert verify_output(out) == []  # control
    meta = out / ".nv-meta/dataset.yaml"
    original = meta.read_text()
    meta.write_text(original.replace("packtool: 1", "packtool: 2"))
    assert any("dataset.yaml" in p and "subflavors" in p for p in verify_output(out)), verify_output(out)
    meta.write_text(original)
    template = out / ".nv-meta/tokenizer/chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_end|>", "<|im_end|>\n"))
    problems = verify_output(out)
    assert any("tokenizer: the model files differ" in p for p in problems), problems


def test_concealed_h264_corruption_fails_the_decode_check():
    """Bytes of an H.264 frame changed: FFmpeg's decoder conceals the damage and decodes every frame without an
    error (the control below), yet the decode check refuses the video."""
    import io
    import sys

    import av

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import demo
    from packtool.media.video import probe_video

    clean = demo.make_video("mp4", width=64, height=48, frames=24, codec="libx264")
    assert probe_video(clean, max_pixels=1 << 20, decode=True).frames == 24

    def conceals(data: bytes) -> bool:
        with av.open(io.BytesIO(data)) as c:
            return sum(1 for _ in c.decode(c.streams.video[0])) == 24

    mdat, concealed = clean.find(b"mdat"), 0
    for k in range(20):
        data = bytearray(clean)
        for j in range(8):
            data[mdat + 200 + k * 97 + j] ^= 0x5A
        try:
            if not conceals(bytes(data)):
                continue
        except av.error.FFmpegError:
            continue
        concealed += 1
        try:
            probe_video(bytes(data), max_pixels=1 << 20, decode=True)
        except ValueError as exc:
            assert "undecodable video" in str(exc)
            return
    pytest.fail(f"none of {concealed} concealed corruptions was found")
