"""Admission: which WAITING requests start receiving this step. Sync, no I/O, execution thread only.

Per step, in FCFS order among the waiting requests the KV pool can hold now, stopping as soon as
nothing more can be admitted::

    active >= limit                             -> stop (full; not a deferral). ``active`` and its
                                                   limit are RECEIVING + READY vs max_prefetch_seqs
                                                   (INLINE: RECEIVING + READY + RUNNING vs max_num_seqs)
    KV pool cannot hold the request             -> defer KV_EXHAUSTED, pass over it (it neither takes
                                                   nor blocks the budget; later requests may go, however
                                                   many misfits are ahead of them)
    budget.acquire_nowait(cost) denied          -> defer BACKPRESSURE and stop: every later
                                                   KV-fitting request would have to wait behind it
                                                   (no overtaking), so none is looked at
    else                                        -> allocate KV (cannot fail: checked above), admit

The budget is taken *before* KV allocation, so a request the budget denies is never allocated and
rolled back. ``INLINE`` and ``IDEAL`` modes skip the budget here (inline takes it later, blocking).

Per-step work is O((admitted + 1) log pool + max_kv_skips), however long the queue and however many
misfits it holds: the queue is an insertion-ordered dict (O(1) removal of admitted or aborted
requests), indexed by KV need (``_NeedIndex``: the earliest request that fits, without walking the
misfits ahead of it), and the scan stops at the first budget denial. A deferral *episode* is counted
once per request and reason, for the requests the scan reaches: a budget episode is one head-of-line
request blocked on the budget (until it is admitted), not one per request queued behind it; KV
episodes for the misfits ahead of where the step stopped, at most ``max_kv_skips`` of them a step.
``ScheduleResult.deferred`` counts, unless the step stopped full before admitting anything, every
waiting request the pool cannot hold now (KV_EXHAUSTED; a step that admitted some and then stopped
full counts those behind its stop too, though it marks episodes only for the ones ahead) and, for a
budget stop, every other request left waiting (BACKPRESSURE), without looking at them.
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
    """Waiting requests examined this step (bounded by admitted + 1 + ``max_kv_skips``)."""


_NONE = (1 << 62, -1)  # (order, need) of an empty bucket


class _NeedIndex:
    """The waiting requests' FCFS order per KV need: ``first_fit(free)`` is the earliest-arrived
    request that needs at most ``free`` blocks, ``count_fit(free)`` how many need at most ``free``,
    each in O(log pool size) (a segment tree over needs, holding each bucket's head and size)."""

    def __init__(self, max_need: int) -> None:
        self.top = max_need + 1  # needs above max_need share the last leaf (they never fit)
        size = 1
        while size < self.top + 1:
            size *= 2
        self.size = size
        self.head = [_NONE] * (2 * size)
        self.count = [0] * (2 * size)

    def leaf(self, need: int) -> int:
        return min(need, self.top)

    def set(self, leaf: int, head: tuple[int, int], delta: int) -> None:
        """The bucket at ``leaf`` has ``head`` now, and ``delta`` more requests."""
        i = leaf + self.size
        ct = self.count
        while i:
            ct[i] += delta
            i //= 2
        i = leaf + self.size
        hd = self.head
        if hd[i] == head:
            return
        hd[i] = head
        i //= 2
        while i:
            a, b = hd[2 * i], hd[2 * i + 1]
            new = a if a <= b else b
            if hd[i] == new:
                return  # nothing above changes
            hd[i] = new
            i //= 2

    def _prefix(self, free: int) -> tuple[tuple[int, int], int]:
        """Min head and total count over leaves [0, free]."""
        best, total = _NONE, 0
        lo, hi = self.size, min(free, self.top - 1) + self.size + 1  # [lo, hi)
        hd, ct = self.head, self.count
        while lo < hi:
            if lo & 1:
                best = min(best, hd[lo])
                total += ct[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, hd[hi])
                total += ct[hi]
            lo //= 2
            hi //= 2
        return best, total

    def first_fit(self, free: int) -> int:
        """The need (leaf) whose bucket head is the earliest request fitting ``free`` (-1: none)."""
        return self._prefix(free)[0][1] if free >= 0 else -1

    def count_fit(self, free: int) -> int:
        return self._prefix(free)[1] if free >= 0 else 0


class Scheduler:
    max_kv_skips = 64
    """KV misfits ahead of where a step's admission stopped that it marks deferred (their episode,
    their log line) per step: bounds that work. Admission itself never walks misfits (``_NeedIndex``)."""

    def __init__(self, config: OrchestratorConfig, budget: TransferBudget, pool: KVBlockPool) -> None:
        self._config = config
        self._budget = budget
        self._pool = pool
        self._waiting: OrderedDict[str, Sequence] = OrderedDict()
        self._orders: dict[str, int] = {}  # arrival order of each waiting request
        self._buckets: dict[int, OrderedDict[str, Sequence]] = {}  # by index leaf (KV need), FCFS
        self._index = _NeedIndex(pool.num_blocks)
        self._next_order = 0
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
        self._insert(seq, self._next_order)
        self._next_order += 1

    def _insert(self, seq: Sequence, order: int) -> None:
        """``seq`` at the end of the queue and of its bucket (``order``: the latest arrival's)."""
        rid = seq.request_id
        self._waiting[rid] = seq
        self._orders[rid] = order
        leaf = self._index.leaf(seq.num_blocks)
        bucket = self._buckets.setdefault(leaf, OrderedDict())
        bucket[rid] = seq
        self._index.set(leaf, self._bucket_head(leaf, bucket), +1)

    def remove(self, request_id: str) -> Sequence | None:
        seq = self._waiting.pop(request_id, None)
        if seq is None:
            return None
        del self._orders[request_id]  # (after the pop: the bucket's new head reads its own order)
        leaf = self._index.leaf(seq.num_blocks)
        bucket = self._buckets[leaf]
        del bucket[request_id]
        if not bucket:
            del self._buckets[leaf]
        self._index.set(leaf, self._bucket_head(leaf, bucket), -1)
        return seq

    def _bucket_head(self, leaf: int, bucket: OrderedDict[str, Sequence]) -> tuple[int, int]:
        return (self._orders[next(iter(bucket))], leaf) if bucket else _NONE

    def pop_all(self) -> list[Sequence]:
        out = list(self._waiting.values())
        self._waiting.clear()
        self._orders.clear()
        self._buckets.clear()
        self._index = _NeedIndex(self._pool.num_blocks)
        return out

    def schedule(self, active: int, limit: int | None = None) -> ScheduleResult:
        """Admit, in FCFS order, the waiting requests the KV pool can hold now (a misfit is passed
        over at no cost: the index finds the earliest request that fits), each after its budget;
        stop at the window's limit, at the first budget denial, or when nothing left fits."""
        admitted: list[Admission] = []
        deferred = {r: 0 for r in DeferReason}
        if not self._waiting:
            return ScheduleResult(admitted, deferred)
        use_budget = self._config.mode is Mode.ORCHESTRATED
        limit = self._config.max_num_seqs if limit is None else limit
        scanned = 0
        stop_order: int | None = _NONE[0]  # misfits that arrived before this were passed over
        denied: Sequence | None = None
        orders: list[int] = []  # of the admitted, as they arrived (put back there if a step fails)
        while True:
            if active + len(admitted) >= limit:  # full: not a deferral
                stop_order = orders[-1] + 1 if orders else None
                break
            leaf = self._index.first_fit(self._pool.num_free)
            if leaf < 0:  # nothing waiting fits the pool now
                break
            seq = self._waiting[next(iter(self._buckets[leaf]))]
            scanned += 1
            grant = None
            if use_budget:
                try:
                    grant = self._budget.acquire_nowait(seq.cost)
                except WouldBlock:
                    # everyone behind waits too (FCFS: no overtaking of this request)
                    denied, stop_order = seq, self._orders[seq.request_id]
                    break
            try:
                seq.block_ids = self._pool.allocate(seq.num_blocks)
            except BaseException:  # cannot happen (validated at submit): no grant or block is lost with it
                if grant is not None:
                    grant.release()
                self._undo(admitted, orders)
                raise
            orders.append(self._orders[seq.request_id])
            self.remove(seq.request_id)
            seq.last_defer = None
            seq.state = RequestState.RECEIVING
            admitted.append(Admission(seq, grant))
        if stop_order is not None:
            free = self._pool.num_free
            deferred[DeferReason.KV_EXHAUSTED] = len(self._waiting) - self._index.count_fit(free)
            scanned += self._mark_misfits(stop_order, free)
        if denied is not None:
            self._defer(denied, DeferReason.BACKPRESSURE)
            deferred[DeferReason.BACKPRESSURE] = len(self._waiting) - deferred[DeferReason.KV_EXHAUSTED]
        return ScheduleResult(admitted, deferred, scanned)

    def _mark_misfits(self, before: int, free: int) -> int:
        """Mark the waiting requests that arrived before ``before`` (all of them misfits: one that fits
        would have been taken) KV-deferred, at most ``max_kv_skips`` of them; returns how many."""
        marked = 0
        orders = self._orders
        for rid, seq in self._waiting.items():
            if marked >= self.max_kv_skips or orders[rid] >= before:
                break
            self._defer(seq, DeferReason.KV_EXHAUSTED)
            marked += 1
        return marked

    def _undo(self, admitted: list[Admission], orders: list[int]) -> None:
        """This step's admissions go back to waiting at their places of arrival (``orders``), their
        blocks and grants returned. O(queue): a path that cannot be taken (see ``schedule``)."""
        for a, order in zip(admitted, orders):
            self._insert(a.seq, order)
        by_order = lambda item: self._orders[item[0]]  # noqa: E731
        self._waiting = OrderedDict(sorted(self._waiting.items(), key=by_order))
        for leaf, bucket in self._buckets.items():
            self._buckets[leaf] = bucket = OrderedDict(sorted(bucket.items(), key=by_order))
            self._index.set(leaf, self._bucket_head(leaf, bucket), 0)
        for a in admitted:
            if a.grant is not None:
                a.grant.release()
            if a.seq.block_ids is not None:
                self._pool.free(a.seq.block_ids)
                a.seq.block_ids = None
            a.seq.state = RequestState.WAITING

    def _defer(self, seq: Sequence, reason: DeferReason) -> None:
        if seq.last_defer is not reason:
            seq.last_defer = reason
            self.deferral_episodes[reason] += 1
            log.debug("request_deferred", request_id=seq.request_id, reason=reason.value, cost=seq.cost)
