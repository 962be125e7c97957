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
from collections import deque
from types import TracebackType

import numpy as np
import structlog
from anyio.from_thread import start_blocking_portal

from ._engine import GenEngine, StepReport

log = structlog.get_logger("orchestrator.loop")


@dataclasses.dataclass(frozen=True)
class Percentiles:
    p50: float
    p99: float
    max: float

    @staticmethod
    def of(values_ms: np.ndarray) -> Percentiles:
        if values_ms.size == 0:
            return Percentiles(0.0, 0.0, 0.0)
        p50, p99 = np.percentile(values_ms, [50, 99])
        return Percentiles(float(p50), float(p99), float(values_ms.max()))


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
    def __init__(self, engine: GenEngine, *, idle_wait_s: float = 0.05, history: int = 1 << 17) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._reports: deque[StepReport] = deque(maxlen=history)
        self.error: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        engine = self.engine
        try:
            while not stop.is_set():
                if not engine.num_running:  # nothing to decode: sleep until a submit or completion
                    engine.wakeup.wait(self._idle_wait_s)
                engine.wakeup.clear()  # before step(): anything set from here on is seen next time
                report = engine.step()
                if report.batch_size or report.admitted:
                    self._reports.append(report)
        except BaseException as exc:  # surfaced by EngineThreads.__exit__ and logged now
            self.error = exc
            log.exception("decode_loop_crashed")
            raise

    def reset_statistics(self) -> None:
        self._reports.clear()

    def statistics(self) -> LoopStatistics:
        reports = list(self._reports)
        decode = [r for r in reports if r.batch_size]
        orch = np.array([r.orchestration_s * 1e3 for r in reports])
        blocked = np.array([r.blocked_s * 1e3 for r in reports])
        stalled = np.array([r.stalled_s * 1e3 for r in reports])
        model = np.array([r.model_s * 1e3 for r in decode])
        return LoopStatistics(
            iterations=len(reports),
            decode_iterations=len(decode),
            orchestration_ms=Percentiles.of(orch),
            blocked_ms=Percentiles.of(blocked),
            stalled_ms=Percentiles.of(stalled),
            model_ms=Percentiles.of(model),
            mean_batch=float(np.mean([r.batch_size for r in decode])) if decode else 0.0,
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
        self.engine.close()
        if self.engine.receiver is not None:
            self._receiver_future.result(timeout=30)
        # one last drain, so results published during shutdown free their blocks
        self.engine.step()
        self._stack.close()
        if self.loop.error is not None and exc is None:
            raise RuntimeError("the decode loop crashed") from self.loop.error
