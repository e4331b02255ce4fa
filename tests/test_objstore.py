"""SOURCE and OUTPUT in an object store (``msc://PROFILE/path``), against a real S3-compatible server on loopback
(moto's, started here): the same bytes as on disk, resume after a kill at every kind of upload, a source object
changed between runs re-encoded, and the readers of an output (verify, stats, inspect, read_packs, Energon)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the object-store tests need the storage extra (boto3)")
pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (test extra)")

import demo
import objstore
from packtool import storage
from packtool.format import MANIFEST
from packtool.packer.output import store_name
from packtool.packer.pipeline import pack
from packtool.packer.store import SourceStamp
from packtool.settings import EncodeSettings, PackSettings, PlanSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def case(demo_dir, tmp_path_factory):
    """A running store holding the demo dataset (5 source shards, images), the settings, and the same pack made
    from and to local disk (the reference)."""
    root = tmp_path_factory.mktemp("objstore")
    os.environ["PACKTOOL_WORK"] = str(root / "work")
    os.environ["PACKTOOL_SCRATCH"] = str(root / "scratch")
    store = objstore.start(root, "teststore")
    data = demo.build_dataset(root / "dataset", n_train=160, n_val=40, samples_per_shard=40, image_fraction=0.3)
    source = store.upload_tree(Path(data), "datasets/demo")
    tok = demo_dir / "tokenizer"
    settings = PackSettings(EncodeSettings(tokenizer=str(tok), pack_size=2048), PlanSettings(shard_size="4"))
    pack(data, root / "reference", settings, workers=1, progress=False)
    yield store, Path(data), source, settings, root
    store.stop()


def local_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.relative_to(root).parts}


def without_manifest(d: dict[str, str]) -> dict[str, str]:
    """The manifest names the source (a folder or a URL); every other byte must be the same."""
    return {k: v for k, v in d.items() if k != MANIFEST}


def test_pack_from_and_to_the_object_store_gives_the_bytes_of_disk(case):
    store, data, source, settings, root = case
    storage.REQUESTED.reset()
    result = pack(source, store.url("out/remote"), settings, workers=1, progress=False)
    requested = {url: n for url, n in storage.REQUESTED.per_object.items() if url.endswith(".tar")}
    reference = local_digest(root / "reference")
    got = store.digest("out/remote")
    assert len(reference) > 10 and without_manifest(got) == without_manifest(reference)
    assert got[MANIFEST] != reference[MANIFEST]  # control: the digests do compare bytes
    manifest = json.loads(storage.ObjectPath(store.url(f"out/remote/{MANIFEST}")).read_bytes())
    assert manifest["source"] == source
    assert result.counts == json.loads((root / "reference" / MANIFEST).read_text())["counts"]
    # Source shards are read by ranged requests: each byte at most about three times (the header walk, the
    # encode scan, the media of the write stage), never whole objects over and over.
    sizes = {f"{source}/shards/{p.name}": p.stat().st_size for p in (data / "shards").glob("*.tar")}
    assert set(requested) == set(sizes)
    assert all(sizes[url] <= n <= 3 * sizes[url] for url, n in requested.items()), (requested, sizes)
    # Source on the object store, output on disk, two workers: the same bytes again.
    pack(source, root / "from-store", settings, workers=2, progress=False)
    assert without_manifest(local_digest(root / "from-store")) == without_manifest(reference)
    # A rerun of the finished output changes nothing and reports the same counts.
    again = pack(source, store.url("out/remote"), settings, workers=1, progress=False)
    assert again.counts == result.counts and store.digest("out/remote") == got


#: Runs the CLI with ObjectPath.upload wrapped: SIGKILL the process just before (or after) the N-th upload whose
#: key matches a pattern. Uploads are the only points of progress in an object store, so this reaches every
#: state a kill can leave there.
KILLER = r"""
import os, re, signal, sys
pattern, nth, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from packtool import storage
real, seen = storage.ObjectPath.upload, [0]
def upload(self, local):
    hit = re.search(pattern, self.key) is not None
    seen[0] += hit
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, local)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
storage.ObjectPath.upload = upload
from packtool.cli import main
sys.argv = ["packtool"] + sys.argv[4:]
main()
"""

#: (key pattern, N, before/after), in pipeline order: each kill hits a run that resumes the previous one.
KILL_POINTS = [
    # an encode folder half put: no source.json
    (r"encode/train/shards_train-0001\.tar-[0-9a-f]{10}/000000/tokens\.npy$", 1, "after"),
    (r"encode/train/shards_train-0003\.tar-[0-9a-f]{10}/000000/source\.json$", 1, "after"),
    (r"train/pack-000000\.tar\.idx$", 1, "after"),  # the write phase: an index without its tar
    (r"train/pack-000002\.tar$", 1, "after"),
    (r"ledger\.parquet$", 1, "after"),
    (r"index\.sqlite$", 1, "before"),
    (r"packtool\.json$", 1, "before"),  # the manifest, last
]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def pack_args(case, source: str, output: str) -> list[str]:
    _, _, _, settings, _ = case
    return ["pack", source, output, "--tokenizer", settings.encode.tokenizer, "--pack-size", "2048",
            "--shard-size", "4", "--no-progress", "--workers", "1"]


def test_killed_at_every_kind_of_upload_then_resumed_is_byte_identical(case):
    store, _, source, settings, root = case
    out = store.url("out/killed")
    manifest = storage.ObjectPath(f"{out}/{MANIFEST}")
    for pattern, nth, when in KILL_POINTS:
        killed = cli("-c", KILLER, pattern, str(nth), when, *pack_args(case, source, out))
        assert killed.returncode == -signal.SIGKILL, (pattern, killed.stdout, killed.stderr)
        assert not manifest.exists(), pattern  # nothing looks complete before it is
    scratch = Path(os.environ["PACKTOOL_SCRATCH"])
    assert list(scratch.glob(".packtool-*")), "the killed runs left no scratch (the control below means nothing)"
    done = cli("-m", "packtool.cli", *pack_args(case, source, out))
    assert done.returncode == 0, done.stderr
    assert not list(scratch.glob(".packtool-*"))  # the rerun removed what the killed runs left
    reference = store.url("out/reference-cli")
    assert cli("-m", "packtool.cli", *pack_args(case, source, reference)).returncode == 0
    got = store.digest("out/killed")
    assert got == store.digest("out/reference-cli")
    assert without_manifest(got) == without_manifest(local_digest(root / "reference"))


def edited(shard: bytes) -> bytes:
    """The shard with the last turn of its first ShareGPT conversation rewritten (a new object: another size,
    ETag and modification time)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(shard)) as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        done = False
        for m in src:
            data = src.extractfile(m).read()
            sample = json.loads(data) if m.name.endswith(".json") else None
            if not done and isinstance(sample, dict) and isinstance(sample.get("conversations"), list):
                sample["conversations"][-1]["value"] = "the reply was edited after the first run"
                data, done = json.dumps(sample).encode(), True
            info = tarfile.TarInfo(m.name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))
    assert done, "no ShareGPT sample to edit"
    return out.getvalue()


