"""CTX side of the NIXL data plane (``transports.nixl``): registers the KV pool once, authenticates
GEN nodes on a TCP control port (at most ``max_unauthenticated`` in their handshake), answers
lookups by pinning a request's blocks, and unpins (and releases) when the READ's NIXL notification
arrives, when GEN unpins (a READ that failed or never started), or when the pin's lease
(``pin_timeout_s``) ends without a renewal: GEN renews the pins it may still READ from (DESIGN
invariant 12: no block is freed or reused under a READ on a timer alone).

A GEN may also READ a request's blocks with no pin at all (the prefill reply named them): the CTX
then frees nothing (a lease's end, a release) before every connected GEN has acknowledged its
revocation (all but the one that let go, when a GEN's release or READ notification frees it: another
GEN may hold the same handle) ("revoke" / "revoked"; a GEN acks once
its READs of the request ended, and READs it again only with a pin), closed its connection (it
trusts nothing from then on; a process that dies closes it too), or let its connection lease end
(``pin_timeout_s`` after its last "alive": past it, the GEN trusts no unpinned READ; a connection
cut without a word waits for it: the CTX cannot tell whether that GEN still READs). The handshake
and every revocation name the store's epoch (its random tag and revocation count): a request put
before a GEN connected, with revocations in between, or by another store, is READ with a pin."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import secrets
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import structlog

from . import _auth
from ._errors import ProtocolViolation, UnknownRequest
from ._ids import InvalidRequestId, check_handle, check_request_id, handle_key
from ._layout import KVSlice, dtype_name
from ._nixl_common import (
    _MAX_MESSAGE_BYTES,
    _PRE_AUTH_BYTES,
    NOTIF_PREFIX,
    NOTIF_READ,
    NIXLConfig,
    layout_info,
    make_agent,
    read_msg,
    write_msg,
)
from ._store import Checkout, KVStore

log = structlog.get_logger("transports.nixl")

_TOKEN_MIN, _TOKEN_MAX = 16, 64  # a pin's token (a GEN makes 24 hex characters)
_MAX_EARLY = 65_536  # tokens remembered (a pin message still on its way, a served pin for "check"): bounded memory
_NOTIF_BACKOFF_S = 0.05  # longest nap between notification polls while unpinned READs may come


class _Recent:
    """Tokens remembered a while, in the order they came: at most ``_MAX_EARLY`` (bounded memory),
    each until ``purge`` passes it."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[Any, float]] = {}  # token -> (value, when); oldest first

    def put(self, token: str, value: Any) -> None:
        self._items.pop(token, None)  # re-added at the end: the dict stays in time order for purge()
        self._items[token] = (value, time.monotonic())
        while len(self._items) > _MAX_EARLY:
            del self._items[next(iter(self._items))]

    def pop(self, token: str) -> tuple[Any, float] | None:
        return self._items.pop(token, None)

    def purge(self, before: float) -> None:
        """Forget every token remembered before ``before`` (monotonic)."""
        while self._items and next(iter(self._items.values()))[1] <= before:
            del self._items[next(iter(self._items))]

    def __contains__(self, token: object) -> bool:
        return token in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclasses.dataclass(eq=False)
class _Gen:
    """An authenticated GEN connection, as revocations see it: it may READ without a pin until
    ``lease_end`` (renewed by its "alive"), also after the connection ended."""

    writer: asyncio.StreamWriter
    peer: str
    lease_end: float
    agent: str | None = None  # its NIXL agent's name (from its handshake), which its READ notifications carry

    @property
    def reader(self) -> object:
        """Who this GEN is as a reader (its agent: one process, whichever connection it READs on)."""
        return self.agent if self.agent is not None else self


@dataclasses.dataclass(eq=False)
class _Revocation:
    request_id: str
    waiting: set[_Gen]  # GENs that have not acknowledged it yet
    done: Callable[[], None]  # the store frees the blocks


