"""Admission: which WAITING requests start receiving this step. Sync, no I/O, execution thread only.

Per step, in FCFS order over the waiting queue::

    active >= limit                             -> stop (full; not a deferral). ``active`` and its
                                                   limit are RECEIVING + READY vs max_prefetch_seqs
                                                   (INLINE: RECEIVING + READY + RUNNING vs max_num_seqs)
    KV pool cannot hold the request             -> defer KV_EXHAUSTED, skip it (it neither takes nor
                                                   blocks the budget; later requests may go)
    an earlier KV-fitting request was denied    -> defer BACKPRESSURE (no overtaking)
    budget.acquire_nowait(cost) denied          -> defer BACKPRESSURE, and block the rest
    else                                        -> allocate KV (cannot fail: checked above), admit

The budget is taken *before* KV allocation, so a request the budget denies is never allocated and
rolled back. ``INLINE`` and ``IDEAL`` modes skip the budget here (inline takes it later, blocking).
"""

from __future__ import annotations

import dataclasses
from collections import deque

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
    """Requests deferred this step, by reason."""


class Scheduler:
    def __init__(self, config: OrchestratorConfig, budget: TransferBudget, pool: KVBlockPool) -> None:
        self._config = config
        self._budget = budget
        self._pool = pool
        self.waiting: deque[Sequence] = deque()
        self.deferral_episodes: dict[DeferReason, int] = {r: 0 for r in DeferReason}
        """A request deferred for the same reason in consecutive steps counts once."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def schedule(self, active: int, limit: int | None = None) -> ScheduleResult:
        admitted: list[Admission] = []
        deferred = {r: 0 for r in DeferReason}
        if not self.waiting:
            return ScheduleResult(admitted, deferred)
        use_budget = self._config.mode is Mode.ORCHESTRATED
        limit = self._config.max_num_seqs if limit is None else limit
        budget_blocked = False
        kept: deque[Sequence] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if active + len(admitted) >= limit:
                kept.append(seq)
                kept.extend(self.waiting)
                self.waiting.clear()
                break
            if not self._pool.can_allocate(seq.num_blocks):
                self._defer(seq, DeferReason.KV_EXHAUSTED, deferred)
                kept.append(seq)
                continue
            grant = None
            if use_budget:
                if budget_blocked:
                    self._defer(seq, DeferReason.BACKPRESSURE, deferred)
                    kept.append(seq)
                    continue
                try:
                    grant = self._budget.acquire_nowait(seq.cost)
                except WouldBlock:
                    budget_blocked = True
                    self._defer(seq, DeferReason.BACKPRESSURE, deferred)
                    kept.append(seq)
                    continue
            seq.block_ids = self._pool.allocate(seq.num_blocks)
            seq.last_defer = None
            seq.state = RequestState.RECEIVING
            admitted.append(Admission(seq, grant))
        self.waiting = kept
        return ScheduleResult(admitted, deferred)

    def _defer(self, seq: Sequence, reason: DeferReason, deferred: dict[DeferReason, int]) -> None:
        deferred[reason] += 1
        if seq.last_defer is not reason:
            seq.last_defer = reason
            self.deferral_episodes[reason] += 1
            log.debug("request_deferred", request_id=seq.request_id, reason=reason.value, cost=seq.cost)
