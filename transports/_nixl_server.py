"""CTX side of the NIXL data plane (``transports.nixl``): registers the KV pool once, authenticates
GEN nodes on a TCP control port (at most ``max_unauthenticated`` in their handshake), answers
lookups by pinning a request's blocks, and unpins (and releases) when the READ's NIXL notification
arrives, when GEN unpins (a READ that failed or never started), or when the pin's lease
(``pin_timeout_s``) ends without a renewal: GEN renews the pins it may still READ from (DESIGN
invariant 12: no block is freed or reused under a READ on a timer alone)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import secrets
import time
from typing import Any

import anyio
import structlog

from . import _auth
from ._errors import ProtocolViolation, UnknownRequest
from ._ids import InvalidRequestId, check_handle, check_request_id
from ._layout import KVSlice, dtype_name
from ._nixl_common import (
    _MAX_MESSAGE_BYTES,
    _PRE_AUTH_BYTES,
    NOTIF_PREFIX,
    NIXLConfig,
    layout_info,
    make_agent,
    read_msg,
    write_msg,
)
from ._store import Checkout, KVStore

log = structlog.get_logger("transports.nixl")

_MAX_EARLY = 65_536  # tokens remembered for a pin message still on its way (bounded memory)


@dataclasses.dataclass
class _Pin:
    request_id: str
    handle: str | None
    checkout: Checkout
    release: bool
    deadline: float


@dataclasses.dataclass
class NIXLKVServerStatistics:
    connections: int
    pinned: int
    served: int
    refused: int
    pins_expired: int
    auth_failures: int
    lookups: int = 0  # pulls that asked for the block ids first (their prefill reply did not name them)


class NIXLKVServer:
    """``async with NIXLKVServer(store, config, port=0) as server: await server.serve_forever()``

    ``head_start``/``total_kv_heads`` place this node's KV heads in the model (tensor parallelism):
    the store holds ``store.layout.num_kv_heads`` heads from ``head_start``; GEN is told at connect
    and names them in this node's own numbering (0 .. num_kv_heads) when it pulls."""

    def __init__(self, store: KVStore, config: NIXLConfig, *, host: str = "0.0.0.0", port: int = 0, lease_s: float = 30.0,
                 expire_interval_s: float = 1.0, idle_notif_poll_s: float = 0.5, busy_notif_poll_s: float = 0.001,
                 head_start: int = 0, total_kv_heads: int | None = None) -> None:
        self.store, self.config, self.host, self._port, self._lease_s = store, config, host, port, lease_s
        self._heads = [head_start, head_start + store.layout.num_kv_heads]
        self._total_kv_heads = total_kv_heads if total_kv_heads is not None else store.layout.num_kv_heads
        self._expire_interval_s = expire_interval_s
        self._idle_poll, self._busy_poll = idle_notif_poll_s, busy_notif_poll_s
        if config.secret is None:
            log.warning("nixl_auth_disabled", role="ctx")
        self.agent = make_agent(f"kvo-ctx-{secrets.token_hex(6)}", config)
        pool = store.pool
        self._reg = self.agent.register_memory(pool)
        self._pool_info = {"addr": pool.data_ptr(), "nbytes": pool.numel() * pool.element_size(),
                           "num_blocks": int(pool.shape[0]), "block_bytes": store.layout.block_bytes,
                           "mem": "VRAM" if pool.is_cuda else "DRAM", "dev": (pool.device.index or 0) if pool.is_cuda else 0}
        self._pins: dict[str, _Pin] = {}
        # notifications and unpins of tokens not pinned (yet): a pin message may follow (_pin_read)
        self._early: dict[str, tuple[bool, float]] = {}  # token -> (a READ's notification?, when)
        self._pinned = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._handshaking = 0
        self._served = self._refused = self._expired = self._auth_failures = self._lookups = 0
        # lookups and pins are answered in the read loop unless a subclass's _before_send may wait
        self._answer_inline = type(self)._before_send is NIXLKVServer._before_send

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def statistics(self) -> NIXLKVServerStatistics:
        return NIXLKVServerStatistics(len(self._conns), len(self._pins), self._served, self._refused, self._expired,
                                      self._auth_failures, self._lookups)

    async def __aenter__(self) -> NIXLKVServer:
        self._server = await asyncio.start_server(self._on_connect, self.host, self._port)
        self._tasks = [asyncio.ensure_future(self._notif_loop()), asyncio.ensure_future(self._expire_loop())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        if self._server is not None:
            self._server.close()
        for w in list(self._conns):
            w.close()
        handlers = list(self._handlers)
        for h in handlers:
            h.cancel()
        await asyncio.gather(*self._tasks, *handlers, return_exceptions=True)
        self._drain_notifs()
        for pin in self._pins.values():  # a READ may still be landing: unpin only, never release here
            pin.checkout.close()
        self._pins.clear()
        self.agent.deregister_memory(self._reg)

    async def serve_forever(self) -> None:
        await anyio.sleep_forever()

    async def _before_send(self, msg: dict[str, Any]) -> None:
        """Test seam: runs after a lookup arrived, before it is answered (the READ comes after)."""

    # -- notifications and pins ---------------------------------------------------------------------

    def _drain_notifs(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(NOTIF_PREFIX):
                    self._done(msg[len(NOTIF_PREFIX):].decode(errors="replace"), ok=True)

    def _done(self, token: str, *, ok: bool) -> None:
        pin = self._pins.pop(token, None)
        if pin is None:  # perhaps a READ's pin still on its way (a pin message): remembered a while
            self._early.pop(token, None)  # re-added at the end: the dict stays in time order for the purge
            self._early[token] = (ok, time.monotonic())
            while len(self._early) > _MAX_EARLY:
                del self._early[next(iter(self._early))]
            return
        self._finish(pin, ok=ok)

    def _finish(self, pin: _Pin, *, ok: bool) -> None:
        pin.checkout.close()
        if ok:
            self._served += 1
            if pin.release:
                self.store.release(pin.request_id, handle=pin.handle)
        if not self._pins:
            self._pinned.clear()

    async def _notif_loop(self) -> None:
        """Poll NIXL's notifications: every ``busy_notif_poll_s`` while blocks are pinned, else rarely."""
        while True:
            self._drain_notifs()
            if self._pins:
                await asyncio.sleep(self._busy_poll)
            else:
                with anyio.move_on_after(self._idle_poll):
                    await self._pinned.wait()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval_s)
            now = time.monotonic()
            while self._early and next(iter(self._early.values()))[1] <= now - self.config.pin_timeout_s:
                del self._early[next(iter(self._early))]
            for token in [t for t, p in self._pins.items() if p.deadline <= now]:
                log.warning("nixl_pin_expired", request_id=self._pins[token].request_id)
                self._expired += 1
                self._done(token, ok=False)
            self.store.expire()

    # -- control connections ------------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        name = writer.get_extra_info("peername")
        peer = f"{name[0]}:{name[1]}" if isinstance(name, tuple) and len(name) >= 2 else str(name)
        if self._handshaking >= self.config.max_unauthenticated:
            log.warning("nixl_connection_refused", peer=peer, reason="too many unauthenticated connections",
                        limit=self.config.max_unauthenticated)
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._conns.add(writer)
        lookups: set[asyncio.Task[Any]] = set()  # answered in their own tasks: a slow one holds up no other
        handshaking = True
        self._handshaking += 1
        try:
            secret = self.config.secret
            ns = _auth.new_nonce()
            write_msg(writer, {"t": "challenge", "ns": ns.hex(), "auth": secret is not None})
            with anyio.fail_after(self.config.handshake_timeout_s):
                resp = await read_msg(reader, _PRE_AUTH_BYTES)
            handshaking = False
            self._handshaking -= 1
            nc = bytes.fromhex(str(resp.get("nc", "")))
            if resp.get("t") != "response" or (
                    secret is not None and not _auth.verify(_auth.client_mac(secret, ns, nc), bytes.fromhex(str(resp.get("mac", ""))))):
                self._auth_failures += 1
                log.warning("nixl_auth_failed", peer=peer)
                write_msg(writer, {"t": "fail"})
                await writer.drain()
                return
            info = json.dumps({"layout": layout_info(self.store.layout), "pool": self._pool_info,
                               "heads": self._heads, "total_kv_heads": self._total_kv_heads,
                               "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                               "lease_ms": int(self._lease_s * 1000),
                               "pin_ms": int(self.config.pin_timeout_s * 1000)}).encode()
            mac = _auth.server_mac(secret, ns, nc, info) if secret is not None else b""
            write_msg(writer, {"t": "ok", "mac": mac.hex(), "info": info.decode()})
            while True:
                msg = await read_msg(reader, _MAX_MESSAGE_BYTES)
                if msg["t"] in ("lookup", "pin"):
                    if len(lookups) >= self.config.max_pulls_per_connection:
                        write_msg(writer, {**self._refuse("BUSY", "too many lookups in flight"), "id": msg.get("id")})
                        continue
                    if self._answer_inline:  # nothing to wait for: answered here, no task (one loop turn less)
                        write_msg(writer, {**self._lookup_or_pin(msg), "id": msg.get("id")})
                        continue
                    lookup = asyncio.ensure_future(self._answer_lookup(writer, msg))
                    lookups.add(lookup)
                    lookup.add_done_callback(lookups.discard)
                    continue
                answer = self._handle(msg)
                if answer is not None:
                    write_msg(writer, {**answer, "id": msg.get("id")})
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ProtocolViolation, ValueError) as exc:
            log.debug("nixl_connection_ended", peer=peer, reason=f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:  # the server closes; asyncio's stream callback would log a re-raise
            pass
        finally:
            if handshaking:
                self._handshaking -= 1
            for lookup in list(lookups):  # not answered: nothing was pinned for them
                lookup.cancel()
            self._conns.discard(writer)
            self._handlers.discard(task)
            writer.close()

    def _refuse(self, status: str, reason: str) -> dict[str, Any]:
        self._refused += 1
        return {"t": "error", "status": status, "reason": reason[:200]}

    async def _answer_lookup(self, writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
        """The task path (a subclass's ``_before_send`` may wait): a slow answer holds up no other."""
        await self._before_send(msg)
        if not writer.is_closing():  # the GEN went away meanwhile: nothing to pin for it
            write_msg(writer, {**self._lookup_or_pin(msg), "id": msg.get("id")})

    def _lookup_or_pin(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._lookup(msg) if msg["t"] == "lookup" else self._pin_read(msg)

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        kind = msg["t"]
        if kind == "unpin":
            self._done(str(msg.get("token")), ok=False)
            return None
        if kind == "renew":  # GEN may still READ these blocks: their pins' leases start again
            deadline = time.monotonic() + self.config.pin_timeout_s
            tokens = msg.get("tokens")
            for token in tokens[: self.config.max_pulls_per_connection] if isinstance(tokens, list) else ():
                pin = self._pins.get(token) if isinstance(token, str) else None
                if pin is not None:
                    pin.deadline = max(pin.deadline, deadline)
            return None
        if kind == "release":
            try:
                ok = self.store.release(check_request_id(msg.get("rid")), handle=check_handle(msg.get("handle")))
            except (InvalidRequestId, ValueError):
                ok = False
            return {"t": "released", "ok": ok}
        if kind == "hold":
            for item in msg.get("items", [])[:100_000]:
                try:
                    self.store.touch(check_request_id(item[0]), self._lease_s, handle=check_handle(item[1]))
                except (InvalidRequestId, ValueError, TypeError, IndexError):
                    continue
            return None
        return self._refuse("BAD_REQUEST", f"unknown message type {kind!r}")

    def _checked(self, msg: dict[str, Any]) -> tuple[str, str | None] | dict[str, Any]:
        """``(request id, handle)`` of a lookup or pin whose slice, dtype and shape are those of the
        request's KV here; else the refusal to answer."""
        layout = self.store.layout
        try:
            rid, handle = check_request_id(msg.get("rid")), check_handle(msg.get("handle"))
            kv_slice = KVSlice(*(int(x) for x in msg["slice"]))
            layout.check_slice(kv_slice)
            shape = tuple(int(x) for x in msg["shape"])
        except (InvalidRequestId, ValueError, TypeError, KeyError) as exc:
            return self._refuse("BAD_REQUEST", str(exc))
        try:
            num_blocks = self.store.num_blocks(rid, handle=handle)
        except UnknownRequest:
            return self._refuse("UNKNOWN_REQUEST", "no KV held for this request")
        want = (dtype_name(layout.dtype), layout.wire_shape(num_blocks, kv_slice))
        if (msg.get("dtype"), shape) != want:
            return self._refuse("SHAPE_MISMATCH", f"have {want[0]}{list(want[1])}, asked {msg.get('dtype')}{list(shape)}")
        return rid, handle

    def _lookup(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._lookups += 1
        checked = self._checked(msg)
        if isinstance(checked, dict):
            return checked
        rid, handle = checked
        self.store.touch(rid, self._lease_s, handle=handle)
        try:
            blocks, checkout = self.store.pin(rid, handle=handle)
        except UnknownRequest:
            return self._refuse("UNKNOWN_REQUEST", "released while preparing")
        token = secrets.token_hex(12)
        self._pins[token] = _Pin(rid, handle, checkout, not msg.get("keep", False),
                                 time.monotonic() + self.config.pin_timeout_s)
        self._pinned.set()
        return {"t": "found", "token": token, "blocks": blocks}

    def _pin_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A READ the GEN posted at once, from block ids the prefill reply named (no lookup first):
        its pin arrives beside it. "pinned" vouches for the bytes the READ got: the request is still
        held here with exactly those blocks, so they were not freed since the prefill (a lease
        ends forwards only), and they stay pinned until the READ's notification (which may even
        have come first) or an unpin. A refusal means the READ's bytes must not be used."""
        token = msg.get("token")
        early = self._early.pop(token, None) if isinstance(token, str) else None
        if not isinstance(token, str) or not 16 <= len(token) <= 64 or token in self._pins:
            return self._refuse("BAD_REQUEST", "a pin needs a fresh token of 16-64 characters")
        checked = self._checked(msg)
        if isinstance(checked, dict):
            return checked
        rid, handle = checked
        try:
            blocks, checkout = self.store.pin(rid, handle=handle)
        except UnknownRequest:
            return self._refuse("UNKNOWN_REQUEST", "released while preparing")
        if msg.get("blocks") != blocks:
            checkout.close()
            return self._refuse("BAD_REQUEST", "the blocks read are not the ones this request holds here")
        self.store.touch(rid, self._lease_s, handle=handle)
        pin = _Pin(rid, handle, checkout, not msg.get("keep", False), time.monotonic() + self.config.pin_timeout_s)
        if early is None:
            self._pins[token] = pin
            self._pinned.set()
        else:  # the READ's notification (True) or the GEN's unpin (False) came first
            self._finish(pin, ok=early[0])
        return {"t": "pinned"}
