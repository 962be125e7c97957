"""The GEN node: receive KV from CTX nodes off the execution thread, decode, stream tokens back.

    event-loop thread (asyncio): control server, UCX transport, the engine's receive task group,
                                 the output pump (engine outputs -> each request's connection)
    execution thread:            DecodeLoop: engine.step() -> model decode step (or device step)

A "generate" connection submits one request (with the KV handle its CTX issued) and streams its
tokens; closing it early aborts the request (blocks and budget come back; CTX is told to free its
copy). A request id that is already live, or an unhealthy engine, is refused and touches nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import sys
import threading
import time
from typing import Any

import anyio
import structlog
import torch

from examples.metrics import serve_node_metrics
from examples.two_node import cli, control, gen_tp, membership, tp_group
from examples.two_node.common import (announce_ready, backend, build_model, control_server, kv_transport,
                                      node_secret, stop_on_sigterm)
from examples.two_node.sigterms import Sigterms
from orchestrator import (
    ContextTooLong,
    DecodeBatch,
    DecodeLoop,
    GenEngine,
    FailureReason,
    GenRequest,
    InvalidRequest,
    KVSource,
    Mode,
    OrchestratorConfig,
    RequestOutput,
    RequestState,
    TPGenEngine,
    Unavailable,
    loop_caller,
)
from orchestrator._sampling import SamplingParams, sample_rows
from transports._ids import blocks_tag_ok, handle_key, handle_tokens
from orchestrator._sampling import logprobs as token_logprobs

log = structlog.get_logger("examples.gen")

SUMMED = ("finished", "aborted", "inline_fallbacks")
"""Counters of a GEN's ``stats["engine"]`` (the ``failed`` and ``deferrals`` dicts, the two receive
histograms and the budget's and pool's counters are summed too; the peaks are maxima)."""
SUMMED_IN = {"budget": ("grants", "oversized_grants", "nowait_denials"), "pool": ("allocations", "exhaustions")}
PEAKS_IN = {"budget": "peak_in_use", "pool": "peak_used_blocks"}


def add_counters(engine: dict[str, Any], ended: dict[str, Any] | None) -> dict[str, Any]:
    """``engine`` (a ``stats["engine"]`` dict of the current generation's engine) with the counters of
    ``ended`` (that of the generations before it, summed) added, so that a tensor-parallel GEN's counters
    and Prometheus series go on across a regroup instead of starting again at 0 as if the node had
    restarted. The gauges are the current engine's alone."""
    if not ended:
        return engine
    out = dict(engine)
    for key in SUMMED:
        out[key] = engine[key] + ended[key]
    for key in ("failed", "deferrals"):
        out[key] = {k: engine[key].get(k, 0) + ended[key].get(k, 0) for k in {*engine[key], *ended[key]}}
    for key in ("receive_seconds", "receive_bytes"):
        now, before = engine[key], ended[key]
        if now["bounds"] != before["bounds"]:  # the buckets are constants: cannot happen
            raise ValueError(f"{key}: the ended engines' histogram has other buckets than the current one's")
        out[key] = {"bounds": now["bounds"], "counts": [a + b for a, b in zip(now["counts"], before["counts"])],
                    "sum": now["sum"] + before["sum"]}
    out["peak_staging_bytes"] = max(engine["peak_staging_bytes"], ended["peak_staging_bytes"])
    for part, names in SUMMED_IN.items():
        peak = PEAKS_IN[part]
        out[part] = {**engine[part], **{n: engine[part][n] + ended[part][n] for n in names},
                     peak: max(engine[part][peak], ended[part][peak])}
    return out


def _refusal_code(exc: Exception) -> str:
    """What kind of refusal ``submit``'s ``exc`` is: about the node (``unavailable``: another GEN may
    take it), or about the request (no GEN of this configuration can: a front must not retry it
    elsewhere nor hold it against this node)."""
    if isinstance(exc, Unavailable):
        return control.UNAVAILABLE
    return "context_length_exceeded" if isinstance(exc, ContextTooLong) else "invalid_request"


class DeviceStep:
    """A decode step that costs device time, as on an accelerator: ``base_ms + per_seq_us * B`` of
    wall time with the CPU and the GIL free (``time.sleep``), like waiting for a GPU kernel."""

    def __init__(self, base_ms: float, per_seq_us: float, vocab_size: int) -> None:
        self.base_s = base_ms / 1e3
        self.per_seq_s = per_seq_us / 1e6
        self.vocab_size = vocab_size

    def __call__(self, batch: DecodeBatch) -> torch.Tensor:
        time.sleep(self.base_s + self.per_seq_s * len(batch))
        return (batch.tokens * 31 + batch.positions) % self.vocab_size


class GenNode:
    """One GEN node, or one rank of a tensor-parallel GEN group (``--tp``, see ``gen_tp``): rank 0
    serves the control plane; the other ranks only step with it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = args.tp_rank
        self.model = build_model(args)
        layout = self.model.kv_layout(args.block_size)
        self.head_sums = gen_tp.HeadChecksums()
        self.rank_loops: dict[int, Any] = {}  # rank 0: the other ranks' execution-thread statistics
        self.kv_held: dict[str, tuple[list[str], str | None]] = {}  # live request -> (its CTX peers, handle)
        self.healer: tp_group.Healer | None = None  # rank 0 of a group: re-forms it when it breaks
        self.notes: gen_tp.NotesClient | None = None  # ranks 1..N-1: notes to rank 0
        self._crc: gen_tp.ChecksumWorker | None = None
        self._all_heads = gen_tp.expected_head_starts(args)
        self._transport: Any = None
        self._tg: Any = None
        self._exec_stop = threading.Event()
        self._exec_thread: threading.Thread | None = None
        self._report_seq = 0  # rank 0: the last statistics request sent; other ranks: the last answered
        self.registration: membership.Registration | None = None  # --etcd: this node's entry
        self.config = OrchestratorConfig(
            layout=layout,
            num_blocks=args.num_blocks,
            transfer_budget_bytes=args.transfer_budget_bytes or OrchestratorConfig.transfer_budget_for_tokens(layout, args.max_tokens_in_buffer),
            mode=Mode(args.mode),
            kv_transfer_timeout_ms=args.kv_transfer_timeout_ms,
            max_num_seqs=args.max_num_seqs,
            max_prefetch_seqs=args.max_prefetch_seqs,
            max_model_len=self.model.config.max_seq_len,
            kv_hold_interval_s=args.kv_hold_interval_s,
            kv_head_offset=self.model.kv_head_range().start,
            total_kv_heads=self.model.config.num_kv_heads,
            device=str(self.model.device),
            **gen_tp.blocking_wait_bound(args),
        )
        self.step_fn: Any = self._step_fn()
        self._handle_key = handle_key(node_secret(args))  # what a CTX's handle names (its prompt's length)
        self.checksums: dict[str, list[int]] = {}
        self.logprob_top: dict[str, int] = {}  # rank 0: requests that asked for logprobs, with how many alternatives
        self.logprobs: dict[str, collections.deque[Any]] = {}  # per token drawn, until the pump sends it
        self._streams: dict[str, Any] = {}
        self._unfinished: set[str] = set()  # ids submitted whose final output is not pumped yet
        self.shutting_down = False  # SIGTERM without --etcd: no new request; the live ones end (graceful stop)
        self.ending = False  # rank 0 stops its group for good: the healer reads the stop as the node's own
        self.exit_status = 0  # 143: a second SIGTERM cut the graceful stop short
        self._pending: collections.deque[RequestOutput] = collections.deque()
        self._pump_flag = threading.Event()
        self._call: Any = None
        self.engine: GenEngine | None = None
        self.loop: DecodeLoop | None = None
        self._ended_counters: dict[str, Any] | None = None  # rank 0: the engines of ended generations, summed
        self._generation_lock = threading.Lock()  # rank 0: the engine and _ended_counters change together
        self.control = control_server(args, self.handle, self.model.config)

    def _step_fn(self) -> Any:
        args = self.args
        if args.step == "device":
            return DeviceStep(args.device_step_ms, args.device_step_us_per_seq, self.model.config.vocab_size)
        return self._model_step

    # -- output routing: execution thread -> event loop, one wake-up per burst ---------------------
    def _on_output(self, out: RequestOutput) -> None:
        self._pending.append(out)
        if not self._pump_flag.is_set():
            self._pump_flag.set()
            self._call(self._pump)

    def _pump(self) -> None:
        """Event loop: hand every pending output to its request's stream. A stream whose reader is
        gone (its client went away) drops the output; it never stops the outputs behind it."""
        self._pump_flag.clear()
        while self._pending:
            out = self._pending.popleft()
            if out.finished:  # its id may be used again from here (not before: its outputs go by id)
                self._unfinished.discard(out.request_id)
            send = self._streams.get(out.request_id)
            if send is not None:
                try:
                    send.send_nowait(out)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    log.debug("output_dropped", request_id=out.request_id)

    def _on_received(self, request_id: str, block_ids: torch.Tensor) -> None:
        """Event loop, a receive landed (before the request can decode): its checksums, on a worker."""
        if not self.args.kv_checksums or self._crc is None:
            return
        self._crc.submit(request_id, self.config.kv_head_offset, self.engine.pool.kv, block_ids,  # type: ignore[union-attr]
                         self._checksums_done)

    def _checksums_done(self, request_id: str, h0: int, per_head: list[list[int]], whole: list[int]) -> None:
        """Event loop: this rank's checksums of a request: kept for its stream (rank 0), or sent to rank 0."""
        if self.notes is not None:
            self.notes.send_soon({"rid": request_id, "h0": h0, "crcs": per_head})
        else:
            self._add_checksums(request_id, h0, per_head, whole)

    def _add_checksums(self, request_id: str, h0: int, per_head: list[list[int]], whole: list[int] | None = None) -> None:
        if request_id not in self._streams:  # ended already (failed): nobody will read them
            return
        if whole:
            self.checksums[request_id] = whole
        self.head_sums.add(request_id, h0, per_head)

    def _on_command(self, command: Any) -> None:
        """Execution thread, every rank at the same step: what rank 0 broadcast."""
        assert self.loop is not None and self.engine is not None
        if command == gen_tp.RESET_STATS:
            self.loop.reset_statistics()
        elif self.rank != 0 and isinstance(command, list) and command[0] == gen_tp.REPORT_STATS:  # rank 0 waits
            # (a list: commands cross the step exchange as JSON, where a tuple arrives as a list)
            self._report_seq = int(command[1])
            stats, notes = self._loop_stats(), self.notes
            if notes is not None:
                self._call(lambda: notes.send_soon({"loop": stats}))

    async def _fresh_rank_loops(self, timeout_s: float = 3.0) -> None:
        """Rank 0 of a tensor-parallel GEN: every rank's loop statistics as of now (not of its last
        once-a-second report), so that a benchmark segment's figures cover all of it on every rank."""
        engine = self.engine
        if not isinstance(engine, TPGenEngine) or engine.health() is not None:
            return
        self._report_seq += 1
        seq = self._report_seq
        engine.broadcast([gen_tp.REPORT_STATS, seq])
        with anyio.move_on_after(timeout_s):
            while any(self.rank_loops.get(r, {}).get("seq", -1) < seq for r in range(1, engine.world_size)):
                engine.wakeup.set()  # an idle rank 0 steps once a second: the answers ride the next steps
                await anyio.sleep(0.005)

    # -- control ---------------------------------------------------------------------------------
    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        op = msg.get("op")
        if op == "generate":
            await self._generate(msg, stream)
        elif op == "stats":
            await self._fresh_rank_loops()
            await stream.send(self.stats())
        elif op == "reset_stats":  # every rank's execution-thread statistics (the others at the next step)
            assert self.loop is not None
            if isinstance(self.engine, TPGenEngine):  # every rank, rank 0 too, at one step
                self.rank_loops.clear()
                self.engine.broadcast(gen_tp.RESET_STATS)
            else:
                self.loop.reset_statistics()
            await stream.send({"ok": True})
        elif op == "drain":  # a front's POST /admin/drain (etcd membership): as on SIGTERM
            reg = self.registration
            await stream.send(reg.request_drain() if reg is not None else
                              {"ok": False, "error": "this node is not registered in etcd (--etcd)"})
        elif op == "ping":
            await stream.send({"ok": True, "role": "gen", "mode": self.config.mode.value, **self._health(),
                               "shutting_down": self.shutting_down,
                               **({"tp": self.healer.statistics()} if self.healer is not None else {})})
        else:
            raise control.ControlError(f"unknown op {op!r}")

    async def _generate(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        if self.engine is None:
            raise control.ControlError("GEN engine unavailable: starting", code=control.UNAVAILABLE)
        if self.shutting_down:
            raise control.ControlError("this GEN node is shutting down (SIGTERM): send the request to another GEN",
                                       code=control.UNAVAILABLE)
        if self.registration is not None and self.registration.refuses_new_work():
            raise control.ControlError("this GEN node is draining: send the request to another GEN", code=control.UNAVAILABLE)
        limit = self.config.max_model_len
        rid = control.request_id(msg)  # before anything is allocated for it
        pulls = self.config.mode is not Mode.IDEAL
        if rid in self._unfinished:  # the engine may have let it go, but its last output is still on its way
            raise control.ControlError(f"request id {rid!r} is already live here (or its previous request's last "
                                       "output is still on its way)")
        if pulls:  # a CTX on the other data plane would fail the pull obscurely (a reset, a handshake
            # timeout); one of another model (same KV shape, other weights) would decode garbage silently
            sources = msg.get("kv_sources")
            for src in sources if isinstance(sources, list) else ():  # checked in full below
                theirs = src.get("kv_transport") if isinstance(src, dict) else None
                if isinstance(theirs, str) and theirs != self.config.kv_transport:
                    raise control.ControlError(
                        f"CTX {str(src.get('peer'))[:64]} serves KV over {theirs[:16]!r}, this GEN pulls over "
                        f"{self.config.kv_transport!r}: start both nodes with the same --kv-transport")
                model = src.get("model") if isinstance(src, dict) else None
                if isinstance(model, str) and model != self.model.config.fingerprint:
                    raise control.ControlError(
                        f"CTX {str(src.get('peer'))[:64]} serves KV of another model (fingerprint {model[:16]}, this "
                        f"GEN's {self.model.config.fingerprint}): start both nodes with the same model flags and --seed")
        request = GenRequest(
            request_id=rid,
            prompt_len=control.field(msg, "prompt_len", int, lo=1, hi=limit),
            first_token=control.field(msg, "first_token", int, lo=0, hi=self.model.config.vocab_size - 1),
            max_tokens=control.field(msg, "max_tokens", int, lo=1, hi=limit),
            peer=control.field(msg, "kv_peer", str) if pulls else None,
            kv_handle=control.kv_handle(msg) if pulls else None,
            kv_sources=self._sources(msg, rid, limit) if pulls else (),
        )
        named = handle_tokens(request.kv_handle, rid, self._handle_key) if request.kv_handle is not None else None
        if named is not None and named != request.prompt_len:  # the same blocks, another position: a wrong answer
            raise control.ControlError(f"prompt_len {request.prompt_len} disagrees with the CTX's prefill of {rid!r}: "
                                       f"{named} tokens (as its KV handle names)", code="invalid_request")
        try:
            if msg.get("sampling") is not None:
                request = dataclasses.replace(request, sampling=SamplingParams.from_wire(msg["sampling"]))
        except ValueError as exc:  # from_wire: anything malformed, an infinity where an int goes too
            raise control.ControlError(str(exc), code="invalid_request") from None
        top = msg.get("logprobs")
        if top is not None and not (type(top) is int and 0 <= top <= 20):  # true is not 1, "3" is not 3
            raise control.ControlError(f"logprobs must be an integer 0-20 (alternatives per token), not {str(top)[:20]!r}",
                                       code="invalid_request")
        if top is not None and request.sampling is None:  # (they come from the sampling path)
            raise control.ControlError("logprobs needs a sampling object ({\"temperature\": 0} for greedy)",
                                       code="invalid_request")
        # submit first (it refuses a live id), then own the stream: no await in between, so no
        # output of this request can reach the pump before its stream is there, and a refused
        # duplicate never touches the live request's stream
        mine = top is not None and rid not in self.logprob_top  # before submit
        if mine:
            self.logprob_top[rid] = top
        try:
            self.engine.submit(request)
        except (InvalidRequest, Unavailable) as exc:
            if mine:
                self.logprob_top.pop(rid, None)
            raise control.ControlError(str(exc), code=_refusal_code(exc)) from None
        self._unfinished.add(rid)
        send, receive = anyio.create_memory_object_stream[RequestOutput](float("inf"))
        self._streams[rid] = send
        if request.kv_handle is not None:  # what a broken group tells every CTX to free at once
            peers = [s.peer for s in request.kv_sources] or [request.peer]
            self.kv_held[rid] = ([p for p in peers if p], request.kv_handle)
        done = False
        try:
            async with anyio.create_task_group() as tg:

                async def watch_client() -> None:  # EOF before "done": the client gave up
                    await control.until_closed(stream)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_client)
                done = await self._stream_tokens(rid, receive, stream)
                tg.cancel_scope.cancel()
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            pass  # the client vanished while we were sending to it
        finally:
            if not done and rid in self._unfinished and self._streams.get(rid) is send:  # still this one's
                log.info("client_gone", request_id=rid)  # the one place a request whose client is gone
                self.engine.abort(rid)  # (or node stopping) is aborted
            if self._streams.get(rid) is send:  # not a later request that reuses the finished id
                del self._streams[rid]
                self.kv_held.pop(rid, None)
                self.checksums.pop(rid, None)
                self.logprob_top.pop(rid, None)
                self.logprobs.pop(rid, None)
                self.head_sums.discard(rid)
            send.close()

    def _sources(self, msg: dict[str, Any], rid: str, limit: int) -> tuple[KVSource, ...]:
        """The generate's ``kv_sources``. Their block ids and store epoch (with which a NIXL pull
        READs at once, unasked) are used only as the CTX named them (``kv_blocks_tag``): without a
        tag they are dropped (the CTX then finds the blocks itself: a round trip more, never
        wrong); with a tag that does not match them the request is refused. Before, a client
        holding a valid handle could point the READ at another request's blocks and the request
        "finished" on that request's KV (an outside drill, over NIXL)."""
        handle = str(msg.get("kv_handle"))
        out = []
        for peer, h0, h1, blocks, epoch, tag in control.kv_sources(msg, self.config.layout.blocks_for(limit)):
            if blocks is None or tag is None:
                blocks = epoch = None
            elif not blocks_tag_ok(tag, self._handle_key, rid, handle, peer, (h0, h1), blocks, epoch):
                raise control.ControlError(
                    f"the KV block ids of source {peer[:64]!r} are not those its CTX named for {rid!r} (their tag "
                    "does not match): pass the prefill reply's kv_sources unchanged", code="invalid_request")
            out.append(KVSource(peer, h0, h1, None, blocks, epoch))
        return tuple(out)

    async def _stream_tokens(self, rid: str, receive: Any, stream: control.JsonStream) -> bool:
        """Forward ``rid``'s outputs; True once "done" was sent."""
        async with receive:
            async for out in receive:
                tokens = list(out.new_tokens)
                while True:  # coalesce what is already there into one message
                    try:
                        more = receive.receive_nowait()
                    except anyio.WouldBlock:
                        break
                    tokens.extend(more.new_tokens)
                    out = more
                lps = self.logprobs.get(rid)
                extra = {"logprobs": [lps.popleft() if lps else None for _ in tokens]} if lps is not None else {}
                if out.finished:
                    if tokens:
                        await stream.send({"tokens": tokens, **extra})
                    if out.state is RequestState.FINISHED:
                        await self._wait_checksums(rid)
                    await stream.send({"done": True, "state": out.state.value,
                                       "failure": out.failure.value if out.failure else None,
                                       "message": out.message, "kv_checksums": self.checksums.get(rid, []),
                                       "kv_head_checksums": self.head_sums.pop(rid)})
                    return True
                await stream.send({"tokens": tokens, **extra})
        return False

    async def _wait_checksums(self, rid: str, timeout_s: float = 2.0) -> None:
        """With --kv-checksums: every rank's checksums of ``rid`` (computed off the event loop, other
        ranks' sent over the notes channel) are there before its stream ends, or ``timeout_s`` passed."""
        if not self.args.kv_checksums or self.config.mode is Mode.IDEAL:
            return
        with anyio.move_on_after(timeout_s):
            while not (self.head_sums.has(rid, self._all_heads) and (self.args.tp > 1 or rid in self.checksums)):
                await anyio.sleep(0.002)

    def streams_open(self) -> int:
        return len(self._streams)

    def _health(self) -> dict[str, Any]:
        why = self.engine.health() if self.engine is not None else "starting"
        if self.healer is not None and self.healer.regrouping:
            why = f"regrouping after: {self.healer.last_cause}"
        return {"healthy": why is None, "health": why}

    def _engine_stats(self, engine: GenEngine) -> tuple[dict[str, Any], Any]:
        """(``stats["engine"]`` of ``engine`` alone, its statistics snapshot)."""
        s = engine.statistics()
        return {
            "waiting": s.waiting, "receiving": s.receiving, "ready": s.ready, "running": s.running,
            "finished": s.finished, "aborted": s.aborted,
            "failed": {r.value: n for r, n in s.failed.items()},
            "deferrals": {r.value: n for r, n in s.deferral_episodes.items()},
            "peak_staging_bytes": s.peak_staging_bytes,
            "transfer_budget_bytes": self.config.transfer_budget_bytes,
            "inline_fallbacks": s.inline_fallbacks,
            "receives_in_flight": s.receives_in_flight, "quarantined_blocks": s.quarantined_blocks,
            "receive_seconds": s.receive_seconds, "receive_bytes": s.receive_bytes,
            "budget": dataclasses.asdict(s.budget),
            "pool": dataclasses.asdict(s.pool),
        }, s

    def stats(self) -> dict[str, Any]:
        assert self.engine is not None and self.loop is not None
        with self._generation_lock:  # an engine and the counters of the ones before it, never a mix (a
            engine, ended = self.engine, self._ended_counters  # scrape runs on the metrics server's threads)
        mine, s = self._engine_stats(engine)
        return {
            "ok": True,
            "role": "gen",
            "mode": self.config.mode.value,
            **self._health(),
            "shutting_down": self.shutting_down,
            "control": dataclasses.asdict(self.control.statistics()),
            "engine": add_counters(mine, ended),
            "loop": self._loop_stats(),
            "rest_problems": engine.rest_problems(s),  # judged on the snapshot reported above
            "tp": self._tp_stats(),
        }

    def _loop_stats(self) -> dict[str, Any]:
        assert self.loop is not None
        ls = self.loop.statistics()
        return {
            "seq": self._report_seq,
            "iterations": ls.iterations, "decode_iterations": ls.decode_iterations, "mean_batch": ls.mean_batch,
            **{name: dataclasses.asdict(getattr(ls, name))
               for name in ("orchestration_ms", "blocked_ms", "stalled_ms", "model_ms")},
        }

    def _tp_stats(self) -> dict[str, Any]:
        engine = self.engine
        if not isinstance(engine, TPGenEngine):
            return {"world_size": 1}
        return {"world_size": engine.world_size, "rank_pids": getattr(self.args, "tp_pids", []),
                "device": self.config.device, "model_backend": tp_group.model_backend(),
                **(self.healer.statistics() if self.healer is not None else {}),
                "kv_head_offset": self.config.kv_head_offset,
                "rank_admitted": [list(a) for a in engine.rank_admitted],
                "rank_loop": {"0": self._loop_stats(), **{str(r): v for r, v in sorted(self.rank_loops.items())}}}

    def _model_step(self, b: DecodeBatch) -> torch.Tensor:
        """The model's decode step: greedy, or drawn per request with its sampling parameters (the
        token at position p from (seed, p) alone: ``orchestrator._sampling``). Every rank of a TP
        group draws from the same logits with the same parameters (they came with the request), so
        the ranks agree; rank 0's tokens are the group's."""
        m = self.model
        params = [r.sampling for r in b.requests]
        if not any(p is not None for p in params):
            return m.decode(b.tokens, b.positions, b.block_tables, b.kv)
        logits = m.decode_logits(b.tokens, b.positions, b.block_tables, b.kv)
        out_pos = [int(p) + 1 for p in b.positions]
        out = sample_rows(logits, params, out_pos, [p - r.prompt_len for p, r in zip(out_pos, b.requests)])
        for i, rid in enumerate(b.request_ids):
            top = self.logprob_top.get(rid)
            if top is not None:  # asked for logprobs (rank 0): sent with the token (the pump)
                self.logprobs.setdefault(rid, collections.deque()).append(token_logprobs(logits[i], int(out[i]), top))
        return out

    def _set_registration(self, reg: membership.Registration) -> None:
        self.registration = reg

    # -- life cycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        args = self.args
        self._call = loop_caller()
        self.config = dataclasses.replace(self.config, kv_transport=backend(args))
        transport = (kv_transport(args, self.config.layout, total_kv_heads=self.model.config.num_kv_heads)
                     if self.config.mode is not Mode.IDEAL else None)
        self._transport = gen_tp.maybe_failing(transport, args)
        self._crc = gen_tp.ChecksumWorker(self._call, whole_blocks=args.tp == 1) if args.kv_checksums else None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.rank != 0:  # a follower rank: steps with rank 0 until the group stops
                    await self._follow(tg)
                    return
                notes = getattr(args, "tp_notes_server", None)
                if notes is not None:
                    notes.on_checksums = self._add_checksums
                    notes.on_loop = self.rank_loops.__setitem__
                    tg.start_soon(notes.serve)
                if args.tp > 1:
                    env, argv = args.tp_extra
                    self.healer = tp_group.Healer("GEN", args, args.tp_state, extra_env=env, extra_argv=argv)
                await self.start_generation()
                if self.healer is not None:
                    tg.start_soon(self.healer.run, gen_tp.GenRank0(self, self._transport))
                try:
                    sigterms = Sigterms()
                    await tg.start(sigterms.run)  # from before READY: a SIGTERM when READY comes is a graceful stop
                    port = await tg.start(self.control.serve, args.host, args.port)
                    metrics = (None if args.metrics_port is None else
                               serve_node_metrics("gen", self.stats, host=args.host, port=args.metrics_port))
                    announce_ready(role="gen", ctrl=f"{args.host}:{port}", mode=self.config.mode.value, metrics=metrics)
                    log.info("gen_ready", ctrl_port=port, mode=self.config.mode.value,
                             transfer_budget_bytes=self.config.transfer_budget_bytes, num_blocks=self.config.num_blocks)
                    drained = anyio.Event()
                    if args.etcd:  # register; SIGTERM / control drain: finish what is live, deregister, stop
                        await tg.start(functools.partial(
                            membership.serve_registration, args.etcd, prefix=args.etcd_prefix, role="gen",
                            ctrl=f"{args.host}:{port}", ttl_s=args.etcd_ttl_s, busy=lambda: self.engine.live_requests,
                            meta={"tp": args.tp, "backend": self.config.kv_transport, "mode": self.config.mode.value,
                                  "model": "tiny", "capacity_blocks": self.config.num_blocks},
                            stop=drained.set, on_registration=self._set_registration, sigterms=sigterms))
                    else:  # SIGTERM: a graceful stop (no new request, the live ones end), then stop
                        tg.start_soon(self._stop_on_sigterm, drained.set, sigterms)
                    await drained.wait()
                finally:
                    self.ending = True  # before the group stops: a healer polling now saw a break and
                    # killed the ranks it was stopping, then formed a new group during the shutdown
                    with anyio.CancelScope(shield=True):
                        await self.end_generation(tell_group=True)
                tg.cancel_scope.cancel()  # drained: the control server and the engine's tasks stop too
        finally:
            if self._crc is not None:
                self._crc.close()
            if transport is not None:
                with anyio.CancelScope(shield=True):
                    await transport.aclose()

    def _new_loop(self) -> DecodeLoop:
        """The execution thread's loop over this generation's engine (an idle TP rank 0 steps well
        within the step timeout)."""
        assert self.engine is not None
        return DecodeLoop(self.engine, tp_idle_s=tp_group.idle_period_s(self.args))

    def _new_engine(self) -> GenEngine:
        args = self.args
        if args.tp == 1:
            return GenEngine(self.config, self._transport, self.step_fn, on_output=self._on_output,
                             on_received=self._on_received)
        watch = self.healer.watch if self.healer is not None else None  # rank 0: this generation's
        return TPGenEngine(self.config, self._transport, gen_tp.watched_step(self.step_fn, watch),
                           sync=gen_tp.step_sync(args.tp_step_group, watch), on_output=self._on_output,
                           on_received=self._on_received, on_command=self._on_command)

    async def start_generation(self) -> None:
        """Rank 0: an engine, a decode loop and an execution thread on the current group (the first,
        or the one the healer just formed: then the model is rebuilt on its model group)."""
        ended = self._ended_counters
        if self.engine is not None:
            self.model = build_model(self.args)
            self.step_fn = self._step_fn()
            # the ended generation's counters go on in the next one's (Prometheus counters never go back)
            ended = add_counters(self._engine_stats(self.engine)[0], ended)
        self.rank_loops.clear()
        engine = self._new_engine()
        with self._generation_lock:
            self.engine, self._ended_counters = engine, ended
        self.loop = self._new_loop()
        await self.engine.start(self._tg)
        self._exec_stop = threading.Event()
        self._exec_thread = threading.Thread(target=self.loop.run, args=(self._exec_stop,), name="execution", daemon=True)
        self._exec_thread.start()

    async def _stop_on_sigterm(self, stop: Any, sigterms: Sigterms) -> None:
        """Without etcd, SIGTERM stops the node gracefully: it takes no new request, lets the live ones
        finish for ``--graceful-shutdown-timeout-s``, aborts the rest (each stream gets its final
        message, each CTX is told to free the request's KV), then ``stop()``. A second SIGTERM
        exits at once (status 143)."""
        await stop_on_sigterm(self, self._wind_down, stop, self._live_work, log, sigterms)

    def _live_work(self) -> dict[str, int]:
        return {"live": self.engine.live_requests if self.engine else 0, "streams": self.streams_open()}

    async def _wind_down(self, grace_s: float) -> None:
        """Until nothing is live here: ``grace_s`` for the live requests to finish, then they are
        aborted; at most 2 s more for their final outputs to reach their streams."""
        assert self.engine is not None
        engine = self.engine
        with anyio.move_on_after(grace_s):
            while engine.live_requests or self._unfinished:
                await anyio.sleep(0.02)
        left = sorted(self._unfinished)
        if left:
            log.warning("shutdown_aborting", requests=len(left), grace_s=grace_s)
            for rid in left:
                engine.abort(rid)
        with anyio.move_on_after(2.0):
            while self._unfinished or self.streams_open():
                await anyio.sleep(0.02)

    async def end_generation(self, *, tell_group: bool = False, timeout_s: float = 10.0) -> None:
        """Stop this generation's execution thread and engine. ``tell_group``: rank 0 is stopping and
        the group is whole (the next step tells every rank). A stream still open then fails here."""
        engine, thread = self.engine, self._exec_thread
        if engine is None or thread is None:
            return
        if tell_group and isinstance(engine, TPGenEngine) and engine.health() is None:
            engine.request_stop()
            with anyio.move_on_after(5):
                while not engine.stopped and thread.is_alive():
                    await anyio.sleep(0.01)
        self._exec_stop.set()
        engine.wakeup.set()
        await anyio.to_thread.run_sync(thread.join, timeout_s)
        engine.close()
        why = engine.health()
        # the engine could not end them (its thread was stuck): say why here; also to ids whose client
        # left (their final output frees the id for reuse, in order behind anything of theirs still queued).
        # A node stopping aborts them (FailureReason.ABORTED); a broken engine fails them.
        if why is None or engine.stopped_gracefully:
            end = (RequestState.ABORTED, FailureReason.ABORTED,
                   "the GEN node is stopping" if why is None else f"GEN node stopping: {why}")
        else:
            end = (RequestState.FAILED, FailureReason.INTERNAL, f"GEN engine unavailable: {why}")
        for rid in [*self._streams, *(r for r in self._unfinished if r not in self._streams)]:
            self._on_output(RequestOutput(rid, (), *end))

    async def _follow(self, tg: Any) -> None:
        args = self.args
        if args.tp_notes:
            self.notes = gen_tp.NotesClient(args.tp_notes, self.rank)
            tg.start_soon(self.notes.run)
            tg.start_soon(gen_tp.report_loop, self.notes, self._loop_stats)
        self.engine = self._new_engine()
        self.loop = self._new_loop()
        await self.engine.start(tg)
        stop = threading.Event()
        exec_thread = threading.Thread(target=self.loop.run, args=(stop,), name="execution", daemon=True)
        exec_thread.start()
        try:
            await anyio.to_thread.run_sync(exec_thread.join)
        finally:
            stop.set()
            await anyio.to_thread.run_sync(exec_thread.join)
            self.engine.close()
            tg.cancel_scope.cancel()


def add_args(p: argparse.ArgumentParser) -> None:
    membership.add_args(p)
    p.add_argument("--host", type=cli.local_host, default="127.0.0.1", help="control-plane bind address")
    p.add_argument("--port", type=cli.port, default=0, help="control-plane port (0: pick one)")
    p.add_argument("--ctx", action="append", default=[], type=cli.address, help="a CTX node's control address HOST:PORT (repeatable; informational: each request names its KV peer)")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.ORCHESTRATED.value)
    p.add_argument("--step", choices=["model", "device"], default="model")
    p.add_argument("--device-step-ms", type=cli.non_negative_float, default=4.0,
                   help="--step device: fixed cost of one decode iteration")
    p.add_argument("--device-step-us-per-seq", type=cli.non_negative_float, default=5.0,
                   help="--step device: added cost per sequence")
    p.add_argument("--num-blocks", type=cli.positive_int, default=4096, help="KV blocks in the GEN pool")
    p.add_argument("--transfer-budget-bytes", type=cli.non_negative_int, default=0,
                   help="transfer budget in bytes (overrides --max-tokens-in-buffer; 0: use that)")
    p.add_argument("--max-tokens-in-buffer", type=cli.positive_int, default=8192, help="transfer budget in tokens of KV")
    p.add_argument("--max-num-seqs", type=cli.positive_int, default=256,
                   help="the decode batch: most requests decoding at once")
    p.add_argument("--max-prefetch-seqs", type=cli.positive_int, default=None,
                   help="most requests receiving or received ahead of the batch (default: --max-num-seqs)")
    p.add_argument("--switch-interval-ms", type=cli.positive_float, default=None,
                   help="sys.setswitchinterval for this process: how long a thread may hold the GIL "
                        "while another waits (Python's default: 5 ms)")
    p.add_argument("--kv-transfer-timeout-ms", type=cli.positive_int, default=60_000)
    p.add_argument("--graceful-shutdown-timeout-s", type=cli.non_negative_float, default=5.0,
                   help="without --etcd: on SIGTERM, how long live requests may finish (no new one is taken) "
                        "before the rest are aborted (their streams get a final message, their CTX frees the "
                        "KV); a second SIGTERM exits at once. With --etcd, SIGTERM drains instead")
    p.add_argument("--metrics-port", type=cli.port, default=None, help="serve Prometheus metrics on this port (0: pick one; default: off)")
    p.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=False,
                   help="CRC32 of each received KV block (per KV head; each rank its own, sent to rank 0 off the "
                        "step exchange), reported at the end of a generate stream: a parity check (the demo "
                        "turns it on; it costs a gather and CPU per request)")
    gen_tp.add_args(p)
    p.add_argument("--kv-hold-interval-s", type=cli.positive_float, default=OrchestratorConfig.kv_hold_interval_s,
                   help="how often CTX nodes are asked to renew the leases of requests still waiting here "
                        "(keep it well below the CTX's --lease-s)")


def main(args: argparse.Namespace) -> int:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    # rank 0's graceful stop: the grace, 2 s for the final outputs, 5 s to stop the group
    return gen_tp.run_node(args, GenNode, notes=True, sigterm_wait_s=args.graceful_shutdown_timeout_s + 10)
