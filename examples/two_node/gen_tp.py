"""A GEN node as a tensor-parallel group: ``python -m examples.two_node gen --tp N``.

    rank 0 (the node the user starts)              ranks 1..N-1 (child processes, same flags)
      picks a free port for the group's store ──spawn──> --tp-rank r --tp-init tcp://127.0.0.1:PORT
      torch.distributed gloo group of N ranks <───────> (each: the model's shard, its KV heads,
      control plane, client streams, outputs             its own engine, event loop, receive
                                                           group, UCX endpoint, execution thread)
    every step: one all-gather (TPGenEngine) on each execution thread, then the model's all-reduces

Rank 0 owns the control connections and the streams back to clients; the other ranks only step.
When rank 0 stops it tells the group (the next step's message); when any rank dies, the others'
next collective fails, they fail their requests and stop (rank 0 stays up, reporting unhealthy).
KV checksums: each rank sums its own heads per block and sends them to rank 0 with its step message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import socket
import subprocess
import sys
from typing import Any

import structlog
import torch

log = structlog.get_logger("examples.gen_tp")

_JOIN_TIMEOUT_S = 120.0  # every rank joining the group (a rank's start imports torch: slow on a busy host)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=1, help="GEN ranks (1, 2, 4; 8 allowed): N processes, one TP group")
    g.add_argument("--tp-timeout-s", type=float, default=10.0,
                   help="a step's collective that a rank does not join within this fails the group "
                        "(a rank that died; far above any step's time)")
    g.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 for its children
    g.add_argument("--tp-init", default=None, help=argparse.SUPPRESS)
    # fault drill (tests): on rank R, every pull of a request whose id starts with PREFIX fails
    g.add_argument("--inject-pull-failure", metavar="RANK:PREFIX", default=None, help=argparse.SUPPRESS)


def check_args(args: argparse.Namespace) -> None:
    """Refuse at start what could not work (not at the first request); a CTX or GEN node's ``--tp``."""
    from examples.tp import TensorParallel, plan_shards
    from examples.two_node.common import model_config

    if args.tp not in (1, 2, 4, 8):
        raise SystemExit(f"error: --tp must be 1, 2, 4 or 8, got {args.tp}")
    try:
        plan_shards(model_config(args), TensorParallel(0, args.tp))
    except ValueError as exc:
        raise SystemExit(f"error: --tp {args.tp} does not fit this model: {exc}") from None


def run_in_group(args: argparse.Namespace, node_main: Any) -> int:
    """Run ``node_main()`` (a node's async main) as this process's rank: alone with ``--tp 1``; with
    ``--tp N`` rank 0 starts and joins the group, the ranks it started join it."""
    import anyio

    check_args(args)
    children: list[subprocess.Popen[bytes]] = []
    if args.tp > 1:
        if args.tp_rank == 0:
            children = start_group(args, args.argv)
            args.tp_pids = [c.pid for c in children]
            args.tp_children = children
        else:
            join_group(args)
    try:
        anyio.run(node_main, backend="asyncio")
    finally:
        stop_children(children)
        leave_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_group(args: argparse.Namespace, argv: list[str]) -> list[subprocess.Popen[bytes]]:
    """Rank 0: start ranks 1..N-1 as children (same flags) and join the group with them.

    Returns the children (rank 0 waits for them when it stops). Blocks until every rank joined."""
    import torch.distributed as dist

    init = f"tcp://127.0.0.1:{_free_port()}"
    children = []
    for rank in range(1, args.tp):
        cmd = [sys.executable, "-m", "examples.two_node", *argv, "--tp-rank", str(rank), "--tp-init", init]
        children.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=args.tp,
                                timeout=datetime.timedelta(seconds=_JOIN_TIMEOUT_S))
        args.tp_group = step_group(args)
    except BaseException:
        stop_children(children)
        raise
    log.info("tp_group_ready", world_size=args.tp, ranks=[0, *(c.pid for c in children)])
    return children


def join_group(args: argparse.Namespace) -> None:
    """Ranks 1..N-1: join the group rank 0 made."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=args.tp_init, rank=args.tp_rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=_JOIN_TIMEOUT_S))
    args.tp_group = step_group(args)


def step_group(args: argparse.Namespace) -> Any:
    """The group every step's collectives run on (the step agreement and the model's all-reduces):
    gloo, with a short timeout so that a dead rank fails the others' next step, not a stuck one."""
    import torch.distributed as dist

    return dist.new_group(list(range(args.tp)), timeout=datetime.timedelta(seconds=args.tp_timeout_s), backend="gloo")


