"""The execution engine: one pool for every stage, results in task order, the first failure as itself, workers
that never outlive the run (SIGTERM, SIGKILL), and Ray clusters that are reached on loopback or fail at once.

No test bounds a duration: cancellation, fail-fast and cleanup are proven by what happened (which tasks ran,
which processes live, which check refused). A wait for an event has a generous limit (:data:`HANG`) that only
ends a hung test."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from packtool.errors import ConfigError, EngineError
from packtool.packer.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PACKTOOL = [sys.executable, "-m", "packtool.cli"]
#: Seconds after which a wait for an event gives up: a hang, never a slow machine.
HANG = 120


# -- tasks (module level: spawn workers import them) -------------------------------------------------------
def square(x: int) -> int:
    return x * x


def whoami(_: int) -> int:
    time.sleep(0.02)
    return os.getpid()


def fail_on(task: tuple[int, int, str, str]) -> int:
    """Fails at ``bad`` at once; any other task waits until ``release`` exists (the caller has seen the failure),
    then leaves a mark (to count the tasks that ran)."""
    x, bad, marks, release = task
    if x == bad:
        raise KeyError(f"task {x} is bad")
    deadline = time.monotonic() + HANG
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(marks, str(x)).touch()
    return x


_loaded: list[str] = []


def load(log: str, value: str) -> None:
    """An initializer: remembers ``value`` in this process and logs the process id once per call."""
    _loaded.append(value)
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")


def loaded(_: int) -> tuple[int, list[str]]:
    return os.getpid(), list(_loaded)


def alive(pids) -> list[int]:
    """The processes among ``pids`` that still run (a zombie nobody reaps has ended)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


# -- local engine ----------------------------------------------------------------------------------------------
def test_one_pool_serves_every_stage_and_dies_with_the_engine():
    with Engine("local", workers=2) as engine:
        assert engine.map(square, list(range(20)), progress=False) == [i * i for i in range(20)]
        first = set(engine.map(whoami, list(range(20)), progress=False))
        second = set(engine.map(whoami, list(range(20)), progress=False))
        children = {p.pid for p in psutil.Process().children()}
    assert os.getpid() not in first and len(first) <= 2
    assert second <= first and first <= children, "a stage got processes of its own"
    assert alive(first) == []


def test_released_workers_are_gone_before_the_engine_closes_and_take_no_more_tasks():
    """A run releases its workers after its last stage with tasks (the write): their processes end there, so
    their memory leaves the process tree while the run finishes alone; a later map is refused, not run inline.
    The control: before the release the same workers serve the stages."""
    with Engine("local", workers=2) as engine:
        workers = set(engine.map(whoami, list(range(8)), progress=False))
        assert alive(workers) and os.getpid() not in workers
        engine.release_workers()
        assert alive(workers) == []
        with pytest.raises(RuntimeError, match="workers not released"):
            engine.map(square, [1], progress=False)
    with Engine("local", workers=1) as engine:  # inline: nothing to release, the process goes on
        engine.release_workers()
        assert engine.map(square, [3], progress=False) == [9]


def test_one_worker_runs_inline():
    with Engine("local", workers=1) as engine:
        assert set(engine.map(whoami, list(range(3)), progress=False)) == {os.getpid()}


def test_first_failure_is_raised_as_itself_and_cancels_what_has_not_started(tmp_path):
    """Proven by which tasks ran, not by the time it took: every other task waits until the caller has seen the
    failure, so none can finish before it; those not yet handed to a worker then never run."""
    marks, release = tmp_path / "marks", tmp_path / "release"
    marks.mkdir()
    tasks = [(i, 0, str(marks), str(release)) for i in range(20)]
    with Engine("local", workers=2) as engine:
        workers = [p for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]
        with pytest.raises(KeyError, match="task 0 is bad"):
            engine.map(fail_on, tasks, progress=False)
        assert list(marks.iterdir()) == [], "a task finished before the failure was raised"
        release.touch()
    # the two running tasks finish, and the pool's queue holds up to workers + 1 more it cannot take back
    ran = sorted(int(p.name) for p in marks.iterdir())
    assert len(workers) == 2 and 2 <= len(ran) <= 5 and 0 not in ran, f"tasks queued after the failure ran: {ran}"
    assert wait_gone(workers, HANG) == [], "a worker outlived the engine"
    assert sorted(int(p.name) for p in marks.iterdir()) == ran, "a task ran after the engine was left"


