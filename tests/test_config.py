"""A pack run written down: the YAML config file, flags over it, explicitly given values against a preset, the
config recorded in the manifest and printed back, help at 80 columns, model ids from a local hub cache."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import yaml

from packtool import config as cfg

PACKTOOL = [sys.executable, "-m", "packtool.cli"]


def run(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKTOOL, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def one_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("packtool: error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_every_pack_flag_is_a_config_key_generated_from_its_declaration():
    """The command's parameters are the run's keys, each with the name, default and help its setting declares
    (SOURCE and OUTPUT arguments); no option of ``pack`` is written by hand besides --config and --print-config."""
    import typer.main

    from packtool.cli import app

    command = typer.main.get_command(app).commands["pack"]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params}
    assert set(params) - {"config", "print_config"} == set(cfg.KEYS)
    base = cfg.defaults()
    for key in cfg.KEYS:
        p, spec = params[key], cfg.SPEC[key]
        assert p.help == spec.help, key
        assert p.default == (None if isinstance(spec.default, tuple) else base[key]), key
    from dataclasses import fields

    from packtool.settings import EncodeSettings, PlanSettings, RunOptions, help_of
    for cls in (EncodeSettings, PlanSettings, RunOptions):  # every setting's help is its field's own
        for f in fields(cls):
            assert params[f.name].help == help_of(cls, f.name) == f.metadata["help"]


def test_every_value_a_flag_refuses_a_config_file_refuses(demo_dir, tmp_path):
    """Checks live with the settings, so a config file meets the same ones as a flag (cp_size 0 was refused only
    by the flag, and a config file's crashed)."""
    base = ["pack", demo_dir / "dataset", tmp_path / "o", "--tokenizer", demo_dir / "tokenizer", "--pack-size",
            2048, "--print-config"]
    conf = tmp_path / "c.yaml"
    for key, value in (("cp_size", 0), ("tp_size", -1), ("align_for", "deepspeed")):
        flag = one_error(run(*base, f"--{key.replace('_', '-')}", value))
        conf.write_text(f"{key}: {value}\n")
        from_file = one_error(run(*base, "--config", conf))
        assert key in flag and from_file.startswith(flag) and str(conf) in from_file, (flag, from_file)


def test_config_file_flags_override_and_print_back(demo_dir, tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"source": str(demo_dir / "dataset"), "output": "out", "tokenizer":
                                    str(demo_dir / "tokenizer"), "pack_size": 2048, "split": ["val"],
                                    "algorithm": "ffd", "workers": 1, "progress": False}))
    printed = run("pack", "--config", conf, "--pack-size", 1024, "--print-config")
    assert printed.returncode == 0, printed.stderr
    values = yaml.safe_load(printed.stdout)
    assert values["pack_size"] == 1024 and values["algorithm"] == "ffd" and values["split"] == ["val"]
    assert values["output"] == str(tmp_path / "out")  # relative to the config file, recorded absolute
    again = tmp_path / "again.yaml"
    again.write_text(printed.stdout)
    done = run("pack", "--config", again, "--no-progress", "--workers", 1)
    assert done.returncode == 0, done.stderr
    shown = run("inspect", tmp_path / "out", "--config")
    assert shown.returncode == 0, shown.stderr
    recorded = yaml.safe_load(shown.stdout)
    assert {k: recorded[k] for k in ("source", "tokenizer", "split", "pack_size", "algorithm")} == \
        {k: values[k] for k in ("source", "tokenizer", "split", "pack_size", "algorithm")}
    assert "output" not in recorded and "workers" not in recorded
    # What inspect prints packs the same bytes again.
    (tmp_path / "recorded.yaml").write_text(shown.stdout)
    again_run = run("pack", recorded["source"], tmp_path / "out2", "--config", tmp_path / "recorded.yaml",
                    "--no-progress", "--workers", 1)
    assert again_run.returncode == 0, again_run.stderr
    files = sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*")
                   if p.is_file() and ".packtool" not in p.parts)
    assert files and all((tmp_path / "out" / f).read_bytes() == (tmp_path / "out2" / f).read_bytes() for f in files)
    bad = tmp_path / "bad.yaml"
    bad.write_text("pack_sise: 3\n")
    assert "unknown setting 'pack_sise'" in one_error(run("pack", "--config", bad))


