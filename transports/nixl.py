"""A NIXL (one-sided READ) data plane: ``NIXLTransport`` on the GEN node, ``NIXLKVServer`` on the CTX.

Needs ``nixl-cu12`` (``pip install -c constraints.txt -e '.[nixl]'``); importing this module without
it raises ``ImportError``. Protocol (docs/transport.md, "NIXL")::

    GEN (NIXLTransport)                                   CTX (NIXLKVServer, KVStore)
    TCP connect to the CTX's control port ──────────────▶ (its NIXL agent registered the KV pool once)
                        ◀── challenge(ns, auth)
    response(nc, client_mac) ───────────────────────────▶ verify
                        ◀── ok(server_mac(.., info), info)     info: KV layout, agent name, NIXL agent
    verify; check the layout; add_remote_agent(metadata)         metadata, pool address/size/block bytes,
                                                                 epoch (its store's tag and revocations)
    every third of the connection lease: alive ────────▶ this GEN's lease: pin_ms from now ◀── alive

    per pull, the prefill reply named the block ids and the epoch, and this connection vouches
    (the request's epoch is this store's, >= the connection's; not revoked since; lease running):
    an UNPINNED READ
    one NIXL READ of the blocks straight into ``into``
    with notification "kvo2:[id, handle, keep]" ─(UCX)─▶ release unless keep (the handle decides)
    per pull otherwise, a PINNED READ (the block ids from the prefill reply, or a lookup first):
    [lookup(id, handle, slice, dtype, shape, keep) ────▶ validate; pin the blocks (a lease of pin_ms)
                        ◀── found(token, block ids)   or  error(status, reason)]
    [pin(.., token, blocks) beside the READ ────────────▶ pinned if held with exactly those blocks]
    block ids checked (count, int, in the pool); while the READ may run, renew([tokens]) every
    third of the pin lease ─────────────────────────────▶ the pins' leases start again
    one NIXL READ (whole blocks into a registered pool: one ``make_prepped_xfer`` from lists
    prepared once; else one descriptor per contiguous run),
    with notification "kvo1:<token>" ───(UCX)──────────▶ the notification: unpin; release unless keep
    unpin(token) if the READ failed or never started ───▶ unpin
    the pull succeeds once the READ is DONE (and, pinned beside it, the CTX answered "pinned")
    release(id, handle) / hold([(id, handle)]) ─────────▶ as on the UCX path

    a free the CTX decides on its own (lease ended, a release not from the GEN):
                        ◀── revoke(id, n, epoch)          the entry goes; its blocks stay allocated
    once its READs of ``id`` ended: revoked([n]) ──────▶ freed when every GEN leased then acked
    (a GEN whose lease ends, or that said bye, counts as having acked)

No block is freed or reused while a READ of it may run (DESIGN invariant 12). A pinned READ: the
pin ends on the notification, an unpin, or a lease nobody renewed, never on a timer alone. An
unpinned READ: the CTX frees a request it revokes only once every GEN that may READ without a pin
acknowledged (each does once its READs of the request ended) or let its connection lease lapse;
a GEN uses an unpinned READ's bytes only if its lease still ran when the READ ended. A GEN that
connected after a revocation cannot know whether it was of its request: the epoch says (a request
put before the connection's epoch is READ pinned). docs/transport.md, "Unpinned READs".

A READ cannot be withdrawn: a pull keeps ``landing`` busy until NIXL reports the transfer no longer
in progress, also after the pull was cancelled. A READ that ``transfer()`` completed at once (one
host: NIXL copies inline) needs no task; over 1 MiB that call is made by the GEN's poller thread,
off the event loop. One thread for the whole GEN (``_nixl_poller.ReadPoller``) posts those and polls every READ in
progress (20 µs naps doubling to 1 ms; asyncio cannot sleep less than 1 ms), each for at most
``read_timeout_s``, after which its watcher drops the peer (which ends the READ). The NIXL progress
thread sleeps in ``poll()`` (``progress_delay_us``; NIXL's Python API would make it spin a core).

Over TCP-only UCX a NIXL READ is emulated in software by UCX (the CTX's progress thread answers
every fragment) and is 1.4-3.3x slower than the ucxx tag path on a quiet machine, 10x under load
(docs/transport.md): use ``UCXTransport`` there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import numpy as np
import structlog
import torch

from . import _auth
from ._errors import (
    AuthenticationFailed,
    IncompatiblePeer,
    PeerBusy,
    PeerClosed,
    PeerUnreachable,
    ProtocolViolation,
    TransportError,
    UnknownRequest,
)
from ._ids import InvalidRequestId, check_handle, check_request_id, checked_handle_names, handle_key, hold_items
from ._layout import KVLayout, KVSlice, dtype_from_name, dtype_name
from ._nixl_common import (
    _MAX_MESSAGE_BYTES,
    _PRE_AUTH_BYTES,
    NOTIF_PREFIX as NOTIF_PREFIX,
    NOTIF_READ,
    NIXLConfig as NIXLConfig,
    _nixl_api as _nixl_api,
    layout_info as layout_info,
    make_agent as make_agent,
    mem_type,
    read_msg as read_msg,
    segments as segments,
    write_msg as write_msg,
)
from ._nixl_conn import _Conn
from ._nixl_poller import ReadPoller
from ._peers import PeerConnections, check_layout
from ._protocol import Landing, parse_peer

log = structlog.get_logger("transports.nixl")


# -- GEN side ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class NIXLTransportStatistics:
    endpoints: int  # live control connections (one per CTX peer)
    pulls_ok: int
    pulls_failed: int
    pulls_retried: int  # on a fresh connection, after a reused one turned out stale before any KV moved
    bytes_moved: int
    peers_down: int
    adhoc_registrations: int  # pulls into memory not registered with register(): registered per pull
    prepped_reads: int = 0  # READs made from descriptor lists prepared once (make_prepped_xfer)
    unpinned_reads: int = 0  # READs posted with no pin (the CTX's revocations kept their blocks)
    pins_lapsed: int = 0  # slow pinned READs whose pin the CTX let lapse meanwhile (their bytes not used)


class NIXLTransport:
    """GEN side (implements ``transports.Transport``). ``register(pool)`` once; pulls into memory
    inside a registered tensor need no registration (others are registered for the one pull).

    ``layout``: this node's KV layout; a peer whose layout differs (layers, head size, block size,
    dtype, or a different number of KV heads in the model than ``total_kv_heads``, default
    ``layout.num_kv_heads``) is refused once at connect with ``IncompatiblePeer``. A CTX may hold
    only some heads (tensor parallelism): a pull names them in that CTX's own numbering.

    Connections follow ``UCXTransport``'s rules: one connect attempt per peer at a time, a refused
    port fails at once, a failed connect marks the peer down for ``dead_peer_backoff_s``, at most
    ``max_peers`` peers, and a pull whose reused connection turned out stale before its READ was
    posted reconnects once."""

    name = "nixl"
    requires_handle = True

    def __init__(self, config: NIXLConfig, *, layout: KVLayout | None = None, total_kv_heads: int | None = None) -> None:
        self.config = config
        self.layout = layout
        self.total_kv_heads = total_kv_heads if total_kv_heads is not None else (layout.num_kv_heads if layout else None)
        if config.secret is None:
            log.warning("nixl_auth_disabled", role="gen")
        self._handle_key = handle_key(config.secret)  # the CTX's handles name their request under it
        self.agent_name = f"kvo-gen-{secrets.token_hex(6)}"  # the CTX knows our READs' notifications by it
        self.agent = make_agent(self.agent_name, config)
        self._regions: list[tuple[int, int, torch.Tensor, Any]] = []  # (start, end, tensor, reg descs)
        self._local_dlists: list[tuple[int, int, Any]] = []  # (start, end, prepped per-block dlist)
        self._remote_dlists: dict[str, Any] = {}  # agent name -> the CTX pool's prepped per-block dlist
        self._prepped = 0
        self._peers: PeerConnections[_Conn] = PeerConnections(
            self._open, max_peers=config.max_peers, backoff_s=config.dead_peer_backoff_s,
            usable=lambda c: c.error is None, discard=self._close_conn)
        self._agents: dict[str, str] = {}  # peer -> the NIXL name of its agent (at most max_peers)
        self._reads: dict[str, int] = {}  # agent name -> READs in flight (the agent is not removed meanwhile)
        self._stale: set[str] = set()  # agents replaced by a reconnect, removed when their last READ ends
        self._pinned: dict[str, tuple[str, float]] = {}  # token -> (peer, pin lease): pins this GEN may READ from
        self._renewer: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._keepalive_lease = 0.0  # the connection lease the renewals run for
        self._unpinned = 0
        self._background: set[asyncio.Future[Any]] = set()
        self._poller = ReadPoller(self.agent)  # one thread watches every READ still in progress
        self._ok = self._failed = self._bytes = self._adhoc = self._retried = self._lapsed = 0
        self._closed = False

    def statistics(self) -> NIXLTransportStatistics:
        return NIXLTransportStatistics(self._peers.live, self._ok, self._failed, self._retried, self._bytes,
                                       self._peers.down, self._adhoc, self._prepped, self._unpinned, self._lapsed)

    def register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor``'s memory with NIXL once (the GEN's KV pool or staging arena); the
        tensor is kept referenced until ``aclose`` deregisters it (its memory cannot be freed and
        reused while NIXL may write into it)."""
        descs = self.agent.register_memory(tensor)
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        self._regions.append((start, end, tensor, descs))
        bb = self.layout.block_bytes if self.layout is not None else 0
        if bb and (end - start) % bb == 0:  # whole blocks: one descriptor each, prepared once
            mem, dev = mem_type(tensor)
            n = (end - start) // bb
            rows = np.stack([start + np.arange(n, dtype=np.int64) * bb, np.full(n, bb), np.full(n, dev)], 1)
            self._local_dlists.append((start, end, self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem)))

    def _registered(self, t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(s <= start and end <= e for s, e, _, _ in self._regions)

    # -- pins: renewed while a READ may use them ------------------------------------------------------

    def _pin(self, conn: _Conn, token: str) -> None:
        self._pinned[token] = (conn.peer, conn.pin_s)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.ensure_future(self._renew_loop())

    def _unpin(self, conn: _Conn, token: str | None, *, tell: bool) -> None:
        """This GEN will not READ ``token``'s blocks any more; with ``tell`` the CTX may unpin them now
        (a READ that failed or never started; a READ that succeeded notifies the CTX itself). No
        token: an unpinned READ, nothing to do."""
        if token is None:
            return
        self._pinned.pop(token, None)
        if tell:
            conn.send({"t": "unpin", "token": token})

    async def _renew_loop(self) -> None:
        """One task for the whole transport, alive while any pin is held: every third of the shortest
        pin lease, renew each peer's pins (over its current connection: a reconnect keeps them)."""
        while self._pinned:
            await asyncio.sleep(min(lease for _, lease in self._pinned.values()) / 3)
            by_peer: dict[str, list[str]] = {}
            for token, (peer, _) in self._pinned.items():
                by_peer.setdefault(peer, []).append(token)
            for peer, tokens in by_peer.items():
                conn = self._peers.conns.get(peer)
                if conn is not None:
                    conn.send({"t": "renew", "tokens": tokens})

    async def _keepalive_loop(self, lease_s: float) -> None:
        """One task for the whole transport, alive while any connection is: every third of the
        shortest connection lease (``lease_s``: the first one's), renew each connection's lease
        (the one unpinned READs need)."""
        while True:
            await asyncio.sleep(lease_s / 3)
            conns = [c for c in self._peers.conns.values() if c.error is None and c.epoch is not None]
            if not conns:
                return
            for conn in conns:
                conn.ask_alive()
            lease_s = self._keepalive_lease = min(c.pin_s for c in conns)

    async def connect(self, peer: str) -> None:
        await self._conn(peer)

    def connected(self, peer: str) -> bool:
        return self._peers.has(peer)

    async def _conn(self, peer: str) -> _Conn:
        return await self._peers.get(peer)

    def _close_conn(self, conn: _Conn) -> None:
        conn.fail(PeerClosed("transport closed", peer=conn.peer))

    def _forget_agent(self, peer: str) -> None:
        """Forget what NIXL knew of ``peer``'s agent; one a READ still reads from goes when it ends."""
        name = self._agents.pop(peer, None)
        if name is None:
            return
        if self._reads.get(name):
            self._stale.add(name)
            return
        self._remove_agent(name)

    def _remove_agent(self, name: str) -> None:
        self._stale.discard(name)
        dlist = self._remote_dlists.pop(name, None)
        if dlist is not None:
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(dlist)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            log.debug("nixl_remove_agent_failed", agent=name, reason=repr(exc))

    async def _open(self, peer: str) -> _Conn:
        try:
            host, port = parse_peer(peer)
        except ValueError as exc:
            raise PeerUnreachable(str(exc), peer=peer) from None
        try:  # a refused port fails here at once
            with anyio.fail_after(self.config.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
        except TimeoutError as exc:
            raise PeerUnreachable(f"connect to {peer} timed out after {self.config.connect_timeout_s}s", peer=peer) from exc
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)  # e.g. "Connection refused"
            raise PeerUnreachable(f"connect to {peer} failed: {why}", peer=peer) from None
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                info, answered_at = await self._handshake(peer, reader, writer)
            remote = self._check_layout(peer, info)
            meta = base64.b64decode(info["meta"])
            self._forget_agent(peer)  # a reconnect: the peer's previous agent is gone
            for old in [p for p in self._agents if p not in self._peers.conns]:
                if len(self._agents) < self.config.max_peers:
                    break
                self._forget_agent(old)  # bounded: agents of peers no longer connected go first
            name = self.agent.add_remote_agent(meta)
            name = name.decode() if isinstance(name, bytes) else name
            self._stale.discard(name)  # the same CTX agent again (a dropped connection, not a restart)
        except TimeoutError as exc:
            writer.close()
            raise PeerUnreachable(f"handshake with {peer} timed out", peer=peer) from exc
        except (OSError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise PeerClosed(f"{peer} closed during the handshake: {exc}", peer=peer) from None
        except (KeyError, TypeError, ValueError) as exc:
            writer.close()
            raise ProtocolViolation(f"bad handshake info from {peer}: {exc}", peer=peer) from None
        except BaseException:
            writer.close()
            raise
        self._agents[peer] = name
        conn = _Conn(peer, reader, writer, info, name, remote)
        conn.lease_from(answered_at)  # the CTX's lease began when it got our answer, after this
        conn.start()
        if self._keepalive is None or self._keepalive.done() or conn.pin_s < self._keepalive_lease:
            if self._keepalive is not None:
                self._keepalive.cancel()  # a shorter lease than the renewals run for: start over
            self._keepalive_lease = conn.pin_s
            self._keepalive = asyncio.ensure_future(self._keepalive_loop(conn.pin_s))
        log.info("nixl_connected", peer=peer, agent=name)
        return conn

    async def _handshake(self, peer: str, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[dict[str, Any], float]:
        """The CTX's info, and when our answer to its challenge left (its lease starts after)."""
        secret = self.config.secret
        challenge = await read_msg(reader, _PRE_AUTH_BYTES)
        if challenge.get("t") != "challenge":
            raise ProtocolViolation(f"expected a challenge from {peer}, got {challenge.get('t')!r}", peer=peer)
        ns = bytes.fromhex(challenge["ns"])
        if challenge.get("auth") and secret is None:
            raise AuthenticationFailed(f"{peer} requires authentication and no secret is configured", peer=peer)
        if not challenge.get("auth") and not self.config.allow_insecure:
            raise AuthenticationFailed(f"{peer} does not authenticate (set allow_insecure to accept)", peer=peer)
        nc = _auth.new_nonce()
        mac = _auth.client_mac(secret, ns, nc) if secret is not None else b""
        answered_at = time.monotonic()
        write_msg(writer, {"t": "response", "nc": nc.hex(), "mac": mac.hex(), "agent": self.agent_name})
        reply = await read_msg(reader, _MAX_MESSAGE_BYTES)
        if reply.get("t") != "ok":
            raise AuthenticationFailed(f"{peer} refused the handshake (wrong or missing secret?)", peer=peer)
        info_raw = reply["info"].encode()
        if challenge.get("auth") and secret is not None:
            if not _auth.verify(_auth.server_mac(secret, ns, nc, info_raw), bytes.fromhex(reply["mac"])):
                raise AuthenticationFailed(f"{peer} did not prove it holds the shared secret", peer=peer)
        return json.loads(info_raw), answered_at

    def _check_layout(self, peer: str, info: dict[str, Any]) -> KVLayout:
        """The CTX's pool layout; ``IncompatiblePeer`` when its model's KV differs from ours."""
        theirs = info["layout"]
        remote = KVLayout(num_layers=int(theirs["num_layers"]), num_kv_heads=int(theirs["num_kv_heads"]),
                          head_dim=int(theirs["head_dim"]), block_size=int(theirs["block_size"]),
                          dtype=dtype_from_name(str(theirs["dtype"])))
        if int(info["pool"]["block_bytes"]) != remote.block_bytes:
            raise ProtocolViolation(f"{peer}: pool block size disagrees with its layout", peer=peer)
        if int(info["pool"]["num_blocks"]) < 0:
            raise ProtocolViolation(f"{peer}: a pool of fewer than no blocks", peer=peer)
        layout = self.layout
        if layout is None:
            return remote
        total = int(info.get("total_kv_heads", remote.num_kv_heads))
        theirs_t = (remote.num_layers, total, remote.head_dim, remote.block_size, dtype_name(remote.dtype))
        try:
            check_layout(peer, theirs_t, layout, self.total_kv_heads)
        except IncompatiblePeer as err:
            log.error("nixl_incompatible_peer", peer=peer, reason=str(err))
            raise
        return layout if remote == layout else remote  # ours: its full slice is the one pulls name (`is`)

    def _check_pull(self, peer: str, request_id: str, handle: str | None, kv_slice: KVSlice,
                    into: torch.Tensor) -> None:
        try:
            check_request_id(request_id)
            check_handle(handle)
            dtype_name(into.dtype)
        except (InvalidRequestId, ValueError) as exc:
            raise ProtocolViolation(f"cannot pull {request_id!r}: {exc}", peer=peer) from None
        shape = into.shape  # a tuple (torch.Size)
        if not into.is_contiguous():
            raise ProtocolViolation("`into` must be contiguous", peer=peer)
        if len(shape) != 6 or shape[1] != kv_slice.num_layers or shape[2] != 2 or shape[3] != kv_slice.num_heads:
            raise ProtocolViolation(f"`into` of shape {tuple(shape)} does not hold slice {kv_slice}", peer=peer)

    async def pull(self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, *,
                   handle: str | None = None, release: bool = True, landing: Landing | None = None,
                   remote_blocks: Sequence[int] | None = None, remote_epoch: int | None = None) -> int:
        """One READ of ``request_id``'s slice into ``into``. With ``remote_blocks`` (the CTX's block
        ids, from its prefill reply) the READ is posted at once. With ``remote_epoch`` too (the
        CTX store's epoch before it put the request) and a connection that vouches for it
        (no revocation it missed or heard of can have been of this request; its lease runs), the
        READ needs no pin: the CTX frees nothing it revokes before this GEN acknowledged, which it
        does once its READs of the request ended. Otherwise a pin travels beside the READ: the pull
        costs the READ or the pin's round trip, whichever is longer, not their sum; a refused pin
        (the request is not held with those blocks) fails the pull and its bytes are not used."""
        self._check_pull(peer, request_id, handle, kv_slice, into)
        landing = landing if landing is not None else Landing()
        try:
            n = await self._pull(peer, request_id, kv_slice, into, handle, release, landing, remote_blocks,
                                 remote_epoch)
        except BaseException:
            self._failed += 1
            raise
        self._ok += 1
        self._bytes += n
        return n

    async def _lookup(self, peer: str, lookup: dict[str, Any]) -> tuple[_Conn, dict[str, Any]]:
        """Pin the request's blocks on the CTX: ``(connection, answer)``. A reused connection that
        turns out stale here (nothing can have moved yet: no READ is posted before the answer) is
        replaced once."""
        conn = await self._conn(peer)
        reused = conn.answered > 0  # it served before: the peer may have restarted since
        try:
            answer = await conn.request(lookup, self.config.request_timeout_s)
            conn.answered += 1
            return conn, answer
        except PeerClosed as exc:
            if not reused or conn.error is None:  # a fresh connection, or a slow answer: no retry
                raise
            self._retried += 1
            log.info("nixl_pull_retry", peer=peer, request_id=lookup["rid"], reason=str(exc))
        self._peers.drop(peer, conn)
        conn = await self._conn(peer)
        answer = await conn.request(lookup, self.config.request_timeout_s)
        conn.answered += 1
        return conn, answer

    _before_read: Callable[[str, str], Awaitable[None]] | None = None
    """Test seam (a subclass's coroutine method ``(peer, request_id)``): runs once the block ids are
    checked, before the READ is posted; none by default (the pull then does not await between its
    connection's vouching and the READ, so nothing it heard can have changed)."""

    def _check_blocks(self, conn: _Conn, blocks: Any, into: torch.Tensor, *,
                      blame_peer: bool = True) -> list[int]:
        """The CTX's block ids, checked before anything is built from them: a list of exactly the
        blocks ``into`` holds, each an int inside the CTX's pool; ``ProtocolViolation`` otherwise
        (naming the peer when it answered them, the request when its prefill reply did)."""
        num_blocks = conn.num_blocks
        if isinstance(blocks, list) and len(blocks) == into.shape[0]:
            for b in blocks:
                if type(b) is not int or not 0 <= b < num_blocks:
                    break
            else:
                return blocks
        got = f"{len(blocks)} ids" if isinstance(blocks, list) else type(blocks).__name__
        who = f"{conn.peer} answered" if blame_peer else "the prefill reply named"
        raise ProtocolViolation(f"{who} a block list ({got}) that does not fit `into` "
                                f"({into.shape[0]} blocks) or the pool of {conn.peer} ({num_blocks})", peer=conn.peer)

    async def _pull(self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, handle: str | None,
                    release: bool, landing: Landing, remote_blocks: Sequence[int] | None,
                    remote_epoch: int | None) -> int:
        confirm: tuple[int, asyncio.Future[dict[str, Any]]] | None = None
        token: str | None
        unpinned = False
        asked_at = time.monotonic()  # before any lookup or pin left: a pin it makes lasts pin_s from later
        if remote_blocks is None:  # learn the block ids (and pin them) first: one round trip
            conn, answer = await self._lookup(peer, _ask("lookup", request_id, handle, kv_slice, into, release))
            if answer.get("t") == "error":
                raise _error(answer, peer, request_id)
            if answer.get("t") != "found" or not isinstance(answer.get("token"), str):
                conn.fail(ProtocolViolation(f"unexpected answer to a lookup: {answer.get('t')!r}", peer=peer))
                raise conn.error  # type: ignore[misc]
            token = answer["token"]
            raw_blocks = answer.get("blocks")
        else:  # the prefill reply named them: READ at once, the pin (if any) travels beside it
            conn = self._peers.ready(peer) or await self._conn(peer)
            raw_blocks = list(remote_blocks)  # checked (as the CTX's answer would be) before the READ is built
            if (handle is not None and conn.vouches(request_id, remote_epoch)
                    and checked_handle_names(handle, request_id, self._handle_key)):  # else the CTX checks it (pin)
                token, unpinned = None, True  # the CTX's revocations keep the blocks: nothing to ask
            else:
                token = secrets.token_hex(12)
                confirm = conn.ask({**_ask("pin", request_id, handle, kv_slice, into, release), "token": token,
                                    "blocks": raw_blocks})
        if token is not None:
            self._pin(conn, token)  # renewed from here until the READ ends
        try:
            state = await self._read(conn, request_id, token, raw_blocks, kv_slice, into, landing,
                                     remote_blocks is None, (handle, not release, remote_epoch) if unpinned else None)
        except BaseException:
            if confirm is not None:
                conn.forget(confirm[0])
            raise
        if confirm is not None:
            frees = release and remote_epoch is not None  # the pinned READ's notice frees it, if the pin took
            try:
                answer = await conn.answer(*confirm, "pin", self.config.request_timeout_s)
            except BaseException:
                conn.forget(confirm[0])
                if frees:  # whether the pin took is not known: as if it did
                    conn.released_here(request_id, remote_epoch + 1)  # type: ignore[operator]
                raise
            if frees and answer.get("t") != "error":
                conn.released_here(request_id, remote_epoch + 1)  # type: ignore[operator]
            if answer.get("t") == "error":  # the bytes read cannot be vouched for: not used
                raise _error(answer, peer, request_id)
            if answer.get("t") != "pinned":
                conn.fail(ProtocolViolation(f"unexpected answer to a pin: {answer.get('t')!r}", peer=peer))
                raise conn.error  # type: ignore[misc]
        if state != "DONE":
            raise PeerClosed(f"NIXL READ from {peer} failed ({state})", peer=peer)
        if token is not None and conn.error is not None:  # its renewals stopped: the pin may have lapsed
            raise PeerClosed(f"the control connection to {peer} failed during a pinned READ: its pin may have "
                             "lapsed and its blocks been freed under it", peer=peer)
        if unpinned and not conn.leased():  # revocations may have gone unheard: the bytes are not used
            raise PeerClosed(f"the control connection to {peer} lost its lease during an unpinned READ", peer=peer)
        if token is not None and time.monotonic() >= asked_at + conn.pin_s * 0.9:
            await self._check_pin(conn, token)  # renewals kept it, unless the connection stalled past the lease
        return into.nbytes

    async def _check_pin(self, conn: _Conn, token: str) -> None:
        """A pinned READ that ended later than its pin's first lease (a tenth less, for clock rates):
        renewals kept the pin unless the control connection stalled longer than the lease without
        failing (the CTX then let the pin lapse and may have freed and reused the blocks). The CTX
        says whether the pin held until the READ's notification; if not, the bytes are not used."""
        answer = await conn.request({"t": "check", "token": token}, self.config.request_timeout_s)
        if answer.get("t") != "checked" or answer.get("held") is not True:
            self._lapsed += 1
            raise PeerClosed(f"the pin of a READ from {conn.peer} lapsed while the READ ran (its control connection "
                             f"stalled longer than the pin lease, {conn.pin_s:g} s): its blocks may have been freed "
                             "under it", peer=conn.peer)

    async def _read(self, conn: _Conn, request_id: str, token: str | None, raw_blocks: Any, kv_slice: KVSlice,
                    into: torch.Tensor, landing: Landing, blame_peer: bool,
                    unpinned: tuple[str | None, bool, int | None] | None = None) -> str:
        """Post one READ of ``raw_blocks`` (pinned under ``token``, or ``unpinned``: its handle,
        keep and epoch) into ``into``; its final state (``DONE`` or a failure), once NIXL no
        longer reports it in progress."""
        peer = conn.peer
        nbytes = into.nbytes
        try:
            blocks = self._check_blocks(conn, raw_blocks, into, blame_peer=blame_peer)
            pool = conn.info["pool"]
            full = conn.remote.full_slice()
            whole = kv_slice is full or kv_slice == full  # whole blocks: their size says it all
            pieces = None if whole else segments(conn.remote, blocks, kv_slice)  # the CTX's pool, its head numbering
            if (len(blocks) * conn.remote.block_bytes if pieces is None else int(pieces[2].sum())) != nbytes:
                raise ProtocolViolation(f"{peer} answered blocks that do not fit `into`", peer=peer)
            if self._before_read is not None:
                await self._before_read(peer, request_id)
                if unpinned is not None and not conn.vouches(request_id, unpinned[2]):  # changed while we waited
                    if request_id in conn.revoked:
                        raise UnknownRequest(f"{peer} revoked {request_id!r} before its READ was posted", peer=peer)
                    raise PeerClosed(f"the control connection to {peer} lost its lease before the READ", peer=peer)
        except ProtocolViolation as exc:
            self._unpin(conn, token, tell=True)
            if blame_peer:
                conn.fail(exc)
            raise
        except BaseException:
            self._unpin(conn, token, tell=True)
            raise
        adhoc = xfer = None
        if unpinned is None:
            notif = NOTIF_PREFIX + str(token).encode()
        else:  # JSON [id, handle, keep]: the CTX releases on it (unless kept), the handle vouching for the GEN
            notif = NOTIF_READ + f'["{request_id}","{unpinned[0]}",{"true" if unpinned[1] else "false"}]'.encode()
        limit = self.config.inline_copy_bytes
        # one host (transfer() copies inline, learnt from what it answered this peer last): a large READ of
        # whole blocks is posted on the loop in pieces of at most `limit`, the loop's other work
        # between them; the notification travels with the last piece
        step = max(1, limit // conn.remote.block_bytes) if whole and nbytes > limit and conn.copies_inline else 0
        first = min(step, len(blocks)) if step else len(blocks)
        # posted and accounted for with no await in between: cancellation cannot split them
        try:
            if not whole:
                xfer = None
            elif first == len(blocks):  # one READ (no slicing: a tensor view costs ~2 µs)
                xfer = self._prepped_xfer(conn, blocks, into, notif)
            else:
                xfer = self._prepped_xfer(conn, blocks[:first], into[:first], b"")
            if xfer is None:  # descriptors built for this READ (one READ: no pieces)
                step = 0
                remote, local, lengths = pieces if pieces is not None else segments(conn.remote, blocks, kv_slice)
                if not self._registered(into):
                    adhoc = self.agent.register_memory(into)
                    self._adhoc += 1
                mem, dev = mem_type(into)
                base = into.data_ptr()
                n = len(lengths)
                ldesc = self.agent.get_xfer_descs(np.stack([local + base, lengths, np.full(n, dev)], 1), mem)
                rdesc = self.agent.get_xfer_descs(
                    np.stack([remote + pool["addr"], lengths, np.full(n, pool["dev"])], 1), pool["mem"])
                xfer = self.agent.initialize_xfer("READ", ldesc, rdesc, conn.agent_name, notif)
            landing.begin()
            conn.read_begins(request_id)  # a revocation of it is acknowledged only once it ended
            if unpinned is not None and not unpinned[1] and unpinned[2] is not None:
                conn.released_here(request_id, unpinned[2] + 1)  # its notice frees it (the handle names it)
            posting = None
            try:
                if nbytes > limit and not step:  # on one host transfer() copies inline: off the loop
                    posting = self._poller.post(xfer, self.config.read_timeout_s, posted=conn.copied)
                    state = "POSTING"
                else:
                    state = self.agent.transfer(xfer)
                    conn.copied(state)
            except BaseException:
                landing.end()  # not posted (NIXL refused it, or no poller to post it): nothing can land
                conn.read_ends(request_id)
                raise
        except Exception as exc:
            self._end_read(xfer, adhoc)
            self._unpin(conn, token, tell=True)
            raise PeerClosed(f"NIXL READ from {peer} could not be posted: {exc}", peer=peer) from None
        if unpinned is not None:
            self._unpinned += 1
        if step and first < len(blocks) and state in ("DONE", "PROC"):  # the first piece of several posted
            return await self._read_rest(conn, request_id, token, blocks, into, notif, landing, first, step, xfer, state)
        if state not in ("PROC", "POSTING"):  # done at once (one host: NIXL copied it inline): no task
            self._end_read(xfer, adhoc)
            landing.end()
            conn.read_ends(request_id)
            if token is not None:
                self._unpin(conn, token, tell=state != "DONE")
            return state
        watch = self._watch_task(conn, request_id, token, xfer, landing, adhoc, posting)
        try:
            return await asyncio.shield(watch)
        except BaseException:  # cancelled: the watcher goes on until NIXL ends the READ
            self._keep(watch)
            raise

    async def _read_rest(self, conn: _Conn, request_id: str, token: str | None, blocks: list[int], into: torch.Tensor,
                         notif: bytes, landing: Landing, done: int, step: int, xfer: Any, state: str) -> str:
        """The rest of a READ posted on the loop in pieces of ``step`` blocks, one at a time (its
        first, ``blocks[:done]``, posted as ``xfer``, now in ``state``), the loop's other work between
        them; the last carries the notification. ``landing`` and the request's READ count, begun for
        the whole READ, end here; a piece NIXL reports in progress (not a one-host copy after all)
        is watched with counts of its own, and the rest follows it as one READ. Cancelled while a
        piece may still be read, the pin ends once NIXL let go of it."""
        peer, total, watch = conn.peer, len(blocks), None
        try:
            while True:
                if state == "PROC":
                    landing.begin()
                    conn.read_begins(request_id)
                    watch = self._watch_task(conn, request_id, None, xfer, landing, None, None)
                    state = await asyncio.shield(watch)
                    watch = None
                else:
                    self._end_read(xfer, None)
                if state != "DONE" or done == total:
                    break
                await asyncio.sleep(0)  # the loop's other work: it is stalled one piece at a time
                hi = min(done + step, total) if conn.copies_inline else total
                xfer = self._prepped_xfer(conn, blocks[done:hi], into[done:hi], notif if hi == total else b"")
                try:
                    state = self.agent.transfer(xfer)
                except Exception as exc:
                    self._end_read(xfer, None)
                    raise PeerClosed(f"NIXL READ from {peer} could not be posted: {exc}", peer=peer) from None
                conn.copied(state)
                done = hi
        except BaseException:
            landing.end()
            conn.read_ends(request_id)
            if watch is None:
                self._unpin(conn, token, tell=True)
            else:  # that piece may still be read: its pin ends with it
                self._keep(watch)
                watch.add_done_callback(lambda _: self._unpin(conn, token, tell=True))
            raise
        landing.end()
        conn.read_ends(request_id)
        if state != "TIMEOUT":  # a piece NIXL still reports in progress keeps the pin (and its landing)
            self._unpin(conn, token, tell=state != "DONE")
        return state

    def _watch_task(self, conn: _Conn, request_id: str, token: str | None, xfer: Any, landing: Landing, adhoc: Any,
                    posting: asyncio.Future[str] | None) -> asyncio.Future[str]:
        """``_watch`` as a task (the READ's agent counted as in use until it ends: for good if NIXL
        never lets go of it, so that ``aclose`` keeps the memory it may write registered)."""
        name = conn.agent_name
        self._reads[name] = self._reads.get(name, 0) + 1
        watch = asyncio.ensure_future(self._watch(conn, request_id, token, xfer, landing, adhoc, posting))
        watch.add_done_callback(lambda w: None if _stuck(w) else self._read_ended(name))
        return watch

    def _keep(self, watch: asyncio.Future[Any]) -> None:
        """A watcher its caller no longer awaits: kept (and awaited by ``aclose``) until it ends."""
        self._background.add(watch)
        watch.add_done_callback(self._background.discard)

    def _prepped_xfer(self, conn: _Conn, blocks: list[int], into: torch.Tensor, notif: bytes) -> Any:
        """A READ of whole blocks (the caller checked that the slice is the full one) into whole
        blocks of a registered region, from descriptor lists prepared once (the CTX pool's per peer
        agent, the region's at ``register``); None when the pull is not of that shape (another
        block size, unaligned ``into``)."""
        bb = conn.remote.block_bytes
        if self.layout is None or bb != self.layout.block_bytes:
            return None
        count = len(blocks)
        start = into.data_ptr()
        end = start + count * bb
        for lo, hi, local in self._local_dlists:
            if lo <= start and end <= hi:
                first, off = divmod(start - lo, bb)
                if not off:
                    break
        else:
            return None
        remote = self._remote_dlists.get(conn.agent_name)
        if remote is None:
            pool = conn.info["pool"]
            n = conn.num_blocks
            rows = np.stack([int(pool["addr"]) + np.arange(n, dtype=np.int64) * bb, np.full(n, bb),
                             np.full(n, int(pool["dev"]))], 1)
            remote = self._remote_dlists[conn.agent_name] = self.agent.prep_xfer_dlist(conn.agent_name, rows, pool["mem"])
        xfer = self.agent.make_prepped_xfer("READ", local, list(range(first, first + count)), remote, blocks, notif)
        self._prepped += 1
        return xfer

    def _end_read(self, xfer: Any, adhoc: Any) -> bool:
        """Free a READ's handle (and an ad-hoc registration); False when NIXL refused (still busy)."""
        ok = True
        if xfer is not None:
            try:
                self.agent.release_xfer_handle(xfer)
            except Exception as exc:  # NIXL refuses to free a handle it cannot cancel
                log.warning("nixl_release_handle_failed", reason=str(exc))
                ok = False
        if adhoc is not None and ok:
            self.agent.deregister_memory(adhoc)
        return ok

    def _read_ended(self, name: str) -> None:
        self._reads[name] -= 1
        if not self._reads[name]:
            del self._reads[name]
            if name in self._stale:  # replaced by a reconnect while this READ ran
                self._remove_agent(name)

    async def _watch(self, conn: _Conn, request_id: str, token: str | None, xfer: Any, landing: Landing, adhoc: Any,
                     posting: asyncio.Future[str] | None = None) -> str:
        """Wait for the GEN's poller to see the READ no longer in progress (``posting``: the poller
        posts it first), at most ``read_timeout_s``; then drop its peer (closing NIXL's connection
        to it ends the READ) and wait as long again. ``landing`` ends only once NIXL says the READ
        is over (a READ NIXL refused to post never began: ``ERR``)."""
        timeout = self.config.read_timeout_s
        state = await (posting if posting is not None else self._poller.wait(xfer, timeout))
        if state == "PROC":
            log.warning("nixl_read_timeout", peer=conn.peer, timeout_s=timeout)
            conn.fail(PeerClosed(f"a READ from {conn.peer} was still in progress after {timeout}s", peer=conn.peer))
            self._peers.drop(conn.peer, conn)
            name = conn.agent_name
            if self._agents.get(conn.peer) == name:
                del self._agents[conn.peer]
            self._remove_agent(name)  # ends the READ (its UCX endpoints close)
            for other in [c for c in self._peers.conns.values() if c.agent_name == name]:  # a reconnect's, same agent
                other.fail(PeerClosed(f"the NIXL agent of {other.peer} was removed (a READ from it timed out)",
                                      peer=other.peer))
                self._peers.drop(other.peer, other)
            state = await self._poller.wait(xfer, timeout)
            if state == "PROC":
                log.error("nixl_read_stuck", peer=conn.peer, reason="NIXL still reports the READ in progress; "
                          "its destination stays busy")
                return "TIMEOUT"  # landing stays busy: the memory may still be written
        self._unpin(conn, token, tell=state != "DONE")  # DONE: the CTX has its notification
        self._read_over(conn, request_id, xfer, adhoc, landing)
        return state

    def _read_over(self, conn: _Conn, request_id: str, xfer: Any, adhoc: Any, landing: Landing) -> None:
        """A watched READ NIXL no longer reports in progress: free its handle and, if NIXL let go of
        it, end its landing and its count (a revocation of its request may be acknowledged)."""
        if self._end_read(xfer, adhoc):
            landing.end()
            conn.read_ends(request_id)

    async def release(self, peer: str, request_id: str, *, handle: str | None = None) -> None:
        try:
            check_request_id(request_id)
            check_handle(handle)
            conn = await self._conn(peer)
            await conn.reads_ended(request_id)  # the CTX frees on a release at once: not under a READ of it
            conn.released_here(request_id, None)  # from now on: a replay of its hand-off READs with a pin
            answer = await conn.request({"t": "release", "rid": request_id, "handle": handle},
                                        self.config.request_timeout_s)
            if type(answer.get("epoch")) is int:  # the CTX's epoch after the free: past the request
                conn.released_here(request_id, answer["epoch"])
        except Exception as exc:
            log.warning("nixl_release_failed", peer=peer, request_id=str(request_id)[:40], reason=str(exc))

    async def hold(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        """Best effort: ask ``peer`` to renew these requests' leases (no reply is awaited). An item
        with a bad request id or handle is dropped here (logged), not the whole batch with it."""
        valid = hold_items(items, peer, log, "nixl_hold_item_dropped")
        if not valid:
            return
        try:
            conn = await self._conn(peer)
            conn.send({"t": "hold", "items": [[r, h] for r, h in valid]})
        except Exception as exc:
            log.warning("nixl_hold_failed", peer=peer, requests=len(valid), reason=str(exc))

    async def aclose(self) -> None:
        """Close every connection; READs still in flight get ``close_timeout_s`` to land, then their
        peers are dropped (which ends them) and they get as long again. Memory a READ may still
        write into is not deregistered (logged); everything else is."""
        if self._closed:
            return
        self._closed = True
        watches = list(self._background)
        if watches:
            _, pending = await asyncio.wait(watches, timeout=self.config.close_timeout_s)
            if pending:
                for name in list(self._reads):
                    self._remove_agent(name)  # ends the READs from it
                _, pending = await asyncio.wait(pending, timeout=self.config.close_timeout_s)
            if pending:
                log.error("nixl_close_reads_stuck", reads=len(pending))
        self._poller.close()
        if self._renewer is not None:
            self._renewer.cancel()
        if self._keepalive is not None:
            self._keepalive.cancel()
        for conn in self._peers.close():
            if not conn.reading:  # no READ left: the CTX need not wait for this GEN's lease to end
                conn.send({"t": "bye"})
            self._close_conn(conn)
        if self._reads:
            log.error("nixl_close_memory_kept", reads=sum(self._reads.values()),
                      reason="NIXL still reports READs in progress: the memory they may write stays registered")
        else:
            for dlist in [*self._remote_dlists.values(), *(d for _, _, d in self._local_dlists)]:
                with contextlib.suppress(Exception):
                    self.agent.release_dlist_handle(dlist)
            self._remote_dlists.clear()
            self._local_dlists.clear()
            for _, _, _, descs in self._regions:
                self.agent.deregister_memory(descs)
            self._regions.clear()

    async def __aenter__(self) -> NIXLTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _stuck(watch: asyncio.Future[str]) -> bool:
    """A watcher that gave up on a READ NIXL still reports in progress (its landing stays busy)."""
    return not watch.cancelled() and watch.exception() is None and watch.result() == "TIMEOUT"


def _ask(kind: str, request_id: str, handle: str | None, kv_slice: KVSlice, into: torch.Tensor,
         release: bool) -> dict[str, Any]:
    """A lookup or a pin of a pull (an unpinned READ asks nothing)."""
    return {"t": kind, "rid": request_id, "handle": handle,
            "slice": [kv_slice.layer_start, kv_slice.layer_end, kv_slice.head_start, kv_slice.head_end],
            "dtype": dtype_name(into.dtype), "shape": list(into.shape), "keep": not release}


def _error(answer: dict[str, Any], peer: str, request_id: str) -> TransportError:
    status, reason = answer.get("status"), str(answer.get("reason", ""))[:200]
    if status == "UNKNOWN_REQUEST":
        return UnknownRequest(f"{peer} holds no KV for {request_id!r}: {reason}", peer=peer)
    if status == "BUSY":
        return PeerBusy(f"{peer} is busy with {request_id!r}: {reason}", peer=peer)
    return ProtocolViolation(f"{peer} refused {request_id!r} ({status}): {reason}", peer=peer)


from ._nixl_server import NIXLKVServer as NIXLKVServer  # noqa: E402  (the CTX side)

__all__ = ["NIXLConfig", "NIXLKVServer", "NIXLTransport", "NIXLTransportStatistics", "make_agent", "segments"]
