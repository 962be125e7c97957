"""What the engine reports: per-step figures, histograms, and its statistics snapshot."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence as Seq

from ._budget import BudgetStatistics
from ._kvpool import PoolStatistics
from ._requests import DeferReason, FailureReason


@dataclasses.dataclass(frozen=True)
class StepReport:
    batch_size: int
    admitted: int
    deferred: dict[DeferReason, int]
    orchestration_s: float
    """Wall time of steps 1-4 (everything but the model step)."""
    blocked_s: float
    """Of that, time spent in explicit blocking waits (staging reserve, peer handshake)."""
    stalled_s: float
    """Of that, wall time minus this thread's CPU time: off the CPU (waiting for the GIL, a lock,
    a blocking wait, or preempted)."""
    model_s: float


class Histogram:
    """Cumulative counts of values in fixed buckets (Prometheus style: ``counts[i]`` are the values
    ``<= bounds[i]``, the last one every value); O(log buckets) per value, on one thread."""

    __slots__ = ("bounds", "_counts", "sum")

    def __init__(self, bounds: Seq[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, object]:
        """{"bounds": [...], "counts": cumulative per bound then +Inf, "sum": float}."""
        return {"bounds": list(self.bounds), "counts": list(itertools.accumulate(self._counts)), "sum": self.sum}


RECEIVE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECEIVE_BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 33, 2))  # 4 KiB .. 4 GiB


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    waiting: int
    receiving: int
    ready: int
    running: int
    finished: int
    failed: dict[FailureReason, int]
    aborted: int
    deferral_episodes: dict[DeferReason, int]
    receives_in_flight: int
    staging_bytes: int
    peak_staging_bytes: int
    inline_fallbacks: int
    quarantined_blocks: int
    """KV blocks of ended requests that a late receive may still write; freed when it ends."""
    receive_seconds: dict[str, object]
    """Histogram (``Histogram.snapshot``) of how long this rank's successful receives took."""
    receive_bytes: dict[str, object]
    """Histogram of the bytes each successful receive moved."""
    health: str | None
    budget: BudgetStatistics
    pool: PoolStatistics
