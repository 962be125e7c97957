"""The UCX (ucxx) data plane: ``UCXTransport`` on the GEN node, ``UCXKVServer`` on the CTX node.

One endpoint per peer, reused by every pull; control messages are ``wire`` frames, KV moves as
one tagged message straight into the caller's ``into`` tensor (CPU or CUDA). Tags, per endpoint
(ucxx hashes them with the endpoint's own tag, so endpoints never see each other's messages)::

    GEN -> CTX   tag 0          every control frame (AUTH_RESPONSE, PULL, READY, ABORT, RELEASE)
    CTX -> GEN   tag 0          handshake frames (AUTH_CHALLENGE, AUTH_OK, AUTH_FAIL)
    CTX -> GEN   tag 2*txid     the reply to the GEN request ``txid`` (PULL_OK/PULL_ERR/RELEASE_OK)
    CTX -> GEN   tag 2*txid+1   the KV of pull ``txid`` (proposed in PULL, echoed in PULL_OK)

Life cycle of a GEN endpoint::

    connect: create_endpoint -> handshake (mutual HMAC) -> usable
    usable  --ucxx error / peer killed / bad reply--> failed: the pulls on it fail with PeerClosed
            and it is dropped, so the next connect to that address makes a new one
    a pull cancelled before READY sends ABORT (endpoint stays usable); a pull cancelled after
    READY (its receive into ``into`` is posted and cannot be withdrawn) waits up to
    ``cancel_grace_s`` for the transfer to end, and fails the endpoint only if it does not.

ucxx reads its settings from the environment when its context is created, so ``apply_ucx_defaults``
(called by both constructors) sets measured defaults with ``os.environ.setdefault``; a user's
environment wins. See docs/transport.md for the measurements.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import threading
from typing import Any

import anyio
import structlog
import torch

from . import _auth, wire
from ._errors import (
    AuthenticationFailed,
    PeerClosed,
    PeerUnreachable,
    ProtocolViolation,
    TransportError,
    UnknownRequest,
)
from ._layout import KVSlice, dtype_name

log = structlog.get_logger("transports.ucx")

CONTROL_TAG = 0
_INLINE_GATHER_BYTES = 1 << 20  # CTX: gathers up to this size run on the event loop

# Chosen from measurements on one host (docs/transport.md): put_zcopy rendezvous instead of the
# tcp default; shared memory and cma zero-copy stay enabled with peer-failure detection on; the
# `thread` progress mode with Python futures is the only one that leaves a core idle at rest.
UCX_DEFAULTS: dict[str, str] = {
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_CMA_SEG_SIZE": "4M",
    "UCX_TCP_CM_REUSEADDR": "y",  # a restarted CTX can listen on its old port at once
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 warns about
}


def apply_ucx_defaults(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``UCX_DEFAULTS`` (and ``extra``) where the environment does not; returns what is in effect.

    Must run before ucxx creates its context (the first endpoint or listener of the process).
    """
    for key, value in {**UCX_DEFAULTS, **(extra or {})}.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in {**UCX_DEFAULTS, **(extra or {})}}


# -- ucxx context ownership: the last owner in a process resets ucxx (stops its notifier thread) --

_owners = 0
_owners_lock = threading.Lock()


def _ucx_acquire() -> Any:
    global _owners
    import ucxx

    with _owners_lock:
        _owners += 1
    return ucxx


def _ucx_release() -> None:
    global _owners
    with _owners_lock:
        _owners -= 1
        last = _owners == 0
    if last:
        import ucxx

        try:
            ucxx.reset()
        except Exception as exc:  # references still alive somewhere; the context is freed later
            log.debug("ucx_reset_deferred", reason=repr(exc))


