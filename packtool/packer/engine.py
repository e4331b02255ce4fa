"""Run independent tasks: in this process, on a local process pool, or on Ray. Each task writes its own output
files, so results never depend on the engine, the worker count or the completion order.

One :class:`Engine` serves a whole run: its worker processes start once and serve every stage, and a Ray
cluster is connected when the engine is entered, so a bad address fails before the run touches anything.
Worker processes never outlive the engine: they die with the parent process even when it is SIGKILLed (Linux
parent-death signal, plus a watcher thread elsewhere), and a SIGTERM or SIGINT to the parent ends them before
the exception it raises reaches the caller (so a lock the caller holds is released only once no worker lives).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from types import ModuleType
from typing import Any, Literal, TypeVar

from tqdm import tqdm

from packtool.errors import ConfigError, EngineError
from packtool.settings import split_address

EngineKind = Literal["local", "ray"]
#: A stage's task record and its result (:meth:`Engine.map`).
T = TypeVar("T")
R = TypeVar("R")

#: ``host:port`` of a Ray cluster (a bracketed IPv6 host allowed).
#: What an HTTP/2 (gRPC) client sends first; a server answers with a SETTINGS frame.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4
#: Seconds between a worker's checks that its parent still lives (where no parent-death signal exists).
_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Engine:
    """Runs batches of independent tasks for one run (a context manager).

    ``kind="local"`` with ``workers == 1`` runs every task inline in this process; with more workers, one spawn
    process pool started on entry serves every :meth:`map` until exit. ``kind="ray"`` connects on entry to the
    cluster at ``address`` (``host:port``), or starts Ray in this process with ``workers`` CPUs when ``address``
    is None; a Ray connection made before the engine was entered is used as it is and left open.

    ``initializer(*initargs)`` runs once in every process that runs tasks (each pool worker, each Ray worker
    before its first task of this engine, this process when inline): the place to load what every task needs.
    ``import_main=False``: the pool's workers do not import the caller's ``__main__`` script (spawn runs it again
    in each, which a script calling packtool at module level cannot survive); then tasks and initializer must be
    importable by name, never defined in the script.
    """

    def __init__(self, kind: EngineKind = "local", workers: int = 1, address: str | None = None,
                 connect_timeout: float = 15.0, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple = (), import_main: bool = True) -> None:
        if kind not in ("local", "ray"):
            raise ConfigError(f"unknown engine {kind!r} (local or ray)")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a positive integer, got {workers!r}")
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be positive, got {connect_timeout!r}")
        if address is not None:
            if kind != "ray":
                raise ConfigError(f"a cluster address ({address!r}) needs the ray engine")
            split_address(address)
        self.kind, self.workers, self.address, self.connect_timeout = kind, workers, address, connect_timeout
        self.initializer, self.initargs, self.import_main = initializer, tuple(initargs), import_main
        self._pool: ProcessPoolExecutor | None = None
        self._ray: ModuleType | None = None  # the ray module once connected
        self._owns_ray = False
        self._handlers: dict[int, Any] = {}

    # -- lifetime ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        if self._pool is not None or self._ray is not None:
            raise RuntimeError("this engine is already open")
        if self.kind == "ray":
            self._connect_ray()
        elif self.workers > 1:
            context = multiprocessing.get_context("spawn") if self.import_main else _SpawnWithoutMain()
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=context,
                initializer=_worker_init, initargs=(os.getpid(), self.initializer, self.initargs))
            for _ in range(self.workers):  # a spawn pool starts a worker per task submitted while none is idle:
                self._pool.submit(_started)  # start them all now, so their start-ups (imports, initializer) overlap
        elif self.initializer is not None:
            self.initializer(*self.initargs)
        self._install_signal_handlers()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._pool is not None:  # after a failure, the tasks already running finish first
                self._pool.shutdown(wait=True, cancel_futures=True)
            if self._ray is not None and self._owns_ray:
                self._ray.shutdown()
        finally:
            self._pool, self._ray, self._owns_ray = None, None, False
            self._restore_signal_handlers()

    def release_workers(self) -> None:
        """The run needs no more tasks: a local pool's workers stop now (their memory leaves the process tree
        while the command finishes on its own); a later :meth:`map` is refused. Ray's workers stay the
        cluster's."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- running -----------------------------------------------------------------------------------------------
    def map(self, fn: Callable[[T], R], tasks: Sequence[T], *, desc: str = "", unit: str = "task",
            progress: bool = True, names: Sequence[str] | None = None,
            on_result: Callable[[int, Any], None] | None = None) -> list[R]:
        """``[fn(t) for t in tasks]`` on the engine's workers (each task one typed record, a frozen dataclass of
        its stage); results in task order. The first failure is raised as the task's own exception, after the
        tasks not yet started are cancelled. ``names`` says what each task works on (a worker that dies is
        reported with the tasks it may have been running); ``on_result(i, result)`` sees each result as it
        arrives and may raise to stop the map."""
        if self._pool is None and self._ray is None and (self.kind == "ray" or self.workers > 1):
            raise RuntimeError("Engine.map needs an open engine (use it in a with block; its workers not released)")
        bar = tqdm(total=len(tasks), desc=desc, unit=unit, disable=not progress or not tasks, leave=False)
        seen = on_result or (lambda i, r: None)
        try:
            if self._ray is not None:
                return self._map_ray(self._ray, fn, tasks, bar, seen)
            if self._pool is not None:
                return self._map_pool(self._pool, fn, tasks, bar, seen, names)
            results = []
            for i, t in enumerate(tasks):
                results.append(fn(t))
                seen(i, results[-1])
                bar.update()
            return results
        finally:
            bar.close()

    def _map_pool(self, pool: ProcessPoolExecutor, fn: Callable[[T], R], tasks: Sequence[T], bar,
                  seen: Callable[[int, Any], None], names: Sequence[str] | None) -> list[R]:
        results: list[Any] = [None] * len(tasks)
        try:
            pending = {pool.submit(fn, t): i for i, t in enumerate(tasks)}
        except BrokenProcessPool:
            raise EngineError("a worker process died (killed from outside, or out of memory?)") from None
        running: list[int] = []
        while pending:
            running = sorted(i for f, i in pending.items() if f.running()) or running
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):  # the same first failure however completions interleave
                i = pending.pop(fut)
                try:
                    results[i] = fut.result()
                    seen(i, results[i])
                except BaseException as exc:
                    for other in pending:
                        other.cancel()
                    if isinstance(exc, BrokenProcessPool):
                        raise EngineError("a worker process died (killed from outside, or out of memory?)"
                                          + _in_flight(names, running or [i])) from None
                    raise
                bar.update()
        return results

    def _map_ray(self, ray: ModuleType, fn: Callable[[T], R], tasks: Sequence[T], bar,
                 seen: Callable[[int, Any], None]) -> list[R]:
        """The tasks as Ray tasks (one CPU each). A task's failure is re-raised as its own exception (not Ray's
        wrapper with the remote traceback in its message), after the tasks not yet finished are cancelled."""
        remote = ray.remote(_ray_task)
        refs = [remote.remote(fn, self.initializer, self.initargs, t) for t in tasks]
        index = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * len(tasks)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for r in done:
                    results[index[r]] = ray.get(r)
                    seen(index[r], results[index[r]])
                    bar.update()
        except ray.exceptions.RayTaskError as exc:
            for r in pending:
                ray.cancel(r)
            if isinstance(exc.cause, Exception):
                raise exc.cause from exc
            raise
        except BaseException:
            for r in pending:
                ray.cancel(r)
            raise
        return results

    # -- Ray -----------------------------------------------------------------------------------------------
    def _connect_ray(self) -> None:
        """Connect to (or start) Ray now, bounded by ``connect_timeout``: an address nobody listens on fails at
        the socket, a port that is not Ray fails the HTTP/2 handshake, and ``ray.init`` itself runs against a
        deadline (it retries for minutes on its own)."""
        try:
            import ray
        except ImportError:
            raise ConfigError("the ray engine needs the optional extra: pip install 'packtool[ray]'") from None
        if ray.is_initialized():
            self._ray = ray
            return
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if self.address is None:
            # "local": a new instance here, never the cluster a `ray start` on this host left in /tmp/ray
            ray.init(address="local", num_cpus=self.workers, include_dashboard=False, runtime_env=env, **quiet)
        else:
            deadline = time.monotonic() + self.connect_timeout
            _probe_gcs(self.address, self.connect_timeout)
            _enable_token_auth_if_available()
            _init_before(deadline, self.address,
                         lambda: ray.init(address=self.address, runtime_env=env, **quiet))
        self._ray, self._owns_ray = ray, True

    # -- signals -------------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT end the workers first, then raise in the main thread (``SystemExit(128 + 15)``
        and ``KeyboardInterrupt``), so the caller unwinds only once no worker lives."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; its owner decides what they do
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._handlers.items():
            signal.signal(signum, previous)
        self._handlers.clear()

    def _on_signal(self, signum: int, frame) -> None:
        for s in self._handlers:  # a second signal must not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        self._stop_workers()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _stop_workers(self) -> None:
        """SIGKILL every pool worker and reap it. Tasks commit their files by renames, so a killed task leaves
        only temporaries behind."""
        if self._pool is None:
            return
        processes = list((getattr(self._pool, "_processes", None) or {}).values())  # no public handle on 3.11
        for p in processes:
            p.kill()
        for p in processes:
            p.join()


