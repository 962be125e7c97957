"""Rank-consistent admission and completion for a tensor-parallel GEN group.

Every rank runs a ``TPGenEngine``: its own execution thread, event loop, receive group, budget and
KV pool holding only its KV heads (``OrchestratorConfig.kv_head_offset``). The ranks agree through
ONE small collective per step, on the execution thread, which already steps in lockstep with its
peers for the model::

    step():  prepare  (rank 0: new requests and aborts from its inbox; every rank: the outcomes of
                       its own receives since the last step, which of them can no longer write
                       into their blocks, and small notes such as KV checksums)
             exchange (StepSync: all-gather of those messages; nothing else waits for another rank,
                       and nothing waits for a receive)
             apply    (identical on every rank, in rank order, so the state stays identical)
             schedule, start receives, decode              (as GenEngine)

Per request, on every rank at the same step::

    arrival ─> WAITING ─admit (same budget, same pool, same order)─> RECEIVING
    RECEIVING ─every rank reported ok─> READY   (budget grant released, rank 0 tells the CTX to
                                                 free its copy: each rank pulled its head slice of it)
    RECEIVING ─any rank reported a failure, or an abort─> ENDING: the client hears at once; every
              rank cancels its own receive ─ every rank reported its receive over and its blocks
              quiet ─> blocks and grant released (the same step everywhere), CTX told once
    READY / RUNNING ─abort─> ended on every rank at the same step

A budget grant and a KV block are therefore released at the same step on every rank, so every
rank's scheduler sees the same inputs and admits the same requests in the same order. If the
collective fails (a rank died), the engine marks itself unhealthy and fails everything locally,
with no further collective; rank 0 reports unhealthy, the others stop.
"""

from __future__ import annotations

import dataclasses
import queue
import time
import zlib
from collections.abc import Callable, Sequence as Seq
from typing import Any, Protocol, TypeVar

import structlog

from ._engine import GenEngine, StepReport
from ._errors import InvalidRequest
from ._requests import DeferReason, FailureReason, GenRequest, RequestOutput, RequestState, Sequence

log = structlog.get_logger("orchestrator.tp")


@dataclasses.dataclass
class StepMessage:
    """What one rank contributes to a step's collective (small, picklable)."""

    arrivals: list[GenRequest] = dataclasses.field(default_factory=list)  # rank 0 only
    aborts: list[str] = dataclasses.field(default_factory=list)  # rank 0 only
    outcomes: list[tuple[str, str | None, str]] = dataclasses.field(default_factory=list)
    """(request id, failure reason value or None, message) of receives that ended on this rank."""
    quiet: list[str] = dataclasses.field(default_factory=list)
    """Requests whose receive ended here and whose blocks nothing may write any more."""
    notes: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    commands: list[Any] = dataclasses.field(default_factory=list)
    """Rank 0 only: what every rank applies at this step (``broadcast``), e.g. clearing statistics."""
    stop: bool = False
    admitted: tuple[int, int] = (0, 0)
    """(count, CRC32 chained over the ids) of everything this rank admitted so far: compared every
    step, so ranks that ever diverge are caught at once instead of decoding different batches."""


T = TypeVar("T")


def _drain(q: queue.SimpleQueue[T]) -> list[T]:
    """Everything in ``q`` now, without waiting."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


class StepSync(Protocol):
    """One collective per step: every rank's message, in rank order."""

    rank: int
    world_size: int

    def exchange(self, message: StepMessage) -> list[StepMessage]: ...


