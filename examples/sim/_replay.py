"""One replay: a closed-loop client, a modelled CTX, and a GEN node of ``gen_tp`` ranks made of the
project's own engines, in virtual time.

    client x concurrency ──> CTX (FIFO prefill slots) ──first token──> GEN rank 0 .submit()
    GEN: GenEngine (TP1) or TPGenEngine x gen_tp stepped by LocalGroup.step_all, each rank with its
         ModelledTransport (link) and a meta-device KV pool; their receive groups on the trio loop;
         every rank's pulls also cross the one CTX rank's egress (ctx_nic_gbyte_s), shared
    execution loop (a trio task): step the engine(s) [in inline mode, a step that may wait runs each
         rank on its own ExecutionThread, whose blocking waits the loop serves side by side in
         virtual time] -> the outputs it emitted (the tokens of the decode that ended as it began:
         stamped at emission) wake their clients -> sleep step_s(batch) (+ the host time of pulls
         that ended: host_us_per_pull)

Nothing here decides admission: the engine's ``Scheduler``, ``TransferBudget`` and ``KVBlockPool``
do, inside ``step()``. The replay only supplies time (``VirtualClock``), the link, the CTX, the
model's step time and the load, and reads what the engine reports.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio
import trio.testing

from orchestrator import (GenEngine, GenRequest, LocalGroup, Mode, OrchestratorConfig, RequestState,
                          TPGenEngine, plan_chunks)
from orchestrator._requests import kv_blocks_needed

from ._model import CTX_PEER, ModelledTransport, SimParams, ctx_egress
from ._virtual import ExecutionThread, VirtualClock, call_all, one_cpu, seed_scheduler


@dataclasses.dataclass
class ModeResult:
    mode: str
    gen_tp: int
    output_tok_s: float
    tpot_ms_mean: float
    tpot_ms_p99: float
    ttft_ms_mean: float
    """Client start to the CTX's first token (queue + prefill)."""
    kv_wait_ms_mean: float
    """CTX's first token to GEN's first decoded token (transfer, admission waits, decode slot)."""
    mean_batch: float
    decode_steps: int
    exec_blocked_ms: dict[str, float]
    """Per step, virtual time the execution thread spent in explicit blocking waits (p50, p99, max, sum_s)."""
    blocked_steps: int
    inline_fallbacks: int
    deferral_episodes: dict[str, int]
    budget_capacity: int
    peak_budget_in_use: int
    peak_link_bytes_in_flight: int
    peak_staging_bytes: int
    """Per GEN rank, the most bytes of pulls under way at once (what the budget bounds, orchestrated)."""
    finished: int
    failed: int
    measured: int
    virtual_s: float
    wall_s: float
    engine_steps: int
    max_admitted_per_step: int
    fcfs_violations: int
    rest_problems: list[str]
    requests: list[tuple[float, float, float, float, int]] = dataclasses.field(default_factory=list, repr=False)
    """Per request (arrival at CTX, first token, first GEN token, end, measured 0/1); only with keep_requests."""

    def problems(self) -> list[str]:
        """The real run's invariants this replay broke (empty: none): no request failed, each rank's
        engine at rest, FCFS among the requests that fit, and, orchestrated, never more bytes being
        pulled into a rank at once than its transfer budget (measured on the link, not read from the
        budget, which cannot grant more than it has)."""
        out = [f"{self.mode}: {msg}" for msg in self.rest_problems]
        if self.failed:
            out.append(f"{self.mode}: {self.failed} requests failed")
        if self.fcfs_violations:
            out.append(f"{self.mode}: {self.fcfs_violations} FCFS violations")
        if self.mode == Mode.ORCHESTRATED.value and self.peak_staging_bytes > self.budget_capacity:
            out.append(f"{self.mode}: {self.peak_staging_bytes} bytes pulled at once into a rank, "
                       f"budget {self.budget_capacity}")
        return out

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("requests")
        return d