def test_a_source_object_changed_between_runs_is_detected_and_packed_anew(case, tmp_path):
    store, data, _, settings, _ = case
    local = tmp_path / "dataset"
    shutil.copytree(data, local)
    source = store.upload_tree(local, "datasets/edited")
    out = store.url("out/edited")
    pack(source, out, settings, workers=1, progress=False)
    before = store.digest("out/edited")
    shard = storage.ObjectPath(f"{source}/shards/train-0001.tar")
    stamp = SourceStamp.of(storage.location(source), "shards/train-0001.tar", "")
    (local / "shards/train-0001.tar").write_bytes(edited(shard.read_bytes()))
    shard.upload(local / "shards/train-0001.tar")
    assert SourceStamp.of(storage.location(source), "shards/train-0001.tar", "") != stamp
    pack(source, out, settings, workers=1, progress=False)
    pack(local, tmp_path / "clean", settings, workers=1, progress=False)
    after = store.digest("out/edited")
    assert after != before
    assert without_manifest(after) == without_manifest(local_digest(tmp_path / "clean"))


@pytest.fixture(scope="module")
def remote_output(case):
    """The demo pack made from and to the object store (once per module)."""
    store, _, source, settings, _ = case
    out = store.url("out/readers")
    pack(source, out, settings, workers=1, progress=False)
    return out


