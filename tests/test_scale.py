"""Scale-out and resume: the output bytes do not depend on the worker count, the engine, or how often the job was
killed (SIGKILL) and rerun; a rerun with other settings refuses unless ``--overwrite``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import demo
from packtool.cli import app
from packtool.errors import FatalSampleError
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.packs import verify_output

ROOT = Path(__file__).resolve().parents[1]
PACKTOOL = [sys.executable, "-m", "packtool.cli"]
#: Names an interrupted run may leave behind (temporary files and folders of any process).
TEMPORARY = re.compile(r"\.tmp-[^/]*$")


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file of an output except the work files under ``.packtool/``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.relative_to(root).parts}


def temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if TEMPORARY.search(p.name))


# -- workers and engines ---------------------------------------------------------------------------------------
def bad_dataset(root: Path) -> Path:
    """One shard: a healthy sample, then one with invalid JSON."""
    members = [("k0.json", json.dumps([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]).encode()),
               ("k1.json", b"{not json")]
    (root / "shards").mkdir(parents=True)
    with tarfile.open(root / "shards/bad.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (root / ".nv-meta").mkdir()
    (root / ".nv-meta/split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": ["shards/bad.tar"]}}))
    (root / ".nv-meta/dataset.yaml").write_text(yaml.safe_dump({"__module__": "megatron.energon",
                                                                "__class__": "CrudeWebdataset"}))
    return root


def test_workers_and_ray_give_identical_bytes(packed, demo_dir, tmp_path):
    """``packed`` ran with one worker in process; two local workers and Ray must write the very same files, and
    a failing Ray task must surface as the task's own one-line error."""
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="8"))
    pack(demo_dir / "dataset", tmp_path / "two", settings, workers=2, progress=False)
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pack(demo_dir / "dataset", tmp_path / "ray", settings, engine="ray", progress=False)
        strict = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
        with pytest.raises(FatalSampleError) as failure:
            pack(bad_dataset(tmp_path / "bad"), tmp_path / "strict", strict, engine="ray", strict=True,
                 progress=False)
    finally:
        ray.shutdown()
    reference = digest(packed)
    assert len(reference) > 10
    assert digest(tmp_path / "two") == reference
    assert digest(tmp_path / "ray") == reference
    assert str(failure.value).startswith("shards/bad.tar/k1: invalid json") and "\n" not in str(failure.value)


# -- resume after SIGKILL --------------------------------------------------------------------------------------
#: Runs the CLI with os.replace wrapped: SIGKILL the process just before (or after) the N-th commit (rename)
#: whose destination matches a pattern. Commits are the pipeline's only points of progress, so this reaches
#: every state a kill can leave, deterministically.
KILLER = r"""
import os, re, signal, sys
pattern, nth, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real, seen = os.replace, [0]
def replace(src, dst, *a, **k):
    hit = re.search(pattern, str(dst)) is not None
    seen[0] += hit
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst, *a, **k)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from packtool.cli import main
sys.argv = ["packtool"] + sys.argv[4:]
main()
"""

#: (destination pattern, N, before/after, what must be left behind): in pipeline order, each kill hits a run
#: that resumes the previous one.
KILL_POINTS = [
    (r"encode\.json$", 1, "before", r"\.packtool/\.encode\.json\.tmp-"),
    (r"output\.json$", 1, "before", r"\.packtool/\.output\.json\.tmp-"),
    (r"encode/train/shards_train-0001\.tar-[0-9a-f]{10}/000000$", 1, "before",
     r"encode/train/shards_train-0001\.tar-[0-9a-f]{10}/\.000000\.tmp-"),
    (r"encode/train/shards_train-0003\.tar-[0-9a-f]{10}/000000$", 1, "after", None),
    (r"train/pack-000001\.tar$", 1, "before", r"train/\.pack-000001\.tar\.tmp-"),
    (r"train/pack-000003\.tar\.idx$", 1, "after", None),
    (r"ledger\.parquet$", 1, "before", r"^\.ledger\.parquet\.tmp-"),
    (r"index\.sqlite$", 1, "before", r"\.nv-meta/\.index\.sqlite\.tmp-"),
    (r"packtool\.json$", 1, "before", r"\.nv-meta/\.packtool\.json\.tmp-"),
]