async def watch_children(children: list[subprocess.Popen[bytes]], on_death: Any, period_s: float = 0.5) -> None:
    """Rank 0: report the first rank process that exits (the engine's next step fails anyway, but
    health says so at once)."""
    import anyio

    while True:
        for rank, child in enumerate(children, start=1):
            if child.poll() is not None:
                on_death(f"tensor-parallel rank {rank} (pid {child.pid}) exited with code {child.returncode}")
                return
        await anyio.sleep(period_s)


def stop_children(children: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace_s)
        if child.poll() is None:
            child.kill()
            child.wait(5)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def head_checksums(pool: torch.Tensor, block_ids: torch.Tensor) -> list[list[int]]:
    """CRC32 of each (block, KV head) of a pool: ``[block][head]``, K and V of every layer of that
    head (what a rank of any TP size holds of that head, so ranks and CTX can be compared)."""
    import zlib

    blocks = pool.index_select(0, block_ids.to(pool.device)).cpu()  # [n, layers, 2, heads, bs, d]
    per_head = blocks.permute(0, 3, 1, 2, 4, 5).contiguous().view(torch.uint8)  # [n, heads, ...]
    return [[zlib.crc32(head.numpy().data) for head in block] for block in per_head]


class HeadChecksums:
    """Rank 0's view of every rank's per-head checksums of a request: ``[block][global head]``."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, list[list[int]]]] = {}

    def add(self, request_id: str, head_start: int, crcs: list[list[int]]) -> None:
        self._parts.setdefault(request_id, {})[head_start] = crcs

    def pop(self, request_id: str) -> list[list[int]]:
        parts = self._parts.pop(request_id, {})
        if not parts:
            return []
        out: list[list[int]] = []
        for b in range(len(next(iter(parts.values())))):
            row: list[int] = []
            for h0 in sorted(parts):
                row.extend(parts[h0][b])
            out.append(row)
        return out

    def discard(self, request_id: str) -> None:
        self._parts.pop(request_id, None)


RESET_STATS = "reset_stats"  # rank 0 -> every rank (TPGenEngine.broadcast): clear the loop statistics
REPORT_STATS = "report_stats"  # rank 0 -> every rank, with a sequence number: send the loop statistics now
LOOP_NOTE = "__loop__"  # a note that carries a rank's execution-thread statistics, not a request's


def on_note(sums: HeadChecksums, rank_loops: dict[int, Any]) -> Any:
    """Rank 0: route notes from other ranks (their checksums, their loop statistics)."""
    def note(rank: int, request_id: str, payload: Any) -> None:
        if request_id == LOOP_NOTE:
            rank_loops[rank] = payload
        elif isinstance(payload, dict) and "crcs" in payload:
            sums.add(request_id, int(payload["h0"]), payload["crcs"])
    return note


async def report_loop(engine: Any, loop_stats: Any, period_s: float = 1.0) -> None:
    """Ranks 1..N-1: send this rank's execution-thread statistics to rank 0 every ``period_s``."""
    import anyio

    while True:
        await anyio.sleep(period_s)
        engine.note(LOOP_NOTE, loop_stats())


class FailingPulls:
    """A transport whose pulls of some request ids fail on this rank only (the fault drill of
    ``--inject-pull-failure``); everything else goes to the real transport."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self._inner = inner
        self._prefix = prefix
        self.name = inner.name

    async def pull(self, peer: str, request_id: str, *args: Any, **kwargs: Any) -> int:
        if request_id.startswith(self._prefix):
            from transports import PeerClosed

            raise PeerClosed(f"injected failure of {request_id} on this rank", peer=peer)
        return await self._inner.pull(peer, request_id, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def maybe_failing(transport: Any, args: argparse.Namespace) -> Any:
    if transport is None or not args.inject_pull_failure:
        return transport
    rank, _, prefix = args.inject_pull_failure.partition(":")
    return FailingPulls(transport, prefix) if int(rank) == args.tp_rank else transport
