"""The GEN engine: the execution thread's side of the orchestrator, one engine for every TP size.

One ``step()`` per decode iteration, on the execution thread, as prepare -> agree -> apply::

    prepare   this rank's local events, in the order they happened (``_step.StepMessage``):
              rank 0: submissions and aborts from its inbox, commands; every rank: the outcomes of
              its own receives, blocks that went quiet, and the tokens its last decode sampled
    agree     ``self.agreement``: identity for one rank; one collective for a tensor-parallel
              group (``TorchStepSync``, ``LocalGroup``). A group that cannot agree is broken
    apply     the one path, identical on every rank:
              0. checks: every rank admitted the same requests and decoded the same batch
                 (digests), nobody stopped or broke; else the group breaks (below)
              1. rank 0's tokens and finish decisions for the last batch: emitted, requests end
              2. submissions and aborts, in arrival order
              3. receive outcomes (only the requests they touch): a request is READY when every
                 rank holds its slice; any failure or an abort ends it for the client at once,
                 its blocks and budget come back when every rank's blocks are quiet
              4. schedule: decode keeps its batch; READY fill free slots; admit WAITING in FCFS,
                 budget before KV; ORCHESTRATED: non-blocking submit to the receive group;
                 INLINE: blocking reserve and handshake here (the baseline); IDEAL: no receive
              5. one decode step (step_fn) for every RUNNING request; its tokens are the next
                 step's events

Per request, on every rank at the same step::

    arrival ─> WAITING ─admit (budget, then KV)─> RECEIVING ─every rank ok─> READY ─slot─> RUNNING ─> FINISHED
                 │ abort                             │ a failure / abort       abort │ abort  │
                 ▼                                   ▼                               ▼        ▼
              ABORTED                    FAILED/ABORTED for the client at once:  ended, blocks freed
                                         blocks + budget held until every rank's
                                         blocks are quiet (a late landing ended)

Rank 0 (the only rank of a group of one) takes ``submit``/``abort``, talks to the CTX (releases,
lease holds) and emits outputs. Budget grants are the engine's: released at the agreed step, so
every rank's scheduler sees the same inputs. ``step()`` never awaits; in ORCHESTRATED mode nothing
in it waits on I/O, a peer or a reservation.

Health and breaking: when the receive group dies, a decode step raises, the group's exchange fails
or the ranks disagree, the engine breaks: ``health()`` says why, ``submit`` raises ``Unavailable``,
rank 0 tells every CTX to free every request it holds and every live request fails with that
cause; ``stopped`` is then True and later steps only bring this rank's blocks and budget back
(a tensor-parallel node then forms a new group; see examples/two_node/gen_tp.py).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence as Seq
from typing import Any

import numpy as np
import structlog
import torch

from transports import KVSlice, Transport, scatter

from ._batch import RunningBatch
from ._budget import TransferBudget
from ._clock import Clock, as_clock
from ._config import Mode, OrchestratorConfig
from ._errors import InvalidRequest, Unavailable, WouldBlock
from ._kvpool import KVBlockPool
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
    kv_blocks_needed,
    plan_sources,
)
from ._scheduler import Scheduler, ScheduleResult
from ._stats import (
    RECEIVE_BYTES_BUCKETS,
    RECEIVE_SECONDS_BUCKETS,
    EngineStatistics,
    Histogram,
    StepReport,
)
from ._step import (CONFIG_FIELDS, FINISH, Abort, Agreement, GroupBroken, Outcome, SoloAgreement, StepMessage, Submit,
                    chain_crc, config_digest, rows_crc)
from ._validate import validate_request

_TOKEN = ~FINISH  # a step word's token bits

log = structlog.get_logger("orchestrator.engine")

__all__ = ["DecodeBatch", "EngineStatistics", "GenEngine", "Histogram", "PreparedStep", "StepReport"]


_GROUP_STOPPED = "the tensor-parallel group was stopped"  # rank 0 asked (request_stop): the node stops


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """Input of one decode step: the RUNNING requests, in a stable order."""

    request_ids: list[str]
    tokens: torch.Tensor  # int64 [B]: each request's newest token
    positions: torch.Tensor  # int64 [B]: its position (where this step writes its KV)
    block_tables: list[torch.Tensor]  # each request's KV blocks, in order
    kv: torch.Tensor  # the pool
    requests: list[GenRequest] = dataclasses.field(default_factory=list)
    """The requests themselves, in batch order (their sampling parameters, prompt lengths)."""

    def __len__(self) -> int:
        return len(self.request_ids)


StepFn = Callable[[DecodeBatch], "Seq[int] | torch.Tensor"]


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A rank's prepared step: its message and when the step began."""

    message: StepMessage
    t0: float
    c0: float


def _covering(chunks: Seq[KVSlice]) -> KVSlice:
    """The one slice that covers ``chunks`` (the pieces ``plan_chunks`` cut from it)."""
    return KVSlice(min(c.layer_start for c in chunks), max(c.layer_end for c in chunks),
                   min(c.head_start for c in chunks), max(c.head_end for c in chunks))


