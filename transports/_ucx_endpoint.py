"""The GEN side's ucxx endpoint (``transports.ucx.UCXTransport``): one authenticated endpoint per CTX
peer, the requests posted on it (each a ucxx request whose future ends with it, its ucxx error
mapped: a broken endpoint fails, a truncated KV message fails its pull only), and one pull's
messages (``_PullIO``: its KV receive and the PULL, posted together; the ``Landing`` of ``into``,
the sentinel and the length check, the PULL_ERR received only when no KV came; one wake-up of the
pulling task)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import anyio
import numpy as np
import structlog
import torch

from . import wire
from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._protocol import Landing
from ._ucx_common import CONTROL_TAG, _ucx_buffer, post_recv, post_send, ucx_truncated

log = structlog.get_logger("transports.ucx")


def _cancelled() -> type[BaseException]:
    return anyio.get_cancelled_exc_class()


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome so that asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _outcome(fut: asyncio.Future[Any]) -> BaseException | None:
    """How a ucxx request's future ended: None when it succeeded, else its error (retrieved)."""
    if fut.cancelled():
        return RuntimeError("request cancelled")
    return fut.exception()


class _NothingMoved(Exception):
    """Internal: the endpoint failed before any of this pull's KV could have moved."""

    def __init__(self, error: TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class _Endpoint:
    """One authenticated ucxx endpoint to a CTX peer, and the failure that ended it (if any)."""

    def __init__(self, peer: str, ep: Any, limits: wire.WireLimits) -> None:
        self.peer = peer
        self.ep = ep
        self.limits = limits
        self.error: TransportError | None = None
        self.info: wire.PeerInfo | None = None
        self.slots: anyio.Semaphore | None = None  # pulls in flight, at most what the CTX serves
        self.served = 0  # pulls it completed (an endpoint that served before may have gone stale since)
        self.unanswered: set[_PullIO] = set()  # pulls failed short whose reply receive is still posted
        self.releases_unanswered = 0  # RELEASEs given up on whose reply receive is still posted

    def watch_close(self) -> None:
        """Fail this endpoint when UCX reports the peer gone (the callback may run on any thread)."""
        loop = asyncio.get_running_loop()

        def closed() -> None:
            try:
                loop.call_soon_threadsafe(self.fail, PeerClosed(f"{self.peer} closed the connection", peer=self.peer))
            except RuntimeError:  # the loop is gone
                pass

        self.ep.set_close_callback(closed)

    def _check(self) -> None:
        if self.error is not None:
            raise PeerClosed(f"endpoint to {self.peer} failed earlier: {self.error}", peer=self.peer)

    def _broke(self, exc: BaseException) -> TransportError:
        err = PeerClosed(f"connection to {self.peer} broke: {type(exc).__name__}: {exc}", peer=self.peer)
        err.__cause__ = exc
        self.fail(err)
        return err

    def _settled(self, req: Any, buf: Any) -> asyncio.Future[Any]:
        """A future that ends with the ucxx request ``req``, a ucxx error mapped (the endpoint
        fails; but a message longer than the receive's frame fails that receive alone, with
        ``ProtocolViolation``: UCX drops it and the endpoint is fine); its outcome is always
        retrieved. ``req`` and its buffer ``buf`` stay referenced until then (ucxx keeps neither)."""
        out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(fut: asyncio.Future[Any], req: Any = req, buf: Any = buf) -> None:
            if out.done():
                return
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled():
                out.set_exception(self._broke(RuntimeError("request cancelled")))
            elif exc is None:
                out.set_result(None)
            elif isinstance(exc, ucx_truncated()):
                out.set_exception(ProtocolViolation(f"{self.peer} sent a message longer than its {len(buf)}-byte frame",
                                                    peer=self.peer))
            else:
                out.set_exception(self._broke(exc))

        out.add_done_callback(_consume)
        req.future.add_done_callback(done)
        return out

    def post(self, buf: Any, tag: int) -> asyncio.Future[Any]:
        """Post a receive now; the returned future ends when UCX ends it."""
        self._check()
        try:
            return self._settled(post_recv(self.ep, buf, tag), buf)
        except Exception as exc:
            raise self._broke(exc) from exc

    def watch_send(self, req: Any, buf: Any) -> None:
        """A posted send nobody waits for: its failure fails the endpoint; ``buf`` stays referenced
        until it ends."""
        def ended(fut: asyncio.Future[Any], req: Any = req, buf: Any = buf) -> None:  # both referenced till then
            exc = _outcome(fut)
            if exc is not None:
                self._broke(exc)

        req.future.add_done_callback(ended)

    def post_send(self, msg: wire.Message) -> asyncio.Future[Any]:
        """Send a control frame without waiting for it: a failed send fails the endpoint (and so
        every receive posted on it)."""
        self._check()
        try:
            frame = wire.encode_frame(msg)
            return self._settled(post_send(self.ep, frame, CONTROL_TAG), frame)
        except Exception as exc:
            raise self._broke(exc) from exc

    async def send(self, msg: wire.Message) -> None:
        await asyncio.shield(self.post_send(msg))

    async def recv(self, tag: int) -> wire.Message:
        frame = bytearray(wire.FRAME_BYTES)
        fut = self.post(frame, tag)
        await asyncio.shield(fut)  # a cancelled caller leaves it posted: the peer answers every request
        return self.decode(frame)

    def decode(self, frame: bytearray) -> wire.Message:
        """A frame the peer sent; a malformed one is a ``ProtocolViolation`` whose message names the peer."""
        try:
            return wire.decode_frame(frame, self.limits)
        except ProtocolViolation as exc:
            raise ProtocolViolation(f"{self.peer} sent a malformed frame: {exc}", peer=self.peer) from None

    def unanswered_release(self, answered: asyncio.Future[Any]) -> None:
        """A RELEASE given up on (its timeout, or its caller cancelled) whose reply receive is still
        posted: it stays until the CTX answers or the endpoint closes, so an endpoint whose CTX
        leaves more than ``MAX_UNANSWERED`` of them unanswered is failed (a reconnect starts afresh)."""
        self.releases_unanswered += 1

        def ended(_: asyncio.Future[Any]) -> None:
            self.releases_unanswered -= 1

        answered.add_done_callback(ended)
        if self.releases_unanswered > MAX_UNANSWERED:
            self.fail(PeerClosed(f"{self.peer} left {self.releases_unanswered} RELEASEs unanswered", peer=self.peer))

    def fail(self, err: TransportError) -> None:
        if self.error is None:
            self.error = err
            log.warning("ucx_endpoint_failed", peer=self.peer, reason=str(err))
        self.abort()

    def abort(self) -> None:
        """Close the endpoint; UCX cancels every receive still posted on it."""
        ep, self.ep = self.ep, None
        if ep is not None:
            try:
                ep.abort(period=10**8)
            except Exception as exc:
                log.debug("ucx_abort_error", peer=self.peer, reason=repr(exc))
        if self.error is None:
            self.error = PeerClosed(f"endpoint to {self.peer} closed", peer=self.peer)


MAX_UNANSWERED = 16  # reply receives an endpoint keeps posted for short messages no PULL_ERR explained (and for RELEASEs)


class _PullIO:
    """One pull's messages on its endpoint, posted before its PULL leaves: the receive of the KV
    (into ``into``, tag 2*txid+1, a random byte, the probe, first written over its last byte), then
    the PULL itself, which names the probe. No reply is posted: a CTX that serves the pull sends the
    KV alone.

    When the receive ends, the last byte of ``into`` tells what came (ucxx reports no length): not
    the probe, the whole KV (a long message fails its receive as truncated; a short one never
    reaches that byte); still the probe, a KV that ends in it (1 pull in 256: the CTX then sends a
    PULL_WHOLE naming the length it sent), a short message, or none (the empty message that follows
    a PULL_ERR). Only then is the reply (tag 2*txid) received: a PULL_WHOLE naming the PULL's length
    is the whole KV, a PULL_ERR the refusal; none within ``grace`` seconds, or anything else, fails
    the pull as a short message (the endpoint keeps that receive posted, at most
    ``MAX_UNANSWERED`` of them).

    ``into`` is busy (its ``Landing``) until the pull's outcome is known: a pull that does not end
    with the whole KV first puts back the byte the probe replaced, so a refused pull leaves ``into``
    as it was. ``woken`` is the pulling task's only wait (its own future: cancelling it cancels
    nothing posted). Everything UCX reads or writes stays referenced until it has ended."""

    __slots__ = ("conn", "into", "txid", "tag", "landing", "grace", "woken", "kv_future", "error", "refusal",
                 "reaping", "probe", "_kv_done", "_ended", "_buf", "_saved", "_reqs", "_frame", "_timer")

    def __init__(self, conn: _Endpoint, into: torch.Tensor, txid: int, landing: Landing, grace: float) -> None:
        self.conn, self.into, self.txid, self.tag, self.landing, self.grace = conn, into, txid, 2 * txid + 1, landing, grace
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.kv_future: asyncio.Future[Any] | None = None  # ucxx's, of the KV receive
        self.error: TransportError | None = None  # what failed the pull (the KV receive, or no KV and no PULL_ERR)
        self.refusal: wire.PullErr | None = None  # the CTX's PULL_ERR
        self.reaping = False  # a background task waits for the KV receive to end
        self.probe = random.getrandbits(8)  # written over the last byte of `into`; the PULL names it
        self._kv_done = self._ended = False
        self._buf: Any = None  # the bytes of `into` that UCX writes
        self._saved = b""  # the byte the probe replaced
        self._reqs: list[Any] = []  # ucxx cancels a request whose object is collected: kept with this
        self._frame: bytearray | None = None  # the reply's, once posted
        self._timer: asyncio.TimerHandle | None = None
        landing.begin()

    def post(self, msg: wire.Pull) -> None:
        """Post the KV receive and send ``msg`` (the PULL, its txid, tag and probe this pull's), with
        no await in between. A failure fails the endpoint (``PeerClosed``), which ends whatever was
        posted."""
        conn = self.conn
        try:
            conn._check()
            pull = wire.encode_frame(msg)  # before `into` is touched: nothing to undo if it fails
            buf = self._buf = _ucx_buffer(self.into)
            self._saved = _tail(buf, 1)  # a device sync for CUDA
            _set_tail(buf, bytes((self.probe,)))  # for CUDA: synchronised, it lands before UCX's may
        except BaseException:
            self.end()
            raise
        try:
            kv = post_recv(conn.ep, buf, self.tag)
        except Exception as exc:
            _set_tail(buf, self._saved)
            self.end()
            raise conn._broke(exc) from exc
        self._reqs = [kv]
        self.kv_future = kv.future
        self.kv_future.add_done_callback(self._kv_ended)
        try:
            conn.watch_send(post_send(conn.ep, pull, CONTROL_TAG), pull)
        except Exception as exc:
            raise conn._broke(exc) from exc

    def _kv_ended(self, fut: asyncio.Future[Any]) -> None:
        exc = _outcome(fut)
        self._kv_done = True
        if exc is None and _tail(self._buf, 1)[0] != self.probe:  # the last byte was written: the whole KV
            self._finish(whole=True)
            return
        if exc is not None:
            self._finish(ProtocolViolation(f"{self.conn.peer} sent a KV message longer than its PULL asked",
                                           peer=self.conn.peer) if "truncated" in str(exc).lower() else self.conn._broke(exc))
            return
        self._await_reply()  # a KV ending in the probe (PULL_WHOLE), or a short one, or none (PULL_ERR)

    def _finish(self, error: TransportError | None = None, *, whole: bool = False) -> None:
        """The pull's outcome is known: unless the whole KV landed, the probe's byte is put back;
        then ``into`` is no longer busy and the pulling task wakes."""
        if not whole and not self._ended and self._buf is not None:
            _set_tail(self._buf, self._saved)  # `into` as it was, but for what a short message wrote
        if error is not None:
            self.error = error
        self.end()
        self._wake()

    def _await_reply(self) -> None:
        self._frame = bytearray(wire.FRAME_BYTES)
        try:
            reply = self.conn.post(self._frame, 2 * self.txid)  # a ucxx error fails the endpoint, mapped
        except TransportError as err:
            self._finish(err)
            return
        reply.add_done_callback(self._reply_ended)
        self._timer = asyncio.get_running_loop().call_later(self.grace, self._unanswered)

    def _reply_ended(self, fut: asyncio.Future[Any]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.conn.unanswered.discard(self)
        if self._ended:  # came after the grace (or the endpoint closed since): the pull already failed
            return
        exc = _outcome(fut)  # a ucxx error is already a PeerClosed (``_Endpoint.post``), the endpoint failed
        if exc is not None:
            self._finish(exc if isinstance(exc, TransportError) else self.conn._broke(exc))
            return
        assert self._frame is not None
        try:
            reply = self.conn.decode(self._frame)
        except ProtocolViolation as err:
            self._finish(err)
            return
        nbytes = self.into.numel() * self.into.element_size()
        if isinstance(reply, wire.PullWhole) and reply.txid == self.txid and reply.nbytes == nbytes:
            self._finish(whole=True)  # the KV ends in the probe's byte
        elif isinstance(reply, wire.PullWhole) and reply.txid == self.txid:
            self._finish(ProtocolViolation(f"{self.conn.peer} sent a KV message of {reply.nbytes} B, its PULL asked "
                                           f"{nbytes} B", peer=self.conn.peer))
        elif isinstance(reply, wire.PullErr) and reply.txid == self.txid:
            self.refusal = reply
            self._finish()
        else:
            self._finish(ProtocolViolation(f"{self.conn.peer} sent an unexpected reply to PULL {self.txid}: {reply!r}",
                                           peer=self.conn.peer))

    def _unanswered(self) -> None:
        """No PULL_ERR or PULL_WHOLE ``grace`` seconds after a receive that ended without the whole
        KV: a short message. Its reply receive stays posted (UCX cannot withdraw it) until the
        endpoint closes; an endpoint with more than ``MAX_UNANSWERED`` of them is failed. (Decided
        by ``_ended``, not ``woken``: a cancelled pull's ``woken`` is done, its landing not yet.)"""
        if self._ended:
            return
        conn = self.conn
        conn.unanswered.add(self)
        self._finish(self.short())
        if len(conn.unanswered) > MAX_UNANSWERED:
            conn.fail(PeerClosed(f"{conn.peer} sent {len(conn.unanswered)} short KV messages no PULL_ERR explained",
                                 peer=conn.peer))

    def _wake(self) -> None:
        if not self.woken.done():
            self.woken.set_result(None)

    @property
    def kv_done(self) -> bool:
        return self._kv_done

    async def wait_kv(self) -> None:
        """Until UCX ends the KV receive (cancelling this wait cancels nothing posted)."""
        if not self._kv_done:
            assert self.kv_future is not None
            await asyncio.wait([self.kv_future])

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.landing.end()

    def short(self) -> ProtocolViolation:
        return ProtocolViolation(f"{self.conn.peer} sent a KV message shorter than its PULL asked "
                                 f"({self.into.numel() * self.into.element_size()} B), or none, and no PULL_ERR",
                                 peer=self.conn.peer)


def _tail(buf: Any, n: int) -> bytes:
    """The last ``n`` bytes of a byte view (``_ucx_buffer``: numpy, or a CUDA tensor: a device sync)."""
    t = buf[-n:]
    return (t.cpu().numpy() if isinstance(t, torch.Tensor) else t).tobytes()


def _set_tail(buf: Any, data: bytes) -> None:
    """Write ``data`` over the last bytes of a byte view (for CUDA, synchronised: it has landed on return)."""
    if isinstance(buf, torch.Tensor):
        buf[-len(data):] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(buf.device)
        torch.cuda.current_stream(buf.device).synchronize()
    else:
        buf[-len(data):] = np.frombuffer(data, dtype=np.uint8)