# -- worker side -------------------------------------------------------------------------------------------------
class _SpawnWithoutMainProcess(multiprocessing.context.SpawnProcess):
    """A spawned worker that does not import the parent's ``__main__``: spawn re-runs the script that started
    the parent in every worker (as ``__mp_main__``), so a script calling :func:`packtool.pack` at module level,
    without ``if __name__ == "__main__":``, would start a run in each worker. A pack run's workers run packtool's
    own functions only, which they import by name."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        main = sys.modules["__main__"]
        # spawn records the main module's file or name to import in the child; a bare module names neither
        sys.modules["__main__"] = ModuleType("__main__")
        try:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        finally:
            sys.modules["__main__"] = main


class _SpawnWithoutMain(multiprocessing.context.SpawnContext):
    Process = _SpawnWithoutMainProcess


def _worker_init(parent: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    """Tie this pool worker's life to its parent's, leave SIGINT to the parent, then run the user's hook."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the whole group: the parent decides
    _die_with_parent(parent)
    atexit.register(_exit_now)  # runs before the exit handlers registered earlier (multiprocessing's own)
    if initializer is not None:
        initializer(*initargs)


def _exit_now() -> None:
    """A pool worker's last act: its results went out through the pool's pipe as each task ended, so it ends
    without the interpreter's teardown of every module it loaded (a tenth of a second the parent waits for)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _started() -> None:
    """The task that starts a worker."""


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="packtool-parent-watch").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _in_flight(names: Sequence[str] | None, running: list[int]) -> str:
    """`` while working on X`` (or one of the tasks that were running) for a worker-death message."""
    if not names:
        return ""
    which = [names[i] for i in running]
    if len(which) == 1:
        return f" while working on {which[0]}"
    return f" while working on one of {', '.join(which[:4])}" + (f" and {len(which) - 4} more" if len(which) > 4
                                                                  else "")


#: Initializers that already ran in this Ray worker process.
_ray_initialized: set[tuple] = set()


def _ray_task(fn: Callable[[T], R], initializer: Callable[..., None] | None, initargs: tuple, task: T) -> R:
    if initializer is not None:
        key = (initializer.__module__, initializer.__qualname__, repr(initargs))
        if key not in _ray_initialized:
            initializer(*initargs)
            _ray_initialized.add(key)
    return fn(task)


# -- connecting to Ray -------------------------------------------------------------------------------------------
def _probe_gcs(address: str, timeout: float) -> None:
    """Fail in seconds, with the reason, unless something at ``address`` speaks HTTP/2 (Ray's GCS is gRPC)."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(_HTTP2_PREFACE)
            header = _read(s, 9)
    except socket.gaierror as exc:
        raise EngineError(f"cannot reach the Ray cluster at {address}: unknown host ({exc.strerror})") from None
    except TimeoutError:
        raise EngineError(f"cannot reach the Ray cluster at {address}: no answer within {timeout:g} s") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise EngineError(f"cannot reach the Ray cluster at {address}: {reason.lower()}") from None
    if len(header) < 9 or header[3] != _HTTP2_SETTINGS:
        raise EngineError(f"no Ray cluster at {address}: something listens there, but not Ray's gRPC server")


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _enable_token_auth_if_available() -> None:
    """Send the Ray authentication token when one is available (``RAY_AUTH_TOKEN``, the file named by
    ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``) and ``RAY_AUTH_MODE`` is unset. ``ray start --head``
    turns token authentication on whenever such a token exists, but ``ray.init`` with an explicit address
    never sends one on its own; a cluster without authentication ignores the token."""
    from ray._private.authentication import authentication_token_setup as auth

    log = logging.getLogger(auth.__name__)
    level = log.level
    log.setLevel(logging.ERROR)  # its warning would talk about starting a cluster
    try:
        auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)


def _init_before(deadline: float, address: str, init: Callable[[], object]) -> None:
    """Run ``init`` (``ray.init``) in a helper thread and give up at ``deadline``; its errors become one line."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            init()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(_not_main_thread_warning)
    thread = threading.Thread(target=target, daemon=True, name="packtool-ray-connect")
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    worker_log.removeFilter(_not_main_thread_warning)
    if thread.is_alive():  # Ray retries forever on its own, e.g. while the cluster rejects the token
        raise EngineError(f"the Ray cluster at {address} did not accept the connection in time (a wrong "
                          "authentication token looks like this)")
    error = outcome.get("error")
    if error is None:
        return
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    if any(type(e).__name__ == "AuthenticationError" for e in chain):
        raise EngineError(f"the Ray cluster at {address} refused the authentication token (or got none): give "
                          "it the cluster's token in RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or "
                          "~/.ray/auth_token") from None
    first = (str(chain[-1]).strip().splitlines() or [type(chain[-1]).__name__])[0]
    raise EngineError(f"cannot connect to the Ray cluster at {address}: {first}") from None


def _not_main_thread_warning(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that it set no SIGTERM handler from the connect thread: the engine sets its own."""
    return "SIGTERM handler is not set" not in record.getMessage()