def test_initializer_runs_once_per_process(tmp_path):
    log = tmp_path / "log"
    with Engine("local", workers=2, initializer=load, initargs=(str(log), "tok")) as engine:
        results = engine.map(loaded, list(range(16)), progress=False)
    assert all(values == ["tok"] for _, values in results)
    pids = log.read_text().split()
    assert len(pids) == len(set(pids)) <= 2 and {str(pid) for pid, _ in results} <= set(pids)
    _loaded.clear()
    with Engine("local", workers=1, initializer=load, initargs=(str(tmp_path / "inline"), "x")) as engine:
        assert engine.map(loaded, [0, 1], progress=False) == [(os.getpid(), ["x"])] * 2
    _loaded.clear()


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "spark"}, "unknown engine 'spark'"),
    ({"workers": 0}, "workers must be a positive integer"),
    ({"connect_timeout": 0}, "connect_timeout must be positive"),
    ({"address": "127.0.0.1:6379"}, "needs the ray engine"),
    ({"kind": "ray", "address": "localhost"}, "'localhost' is not host:port"),
    ({"kind": "ray", "address": "host:99999"}, "is not host:port"),
    ({"kind": "ray", "address": "http://h:1"}, "is not host:port"),
])
def test_bad_arguments_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Engine(**kwargs)