def _config(p: SimParams, mode: Mode, rank: int) -> OrchestratorConfig:
    layout = p.rank_layout()
    longest = max(p.isl_choices or (p.isl,))
    per_request = kv_blocks_needed(layout, longest, p.osl)  # what the engine holds per request
    pool_requests = p.kv_pool_requests or (p.max_num_seqs + (p.max_prefetch_seqs or p.max_num_seqs))
    return OrchestratorConfig(
        layout=layout,
        num_blocks=per_request * pool_requests,
        transfer_budget_bytes=OrchestratorConfig.transfer_budget_for_tokens(layout, p.max_tokens_in_buffer),
        mode=mode,
        kv_transfer_timeout_ms=p.kv_transfer_timeout_ms,
        max_num_seqs=p.max_num_seqs,
        max_prefetch_seqs=p.max_prefetch_seqs,
        max_model_len=longest + p.osl,
        inline_reserve_timeout_s=p.inline_reserve_timeout_s,
        kv_head_offset=rank * p.heads_per_rank,
        device="meta",  # shapes and bytes only: the public case's pool would not fit in this machine
    )


def _tokens(batch: Any) -> list[int]:
    return [1] * len(batch.request_ids)


class _Replay:
    def __init__(self, p: SimParams, mode: Mode, clock: VirtualClock, keep_requests: bool,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.p, self.mode, self.clock = p, mode, clock
        self.keep_requests = keep_requests
        self.ready_at: dict[str, float] | None = {} if p.pipelined else None
        self.ends: list[tuple[Any, float]] = []  # RequestOutputs that end a request (FINISHED/FAILED), from rank 0, and when
        on_output = self._on_output
        self.transports: list[ModelledTransport] = []
        self.ctx_nic = ctx_egress(p)  # one CTX rank: its egress is every GEN rank's
        if p.gen_tp == 1:
            transport = None if mode is Mode.IDEAL else ModelledTransport(p, self.ready_at, self.ctx_nic)
            self.transports = [transport] if transport else []
            self.engines: list[GenEngine] = [GenEngine(_config(p, mode, 0), transport, _tokens, on_output=on_output,
                                                          clock=clock)]
            self._step = self._step_one
        else:
            group = LocalGroup(p.gen_tp)
            self.engines = []
            for rank in range(p.gen_tp):
                transport = None if mode is Mode.IDEAL else ModelledTransport(p, self.ready_at, self.ctx_nic)
                if transport:
                    self.transports.append(transport)
                self.engines.append(TPGenEngine(_config(p, mode, rank), transport, _tokens, on_output=on_output,
                                                clock=clock, sync=group.sync(rank)))
            self._step = self._step_group
        self.lead = self.engines[0]
        clock.on_park = self._settle  # inline: what a step emitted before it waits reaches its clients then
        self._watch_admission()
        for engine in self.engines:  # as DecodeLoop's wakeup.wait: whatever wakes an engine wakes the loop
            engine.wakeup = _Wakeup(self._wake)
        self.isls = p.prompt_lengths()
        self.total = p.warmup + p.requests
        self._next = iter(range(0))
        self.phase_start = 0.0
        self.waiters: dict[str, trio.Event] = {}
        self.records = np.zeros((self.total, 5))  # arrival, first token, first GEN token, end, ok
        self.gen_arrival: dict[str, int] = {}  # request id -> its place in the order GEN received them
        self.first_gen_token: dict[str, float] = {}
        self.activity = trio.Event()
        self.batches: list[int] = []
        self.blocked: list[float] = []
        self.steps = 0
        self.clients_done = False
        self._submitted = False
        self.max_admitted = 0
        self.fcfs_violations = 0
        self.progress = progress
        """Called as requests end, every tenth of them and at the last: (ended so far, total)."""
        self._ended = 0
        self._next_report = 0

    def _on_output(self, out: Any, _running: RequestState = RequestState.RUNNING) -> None:
        # on the execution thread, inside step(), once per token: kept small. A step emits the
        # tokens of the decode that ended as it began: stamped now, at emission
        if out.state is not _running:
            self.ends.append((out, self.clock.now()))
        elif out.request_id not in self.first_gen_token:
            self.first_gen_token[out.request_id] = self.clock.now()

    def _wake(self) -> None:
        """An engine's wakeup was set (a submission, a receive's end in any way, a stop): on the loop's
        thread, the idle loop wakes now; on an execution thread (inline), the loop is not idle (it
        runs that thread's step) and reads the engines' wakeups before it next sleeps."""
        if threading.get_ident() == self.clock.loop_thread:
            self.activity.set()

    def _may_block(self) -> bool:
        """Inline: only admitting a request waits (staging reservation, connect): a step may wait
        only when a request is queued at an engine or was submitted since the last step."""
        return self._submitted or any(e.scheduler.num_waiting for e in self.engines)

    def _step_one(self) -> list[Any]:
        return [self.lead.step()]

    def _step_group(self) -> list[Any]:
        return LocalGroup.step_all(self.engines)  # type: ignore[arg-type]

    async def _step_on_threads(self, threads: list[ExecutionThread]) -> list[Any]:
        """A step that may wait (inline): each rank applies it on its own execution thread, so the
        ranks' blocking waits overlap in virtual time, as on separate processes."""
        if len(self.engines) == 1:
            return await call_all(threads, [self.lead.step])
        prepared, messages = LocalGroup.prepare_all(self.engines)
        return await call_all(threads, [functools.partial(e.apply_step, p, messages)  # type: ignore[attr-defined]
                                        for e, p in zip(self.engines, prepared)])

    # -- the execution loop ----------------------------------------------------------------------
    async def execution_loop(self) -> None:
        threads = [ExecutionThread(self.clock) for _ in self.engines] if self.mode is Mode.INLINE else []
        p = self.p
        idle = p.idle_poll_ms / 1e3
        stall_s = 2 * p.kv_transfer_timeout_ms / 1e3 + 10  # longer than any receive, or landing, can last
        stalled_since: float | None = None
        try:
            while not (self.clients_done and not self.lead.live_requests):
                if not self.lead.num_running and not self.lead.num_ready and not self._woken():
                    # nothing to decode or start: as DecodeLoop, sleep until an engine's wakeup is set (a
                    # submission, a receive's end, failed or not), at most idle_poll_ms
                    with trio.move_on_after(idle):
                        await self.activity.wait()
                self.activity = trio.Event()
                for engine in self.engines:  # before the step: anything set from here on is seen next time
                    engine.wakeup.clear()
                may_block = bool(threads) and self._may_block()
                self._submitted = False  # submits from here on (also while this step waits) count for the next
                if may_block:
                    reports = await self._step_on_threads(threads)
                else:  # a step that cannot wait needs no thread: run it here (a wait here would raise)
                    reports = self._step()
                self.steps += 1
                batch = reports[0].batch_size
                blocked = max(r.blocked_s for r in reports)
                if batch or blocked:
                    self.batches.append(batch)
                    self.blocked.append(blocked)
                admitted = reports[0].admitted
                if admitted > self.max_admitted:
                    self.max_admitted = admitted
                self._settle()  # the clients hear of what this step emitted now, not after its model time
                if self._nowhere():  # live requests in no queue: a bug would spin here for ever in virtual time
                    now = self.clock.now()
                    stalled_since = now if stalled_since is None else stalled_since
                    if now - stalled_since > stall_s:
                        raise ReplayStuck(f"replay stuck: {self.lead.live_requests} live requests neither waiting, "
                                           f"receiving, ready nor running for {stall_s:g} s of virtual time")
                else:
                    stalled_since = None
                host = self._host_debt()
                if batch:
                    await trio.sleep(p.step_s(batch) * p.iterations_per_step + host)
        finally:
            for thread in threads:
                thread.close()

    def _woken(self) -> bool:
        return any(engine.wakeup.is_set() for engine in self.engines)

    def _nowhere(self) -> bool:
        """Live requests, and none waiting, receiving, ready or running (a landing still busy after
        its receive ended is the one legitimate cause, and it ends with its transfer)."""
        lead = self.lead
        return bool(lead.live_requests and not (lead.num_running or lead.num_ready or lead.scheduler.num_waiting)
                    and not lead.statistics().receiving)

    def _host_debt(self) -> float:
        """Host time the pulls that ended took from the ranks' execution threads since the last step
        (``host_us_per_pull``): a group step waits for its slowest rank. An idle step forgets it."""
        if not self.p.host_us_per_pull:
            return 0.0
        debt = max((t.host_debt_s for t in self.transports), default=0.0)
        for t in self.transports:
            t.host_debt_s = 0.0
        return debt

    def _settle(self) -> None:
        ends, self.ends = self.ends, []
        if ends and self.progress is not None:
            self._ended += len(ends)
            if self._ended >= self._next_report or self._ended == self.total:
                self._next_report = self._ended + max(1, self.total // 10)
                self.progress(self._ended, self.total)
        for out, at in ends:
            i = int(out.request_id[1:])
            self.records[i, 3] = at
            self.records[i, 4] = 1.0 if out.state is RequestState.FINISHED else 0.0
            self.records[i, 2] = self.first_gen_token.pop(out.request_id, at)
            self.waiters.pop(out.request_id).set()

    # -- the client and the CTX ------------------------------------------------------------------
    async def client(self, ctx_slots: trio.Semaphore) -> None:
        p = self.p
        for i in self._next:
            rid = f"r{i}"
            isl = self.isls[i]
            self.records[i, 0] = trio.current_time()
            done = self.waiters[rid] = trio.Event()
            async with ctx_slots:
                prefill = p.prefill_s(isl)
                if self.ready_at is not None:  # pipelined: GEN may start once the first layer is prefilled
                    self.ready_at[rid] = trio.current_time() + prefill
                    await trio.sleep(prefill / p.num_layers)
                    self._submit(i, rid, isl)
                    await trio.sleep(prefill - prefill / p.num_layers)
                else:
                    await trio.sleep(prefill)
            self.records[i, 1] = trio.current_time()
            if self.ready_at is None:
                self._submit(i, rid, isl)
            await done.wait()
        # the last client to finish lets the execution loop end once nothing is live

    def _submit(self, i: int, rid: str, isl: int) -> None:
        self.gen_arrival[rid] = len(self.gen_arrival)
        self.lead.submit(GenRequest(rid, prompt_len=isl, first_token=1, max_tokens=self.p.engine_max_tokens(), peer=CTX_PEER))
        self._submitted = True
        self.activity.set()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for engine in self.engines:
                await engine.start(nursery)
            async with trio.open_nursery() as inner:
                inner.start_soon(self.execution_loop)
                ctx_slots = trio.Semaphore(self.p.ctx_prefill_slots)
                # two phases, as the public case ran them: warm-up to completion, then the measured one
                for start, end in ((0, self.p.warmup), (self.p.warmup, self.total)):
                    self._next = iter(range(start, end))
                    self.phase_start = trio.current_time()
                    async with trio.open_nursery() as clients:
                        for _ in range(min(self.p.concurrency, end - start)):
                            clients.start_soon(self.client, ctx_slots)
                self.clients_done = True
                self.activity.set()
            # the execution loop has ended with nothing live: stop the receive groups
            for engine in self.engines:
                engine.close()

    # -- what it showed --------------------------------------------------------------------------
    def _watch_admission(self) -> None:
        """Judge FCFS as the lead's scheduler decides (``_check_fcfs``): its ``schedule`` is wrapped to
        read what it admitted and the KV left free when it returned. Only reads: the decision is its own."""
        scheduler, pool = self.lead.scheduler, self.lead.pool
        schedule = scheduler.schedule

        def watched(*args: Any, **kwargs: Any) -> Any:
            result = schedule(*args, **kwargs)
            if result.admitted:
                self._check_fcfs(result.admitted, pool.num_free)
            return result

        scheduler.schedule = watched  # type: ignore[method-assign]

    def _check_fcfs(self, admitted: list[Any], free_after: int) -> None:
        """FCFS among the requests that fit (the scheduler's rule, judged by the facts, not by a mark):
        each admission is the earliest-arrived waiting request that fits the KV free at that moment,
        so a request that reached GEN before an admitted one and still waits must not have fitted the
        KV free when the first admission that arrived after it was chosen (a budget denial or a full
        window stops the step: nothing is admitted past either). The KV free then is what is free
        after the step's allocations plus the blocks of the admissions from that one on."""
        arrival = self.gen_arrival
        order = [arrival[a.seq.request_id] for a in admitted]  # in the order the scan chose them
        free_at = []  # free_at[i]: KV free when admission i was chosen
        free = free_after
        for a in reversed(admitted):
            free += a.seq.num_blocks
            free_at.append(free)
        free_at.reverse()
        latest = max(order)
        for seq in self.lead.scheduler.waiting:  # in arrival order
            came = arrival[seq.request_id]
            if came > latest:
                break
            free_then = next(f for o, f in zip(order, free_at) if o > came)
            if seq.num_blocks <= free_then:  # it fitted, and a later request went first
                self.fcfs_violations += 1


MAX_POOL_BLOCKS = 1 << 26
"""KV blocks over all GEN ranks at most (67M: 113x the public case's 589,824). The pool's tensor is
on the meta device, but its free list and owner marks are real arrays, 9 bytes a block."""


def check_requests(p: SimParams) -> None:
    """Raise ``ValueError`` when a GEN rank would refuse some of ``p``'s requests at submit (the
    real node answers ``InvalidRequest``): a transfer budget smaller than one layer of one KV head
    of a prompt; or when the GEN ranks' KV pools, sized to fit every request, would take more than
    ``MAX_POOL_BLOCKS`` blocks (a NumPy MemoryError, or the machine's memory, otherwise)."""
    config = _config(p, Mode.ORCHESTRATED, 0)
    if config.num_blocks * p.gen_tp > MAX_POOL_BLOCKS:
        raise ValueError(f"the GEN KV pools would take {config.num_blocks:,} blocks x GEN TP {p.gen_tp} (at most "
                         f"{MAX_POOL_BLOCKS:,}: 9 bytes of host memory a block): lower kv_pool_requests, max_num_seqs, "
                         f"max_prefetch_seqs or the prompt and output lengths, or raise block_size")
    for isl in sorted(set(p.isl_choices or (p.isl,))):
        try:
            plan_chunks(config.layout, config.layout.blocks_for(isl), config.kv_slice, config.transfer_budget_bytes)
        except ValueError as exc:
            raise ValueError(f"max_tokens_in_buffer {p.max_tokens_in_buffer} at GEN TP {p.gen_tp}: a GEN rank would "
                             f"refuse every {isl}-token prompt ({exc}); raise the budget") from None


def check_transfers(p: SimParams) -> None:
    """Raise ``ValueError`` when the longest prompt's KV cannot cross the links within
    ``kv_transfer_timeout_ms`` even alone (bytes / bandwidth, no latency, no queue): in a mode that
    pulls, every such request would time out, each after the full timeout, one budget's worth at a
    time (at the public case's size, hours of idle steps and a warning per request per rank). The
    CLI and the sweep refuse such parameters; ``replay`` itself runs them (a receive's timeout is
    worth replaying on purpose)."""
    longest = max(p.isl_choices or (p.isl,))
    rank_bytes = p.rank_bytes(longest)  # what one rank pulls: whole blocks
    alone_s = p.transfer_s(longest)
    if alone_s * 1e3 >= p.kv_transfer_timeout_ms:
        raise ValueError(f"a {longest}-token prompt's KV ({rank_bytes:,} bytes per GEN rank, x {p.gen_tp} through the "
                         f"CTX's NIC) takes {alone_s:,.1f} s on the links alone, not under kv_transfer_timeout_ms "
                         f"{p.kv_transfer_timeout_ms}: every such request would time out (only ideal pulls nothing)")


class _Wakeup(threading.Event):
    """An engine's ``wakeup`` (a ``threading.Event``, as the engine makes it) that also calls
    ``on_set``: the replay's idle loop sleeps on it as ``DecodeLoop`` sleeps on ``wakeup.wait``."""

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()


class ReplayStuck(RuntimeError):
    """The engine holds live requests in no queue (a bug): the replay stops instead of spinning."""


def replay(p: SimParams, mode: Mode | str, *, keep_requests: bool = False,
           progress: Callable[[int, int], None] | None = None) -> ModeResult:
    """Run one mode of ``p`` in virtual time; returns what a benchmark would report.
    ``progress(ended, total)``: as requests end, every tenth of them (for long runs)."""
    p.check()
    check_requests(p)
    mode = Mode(mode)
    seed_scheduler(p.seed)
    mock = trio.testing.MockClock(autojump_threshold=0)
    holder: dict[str, _Replay] = {}

    async def main() -> None:
        clock = VirtualClock(mock)
        r = holder["r"] = _Replay(p, mode, clock, keep_requests, progress)
        await r.run()
        r._step()  # results published while stopping free their blocks here

    wall = time.perf_counter()
    with one_cpu():
        try:
            trio.run(main, clock=mock)
        except BaseExceptionGroup as group:  # the replay's own verdict, not its nurseries' wrapping
            stuck = group.subgroup(ReplayStuck)
            if stuck is None:
                raise
            while isinstance(stuck, BaseExceptionGroup):
                stuck = stuck.exceptions[0]
            raise stuck from None
    wall = time.perf_counter() - wall
    r = holder["r"]
    return _result(r, mock.current_time(), wall)


def _result(r: _Replay, virtual_s: float, wall_s: float) -> ModeResult:
    p = r.p
    rec = r.records
    measured = rec[p.warmup:]
    ok = measured[:, 4] > 0
    window = float(measured[:, 3].max() - r.phase_start) if len(measured) else 0.0  # the measured phase
    tokens = p.osl * int(ok.sum())
    tpot = (measured[ok, 3] - measured[ok, 1]) / max(1, p.osl - 1) * 1e3
    batches = np.array(r.batches or [0])
    decode = batches > 0
    blocked = np.array(r.blocked or [0.0]) * 1e3
    stats = [e.statistics() for e in r.engines]
    problems = [f"rank {k}: {msg}" for k, e in enumerate(r.engines) for msg in e.rest_problems()]
    return ModeResult(
        mode=r.mode.value,
        gen_tp=p.gen_tp,
        output_tok_s=tokens / window if window > 0 else 0.0,
        tpot_ms_mean=float(tpot.mean()) if tpot.size else 0.0,
        tpot_ms_p99=float(np.percentile(tpot, 99)) if tpot.size else 0.0,
        ttft_ms_mean=float((measured[:, 1] - measured[:, 0]).mean() * 1e3),
        kv_wait_ms_mean=float((measured[ok, 2] - measured[ok, 1]).mean() * 1e3) if ok.any() else 0.0,
        mean_batch=float(batches[decode].mean()) if decode.any() else 0.0,
        decode_steps=int(decode.sum()),
        exec_blocked_ms={"p50": float(np.percentile(blocked, 50)), "p99": float(np.percentile(blocked, 99)),
                         "max": float(blocked.max()), "sum_s": float(blocked.sum() / 1e3)},
        blocked_steps=int((blocked > 0).sum()),
        inline_fallbacks=sum(s.inline_fallbacks for s in stats),
        deferral_episodes={k.value: v for k, v in stats[0].deferral_episodes.items()},
        budget_capacity=stats[0].budget.capacity,
        peak_budget_in_use=max(s.budget.peak_in_use for s in stats),
        peak_link_bytes_in_flight=max((t.link.peak_bytes_in_flight for t in r.transports), default=0),
        peak_staging_bytes=max((t.peak_staging_bytes for t in r.transports), default=0),
        finished=int(rec[:, 4].sum()),
        failed=int(r.total - rec[:, 4].sum()),
        measured=int(ok.sum()),
        virtual_s=virtual_s,
        wall_s=wall_s,
        engine_steps=r.steps,
        max_admitted_per_step=r.max_admitted,
        fcfs_violations=r.fcfs_violations,
        rest_problems=problems,
        requests=[tuple(row) for row in rec.tolist()] if r.keep_requests else [],  # type: ignore[misc]
    )
