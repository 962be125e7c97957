"""The GEN engine: the execution thread's side of the orchestrator.

One ``step()`` per decode iteration, on the execution thread::

    0. free quarantined blocks whose late receive has ended; every kv_hold_interval_s, ask each CTX
       to renew the leases of requests still WAITING (one batched message per peer, on the loop)
    1. drain the inbox        (submits and aborts from any thread; validated at submit)
    2. drain completions      (ReceiveResults from the event loop: RECEIVING -> READY / FAILED)
    3. schedule               (decode keeps its batch; READY fill free decode slots; admit WAITING
                              in FCFS: budget, then KV; receives run ahead of the batch, up to
                              max_prefetch_seqs holding KV without decoding)
    4. start receives         ORCHESTRATED: non-blocking submit to the receive group
                              INLINE: blocking staging reserve (timeout, then slow fallback) and a
                                      blocking peer handshake, here, on this thread (the baseline)
                              IDEAL: no receive; the request runs at once
    5. one decode step        step_fn(DecodeBatch) for every RUNNING request; emit tokens

``step()`` never awaits. In ORCHESTRATED mode nothing in it waits on I/O, a peer or a reservation;
it measures the time it spent in orchestration (0-4) and in explicit blocking waits (INLINE only).

Health: when the receive group dies or the decode loop crashes, ``health()`` says why, ``submit``
raises ``Unavailable``, and the next ``step()`` fails every live request with ``INTERNAL`` (budget
and blocks come back; receives in flight are cancelled and end as their results arrive).
Quarantine: a failed receive whose buffer the transport may still write (``ReceiveResult.landing``
busy) ends at once for the client, but its KV blocks are freed only when that receive is over.
Outputs are polled with ``poll()`` (or pushed to ``on_output``). The receive group must be running
on an event loop (``await engine.serve()``, or ``EngineThreads`` for a ready-made pair of threads).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence as Seq

import structlog
import torch

from transports import InvalidRequestId, KVSlice, Transport, check_handle, check_request_id, scatter

from ._budget import TransferBudget
from ._config import Mode, OrchestratorConfig
from ._errors import InvalidRequest, Unavailable, WouldBlock
from ._kvpool import KVBlockPool, PoolStatistics
from ._budget import BudgetStatistics
from ._receiver import ReceiveGroup, ReceiveJob, ReceivePart, plan_chunks, shift_heads
from ._requests import (
    DeferReason,
    FailureReason,
    GenRequest,
    KVSource,
    ReceiveResult,
    RequestOutput,
    RequestState,
    Sequence,
    plan_sources,
)
from ._scheduler import Admission, Scheduler, ScheduleResult

log = structlog.get_logger("orchestrator.engine")


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """Input of one decode step: the RUNNING requests, in a stable order."""

    request_ids: list[str]
    tokens: torch.Tensor  # int64 [B]: each request's newest token
    positions: torch.Tensor  # int64 [B]: its position (where this step writes its KV)
    block_tables: list[torch.Tensor]  # each request's KV blocks, in order
    kv: torch.Tensor  # the pool

    def __len__(self) -> int:
        return len(self.request_ids)


StepFn = Callable[[DecodeBatch], "Seq[int] | torch.Tensor"]


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


def _covering(chunks: Seq[KVSlice]) -> KVSlice:
    """The one slice that covers ``chunks`` (the pieces ``plan_chunks`` cut from it)."""
    return KVSlice(min(c.layer_start for c in chunks), max(c.layer_end for c in chunks),
                   min(c.head_start for c in chunks), max(c.head_end for c in chunks))


class GenEngine:
    _pull_releases = True
    """The last chunk of a pull lets the CTX free its copy (a tensor-parallel rank leaves that to rank 0)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        transport: Transport | None,
        step_fn: StepFn,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_received: Callable[[str, torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if transport is None and config.mode is not Mode.IDEAL:
            raise ValueError(f"mode {config.mode.value} needs a transport")
        self.config = config
        self.layout = config.layout
        self.budget = TransferBudget(config.transfer_budget_bytes)
        self.pool = KVBlockPool(config.layout, config.num_blocks, config.device, poison_freed=config.debug_poison_freed_blocks)
        self.scheduler = Scheduler(config, self.budget, self.pool)
        self._step_fn = step_fn
        self._clock = clock
        self._on_output = on_output
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[GenRequest | str] = queue.SimpleQueue()
        self._completions: queue.SimpleQueue[ReceiveResult] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        """Set whenever there is new work for the execution thread (submit, abort, completion)."""
        self._live_lock = threading.Lock()
        self._live: set[str] = set()
        self._receiving: dict[str, Sequence] = {}
        self._ready: dict[str, Sequence] = {}  # KV received, waiting for a decode slot (FIFO)
        self._running: dict[str, Sequence] = {}
        self._finished = 0
        self._aborted = 0
        self._failed = {r: 0 for r in FailureReason}
        self._inline_fallbacks = 0
        self._unhealthy: str | None = None
        self._quarantine: list[tuple[object, torch.Tensor]] = []  # (Landing, block ids)
        self._quarantined_blocks = 0
        self._receive_seconds = Histogram(RECEIVE_SECONDS_BUCKETS)
        self._receive_bytes = Histogram(RECEIVE_BYTES_BUCKETS)
        self._next_hold = clock() + config.kv_hold_interval_s
        register = getattr(transport, "register", None)
        if callable(register):  # a one-sided transport (NIXL) registers the KV pool once: a pull that
            register(self.pool.kv)  # lands in the blocks needs no registration of its own
        self.receiver = (
            ReceiveGroup(
                transport,
                self.pool.kv,
                config.layout,
                timeout_s=config.kv_transfer_timeout_ms / 1e3,
                on_result=self._on_result,
                on_received=on_received,
            )
            if transport is not None
            else None
        )

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, request: GenRequest) -> None:
        """Queue a request for admission. Validates it first; raises ``InvalidRequest`` (a bad or
        duplicate request) or ``Unavailable`` (the engine is unhealthy, see ``health()``). Never blocks."""
        if (why := self.health()) is not None:
            raise Unavailable(f"GEN engine unavailable: {why}")
        self._validate(request)
        with self._live_lock:
            if request.request_id in self._live:
                raise InvalidRequest(f"request id {request.request_id!r} is already live")
            self._live.add(request.request_id)
        self._inbox.put(request)
        self.wakeup.set()

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (unknown or finished ids are ignored). Never blocks."""
        self._inbox.put(request_id)
        self.wakeup.set()

    def poll(self) -> list[RequestOutput]:
        """Every output emitted since the last poll (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._outputs.get_nowait())
            except queue.Empty:
                return out

    async def serve(self) -> None:
        """Run the receive group on the current event loop until ``close()``."""
        if self.receiver is not None:
            await self.receiver.run()

    async def start(self, task_group: object) -> None:
        """Start the receive group in ``task_group`` (an anyio TaskGroup) and wait until it runs."""
        if self.receiver is not None:
            await task_group.start(self.receiver.run)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why not (its receive group or decode loop died)."""
        if self._unhealthy is not None:
            return self._unhealthy
        if self.receiver is not None and self.receiver.failure is not None:
            return f"receive group stopped: {self.receiver.failure}"
        return None

    def mark_unhealthy(self, reason: str) -> None:
        """Record why the engine can no longer serve (the first reason wins); any thread."""
        if self._unhealthy is None:
            self._unhealthy = reason

    @property
    def live_requests(self) -> int:
        with self._live_lock:
            return len(self._live)

    # -- execution thread ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    def step(self) -> StepReport:
        t0 = self._clock()
        c0 = time.thread_time()
        if self._quarantine:
            self._release_quarantine()
        self._drain_inbox()
        self._drain_completions()
        if (why := self.health()) is not None:
            self._fail_live(why)
            t1 = self._clock()
            return StepReport(0, 0, {r: 0 for r in DeferReason}, t1 - t0, 0.0, 0.0, 0.0)
        if t0 >= self._next_hold:
            self._send_holds(t0)
        self._fill_slots()
        sched, blocked = self._admit(len(self._receiving) + len(self._ready))
        t1 = self._clock()
        stalled = max(0.0, (t1 - t0) - (time.thread_time() - c0))
        batch_size = len(self._running)
        if batch_size:
            self._decode()
        t2 = self._clock()
        return StepReport(batch_size, len(sched.admitted), sched.deferred, t1 - t0, blocked, stalled, t2 - t1)

    def _admit(self, holding: int) -> tuple[ScheduleResult, float]:
        """Schedule (``holding``: requests with KV blocks that are not decoding) and start the
        admitted requests' receives; returns the schedule and the time this thread was blocked."""
        if self.config.mode is Mode.INLINE:  # the original path: a receive takes a decode slot
            sched = self.scheduler.schedule(active=holding + len(self._running), limit=self.config.max_num_seqs)
        else:
            sched = self.scheduler.schedule(active=holding, limit=self.config.prefetch_seqs)
        blocked = 0.0
        for admission in sched.admitted:
            blocked += self._start_receive(admission)
        self._fill_slots()  # IDEAL admissions are ready at once
        return sched, blocked

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                self._abort(item)
            else:
                self._enqueue(item)

    def _enqueue(self, item: GenRequest) -> None:
        layout = self.layout
        prompt_blocks = layout.blocks_for(item.prompt_len)
        self.scheduler.add(Sequence(
            request=item,
            arrival=self._clock(),
            num_blocks=layout.blocks_for(item.prompt_len + item.max_tokens),
            num_prompt_blocks=prompt_blocks,
            cost=layout.wire_bytes(prompt_blocks, item.kv_slice or self.config.kv_slice),
            tokens=[item.first_token],
        ))

    def _tell_ctx(self, seq: Sequence) -> None:
        """The CTX may free its copy of ``seq``'s KV now (best effort, on the event loop)."""
        if self.receiver is not None:
            seen: set[str] = set()
            for src in seq.request.sources():
                if src.peer not in seen:
                    seen.add(src.peer)
                    self.receiver.release_soon(src.peer, seq.request_id, src.kv_handle)

    def _drain_completions(self) -> None:
        while True:
            try:
                result = self._completions.get_nowait()
            except queue.Empty:
                return
            seq = self._receiving.pop(result.request_id, None)
            if seq is None:  # cannot happen: one result per job, one job per receiving request
                log.error("result_for_unknown_request", request_id=result.request_id)
                continue
            self._observe(result)
            quarantine = result.landing if result.landing is not None and result.landing.busy else None
            if seq.abort_failure is not None:
                self._end(seq, RequestState.FAILED, *seq.abort_failure, quarantine=quarantine)
            elif seq.abort_requested:
                self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, "aborted", quarantine=quarantine)
            elif result.ok:
                log.debug("receive_done", request_id=seq.request_id, bytes=result.bytes_moved,
                          ms=round(result.elapsed_s * 1e3, 3))
                self._run(seq)
            else:
                state = RequestState.ABORTED if result.failure is FailureReason.ABORTED else RequestState.FAILED
                self._end(seq, state, result.failure, result.message, quarantine=quarantine)

    def _observe(self, result: ReceiveResult) -> None:
        if result.ok:
            self._receive_seconds.observe(result.elapsed_s)
            self._receive_bytes.observe(float(result.bytes_moved))

    def _start_receive(self, admission: Admission) -> float:
        """Start one admitted request's receive; returns the time this thread spent blocked."""
        seq = admission.seq
        mode = self.config.mode
        assert seq.block_ids is not None
        if mode is Mode.IDEAL:
            if seq.request.local_kv is not None:
                slice_ = shift_heads(seq.request.kv_slice or self.config.kv_slice, -self.config.kv_head_offset)
                scatter(self.pool.kv, seq.block_ids[: seq.num_prompt_blocks], seq.request.local_kv, slice_)
            self._run(seq)
            return 0.0
        assert self.receiver is not None
        kv_slice = seq.request.kv_slice or self.config.kv_slice
        prompt_ids = seq.block_ids[: seq.num_prompt_blocks]
        self._receiving[seq.request_id] = seq
        sources = seq.request.sources()
        try:
            parts = self._plan_parts(seq, kv_slice, sources)
        except ValueError as exc:  # no source holds some of this rank's heads: the receive fails now
            if admission.grant is not None:
                admission.grant.release()
            self._on_result(ReceiveResult(seq.request_id, None, 0, 0.0, FailureReason.PROTOCOL_ERROR, str(exc)))
            return 0.0
        if self._pull_releases:  # a source none of this request's heads come from frees its copy now
            used = {p.peer for p in parts}
            for src in sources:
                if src.peer not in used:
                    self.receiver.release_soon(src.peer, seq.request_id, src.kv_handle)
        first = parts[0]
        job = ReceiveJob(seq.request_id, first.peer, prompt_ids, first.chunks, admission.grant, handle=first.handle,
                         head_offset=self.config.kv_head_offset, release=self._pull_releases,
                         parts=parts if len(parts) > 1 or first.peer_head_start else (),
                         parts_at_once=seq.cost <= self.budget.capacity)  # staging of all parts fits at once
        if mode is Mode.ORCHESTRATED:
            self.receiver.submit(job)
            return 0.0
        # INLINE: the original path, on this thread, kept as the benchmark's baseline.
        t0 = self._clock()
        grant = None
        staging = None
        try:
            grant = self.budget.acquire_blocking(seq.cost, self.config.inline_reserve_timeout_s)
        except WouldBlock:
            # Slow fallback: a dedicated, unpooled buffer, allocated and touched on this thread.
            # (one chunk per source; with several sources, each part's buffer is made as it starts)
            self._inline_fallbacks += 1
            parts = tuple(dataclasses.replace(p, chunks=(_covering(p.chunks),)) for p in parts)
            if len(parts) == 1:
                staging = torch.zeros(
                    self.layout.wire_shape(seq.num_prompt_blocks, parts[0].chunks[0]), dtype=self.layout.dtype,
                    device=self.pool.kv.device,
                )
        for part in parts:
            self.receiver.connect_blocking(part.peer, self.config.kv_transfer_timeout_ms / 1e3)
        self.receiver.submit(dataclasses.replace(job, grant=grant, staging=staging, chunks=parts[0].chunks,
                                                 parts=parts if job.parts else ()))
        return self._clock() - t0

    def _plan_parts(self, seq: Sequence, kv_slice: KVSlice, sources: tuple[KVSource, ...]) -> tuple[ReceivePart, ...]:
        """This rank's heads of ``seq``, each from a source that holds it, in budget-sized chunks."""
        parts = []
        for src, h0, h1 in plan_sources(sources, kv_slice.head_start, kv_slice.head_end):
            piece = KVSlice(kv_slice.layer_start, kv_slice.layer_end, h0, h1)
            chunks = plan_chunks(self.layout, seq.num_prompt_blocks, piece, self.budget.capacity)
            parts.append(ReceivePart(src.peer, src.kv_handle, chunks, src.head_start))
        return tuple(parts)

    def _decode(self) -> None:
        seqs = list(self._running.values())
        batch = DecodeBatch(
            request_ids=[s.request_id for s in seqs],
            tokens=torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.int64),
            positions=torch.tensor([s.position for s in seqs], dtype=torch.int64),
            block_tables=[s.block_ids for s in seqs],  # type: ignore[misc]
            kv=self.pool.kv,
        )
        new = self._step_fn(batch)
        new_tokens = new.tolist() if isinstance(new, torch.Tensor) else list(new)
        if len(new_tokens) != len(seqs):
            raise RuntimeError(f"step function returned {len(new_tokens)} tokens for a batch of {len(seqs)}")
        for seq, token in zip(seqs, new_tokens):
            seq.tokens.append(int(token))
            if self._done(seq):
                self._end(seq, RequestState.FINISHED, None, "", new_tokens=(int(token),))
            else:
                self._emit(RequestOutput(seq.request_id, (int(token),), RequestState.RUNNING))

    def _done(self, seq: Sequence) -> bool:
        eos = seq.request.eos_token
        return len(seq.tokens) >= seq.request.max_tokens or (eos is not None and seq.tokens[-1] == eos)

    def _run(self, seq: Sequence) -> None:
        """The request's KV is here: it waits (READY) for a decode slot."""
        self._receiving.pop(seq.request_id, None)
        if self._done(seq):  # max_tokens == 1: the CTX token was the whole answer
            self._end(seq, RequestState.FINISHED, None, "")
            return
        seq.state = RequestState.READY
        self._ready[seq.request_id] = seq

    def _fill_slots(self) -> None:
        while self._ready and len(self._running) < self.config.max_num_seqs:
            seq = self._ready.pop(next(iter(self._ready)))
            seq.state = RequestState.RUNNING
            self._running[seq.request_id] = seq

    def _abort(self, request_id: str) -> None:
        seq = self.scheduler.remove(request_id)
        if seq is not None:
            self._tell_ctx(seq)  # the CTX may free its copy now
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, "aborted while waiting")
            return
        seq = self._receiving.get(request_id)
        if seq is not None:  # blocks are freed when the receive task reports it has stopped
            seq.abort_requested = True
            assert self.receiver is not None
            self.receiver.cancel(request_id)
            return
        seq = self._ready.pop(request_id, None) or self._running.pop(request_id, None)
        if seq is not None:
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, f"aborted while {seq.state.value}")

    def _end(
        self,
        seq: Sequence,
        state: RequestState,
        failure: FailureReason | None,
        message: str,
        new_tokens: tuple[int, ...] = (),
        *,
        quarantine: object | None = None,
    ) -> None:
        self._running.pop(seq.request_id, None)
        self._ready.pop(seq.request_id, None)
        self._receiving.pop(seq.request_id, None)
        if seq.block_ids is not None:
            if quarantine is not None:  # a late receive may still land in them: not reusable yet
                self._quarantine.append((quarantine, seq.block_ids))
                self._quarantined_blocks += int(seq.block_ids.numel())
            else:
                self.pool.free(seq.block_ids)
            seq.block_ids = None
        seq.state = state
        if state is RequestState.FINISHED:
            self._finished += 1
        elif state is RequestState.ABORTED:
            self._aborted += 1
        else:
            assert failure is not None
            self._failed[failure] += 1
            # the receive task logged the one warning event (request id, peer, reason, bytes moved)
            log.debug("request_failed", request_id=seq.request_id, peer=seq.request.peer, reason=failure.value)
        with self._live_lock:
            self._live.discard(seq.request_id)
        self._emit(RequestOutput(seq.request_id, new_tokens, state, failure, message))

    def _release_quarantine(self) -> None:
        kept = []
        for landing, block_ids in self._quarantine:
            if landing.busy:  # type: ignore[attr-defined]
                kept.append((landing, block_ids))
            else:
                self._quarantined_blocks -= int(block_ids.numel())
                self.pool.free(block_ids)
        self._quarantine = kept

    def _send_holds(self, now: float) -> None:
        """Ask each CTX to renew the leases of requests still waiting here (batched per peer)."""
        self._next_hold = now + self.config.kv_hold_interval_s
        if self.receiver is None or not self.scheduler.num_waiting:
            return
        by_peer: dict[str, list[tuple[str, str | None]]] = {}
        for seq in self.scheduler.waiting:
            seen: set[str] = set()
            for src in seq.request.sources():
                if src.peer not in seen:
                    seen.add(src.peer)
                    by_peer.setdefault(src.peer, []).append((seq.request_id, src.kv_handle))
        for peer, items in by_peer.items():
            self.receiver.hold_soon(peer, items)

    def _fail_live(self, why: str) -> None:
        """The engine cannot serve: every live request fails now (receiving ones when their receive,
        cancelled here, reports back)."""
        failure = (FailureReason.INTERNAL, f"GEN engine unavailable: {why}")
        for seq in self.scheduler.pop_all():
            self._tell_ctx(seq)
            self._end(seq, RequestState.FAILED, *failure)
        for seq in list(self._ready.values()) + list(self._running.values()):
            self._end(seq, RequestState.FAILED, *failure)
        for seq in self._receiving.values():
            if seq.abort_failure is None:
                seq.abort_requested = True
                seq.abort_failure = failure
                assert self.receiver is not None
                self.receiver.cancel(seq.request_id)

    def _emit(self, output: RequestOutput) -> None:
        if self._on_output is not None:
            self._on_output(output)
        else:
            self._outputs.put(output)

    # -- event-loop thread -----------------------------------------------------------------------
    def _on_result(self, result: ReceiveResult) -> None:
        self._completions.put(result)
        self.wakeup.set()

    # -- checks ----------------------------------------------------------------------------------
    def _validate(self, r: GenRequest) -> None:
        cfg, layout = self.config, self.layout
        try:
            check_request_id(r.request_id)
            if r.kv_handle is not None:
                check_handle(r.kv_handle)
        except InvalidRequestId as exc:
            raise InvalidRequest(str(exc)) from None
        if r.prompt_len < 1 or r.max_tokens < 1:
            raise InvalidRequest(f"{r.request_id}: prompt_len and max_tokens must be >= 1")
        if r.prompt_len + r.max_tokens > cfg.max_model_len:
            raise InvalidRequest(f"{r.request_id}: prompt_len + max_tokens exceeds max_model_len {cfg.max_model_len}")
        need = layout.blocks_for(r.prompt_len + r.max_tokens)
        if need > cfg.num_blocks:
            raise InvalidRequest(f"{r.request_id}: needs {need} KV blocks, the pool has {cfg.num_blocks}")
        kv_slice = r.kv_slice or cfg.kv_slice
        try:
            layout.check_slice(shift_heads(kv_slice, -cfg.kv_head_offset))
            plan_chunks(layout, layout.blocks_for(r.prompt_len), kv_slice, cfg.transfer_budget_bytes)
        except ValueError as exc:
            raise InvalidRequest(f"{r.request_id}: {exc}") from None
        if cfg.mode is Mode.IDEAL:
            return
        sources = r.sources()
        if not sources:
            raise InvalidRequest(f"{r.request_id}: a peer (the CTX node's address) is required")
        try:
            for src in r.kv_sources:
                if not src.peer or src.head_start < 0 or (src.head_end is not None and src.head_end <= src.head_start):
                    raise ValueError(f"bad KV source {src.peer!r} heads {src.head_start}:{src.head_end}")
                if src.kv_handle is not None:
                    check_handle(src.kv_handle)
            plan_sources(sources, kv_slice.head_start, kv_slice.head_end)  # this rank's heads are all held
        except (ValueError, InvalidRequestId) as exc:
            raise InvalidRequest(f"{r.request_id}: {exc}") from None

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            waiting=self.scheduler.num_waiting,
            receiving=len(self._receiving),
            ready=len(self._ready),
            running=len(self._running),
            finished=self._finished,
            failed=dict(self._failed),
            aborted=self._aborted,
            deferral_episodes=dict(self.scheduler.deferral_episodes),
            receives_in_flight=self.receiver.in_flight if self.receiver else 0,
            staging_bytes=self.receiver.staging_bytes if self.receiver else 0,
            peak_staging_bytes=self.receiver.peak_staging_bytes if self.receiver else 0,
            inline_fallbacks=self._inline_fallbacks,
            quarantined_blocks=self._quarantined_blocks,
            receive_seconds=self._receive_seconds.snapshot(),
            receive_bytes=self._receive_bytes.snapshot(),
            health=self.health(),
            budget=self.budget.statistics(),
            pool=self.pool.statistics(),
        )

    def rest_problems(self) -> list[str]:
        """Why the engine is not at rest (empty when it is): budget full, nothing in flight, no
        request live, every KV block free."""
        s = self.statistics()
        problems = []
        if s.budget.in_use or s.budget.holders or s.budget.waiters:
            problems.append(f"budget not full: {s.budget}")
        if s.receives_in_flight:
            problems.append(f"{s.receives_in_flight} receives in flight")
        if s.waiting or s.receiving or s.ready or s.running or self.live_requests:
            problems.append(f"requests live: {s.waiting} waiting, {s.receiving} receiving, {s.ready} ready, "
                            f"{s.running} running")
        if s.quarantined_blocks:
            problems.append(f"{s.quarantined_blocks} KV blocks quarantined (a late receive may still land)")
        if s.pool.used_blocks:
            problems.append(f"{s.pool.used_blocks} KV blocks not freed")
        if s.staging_bytes:
            problems.append(f"{s.staging_bytes} staging bytes still allocated")
        return problems

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<GenEngine {self.config.mode.value} [Requests: {s.waiting} waiting, {s.receiving} receiving, "
            f"{s.ready} ready, {s.running} running] {self.budget!r} {self.pool!r}>"
        )