@dataclasses.dataclass(frozen=True)
class UCXConfig:
    """Settings of both ends. ``secret`` is required unless ``allow_insecure`` is set."""

    secret: bytes | None = dataclasses.field(default=None, repr=False)
    allow_insecure: bool = False
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    ready_timeout_s: float = 30.0  # CTX: how long a PULL_OK waits for READY/ABORT
    release_timeout_s: float = 2.0
    cancel_grace_s: float = 2.0  # GEN: a pull cancelled mid-transfer waits this long for it to end
    expire_interval_s: float = 1.0  # CTX: lease expiry period
    max_pulls_per_endpoint: int = 256  # CTX: more in flight on one endpoint are refused (BUSY)
    limits: wire.WireLimits = dataclasses.field(default_factory=wire.WireLimits)
    ucx_env: tuple[tuple[str, str], ...] = ()  # extra UCX defaults, e.g. (("UCX_TLS", "tcp"),)

    def __post_init__(self) -> None:
        if self.secret is None and not self.allow_insecure:
            raise ValueError(
                "UCXConfig needs a shared secret (transports._auth.load_secret(), env KVO_SHARED_SECRET) "
                "or allow_insecure=True"
            )
        if self.secret is not None and len(self.secret) < _auth.MIN_SECRET_BYTES:
            raise ValueError(f"shared secret must be at least {_auth.MIN_SECRET_BYTES} bytes")

    def _warn_if_insecure(self, role: str) -> None:
        if self.secret is None:
            log.warning("ucx_auth_disabled", role=role, reason="allow_insecure=True and no secret")


def parse_peer(peer: str) -> tuple[str, int]:
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer must be 'host:port', got {peer!r}")
    return host.strip("[]"), int(port)