@pytest.fixture(scope="module")
def resume_case(demo_dir, tmp_path_factory):
    """A dataset of 7 source shards and the same settings as CLI arguments and as :class:`PackSettings`."""
    root = tmp_path_factory.mktemp("resume")
    data = demo.build_dataset(root / "dataset", n_train=300, n_val=40, samples_per_shard=50, image_fraction=0.3)
    tok = demo_dir / "tokenizer"
    args = ["--tokenizer", str(tok), "--pack-size", "2048", "--shard-size", "6", "--no-progress"]
    settings = PackSettings(EncodeSettings(tokenizer=str(tok), pack_size=2048), PlanSettings(shard_size="6"))
    reference = root / "reference"
    pack(data, reference, settings, workers=1, progress=False)
    return data, args, settings, digest(reference)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_killed_at_every_commit_point_then_resumed_is_byte_identical(resume_case, tmp_path):
    data, args, _, reference = resume_case
    out = tmp_path / "out"
    for pattern, nth, when, leftover in KILL_POINTS:
        killed = run([sys.executable, "-c", KILLER, pattern, str(nth), when, "pack", str(data), str(out), *args,
                      "--workers", "1"])
        assert killed.returncode == -signal.SIGKILL, (pattern, killed.stdout, killed.stderr)
        assert not (out / ".nv-meta" / "packtool.json").exists()
        if leftover:
            assert any(re.search(leftover, t) for t in temporaries(out)), (pattern, temporaries(out))
    done = run([*PACKTOOL, "pack", str(data), str(out), *args, "--workers", "1"])
    assert done.returncode == 0, done.stderr
    assert temporaries(out) == []
    assert digest(out) == reference
    assert verify_output(out) == []


def test_process_group_killed_during_encode_then_resumed(resume_case, tmp_path):
    """A real ``packtool pack`` with two worker processes, killed with its workers (as a scheduler does) once
    some shards are encoded; the rerun finishes the job with the same bytes."""
    data, args, _, reference = resume_case
    out = tmp_path / "out"
    cmd = [*PACKTOOL, "pack", str(data), str(out), *args, "--workers", "2"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    encoded = out / ".packtool" / "encode" / "train"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len([p for p in encoded.glob("shards_*") if not TEMPORARY.search(p.name)]) >= 2:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / ".nv-meta" / "packtool.json").exists()
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    assert temporaries(out) == []
    assert digest(out) == reference


# -- other settings ----------------------------------------------------------------------------------------------
def test_rerun_with_other_settings_refuses_unless_overwrite(resume_case, tmp_path):
    data, args, settings, reference = resume_case
    out = tmp_path / "out"
    pack(data, out, settings, workers=1, progress=False)
    other = [a if a != "2048" else "1024" for a in args]
    refused = CliRunner().invoke(app, ["pack", str(data), str(out), *other, "--workers", "1"])
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip()
    assert "\n" not in line and "encode.pack_size: 2048 -> 1024" in line and "--overwrite" in line, line
    assert digest(out) == reference
    replaced = CliRunner().invoke(app, ["pack", str(data), str(out), *other, "--workers", "1", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert digest(out) != reference and verify_output(out) == []


def test_output_not_made_by_packtool_is_refused(resume_case, tmp_path):
    data, args, _, _ = resume_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    refused = CliRunner().invoke(app, ["pack", str(data), str(out), *args, "--workers", "1"])
    assert refused.exit_code == 2 and "not made by packtool" in refused.output
    assert (out / "precious.txt").read_text() == "keep me"