class TorchStepSync:
    """``StepSync`` over a ``torch.distributed`` group (gloo: CPU objects; on CUDA keep a gloo group
    for this and NCCL for the model)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def exchange(self, message: StepMessage) -> list[StepMessage]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, message, group=self._group)
        return out


class TPGenEngine(GenEngine):
    """A ``GenEngine`` that is one rank of a tensor-parallel group (see the module docstring).

    Only rank 0 takes ``submit``/``abort`` and emits outputs; every rank steps. ``on_note(rank,
    request_id, payload)`` (rank 0) receives what other ranks attach with ``note()``;
    ``on_command(payload)`` (every rank, on its execution thread, at the same step) what rank 0
    sends with ``broadcast()``.

    Every mode works: ``ORCHESTRATED`` as described above; ``INLINE`` (the benchmark's baseline)
    takes the budget and connects on each rank's own execution thread, so the slowest rank sets the
    group's pace through the step collective; ``IDEAL`` admits without any receive.
    """

    _pull_releases = False  # every rank pulls its slice of one copy; rank 0 tells the CTX once

    def __init__(self, *args: Any, sync: StepSync, on_note: Callable[[int, str, Any], None] | None = None,
                 on_command: Callable[[Any], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sync = sync
        self.rank = sync.rank
        self.world_size = sync.world_size
        self._on_note = on_note
        self._on_command = on_command
        self._notes: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._votes: dict[str, dict[int, tuple[str | None, str]]] = {}
        self._quiet: dict[str, set[int]] = {}
        self._ending: dict[str, Sequence] = {}  # failed or aborted while receiving: blocks not yet back
        self._grants: dict[str, Any] = {}  # budget grants the engine (not the receive task) releases
        self._unquiet: dict[str, Any] = {}  # local receives ended, landing still busy
        self._local_done: set[str] = set()  # local receive results received (of requests not yet released)
        self._stop_requested = False
        self.stopped = False
        """Rank 0 asked the group to stop (followers end their loop)."""
        self._admission_log: list[str] = []
        self._admitted = (0, 0)
        self.rank_admitted: list[tuple[int, int]] = []
        """Every rank's ``StepMessage.admitted`` at the last step (rank 0: for stats and tests)."""

    # -- any thread ------------------------------------------------------------------------------
    @property
    def leads_steps(self) -> bool:
        return self.rank == 0

    def submit(self, request: GenRequest) -> None:
        if self.rank != 0:
            raise InvalidRequest("requests enter a tensor-parallel group at rank 0")
        if request.kv_slice is not None:
            raise InvalidRequest(f"{request.request_id}: a tensor-parallel rank pulls its own heads; give no kv_slice")
        super().submit(request)

    def abort(self, request_id: str) -> None:
        if self.rank != 0:
            raise InvalidRequest("aborts enter a tensor-parallel group at rank 0")
        super().abort(request_id)

    def note(self, request_id: str, payload: Any) -> None:
        """Attach ``payload`` for rank 0 to this step's message (any thread)."""
        self._notes.put((request_id, payload))

    def broadcast(self, payload: Any) -> None:
        """Rank 0 (any thread): every rank's ``on_command(payload)`` runs at the next step."""
        if self.rank != 0:
            raise InvalidRequest("commands enter a tensor-parallel group at rank 0")
        self._commands.put(payload)
        self.wakeup.set()

    def request_stop(self) -> None:
        """Rank 0: the next step tells every rank to stop."""
        self._stop_requested = True
        self.wakeup.set()

    @property
    def live_requests(self) -> int:
        """Requests live here, counting failed ones whose blocks wait for every rank's receive to end."""
        return super().live_requests + len(self._ending)

    @property
    def admission_log(self) -> list[str]:
        """Request ids in the order this rank admitted them (identical on every rank)."""
        return self._admission_log

    # -- execution thread ------------------------------------------------------------------------
    def step(self) -> StepReport:
        t0 = self._clock()
        c0 = time.thread_time()
        if self.health() is not None:
            return self._step_unhealthy(t0)
        message = self.prepare_step()
        try:
            messages = self.sync.exchange(message)
        except Exception as exc:  # a rank died or the group broke: no further collective
            log.error("tp_exchange_failed", rank=self.rank, reason=f"{type(exc).__name__}: {exc}")
            self.mark_unhealthy(f"tensor-parallel group broken at rank {self.rank}: {type(exc).__name__}: {exc}")
            for request in message.arrivals:  # taken from the inbox for this step: they fail with the rest
                self._enqueue(request)
            return self._step_unhealthy(t0)
        return self.finish_step(messages, t0, c0)

    def _step_unhealthy(self, t0: float) -> StepReport:
        """No agreement is possible any more: end everything with local knowledge only."""
        why = self.health() or "unhealthy"
        self._drain_inbox()  # whatever arrived since the last step fails with the rest, never hangs
        for result in _drain(self._completions):
            rid = result.request_id
            landing = result.landing if result.landing is not None and result.landing.busy else None
            self._local_done.add(rid)
            seq = self._receiving.get(rid)
            if seq is not None:
                self._end(seq, RequestState.FAILED, FailureReason.INTERNAL, f"GEN engine unavailable: {why}",
                          quarantine=landing)
                self._release_grant(rid)
            elif landing is not None:
                self._unquiet[rid] = landing
        for rid, seq in list(self._ending.items()):  # already ended for the client; blocks held
            if rid in self._local_done:
                landing = self._unquiet.pop(rid, None)
                if landing is not None and landing.busy:
                    self._quarantine.append((landing, seq.block_ids))
                    self._quarantined_blocks += int(seq.block_ids.numel())
                    seq.block_ids = None
                self._release_request(seq, tell_ctx=False)
        self._fail_live(why)
        self.stopped = True
        return StepReport(0, 0, {r: 0 for r in DeferReason}, self._clock() - t0, 0.0, 0.0, 0.0)

    def prepare_step(self) -> StepMessage:
        """This rank's contribution to the step (split from ``step`` so tests can drive ranks in lockstep)."""
        msg = StepMessage(stop=self._stop_requested, admitted=self._admitted)
        if self.rank == 0:
            for item in _drain(self._inbox):
                (msg.aborts.append if isinstance(item, str) else msg.arrivals.append)(item)  # type: ignore[arg-type]
            msg.commands = _drain(self._commands)
        for result in _drain(self._completions):
            self._local_done.add(result.request_id)
            self._observe(result)
            msg.outcomes.append((result.request_id, result.failure.value if result.failure else None, result.message))
            if result.landing is not None and result.landing.busy:
                self._unquiet[result.request_id] = result.landing
            else:
                msg.quiet.append(result.request_id)
        for rid, landing in list(self._unquiet.items()):
            if not landing.busy:
                del self._unquiet[rid]
                msg.quiet.append(rid)
        msg.notes = _drain(self._notes)
        return msg

    def finish_step(self, messages: Seq[StepMessage], t0: float, c0: float) -> StepReport:
        if any(m.stop for m in messages):
            self.stopped = True
            self.mark_unhealthy("the tensor-parallel group was stopped")
            return self._step_unhealthy(t0)
        self.rank_admitted = [m.admitted for m in messages]
        if any(a != self.rank_admitted[0] for a in self.rank_admitted):
            log.error("tp_ranks_diverged", rank=self.rank, admitted=self.rank_admitted)
            self.mark_unhealthy(f"tensor-parallel ranks admitted different requests: {self.rank_admitted}")
            return self._step_unhealthy(t0)
        lead = messages[0]
        if self._on_command is not None:
            for command in lead.commands:
                self._on_command(command)
        for request in lead.arrivals:
            self._arrive(request)
        for rid in lead.aborts:
            self._abort_agreed(rid)
        for rank, m in enumerate(messages):
            for rid, failure, message in m.outcomes:
                self._votes.setdefault(rid, {})[rank] = (failure, message)
            for rid in m.quiet:
                self._quiet.setdefault(rid, set()).add(rank)
            if self.rank == 0 and self._on_note is not None:
                for rid, payload in m.notes:
                    self._on_note(rank, rid, payload)
        self._settle()
        return self._schedule_and_decode(t0, c0)

    def _arrive(self, request: GenRequest) -> None:
        if self.rank != 0:  # rank 0 checked it at submit and holds it live already
            with self._live_lock:
                self._live.add(request.request_id)
        self._enqueue(request)

    def _abort_agreed(self, rid: str) -> None:
        seq = self.scheduler.remove(rid)
        if seq is not None:
            self._tell_ctx(seq)
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, "aborted while waiting")
            return
        seq = self._receiving.get(rid)
        if seq is not None:  # every rank cancels its own receive; the request ends when they report
            seq.abort_requested = True
            assert self.receiver is not None
            self.receiver.cancel(rid)
            return
        seq = self._ready.pop(rid, None) or self._running.pop(rid, None)
        if seq is not None:
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, f"aborted while {seq.state.value}")

    def _settle(self) -> None:
        """Apply the agreed outcomes (identical on every rank)."""
        for rid in list(self._votes):
            votes = self._votes[rid]
            seq = self._receiving.get(rid)
            if seq is None:
                if rid not in self._ending:
                    self._votes.pop(rid, None)
                continue
            failed = [(FailureReason(f), msg) for f, msg in (votes[r] for r in sorted(votes)) if f is not None]
            if failed or seq.abort_requested and votes:
                reason, message = failed[0] if failed else (FailureReason.ABORTED, "aborted")
                self._fail_agreed(seq, reason, message)
            elif len(votes) == self.world_size:  # every rank holds its slice
                del self._votes[rid]
                self._quiet.pop(rid, None)
                self._local_done.discard(rid)
                self._release_grant(rid)
                self._tell_ctx(seq)
                self._run(seq)
        for rid, seq in list(self._ending.items()):
            if len(self._quiet.get(rid, ())) == self.world_size:
                self._release_request(seq)

    def _fail_agreed(self, seq: Sequence, reason: FailureReason, message: str) -> None:
        rid = seq.request_id
        self._receiving.pop(rid, None)
        if not seq.abort_requested:  # the ranks whose receive still runs cancel it now
            seq.abort_requested = True
            assert self.receiver is not None
            self.receiver.cancel(rid)
        self._ending[rid] = seq
        state = RequestState.ABORTED if reason is FailureReason.ABORTED else RequestState.FAILED
        blocks, seq.block_ids = seq.block_ids, None  # kept until every rank is quiet
        self._end(seq, state, reason, message)
        seq.block_ids = blocks

    def _release_request(self, seq: Sequence, *, tell_ctx: bool = True) -> None:
        rid = seq.request_id
        self._ending.pop(rid, None)
        self._votes.pop(rid, None)
        self._quiet.pop(rid, None)
        self._local_done.discard(rid)
        if seq.block_ids is not None:
            self.pool.free(seq.block_ids)
            seq.block_ids = None
        self._release_grant(rid)
        if tell_ctx:
            self._tell_ctx(seq)

    def _release_grant(self, rid: str) -> None:
        grant = self._grants.pop(rid, None)
        if grant is not None:
            grant.release()

    def _tell_ctx(self, seq: Sequence) -> None:
        """Rank 0 tells the CTX once that it may free its copy (every rank pulled without release)."""
        if self.rank == 0:
            super()._tell_ctx(seq)

    def _schedule_and_decode(self, t0: float, c0: float) -> StepReport:
        if t0 >= self._next_hold and self.rank == 0:
            self._send_holds(t0)
        self._fill_slots()
        # INLINE: ``blocked`` is this rank's own waits (budget, connect); its peers wait in the next collective
        sched, blocked = self._admit(len(self._receiving) + len(self._ready) + len(self._ending))
        t1 = self._clock()
        stalled = max(0.0, (t1 - t0) - (time.thread_time() - c0))
        batch_size = len(self._running)
        if batch_size:
            self._decode()
        return StepReport(batch_size, len(sched.admitted), sched.deferred, t1 - t0, blocked, stalled, self._clock() - t1)

    def _start_receive(self, admission: Any) -> float:
        """As ``GenEngine``'s orchestrated receive, but the grant stays with the engine (released at
        the agreed step, not by the receive task) and the pull leaves the CTX's copy to rank 0."""
        seq = admission.seq
        self._admission_log.append(seq.request_id)
        self._admitted = (self._admitted[0] + 1, zlib.crc32(seq.request_id.encode(), self._admitted[1]))
        if admission.grant is not None:
            self._grants[seq.request_id] = admission.grant
        return super()._start_receive(dataclasses.replace(admission, grant=None))

    def _emit(self, output: RequestOutput) -> None:
        if self.rank == 0:
            super()._emit(output)

    def _fail_live(self, why: str) -> None:
        for seq in self.scheduler.waiting:
            self._release_grant(seq.request_id)
        super()._fail_live(why)

    def rest_problems(self) -> list[str]:
        problems = super().rest_problems()
        if self._ending:
            problems.append(f"{len(self._ending)} failed requests waiting for every rank to end its receive")
        return problems


class LocalGroup:
    """N ranks in one process, stepped in lockstep by the caller (tests): ``step_all(engines)``."""

    class _Sync:
        def __init__(self, rank: int, world_size: int) -> None:
            self.rank, self.world_size = rank, world_size

        def exchange(self, message: StepMessage) -> list[StepMessage]:  # pragma: no cover - not used
            raise RuntimeError("LocalGroup ranks are stepped with step_all()")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def sync(self, rank: int) -> StepSync:
        return self._Sync(rank, self.world_size)

    @staticmethod
    def step_all(engines: Seq[TPGenEngine]) -> list[StepReport]:
        t0 = [e._clock() for e in engines]
        c0 = [time.thread_time()] * len(engines)
        healthy = [e.health() is None for e in engines]
        if not all(healthy):
            return [e.step() if not h else e._step_unhealthy(t) for e, h, t in zip(engines, healthy, t0)]
        messages = [e.prepare_step() for e in engines]
        return [e.finish_step(messages, t, c) for e, t, c in zip(engines, t0, c0)]
