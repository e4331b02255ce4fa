"""The command line: clear one-line errors for bad input, stats output, and the typed/custom adapters end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

import demo

PACKTOOL = [sys.executable, "-m", "packtool.cli"]


def run(*args, check_fail=False) -> subprocess.CompletedProcess:
    p = subprocess.run([*PACKTOOL, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check_fail:
        assert p.returncode != 0, p.stdout
        assert "Traceback" not in p.stderr, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("packtool: error:")]
        assert len(lines) == 1, p.stderr
    return p


def test_bad_input_gives_one_line_errors(demo_dir, tmp_path):
    data, tok = demo_dir / "dataset", demo_dir / "tokenizer"
    empty_tok = tmp_path / "emptytok"
    empty_tok.mkdir()
    assert "tokenizer.json" in run("pack", data, tmp_path / "o1", "--tokenizer", empty_tok, "--pack-size", 2048,
                                   check_fail=True).stderr
    assert "does not exist" in run("pack", data, tmp_path / "o1", "--tokenizer", tmp_path / "nope", "--pack-size",
                                   2048, check_fail=True).stderr
    assert "no .nv-meta" in run("pack", tmp_path, tmp_path / "o2", "--tokenizer", tok, "--pack-size", 2048,
                                check_fail=True).stderr
    assert "unknown split 'nope'" in run("pack", data, tmp_path / "o3", "--tokenizer", tok, "--pack-size", 2048,
                                         "--split", "nope", check_fail=True).stderr
    assert "smaller than any sample" in run("pack", data, tmp_path / "o4", "--tokenizer", tok, "--pack-size", 8,
                                            "--split", "val", "--no-progress", check_fail=True).stderr
    assert "unknown algorithm" in run("pack", data, tmp_path / "o5", "--tokenizer", tok, "--pack-size", 2048,
                                      "--algorithm", "magic", check_fail=True).stderr
    missing = run("stats", tmp_path / "missing", check_fail=True)  # the library raised FileNotFoundError(path)
    assert f"No such file or directory ({tmp_path / 'missing'})" in missing.stderr and missing.returncode == 2


def test_rerun_with_other_settings_refuses_unless_overwrite(demo_dir, tmp_path):
    data, tok, out = demo_dir / "dataset", demo_dir / "tokenizer", tmp_path / "out"
    base = ["pack", data, out, "--tokenizer", tok, "--split", "val", "--workers", 1, "--no-progress"]
    assert run(*base, "--pack-size", 2048).returncode == 0
    again = run(*base, "--pack-size", 2048)
    assert again.returncode == 0 and "val:" in again.stdout
    refused = run(*base, "--pack-size", 4096, check_fail=True)
    assert "other settings" in refused.stderr and "pack_size" in refused.stderr
    assert run(*base, "--pack-size", 4096, "--overwrite").returncode == 0
    assert json.loads((out / ".nv-meta" / "packtool.json").read_text())["settings"]["pack_size"] == 4096


def test_stats_table_json_plot(packed, tmp_path):
    p = run("stats", packed)
    assert p.returncode == 0 and "fill" in p.stdout and "L1 bound" in p.stdout and "[train]" in p.stdout
    report = json.loads(run("stats", packed, "--json").stdout)
    train = report["splits"]["train"]
    ledger = pq.read_table(packed / "ledger.parquet").to_pylist()
    assert train["samples"] == sum(r["split"] == "train" for r in ledger)
    assert train["tokens"] == sum(r["tokens"] for r in ledger if r["split"] == "train" and r["pack"])
    assert train["status"]["truncated"] == sum(r["status"] == "truncated" for r in ledger if r["split"] == "train")
    png = tmp_path / "stats.png"
    assert run("stats", packed, "--plot", png).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The ledger alone works as well (manifest found beside it).
    assert run("stats", packed / "ledger.parquet").returncode == 0


def test_typed_datasets_and_custom_adapter(demo_dir, tmp_path):
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings

    vqa = demo.build_vqa_dataset(tmp_path / "vqa", n=12)
    cap = demo.build_captioning_dataset(tmp_path / "cap", n=8)
    tok = str(demo_dir / "tokenizer")
    for src in (vqa, cap):
        r = pack(src, tmp_path / f"out-{src.name}", PackSettings(EncodeSettings(tokenizer=tok, pack_size=2048)),
                 progress=False)
        c = r.counts["train"]
        assert c["packed"] == c["samples"] > 0, c
    # A custom adapter: reads the VQA members itself and answers with the question reversed.
    mod = tmp_path / "myadapter.py"
    mod.write_text(
        "import json\n"
        "def convert(sample):\n"
        "    q = json.loads(sample['json'])\n"
        "    return {'messages': [{'role': 'user', 'content': '<image>' + q['question']},\n"
        "                         {'role': 'assistant', 'content': q['question'][::-1]}], 'media': ['jpg']}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        r = pack(vqa, tmp_path / "out-custom", PackSettings(EncodeSettings(tokenizer=tok, pack_size=2048,
                                                                           adapter="myadapter:convert")),
                 progress=False)
    finally:
        sys.path.remove(str(tmp_path))
    assert r.counts["train"]["packed"] == 12


def test_dry_run_compare_and_dp_balance(demo_dir, tmp_path):
    out = tmp_path / "dry"
    p = run("pack", demo_dir / "dataset", out, "--tokenizer", demo_dir / "tokenizer", "--pack-size", 2048,
            "--dry-run", "--balance-dp", 4, "--workers", 1, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert (out / "ledger.parquet").exists() and not (out / "train").exists()
    assert not (out / ".nv-meta" / "index.sqlite").exists()
    algos = "bfd,ffd,greedy_knapsack,balanced_greedy_knapsack,first_fit_shuffle,sequential"
    report = json.loads(run("stats", out, "--json", "--compare", algos).stdout)
    train = report["splits"]["train"]
    assert train["dp_imbalance"] <= 1.05 and train["dp_imbalance"] <= train["dp_imbalance_unbalanced_order"]
    rows = {r["algorithm"]: r for r in report["compare"]["train"]}
    assert set(rows) == set(algos.split(","))
    assert rows["bfd"]["packs"] == train["packs"] and rows["sequential"]["packs"] >= rows["bfd"]["packs"]


def test_dry_run_then_full_run_reuses_the_plan(demo_dir, tmp_path):
    out, ref = tmp_path / "out", tmp_path / "ref"
    base = [demo_dir / "dataset", "--tokenizer", demo_dir / "tokenizer", "--pack-size", 2048, "--split", "val",
            "--workers", 1, "--no-progress"]
    assert run("pack", base[0], out, *base[1:], "--dry-run").returncode == 0
    assert not (out / "val").exists()
    assert run("pack", base[0], out, *base[1:], "--strict").returncode == 0
    assert run("pack", base[0], ref, *base[1:]).returncode == 0
    assert run("verify", out).returncode == 0
    for path in sorted(p for p in ref.rglob("*") if p.is_file() and ".packtool" not in p.parts):
        assert (out / path.relative_to(ref)).read_bytes() == path.read_bytes(), path


def test_concurrent_run_on_the_same_output_is_refused(demo_dir, tmp_path):
    import fcntl

    out = tmp_path / "out"
    base = ["pack", demo_dir / "dataset", out, "--tokenizer", demo_dir / "tokenizer", "--pack-size", 2048,
            "--split", "val", "--workers", 1, "--no-progress"]
    (out / ".packtool").mkdir(parents=True)
    with open(out / ".packtool" / "lock", "a") as held:  # what a running `packtool pack` holds
        fcntl.flock(held, fcntl.LOCK_EX)
        assert "another packtool run is writing" in run(*base, check_fail=True).stderr
    assert run(*base).returncode == 0


def test_failed_start_does_not_block_a_corrected_rerun(demo_dir, tmp_path):
    out = tmp_path / "out"
    base = ["pack", demo_dir / "dataset", out, "--pack-size", 2048, "--split", "val", "--workers", 1,
            "--no-progress"]
    assert "tokenizer.json" in run(*base, "--tokenizer", tmp_path, check_fail=True).stderr
    assert not out.exists()  # nothing written for a run that could not start
    (out / ".packtool").mkdir(parents=True)  # a run killed right after stamping its settings
    (out / ".packtool" / "settings.json").write_text('{"other": 1}')
    assert run(*base, "--tokenizer", demo_dir / "tokenizer").returncode == 0


def test_light_imports():
    """verify never loads torch (its memory would dominate verify's), and pack's parent never loads the encoder or
    transformers (its workers do): each costs start-up time and hundreds of MB."""
    code = ("import sys, packtool.cli, packtool.packer.pipeline, packtool.verify.packs; "
            "print(sorted(m for m in ('torch', 'transformers', 'packtool.packer.encoder') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def _pandas_loaded(importtime: str) -> bool:
    """Whether ``-X importtime`` output shows pandas loaded (its submodules; a refused import loads none)."""
    return any(re.search(r"\|\s+pandas\.", line) for line in importtime.splitlines())


def test_a_pack_run_never_loads_pandas(demo_dir, tmp_path):
    """pyarrow loads pandas (0.4 s) on its first array from Python values; pack's parent and its workers keep it
    out. Control: the same array made in a plain process loads it."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "packtool", "pack", str(demo_dir / "dataset"),
                        str(tmp_path / "out"), "--tokenizer", str(demo_dir / "tokenizer"), "--pack-size", "2048",
                        "--workers", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| packtool.packer.encoder" in p.stderr  # the workers' imports are in the output too
    assert not _pandas_loaded(p.stderr)
    control = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pyarrow as pa; pa.array(['x'])"],
                             capture_output=True, text=True, timeout=120)
    assert _pandas_loaded(control.stderr)
    # A user's module may import it: after allow_pandas it loads.
    code = ("from packtool.storage import allow_pandas, arrow_without_pandas\n"
            "arrow_without_pandas()\ntry:\n    import pandas\nexcept ImportError:\n    print('refused')\n"
            "allow_pandas()\nimport pandas\nprint('loaded')")
    both = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert both.stdout.split() == ["refused", "loaded"], both.stdout + both.stderr


