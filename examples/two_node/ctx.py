"""The CTX node: prefill prompts into paged KV, hold it, serve it over UCX until pulled.

    control "prefill" ─> check the request id (before anything is allocated)
                     ─> allocate KV blocks (waits while the pool is full, bounded)
                     ─> prefill on the execution thread (one at a time) ─> KVStore.put(lease) -> handle
                     ─> reply first_token, prompt_len, kv_peer, kv_handle, block checksums
    KV PULL from GEN ─> the KV server (--kv-transport) serves the blocks, then the store frees them
    GEN's RELEASE, a control "release" with the handle, or the lease expiring ─> the store frees them

With ``--tp M`` the node is M rank processes, each holding its KV heads (examples/two_node/ctx_tp.py):
the prefill reply's ``kv_sources`` names every rank's UCX address and head range, and GEN pulls each
head from the rank that holds it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import threading
import time
from typing import Any

import anyio
import structlog
import torch

from examples.metrics import ctx_node_stats, serve_node_metrics
from examples.two_node import cli, control, ctx_tp, gen_tp, membership, tp_group
from examples.two_node.common import (
    announce_ready,
    backend,
    block_checksums,
    build_model,
    control_server,
    kv_server,
    node_secret,
    stop_on_sigterm,
)
from examples.two_node.gen_tp import head_checksums
from examples.two_node.sigterms import Sigterms
from orchestrator import KVBlockPool, KVExhausted, loop_caller
from orchestrator._sampling import SamplingParams, sample
from orchestrator._sampling import logprobs as token_logprobs
from transports import KVStore
from transports._ids import blocks_tag, handle_key

log = structlog.get_logger("examples.ctx")


class CtxNode:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = build_model(args)
        self.layout = self.model.kv_layout(args.block_size)
        self.pool = KVBlockPool(self.layout, args.num_blocks)
        self.store = KVStore(self.layout, self.pool.kv)
        # its handles name their request and prompt length: a GEN refuses a generate whose prompt_len
        # disagrees with the prefill (a NIXL GEN also READs without asking, from such a handle only)
        self.handle_key = handle_key(node_secret(args))  # also tags the block ids its prefills name
        self.store.name_handles(self.handle_key)
        self.ucx_addr = ""
        self.kv_server: Any = None
        self.rank = getattr(args, "tp_rank", 0)
        self.head_range = (tuple(self.model.kv_head_range()) if args.tp > 1
                           else (0, self.model.config.num_kv_heads))
        self._freed = anyio.Event()
        self._exec = anyio.CapacityLimiter(1)  # the CTX execution thread: one prefill at a time
        self._prefills = 0
        self._abandoned = 0  # prefills whose client closed the connection before the answer (KV released)
        self._prefilling: set[str] = set()  # request ids between their checks and their put (duplicates refused)
        self.registration: membership.Registration | None = None  # --etcd: this node's entry
        self.shutting_down = False  # SIGTERM without --etcd: no new prefill; held KV may still be pulled
        self.exit_status = 0  # 143: a second SIGTERM cut the graceful stop short
        self.group: ctx_tp.CtxGroup | None = None
        self.healer: tp_group.Healer | None = None  # rank 0 of a group: re-forms it when it breaks
        self.group_copies: dict[str, str] = {}  # rank 0: request id -> handle of what the group holds
        self.exec_thread: threading.Thread | None = None
        if args.tp > 1:
            if self.rank == 0:
                self.healer = tp_group.Healer("CTX", args, args.tp_state)
            self.group = ctx_tp.CtxGroup(self, args.tp_step_group, self.rank, args.tp,
                                         self.healer.watch if self.healer is not None else None)
        self.control = control_server(args, self.handle, self.model.config) if self.rank == 0 else None

    def on_free(self, block_ids: torch.Tensor, request_id: str | None = None, handle: str | None = None) -> None:
        """Any thread: give the blocks back and wake every prefill waiting for blocks. A group's copy
        (``request_id`` and its ``handle``) is forgotten only if it is still the one recorded: a copy
        released while a pull pinned it is freed later, perhaps after a new prefill of that id."""
        if request_id is not None and self.group_copies.get(request_id) == handle:
            self.group_copies.pop(request_id, None)
        self.pool.free(block_ids)
        if self.group is not None:
            self.group.notify_freed()
        self._call(self._wake_allocators)

    def rank_stats(self) -> dict[str, Any]:
        s, p = self.store.statistics(), self.pool.statistics()
        kv = dataclasses.asdict(self.kv_server.statistics()) if self.kv_server is not None else {}
        return {"rank": self.rank, "head_range": list(self.head_range), "store": dataclasses.asdict(s),
                "pool": {"num_blocks": p.num_blocks, "used_blocks": p.used_blocks, "peak_used_blocks": p.peak_used_blocks},
                "kv_server": kv}

    async def _in_group(self, op: tuple[Any, ...], local: Any = None) -> Any:
        """Rank 0: run ``op`` on every rank (their execution threads, in lockstep) and wait for it."""
        assert self.group is not None
        done = anyio.Event()
        box: list[Any] = []

        def finished(result: Any) -> None:  # on the execution thread
            box.append(result)
            self._call(done.set)

        self.group.submit(op, local, finished)
        await done.wait()
        if isinstance(box[0], BaseException):
            raise control.ControlError(str(box[0]))
        return box[0]

    def _wake_allocators(self) -> None:
        freed, self._freed = self._freed, anyio.Event()  # one event per generation of frees
        freed.set()

    async def _allocate(self, n: int) -> torch.Tensor:
        with anyio.fail_after(self.args.alloc_wait_s):
            while True:
                freed = self._freed  # taken before trying, so a free in between is not missed
                try:
                    return self.pool.allocate(n)
                except KVExhausted:
                    await freed.wait()

    def _set_registration(self, reg: membership.Registration) -> None:
        self.registration = reg

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        op = msg.get("op")
        if op == "prefill":
            reply = await self._prefill_while_watched(msg, stream)
            if reply is not None:
                await stream.send(reply)
        elif op == "release":  # only with the handle of the prefill: a wrong one releases nothing
            rid, handle = control.request_id(msg), control.kv_handle(msg)
            await stream.send({"ok": True, "released": await self._release(rid, handle)})
        elif op == "stats":
            await stream.send(await self.stats())
        elif op == "drain":  # a front's POST /admin/drain (etcd membership): as on SIGTERM
            reg = self.registration
            await stream.send(reg.request_drain() if reg is not None else
                              {"ok": False, "error": "this node is not registered in etcd (--etcd)"})
        elif op == "ping":
            await stream.send({"ok": True, "role": "ctx", **self._health(), "shutting_down": self.shutting_down,
                               **({"tp": self.healer.statistics()} if self.healer is not None else {})})
        else:
            raise control.ControlError(f"unknown op {op!r}")

    def _health(self) -> dict[str, Any]:
        why = self.group.broken if self.group is not None else None
        if self.healer is not None and self.healer.regrouping:
            why = f"regrouping after: {self.healer.last_cause}"
        if self.shutting_down:  # a front's poll then keeps it out (its prefills would only be refused)
            why = "shutting down (SIGTERM): no new prefill"
        return {"healthy": why is None, "health": why}

    async def stats(self) -> dict[str, Any]:
        """Figures of the node; with ``--tp``, ``store`` and ``pool`` add up every rank's (``ranks``)."""
        assert self.control is not None
        ranks = [self.rank_stats()]
        if self.group is not None and self.group.broken is None:
            with contextlib.suppress(control.ControlError):  # the group broke meanwhile: rank 0's own
                ranks = await self._in_group(("stats",))
        store = {k: sum(r["store"][k] for r in ranks) for k in ranks[0]["store"]}
        pool = {k: sum(r["pool"][k] for r in ranks) for k in ranks[0]["pool"]}
        return {"ok": True, "role": "ctx", "prefills": self._prefills, "prefills_abandoned": self._abandoned,
                "busy": self.busy(),  # what a stop now would lose (held KV, prefills taken), rank 0's count
                "store": store, "pool": pool,
                "tp": {"world_size": self.args.tp, "ranks": ranks, "rank_pids": getattr(self.args, "tp_pids", []),
                       **(self.healer.statistics() if self.healer is not None else {})},
                "control": dataclasses.asdict(self.control.statistics()), **self._health()}

    async def _release(self, rid: str, handle: str | None) -> bool:
        return (await self._in_group(("release", rid, handle)) if self.group is not None
                else self.store.release(rid, handle=handle))

    async def _prefill_while_watched(self, msg: dict[str, Any], stream: control.JsonStream) -> dict[str, Any] | None:
        """The prefill, its connection watched meanwhile: a client that closed it (gave up, died)
        before the answer can never release that KV (it has no handle). A prefill still waiting for
        blocks or for the execution thread is cancelled (``_prefill`` frees what it took); one
        already running is let finish and its KV released at once rather than held for the lease
        (and so is every prefill of a tensor-parallel CTX, whose group runs it). None then (nobody
        to answer)."""
        gone = False
        error: Exception | None = None
        reply: dict[str, Any] | None = None
        waiting = anyio.CancelScope()  # the prefill, cancelled when its client leaves
        async with anyio.create_task_group() as tg:

            async def watch() -> None:  # a prefill's client sends nothing more: EOF means it left
                nonlocal gone
                await control.until_closed(stream)
                gone = True
                if self.group is None:
                    waiting.cancel()

            tg.start_soon(watch)
            try:
                with waiting:
                    reply = await self._prefill(msg)
            except Exception as exc:  # raised below, not wrapped in the task group's ExceptionGroup
                error = exc
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
        if reply is None:  # cancelled before it stored anything: its client is gone
            self._abandoned += 1
            log.info("prefill_client_gone", request_id=str(msg.get("request_id"))[:128], ran=False)
            return None
        if not gone:
            return reply
        released = await self._release(reply["request_id"], reply["kv_handle"])
        self._abandoned += 1
        log.info("prefill_client_gone", request_id=reply["request_id"], ran=True, released=released)
        return None

    async def _prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.model.config
        rid = control.request_id(msg)  # before anything is allocated for it
        max_tokens = control.field(msg, "max_tokens", int, lo=1, hi=cfg.max_seq_len - 1)
        prompt = control.int_list(msg, "prompt_ids", max_len=cfg.max_seq_len, lo=0, hi=cfg.vocab_size - 1)
        if len(prompt) + max_tokens > cfg.max_seq_len:  # (said as such: "a list of 1..0 ints" named no cause)
            raise control.ControlError(f"prompt_ids ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                       f"model's max_seq_len ({cfg.max_seq_len})", code="context_length_exceeded")
        try:  # sampled (the front's temperature, top_p, top_k, seed...): else greedy
            sampling = SamplingParams.from_wire(msg["sampling"]) if msg.get("sampling") is not None else None
        except ValueError as exc:
            raise control.ControlError(str(exc), code="invalid_request") from None
        if sampling is not None and self.group is not None:
            raise control.ControlError("sampling needs a CTX without --tp (its group prefills greedily)")
        n = self.layout.blocks_for(len(prompt))
        if n > self.pool.num_blocks:
            raise control.ControlError(f"prompt needs {n} KV blocks, the CTX pool has {self.pool.num_blocks}",
                                       code="context_length_exceeded")
        if self.group is not None and self.group.broken is not None:
            raise control.ControlError(f"CTX unavailable: {self.group.broken}")
        if self.shutting_down or (self.registration is not None and self.registration.refuses_new_work()):
            # stopping, or draining past the fronts' grace: a prefill taken now would extend the stop
            raise control.ControlError("this CTX node is shutting down: send the prefill to another CTX",
                                       code=control.UNAVAILABLE)
        if rid in self._prefilling or rid in self.group_copies or self.store.holds(rid):  # before blocks are taken
            raise control.ControlError(f"duplicate request id {rid!r}: its KV is held here (or being prefilled)")
        self._prefilling.add(rid)
        try:
            return await self._prefill_new(rid, msg, prompt, sampling, n)
        finally:
            self._prefilling.discard(rid)

    async def _prefill_new(self, rid: str, msg: dict[str, Any], prompt: list[int], sampling: SamplingParams | None,
                           n: int) -> dict[str, Any]:
        try:
            block_ids = await self._allocate(n)
        except TimeoutError:
            raise control.ControlError(f"no {n} free KV blocks within {self.args.alloc_wait_s} s") from None
        if self.group is not None:
            return await self._prefill_in_group(rid, prompt, block_ids)
        try:
            t0 = time.perf_counter()
            top = msg.get("logprobs")  # the front asks for the first token's log-probability (and top ones)
            first_lp: list[Any] = []

            def prefill(*a: Any) -> int:
                if sampling is None:
                    return self.model.prefill(*a)
                logits = self.model.prefill_logits(*a)
                token = sample(logits, sampling, position=len(prompt), index=0)
                if isinstance(top, int) and 0 <= top <= 20:
                    first_lp.append(token_logprobs(logits, token, top))
                return token

            sums: list[list[Any]] = [[], []]

            def prefill_and_sum(*a: Any) -> int:
                token = prefill(*a)
                if self.args.kv_checksums:  # here, not on the event loop (it serves pulls meanwhile)
                    sums[:] = [block_checksums(self.pool.kv, block_ids), head_checksums(self.pool.kv, block_ids)]
                return token

            first = await anyio.to_thread.run_sync(prefill_and_sum, prompt, self.pool.kv, block_ids,
                                                   limiter=self._exec)
            checksums, per_head = sums
            epoch = self.store.epoch  # before the put: any revocation of this request comes after
            handle = self.store.put(rid, block_ids, num_tokens=len(prompt), lease_s=self.args.lease_s,
                                    on_release=lambda: self.on_free(block_ids))
        except ValueError as exc:  # duplicate id
            self.pool.free(block_ids)
            raise control.ControlError(str(exc)) from None
        except BaseException:
            self.pool.free(block_ids)
            raise
        self._prefills += 1
        log.debug("prefill_done", request_id=rid, tokens=len(prompt), ms=round((time.perf_counter() - t0) * 1e3, 2))
        return {"ok": True, "request_id": rid, "first_token": first, "prompt_len": len(prompt),
                **({"first_logprobs": first_lp[0]} if first_lp else {}),
                "kv_peer": self.ucx_addr, "kv_handle": handle, "block_checksums": checksums,
                "head_checksums": per_head,
                "kv_sources": [self.source(rid, handle, self.ucx_addr, (0, self.head_range[1]),
                                           [int(b) for b in block_ids.tolist()], epoch)]}

    def source(self, rid: str, handle: str, peer: str, heads: tuple[int, int], blocks: list[int],
               epoch: int) -> dict[str, Any]:
        """One ``kv_sources`` entry of a prefill reply: where a GEN pulls these heads, the block ids
        and store epoch (a NIXL GEN READs them without asking) and their tag (``blocks_tag``: a GEN
        node uses the ids only as this CTX named them)."""
        return {"peer": peer, "head_start": heads[0], "head_end": heads[1], "kv_blocks": blocks, "kv_epoch": epoch,
                "kv_blocks_tag": blocks_tag(self.handle_key, rid, handle, peer, heads, blocks, epoch),
                "kv_transport": backend(self.args), "model": self.model.config.fingerprint}

    async def _prefill_in_group(self, rid: str, prompt: list[int], block_ids: torch.Tensor) -> dict[str, Any]:
        """Every rank prefills its shard and holds its heads under one handle; the reply names them all."""
        handle = self.store.new_handle(rid, len(prompt))  # as a single-rank put would issue it
        t0 = time.perf_counter()
        held = [block_ids]  # the group's prefill takes them (and frees or stores them); else freed here
        try:
            out = await self._in_group(("prefill", rid, prompt, handle, self.args.lease_s, self.args.kv_checksums),
                                       held)
        except control.ControlError:
            if held:  # the group broke before it ran the prefill
                self.pool.free(held.pop())
            raise
        if not out["ok"]:
            raise control.ControlError(out["error"])
        self._prefills += 1
        log.debug("prefill_done", request_id=rid, tokens=len(prompt), ranks=self.args.tp,
                  ms=round((time.perf_counter() - t0) * 1e3, 2))
        return {"ok": True, "request_id": rid, "first_token": out["first_token"], "prompt_len": len(prompt),
                "kv_peer": self.ucx_addr, "kv_handle": handle, "block_checksums": [],
                "head_checksums": out["head_checksums"], "kv_sources": out["kv_sources"]}

    async def run(self) -> None:
        self._call = loop_caller()
        args = self.args
        ucx_port = args.ucx_port + self.rank if args.ucx_port else 0  # rank r listens on --ucx-port + r
        async with kv_server(self.args, self.store, port=ucx_port, lease_s=self.args.lease_s,
                             head_start=self.head_range[0], total_kv_heads=self.model.config.num_kv_heads) as server:
            self.ucx_addr = f"{self.args.advertise or self.args.host}:{server.port}"
            self.kv_server = server
            if self.group is not None:
                await self._run_group()
                return
            await self._serve_control()

    async def _serve_control(self) -> None:
        async with anyio.create_task_group() as tg:
            if self.healer is not None:
                tg.start_soon(self.healer.run, ctx_tp.CtxRank0(self, self.healer))
            assert self.control is not None
            sigterms = Sigterms()
            await tg.start(sigterms.run)  # from before READY: a SIGTERM when READY comes is a graceful stop
            port = await tg.start(self.control.serve, self.args.host, self.args.port)
            metrics = (None if self.args.metrics_port is None else serve_node_metrics(
                "ctx", lambda: ctx_node_stats(self), host=self.args.host, port=self.args.metrics_port))
            announce_ready(role="ctx", ctrl=f"{self.args.host}:{port}", ucx=self.ucx_addr, metrics=metrics,
                           tp=self.args.tp)
            log.info("ctx_ready", ctrl_port=port, ucx=self.ucx_addr, tp=self.args.tp)
            if self.args.etcd:  # register; SIGTERM / control drain: until no KV is held, deregister, stop
                await tg.start(functools.partial(
                    membership.serve_registration, self.args.etcd, prefix=self.args.etcd_prefix, role="ctx",
                    ctrl=f"{self.args.host}:{port}", ttl_s=self.args.etcd_ttl_s, stop=tg.cancel_scope.cancel,
                    busy=self._held_anywhere,
                    meta={"tp": self.args.tp, "ucx": self.ucx_addr, "backend": backend(self.args), "model": "tiny",
                          "capacity_blocks": self.args.num_blocks},
                    on_registration=self._set_registration, sigterms=sigterms))
            else:  # SIGTERM: a graceful stop (no new prefill, held KV may still be pulled), then stop
                tg.start_soon(self._stop_on_sigterm, tg.cancel_scope.cancel, sigterms)

    def busy(self) -> int:
        """Work that a stop would lose: requests whose KV is held here, prefills running or waiting
        (``_prefilling``: also one waiting for KV blocks, or run by a group's execution thread, which
        the executor's counts do not see)."""
        ex = self._exec.statistics()
        return (self.store.statistics().held_requests + len(self._prefilling) + ex.borrowed_tokens
                + ex.tasks_waiting)

    async def _held_anywhere(self) -> int:
        """What a drain (``--etcd``) and a graceful stop wait for: ``busy()`` or, once that is 0, at
        rank 0 of a group, the copies the other ranks hold (the drain counted rank 0's alone). The
        other ranks are asked only then: a stop polls this every 20 ms."""
        return self.busy() or await self._other_ranks_hold()

    async def _other_ranks_hold(self) -> int:
        """Rank 0 of a group: requests whose heads the other ranks still hold. A GEN TP1 pulls each
        rank's heads on its own and frees each copy with its pull: rank 0's copy can be gone while
        another rank's part is still to be pulled (the parts one after the other when the GEN's
        budget does not fit them at once), and rank 0 alone read that as nothing held."""
        if self.group is None or self.group.broken is not None:
            return 0
        try:
            ranks = await self._in_group(("stats",))
        except control.ControlError:  # the group broke: what the other ranks held is gone
            return 0
        return sum(r["store"]["held_requests"] for r in ranks[1:])

    async def _stop_on_sigterm(self, stop: Any, sigterms: Sigterms) -> None:
        """Without etcd, SIGTERM stops the node gracefully: it takes no new prefill (a front sends it
        to another CTX), lets the prefills running finish and the GENs pull (and release) what it
        holds for ``--graceful-shutdown-timeout-s``, then ``stop()`` (what is still held is lost: its
        GEN's pull fails at once). A second SIGTERM exits at once (status 143)."""
        await stop_on_sigterm(self, self._wind_down, stop, lambda: {"busy": self.busy()}, log, sigterms)

    async def _wind_down(self, grace_s: float) -> None:
        """Until nothing is held or running here (on any rank), at most ``grace_s``."""
        with anyio.move_on_after(grace_s):
            while await self._held_anywhere():
                await anyio.sleep(0.02)
        if self.busy():
            log.warning("shutdown_dropping", busy=self.busy(), grace_s=grace_s)

    def start_execution(self) -> threading.Thread:
        """This rank's execution thread for the current group (rank 0 leads it)."""
        group = self.group
        assert group is not None
        self.exec_thread = threading.Thread(target=group.lead if self.rank == 0 else group.follow, name="execution",
                                            daemon=True)
        self.exec_thread.start()
        return self.exec_thread

    async def _run_group(self) -> None:
        """``--tp``: this rank's execution thread runs the group's operations (rank 0 leads)."""
        exec_thread = self.start_execution()
        if self.rank != 0:  # serves pulls of its heads until rank 0 stops the group (or it breaks)
            log.info("ctx_rank_ready", rank=self.rank, ucx=self.ucx_addr, heads=list(self.head_range))
            await anyio.to_thread.run_sync(exec_thread.join, abandon_on_cancel=True)
            return
        try:
            await self._serve_control()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(control.ControlError):
                await self._in_group(("stop",))  # every rank leaves (a broken group: nothing to tell)


def add_args(p: argparse.ArgumentParser) -> None:
    membership.add_args(p)
    p.add_argument("--host", type=cli.local_host, default="127.0.0.1", help="control-plane bind address")
    p.add_argument("--port", type=cli.port, default=0, help="control-plane port (0: pick one)")
    p.add_argument("--ucx-port", type=cli.port, default=0, help="UCX listener port (0: pick one)")
    p.add_argument("--advertise", help="host GEN should use to reach the UCX listener (default: --host)")
    p.add_argument("--num-blocks", type=cli.positive_int, default=4096, help="KV blocks in the CTX pool")
    p.add_argument("--lease-s", type=cli.positive_float, default=30.0,
                   help="free a request's KV if GEN has not pulled it by then")
    p.add_argument("--alloc-wait-s", type=cli.non_negative_float, default=30.0,
                   help="how long a prefill waits for free KV blocks")
    p.add_argument("--metrics-port", type=cli.port, default=None, help="serve Prometheus metrics on this port (0: pick one; default: off)")
    p.add_argument("--graceful-shutdown-timeout-s", type=cli.non_negative_float, default=5.0,
                   help="without --etcd: on SIGTERM, how long GENs may still pull the KV held here and running "
                        "prefills finish (no new prefill is taken) before the node stops; a second SIGTERM exits "
                        "at once. With --etcd, SIGTERM drains instead")
    p.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=True,
                   help="CRC32 of each prefilled KV block in the prefill reply (a parity check; costs CPU per request)")
    ctx_tp.add_args(p)


def main(args: argparse.Namespace) -> int:
    # a drain (--etcd) lasts until no KV is held: a lease, unless a GEN renews it
    # (without etcd, a graceful stop lasts at most --graceful-shutdown-timeout-s)
    return gen_tp.run_node(args, CtxNode, sigterm_wait_s=max(args.lease_s, args.graceful_shutdown_timeout_s) + 10)
