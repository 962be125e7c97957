"""The UCX (ucxx) data plane: ``UCXTransport`` on the GEN node, ``UCXKVServer`` on the CTX node.

One endpoint per peer, reused by every pull; control messages are ``wire`` frames, KV moves as
one tagged message straight into the caller's ``into`` tensor (CPU or CUDA). Tags, per endpoint
(ucxx hashes them with the endpoint's own tag, so endpoints never see each other's messages)::

    GEN -> CTX   tag 0          every control frame (AUTH_RESPONSE, PULL, RELEASE, HOLD)
    CTX -> GEN   tag 0          handshake frames (AUTH_CHALLENGE, AUTH_OK, AUTH_FAIL)
    CTX -> GEN   tag 2*txid     the reply to the GEN request ``txid`` (PULL_ERR, RELEASE_OK; PULL_WHOLE to a
                                served pull whose KV ends in the PULL's probe byte, 1 in 256; else none)
    CTX -> GEN   tag 2*txid+1   the KV of pull ``txid``, or an empty message (after a PULL_ERR)

A pull is two messages, as the library's own exchange: GEN posts the receive of the KV (into
``into``, a random byte, the probe, over its last byte), then sends PULL naming the probe; CTX
answers with the KV alone; GEN checks that all of it landed (``wire`` draws it: ucxx reports no
length; a short message never writes the last byte). Only a receive that ends with the probe still
there makes GEN receive the reply: a PULL_WHOLE (the KV ends in that byte) or a PULL_ERR. Sends
and receives are posted as ucxx requests whose futures end with them (``_ucx_common``): no task per
message, and the pulling task wakes once (``_ucx_endpoint._PullIO``).

Life cycle of a GEN endpoint::

    connect (one attempt per peer at a time, shared by every pull waiting for it):
        TCP probe (a refused port fails at once) -> create_endpoint -> handshake (mutual HMAC,
        the CTX's KV layout checked once) -> usable, at most ``max_pulls`` pulls in flight on it
        a failed connect marks the peer down for ``dead_peer_backoff_s``: pulls to it fail at once
    usable  --ucxx error / close callback--> failed: its pulls fail with PeerClosed, it is
            dropped; a pull that fails on a reused endpoint before its KV landed (a CTX that
            restarted while idle) reconnects once, once its old receive has ended
    a cancelled pull returns at once; its KV may still come into ``into`` (a posted receive cannot
    be withdrawn), so its ``Landing`` stays busy until UCX ends that: the CTX answers every PULL
    with one data message, and a pull whose KV receive has not ended ``cancel_grace_s`` later
    costs the endpoint (closing it cancels what is posted).
    a short or long KV message, or a reply longer than a frame, fails its pull alone
    (ProtocolViolation); the endpoint stays (unless more than ``MAX_UNANSWERED`` short messages came
    without a PULL_ERR).

ucxx reads its settings from the environment when its context is created, so ``apply_ucx_defaults``
(called by both constructors) sets measured defaults with ``os.environ.setdefault``; a user's
environment wins. See docs/transport.md for the measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

import anyio
import structlog
import torch

from . import _auth, wire
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
from ._ids import InvalidRequestId, check_handle, check_request_id, hold_items
from ._layout import KVLayout, KVSlice, dtype_name
from ._peers import PeerConnections, check_layout
from ._protocol import Landing, parse_peer
from ._ucx_common import (
    CONTROL_TAG as CONTROL_TAG,
    UCX_DEFAULTS as UCX_DEFAULTS,
    UCXConfig as UCXConfig,
    _ucx_acquire,
    _ucx_buffer as _ucx_buffer,
    _ucx_release,
    apply_ucx_defaults as apply_ucx_defaults,
)
from ._ucx_endpoint import _cancelled, _consume, _Endpoint, _NothingMoved, _PullIO

log = structlog.get_logger("transports.ucx")


@dataclasses.dataclass(frozen=True)
class UCXTransportStatistics:
    endpoints: int
    pulls_ok: int
    pulls_failed: int
    pulls_retried: int
    bytes_moved: int
    peers_down: int


class UCXTransport:
    """GEN side of the data plane (implements ``transports.Transport``).

    ``layout``: this node's KV layout; a peer whose layout differs (layers, head size, block size,
    dtype, or a different number of KV heads in the model than ``total_kv_heads``, default
    ``layout.num_kv_heads``) is refused once at connect with ``IncompatiblePeer``.
    """

    name = "ucx"
    requires_handle = True

    def __init__(self, config: UCXConfig, *, layout: KVLayout | None = None, total_kv_heads: int | None = None) -> None:
        self.config = config
        self.layout = layout
        self.total_kv_heads = total_kv_heads if total_kv_heads is not None else (layout.num_kv_heads if layout else None)
        apply_ucx_defaults(dict(config.ucx_env))
        config._warn_if_insecure("gen")
        self._ucxx: Any = None
        # one connect attempt per peer, dead-peer backoff, at most max_peers (shared with transports.nixl)
        self._peers: PeerConnections[_Endpoint] = PeerConnections(
            self._open, max_peers=config.max_peers, backoff_s=config.dead_peer_backoff_s,
            usable=lambda c: c.error is None, discard=lambda c: c.abort())
        self._background: set[asyncio.Future[Any]] = set()
        self._unanswered: dict[str, asyncio.Future[Any]] = {}  # connects given up on, still running (see _create_endpoint)
        self._txids = itertools.count(1)
        self._pulls_ok = 0
        self._pulls_failed = 0
        self._retried = 0
        self._bytes = 0
        self._closed = False

    def statistics(self) -> UCXTransportStatistics:
        return UCXTransportStatistics(self._peers.live, self._pulls_ok, self._pulls_failed, self._retried, self._bytes,
                                      self._peers.down)

    @property
    def _eps(self) -> dict[str, _Endpoint]:
        return self._peers.conns

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<UCXTransport [{s.endpoints} endpoints, {s.pulls_ok} ok, {s.pulls_failed} failed, {s.bytes_moved} bytes]>"

    async def connect(self, peer: str) -> None:
        await self._endpoint(peer)

    def connected(self, peer: str) -> bool:
        return self._peers.has(peer)

    async def _endpoint(self, peer: str) -> _Endpoint:
        return await self._peers.get(peer)

    async def _open(self, peer: str) -> _Endpoint:
        try:
            host, port = parse_peer(peer)
        except ValueError as exc:
            raise PeerUnreachable(str(exc), peer=peer) from None
        timeout = self.config.connect_timeout_s
        try:  # a refused port fails here at once (ucxx itself would wait out the whole timeout)
            with anyio.fail_after(timeout):
                probe = await anyio.connect_tcp(host, port)
            await probe.aclose()
        except TimeoutError as exc:
            raise PeerUnreachable(f"connect to {peer} timed out after {timeout}s", peer=peer) from exc
        except OSError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc  # anyio wraps the last attempt's error
            why = os.strerror(cause.errno) if cause.errno else str(cause)  # e.g. "Connection refused"
            raise PeerUnreachable(f"connect to {peer} failed: {why}", peer=peer) from exc
        if self._ucxx is None:
            self._ucxx = _ucx_acquire()
        ep = await self._create_endpoint(peer, host, port, timeout)
        conn = _Endpoint(peer, ep, self.config.limits)
        try:
            conn.watch_close()
            with anyio.fail_after(self.config.handshake_timeout_s):
                info = await self._handshake(conn)
            self._check_layout(peer, info)
        except TimeoutError as exc:
            conn.abort()
            raise PeerUnreachable(f"handshake with {peer} timed out", peer=peer) from exc
        except BaseException:
            conn.abort()
            raise
        conn.info = info
        conn.slots = anyio.Semaphore(info.max_pulls)
        log.info("ucx_connected", peer=peer, max_pulls=info.max_pulls, lease_ms=info.lease_ms)
        return conn

    async def _create_endpoint(self, peer: str, host: str, port: int, timeout: float) -> Any:
        """ucxx's ``create_endpoint``, never cancelled: cancelling it (or its own ``connect_timeout``)
        while the peer has not answered ucxx's peer-info exchange leaves that exchange's receive
        posted into a buffer Python then frees, and the process dies of a segmentation fault when
        the peer answers after all (a CTX stopped with SIGSTOP, then continued). So the call gets no
        timeout of its own and runs to its end; past ``timeout`` this connect fails and the call is
        left to finish (the peer answers, then its endpoint is closed, or fails, or the transport
        closes), and until it has, a new connect to that peer fails at once."""
        pending = self._unanswered.get(peer)
        if pending is not None and not pending.done():
            raise PeerUnreachable(f"connect to {peer}: an earlier connect is still unanswered "
                                  "(the peer accepted TCP but its UCX does not answer: stopped or hung?)", peer=peer)
        call = asyncio.ensure_future(self._ucxx.create_endpoint(host, port, endpoint_error_handling=True,
                                                                connect_timeout=None))
        try:
            await asyncio.wait({call}, timeout=timeout)  # cancelling this wait leaves ``call`` running
        finally:
            if not call.done():
                self._unanswered[peer] = call
                call.add_done_callback(lambda fut: self._abandoned(peer, fut))
        if not call.done():
            log.warning("ucx_connect_unanswered", peer=peer, timeout_s=timeout)
            raise PeerUnreachable(f"connect to {peer} timed out after {timeout}s", peer=peer) from TimeoutError()
        try:
            return call.result()
        except Exception as exc:
            raise PeerUnreachable(f"connect to {peer} failed: {type(exc).__name__}: {exc}", peer=peer) from exc

    def _abandoned(self, peer: str, call: asyncio.Future[Any]) -> None:
        """A connect given up on has ended: close what it made (or consume its error)."""
        if self._unanswered.get(peer) is call:
            del self._unanswered[peer]
        if call.cancelled():
            return
        if call.exception() is None:
            ep = call.result()
            with contextlib.suppress(Exception):
                ep.abort()
            log.info("ucx_connect_answered_late", peer=peer)

    def _check_layout(self, peer: str, info: wire.PeerInfo) -> None:
        layout = self.layout
        if layout is None:
            return
        theirs = (info.num_layers, info.total_kv_heads, info.head_dim, info.block_size, info.dtype)
        try:
            check_layout(peer, theirs, layout, self.total_kv_heads)
        except IncompatiblePeer as err:
            log.error("ucx_incompatible_peer", peer=peer, reason=str(err))
            raise

    async def _handshake(self, conn: _Endpoint) -> wire.PeerInfo:
        peer, secret = conn.peer, self.config.secret
        challenge = await conn.recv(CONTROL_TAG)
        if not isinstance(challenge, wire.AuthChallenge):
            raise ProtocolViolation(f"expected AUTH_CHALLENGE from {peer}, got {type(challenge).__name__}", peer=peer)
        if challenge.auth_required and secret is None:
            raise AuthenticationFailed(f"{peer} requires authentication and no secret is configured", peer=peer)
        if not challenge.auth_required and not self.config.allow_insecure:
            raise AuthenticationFailed(f"{peer} does not authenticate and allow_insecure is off", peer=peer)
        nonce = _auth.new_nonce()
        use_secret = challenge.auth_required and secret is not None
        mac = _auth.client_mac(secret, challenge.nonce, nonce) if use_secret else bytes(wire.MAC_BYTES)
        await conn.send(wire.AuthResponse(nonce, mac))
        try:
            reply = await conn.recv(CONTROL_TAG)
        except PeerClosed as exc:
            raise AuthenticationFailed(f"{peer} closed the connection during the handshake", peer=peer) from exc
        if isinstance(reply, wire.AuthFail):
            raise AuthenticationFailed(f"{peer} rejected us: {reply.reason}", peer=peer)
        if not isinstance(reply, wire.AuthOk):
            raise ProtocolViolation(f"expected AUTH_OK from {peer}, got {type(reply).__name__}", peer=peer)
        expected = _auth.server_mac(secret, challenge.nonce, nonce, wire.info_bytes(reply.info)) if use_secret else None
        if expected is not None and not _auth.verify(expected, reply.mac):
            raise AuthenticationFailed(f"{peer} did not prove it holds the shared secret", peer=peer)
        return reply.info

    def _pull_message(
        self, peer: str, request_id: str, handle: str | None, kv_slice: KVSlice, into: torch.Tensor, release: bool
    ) -> wire.Pull:
        """Build (and so validate) the PULL locally; a bad request never reaches the network. The
        checks are those the CTX's ``decode`` makes that a local caller could break (no re-encode)."""
        try:
            check_request_id(request_id)
            check_handle(handle)
            dtype = dtype_name(into.dtype)
        except (InvalidRequestId, ValueError) as exc:
            raise ProtocolViolation(f"cannot pull {request_id!r}: {exc}", peer=peer) from None
        shape = tuple(int(d) for d in into.shape)
        if not into.is_contiguous():
            raise ProtocolViolation("`into` must be contiguous", peer=peer)
        if len(shape) != 6 or shape[1] != kv_slice.num_layers or shape[2] != 2 or shape[3] != kv_slice.num_heads:
            raise ProtocolViolation(f"`into` of shape {shape} does not hold slice {kv_slice}", peer=peer)
        limits = self.config.limits
        nbytes = into.numel() * into.element_size()
        if (not 0 < nbytes <= limits.max_transfer_bytes or len(request_id) > limits.max_request_id_len
                or kv_slice.num_layers > limits.max_layers or kv_slice.num_heads > limits.max_heads
                or max(shape) > limits.max_dim):
            raise ProtocolViolation(f"PULL of {request_id!r} ({nbytes} B, {shape}) would break the wire limits", peer=peer)
        return wire.Pull(0, request_id, handle, kv_slice, dtype, shape, nbytes, 0, release)  # type: ignore[arg-type]

    async def pull(
        self,
        peer: str,
        request_id: str,
        kv_slice: KVSlice,
        into: torch.Tensor,
        *,
        handle: str | None = None,
        release: bool = True,
        landing: Landing | None = None,
        remote_blocks: Sequence[int] | None = None,
        remote_epoch: int | None = None,
    ) -> int:
        """Pull into ``into``; with ``release`` (the default) the CTX frees the entry once it is sent,
        without it (every chunk of a chunked receive but the last) the CTX keeps it.
        ``remote_blocks`` and ``remote_epoch`` are not needed (the CTX gathers its own blocks) and ignored."""
        template = self._pull_message(peer, request_id, handle, kv_slice, into, release)
        landing = landing if landing is not None else Landing()
        try:
            n = await self._pull(peer, template, into, landing)
        except BaseException:
            self._pulls_failed += 1
            raise
        self._pulls_ok += 1
        self._bytes += n
        return n

    async def _pull(self, peer: str, template: wire.Pull, into: torch.Tensor, landing: Landing) -> int:
        conn = await self._endpoint(peer)
        reused = conn.served > 0  # it served before: the peer may have restarted since
        try:
            return await self._pull_once(conn, template, into, landing)
        except _NothingMoved as nothing:
            if not reused:
                raise nothing.error from None
            self._retried += 1
            log.info("ucx_pull_retry", peer=peer, request_id=template.request_id, reason=str(nothing.error))
        await self._until_idle(landing)  # the dropped endpoint cancels the old receive
        conn = await self._endpoint(peer)
        try:
            return await self._pull_once(conn, template, into, landing)
        except _NothingMoved as nothing:
            raise nothing.error from None

    async def _until_idle(self, landing: Landing) -> None:
        idle = anyio.Event()
        landing.when_idle(idle.set)
        await idle.wait()

    async def _pull_once(self, conn: _Endpoint, template: wire.Pull, into: torch.Tensor, landing: Landing) -> int:
        peer = conn.peer
        slots = conn.slots
        assert slots is not None
        try:
            slots.acquire_nowait()  # no checkpoint when a slot is free (FIFO: fails while others wait)
        except anyio.WouldBlock:
            await slots.acquire()
        try:
            txid = next(self._txids)
            t = template
            io = _PullIO(conn, into, txid, landing, self.config.cancel_grace_s)  # `into` busy until its outcome is known
            msg = wire.Pull(txid, t.request_id, t.handle, t.kv_slice, t.dtype, t.shape, t.nbytes, 2 * txid + 1, t.release,
                            io.probe)
            try:
                io.post(msg)
            except PeerClosed as exc:
                raise _NothingMoved(exc) from None
            try:
                await io.woken
            except _cancelled():
                self._reap(io)
                raise
            finally:
                if conn.error is not None and self._eps.get(peer) is conn:
                    del self._eps[peer]
        finally:
            slots.release()
        if io.refusal is not None:
            raise _pull_error(io.refusal, peer, msg.request_id)
        if io.error is not None:
            if isinstance(io.error, PeerClosed):  # the endpoint broke before the KV landed
                raise _NothingMoved(io.error)
            raise io.error
        conn.served += 1
        log.debug("ucx_pull_done", peer=peer, request_id=msg.request_id, bytes=msg.nbytes)
        return msg.nbytes

    def _reap(self, io: _PullIO) -> None:
        """A pull was cancelled while its KV receive may still be posted: give the CTX
        ``cancel_grace_s`` to send what ends it (the KV, or the empty message after a refusal, whose
        PULL_ERR ``_PullIO`` then receives), then close the endpoint, which cancels what is still
        posted. ``into`` stays busy (its landing) until then."""
        if io.kv_future is None or io.kv_done or io.reaping:
            return
        io.reaping = True
        conn = io.conn

        async def reap() -> None:
            with anyio.move_on_after(self.config.cancel_grace_s):
                await io.wait_kv()
                return
            conn.fail(PeerClosed(f"a pull from {conn.peer} was still unanswered {self.config.cancel_grace_s}s "
                                 "after it ended early; endpoint dropped", peer=conn.peer))

        task = asyncio.ensure_future(reap())
        task.add_done_callback(_consume)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, peer: str, request_id: str, *, handle: str | None = None) -> None:
        """Best effort: tell ``peer`` to free ``request_id``; failures are logged, not raised."""
        try:
            check_request_id(request_id)
            check_handle(handle)
        except (InvalidRequestId, ValueError) as exc:
            log.warning("ucx_release_failed", peer=peer, request_id=str(request_id)[:40], reason=str(exc))
            return
        answered: asyncio.Future[Any] | None = None
        try:
            with anyio.fail_after(self.config.release_timeout_s + self.config.connect_timeout_s):
                conn = await self._endpoint(peer)
                txid = next(self._txids)
                frame = bytearray(wire.FRAME_BYTES)
                answered = conn.post(frame, 2 * txid)
                conn.post_send(wire.Release(txid, request_id, handle))  # type: ignore[arg-type]
                await asyncio.shield(answered)
            reply = conn.decode(frame)
            if not isinstance(reply, wire.ReleaseOk) or reply.txid != txid:
                raise ProtocolViolation(f"{peer} sent an unexpected reply to RELEASE: {reply!r}", peer=peer)
            log.debug("ucx_released", peer=peer, request_id=request_id, held=reply.released)
        except (TransportError, TimeoutError) as exc:
            log.warning("ucx_release_failed", peer=peer, request_id=request_id, reason=str(exc) or type(exc).__name__)
        finally:
            if answered is not None and not answered.done():  # its reply receive stays posted
                conn.unanswered_release(answered)

    async def hold(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        """Best effort: ask ``peer`` to renew these requests' leases (no reply is awaited). An item
        with a bad request id or handle is dropped here (logged): one that cannot be encoded would
        fail the endpoint, one the peer cannot decode would cost the whole HOLD frame."""
        valid = hold_items(items, peer, log, "ucx_hold_item_dropped")
        if not valid:
            return
        try:
            conn = await self._endpoint(peer)
            for frame in wire.hold_frames(valid, next(self._txids)):  # type: ignore[arg-type]
                await conn.send(frame)
        except TransportError as exc:
            log.info("ucx_hold_failed", peer=peer, requests=len(valid), reason=str(exc))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        for conn in self._peers.close():
            conn.abort()
        if self._ucxx is not None:
            self._ucxx = None
            _ucx_release()

    async def __aenter__(self) -> UCXTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _pull_error(reply: wire.PullErr, peer: str, request_id: str) -> TransportError:
    text = f"{peer} refused pull of {request_id!r}: {reply.status.name}: {reply.reason}"
    match reply.status:
        case wire.Status.UNKNOWN_REQUEST:
            return UnknownRequest(text, peer=peer)
        case wire.Status.SHAPE_MISMATCH | wire.Status.BAD_REQUEST:
            return ProtocolViolation(text, peer=peer)
        case wire.Status.AUTH_FAILED:
            return AuthenticationFailed(text, peer=peer)
        case wire.Status.BUSY:
            return PeerBusy(text, peer=peer)
        case _:
            return TransportError(text, peer=peer)


from ._ucx_server import UCXKVServer as UCXKVServer  # noqa: E402  (the CTX side, which imports this module)
from ._ucx_server import UCXKVServerStatistics as UCXKVServerStatistics  # noqa: E402