def test_packtool_processes_allocate_with_the_system_allocator():
    """Arrow's default allocator keeps what it freed (tens of MB a write task): packtool's command line sets the
    system one, for itself and every process it starts (a pack's workers), unless the user named one. Control: a
    plain process keeps Arrow's default."""
    child = "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"
    code = ("import subprocess, sys\nimport pyarrow as pa\nfrom packtool.storage import system_allocator\n"
            "system_allocator()\nprint(pa.default_memory_pool().backend_name)\n"
            f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout)")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    set_here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert set_here.stdout.split() == ["system", "system"], set_here.stdout + set_here.stderr
    control = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env)
    assert control.returncode == 0 and control.stdout.strip() != "system", control.stdout + control.stderr
    users = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "ARROW_DEFAULT_MEMORY_POOL": control.stdout.strip()})
    assert users.stdout.split() == [control.stdout.strip()] * 2, users.stdout + users.stderr


def test_mistyped_option_or_command_is_one_line_naming_the_nearest():
    option = run("pack", "--pack-sise", 4096, "a", "b", check_fail=True)
    assert "no such option --pack-sise; did you mean --pack-size?" in option.stderr and option.returncode == 2
    assert "Usage:" not in option.stderr  # not Click's box
    command = run("pakc", "a", check_fail=True)
    assert "no such command pakc; did you mean pack?" in command.stderr and command.returncode == 2
    far = run("frobnicate", check_fail=True)  # nothing near: no suggestion
    assert "no such command frobnicate" in far.stderr and "did you mean" not in far.stderr
    missing = run("stats", check_fail=True)
    assert "missing argument 'path'" in missing.stderr and "--help" in missing.stderr


