"""A CTX node as a tensor-parallel group: ``python -m examples.two_node ctx --tp M``.

    rank 0 (the node the user starts)             ranks 1..M-1 (child processes, same flags)
      control plane, READY line                     no control plane
      every rank: the model's shard, a KV pool of its KV heads only, a KVStore, its own UCX listener
      (lease expiry, pulls and releases served per rank, independently)

    Every operation that needs the whole group runs on each rank's execution thread, in lockstep,
    led by rank 0:   rank 0 broadcasts (op) ─> every rank runs it ─> results all-gathered to rank 0
      prefill:  every rank allocates its blocks (all-gather: did everyone get them?), prefills its
                shard (the model's all-reduces), stores its heads under ONE handle rank 0 chose, and
                reports its UCX address, its head range and its per-head checksums
      release:  every rank frees its copy (the control plane's release, with the handle)
      stats:    every rank's store and pool figures
      noop:     a heartbeat once a second while idle, so that an idle group's collectives never time
                out and a dead rank is noticed within --tp-timeout-s
      stop:     rank 0 is stopping: every rank leaves

GEN then pulls each of its KV heads straight from the CTX rank that holds it (``kv_sources`` in the
prefill reply; fan-in when a GEN rank's heads span several CTX ranks) and releases each CTX rank
once. When a rank dies or stops answering past --tp-step-timeout-s, rank 0 heals the group
(``tp_group.Healer``, ``CtxRank0`` below): prefills are refused with one readable cause, the old
ranks are killed, rank 0 frees its copies of the old group's prefills, and a new group serves on
the same control port; the other ranks' next collective fails and they exit. Ranks that disagree on a
prefill's first token fail that prefill only.
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from examples.two_node import tp_group
from examples.two_node.gen_tp import head_checksums

log = structlog.get_logger("examples.ctx_tp")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=1,
                   help="CTX ranks (1, 2, 4; 8 allowed): M processes, one TP group, each holding its KV heads "
                        "and serving them on its own UCX listener (--ucx-port P: rank r listens on P + r)")
    tp_group.add_timeout_args(g)
    g.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 for its children
    g.add_argument("--tp-init", default=None, help=argparse.SUPPRESS)
    # fault drill (tests): on rank R, the first token of every prefill whose id starts with PREFIX is off by one
    g.add_argument("--inject-first-token", metavar="RANK:PREFIX", default=None, help=argparse.SUPPRESS)


@dataclasses.dataclass
class _Job:
    op: tuple[Any, ...]
    local: Any
    done: Callable[[Any], None]


class GroupBroken(RuntimeError):
    pass


class CtxGroup:
    """One rank's side of the group's lockstep operations (see the module docstring)."""

    def __init__(self, node: Any, group: Any, rank: int, world_size: int,
                 watch: tp_group.RankWatch | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.node = node
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._freed = threading.Condition()
        self._watch = watch  # rank 0: times its collectives and names the cause when the group breaks
        self._heartbeat_s = tp_group.idle_period_s(node.args)  # rank 0, idle: a no-op collective this often
        self.collectives = 0  # rank 0: collectives every rank took part in (the first: every rank serves)
        rank_, _, prefix = (node.args.inject_first_token or "").partition(":")
        self._skew_prefix = prefix if rank_ and int(rank_) == rank else None

    # -- rank 0, any thread ------------------------------------------------------------------------
    def submit(self, op: tuple[Any, ...], local: Any, done: Callable[[Any], None]) -> None:
        """Run ``op`` on every rank; ``done(result)`` gets the merged result or the exception."""
        with self._lock:
            if self.broken is not None or self._stopped:
                done(GroupBroken(self.broken or "the CTX group is stopping"))
                return
            self._jobs.put(_Job(op, local, done))

    def mark_broken(self, why: str) -> None:
        """Any thread: the group cannot serve any more (a rank process exited)."""
        self._break(why)

    def notify_freed(self) -> None:
        """Any thread: blocks were freed on this rank (wakes an allocation waiting for them)."""
        with self._freed:
            self._freed.notify_all()

    # -- execution thread --------------------------------------------------------------------------
    def lead(self) -> None:
        """Rank 0's execution thread: run queued operations (a heartbeat when idle) until stop."""
        while True:
            try:
                job = self._jobs.get(timeout=self._heartbeat_s)
            except queue.Empty:
                job = _Job(("noop",), None, lambda _: None)
            try:
                result = self._lead_one(job)
                self.collectives += 1
            except Exception as exc:  # a rank died or the group broke: no further collective
                self._break(str(exc) if isinstance(exc, tp_group.GroupBroken) else f"{type(exc).__name__}: {exc}")
                job.done(GroupBroken(self.broken))
                self._fail_queued()
                return
            job.done(result)
            if job.op[0] == "stop":
                self._fail_queued()
                return

    def _lead_one(self, job: _Job) -> Any:
        def both() -> Any:
            self._dist.broadcast_object_list([job.op], src=0, group=self.group)
            return self.run(job.op, job.local)

        return self._watch.collective(both) if self._watch is not None else both()

    def follow(self) -> None:
        """Ranks 1..M-1: run what rank 0 broadcasts until it says stop or the group breaks."""
        while True:
            box: list[Any] = [None]
            try:
                self._dist.broadcast_object_list(box, src=0, group=self.group)
                op = box[0]
                self.run(op, None)
            except Exception as exc:
                self._break(f"{type(exc).__name__}: {exc}")
                return
            if op[0] == "stop":
                return

    def _break(self, why: str) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = f"tensor-parallel CTX group broken at rank {self.rank}: {why}"
                log.error("ctx_tp_group_broken", rank=self.rank, reason=why)

    def _fail_queued(self) -> None:
        with self._lock:
            self._stopped = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job.done(GroupBroken(self.broken or "the CTX group stopped"))

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self.group)
        return out

    # -- the operations (every rank, same order) --------------------------------------------------
    def run(self, op: tuple[Any, ...], local: Any) -> Any:
        kind = op[0]
        if kind == "prefill":
            return self._prefill(*op[1:], local_blocks=local.pop() if local else None)  # ownership taken
        if kind == "release":
            rid, handle = op[1:]
            return any(self._gather(self.node.store.release(rid, handle=handle)))
        if kind == "stats":
            return self._gather(self.node.rank_stats())
        if kind in ("noop", "stop"):
            return None
        raise ValueError(f"unknown CTX group operation {kind!r}")

    def _allocate_blocking(self, n: int, wait_s: float) -> torch.Tensor | None:
        from orchestrator import KVExhausted

        deadline = time.monotonic() + wait_s
        with self._freed:
            while True:
                try:
                    return self.node.pool.allocate(n)
                except KVExhausted:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._freed.wait(left)

    def _prefill(self, rid: str, prompt: list[int], handle: str, lease_s: float, checksums: bool, *,
                 local_blocks: torch.Tensor | None) -> dict[str, Any]:
        node = self.node
        n = node.layout.blocks_for(len(prompt))
        # 1. every rank's blocks (rank 0 waited for its own before it submitted; the others' frees
        #    follow GEN's releases closely, so their wait is short and bounded below the group timeout)
        blocks = local_blocks if local_blocks is not None else \
            self._allocate_blocking(n, min(node.args.alloc_wait_s, node.args.tp_step_timeout_s / 2))
        try:  # this rank's blocks are this call's until the store holds them: freed on any failure
            got = self._gather(blocks is not None)
        except BaseException:
            if blocks is not None:
                node.pool.free(blocks)
            raise
        if not all(got):
            if blocks is not None:
                node.pool.free(blocks)
            missing = [r for r, ok in enumerate(got) if not ok]
            return {"ok": False, "error": f"CTX ranks {missing} have no {n} free KV blocks"}
        assert blocks is not None
        # 2. prefill the shard (collectives inside), hold this rank's heads under the group's handle
        try:
            first = node.model.prefill(prompt, node.pool.kv, blocks)
            if self._skew_prefix is not None and rid.startswith(self._skew_prefix):
                first = (first + 1) % node.model.config.vocab_size  # the fault drill: this rank disagrees
            crcs = head_checksums(node.pool.kv, blocks) if checksums else []
        except BaseException:
            node.pool.free(blocks)
            raise
        stored, error = True, None
        epoch = node.store.epoch  # before the put: any revocation of this request comes after
        try:
            node.store.put(rid, blocks, num_tokens=len(prompt), lease_s=lease_s, handle=handle,
                           on_release=lambda: node.on_free(blocks, rid, handle))
            node.group_copies[rid] = handle
        except ValueError as exc:  # a duplicate id
            node.pool.free(blocks)
            stored, error = False, str(exc)
        h0, h1 = node.head_range
        try:
            parts = self._gather({"ok": stored, "error": error, "peer": node.ucx_addr, "head_start": h0,
                                  "head_end": h1, "crcs": crcs, "first": first,
                                  "blocks": [int(b) for b in blocks.tolist()], "epoch": epoch})
        except BaseException:  # the group broke: the stored copy goes (its blocks with it, once)
            if stored:
                node.store.release(rid, handle=handle)
            raise
        firsts = [p["first"] for p in parts]
        if not all(p["ok"] for p in parts) or len(set(firsts)) != 1:  # every rank sees the same parts
            if stored:
                node.store.release(rid, handle=handle)
            if len(set(firsts)) != 1:  # cannot happen with an exact model: this prefill fails, the group serves on
                log.error("ctx_tp_first_token_disagreement", request_id=rid, first_tokens=firsts)
                return {"ok": False, "error": f"CTX ranks disagree on the first token of {rid}: {firsts} "
                                              "(rank r at index r); the prefill is refused"}
            return {"ok": False, "error": next(p["error"] for p in parts if not p["ok"])}
        return {"ok": True, "first_token": first, "kv_sources": [
            node.source(rid, handle, p["peer"], (p["head_start"], p["head_end"]), p["blocks"], p["epoch"])
            for p in parts],
            "head_checksums": merge_head_checksums(parts) if checksums else []}


