"""A GEN node as a tensor-parallel group: ``python -m examples.two_node gen --tp N``.

    rank 0 (the node the user starts)              ranks 1..N-1 (child processes, same flags)
      forms the group (tp_group.form) ─────spawn──> --tp-rank r --tp-init tcp://127.0.0.1:PORT --tp-notes ADDR
      step group (gloo) + model group  <─────────> (each: the model's shard, its KV heads, its own
      control plane, client streams, outputs          engine, event loop, receive group, UCX
      notes server  <───────── TCP, off the ────────  endpoint, execution thread; a notes client)
                               execution thread
    every step: the step exchange (TPGenEngine) on each execution thread, then the model's all-reduces

Rank 0 owns the control connections and the streams back to clients; the other ranks only step.
When rank 0 stops it tells the group (the next step); when the group breaks (a rank dies or stops
answering past --tp-step-timeout-s) rank 0 heals it (tp_group.Healer, ``GenRank0`` below): every
client fails with one readable cause, every CTX is told to free what rank 0's requests held, the old
ranks are killed and a new group serves on the same control port.

Notes (what ranks 1..N-1 tell rank 0; never on the step exchange): per-head KV checksums of each
received request (only with --kv-checksums), computed on a worker thread from a snapshot of the
request's blocks, and the rank's execution-thread statistics (every second, and when rank 0 asks).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hmac
import json
import os
import secrets
import socket
import zlib
from collections.abc import Callable
from typing import Any

import structlog
import torch

from examples.two_node import tp_group

log = structlog.get_logger("examples.gen_tp")

NOTES_TOKEN_ENV = "KVO_TP_NOTES_TOKEN"  # rank 0 -> its children: the notes channel's token (not on argv)
_NOTE_LINE_MAX = 1 << 22


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=1, help="GEN ranks (1, 2, 4; 8 allowed): N processes, one TP group")
    tp_group.add_timeout_args(g)
    g.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 for its children
    g.add_argument("--tp-init", default=None, help=argparse.SUPPRESS)
    g.add_argument("--tp-notes", default=None, help=argparse.SUPPRESS)  # rank 0's notes server, for its children
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
    if args.tp_step_timeout_s <= 0 or tp_group.model_timeout_s(args) < args.tp_step_timeout_s:
        raise SystemExit("error: --tp-step-timeout-s must be > 0 and --tp-model-timeout-s at least as long")
    if not args.tp_reform_backoff_max_s >= 1.0 or args.tp_reform_attempts < 0:
        raise SystemExit("error: --tp-reform-backoff-max-s must be >= 1 and --tp-reform-attempts >= 0")


def run_node(args: Any, make_node: Callable[[Any], Any], **kw: Any) -> int:
    """``run_in_group`` of ``make_node(args).run()``, with the node's own ``exit_status`` when it set
    one (143: a second SIGTERM cut its graceful stop short; raised as SystemExit in a task, it left
    the event loop at once and asyncio logged a 40-line traceback at shutdown)."""
    nodes: list[Any] = []

    def run() -> Any:
        nodes.append(make_node(args))
        return nodes[-1].run()

    status = run_in_group(args, run, **kw)
    return nodes[0].exit_status if nodes and nodes[0].exit_status else status


def run_in_group(args: argparse.Namespace, node_main: Any, *, notes: bool = False,
                 sigterm_wait_s: float = 10.0) -> int:
    """Run ``node_main()`` (a node's async main) as this process's rank: alone with ``--tp 1``; with
    ``--tp N`` rank 0 forms the first generation of the group (its Healer forms the next ones), the
    ranks it started join it. ``notes``: rank 0 listens for its ranks' notes (a GEN).
    ``sigterm_wait_s``: how long a rank other than 0 waits, after a SIGTERM, for rank 0 to stop
    the group (``tp_group.wait_for_rank0_on_sigterm``)."""
    import anyio

    check_args(args)
    args.tp_state = None
    if args.tp > 1:
        if args.tp_rank != 0:
            tp_group.wait_for_rank0_on_sigterm(sigterm_wait_s)
        if args.tp_rank == 0:
            extra_env, extra_argv = {}, []
            if notes:
                args.tp_notes_server = NotesServer()
                extra_env = {NOTES_TOKEN_ENV: args.tp_notes_server.token}
                extra_argv = ["--tp-notes", args.tp_notes_server.address]
            args.tp_extra = (extra_env, extra_argv)
            try:
                group = tp_group.form(args, args.argv, extra_env=extra_env, extra_argv=extra_argv)
            except Exception as exc:  # a rank that could not start or join: one line, exit 1 (not a traceback)
                raise tp_group.GaveUp(f"could not form its tensor-parallel group at start: {exc}") from exc
        else:
            group = tp_group.join(args)
        use_group(args, group)
    try:
        anyio.run(node_main, backend="asyncio")
    finally:
        if args.tp_state is not None:
            tp_group.stop_ranks(args.tp_state.children)
        tp_group.leave()
    return 0


def use_group(args: argparse.Namespace, group: tp_group.Group) -> None:
    """Make ``group`` the one the node builds its model and step sync on."""
    args.tp_state = group
    args.tp_group = group.model_group  # the model's all-reduces (common.build_model)
    args.tp_step_group = group.step_group
    args.tp_pids = group.pids


def blocking_wait_bound(args: argparse.Namespace) -> dict[str, float]:
    """``OrchestratorConfig(max_blocking_wait_s=...)`` for a rank of a group: half the step timeout,
    so no wait on one rank (an inline connect, a reservation) outlasts its peers' step exchange."""
    return {} if args.tp == 1 else {"max_blocking_wait_s": args.tp_step_timeout_s / 2}


def step_sync(group: Any, watch: tp_group.RankWatch | None) -> Any:
    """The engine's step exchange on ``group``; on rank 0 a failure reads as the watch's cause."""
    from orchestrator import TorchStepSync

    return TorchStepSync(group, describe_failure=watch.cause if watch is not None else None)


def watched_step(step_fn: Callable[[Any], Any], watch: tp_group.RankWatch | None) -> Callable[[Any], Any]:
    """Rank 0's model step: its collectives timed by the watch; a broken group's failure reads as its cause."""
    if watch is None:
        return step_fn
    return lambda batch: watch.collective(lambda: step_fn(batch))


# -- notes: ranks 1..N-1 -> rank 0, off the execution thread -------------------------------------------

class NotesServer:
    """Rank 0: one TCP connection per rank (127.0.0.1), newline-delimited JSON after a token line.

    ``{"rid": ..., "h0": ..., "crcs": [[...]]}`` -> ``on_checksums(rid, h0, crcs)``;
    ``{"loop": {...}}`` -> ``on_loop(rank, stats)``. Bound before the first group forms, so its
    address can go to the ranks on their command line; the token goes in their environment."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.token = secrets.token_hex(16)
        self.on_checksums: Callable[[str, int, list[list[int]]], None] = lambda rid, h0, crcs: None
        self.on_loop: Callable[[int, dict[str, Any]], None] = lambda rank, stats: None

    async def serve(self) -> None:
        from anyio.abc import SocketListener

        listener = await SocketListener.from_socket(self.sock)
        await listener.serve(self._handle)

    async def _handle(self, stream: Any) -> None:
        import anyio
        from anyio.streams.buffered import BufferedByteReceiveStream

        reader = BufferedByteReceiveStream(stream)
        async with stream:
            try:
                with anyio.fail_after(10):
                    hello = json.loads(await reader.receive_until(b"\n", 1024))
                if not hmac.compare_digest(str(hello.get("token", "")), self.token):
                    log.warning("tp_notes_refused")
                    return
                rank = int(hello["rank"])
                while True:
                    note = json.loads(await reader.receive_until(b"\n", _NOTE_LINE_MAX))
                    if "loop" in note:
                        self.on_loop(rank, note["loop"])
                    else:
                        self.on_checksums(str(note["rid"]), int(note["h0"]), note["crcs"])
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    anyio.DelimiterNotFound, TimeoutError, ValueError, KeyError, TypeError, OSError):
                return  # the rank is gone (or spoke nonsense): its notes end here


class NotesClient:
    """Ranks 1..N-1: what this rank tells rank 0, sent by the event loop (``send_soon``: loop only)."""

    def __init__(self, address: str, rank: int) -> None:
        import anyio

        self._address = address
        self._rank = rank
        self._send, self._receive = anyio.create_memory_object_stream[dict[str, Any]](float("inf"))

    def send_soon(self, note: dict[str, Any]) -> None:
        self._send.send_nowait(note)

    async def run(self) -> None:
        import anyio

        host, _, port = self._address.rpartition(":")
        stream = await anyio.connect_tcp(host, int(port))
        async with stream:
            await stream.send(json.dumps({"token": os.environ.get(NOTES_TOKEN_ENV, ""), "rank": self._rank}).encode() + b"\n")
            async for note in self._receive:
                await stream.send(json.dumps(note, separators=(",", ":")).encode() + b"\n")


class ChecksumWorker:
    """Per-head (and, at TP1, whole-block) CRC32 of a received request's KV, off the event loop: the
    event loop only snapshots the request's blocks (one gather; asynchronous on a GPU); the copy to
    the host and the CRCs run on this worker thread, then ``done(rid, h0, per_head, whole)`` runs on
    the event loop (through ``call``)."""

    def __init__(self, call: Callable[[Callable[[], None]], None], whole_blocks: bool) -> None:
        self._call = call
        self._whole = whole_blocks
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-checksums")

    def submit(self, rid: str, h0: int, pool: torch.Tensor, block_ids: torch.Tensor,
               done: Callable[[str, int, list[list[int]], list[int]], None]) -> None:
        snapshot = pool.index_select(0, block_ids.to(pool.device))  # before decode writes into the blocks

        def work() -> None:
            host = snapshot.cpu()
            per_head = head_checksums_of(host)
            whole = [zlib.crc32(b.numpy().data) for b in host.contiguous().view(torch.uint8)] if self._whole else []
            self._call(lambda: done(rid, h0, per_head, whole))

        self._pool.submit(work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def expected_head_starts(args: argparse.Namespace) -> frozenset[int]:
    """The first KV head of every rank of the group: whose checksums make a request's set complete."""
    from examples.tp import TensorParallel, plan_shards
    from examples.two_node.common import model_config

    cfg = model_config(args)
    return frozenset(plan_shards(cfg, TensorParallel(r, args.tp)).kv_heads.start for r in range(args.tp))


def head_checksums(pool: torch.Tensor, block_ids: torch.Tensor) -> list[list[int]]:
    """CRC32 of each (block, KV head) of a pool: ``[block][head]``, K and V of every layer of that
    head (what a rank of any TP size holds of that head, so ranks and CTX can be compared)."""
    return head_checksums_of(pool.index_select(0, block_ids.to(pool.device)).cpu())


def head_checksums_of(blocks: torch.Tensor) -> list[list[int]]:
    """``head_checksums`` of gathered host blocks ``[n, layers, 2, heads, bs, d]``."""
    per_head = blocks.permute(0, 3, 1, 2, 4, 5).contiguous().view(torch.uint8)  # [n, heads, ...]
    return [[zlib.crc32(head.numpy().data) for head in block] for block in per_head]


class HeadChecksums:
    """Rank 0's view of every rank's per-head checksums of a request: ``[block][global head]``."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, list[list[int]]]] = {}

    def add(self, request_id: str, head_start: int, crcs: list[list[int]]) -> None:
        self._parts.setdefault(request_id, {})[head_start] = crcs

    def has(self, request_id: str, head_starts: frozenset[int]) -> bool:
        """Whether the checksums of every rank in ``head_starts`` arrived for ``request_id``."""
        return head_starts <= self._parts.get(request_id, {}).keys()

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

    def __len__(self) -> int:
        return len(self._parts)


RESET_STATS = "reset_stats"  # rank 0 -> every rank (TPGenEngine.broadcast): clear the loop statistics
REPORT_STATS = "report_stats"  # rank 0 -> every rank, with a sequence number: send the loop statistics now


async def report_loop(notes: NotesClient, loop_stats: Any, period_s: float = 1.0) -> None:
    """Ranks 1..N-1: send this rank's execution-thread statistics to rank 0 every ``period_s``."""
    import anyio

    while True:
        await anyio.sleep(period_s)
        notes.send_soon({"loop": loop_stats()})


class GenRank0:
    """Rank 0 of a GEN group, as its ``tp_group.Healer`` sees it (``tp_group.GroupNode``)."""

    def __init__(self, node: Any, transport: Any) -> None:
        self.node = node
        self.transport = transport

    def broken(self) -> str | None:
        engine = self.node.engine
        if engine is None or self.node.ending:  # the node stops its group itself: not a break to heal
            return None
        return engine.health()

    async def fail(self, cause: str) -> None:
        """Every client fails with ``cause`` (the engine, once its execution thread leaves the
        collective the kill just broke), and every CTX is told at once to free what this node's
        live requests hold there (never a lease wait)."""
        import anyio

        node = self.node
        node.engine.mark_unhealthy(cause)
        node.engine.wakeup.set()
        held = list(node.kv_held.items())
        if self.transport is not None and held:
            with anyio.move_on_after(2.0):
                async with anyio.create_task_group() as tg:
                    for rid, (peers, handle) in held:
                        for peer in peers:
                            tg.start_soon(self._release, peer, rid, handle)
        with anyio.move_on_after(2.0):  # the engine fails them as soon as its thread is free
            while node.streams_open():
                await anyio.sleep(0.01)

    async def _release(self, peer: str, rid: str, handle: str | None) -> None:
        with contextlib.suppress(Exception):  # best effort: a CTX that is gone frees on its own
            await self.transport.release(peer, rid, handle=handle)

    async def stop(self) -> None:
        await self.node.end_generation()

    async def start(self, group: tp_group.Group) -> None:
        use_group(self.node.args, group)
        await self.node.start_generation()

    def serving(self) -> bool:
        """Every rank took part in an agreed step of this generation's engine."""
        engine = self.node.engine
        return engine is not None and engine.agreed_steps > 0


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