@dataclasses.dataclass
class _Pin:
    request_id: str
    handle: str | None
    checkout: Checkout
    release: bool
    deadline: float
    owner: set[str] | None = None  # the pin tokens of the connection that made it (a per-connection cap)
    reader: object = None  # the GEN that READs it (``_Gen.reader``): its release revokes for the others


@dataclasses.dataclass
class NIXLKVServerStatistics:
    connections: int
    pinned: int
    served: int
    refused: int
    pins_expired: int
    auth_failures: int
    lookups: int = 0  # pulls that asked for the block ids first (their prefill reply did not name them)
    unpinned_reads: int = 0  # READs no pin covered (revocations kept their blocks), by their notification
    revocations: int = 0  # frees decided here (lease, local release) that waited for the GENs' acks
    revocations_pending: int = 0  # of those, still waiting
    gens: int = 0  # GEN connection leases not ended (their connections may have closed)
    handed_on: int = 0  # frees by one GEN (release, READ notification) that other leased GENs had to ack


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
        self._early = _Recent()  # token -> a READ's notification (True) or an unpin (False)
        self._served_pins = _Recent()  # tokens whose READ's notification ended their pin (for "check")
        self._wake = asyncio.Event()  # a pin or a GEN's lease began: poll notifications often from now
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._handshaking = 0
        self._served = self._refused = self._expired = self._auth_failures = self._lookups = 0
        self._unpinned_reads = self._revoked = self._handed_on = 0
        self._gens: set[_Gen] = set()
        self._revocations: dict[int, _Revocation] = {}
        self._revocation_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # lookups and pins are answered in the read loop unless a subclass's _before_send may wait
        self._answer_inline = type(self)._before_send is NIXLKVServer._before_send

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def statistics(self) -> NIXLKVServerStatistics:
        return NIXLKVServerStatistics(len(self._conns), len(self._pins), self._served, self._refused, self._expired,
                                      self._auth_failures, self._lookups, self._unpinned_reads, self._revoked,
                                      len(self._revocations), len(self._gens), self._handed_on)

    async def __aenter__(self) -> NIXLKVServer:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._server = await asyncio.start_server(self._on_connect, self.host, self._port)
        self._tasks = [asyncio.ensure_future(self._notif_loop()), asyncio.ensure_future(self._expire_loop())]
        self.store.guard_frees(self._on_free)
        self.store.name_handles(handle_key(self.config.secret))  # a GEN tells a handle given with another id
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
        self.store.guard_frees(None)
        self._drain_notifs()
        for pin in self._pins.values():  # a READ may still be landing: unpin only, never release here
            pin.checkout.close()
        self._pins.clear()
        revocations, self._revocations = list(self._revocations.values()), {}
        for rev in revocations:  # the pool leaves NIXL below: no READ of it can run any more
            rev.done()
        self._gens.clear()
        self.agent.deregister_memory(self._reg)

    async def serve_forever(self) -> None:
        await anyio.sleep_forever()

    async def _before_send(self, msg: dict[str, Any]) -> None:
        """Test seam: runs after a lookup arrived, before it is answered (the READ comes after)."""

    # -- notifications and pins ---------------------------------------------------------------------

    def _drain_notifs(self) -> int:
        """Handle every notification NIXL has; how many there were."""
        n = 0
        for sender, msgs in self.agent.get_new_notifs().items():
            n += len(msgs)
            for msg in msgs:
                if msg.startswith(NOTIF_PREFIX):
                    self._done(msg[len(NOTIF_PREFIX):].decode(errors="replace"), ok=True)
                elif msg.startswith(NOTIF_READ):
                    self._read_ended(msg[len(NOTIF_READ):], sender)
        return n

    def _read_ended(self, body: bytes, sender: str) -> None:
        """An unpinned READ by agent ``sender`` ended: release the request unless the GEN keeps it
        (the handle decides); any other GEN that may READ it unpinned must let go first."""
        try:
            rid, handle, keep = json.loads(body)
            rid, handle = check_request_id(rid), check_handle(handle)
        except (ValueError, TypeError, InvalidRequestId):
            log.warning("nixl_bad_notification", body=body[:80])
            return
        try:
            if keep:
                self.store.num_blocks(rid, handle=handle)  # held, and that handle is its own
            elif not self.store.release(rid, handle=handle, reader=sender):
                raise UnknownRequest(rid)
        except UnknownRequest:  # another handle's, or gone (revoked while it was read): nothing to do
            log.debug("nixl_notification_unmatched", request_id=rid[:40])
            return
        self._unpinned_reads += 1
        self._served += 1

    def _done(self, token: str, *, ok: bool) -> None:
        if not _TOKEN_MIN <= len(token) <= _TOKEN_MAX:  # no pin has it; and a long one kept a while was
            return  # memory a GEN could fill at will (an outside drill: 1 MiB tokens, +1 GiB in 1,000 unpins)
        pin = self._pins.pop(token, None)
        if pin is not None and pin.owner is not None:
            pin.owner.discard(token)
        if pin is None:  # perhaps a READ's pin still on its way (a pin message): remembered a while
            self._early.put(token, ok)
            return
        self._finish(token, pin, ok=ok)

    def _finish(self, token: str, pin: _Pin, *, ok: bool) -> None:
        pin.checkout.close()
        if ok:  # held until the READ ended: a GEN's "check" of a slow READ says so a while (pin_timeout_s)
            self._served_pins.put(token, True)
            self._served += 1
            if pin.release:
                self.store.release(pin.request_id, handle=pin.handle, reader=pin.reader)

    async def _notif_loop(self) -> None:
        """Poll NIXL's notifications: every ``busy_notif_poll_s`` while blocks are pinned; while
        unpinned READs may come (a GEN holds a lease), as often after one arrived, then napping
        twice as long each time up to 50 ms; else rarely (or at once on a pin)."""
        nap = self._busy_poll
        while True:
            got = self._drain_notifs()
            if self._pins:
                nap = self._busy_poll
                await asyncio.sleep(nap)
                continue
            if self._gens:  # a GEN holds a lease: it may READ without a pin
                nap = self._busy_poll if got else min(nap * 2, _NOTIF_BACKOFF_S)
                wait = nap
            else:
                nap, wait = self._busy_poll, self._idle_poll
            self._wake.clear()
            with anyio.move_on_after(wait):  # a pin or a new GEN wakes it at once
                await self._wake.wait()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval_s)
            now = time.monotonic()
            self._early.purge(now - self.config.pin_timeout_s)
            self._served_pins.purge(now - self.config.pin_timeout_s)
            for token in [t for t, p in self._pins.items() if p.deadline <= now]:
                log.warning("nixl_pin_expired", request_id=self._pins[token].request_id)
                self._expired += 1
                self._done(token, ok=False)
            for gen in [g for g in self._gens if g.lease_end <= now]:
                self._let_go(gen, why="its lease ended")
            self.store.expire()

    # -- revocations: frees decided here, once every GEN that may READ without a pin let go -------------

    def _on_free(self, request_id: str, done: Callable[[], None], reader: Hashable | None) -> None:
        """The store's guard (any thread): revoke on the event loop."""
        loop = self._loop
        if threading.get_ident() == self._loop_thread:
            self._revoke(request_id, done, reader)
        elif loop is None or loop.is_closed():
            done()
        else:
            try:
                loop.call_soon_threadsafe(self._revoke, request_id, done, reader)
            except RuntimeError:  # the loop closed meanwhile: nothing READs any more
                done()

    def _revoke(self, request_id: str, done: Callable[[], None], reader: Hashable | None) -> None:
        """Free ``request_id``'s blocks (``done``) once every leased GEN but ``reader`` (the one that
        let go, if any: its READs ended) acknowledged: any other may hold the request's handle and
        block ids (a front's hand-off retry) and READ them without a pin."""
        now = time.monotonic()
        waiting = {g for g in self._gens if g.lease_end > now and (reader is None or g.reader != reader)}
        if reader is None:
            self._revoked += 1
        elif waiting:
            self._handed_on += 1
        if not waiting:
            done()
            return
        n = next(self._revocation_ids)
        self._revocations[n] = _Revocation(request_id, waiting, done)
        msg = {"t": "revoke", "rid": request_id, "n": n, "epoch": self.store.epoch}
        for gen in waiting:
            if not gen.writer.is_closing():  # a closed one's lease still runs: it goes when that ends
                write_msg(gen.writer, msg)

    def _acked(self, gen: _Gen, n: int) -> None:
        rev = self._revocations.get(n)
        if rev is not None and gen in rev.waiting:
            rev.waiting.discard(gen)
            if not rev.waiting:
                del self._revocations[n]
                rev.done()

    def _let_go(self, gen: _Gen, *, why: str) -> None:
        """``gen`` READs nothing unpinned any more (it said so, or its lease ended): it acks all."""
        self._gens.discard(gen)
        pending = [n for n, rev in self._revocations.items() if gen in rev.waiting]
        if pending:
            log.info("nixl_gen_let_go", peer=gen.peer, reason=why, revocations=len(pending))
        for n in pending:
            self._acked(gen, n)

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
        pins: set[str] = set()  # pins this connection made that have not ended
        gen: _Gen | None = None
        gen_closed = False
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
            # from here this GEN hears every revocation; the epoch tells it which came before
            agent = resp.get("agent")
            gen = _Gen(writer, peer, time.monotonic() + self.config.pin_timeout_s,
                       agent if isinstance(agent, str) and 0 < len(agent) <= 256 else None)
            self._gens.add(gen)
            self._wake.set()
            info = json.dumps({"layout": layout_info(self.store.layout), "pool": self._pool_info,
                               "heads": self._heads, "total_kv_heads": self._total_kv_heads,
                               "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                               "lease_ms": int(self._lease_s * 1000),
                               "pin_ms": int(self.config.pin_timeout_s * 1000),
                               "epoch": self.store.epoch}).encode()
            mac = _auth.server_mac(secret, ns, nc, info) if secret is not None else b""
            write_msg(writer, {"t": "ok", "mac": mac.hex(), "info": info.decode()})
            while True:
                msg = await read_msg(reader, _MAX_MESSAGE_BYTES)
                if msg["t"] in ("lookup", "pin"):
                    if len(lookups) + len(pins) >= self.config.max_pulls_per_connection:
                        write_msg(writer, {**self._refuse("BUSY", "too many lookups or pins at once"), "id": msg.get("id")})
                        continue
                    if self._answer_inline:  # nothing to wait for: answered here, no task (one loop turn less)
                        write_msg(writer, {**self._lookup_or_pin(msg, pins, gen.reader), "id": msg.get("id")})
                        continue
                    lookup = asyncio.ensure_future(self._answer_lookup(writer, msg, pins, gen.reader))
                    lookups.add(lookup)
                    lookup.add_done_callback(lookups.discard)
                    continue
                answer = self._handle(msg, gen)
                if answer is not None:
                    write_msg(writer, {**answer, "id": msg.get("id")})
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ProtocolViolation, ValueError) as exc:
            log.debug("nixl_connection_ended", peer=peer, reason=f"{type(exc).__name__}: {exc}")
            # the GEN's socket closed: its FIN between two messages, not one we started (the GEN fails its
            # connection before it closes it, so it trusts no unpinned READ any more), or its kernel's reset
            # (a process that died with data unread). Anything else (a cut, our own close) keeps its lease.
            gen_closed = isinstance(exc, ConnectionResetError) or (
                isinstance(exc, asyncio.IncompleteReadError) and not exc.partial and not writer.is_closing())
        except asyncio.CancelledError:  # the server closes; asyncio's stream callback would log a re-raise
            pass
        finally:
            if gen is not None and gen_closed:
                self._let_go(gen, why="its connection closed")
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

    async def _answer_lookup(self, writer: asyncio.StreamWriter, msg: dict[str, Any], pins: set[str],
                             reader: object) -> None:
        """The task path (a subclass's ``_before_send`` may wait): a slow answer holds up no other."""
        await self._before_send(msg)
        if not writer.is_closing():  # the GEN went away meanwhile: nothing to pin for it
            write_msg(writer, {**self._lookup_or_pin(msg, pins, reader), "id": msg.get("id")})

    def _lookup_or_pin(self, msg: dict[str, Any], pins: set[str], reader: object) -> dict[str, Any]:
        """Answer a lookup or a pin; a pin it leaves counts against its connection (``pins``) until it ends."""
        answer = self._lookup(msg, reader) if msg["t"] == "lookup" else self._pin_read(msg, reader)
        token = {"found": answer.get("token"), "pinned": msg.get("token")}.get(answer.get("t"))
        pin = self._pins.get(token) if isinstance(token, str) else None
        if pin is not None:
            pin.owner = pins
            pins.add(token)  # type: ignore[arg-type]
        return answer

    def _handle(self, msg: dict[str, Any], gen: _Gen) -> dict[str, Any] | None:
        kind = msg["t"]
        if kind == "revoked":  # the GEN's READs of these revocations' requests ended
            ns = msg.get("n")
            for n in ns[:100_000] if isinstance(ns, list) else ():
                if type(n) is int:
                    self._acked(gen, n)
            return None
        if kind == "alive":  # the GEN's lease: it may READ without a pin until pin_timeout_s from now
            if gen in self._gens:
                gen.lease_end = time.monotonic() + self.config.pin_timeout_s
                return {"t": "alive"}
            return self._refuse("LEASE_ENDED", "this connection's lease ended: READ with pins")
        if kind == "bye":  # the GEN READs nothing unpinned from here on
            self._let_go(gen, why="it said bye")
            return None
        if kind == "unpin":
            self._done(str(msg.get("token")), ok=False)
            return None
        if kind == "check":  # a slow pinned READ ended: was its pin held until then (not lapsed)?
            token = msg.get("token")
            return {"t": "checked", "held": isinstance(token, str) and (token in self._pins or token in self._served_pins)}
        if kind == "renew":  # GEN may still READ these blocks: their pins' leases start again
            deadline = time.monotonic() + self.config.pin_timeout_s
            tokens = msg.get("tokens")
            for token in tokens if isinstance(tokens, list) else ():  # every one (a message is bounded)
                pin = self._pins.get(token) if isinstance(token, str) else None
                if pin is not None:
                    pin.deadline = max(pin.deadline, deadline)
            return None
        if kind == "release":
            try:
                ok = self.store.release(check_request_id(msg.get("rid")), handle=check_handle(msg.get("handle")),
                                        reader=gen.reader)  # this GEN let go; any other must too
            except (InvalidRequestId, ValueError):
                ok = False
            return {"t": "released", "ok": ok, "epoch": self.store.epoch}  # past the request: the GEN remembers it
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

    def _lookup(self, msg: dict[str, Any], reader: object) -> dict[str, Any]:
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
                                 time.monotonic() + self.config.pin_timeout_s, reader=reader)
        self._wake.set()
        return {"t": "found", "token": token, "blocks": blocks}

    def _pin_read(self, msg: dict[str, Any], reader: object) -> dict[str, Any]:
        """A READ the GEN posted at once, from block ids the prefill reply named (no lookup first):
        its pin arrives beside it. "pinned" vouches for the bytes the READ got: the request is still
        held here with exactly those blocks, so they were not freed since the prefill (a lease
        ends forwards only), and they stay pinned until the READ's notification (which may even
        have come first) or an unpin. A refusal means the READ's bytes must not be used."""
        token = msg.get("token")
        early = self._early.pop(token) if isinstance(token, str) else None
        if not isinstance(token, str) or not _TOKEN_MIN <= len(token) <= _TOKEN_MAX or token in self._pins:
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
        pin = _Pin(rid, handle, checkout, not msg.get("keep", False), time.monotonic() + self.config.pin_timeout_s,
                   reader=reader)
        if early is None:
            self._pins[token] = pin
            self._wake.set()
        else:  # the READ's notification (True) or the GEN's unpin (False) came first
            self._finish(token, pin, ok=early[0])
        return {"t": "pinned"}
