"""Run independent tasks: in this process, on a local process pool, or on Ray. Each task writes its own output
files, so results never depend on the engine, the worker count or the completion order."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Sequence

from tqdm import tqdm

from packtool.errors import EngineError


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def run_tasks(fn: Callable, tasks: Sequence[tuple], *, workers: int = 1, engine: str = "local",
              ray_address: str | None = None, desc: str = "", unit: str = "task",
              progress: bool = True) -> list[Any]:
    """``[fn(*t) for t in tasks]``, in parallel; results in task order. The first failure is raised."""
    bar = tqdm(total=len(tasks), desc=desc, unit=unit, disable=not progress or not tasks, leave=False)
    try:
        if engine == "ray":
            return _run_ray(fn, tasks, ray_address, bar)
        if engine != "local":
            raise ValueError(f"unknown engine {engine!r} (local or ray)")
        if workers <= 1 or len(tasks) <= 1:
            results = []
            for t in tasks:
                results.append(fn(*t))
                bar.update()
            return results
        results: list[Any] = [None] * len(tasks)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx) as pool:
            pending = {pool.submit(fn, *t): i for i, t in enumerate(tasks)}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        results[i] = fut.result()
                    except BaseException:
                        for other in pending:
                            other.cancel()
                        raise
                    bar.update()
        return results
    finally:
        bar.close()


def _run_ray(fn: Callable, tasks: Sequence[tuple], address: str | None, bar) -> list[Any]:
    """The tasks as Ray tasks (one CPU each). A task's failure is re-raised as its own exception (not Ray's
    wrapper with the remote traceback in its message), after the tasks not yet finished are cancelled."""
    try:
        import ray
    except ImportError:
        raise EngineError("the ray engine needs the optional extra: pip install 'packtool[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    remote = ray.remote(fn)
    refs = [remote.remote(*t) for t in tasks]
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(tasks)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                results[index[r]] = ray.get(r)
                bar.update()
    except ray.exceptions.RayTaskError as exc:
        for r in pending:
            ray.cancel(r)
        if isinstance(exc.cause, Exception):
            raise exc.cause from exc
        raise
    return results