def _drain(q: queue.SimpleQueue[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


ADMISSION_WINDOW = 1024
"""Admissions kept by id for diagnostics (``admission_log``); the digest covers all of them."""


class GenEngine:
    def __init__(
        self,
        config: OrchestratorConfig,
        transport: Transport | None,
        step_fn: StepFn,
        *,
        agreement: Agreement | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_received: Callable[[str, torch.Tensor], None] | None = None,
        on_command: Callable[[Any], None] | None = None,
        clock: Clock | Callable[[], float] = time.perf_counter,
    ) -> None:
        clock = as_clock(clock)  # deadlines, step timings and the inline path's blocking waits
        if transport is None and config.mode is not Mode.IDEAL:
            raise ValueError(f"mode {config.mode.value} needs a transport")
        self.config = config
        self.layout = config.layout
        self.agreement: Agreement = agreement or SoloAgreement()
        self.rank = self.agreement.rank
        self.world_size = self.agreement.world_size
        self._everyone = (1 << self.world_size) - 1
        self._config_digest = config_digest(config)
        self._pull_releases = self.world_size == 1
        """A lone rank's last pull lets the CTX free its copy; a group's rank 0 tells the CTX once
        every rank has its slice."""
        self.budget = TransferBudget(config.transfer_budget_bytes, clock=clock)
        self.pool = KVBlockPool(config.layout, config.num_blocks, config.device, poison_freed=config.debug_poison_freed_blocks)
        self.scheduler = Scheduler(config, self.budget, self.pool)
        self._step_fn = step_fn
        self._clock = clock
        self._on_output = on_output
        self._on_command = on_command
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[GenRequest | str] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._completions: queue.SimpleQueue[ReceiveResult] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        """Set whenever there is new work for the execution thread (submit, abort, completion)."""
        self._live_lock = threading.Lock()
        self._live: set[str] = set()  # ids that may not be submitted again yet
        self._by_id: dict[str, Sequence] = {}  # every request this engine holds anything of
        self._by_seq: dict[int, Sequence] = {}
        self._next_seq = 0
        self._receiving: dict[str, Sequence] = {}
        self._ready: dict[str, Sequence] = {}  # KV received, waiting for a decode slot (FIFO)
        self._running: dict[str, Sequence] = {}
        self._ending: dict[int, Sequence] = {}  # ended for the client; blocks held until quiet everywhere
        self._unquiet: dict[int, Any] = {}  # this rank's reported receives whose landing is still busy
        self._quarantined_blocks = 0
        self._batch = RunningBatch()
        """The RUNNING requests' columns (``_running``, for a decode step)."""
        self._last: RunningBatch | None = None
        """The batch the last decode stepped, and the tokens it sampled: the next step's digest,
        finish decisions and agreed tokens are about it."""
        self._sampled = np.zeros(0, dtype=np.int64)
        self._finished = 0
        self._aborted = 0
        self._failed = {r: 0 for r in FailureReason}
        self._inline_fallbacks = 0
        self._unhealthy: str | None = None
        self._stop_requested = False
        self._graceful = False
        self.stopped = False
        """The engine broke (or the group was stopped): it steps only to bring its blocks back."""
        self._admitted = (0, 0)
        self._admission_window: collections.deque[str] = collections.deque(maxlen=ADMISSION_WINDOW)
        self.rank_admitted: list[tuple[int, int]] = [(0, 0)] * self.world_size
        """Every rank's (admissions, digest) at the last step."""
        self._steps = 0
        self.agreed_steps = 0  # steps every rank agreed on (a group's first: every rank steps)
        self._receive_seconds = Histogram(RECEIVE_SECONDS_BUCKETS)
        self._receive_bytes = Histogram(RECEIVE_BYTES_BUCKETS)
        self._next_hold = clock() + config.kv_hold_interval_s
        self._requires_handle = bool(getattr(transport, "requires_handle", False))
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
    @property
    def leads_steps(self) -> bool:
        """Rank 0: takes requests, talks to the CTX, emits outputs, paces the group's steps."""
        return self.rank == 0

    def submit(self, request: GenRequest) -> None:
        """Queue a request for admission. Validates it first; raises ``InvalidRequest`` (a bad or
        duplicate request) or ``Unavailable`` (the engine is unhealthy, see ``health()``). Never blocks."""
        if not self.leads_steps:
            raise InvalidRequest("requests enter a tensor-parallel group at rank 0")
        if not isinstance(request, GenRequest):  # checked here: the step drops anything else, which then
            # stayed live with no output (a look-alike passed validation)
            raise TypeError(f"submit takes a GenRequest, not {type(request).__name__}")
        if (why := self.health()) is not None:
            raise Unavailable(f"GEN engine unavailable: {why}")
        validate_request(self.config, request, self.world_size, requires_handle=self._requires_handle)
        with self._live_lock:
            if (why := self.health()) is not None:  # again, under the lock: a node stopping while this
                # request was validated may have stepped to rest already (EngineThreads' exit) and
                # would never step it; one that stops later sees it live and steps it to an end
                raise Unavailable(f"GEN engine unavailable: {why}")
            if request.request_id in self._live:
                held = self._by_id.get(request.request_id)  # (a read of the execution thread's dict: atomic)
                if held is not None and held.state.terminal:  # ended for its client, blocks quarantined
                    raise InvalidRequest(
                        f"request id {request.request_id!r} still has a receive ending (it ended, but its KV "
                        "blocks are quarantined until that receive's landing stops): retry later")
                raise InvalidRequest(f"request id {request.request_id!r} is already live")
            self._live.add(request.request_id)
            self._inbox.put(request)
        self.wakeup.set()

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (unknown or finished ids are ignored). Never blocks."""
        if not self.leads_steps:
            raise InvalidRequest("aborts enter a tensor-parallel group at rank 0")
        if not isinstance(request_id, str):  # checked here: the step reads anything else as a submission
            raise TypeError(f"abort takes a request id (str), not {type(request_id).__name__}")
        self._inbox.put(request_id)
        self.wakeup.set()

    def broadcast(self, payload: Any) -> None:
        """Rank 0 (any thread): every rank's ``on_command(payload)`` runs at the next step.
        ``payload`` must be JSON-able (it crosses the step exchange)."""
        if not self.leads_steps:
            raise InvalidRequest("commands enter a tensor-parallel group at rank 0")
        self._commands.put(payload)
        self.wakeup.set()

    def request_stop(self) -> None:
        """Rank 0: the next step stops every rank of the group."""
        self._stop_requested = True
        self.wakeup.set()

    def stop(self, reason: str = "the GEN node is stopping") -> None:
        """Any thread: the engine stops serving, as its node is shutting down (not a failure).
        ``submit`` refuses from now on; the next step ends every live request ABORTED with
        ``reason`` and logs ``engine_stopped``. An engine already broken keeps its cause."""
        if self.health() is None:
            self._stop_requested = True
            self.mark_unhealthy(reason)
        self.wakeup.set()

    @property
    def stopped_gracefully(self) -> bool:
        """The engine stopped because it was asked to (``stop``, ``request_stop``), not broken."""
        return self._graceful

    def poll(self) -> list[RequestOutput]:
        """Every output emitted since the last poll (non-blocking)."""
        return _drain(self._outputs)

    async def serve(self) -> None:
        """Run the receive group on the current event loop until ``close()``."""
        if self.receiver is not None:
            await self.receiver.run()

    async def start(self, task_group: object) -> None:
        """Start the receive group in ``task_group`` (an anyio TaskGroup) and wait until it runs."""
        if self.receiver is not None:
            await task_group.start(self.receiver.run)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close the receive group (any receive still running is cancelled). To shut down without
        leaving each CTX holding KV until its lease ends, ``stop()`` and step until no receive is in
        flight first, as ``EngineThreads`` does on exit: the aborts then reach the CTXs."""
        if self.receiver is not None:
            self.receiver.close()

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why not (its receive group or decode loop
        died, or its tensor-parallel group broke)."""
        if self._unhealthy is not None:
            return self._unhealthy
        if self.receiver is not None and self.receiver.failure is not None:
            return f"receive group stopped: {self.receiver.failure}"
        return None

    def mark_unhealthy(self, reason: str) -> None:
        """Record why the engine can no longer serve (the first reason wins); any thread. The next
        step breaks the engine (and its group) with this cause."""
        if self._unhealthy is None:
            self._unhealthy = reason
        self.wakeup.set()

    @property
    def live_requests(self) -> int:
        with self._live_lock:
            return len(self._live)

    @property
    def admission_log(self) -> list[str]:
        """The newest admissions by id, in order (identical on every rank; bounded)."""
        return list(self._admission_window)

    # -- execution thread: the step ---------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_ready(self) -> int:
        """Requests whose KV is here, waiting for a decode slot (the next step starts them if one is free)."""
        return len(self._ready)

    def step(self) -> StepReport:
        prepared = self.prepare_step()
        if self.stopped:
            return self._apply_alone(prepared)
        try:
            messages = self.agreement.agree(prepared.message)
        except GroupBroken as exc:
            self._break(exc.cause)
            return self._apply_alone(prepared)
        except Exception as exc:  # e.g. a message that cannot be encoded: what this step drained is not lost
            log.exception("step_agreement_failed", rank=self.rank)
            self._break(f"the step could not be agreed: {type(exc).__name__}: {exc}")
            return self._apply_alone(prepared)
        return self.apply_step(prepared, messages)

    def prepare_step(self) -> PreparedStep:
        """This rank's local events since its last step (see the module docstring)."""
        t0 = self._clock()
        c0 = time.thread_time()
        why = self.health()  # before the stop flag: stop() sets the flag, then the reason, so a reason
        msg = StepMessage(admitted=self._admitted, stop=self._stop_requested)  # read here comes with its flag
        msg.config = self._config_digest
        if why is not None and not self.stopped:
            msg.broken = why
        if self.leads_steps:
            arriving: dict[str, int] = {}
            for item in _drain(self._inbox):
                if isinstance(item, str):
                    known = self._by_id.get(item)
                    seq_no = known.seq_no if known is not None else arriving.get(item)
                    if seq_no is not None:  # an abort of nothing known is stale: dropped, as at any size
                        msg.events.append(Abort(seq_no))
                elif isinstance(item, GenRequest):
                    seq_no = self._next_seq
                    self._next_seq += 1
                    arriving[item.request_id] = seq_no
                    msg.events.append(Submit(seq_no, item))
                else:  # cannot come from submit/abort (they check): dropped alone, never the batch
                    log.error("inbox_item_dropped", item_type=type(item).__name__)
            msg.commands = _drain(self._commands)
        for result in _drain(self._completions):
            seq = self._by_id.get(result.request_id)
            if seq is None:  # cannot happen: one result per job, one job per receiving request
                log.error("result_for_unknown_request", request_id=result.request_id)
                continue
            self._observe(result)
            busy = result.landing is not None and result.landing.busy
            if busy:
                self._unquiet[seq.seq_no] = result.landing
                if result.failure is None:  # a transport bug: its blocks are held until it ends (_end)
                    log.error("receive_ok_while_landing_busy", request_id=result.request_id, rank=self.rank)
            msg.outcomes.append(Outcome(seq.seq_no, result.failure, result.message, quiet=not busy))
        if self._unquiet:
            for seq_no, landing in list(self._unquiet.items()):
                if not landing.busy:
                    del self._unquiet[seq_no]
                    msg.quiet.append(seq_no)
        if (last := self._last) is not None:
            sampled = self._sampled
            msg.batch_digest = rows_crc(last.seq_nos, last.inputs, sampled)
            if self.leads_steps:  # does each request end with its new token?
                msg.tokens = (sampled | np.where(last.ends(sampled), FINISH, 0)).tolist()
        return PreparedStep(msg, t0, c0)

    def apply_step(self, prepared: PreparedStep, messages: Seq[StepMessage]) -> StepReport:
        """Apply the agreed ``messages`` (every rank's, in rank order): the one path."""
        self._steps += 1
        self.rank_admitted = [m.admitted for m in messages]
        cause = self._disagreement(messages)
        if cause is not None:
            self._break(cause)
            return self._apply_alone(prepared)
        self.agreed_steps += 1
        lead = messages[0]
        if self._on_command is not None:
            for command in lead.commands:
                self._on_command(command)
        self._apply_tokens(lead.tokens)
        for event in lead.events:
            if isinstance(event, Submit):
                self._arrive(event)
            else:
                self._abort(event.seq)
        for seq in self._apply_outcomes(messages):
            self._settle(seq, self._everyone)
        if self.leads_steps and prepared.t0 >= self._next_hold:
            self._send_holds(prepared.t0)
        self._fill_slots()
        sched, blocked = self._admit()
        return self._decode_step(prepared, sched, blocked)

    def _apply_alone(self, prepared: PreparedStep) -> StepReport:
        """A broken engine's step: no agreement any more. This rank's own outcomes bring its
        blocks and budget back; everything live fails."""
        msg = prepared.message
        for event in msg.events:  # taken from the inbox: they fail with the rest
            if isinstance(event, Submit):
                self._arrive(event)
        mine = 1 << self.rank
        # every live request fails first: one this rank's outcome says received while its landing
        # is still busy is then ended as receiving (its blocks held until that landing ends), not
        # run and freed at once
        self._fail_live(self.health() or "the engine stopped")
        for seq in self._apply_outcomes([msg] if self.rank == 0 else [StepMessage()] * self.rank + [msg]):
            self._settle(seq, mine)
        for seq in list(self._ending.values()):
            self._settle(seq, mine)
        self._apply_tokens([])
        t1 = self._clock()
        return StepReport(0, 0, {r: 0 for r in DeferReason}, t1 - prepared.t0, 0.0, 0.0, 0.0)

    def _disagreement(self, messages: Seq[StepMessage]) -> str | None:
        """Why the group cannot apply this step (None: it can)."""
        if any(m.stop for m in messages):
            return _GROUP_STOPPED
        for rank, m in enumerate(messages):
            if m.broken:
                return m.broken if self.world_size == 1 else f"GEN rank {rank}: {m.broken}"
        lead = messages[0]
        for rank, m in enumerate(messages):
            if m.config != lead.config:  # at the first step, not at the first request where it shows
                return (f"tensor-parallel rank {rank} runs other settings than rank 0: every rank must share "
                        f"{', '.join(CONFIG_FIELDS)} and the KV layout (but for its head offset)")
            if m.admitted != lead.admitted:
                return (f"tensor-parallel ranks admitted different requests: rank {rank} {m.admitted[0]} "
                        f"admissions, rank 0 {lead.admitted[0]} (digests {m.admitted[1]:08x} / {lead.admitted[1]:08x})")
            if m.batch_digest != lead.batch_digest:
                return (f"tensor-parallel ranks decoded different batches at step {self._steps - 1}: rank {rank}'s "
                        f"requests or tokens differ from rank 0's ({len(self._last or ())} requests)")
        return None

    def _break(self, cause: str) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.mark_unhealthy(cause)
        self._graceful = cause == _GROUP_STOPPED  # live requests end ABORTED: the node is shutting down
        if cause == _GROUP_STOPPED or (self.receiver is not None and self.receiver.cancelled):  # a stop: no failure
            log.info("engine_stopped", rank=self.rank, world_size=self.world_size, cause=self._unhealthy or cause)
        else:
            log.error("engine_broken", rank=self.rank, world_size=self.world_size, cause=cause)

    def _apply_tokens(self, tokens: Seq[int]) -> None:
        """Rank 0's tokens (and finish decisions) for the batch this rank decoded last step."""
        batch, self._last = self._last, None
        if batch is None or not tokens:
            return
        if len(tokens) != len(batch):  # the digests agreed on this batch: cannot happen
            raise RuntimeError(f"{len(tokens)} agreed tokens for a decoded batch of {len(batch)}")
        words = np.asarray(tokens, dtype=np.int64)
        batch.advance(words & _TOKEN)
        running = RequestState.RUNNING
        emit = self._emitter()  # only rank 0 emits: other ranks build no output per token
        if emit is None:
            for i in np.flatnonzero(words & FINISH).tolist():
                seq = batch.seqs[i]
                if seq.state is running:
                    self._end(seq, RequestState.FINISHED, None, "", new_tokens=(tokens[i] & _TOKEN,))
            return
        for seq, word in zip(batch.seqs, tokens):  # in batch order, as the tokens came
            if seq.state is not running:
                continue
            if word & FINISH:
                self._end(seq, RequestState.FINISHED, None, "", new_tokens=(word & _TOKEN,))
            else:
                emit(RequestOutput(seq.request.request_id, (word,), running))

    def _arrive(self, event: Submit) -> None:
        request = event.request
        layout = self.layout
        prompt_blocks = layout.blocks_for(request.prompt_len)
        seq = Sequence(
            request=request,
            arrival=self._clock(),
            num_blocks=kv_blocks_needed(layout, request.prompt_len, request.max_tokens),
            num_prompt_blocks=prompt_blocks,
            cost=layout.wire_bytes(prompt_blocks, request.kv_slice or self.config.kv_slice),
            seq_no=event.seq,
            last_token=request.first_token,
        )
        self._next_seq = max(self._next_seq, event.seq + 1)
        if not self.leads_steps:  # rank 0 checked it at submit and holds it live already
            with self._live_lock:
                self._live.add(request.request_id)
        self._by_id[request.request_id] = seq
        self._by_seq[seq.seq_no] = seq
        self.scheduler.add(seq)

    def _abort(self, seq_no: int) -> None:
        seq = self._by_seq.get(seq_no)
        if seq is None or seq.state.terminal:
            return
        if seq.state is RequestState.WAITING:
            self.scheduler.remove(seq.request_id)
            self._tell_ctx(seq)  # the CTX may free its copy now
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, "aborted while waiting")
        elif seq.state is RequestState.RECEIVING:  # every rank stops its receive; it ends when one reports
            seq.abort_requested = True
            self._cancel_local(seq)
            self._settle(seq, self._everyone)
        else:
            self._end(seq, RequestState.ABORTED, FailureReason.ABORTED, f"aborted while {seq.state.value}")

    def _apply_outcomes(self, messages: Seq[StepMessage]) -> list[Sequence]:
        """Record every rank's outcomes; returns the requests they touched (in first-touch order)."""
        touched: dict[int, Sequence] = {}
        for rank, m in enumerate(messages):
            bit = 1 << rank
            for o in m.outcomes:
                seq = self._by_seq.get(o.seq)
                if seq is None:
                    continue
                seq.reported |= bit
                if o.quiet:
                    seq.quiet |= bit
                if o.failure is not None and seq.failure is None:
                    seq.failure = (o.failure, o.message if rank == 0 or self.world_size == 1
                                   else f"GEN rank {rank}: {o.message}")
                touched[o.seq] = seq
            for seq_no in m.quiet:
                seq = self._by_seq.get(seq_no)
                if seq is not None:
                    seq.quiet |= bit
                    touched[seq_no] = seq
        return list(touched.values())

    def _settle(self, seq: Sequence, everyone: int) -> None:
        """Decide what the agreed outcomes so far mean for ``seq`` (only requests touched this step)."""
        if seq.state is RequestState.RECEIVING:
            if seq.abort_requested and (seq.reported or seq.failure):
                self._end_receiving(seq, RequestState.ABORTED, FailureReason.ABORTED, "aborted")
            elif seq.failure is not None:
                reason, message = seq.failure
                state = RequestState.ABORTED if reason is FailureReason.ABORTED else RequestState.FAILED
                self._end_receiving(seq, state, reason, message)
            elif seq.reported & everyone == everyone:  # every rank holds its slice
                if seq.quiet & everyone == everyone:  # else its bytes may still move: budget kept, CTX not told
                    self._release_grant(seq)
                    if not self._pull_releases:
                        self._tell_ctx(seq)
                self._run(seq)
                return
        if seq.state.terminal and seq.seq_no in self._ending and seq.quiet & everyone == everyone:
            self._release(seq)
        elif not seq.state.terminal and seq.quiet & everyone == everyone:  # READY or RUNNING: the landing
            self._release_grant(seq)  # its transport left busy ended
            if not self._pull_releases and seq.reported & everyone == everyone:
                self._tell_ctx(seq)

    def _end_receiving(self, seq: Sequence, state: RequestState, failure: FailureReason, message: str) -> None:
        """A receive phase ends badly: the client hears now; blocks and budget stay until every
        rank's blocks are quiet (a receive still running is cancelled here)."""
        self._receiving.pop(seq.request_id, None)
        self._cancel_local(seq)  # the CTXs are told once every rank's blocks are quiet (_release),
        if self.stopped and not self._pull_releases:  # or at once by a broken group: nothing waits for a lease
            self._tell_ctx(seq)
        self._ending[seq.seq_no] = seq
        if seq.block_ids is not None:
            self._quarantined_blocks += int(seq.block_ids.numel())
        self._end(seq, state, failure, message, keep_blocks=True)

    def _cancel_local(self, seq: Sequence) -> None:
        if not seq.cancelled and not seq.reported & (1 << self.rank) and self.receiver is not None:
            seq.cancelled = True
            self.receiver.cancel(seq.request_id)

    def _release(self, seq: Sequence) -> None:
        """Every rank's blocks of an ended request are quiet: blocks and budget come back, and the
        CTXs may free its KV (a READ of it may have run until now: NIXL cannot withdraw one)."""
        if not self._pull_releases:
            self._tell_ctx(seq)
        del self._ending[seq.seq_no]
        self._unquiet.pop(seq.seq_no, None)
        if seq.block_ids is not None:
            self._quarantined_blocks -= int(seq.block_ids.numel())
            self.pool.free(seq.block_ids)
            seq.block_ids = None
        self._release_grant(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self._by_id.pop(seq.request_id, None)
        self._by_seq.pop(seq.seq_no, None)
        with self._live_lock:
            self._live.discard(seq.request_id)

    @staticmethod
    def _release_grant(seq: Sequence) -> None:
        if seq.grant is not None:
            seq.grant.release()
            seq.grant = None

    def _decode_step(self, prepared: PreparedStep, sched: ScheduleResult, blocked: float) -> StepReport:
        t1 = self._clock()
        stalled = max(0.0, (t1 - prepared.t0) - (time.thread_time() - prepared.c0))
        batch_size = len(self._running)
        if batch_size:
            self._decode()
        t2 = self._clock()
        return StepReport(batch_size, len(sched.admitted), sched.deferred, t1 - prepared.t0, blocked, stalled, t2 - t1)

    # -- admission and receives -------------------------------------------------------------------
    def _admit(self) -> tuple[ScheduleResult, float]:
        """Schedule and start the admitted requests' receives; returns the schedule and the time
        this thread was blocked (INLINE)."""
        holding = len(self._receiving) + len(self._ready)
        if self.config.mode is Mode.INLINE:  # the original path: a receive takes a decode slot
            sched = self.scheduler.schedule(active=holding + len(self._running), limit=self.config.max_num_seqs)
        else:
            sched = self.scheduler.schedule(active=holding, limit=self.config.prefetch_seqs)
        blocked = 0.0
        for admission in sched.admitted:
            seq = admission.seq
            seq.grant = admission.grant
            self._admitted = (self._admitted[0] + 1, chain_crc(self._admitted[1], seq.seq_no))
            self._admission_window.append(seq.request_id)
            blocked += self._start_receive(seq)
        return sched, blocked

    def _start_receive(self, seq: Sequence) -> float:
        """Start one admitted request's receive; returns the time this thread spent blocked."""
        mode = self.config.mode
        assert seq.block_ids is not None
        if mode is Mode.IDEAL:  # READY now; it decodes from the next step (after the group agreed it)
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
            self._on_result(ReceiveResult(seq.request_id, None, 0, 0.0, FailureReason.PROTOCOL_ERROR, str(exc)))
            return 0.0
        if self._pull_releases:  # a source none of this request's heads come from frees its copy now
            used = {p.peer for p in parts}
            for src in sources:
                if src.peer not in used:
                    self.receiver.release_soon(src.peer, seq.request_id, src.kv_handle)
        first = parts[0]
        job = ReceiveJob(seq.request_id, first.peer, prompt_ids, first.chunks, None, handle=first.handle,
                         head_offset=self.config.kv_head_offset, release=self._pull_releases,
                         parts=parts if len(parts) > 1 or first.peer_head_start else (),
                         parts_at_once=seq.cost <= self.budget.capacity,  # staging of all parts fits at once
                         kv_blocks=first.blocks, kv_epoch=first.epoch)
        if mode is Mode.ORCHESTRATED:
            self.receiver.submit(job)
            return 0.0
        # INLINE: the original path, on this thread, kept as the benchmark's baseline.
        # Its grant goes with the receive, which gives it back the moment it ends (on the event
        # loop), as the original path did: a reserve waiting here is woken by a receive ending,
        # not by a step of this very thread. (INLINE admission does not read the budget, so this
        # cannot make ranks admit differently.)
        t0 = self._clock()
        staging = None
        grant = None
        try:
            grant = self.budget.acquire_blocking(seq.cost, self._blocking_wait_s(self.config.inline_reserve_timeout_s))
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
            self.receiver.connect_blocking(part.peer, self._blocking_wait_s(self.config.kv_transfer_timeout_ms / 1e3),
                                          clock=self._clock)
        self.receiver.submit(dataclasses.replace(job, grant=grant, staging=staging, chunks=parts[0].chunks,
                                                 parts=parts if job.parts else ()))
        return self._clock() - t0

    def _blocking_wait_s(self, wanted: float) -> float:
        """A blocking wait on this thread never outlasts ``max_blocking_wait_s`` (a rank blocked
        longer than its group's step timeout would break the group)."""
        limit = self.config.max_blocking_wait_s
        return wanted if limit is None else min(wanted, limit)

    def _plan_parts(self, seq: Sequence, kv_slice: KVSlice, sources: tuple[KVSource, ...]) -> tuple[ReceivePart, ...]:
        """This rank's heads of ``seq``, each from a source that holds it, in budget-sized chunks."""
        parts = []
        for src, h0, h1 in plan_sources(sources, kv_slice.head_start, kv_slice.head_end):
            piece = KVSlice(kv_slice.layer_start, kv_slice.layer_end, h0, h1)
            chunks = plan_chunks(self.layout, seq.num_prompt_blocks, piece, self.budget.capacity)
            parts.append(ReceivePart(src.peer, src.kv_handle, chunks, src.head_start, src.kv_blocks, src.kv_epoch))
        return tuple(parts)

    # -- decode -----------------------------------------------------------------------------------
    def _decode(self) -> None:
        b = self._batch.columns()
        batch = DecodeBatch(  # copies: the step function may keep or change what it is given
            request_ids=list(b.request_ids),
            tokens=torch.from_numpy(b.inputs.copy()),
            positions=torch.from_numpy(b.positions()),
            block_tables=list(b.block_tables),
            kv=self.pool.kv,
            requests=list(b.requests),
        )
        new = self._step_fn(batch)
        sampled = (new.detach().cpu().numpy() if isinstance(new, torch.Tensor) else np.asarray(list(new))).reshape(-1)
        if sampled.size != len(b):
            raise RuntimeError(f"step function returned {sampled.size} tokens for a batch of {len(b)}")
        self._last = b
        self._sampled = sampled.astype(np.int64) & _TOKEN  # emitted once the group agreed them

    @staticmethod
    def _done(seq: Sequence) -> bool:
        """Does ``seq`` end with the tokens it has (not RUNNING: its own count and token)?"""
        eos = seq.request.eos_token
        return seq.num_tokens >= seq.request.max_tokens or (eos is not None and seq.last_token == eos)

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
            self._batch.add(seq)

    # -- ending -----------------------------------------------------------------------------------
    def _end(self, seq: Sequence, state: RequestState, failure: FailureReason | None, message: str,
             new_tokens: tuple[int, ...] = (), *, keep_blocks: bool = False) -> None:
        if self._running.pop(seq.request_id, None) is not None:
            self._batch.remove(seq)
        self._ready.pop(seq.request_id, None)
        self._receiving.pop(seq.request_id, None)
        seq.state = state
        if not keep_blocks and seq.block_ids is not None and self._landing_busy(seq):
            # every rank reported its receive whole, yet some rank's transport may still write into
            # these blocks: held until that landing ends, as a failed receive's are (DESIGN: no block
            # freed under a live receive, on every path)
            keep_blocks = True
            self._ending[seq.seq_no] = seq
            self._quarantined_blocks += int(seq.block_ids.numel())
        if not keep_blocks:
            if seq.block_ids is not None:
                self.pool.free(seq.block_ids)
                seq.block_ids = None
            self._release_grant(seq)
            self._forget(seq)
        # counted once its blocks and grant are back (or quarantined): a statistics() read from
        # another thread that counts it ended reads its pool and budget after that (they come last)
        if state is RequestState.FINISHED:
            self._finished += 1
        elif state is RequestState.ABORTED:
            self._aborted += 1
        else:
            assert failure is not None
            self._failed[failure] += 1
            # the receive task logged the one warning event (request id, peer, reason, bytes moved)
            log.debug("request_failed", request_id=seq.request_id, peer=seq.request.peer, reason=failure.value)
        self._emit(RequestOutput(seq.request_id, new_tokens, state, failure, message))

    def _landing_busy(self, seq: Sequence) -> bool:
        """A receive every rank reported (so not a failed one: those are held by ``_end_receiving``)
        whose blocks some rank has not reported quiet."""
        everyone = self._everyone
        return seq.reported & everyone == everyone and seq.quiet & everyone != everyone

    def _tell_ctx(self, seq: Sequence) -> None:
        """Rank 0: every CTX holding ``seq``'s KV may free its copy now (best effort, on the event loop;
        once per request)."""
        if seq.told:
            return
        seq.told = True
        if self.receiver is not None and self.leads_steps:
            seen: set[str] = set()
            for src in seq.request.sources():
                if src.peer not in seen:
                    seen.add(src.peer)
                    self.receiver.release_soon(src.peer, seq.request_id, src.kv_handle)

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
        """The engine cannot serve: every live request fails now (is aborted, after a stop). Rank 0 tells every CTX to free
        what it holds (nothing waits for a lease); a receive still running is cancelled, and its
        blocks come back when it reports."""
        if self._graceful:  # a stop (DESIGN: ABORTED is "client cancel or the node is shutting down")
            state, failure = RequestState.ABORTED, (FailureReason.ABORTED, f"GEN node stopping: {why}")
        else:
            state, failure = RequestState.FAILED, (FailureReason.INTERNAL, f"GEN engine unavailable: {why}")
        for seq in self.scheduler.pop_all():
            self._tell_ctx(seq)
            self._end(seq, state, *failure)
        for seq in list(self._receiving.values()):
            self._end_receiving(seq, state, *failure)
        for seq in list(self._ready.values()) + list(self._running.values()):
            self._end(seq, state, *failure)

    def _emit(self, output: RequestOutput) -> None:
        if (emit := self._emitter()) is not None:
            emit(output)

    def _emitter(self) -> Callable[[RequestOutput], object] | None:
        """Where this rank's outputs go (None: nowhere, off rank 0)."""
        if not self.leads_steps:
            return None
        return self._on_output if self._on_output is not None else self._outputs.put

    # -- event-loop thread -----------------------------------------------------------------------
    def _on_result(self, result: ReceiveResult) -> None:
        self._completions.put(result)
        self.wakeup.set()

    def _observe(self, result: ReceiveResult) -> None:
        if result.ok:
            log.debug("receive_done", request_id=result.request_id, bytes=result.bytes_moved,
                      ms=round(result.elapsed_s * 1e3, 3))
            self._receive_seconds.observe(result.elapsed_s)
            self._receive_bytes.observe(float(result.bytes_moved))

    # -- checks ----------------------------------------------------------------------------------
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

    def rest_problems(self, stats: EngineStatistics | None = None) -> list[str]:
        """Why the engine is not at rest (empty when it is): budget full, nothing in flight, no
        request live, every KV block free. ``stats``: judge that snapshot (a caller reporting both
        gets answers that agree) instead of a new one."""
        s = stats if stats is not None else self.statistics()
        problems = []
        if s.budget.in_use or s.budget.holders or s.budget.waiters:
            problems.append(f"budget not full: {s.budget}")
        if s.receives_in_flight:
            problems.append(f"{s.receives_in_flight} receives in flight")
        if s.waiting or s.receiving or s.ready or s.running or self.live_requests:
            problems.append(f"requests live: {s.waiting} waiting, {s.receiving} receiving, {s.ready} ready, "
                            f"{s.running} running")
        if self._ending:
            problems.append(f"{len(self._ending)} ended requests whose blocks some rank's receive may still write")
        if s.quarantined_blocks:
            problems.append(f"{s.quarantined_blocks} KV blocks quarantined (a late receive may still land)")
        if s.pool.used_blocks:
            problems.append(f"{s.pool.used_blocks} KV blocks not freed")
        if s.staging_bytes:
            problems.append(f"{s.staging_bytes} staging bytes still allocated")
        return problems

    def __repr__(self) -> str:
        s = self.statistics()
        tp = f" rank {self.rank}/{self.world_size}" if self.world_size > 1 else ""
        return (
            f"<GenEngine{tp} {self.config.mode.value} [Requests: {s.waiting} waiting, {s.receiving} receiving, "
            f"{s.ready} ready, {s.running} running] {self.budget!r} {self.pool!r}>"
        )