# -- signals -----------------------------------------------------------------------------------------------
#: A run with two workers on slow tasks; each task writes its pid to MARKS once it runs. The ``finally`` stands
#: for the caller's lock: it records which of those workers still lived when the exception reached it.
RUN = r"""
import os, sys, time
from pathlib import Path
import psutil
from packtool.packer.engine import Engine

def slow(task):
    i, marks = task
    Path(marks, str(os.getpid())).touch()
    time.sleep(60)

if __name__ == "__main__":
    marks = sys.argv[1]
    try:
        with Engine("local", workers=2) as engine:
            engine.map(slow, [(i, marks) for i in range(4)], progress=False)
    finally:
        pids = [int(p.name) for p in Path(marks).iterdir()]
        living = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        Path(marks).with_suffix(".unwound").write_text(str(living))
"""


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The RUN script, once both workers run a task; with every process it started."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "run.py"  # a file: spawn workers import the task from it
    script.write_text(RUN)
    proc = subprocess.Popen([sys.executable, str(script), str(marks)], cwd=ROOT, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + HANG
    while len(list(marks.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(marks.iterdir())) == 2, proc.stderr.read() if proc.poll() is not None else "no start"
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert {int(p.name) for p in marks.iterdir()} <= {p.pid for p in descendants}
    return proc, descendants


def wait_gone(processes: list[psutil.Process], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while alive(p.pid for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(p.pid for p in processes)


def test_sigterm_to_the_parent_alone_ends_every_worker_before_it_unwinds(tmp_path):
    proc, descendants = start_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=HANG)
    assert proc.returncode != 0 and proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()
    assert wait_gone(descendants, HANG) == [], [p.cmdline() for p in descendants if p.pid in alive([p.pid])]
    assert (tmp_path / "marks.unwound").read_text() == "[]", "workers still lived when the caller unwound"


def test_sigkill_of_the_parent_takes_the_workers_along(tmp_path):
    proc, descendants = start_run(tmp_path)
    proc.kill()
    proc.wait(timeout=HANG)
    assert wait_gone(descendants, HANG) == []


# -- Ray -------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_cluster(temp_dir: str) -> None:
    """Stop the Ray processes of one cluster (``ray stop`` would stop every Ray on the host, including the other
    test workers' ones): each of them names its temp dir on its command line; their children go with them."""
    marks = (f"{temp_dir}/session", f"--temp-dir={temp_dir}")
    roots = [p for p in psutil.process_iter(["cmdline"]) if p.pid != os.getpid()
             and any(m in arg for arg in p.info["cmdline"] or () for m in marks)]
    doomed = set(roots)
    for p in roots:
        try:
            doomed.update(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in doomed:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, living = psutil.wait_procs(doomed, timeout=3)
    for p in living:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(living, timeout=3)


@pytest.fixture
def ray_cluster(request):
    """A two-node Ray cluster on loopback with token authentication (its own token, its own temp dir, a free
    port): yields the address, the client environment (the token only: the engine must turn token mode on by
    itself) and a function that stops the cluster, which also runs at teardown."""
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live below it
    request.addfinalizer(lambda: shutil.rmtree(temp_dir, ignore_errors=True))
    request.addfinalizer(lambda: stop_cluster(temp_dir))
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    cluster_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    port = free_port()
    address = f"127.0.0.1:{port}"
    ray_cli = [str(Path(sys.executable).with_name("ray")), "start", "--num-cpus=1", "--disable-usage-stats",
               f"--temp-dir={temp_dir}"]
    for args in (["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false"],
                 [f"--address={address}"]):
        started = subprocess.run(ray_cli + args, env=cluster_env, capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stdout + started.stderr
    client_env = {**env, "RAY_AUTH_TOKEN": token, "TOKENIZERS_PARALLELISM": "false"}
    return address, client_env, lambda: stop_cluster(temp_dir)


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file of an output except the work files under ``.packtool/``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".packtool" not in p.relative_to(root).parts}


def pack_cli(demo_dir: Path, out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKTOOL, "pack", str(demo_dir / "dataset"), str(out), "--tokenizer",
                           str(demo_dir / "tokenizer"), "--pack-size", "2048", "--shard-size", "8",
                           "--no-progress", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=2 * HANG)


#: On the cluster: the initializer runs in every Ray worker before its first task, and a failing task surfaces
#: as its own exception. (Functions of ``__main__`` travel by value, so the workers need not import this file.)
ON_CLUSTER = r"""
import json, os, sys, time
from packtool.packer.engine import Engine

def load(log, value):
    os.environ["ENGINE_TEST_LOADED"] = value
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")

def loaded(_):
    time.sleep(0.2)
    return os.getpid(), os.environ.get("ENGINE_TEST_LOADED")

def fail_on(x):
    if x == 2:
        raise KeyError(f"task {x} is bad")
    return x

address, log = sys.argv[1:]
with Engine("ray", address=address, initializer=load, initargs=(log, "tok")) as engine:
    results = engine.map(loaded, list(range(6)), progress=False)
    try:
        engine.map(fail_on, list(range(4)), progress=False)
    except KeyError as exc:
        failure = str(exc)
print(json.dumps({"results": results, "failure": failure}))
"""


def test_pack_on_a_loopback_ray_cluster_matches_local_bytes(ray_cluster, packed, demo_dir, tmp_path):
    address, env, stop = ray_cluster
    done = pack_cli(demo_dir, tmp_path / "ray", env, "--engine", "ray", "--ray-address", address)
    assert done.returncode == 0, done.stderr
    reference = digest(packed)
    assert len(reference) > 10 and digest(tmp_path / "ray") == reference

    hooks = subprocess.run([sys.executable, "-c", ON_CLUSTER, address, str(tmp_path / "log")], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
    assert hooks.returncode == 0, hooks.stderr
    report = json.loads(hooks.stdout)
    assert all(value == "tok" for _, value in report["results"])
    pids = (tmp_path / "log").read_text().split()
    assert len(pids) == len(set(pids)) and {str(p) for p, _ in report["results"]} <= set(pids)
    assert report["failure"] == "'task 2 is bad'"

    stop()
    failed = pack_cli(demo_dir, tmp_path / "stopped", env, "--engine", "ray", "--ray-address", address)
    # refused at the socket, by packtool's probe before ray.init (which would retry for minutes)
    assert failed.returncode == 2
    assert failed.stderr.strip() == f"packtool: error: cannot reach the Ray cluster at {address}: connection refused"


@pytest.mark.parametrize("address, reason", [
    ("localhost", "Ray address 'localhost' is not host:port"),
    ("127.0.0.1:{port}", "cannot reach the Ray cluster at 127.0.0.1:{port}: connection refused"),
    ("no-such-host.invalid:6379", "cannot reach the Ray cluster at no-such-host.invalid:6379: unknown host"),
])
def test_bad_ray_address_fails_at_once_with_one_line(address, reason, demo_dir, tmp_path):
    """Refused by the address check or packtool's socket probe (their reasons), so ray.init never retried."""
    port = free_port()
    address, reason = address.format(port=port), reason.format(port=port)
    done = pack_cli(demo_dir, tmp_path / "out", {**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                    "--engine", "ray", "--ray-address", address)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(f"packtool: error: {reason}") and "\n" not in done.stderr.strip()


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:{port}"])
def test_bad_ray_address_leaves_no_output(address, demo_dir, tmp_path):
    done = pack_cli(demo_dir, tmp_path / "out", {**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                    "--engine", "ray", "--ray-address", address.format(port=free_port()))
    assert done.returncode == 2
    assert not (tmp_path / "out").exists()


def test_a_port_that_is_not_ray_fails_the_handshake():
    """Something listens but answers like a web server: refused by the handshake, so ray.init (which retries for
    minutes) never runs."""
    ray = pytest.importorskip("ray")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(EngineError, match=f"no Ray cluster at {address}: something listens there"):
            with Engine("ray", address=address, connect_timeout=HANG):
                pass
    assert not ray.is_initialized(), "ray.init ran against a server that is not Ray"
