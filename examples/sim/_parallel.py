"""Replays side by side: independent replays (modes of one table, points of the sweep) on worker
processes, one CPU each.

    run_all([(params, mode), ...], jobs=N, on_done=cb) -> [ModeResult, ...]   (in the order given)

A replay is a deterministic function of its parameters and seed (``_replay``), so where it ran
changes nothing in its result, only how long the whole command takes. Each worker is pinned to a
CPU of its own (round robin over the CPUs this process may use): a replay runs one thread at a
time, and two on one CPU would each take twice as long. Workers start with ``spawn`` (a fork after
torch has started its thread pools is unsafe). ``jobs=1`` runs everything here, in order.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from ._model import SimParams
from ._replay import ModeResult, replay


def available_cpus() -> list[int]:
    getter = getattr(os, "sched_getaffinity", None)
    return sorted(getter(0)) if getter is not None else list(range(os.cpu_count() or 1))


def default_jobs() -> int:
    """One worker per CPU this process may use."""
    return len(available_cpus())


def _init_worker(cpus: Any) -> None:
    """Take the next CPU from the parent's queue and stay on it; logs as quiet as the parent's."""
    from . import quiet_logs

    quiet_logs()
    cpu = cpus.get()
    setter = getattr(os, "sched_setaffinity", None)
    if setter is not None and cpu is not None:
        try:
            setter(0, {cpu})
        except OSError:
            pass


def _one(params: SimParams, mode: str, progress: bool = False) -> ModeResult:
    return replay(params, mode, progress=_Progress(params, mode) if progress else None)


class _Progress:
    """One line on stderr per tenth of a long replay's requests (where it runs, as it runs)."""

    LONG = 4096  # requests: a replay shorter than this ends before it would matter

    def __init__(self, params: SimParams, mode: str) -> None:
        self.label = f"{mode}, GEN TP{params.gen_tp}"
        self.t0 = time.perf_counter()
        self.on = params.warmup + params.requests >= self.LONG

    def __call__(self, ended: int, total: int) -> None:
        if self.on and ended < total:
            print(f"    {self.label}: {ended:,} / {total:,} requests ended ({time.perf_counter() - self.t0:.0f} s)",
                  file=sys.stderr, flush=True)


def run_all(work: Sequence[tuple[SimParams, str]], *, jobs: int | None = None,
            on_done: Callable[[int, ModeResult], None] | None = None, progress: bool = False) -> list[ModeResult]:
    """Every ``(params, mode)`` of ``work`` replayed; results in ``work``'s order. ``on_done(i, result)``
    as each ends (in the order they end, on this thread); ``progress``: a line on stderr per tenth
    of the requests of each long replay (4,096 requests or more)."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    results: list[ModeResult | None] = [None] * len(work)
    if jobs == 1 or len(work) <= 1:
        for i, (params, mode) in enumerate(work):
            results[i] = r = _one(params, mode, progress)
            if on_done is not None:
                on_done(i, r)
        return results  # type: ignore[return-value]
    workers = min(jobs, len(work))
    ctx = multiprocessing.get_context("spawn")
    cpus = ctx.Queue()
    allowed = available_cpus()
    for k in range(workers):
        cpus.put(allowed[k % len(allowed)] if len(allowed) >= 2 else None)
    # the costliest first (GEN TP x requests; inline and orchestrated run receive tasks, ideal none),
    # so that the cheap ones fill in at the end
    order = sorted(range(len(work)), key=lambda i: -_cost(*work[i]))
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(cpus,)) as pool:
        pending: dict[Future[ModeResult], int] = {pool.submit(_one, *work[i], progress): i for i in order}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    results[i] = r = fut.result()
                    if on_done is not None:
                        on_done(i, r)
        except BaseException:  # interrupted, or a replay raised: nothing more starts, nothing runs on
            procs = list((getattr(pool, "_processes", None) or {}).values())  # (no public way to stop them;
            pool.shutdown(wait=False, cancel_futures=True)                    # shutdown forgets them)
            for proc in procs:
                proc.terminate()
            raise
    return results  # type: ignore[return-value]


def _cost(params: SimParams, mode: str) -> float:
    return (params.warmup + params.requests) * params.gen_tp * (1.0 if mode == "ideal" else 2.5)
