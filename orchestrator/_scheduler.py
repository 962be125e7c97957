"""Admission: which WAITING requests start receiving this step. Sync, no I/O, execution thread only.

Per step, in FCFS order over the waiting queue, stopping as soon as nothing more can be admitted::

    active >= limit                             -> stop (full; not a deferral). ``active`` and its
                                                   limit are RECEIVING + READY vs max_prefetch_seqs
                                                   (INLINE: RECEIVING + READY + RUNNING vs max_num_seqs)
    KV pool cannot hold the request             -> defer KV_EXHAUSTED, skip it (it neither takes nor
                                                   blocks the budget; later requests may go), at most
                                                   ``max_kv_skips`` of them per step
    budget.acquire_nowait(cost) denied          -> defer BACKPRESSURE and stop: every later
                                                   KV-fitting request would have to wait behind it
                                                   (no overtaking), so none is looked at
    else                                        -> allocate KV (cannot fail: checked above), admit

The budget is taken *before* KV allocation, so a request the budget denies is never allocated and
rolled back. ``INLINE`` and ``IDEAL`` modes skip the budget here (inline takes it later, blocking).

Per-step work is O(admitted + KV skips), however long the queue: the queue is an insertion-ordered
dict (O(1) removal of admitted or aborted requests) and the scan stops at the first budget denial.
A deferral *episode* is counted once per request and reason, for the requests the scan reaches: a
budget episode is one head-of-line request blocked on the budget (until it is admitted), not one
per request queued behind it. ``ScheduleResult.deferred`` counts, for a budget stop, every request
left waiting behind it, without looking at them.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import structlog

from ._budget import Grant, TransferBudget
from ._config import Mode, OrchestratorConfig
from ._errors import WouldBlock
from ._kvpool import KVBlockPool
from ._requests import DeferReason, RequestState, Sequence

log = structlog.get_logger("orchestrator.scheduler")


@dataclasses.dataclass(frozen=True)
class Admission:
    seq: Sequence
    grant: Grant | None


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    admitted: list[Admission]
    deferred: dict[DeferReason, int]
    """Requests deferred this step, by reason (see the module docstring)."""
    scanned: int = 0
    """Waiting requests examined this step (bounded by admitted + KV skips + 1)."""


class Scheduler:
    max_kv_skips = 64
    """KV-exhausted requests skipped per step before the scan stops (bounds per-step work)."""

    def __init__(self, config: OrchestratorConfig, budget: TransferBudget, pool: KVBlockPool) -> None:
        self._config = config
        self._budget = budget
        self._pool = pool
        self._waiting: OrderedDict[str, Sequence] = OrderedDict()
        self.deferral_episodes: dict[DeferReason, int] = {r: 0 for r in DeferReason}
        """A request deferred for the same reason in consecutive steps counts once."""

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting queue in FCFS order (a snapshot; O(n), for inspection and tests)."""
        return list(self._waiting.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, seq: Sequence) -> None:
        self._waiting[seq.request_id] = seq

    def remove(self, request_id: str) -> Sequence | None:
        return self._waiting.pop(request_id, None)

    def pop_all(self) -> list[Sequence]:
        out = list(self._waiting.values())
        self._waiting.clear()
        return out

    def schedule(self, active: int, limit: int | None = None) -> ScheduleResult:
        admitted: list[Admission] = []
        deferred = {r: 0 for r in DeferReason}
        if not self._waiting:
            return ScheduleResult(admitted, deferred)
        use_budget = self._config.mode is Mode.ORCHESTRATED
        limit = self._config.max_num_seqs if limit is None else limit
        scanned = 0
        for seq in self._waiting.values():
            if active + len(admitted) >= limit:
                break
            scanned += 1
            if not self._pool.can_allocate(seq.num_blocks):
                self._defer(seq, DeferReason.KV_EXHAUSTED, deferred)
                if deferred[DeferReason.KV_EXHAUSTED] >= self.max_kv_skips:
                    break
                continue
            grant = None
            if use_budget:
                try:
                    grant = self._budget.acquire_nowait(seq.cost)
                except WouldBlock:
                    self._defer(seq, DeferReason.BACKPRESSURE, deferred)
                    # everyone behind waits too, unexamined (FCFS: no overtaking of this request)
                    deferred[DeferReason.BACKPRESSURE] = (
                        len(self._waiting) - len(admitted) - deferred[DeferReason.KV_EXHAUSTED])
                    break
            seq.block_ids = self._pool.allocate(seq.num_blocks)
            seq.last_defer = None
            seq.state = RequestState.RECEIVING
            admitted.append(Admission(seq, grant))
        for a in admitted:
            del self._waiting[a.seq.request_id]
        return ScheduleResult(admitted, deferred, scanned)

    def _defer(self, seq: Sequence, reason: DeferReason, deferred: dict[DeferReason, int]) -> None:
        deferred[reason] += 1
        if seq.last_defer is not reason:
            seq.last_defer = reason
            self.deferral_episodes[reason] += 1
            log.debug("request_deferred", request_id=seq.request_id, reason=reason.value, cost=seq.cost)