def merge_head_checksums(parts: list[dict[str, Any]]) -> list[list[int]]:
    """``[block][model head]`` from every rank's ``[block][its heads]`` (a replicated head once)."""
    by_head: dict[int, list[int]] = {}
    for p in parts:
        for i, head in enumerate(range(p["head_start"], p["head_end"])):
            if head not in by_head and p["crcs"]:
                by_head[head] = [row[i] for row in p["crcs"]]
    if not by_head:
        return []
    heads = sorted(by_head)
    return [[by_head[h][b] for h in heads] for b in range(len(by_head[heads[0]]))]


class CtxRank0:
    """Rank 0 of a CTX group, as its ``tp_group.Healer`` sees it (``tp_group.GroupNode``)."""

    def __init__(self, node: Any, healer: tp_group.Healer) -> None:
        self.node = node
        self.healer = healer

    def broken(self) -> str | None:
        return self.node.group.broken

    async def fail(self, cause: str) -> None:
        self.node.group.mark_broken(cause)  # prefills are refused with it from now on

    async def stop(self) -> None:
        """The old group's execution thread ends (its collectives failed when the ranks were killed);
        rank 0 frees its copies of the old group's prefills: the other heads died with their ranks,
        and a GEN pull of them fails at once (a refused or reset connection), never at its timeout."""
        import anyio

        node = self.node
        thread = node.exec_thread
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join, 10.0)
        for rid, handle in list(node.group_copies.items()):
            node.store.release(rid, handle=handle)
        node.group_copies.clear()

    def serving(self) -> bool:
        """Every rank took part in a collective: each listens for pulls (it does before it follows)."""
        return self.node.group.collectives > 0

    async def start(self, group: tp_group.Group) -> None:
        from examples.two_node import gen_tp
        from examples.two_node.common import build_model

        node = self.node
        gen_tp.use_group(node.args, group)
        node.model = build_model(node.args)
        node.group = CtxGroup(node, group.step_group, 0, group.size, self.healer.watch)
        node.start_execution()