def test_ctrl_c_says_a_rerun_resumes_and_exits_130(tmp_path):
    import os
    import signal
    import time

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # reading the config blocks here until the signal comes
    # Ctrl-C's default disposition for the run (a test runner's worker may ignore SIGINT, and Python installs its
    # KeyboardInterrupt handler only where SIGINT is not ignored).
    p = subprocess.Popen([*PACKTOOL, "pack", "--config", str(fifo)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(600):  # wait until the run is inside the command, blocked opening the FIFO
            wchan = open(f"/proc/{p.pid}/wchan").read() if os.path.exists(f"/proc/{p.pid}/wchan") else ""
            if "fifo" in wchan or "pipe" in wchan or "wait_for_partner" in wchan:  # (the last: Linux FIFO open)
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "packtool: interrupted; rerun the same command to resume" in err and "Traceback" not in err, err


def test_inspect_config_out_writes_a_portable_file(packed, demo_dir, tmp_path):
    """``inspect --config --out FILE`` writes local paths relative to FILE's folder; ``pack --config`` reads them
    back to the same folders, wherever the file lies."""
    import yaml

    target = tmp_path / "configs" / "run.yaml"
    target.parent.mkdir()
    p = run("inspect", packed, "--config", "--out", target)
    assert p.returncode == 0 and f"wrote {target}" in p.stdout, p.stderr
    config = yaml.safe_load(target.read_text())
    assert not Path(config["source"]).is_absolute() and not Path(config["tokenizer"]).is_absolute(), config
    assert (target.parent / config["source"]).resolve() == (demo_dir / "dataset").resolve()
    assert (target.parent / config["tokenizer"]).is_dir()
    target.write_text(target.read_text() + "output: out\n")  # the run's output is never recorded
    printed = run("pack", "--config", target, "--print-config")
    assert printed.returncode == 0, printed.stderr
    back = yaml.safe_load(printed.stdout)
    assert Path(back["source"]).resolve() == (demo_dir / "dataset").resolve(), back
    assert "--out writes the config file" in run("inspect", packed, "--out", target, check_fail=True).stderr