def test_explicit_values_conflicting_with_the_preset_are_errors(demo_dir, tmp_path):
    base = ["pack", demo_dir / "dataset", tmp_path / "o", "--tokenizer", demo_dir / "tokenizer", "--pack-size",
            2048, "--preset", "megatron-bridge-qwen-vl", "--print-config"]
    ok = run(*base)
    assert ok.returncode == 0 and yaml.safe_load(ok.stdout)["media_first"] is True
    # --no-media-first equals the default, and is still a value given.
    assert "preset 'megatron-bridge-qwen-vl' sets media_first to True, not False (given explicitly)" in \
        one_error(run(*base, "--no-media-first"))
    conf = tmp_path / "c.yaml"
    conf.write_text("target_newline_after_eot: false\n")
    assert "sets target_newline_after_eot to True, not False" in one_error(run(*base, "--config", conf))
    conf.write_text("media_first: true\n")  # the preset's own value: fine
    assert run(*base, "--config", conf).returncode == 0


def test_help_fits_80_columns():
    p = run("pack", "--help", env={"COLUMNS": "80"})
    assert p.returncode == 0
    assert all(len(line) <= 80 for line in p.stdout.splitlines()), max(p.stdout.splitlines(), key=len)
    for key in cfg.KEYS:
        if key not in ("source", "output"):
            assert re.search(rf"--{key.replace('_', '-')}\b", p.stdout), key
    assert "megatron-bridge-qwen-vl" in p.stdout and "balanced_greedy_knapsack" in p.stdout


