"""The execution thread's loop, and the two threads a GEN node runs.

    EngineThreads(engine)                         (a context manager)
      ├─ event-loop thread: anyio BlockingPortal running engine.receiver.run (the task group)
      └─ execution thread:  DecodeLoop.run: while not stopped: engine.step(); record timings
                             (sleeps on engine.wakeup only when nothing is RUNNING)

Per iteration the loop records the orchestration time, the explicit blocking time, the model time
and the batch size in a bounded ring (``history`` iterations), summarised by ``statistics()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from types import TracebackType

import numpy as np
import structlog
from anyio.from_thread import start_blocking_portal

from ._engine import GenEngine, StepReport
from ._step import GroupBroken

_REST_WAIT_S = 5.0  # EngineThreads' exit: how long it steps for the engine to come to rest

log = structlog.get_logger("orchestrator.loop")


@dataclasses.dataclass(frozen=True)
class Percentiles:
    p50: float
    p99: float
    max: float
    mean: float = 0.0

    @staticmethod
    def of(values_ms: np.ndarray) -> Percentiles:
        if values_ms.size == 0:
            return Percentiles(0.0, 0.0, 0.0, 0.0)
        p50, p99 = np.percentile(values_ms, [50, 99])
        return Percentiles(float(p50), float(p99), float(values_ms.max()), float(values_ms.mean()))


@dataclasses.dataclass(frozen=True)
class LoopStatistics:
    iterations: int
    decode_iterations: int
    orchestration_ms: Percentiles
    blocked_ms: Percentiles
    stalled_ms: Percentiles
    model_ms: Percentiles
    mean_batch: float


class DecodeLoop:
    # per-iteration figures kept in a ring of preallocated arrays (bounded, ~40 bytes an iteration)
    _FIELDS = ("orchestration_s", "blocked_s", "stalled_s", "model_s", "batch_size")

    def __init__(self, engine: GenEngine, *, idle_wait_s: float = 0.05, history: int = 1 << 17,
                 tp_tick_s: float = 0.002, tp_idle_s: float = 1.0) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._tp_tick_s = tp_tick_s
        self._tp_idle_s = tp_idle_s
        self._ring = np.zeros((len(self._FIELDS), history), dtype=np.float64)
        self._ring.fill(0.0)  # touch every page now: untouched pages would turn resident (RSS) as it fills
        self._count = 0  # iterations recorded since the last reset (the ring keeps the newest)
        self.error: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        """Step the engine until ``stop``. If a step raises (a model bug, a device error), the engine
        is marked unhealthy and the loop goes on stepping it, so that every live request fails with
        a reason and its blocks and budget come back; the error is kept in ``error``."""
        engine = self.engine
        leads = getattr(engine, "leads_steps", True)  # a tensor-parallel follower never waits: it
        while not stop.is_set():                      # steps whenever rank 0 does (in the collective)
            if leads and not engine.num_running and not engine.num_ready:  # nothing to decode or start:
                engine.wakeup.wait(self._wait_s(engine))  # sleep until a submit or a completion
            engine.wakeup.clear()  # before step(): anything set from here on is seen next time
            try:
                report = engine.step()
            except Exception as exc:
                if self.error is None:
                    self.error = exc
                    if isinstance(exc, GroupBroken):  # the model's collective: a rank or the group's link failed,
                        # a fault, not a bug: one line, no traceback, and the group's one cause, whichever
                        # collective met it first
                        log.error("decode_loop_group_broken", cause=exc.cause)
                        engine.mark_unhealthy(exc.cause)
                    else:
                        log.exception("decode_loop_crashed")
                        engine.mark_unhealthy(f"decode loop crashed: {type(exc).__name__}: {exc}")
                else:  # failing the live requests failed too: nothing more can be done here
                    log.exception("decode_loop_gave_up")
                    return
                continue
            if report.batch_size or report.admitted:
                self._record(report)
            if getattr(engine, "stopped", False) and not leads:
                return  # the group stopped (rank 0 said so, or a collective failed)

    def _wait_s(self, engine: GenEngine) -> float:
        """How long rank 0 (or a single rank) may sleep with nothing to decode. A tensor-parallel
        rank 0 with requests in flight wakes every ``tp_tick_s``: the other ranks' receive outcomes
        reach it only through a step. With nothing live it steps once every ``tp_idle_s`` (the
        other ranks wait in that step's collective, which must come well within the group's
        timeout), so an idle group costs one small collective a second."""
        if getattr(engine, "world_size", 1) > 1:
            return self._tp_tick_s if engine.live_requests else self._tp_idle_s
        return self._idle_wait_s

    def _record(self, r: StepReport) -> None:
        self._ring[:, self._count % self._ring.shape[1]] = (
            r.orchestration_s, r.blocked_s, r.stalled_s, r.model_s, r.batch_size)
        self._count += 1

    def reset_statistics(self) -> None:
        self._count = 0

    def statistics(self) -> LoopStatistics:
        ring = self._ring[:, : min(self._count, self._ring.shape[1])]
        batch = ring[4]
        orch, blocked, stalled, model = (ring[i] * 1e3 for i in range(4))
        decode = batch > 0
        return LoopStatistics(
            iterations=int(ring.shape[1]),
            decode_iterations=int(decode.sum()),
            orchestration_ms=Percentiles.of(orch),
            blocked_ms=Percentiles.of(blocked),
            stalled_ms=Percentiles.of(stalled),
            model_ms=Percentiles.of(model[decode]),
            mean_batch=float(batch[decode].mean()) if decode.any() else 0.0,
        )


class EngineThreads:
    """Run ``engine`` as a GEN node does: an event-loop thread and an execution thread."""

    def __init__(self, engine: GenEngine, *, backend: str = "asyncio", idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.loop = DecodeLoop(engine, idle_wait_s=idle_wait_s)
        self._backend = backend
        self._stop = threading.Event()
        self._stack = contextlib.ExitStack()
        self._thread: threading.Thread | None = None
        self.portal = None

    def __enter__(self) -> EngineThreads:
        self.portal = self._stack.enter_context(start_blocking_portal(self._backend))
        if self.engine.receiver is not None:
            self._receiver_future, _ = self.portal.start_task(self.engine.receiver.run, name="receive-group")
        self._thread = threading.Thread(target=self.loop.run, args=(self._stop,), name="execution", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self.engine.wakeup.set()
        if self._thread is not None:
            self._thread.join()
        # what is still live ends now, aborted (its clients hear), while the receive group still runs:
        # the CTXs are told to free their copies and the receives cancelled end as aborts, which tell
        # them too (a receive group closed first dropped those releases: each CTX held the KV until
        # its lease ran out)
        self.engine.stop("the engine's threads exited")  # a stop, not a failure: live requests end ABORTED
        deadline = time.monotonic() + _REST_WAIT_S

        def step_while(busy: Callable[[], object]) -> None:  # bounded: a landing a transport never ends stays
            self.engine.step()
            while busy() and time.monotonic() < deadline:
                time.sleep(0.01)
                self.engine.step()

        step_while(lambda: self.engine.receiver is not None and self.engine.receiver.in_flight)
        self.engine.close()
        if self.engine.receiver is not None:
            self._receiver_future.result(timeout=30)
        step_while(self.engine.rest_problems)  # results published during shutdown free their blocks
        self._stack.close()
        if self.loop.error is not None and exc is None:
            raise RuntimeError("the decode loop crashed") from self.loop.error