def _ucx_buffer(t: torch.Tensor) -> Any:
    """A view of a contiguous tensor's bytes that ucxx accepts (buffer protocol or CUDA interface)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def _cancelled() -> type[BaseException]:
    return anyio.get_cancelled_exc_class()


# -- GEN side -------------------------------------------------------------------------------------


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome so that asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Endpoint:
    """One authenticated ucxx endpoint to a CTX peer, and the failure that ended it (if any)."""

    def __init__(self, peer: str, ep: Any, limits: wire.WireLimits) -> None:
        self.peer = peer
        self.ep = ep
        self.limits = limits
        self.error: TransportError | None = None
        self._orphans: list[bytearray] = []  # frames of cancelled receives that UCX may still fill

    def _check(self) -> None:
        if self.error is not None:
            raise PeerClosed(f"endpoint to {self.peer} failed earlier: {self.error}", peer=self.peer)

    async def _io(self, coro: Any) -> Any:
        try:
            return await coro
        except (TransportError, _cancelled()):
            raise
        except Exception as exc:
            err = PeerClosed(f"connection to {self.peer} broke: {type(exc).__name__}: {exc}", peer=self.peer)
            self.fail(err)
            raise err from exc

    async def send(self, msg: wire.Message) -> None:
        self._check()
        await self._io(self.ep.send(wire.encode_frame(msg), tag=CONTROL_TAG))

    async def recv(self, tag: int) -> wire.Message:
        self._check()
        frame = bytearray(wire.FRAME_BYTES)
        try:
            await self._io(self.ep.recv(frame, tag=tag))
        except _cancelled():
            self._orphans.append(frame)  # the posted receive cannot be withdrawn; keep its memory
            raise
        return wire.decode_frame(frame, self.limits)

    async def receive_data(self, ready: wire.Ready, buf: Any, tag: int, grace_s: float) -> None:
        """Post the receive of the KV into ``buf``, send READY, wait for the KV.

        Once READY may have left, the receive cannot be withdrawn, and with a put-based transport
        (cma, RDMA) the CTX writes straight into ``buf``. So a cancelled caller waits, shielded,
        up to ``grace_s`` for the transfer to end (the endpoint stays usable); only a transfer
        that does not end in time costs the endpoint. ``buf`` is never written after this returns,
        except by a peer that stalls past ``grace_s`` and then resumes (documented limitation).
        """
        self._check()
        task = asyncio.ensure_future(self._io(self.ep.recv(buf, tag=tag)))
        try:
            await self.send(ready)
            await asyncio.shield(task)
        except BaseException as exc:
            if not task.done():
                with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
                    await asyncio.wait([task])
            if not task.done():
                task.add_done_callback(_consume)
                self.fail(PeerClosed(f"receive on {self.peer} still busy {grace_s}s after {type(exc).__name__}; "
                                     "endpoint dropped", peer=self.peer))
            else:
                _consume(task)
            raise

    def fail(self, err: TransportError) -> None:
        if self.error is None:
            self.error = err
            log.warning("ucx_endpoint_failed", peer=self.peer, reason=str(err))
        self.abort()

    def abort(self) -> None:
        ep, self.ep = self.ep, None
        if ep is not None:
            try:
                ep.abort(period=10**8)
            except Exception as exc:
                log.debug("ucx_abort_error", peer=self.peer, reason=repr(exc))
        if self.error is None:
            self.error = PeerClosed(f"endpoint to {self.peer} closed", peer=self.peer)


@dataclasses.dataclass(frozen=True)
class UCXTransportStatistics:
    endpoints: int
    pulls_ok: int
    pulls_failed: int
    bytes_moved: int


class UCXTransport:
    """GEN side of the data plane (implements ``transports.Transport``)."""

    name = "ucx"

    def __init__(self, config: UCXConfig) -> None:
        self.config = config
        apply_ucx_defaults(dict(config.ucx_env))
        config._warn_if_insecure("gen")
        self._ucxx: Any = None
        self._eps: dict[str, _Endpoint] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._txids = itertools.count(1)
        self._pulls_ok = 0
        self._pulls_failed = 0
        self._bytes = 0
        self._closed = False

    def statistics(self) -> UCXTransportStatistics:
        return UCXTransportStatistics(len(self._eps), self._pulls_ok, self._pulls_failed, self._bytes)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<UCXTransport [{s.endpoints} endpoints, {s.pulls_ok} ok, {s.pulls_failed} failed, {s.bytes_moved} bytes]>"

    async def connect(self, peer: str) -> None:
        await self._endpoint(peer)

    async def _endpoint(self, peer: str) -> _Endpoint:
        if self._closed:
            raise PeerClosed("transport is closed", peer=peer)
        conn = self._eps.get(peer)
        if conn is not None and conn.error is None:
            return conn
        lock = self._locks.setdefault(peer, anyio.Lock())
        async with lock:
            conn = self._eps.get(peer)
            if conn is not None and conn.error is None:
                return conn
            self._eps.pop(peer, None)
            conn = await self._open(peer)
            self._eps[peer] = conn
            return conn

    async def _open(self, peer: str) -> _Endpoint:
        try:
            host, port = parse_peer(peer)
        except ValueError as exc:
            raise PeerUnreachable(str(exc), peer=peer) from None
        if self._ucxx is None:
            self._ucxx = _ucx_acquire()
        timeout = self.config.connect_timeout_s
        try:
            with anyio.fail_after(timeout):
                ep = await self._ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=timeout)
        except TimeoutError as exc:
            raise PeerUnreachable(f"connect to {peer} timed out after {timeout}s", peer=peer) from exc
        except Exception as exc:
            raise PeerUnreachable(f"connect to {peer} failed: {type(exc).__name__}: {exc}", peer=peer) from exc
        conn = _Endpoint(peer, ep, self.config.limits)
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                await self._handshake(conn)
        except TimeoutError as exc:
            conn.abort()
            raise PeerUnreachable(f"handshake with {peer} timed out", peer=peer) from exc
        except BaseException:
            conn.abort()
            raise
        log.info("ucx_connected", peer=peer)
        return conn

    async def _handshake(self, conn: _Endpoint) -> None:
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
        if use_secret and not _auth.verify(_auth.server_mac(secret, challenge.nonce, nonce), reply.mac):
            raise AuthenticationFailed(f"{peer} did not prove it holds the shared secret", peer=peer)

    def _pull_message(self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor) -> wire.Pull:
        """Build (and so validate) the PULL locally; a bad request never reaches the network."""
        try:
            dtype = dtype_name(into.dtype)
        except ValueError as exc:
            raise ProtocolViolation(str(exc), peer=peer) from None
        shape = tuple(int(d) for d in into.shape)
        if not into.is_contiguous():
            raise ProtocolViolation("`into` must be contiguous", peer=peer)
        if len(shape) != 6 or shape[1] != kv_slice.num_layers or shape[2] != 2 or shape[3] != kv_slice.num_heads:
            raise ProtocolViolation(f"`into` of shape {shape} does not hold slice {kv_slice}", peer=peer)
        msg = wire.Pull(0, request_id, kv_slice, dtype, shape, math.prod(shape) * into.element_size(), 0)
        try:
            wire.decode(wire.encode(msg), self.config.limits)
        except (ValueError, UnicodeError) as exc:
            raise ProtocolViolation(f"cannot encode PULL: {exc}", peer=peer) from None
        except ProtocolViolation as exc:
            raise ProtocolViolation(f"PULL would break the protocol: {exc}", peer=peer) from None
        return msg

    async def pull(
        self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, *, release: bool = True
    ) -> int:
        """Pull into ``into``; with ``release`` (the default) the CTX frees the entry once it is sent,
        without it (every chunk of a chunked receive but the last) the CTX keeps it."""
        template = dataclasses.replace(self._pull_message(peer, request_id, kv_slice, into), release=release)
        try:
            n = await self._pull(peer, template, into)
        except BaseException:
            self._pulls_failed += 1
            raise
        self._pulls_ok += 1
        self._bytes += n
        return n

    async def _pull(self, peer: str, template: wire.Pull, into: torch.Tensor) -> int:
        conn = await self._endpoint(peer)
        txid = next(self._txids)
        msg = dataclasses.replace(template, txid=txid, tag=2 * txid + 1)
        phase = "request"
        try:
            await conn.send(msg)
            reply = await conn.recv(2 * txid)
            if isinstance(reply, wire.PullErr):
                phase = "refused"  # a refusal, not a broken peer: the endpoint stays
                raise _pull_error(reply, peer, msg.request_id)
            if not isinstance(reply, wire.PullOk) or reply.txid != txid:
                raise ProtocolViolation(f"unexpected reply to PULL {txid}: {reply!r}", peer=peer)
            expected = (msg.tag, msg.dtype, msg.shape, msg.nbytes)
            if (reply.tag, reply.dtype, reply.shape, reply.nbytes) != expected:
                await conn.send(wire.Abort(txid))
                raise ProtocolViolation(
                    f"PULL_OK {reply.dtype}{list(reply.shape)} ({reply.nbytes} B, tag {reply.tag}) does not match "
                    f"`into` {msg.dtype}{list(msg.shape)} ({msg.nbytes} B, tag {msg.tag})",
                    peer=peer,
                )
            phase = "data"
            await conn.receive_data(wire.Ready(txid), _ucx_buffer(into), msg.tag, self.config.cancel_grace_s)
            phase = "done"
        except _cancelled():
            with anyio.CancelScope(shield=True):
                await self._after_cancel(conn, txid, phase)
            raise
        except ProtocolViolation as exc:
            if phase != "refused":
                conn.fail(exc)  # the peer broke the protocol: do not trust this endpoint again
            raise
        finally:
            if conn.error is not None and self._eps.get(peer) is conn:
                del self._eps[peer]
        log.debug("ucx_pull_done", peer=peer, request_id=msg.request_id, bytes=msg.nbytes)
        return msg.nbytes

    async def _after_cancel(self, conn: _Endpoint, txid: int, phase: str) -> None:
        """A pull cancelled after PULL left and before READY: tell the CTX not to send (best effort)."""
        if phase == "request" and conn.error is None:
            with anyio.move_on_after(self.config.release_timeout_s):
                try:
                    await conn.send(wire.Abort(txid))
                except TransportError:
                    pass

    async def release(self, peer: str, request_id: str) -> None:
        """Best effort: tell ``peer`` to free ``request_id``; failures are logged, not raised."""
        try:
            with anyio.fail_after(self.config.release_timeout_s + self.config.connect_timeout_s):
                conn = await self._endpoint(peer)
                txid = next(self._txids)
                await conn.send(wire.Release(txid, request_id))
                reply = await conn.recv(2 * txid)
            if not isinstance(reply, wire.ReleaseOk) or reply.txid != txid:
                raise ProtocolViolation(f"unexpected reply to RELEASE: {reply!r}", peer=peer)
            log.debug("ucx_released", peer=peer, request_id=request_id, held=reply.released)
        except (TransportError, TimeoutError) as exc:
            log.warning("ucx_release_failed", peer=peer, request_id=request_id, reason=str(exc))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._eps.values()):
            conn.abort()
        self._eps.clear()
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
        case _:
            return TransportError(text, peer=peer)


from ._ucx_server import UCXKVServer as UCXKVServer  # noqa: E402  (the CTX side, which imports this module)
from ._ucx_server import UCXKVServerStatistics as UCXKVServerStatistics  # noqa: E402