def test_verify_stats_and_inspect_read_an_output_in_the_object_store(case, remote_output):
    from packtool.verify.inspect import inspect_pack
    from packtool.verify.packs import verify_output
    from packtool.verify.stats import compute

    _, _, source, _, root = case
    assert verify_output(remote_output) == []
    assert verify_output(remote_output, source=source) == []
    assert compute(remote_output) == compute(root / "reference")
    assert inspect_pack(remote_output) == inspect_pack(root / "reference").replace(str(root / "reference"),
                                                                                  remote_output)
    # Control: verify sees a damaged object (one byte of a pack shard changed).
    shard = storage.ObjectPath(f"{remote_output}/train/pack-000001.tar")
    damaged = bytearray(shard.read_bytes())
    damaged[1000] ^= 0xFF
    bad = root / "damaged.tar"
    bad.write_bytes(bytes(damaged))
    copy = storage.ObjectPath(remote_output.replace("readers", "damaged"))
    for obj in storage.ObjectPath(remote_output).files():
        local = root / "obj"
        local.write_bytes(obj.read_bytes())
        (copy / str(obj.relative_to(storage.ObjectPath(remote_output)))).upload(local)
    (copy / "train/pack-000001.tar").upload(bad)
    assert any("pack-000001.tar" in p for p in verify_output(str(copy)))


