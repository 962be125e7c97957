"""The CTX side of the UCX data plane: ``UCXKVServer`` serves a ``KVStore``'s KV to GEN nodes.

Per endpoint: at most ``max_unauthenticated`` endpoints may be in their handshake at once (more
are closed at once); the mutual HMAC handshake comes first (nothing is served before it succeeds)
and tells GEN this node's KV layout, head range, pull limit and lease. Then a reader loop takes
GEN's control frames:

    PULL     validate against the limits, the layout and the handle,
             check the entry out of the store (pinned, so a RELEASE or the lease cannot free it
             mid-send; the lease is renewed): a zero-copy view when its blocks form one run (served
             in the read loop itself, no task), else a gathered copy (in a worker thread above
             1 MiB; at most ``max_gathers_per_request`` copies of one request at once, the others
             wait); post the KV alone on the data tag (no reply: GEN checks its length), then
             release the entry if asked.
             A refusal (unknown request, wrong handle, bad slice or shape, busy, malformed) is a
             PULL_ERR on the reply tag and an empty message on the data tag (GEN posted its KV
             receive before the PULL; this ends it). A PULL that reuses a txid in flight or names
             a foreign data tag gets the PULL_ERR alone.
    RELEASE  frees the entry if the handle matches; RELEASE_OK says whether it was held.
    HOLD     renews the leases of the listed requests (no reply).

A malformed frame fails the one request it names (or is dropped when it names none); it never ends
the endpoint that other requests share. Imported as ``transports.ucx.UCXKVServer``; the wire
protocol is described in ``transports.wire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import structlog
import torch

from . import _auth, wire
from ._errors import ProtocolViolation, UnknownRequest
from ._layout import dtype_name
from ._store import KVStore
from ._ucx_common import (
    _INLINE_GATHER_BYTES,
    CONTROL_TAG,
    UCXConfig,
    _ucx_acquire,
    _ucx_buffer,
    _ucx_release,
    apply_ucx_defaults,
    ends_in,
    post_send,
    ucx_truncated,
)

log = structlog.get_logger("transports.ucx")



@dataclasses.dataclass(frozen=True)
class UCXKVServerStatistics:
    connections: int
    pulls_served: int
    pulls_refused: int
    bytes_sent: int
    auth_failures: int
    malformed_frames: int
    pulls_ending_in_probe: int = 0  # served pulls whose KV ended in the GEN's probe byte (PULL_WHOLE sent)
    sends_timed_out: int = 0  # KV sends still not ended after send_timeout_s (their endpoint aborted)


def remote_address(ep: Any) -> str | None:
    """``host:port`` of the peer of a ucxx endpoint (UCP's ``ucp_ep_query``), or None if unknown."""
    try:
        lib = _libucp()
        buf = ctypes.create_string_buffer(1024)  # ucp_ep_attr_t, with room to spare
        struct.pack_into("=Q", buf, 0, 1 << 2)  # field_mask = UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR
        if lib.ucp_ep_query(ctypes.c_void_p(ep.ucp_endpoint), buf) != 0:
            return None
        raw = buf.raw[8 + 32 + 128 : 8 + 32 + 256]  # after field_mask, name[32], local_sockaddr
        family = struct.unpack_from("=H", raw, 0)[0]
        port = struct.unpack_from("!H", raw, 2)[0]
        if family == socket.AF_INET:
            return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
        if family == socket.AF_INET6:
            return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    except Exception:
        return None
    return None


_LIBUCP: Any = None


def _libucp() -> Any:
    global _LIBUCP
    if _LIBUCP is None:
        lib = ctypes.CDLL("libucp.so.0", mode=ctypes.RTLD_GLOBAL | getattr(ctypes, "RTLD_NOLOAD", 0))
        lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_ep_query.restype = ctypes.c_int
        _LIBUCP = lib
    return _LIBUCP


class UCXKVServer:
    """CTX side: serves PULL/RELEASE/HOLD from a ``KVStore`` on ``port`` (0 picks a free one, see
    ``.port``). ``lease_s`` is the lease a PULL or HOLD renews (and that GEN is told).
    ``head_start``/``total_kv_heads`` place this node's KV heads in the model (tensor parallelism).

    Use as ``async with UCXKVServer(store, config) as server: ...``; the listener accepts on all
    interfaces (ucxx listeners do not bind to one address).
    """

    def __init__(
        self, store: KVStore, config: UCXConfig, *, port: int = 0, lease_s: float = 30.0,
        head_start: int = 0, total_kv_heads: int | None = None,
    ) -> None:
        self.store = store
        self.config = config
        apply_ucx_defaults(dict(config.ucx_env))
        config._warn_if_insecure("ctx")
        self._requested_port = port
        self._lease_s = lease_s
        self._listener: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._eps: set[Any] = set()
        self._handshaking = 0
        self._gathers: dict[str, tuple[anyio.Semaphore, list[int]]] = {}  # request id -> (slots, [users])
        # pulls served in the read loop (``_serve_now``) whose sends have not ended: (endpoint, txid) ->
        # (checkout, what UCX sends from); a subclass that overrides a send seam takes the task path
        self._sending: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._inline_ok = (type(self)._before_send is UCXKVServer._before_send
                           and type(self)._send_checked_out is UCXKVServer._send_checked_out)
        self._dtype = dtype_name(store.layout.dtype)
        self._served = self._refused = self._bytes = self._auth_failures = self._malformed = self._whole = 0
        self._sends_timed_out = 0
        self._since = (0, 0, 0)  # served, refused, bytes at the last summary
        layout = store.layout
        limits = config.limits
        self._limits = dataclasses.replace(
            limits, max_layers=min(limits.max_layers, layout.num_layers), max_heads=min(limits.max_heads, layout.num_kv_heads)
        )
        total = total_kv_heads if total_kv_heads is not None else layout.num_kv_heads
        self.info = wire.PeerInfo(
            num_layers=layout.num_layers, total_kv_heads=total, head_start=head_start,
            head_end=head_start + layout.num_kv_heads, head_dim=layout.head_dim, block_size=layout.block_size,
            dtype=dtype_name(layout.dtype), max_pulls=config.max_pulls_per_endpoint, lease_ms=int(lease_s * 1e3),
        )

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return int(self._listener.port)

    def statistics(self) -> UCXKVServerStatistics:
        return UCXKVServerStatistics(len(self._eps), self._served, self._refused, self._bytes, self._auth_failures,
                                     self._malformed, self._whole, self._sends_timed_out)

    def __repr__(self) -> str:
        s = self.statistics()
        where = f"port {self.port}" if self._listener is not None else "not listening"
        return (f"<UCXKVServer [{where}, {s.connections} connections, {s.pulls_served} served, "
                f"{s.pulls_refused} refused, {s.bytes_sent} bytes, {s.auth_failures} auth failures]>")

    async def __aenter__(self) -> UCXKVServer:
        ucxx = _ucx_acquire()
        entered = False
        try:
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            entered = True
            try:
                self._listener = ucxx.create_listener(self._on_connect, port=self._requested_port,
                                                      endpoint_error_handling=True)
            except Exception as exc:  # ucxx says "Device is busy" for a port in use
                raise OSError(errno.EADDRINUSE, f"cannot listen for UCX on port {self._requested_port or '(any)'}: "
                                                f"{type(exc).__name__}: {exc} (is the port in use?)") from exc
            self._tg.start_soon(self._expire_loop)
            self._tg.start_soon(self._summary_loop)
        except BaseException:
            if entered:
                self._tg.cancel_scope.cancel()
                with contextlib.suppress(BaseException):
                    await self._tg.__aexit__(None, None, None)
            _ucx_release()
            raise
        log.info("ucx_server_listening", port=self.port)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        try:
            if self._listener is not None:
                self._listener.close()
            for ep in list(self._eps):  # first: UCX ends every send in flight, before a checkout closes
                ep.abort(period=10**8)
            for checkout, *_ in list(self._sending.values()):  # sends served in the read loop: ended by the aborts
                checkout.close()
            self._sending.clear()
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            return await self._tg.__aexit__(*exc)
        finally:
            for ep in list(self._eps):
                ep.abort(period=10**8)
            self._eps.clear()
            self._listener = None
            self._tg = None
            _ucx_release()

    async def serve_forever(self) -> None:
        await anyio.sleep_forever()

    async def _before_send(self, msg: wire.Pull) -> None:
        """Test seam: runs after the PULL was accepted, before the KV is sent."""

    async def _expire_loop(self) -> None:
        while True:
            await anyio.sleep(self.config.expire_interval_s)
            for request_id in self.store.expire():
                log.info("kv_lease_expired", request_id=request_id)

    async def _summary_loop(self) -> None:
        """One info line per period instead of one per pull (which was most of a CTX's log)."""
        while True:
            await anyio.sleep(self.config.summary_interval_s)
            now = (self._served, self._refused, self._bytes)
            if now != self._since:
                log.info("kv_pulls_summary", served=now[0] - self._since[0], refused=now[1] - self._since[1],
                         bytes=now[2] - self._since[2], connections=len(self._eps),
                         held_requests=self.store.statistics().held_requests, period_s=self.config.summary_interval_s)
                self._since = now

    async def _on_connect(self, ep: Any) -> None:
        if self._tg is None:
            ep.abort()
            return
        if self._handshaking >= self.config.max_unauthenticated:
            log.warning("ucx_connection_refused", peer=remote_address(ep), reason="too many unauthenticated connections",
                        limit=self.config.max_unauthenticated)
            ep.abort()
            return
        self._handshaking += 1
        self._tg.start_soon(self._serve_endpoint, ep)

    async def _send(self, ep: Any, msg: wire.Message, tag: int) -> None:
        await ep.send(wire.encode_frame(msg), tag=tag)

    async def _recv(self, ep: Any) -> bytearray:
        frame = bytearray(wire.FRAME_BYTES)
        await ep.recv(frame, tag=CONTROL_TAG)
        return frame

    async def _handshake(self, ep: Any, peer: str | None) -> bool:
        secret = self.config.secret
        nonce = _auth.new_nonce()
        await self._send(ep, wire.AuthChallenge(nonce, secret is not None), CONTROL_TAG)
        with anyio.fail_after(self.config.handshake_timeout_s):
            msg = wire.decode_frame(await self._recv(ep), self._limits)
        if not isinstance(msg, wire.AuthResponse):
            reason = f"expected AUTH_RESPONSE, got {type(msg).__name__}"
        elif secret is not None and not _auth.verify(_auth.client_mac(secret, nonce, msg.nonce), msg.mac):
            reason = "bad credentials"
        else:
            info = self.info
            mac = _auth.server_mac(secret, nonce, msg.nonce, wire.info_bytes(info)) if secret is not None else bytes(wire.MAC_BYTES)
            await self._send(ep, wire.AuthOk(mac, info), CONTROL_TAG)
            return True
        self._auth_failures += 1
        log.warning("ucx_auth_failed", peer=peer, reason=reason)
        with anyio.move_on_after(1):
            await self._send(ep, wire.AuthFail(wire.Status.AUTH_FAILED, reason), CONTROL_TAG)
        return False

    async def _serve_endpoint(self, ep: Any) -> None:
        self._eps.add(ep)
        peer = remote_address(ep)
        in_flight: set[int] = set()
        try:
            try:
                authenticated = await self._handshake(ep, peer)
            except TimeoutError:
                log.warning("ucx_handshake_timeout", peer=peer)
                return
            except ProtocolViolation as exc:
                self._auth_failures += 1
                log.warning("ucx_auth_failed", peer=peer, reason=str(exc))
                return
            finally:
                self._handshaking -= 1
            if not authenticated:
                return
            async with anyio.create_task_group() as tg:
                try:
                    await self._read_loop(ep, peer, tg, in_flight)
                finally:
                    tg.cancel_scope.cancel()
        except Exception as exc:  # ucxx: the peer went away
            log.info("ucx_peer_gone", peer=peer, reason=f"{type(exc).__name__}: {exc}")
        finally:
            self._eps.discard(ep)
            try:
                ep.abort(period=10**8)
            except Exception:
                pass

    async def _read_loop(self, ep: Any, peer: str | None, tg: anyio.abc.TaskGroup, in_flight: set[int]) -> None:
        while True:
            try:
                frame = await self._recv(ep)  # any other ucxx error (peer gone) ends the endpoint
            except ucx_truncated() as exc:  # a frame longer than one: it names no request it could fail
                self._malformed += 1
                log.warning("ucx_protocol_violation", peer=peer, reason=f"control frame over {wire.FRAME_BYTES} bytes "
                            f"({type(exc).__name__})")
                continue
            try:
                msg = wire.decode_frame(frame, self._limits)
            except ProtocolViolation as exc:
                self._malformed += 1
                self._answer_malformed(ep, peer, tg, exc, in_flight)
                continue
            if isinstance(msg, wire.Pull):
                if msg.tag != 2 * msg.txid + 1 or msg.txid in in_flight:  # no data message: the tag may be live
                    self._malformed += 1
                    log.warning("ucx_protocol_violation", peer=peer, reason=f"PULL {msg.txid}: reused txid or foreign tag")
                    tg.start_soon(self._refuse, ep, msg.txid, msg.request_id, wire.Status.BAD_REQUEST,
                                  "reused txid or foreign tag", False)
                    continue
                # GEN keeps below max_pulls, but its pull ends when the KV lands, a moment before this
                # node sees the send end: the same number again may be finishing here
                if len(in_flight) >= 2 * self.config.max_pulls_per_endpoint:
                    tg.start_soon(self._refuse, ep, msg.txid, msg.request_id, wire.Status.BUSY, "too many pulls in flight")
                    continue
                in_flight.add(msg.txid)
                if not (self._inline_ok and self._serve_now(ep, peer, msg, in_flight)):
                    tg.start_soon(self._serve_pull, ep, peer, msg, in_flight)
            elif isinstance(msg, wire.Release):
                released = self.store.release(msg.request_id, handle=msg.handle)
                log.debug("kv_released", request_id=msg.request_id, held=released)
                tg.start_soon(self._send_quietly, ep, wire.ReleaseOk(msg.txid, released), 2 * msg.txid)
            elif isinstance(msg, wire.Hold):
                for rid, handle in msg.items:
                    self.store.touch(rid, self._lease_s, handle=handle)
            else:
                self._malformed += 1
                log.warning("ucx_protocol_violation", peer=peer, reason=f"unexpected {type(msg).__name__} from a client")

    def _answer_malformed(self, ep: Any, peer: str | None, tg: anyio.abc.TaskGroup, exc: ProtocolViolation,
                          in_flight: set[int]) -> None:
        """Fail the one request a malformed frame names; drop a frame that names none."""
        kind, txid = getattr(exc, "kind", None), getattr(exc, "txid", None)
        log.warning("ucx_protocol_violation", peer=peer, message=kind.name if kind else None, txid=txid, reason=str(exc))
        if txid is None:
            return
        if kind is wire.MsgType.PULL:  # its data tag is 2*txid+1 (unless that pull is in flight)
            tg.start_soon(self._refuse, ep, txid, None, wire.Status.BAD_REQUEST, str(exc), txid not in in_flight)
        elif kind is wire.MsgType.RELEASE:
            tg.start_soon(self._send_quietly, ep, wire.ReleaseOk(txid, False), 2 * txid)

    async def _send_quietly(self, ep: Any, msg: wire.Message | bytearray, tag: int) -> None:
        try:
            if isinstance(msg, bytearray):
                await ep.send(msg, tag=tag)
            else:
                await self._send(ep, msg, tag)
        except Exception as exc:
            log.info("ucx_send_failed", reason=f"{type(exc).__name__}: {exc}")

    async def _refuse(self, ep: Any, txid: int, request_id: str | None, status: wire.Status, reason: str,
                      data: bool = True) -> None:
        """PULL_ERR on the reply tag, then (``data``) an empty message on the data tag: it ends the KV
        receive GEN posted with its PULL."""
        self._refused += 1
        log.debug("kv_pull_refused", request_id=request_id, reason=status.name)
        await self._send_quietly(ep, wire.PullErr(txid, status, reason[:120]), 2 * txid)
        if data:
            await self._send_quietly(ep, bytearray(), 2 * txid + 1)

    def _serve_now(self, ep: Any, peer: str | None, msg: wire.Pull, in_flight: set[int]) -> bool:
        """Serve a zero-copy PULL here, in the read loop, without a task: check it, pin a view of the
        pool, post the KV; its completion (a callback) unpins, counts and releases. False (nothing
        done) when the PULL needs the task path: a refusal (which that path sends), a gather."""
        if self._refusal(msg) is not None:
            return False
        self.store.touch(msg.request_id, self._lease_s, handle=msg.handle)  # a started pull renews the lease
        try:
            checkout = self.store.checkout_view(msg.request_id, msg.kv_slice, handle=msg.handle)
        except UnknownRequest:
            return False
        if checkout is None:
            return False
        buf = _ucx_buffer(checkout.tensor)
        if ends_in(buf, msg.probe):  # a PULL_WHOLE must follow: the task path sends it
            checkout.close()
            return False
        try:
            data = post_send(ep, buf, msg.tag)
        except Exception as exc:  # the endpoint broke: its reader sees it too
            checkout.close()
            in_flight.discard(msg.txid)
            self._pull_failed(ep, peer, msg, exc)
            return True
        key = (id(ep), msg.txid)
        deadline = self._send_deadline(ep, msg)

        def ended(fut: asyncio.Future[Any]) -> None:  # on the loop, when the send ends
            deadline.cancel()
            exc = RuntimeError("send cancelled") if fut.cancelled() else fut.exception()  # retrieved in any case
            if self._sending.pop(key, None) is None:  # the server closed it
                return
            in_flight.discard(msg.txid)
            checkout.close()  # UCX is done with the view
            if exc is not None:
                self._pull_failed(ep, peer, msg, exc)
            else:
                self._pull_served(msg)

        # the buffer and the request stay referenced until the send ends (ucxx keeps neither)
        self._sending[key] = (checkout, buf, data)
        data.future.add_done_callback(ended)
        return True

    def _send_deadline(self, ep: Any, msg: wire.Pull) -> asyncio.TimerHandle:
        """Abort ``ep`` if the KV send of ``msg`` has not ended ``send_timeout_s`` from now. A GEN
        stopped, hung or cut off with its pull posted never ends the send (UCX does not notice: the
        kernel still acknowledges), and a pinned entry outlives its lease: its blocks were held for
        good. The abort ends the send, whose callbacks unpin the blocks; the lease then frees them."""
        def overdue() -> None:
            self._sends_timed_out += 1
            log.warning("kv_send_timeout", peer=remote_address(ep), request_id=msg.request_id, bytes=msg.nbytes,
                        timeout_s=self.config.send_timeout_s)
            with contextlib.suppress(Exception):
                ep.abort(period=10**8)

        return asyncio.get_running_loop().call_later(self.config.send_timeout_s, overdue)

    async def _serve_pull(self, ep: Any, peer: str | None, msg: wire.Pull, in_flight: set[int]) -> None:
        """Serve one PULL. Pulls of the same request may run at once (tensor-parallel GEN ranks each
        pull their head slice of it): the checkout pins the blocks, so a release by one of them (or
        the lease) frees nothing under another's send; a pull that comes after the release is an
        unknown request."""
        try:
            await self._serve_pull_locked(ep, msg)
        except Exception as exc:  # ucxx: the endpoint broke mid-pull; the reader sees it too
            self._pull_failed(ep, peer, msg, exc)
        finally:
            in_flight.discard(msg.txid)

    def _pull_served(self, msg: wire.Pull) -> None:
        """A pull's send ended: count it and release the entry unless the PULL said KEEP."""
        self._served += 1
        self._bytes += msg.nbytes
        if msg.release:
            self.store.release(msg.request_id, handle=msg.handle)
        log.debug("kv_pull_served", request_id=msg.request_id, bytes=msg.nbytes, released=msg.release)

    @staticmethod
    def _pull_failed(ep: Any, peer: str | None, msg: wire.Pull, exc: BaseException) -> None:
        """A send of a pull failed: the endpoint is broken (its reader sees it too); close it."""
        log.info("kv_pull_failed", peer=peer, request_id=msg.request_id, reason=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            ep.abort(period=10**8)

    def _refusal(self, msg: wire.Pull) -> tuple[wire.Status, str] | None:
        """Why this node refuses ``msg`` (a status and a reason), or None: the entry is held under
        this handle, the slice fits the layout, and the dtype and shape are those of what it holds."""
        layout = self.store.layout
        try:
            num_blocks = self.store.num_blocks(msg.request_id, handle=msg.handle)
        except UnknownRequest:
            return wire.Status.UNKNOWN_REQUEST, "no KV held for this request"
        try:
            layout.check_slice(msg.kv_slice)
        except ValueError as exc:
            return wire.Status.BAD_REQUEST, str(exc)
        want = (self._dtype, layout.wire_shape(num_blocks, msg.kv_slice))
        if (msg.dtype, msg.shape) != want:
            return wire.Status.SHAPE_MISMATCH, f"have {want[0]}{list(want[1])}, asked {msg.dtype}{list(msg.shape)}"
        return None

    async def _serve_pull_locked(self, ep: Any, msg: wire.Pull) -> None:
        refusal = self._refusal(msg)
        if refusal is not None:
            await self._refuse(ep, msg.txid, msg.request_id, *refusal)
            return
        self.store.touch(msg.request_id, self._lease_s, handle=msg.handle)  # a started pull renews the lease
        try:  # pinned: neither a RELEASE nor the lease can free the blocks while they are sent
            checkout = self.store.checkout_view(msg.request_id, msg.kv_slice, handle=msg.handle)
            if checkout is not None:  # zero-copy: no gather, no thread
                with checkout:
                    await self._send_checked_out(ep, msg, checkout.tensor)
                return
            async with self._gather_slot(msg.request_id):  # bounded copies of one request at once
                if msg.nbytes <= _INLINE_GATHER_BYTES:  # cheaper than a hop to a worker thread
                    checkout = self.store.checkout(msg.request_id, msg.kv_slice, handle=msg.handle)
                else:
                    checkout = await anyio.to_thread.run_sync(
                        lambda: self.store.checkout(msg.request_id, msg.kv_slice, handle=msg.handle))
                with checkout:
                    await self._send_checked_out(ep, msg, checkout.tensor)
        except UnknownRequest:
            await self._refuse(ep, msg.txid, msg.request_id, wire.Status.UNKNOWN_REQUEST, "released while preparing")

    @contextlib.asynccontextmanager
    async def _gather_slot(self, request_id: str) -> AsyncIterator[None]:
        """One of ``max_gathers_per_request`` slots for a gathered copy of ``request_id`` (a GEN that
        pulls one request many times at once cannot make this node hold many copies of it)."""
        entry = self._gathers.get(request_id)
        if entry is None:
            entry = self._gathers[request_id] = (anyio.Semaphore(self.config.max_gathers_per_request), [0])
        slots, users = entry
        users[0] += 1
        try:
            async with slots:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._gathers[request_id]

    def gathers_in_flight(self, request_id: str) -> int:
        """Gathered copies of ``request_id`` being made or sent now (for tests and stats)."""
        entry = self._gathers.get(request_id)
        return 0 if entry is None else self.config.max_gathers_per_request - entry[0].value

    async def _send_checked_out(self, ep: Any, msg: wire.Pull, staged: torch.Tensor) -> None:
        """The KV on the pull's data tag; and, when what is sent ends in the PULL's probe byte (GEN
        cannot tell it from a short message then), a PULL_WHOLE naming its length on the reply tag."""
        await self._before_send(msg)
        buf = _ucx_buffer(staged)
        whole = ends_in(buf, msg.probe)
        data = post_send(ep, buf, msg.tag)
        deadline = self._send_deadline(ep, msg)
        keep = (buf, staged, data)  # referenced until the send ended (ucxx keeps neither the buffer nor the
        # request), also when this task is cancelled; its outcome is read then (no "never retrieved")
        data.future.add_done_callback(lambda f: (keep, deadline.cancel(), f.cancelled() or f.exception()))
        if whole:
            self._whole += 1
            await self._send_quietly(ep, wire.PullWhole(msg.txid, len(buf)), 2 * msg.txid)
        await asyncio.shield(data.future)
        self._pull_served(msg)