def test_model_id_from_the_local_hub_cache(demo_dir, tmp_path):
    cache = tmp_path / "hub"
    repo = cache / "models--Acme--Tiny-VL"
    shutil.copytree(demo_dir / "tokenizer", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    p = run("pack", demo_dir / "dataset", tmp_path / "o", "--tokenizer", "Acme/Tiny-VL", "--pack-size", 2048,
            "--print-config", env={"HF_HUB_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["tokenizer"] == "Acme/Tiny-VL"
    missing = one_error(run("pack", demo_dir / "dataset", tmp_path / "o", "--tokenizer", "Acme/Other",
                            "--pack-size", 2048, env={"HF_HUB_CACHE": str(cache)}))
    assert str(cache / "models--Acme--Other") in missing and "local Hugging Face cache" in missing
    home = one_error(run("pack", demo_dir / "dataset", tmp_path / "o", "--tokenizer", "Acme/Tiny-VL",
                         "--pack-size", 2048, env={"HF_HUB_CACHE": "", "HF_HOME": str(tmp_path / "home")}))
    assert str(tmp_path / "home" / "hub" / "models--Acme--Tiny-VL") in home
    from packtool.hub import resolve_model

    os.environ["HF_HUB_CACHE"] = str(cache)
    try:
        assert resolve_model("Acme/Tiny-VL") == (repo / "snapshots" / "abc123").resolve()
    finally:
        del os.environ["HF_HUB_CACHE"]


def test_config_values_are_type_checked(tmp_path):
    import pytest

    from packtool.errors import ConfigError

    conf = tmp_path / "c.yaml"
    for text, needle in (("overwrite: 'false'\n", "overwrite must be true or false, not 'false'"),
                         ("dry_run: 'no'\n", "dry_run must be true or false, not 'no'"),
                         ("strict: 1\n", "strict must be true or false, not 1"),
                         ("workers: -3\n", "workers must be at least 1"),
                         ("workers: 0\n", "workers must be at least 1"),
                         ("pack_size: '4096'\n", "pack_size must be an integer, not '4096'"),
                         ("max_error_rate: [1]\n", "max_error_rate must be a number"),
                         ("algorithm: {a: 1}\n", "algorithm must be one of auto"),
                         ("split: [1]\n", "split must be"),
                         ("pack_size: 4096\npack-size: 2048\n", "'pack_size' and 'pack-size' are the same setting")):
        conf.write_text(text)
        with pytest.raises(ConfigError) as info:
            cfg.read(conf)
        assert needle in str(info.value) and str(conf) in str(info.value), (text, info.value)
    conf.write_text("overwrite: true\ndry_run: false\nworkers: 2\nshard_size: 100\nsplit: val\nmax_error_rate: 0\n")
    assert cfg.read(conf)["overwrite"] is True  # the control: right types pass
    with pytest.raises(ConfigError, match="workers must be at least 1"):
        cfg.merge(None, {"workers": -3})
    conf.write_text("overwrite: 'false'\n")
    line = one_error(run("pack", "x", tmp_path / "o", "--config", conf))
    assert "overwrite must be true or false" in line and str(conf) in line


def test_inspect_config_is_portable(demo_dir, tmp_path):
    """``inspect --config --out`` writes a config to reuse: the model as its hub id, paths relative to the file,
    what the preset derived as comments; the file packs the same bytes from another folder, takes other parallel
    sizes, and a conflict it causes names it."""
    cache = tmp_path / "hub"
    repo = cache / "models--Acme--Tiny-VL"
    shutil.copytree(demo_dir / "tokenizer", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = {"HF_HUB_CACHE": str(cache)}
    first, again = tmp_path / "first", tmp_path / "again"
    p = run("pack", demo_dir / "dataset", first, "--tokenizer", "Acme/Tiny-VL", "--pack-size", 2048, "--split",
            "val", "--preset", "nemo-rl-qwen-vl", "--tp-size", 2, "--align-for", "nemo-rl", "--workers", 1,
            "--no-progress", env=env)
    assert p.returncode in (0, 3), p.stderr
    conf = tmp_path / "configs" / "run.yaml"
    conf.parent.mkdir()
    assert run("inspect", first, "--config", "--out", conf, env=env).returncode == 0
    text = conf.read_text()
    written = yaml.safe_load(text)
    assert written == {"source": os.path.relpath(demo_dir / "dataset", conf.parent), "split": ["val"],
                       "tokenizer": "Acme/Tiny-VL", "pack_size": 2048, "preset": "nemo-rl-qwen-vl",
                       "align_for": "nemo-rl", "tp_size": 2}
    assert "# overlong: drop" in text and "# target_newline_after_eot: true" in text  # the preset's: comments
    assert "# align: 4" in text  # what the parallel sizes derived: a comment, not set
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = subprocess.run([*PACKTOOL, "pack", str(demo_dir / "dataset"), str(again), "--config", str(conf),
                        "--workers", "2", "--no-progress"], capture_output=True, text=True, timeout=300,
                       cwd=elsewhere, env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode in (0, 3), p.stderr

    def tree(root):
        return {q.relative_to(root): q.read_bytes() for q in sorted(root.rglob("*")) if q.is_file()}

    assert tree(again) == tree(first)
    assert run("pack", demo_dir / "dataset", tmp_path / "cp", "--config", conf, "--tp-size", 4, "--cp-size", 2,
               "--no-progress", env=env).returncode in (0, 3)
    conf.write_text(text + "align: 4\n")  # set by hand now: a conflict names the file
    message = one_error(run("pack", demo_dir / "dataset", tmp_path / "bad", "--config", conf, "--cp-size", 3,
                            env=env))
    assert "align 4 conflicts" in message and f"align is set in {conf}" in message
    conf.write_text(text + "overlong: truncate\n")
    message = one_error(run("pack", demo_dir / "dataset", tmp_path / "bad", "--config", conf, env=env))
    assert f"(given in {conf})" in message


def test_a_config_naming_the_source_takes_one_argument_as_the_output(demo_dir, tmp_path):
    """``pack --config run.yaml NEWOUT`` (run.yaml from ``inspect --config``, naming the source) packs into NEWOUT;
    ``--print-config`` needs no output; ``--output`` says OUTPUT is an argument; without a source in the file one
    argument is still the source (control: OUTPUT is then missing, said with the command line that exists)."""
    first = tmp_path / "first"
    p = run("pack", demo_dir / "dataset", first, "--tokenizer", demo_dir / "tokenizer", "--pack-size", 2048,
            "--split", "val", "--workers", 1, "--no-progress")
    assert p.returncode in (0, 3), p.stderr
    conf = tmp_path / "run.yaml"
    conf.write_text(run("inspect", first, "--config").stdout)
    again = tmp_path / "again"
    p = run("pack", "--config", conf, again, "--workers", 1, "--no-progress")
    assert p.returncode in (0, 3), p.stderr
    assert (again / "ledger.parquet").read_bytes() == (first / "ledger.parquet").read_bytes()
    printed = run("pack", "--config", conf, "--print-config")
    assert printed.returncode == 0 and yaml.safe_load(printed.stdout)["source"] == str(demo_dir / "dataset")
    assert "OUTPUT is an argument, not an option" in one_error(run("pack", "--config", conf, "--output", "x"))
    no_source = tmp_path / "no-source.yaml"
    no_source.write_text(yaml.safe_dump({"tokenizer": str(demo_dir / "tokenizer"), "pack_size": 2048}))
    message = one_error(run("pack", "--config", no_source, demo_dir / "dataset"))
    assert message.startswith("packtool: error: OUTPUT is required: `packtool pack SOURCE OUTPUT")
    assert "a flag" not in message