def test_read_packs_and_energon_task_encoders_read_an_output_in_the_object_store(case, remote_output):
    import torch
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from packtool.runtime.loader import PackDataset, PackTaskEncoder
    from packtool.runtime.read import read_packs

    _, _, _, _, root = case

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a if k != "source")

    local = list(read_packs(root / "reference", "train"))
    remote = list(read_packs(remote_output, "train"))
    assert len(local) > 5 and len(remote) == len(local) and all(same(a, b) for a, b in zip(local, remote))
    assert [b["pack_key"] for b in PackDataset(remote_output, shuffle=False)] == [b["pack_key"] for b in local]

    def keys(path):
        ds = get_val_dataset(path, split_part="train", batch_size=1, task_encoder=PackTaskEncoder(),
                             worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        return [b["pack_key"] for b in get_loader(ds)]

    assert keys(remote_output) == keys(root / "reference") == [b["pack_key"] for b in local]


def test_a_ray_cluster_without_a_shared_filesystem_packs_from_and_to_the_object_store(case, remote_output,
                                                                                     demo_dir, tmp_path):
    """Two Ray nodes on loopback, each with its own local folders (scratch, cache, home) and the store's profile;
    SOURCE, OUTPUT and the model folder are in the object store, so no task reads a path another machine wrote.
    The output equals the one packed by the local engine, byte for byte, and verifies."""
    pytest.importorskip("ray")
    from packtool.verify.packs import verify_output
    from test_engine import free_port, stop_cluster

    store, _, source, _, _ = case
    model = store.upload_tree(demo_dir / "tokenizer", "models/tokenizer")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live below it
    nodes = {name: tmp_path / name for name in ("head", "worker", "driver")}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PACKTOOL_"))}
    base.update({"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"})

    def node_env(name: str) -> dict[str, str]:
        nodes[name].mkdir()
        return {**base, "HOME": str(nodes[name]), "PACKTOOL_SCRATCH": str(nodes[name] / "scratch"),
                "PACKTOOL_WORK": str(nodes[name] / "work")}

    address = f"127.0.0.1:{free_port()}"
    ray_cli = [str(Path(sys.executable).with_name("ray")), "start", "--num-cpus=1", "--disable-usage-stats",
               f"--temp-dir={temp_dir}"]
    try:
        for name, args in (("head", ["--head", f"--port={address.split(':')[1]}", "--node-ip-address=127.0.0.1",
                                     "--include-dashboard=false"]),
                           ("worker", [f"--address={address}"])):
            started = subprocess.run(ray_cli + args, env=node_env(name), capture_output=True, text=True, timeout=90)
            assert started.returncode == 0, started.stdout + started.stderr
        out = store.url("out/ray")
        done = subprocess.run([sys.executable, "-m", "packtool.cli", "pack", source, out, "--tokenizer", model,
                               "--pack-size", "2048", "--shard-size", "4", "--no-progress", "--engine", "ray",
                               "--ray-address", address], cwd=ROOT, env=node_env("driver"), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # The same bytes but the manifest's record of where the model folder was read from (the object store here, a
    # local folder for the local engine's run): every other manifest field is equal too.
    ray, local = store.digest("out/ray"), store.digest("out/readers")
    manifest = ".nv-meta/packtool.json"
    assert {k: v for k, v in ray.items() if k != manifest} == {k: v for k, v in local.items() if k != manifest}
    got, want = (json.loads(storage.ObjectPath(store.url(f"out/{name}/{manifest}")).read_bytes())
                 for name in ("ray", "readers"))
    assert got["run_config"].pop("tokenizer") == model and want["run_config"].pop("tokenizer") != model
    assert got == want
    assert verify_output(out) == []
    # The workers fetched the model folder into their own node's cache; the driver fetched nothing large.
    fetched = [n for n in ("head", "worker") if list((nodes[n] / "scratch" / "packtool-cache").glob("*/tokenizer"))]
    assert fetched, "no worker fetched the model folder"
    assert not (nodes["driver"] / "scratch" / "packtool-cache").exists()


def test_killed_after_encoding_then_a_source_object_changed_packs_the_new_object(case, tmp_path):
    """``kill -9`` once the first range of a shard is encoded, rewrite that shard's object, rerun: the output
    equals a clean pack of the edited source (the stale range is encoded again), as on disk."""
    store, data, _, settings, _ = case
    local = tmp_path / "dataset"
    shutil.copytree(data, local)
    source = store.upload_tree(local, "datasets/killed-edited")
    out = store.url("out/killed-edited")
    first = store_name("shards/train-0000.tar")
    killed = cli("-c", KILLER, rf"encode/train/{re.escape(first)}/000000/source\.json$", "1", "after",
                 *pack_args(case, source, out))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert storage.ObjectPath(f"{out}/.packtool/encode/train/{first}/000000/source.json").is_file()
    shard = local / "shards/train-0000.tar"
    shard.write_bytes(edited(shard.read_bytes()))
    storage.ObjectPath(f"{source}/shards/train-0000.tar").upload(shard)
    assert cli("-m", "packtool.cli", *pack_args(case, source, out)).returncode == 0
    pack(local, tmp_path / "clean", settings, workers=1, progress=False)
    assert without_manifest(store.digest("out/killed-edited")) == without_manifest(local_digest(tmp_path / "clean"))


def test_store_errors_json_sources_deleted_packs_and_profiles_sharing_a_bucket(case, tmp_path, monkeypatch):
    """A missing bucket is one line; a JSON source packs into the store read in place (``--staging`` is one
    line); a pack object deleted from a finished output is written again by a rerun; an OUTPUT inside the
    SOURCE through another profile of the same bucket is refused."""
    import copy

    import yaml

    store, data, source, settings, _ = case
    config = yaml.safe_load(store.config.read_text())
    profile = config["profiles"][store.profile]
    missing = copy.deepcopy(profile)
    missing["storage_provider"]["options"]["base_path"] = "no-such-bucket"
    inner = copy.deepcopy(profile)  # the same bucket, its base path the datasets folder
    inner["storage_provider"]["options"]["base_path"] = f"{objstore.BUCKET}/datasets"
    config["profiles"].update({"missing": missing, "inner": inner})
    (tmp_path / "msc.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.yaml"))

    def one_line(p: subprocess.CompletedProcess, needle: str) -> None:
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert p.stderr.strip().count("\n") == 0 and needle in p.stderr, p.stderr

    one_line(cli("-m", "packtool", *pack_args(case, source, "msc://missing/out")), "NoSuchBucket")
    one_line(cli("-m", "packtool", *pack_args(case, "msc://missing/data", str(tmp_path / "o"))), "NoSuchBucket")
    import packtool
    from packtool.errors import StoreError

    with pytest.raises(StoreError, match="NoSuchBucket"):  # the Python entry point: a PacktoolError too
        packtool.pack(source, "msc://missing/out", tokenizer=settings.encode.tokenizer, pack_size=2048, workers=1,
                      progress=False)
    one_line(cli("-m", "packtool", *pack_args(case, source, "msc://inner/demo/packed")), "overlaps the source")
    control = cli("-m", "packtool", *pack_args(case, source, "msc://inner/elsewhere/packed"))
    assert control.returncode == 0, control.stderr[-3000:]  # the same profile, outside the source: fine

    conversations = tmp_path / "chat.jsonl"
    conversations.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "an answer"}]}) for i in range(5)))
    out = store.url("out/from-json")
    one_line(cli("-m", "packtool", *pack_args(case, str(conversations), out), "--staging", str(tmp_path / "stg")),
             "read in place")
    read = cli("-m", "packtool", *pack_args(case, str(conversations), out))  # read in place, nothing staged
    assert read.returncode == 0 and "wrote" in read.stdout, read.stderr[-3000:]
    assert not (tmp_path / "stg").exists()

    out = store.url("out/deleted")
    pack(source, out, settings, workers=1, progress=False)
    before = store.digest("out/deleted")
    shard = storage.ObjectPath(f"{out}/train/pack-000001.tar")
    shard.unlink()
    again = cli("-m", "packtool", *pack_args(case, source, out))
    assert again.returncode == 0 and "wrote" in again.stdout, again.stderr[-3000:]
    assert shard.exists() and store.digest("out/deleted") == before
