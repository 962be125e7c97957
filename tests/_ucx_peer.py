"""A CTX peer in its own process for the UCX tests: ``python -m tests._ucx_peer [options]``.

It fills a deterministic KV pool (``make_pool``), holds ``--requests`` requests ``req-0 ...``
(``--blocks`` blocks each, ids from ``block_ids``) in a ``KVStore`` and serves them with a
``UCXKVServer``. Once listening it prints one JSON line ``{"port": ..., "pid": ...}``. Then it
answers stdin commands, one JSON line each: ``stats`` (store statistics and held ids),
``put <id>`` (hold one more request). The secret comes from ``KVO_SHARED_SECRET``; ``--insecure``
serves without one. ``--gather-delay S`` makes every gather sleep S seconds (to kill it mid-pull),
``--send-delay S`` sleeps before it sends (to cancel a pull whose receive is posted). ``--runs`` holds
each request in one ascending run of blocks, which the UCX server sends from a zero-copy view of its
pool in its read loop (the scattered default takes its gather path).
``--corrupt short|short1|short7|short-told|whole-foreign|long|foreign|long-reply|garbage-reply``
(UCX only) answers pulls of
``req-1`` with half the KV, the KV less its last byte or its last 7, the KV less its last byte and
a PULL_WHOLE that names that length (its probe forced into the byte it ends in) or the whole
length but another pull, the KV and 64 more bytes, or no KV (the empty message) and a PULL_ERR
that names another pull, a reply longer than a frame or a frame of garbage: a CTX bug that GEN must catch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from transports import KVLayout, KVSlice, KVStore

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float16)


def handle_for(request_id: str) -> str:
    """The KV handle this test peer issues for ``request_id`` (deterministic, so tests can present it)."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def make_pool(layout: KVLayout, num_blocks: int, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *layout.block_shape), generator=g, dtype=torch.float32).to(layout.dtype)


def block_ids(index: int, blocks: int, total: int, *, runs: bool = False) -> torch.Tensor:
    """Request ``index``'s blocks: a scattered, reversed run so that gather order matters; with
    ``runs``, one ascending run (what the CTX sends as a zero-copy view of its pool, in its read loop)."""
    if runs:
        return torch.arange(index * blocks, (index + 1) * blocks)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(99))
    return perm[index * blocks : (index + 1) * blocks].flip(0)


class _SlowStore(KVStore):
    delay_s = 0.0
    gathering = 0  # gathers running now, and the most at once (``max_gathers`` in ``stats``)
    max_gathering = 0

    def _gather_held(self, held: object, kv_slice: KVSlice) -> torch.Tensor:
        with self._lock:
            self.gathering += 1
            self.max_gathering = max(self.max_gathering, self.gathering)
        try:
            time.sleep(self.delay_s)  # runs in a worker thread (to_thread), not on the event loop
            return super()._gather_held(held, kv_slice)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self.gathering -= 1


async def _main(args: argparse.Namespace) -> None:
    import anyio

    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXKVServer

    total = args.requests * args.blocks + 8
    pool = make_pool(LAYOUT, total)
    store = _SlowStore(LAYOUT, pool)
    store.delay_s = args.gather_delay
    for i in range(args.requests):
        store.put(f"req-{i}", block_ids(i, args.blocks, total, runs=args.runs), num_tokens=args.blocks * LAYOUT.block_size,
                  lease_s=args.lease, handle=handle_for(f"req-{i}"))
    secret = None if args.insecure else load_secret()
    config = UCXConfig(secret=secret, allow_insecure=args.insecure, expire_interval_s=0.2,
                       max_pulls_per_endpoint=args.max_pulls, max_unauthenticated=args.max_unauthenticated,
                       max_gathers_per_request=args.max_gathers,
                       handshake_timeout_s=args.handshake_timeout, send_timeout_s=args.send_timeout)

    class Slowed(UCXKVServer):  # only when asked: otherwise the server as it ships (zero-copy pulls in its read loop)
        async def _before_send(self, msg: object) -> None:
            if args.send_delay:
                await anyio.sleep(args.send_delay)

        async def _send_quietly(self, ep, msg, tag):  # type: ignore[no-untyped-def]
            from transports import wire

            if not (args.ignore_releases and isinstance(msg, wire.ReleaseOk)):  # (a CTX bug: no answer)
                await super()._send_quietly(ep, msg, tag)

        async def _send_checked_out(self, ep, msg, staged):  # type: ignore[no-untyped-def]
            if not args.corrupt or msg.request_id != "req-1":
                return await super()._send_checked_out(ep, msg, staged)
            import asyncio

            from transports import wire
            from transports._ucx_common import _ucx_buffer, post_send

            flat = staged.reshape(-1)
            if args.corrupt in ("long-reply", "garbage-reply"):  # no KV, and a reply longer than a frame, or garbage
                junk = bytearray(2 * wire.FRAME_BYTES) if args.corrupt == "long-reply" else bytearray(b"\xab" * wire.FRAME_BYTES)
                reply = post_send(ep, junk, 2 * msg.txid)
                await asyncio.shield(reply.future)
                sent = flat[:0]
            elif args.corrupt == "foreign":  # no KV, and a PULL_ERR that names another pull
                err = wire.encode_frame(wire.PullErr(msg.txid + 1000, wire.Status.INTERNAL, "not yours"))
                reply = post_send(ep, err, 2 * msg.txid)
                await asyncio.shield(reply.future)
                sent = flat[:0]
            elif args.corrupt == "short":
                sent = flat[: flat.numel() // 2].clone()
            elif args.corrupt in ("short1", "short7", "short-told", "whole-foreign"):  # bytes: 1 or 7 short
                sent = flat.view(torch.uint8)[: -7 if args.corrupt == "short7" else -1].clone()
                if args.corrupt in ("short-told", "whole-foreign"):  # it ends in the probe; a PULL_WHOLE
                    sent[-1] = msg.probe
                    told = wire.encode_frame(wire.PullWhole(msg.txid, sent.numel()) if args.corrupt == "short-told"
                                             else wire.PullWhole(msg.txid + 1000, msg.nbytes))
                    reply = post_send(ep, told, 2 * msg.txid)
                    await asyncio.shield(reply.future)
            else:
                sent = torch.cat([flat, torch.zeros(32, dtype=flat.dtype)])
            buf = _ucx_buffer(sent)
            data = post_send(ep, buf, msg.tag)
            await asyncio.shield(data.future)

    Server = Slowed if args.send_delay or args.corrupt or args.ignore_releases else UCXKVServer

    if args.backend == "nixl":  # the same store behind a NIXL server; both delays hold up the lookup
        from transports.nixl import NIXLConfig, NIXLKVServer

        config = NIXLConfig(secret=secret, allow_insecure=args.insecure, max_pulls_per_connection=args.max_pulls,
                            handshake_timeout_s=args.handshake_timeout)

        class Server(NIXLKVServer):  # type: ignore[no-redef]
            async def _before_send(self, msg: object) -> None:
                if args.send_delay or args.gather_delay:
                    await anyio.sleep(args.send_delay + args.gather_delay)

            def statistics(self):  # type: ignore[override]  (the UCX server's names, for the tests)
                s = super().statistics()
                return argparse.Namespace(connections=s.connections, pulls_served=s.served, pulls_refused=s.refused,
                                          auth_failures=s.auth_failures, malformed_frames=0, pinned=s.pinned)

    async with Server(store, config, port=args.port, lease_s=args.lease,
                      **({"host": "127.0.0.1", "expire_interval_s": 0.2} if args.backend == "nixl" else {})) as server:
        print(json.dumps({"port": server.port, "pid": __import__("os").getpid()}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                break
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "stats":
                s = store.statistics()
                held = sorted(store._held)  # test helper: peek at the ids still held
                out = {"held": held, "released": s.released, "expired": s.expired, "max_gathers": store.max_gathering,
                       "open_pins": s.open_pins,
                       **vars(server.statistics())}
            elif cmd == "put":
                store.put(arg, block_ids(0, args.blocks, total, runs=args.runs), num_tokens=16, lease_s=args.lease, handle=handle_for(arg))
                out = {"ok": True}
            else:
                out = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--lease", type=float, default=600.0)
    p.add_argument("--gather-delay", type=float, default=0.0)
    p.add_argument("--send-delay", type=float, default=0.0, help="sleep after accepting a PULL, before sending the KV")
    p.add_argument("--max-pulls", type=int, default=256)
    p.add_argument("--max-unauthenticated", type=int, default=64)
    p.add_argument("--max-gathers", type=int, default=4)
    p.add_argument("--handshake-timeout", type=float, default=5.0)
    p.add_argument("--send-timeout", type=float, default=120.0, help="UCXConfig.send_timeout_s")
    p.add_argument("--ignore-releases", action="store_true", help="never answer a RELEASE (it still frees)")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--corrupt", choices=["short", "short1", "short7", "short-told", "whole-foreign", "long", "foreign",
                                         "long-reply", "garbage-reply"], default=None)
    p.add_argument("--runs", action="store_true", help="hold each request in one ascending run of blocks (zero-copy sends)")
    p.add_argument("--backend", choices=["ucx", "nixl"], default="ucx", help="serve with UCXKVServer or NIXLKVServer")
    args = p.parse_args(argv)
    import anyio
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),  # stdout is for replies
                        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()])

    anyio.run(_main, args, backend="asyncio")
    return 0




async def _client(args: argparse.Namespace) -> None:
    """``python -m tests._ucx_peer client --peer HOST:PORT --request req-0``: one pull, one JSON line."""
    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXTransport

    total = args.requests * args.blocks + 8
    expected = make_pool(LAYOUT, total)[block_ids(args.index, args.blocks, total)]
    into = torch.empty(LAYOUT.wire_shape(args.blocks), dtype=LAYOUT.dtype)
    async with UCXTransport(UCXConfig(secret=load_secret(), connect_timeout_s=args.timeout)) as t:
        try:
            rid = f"req-{args.index}"
            n = await t.pull(args.peer, rid, LAYOUT.full_slice(), into, handle=handle_for(rid))
            out = {"ok": True, "bytes": n, "equal": bool(torch.equal(into, expected))}
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    import anyio
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    anyio.run(_client, args, backend="asyncio")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(main())
