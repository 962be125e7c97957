"""The GEN side's ucxx endpoint (``transports.ucx.UCXTransport``): one authenticated endpoint per CTX
peer, the requests posted on it (each a ucxx request whose future ends with it, its ucxx error
mapped: a broken endpoint fails, a truncated KV message fails its pull only), and one pull's
messages (``_PullIO``: its two receives and the PULL, posted together; the ``Landing`` of ``into``,
the sentinel and the length check; one wake-up of the pulling task)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import anyio
import structlog
import torch

from . import wire
from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._protocol import Landing
from ._ucx_common import CONTROL_TAG, _ucx_buffer, kv_crc32, post_recv, post_send

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
        fails); its outcome is always retrieved. ``req`` and its buffer ``buf`` stay referenced until
        then (ucxx keeps neither)."""
        out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(fut: asyncio.Future[Any], req: Any = req, buf: Any = buf) -> None:
            if out.done():
                return
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled():
                out.set_exception(self._broke(RuntimeError("request cancelled")))
            elif exc is None:
                out.set_result(None)
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
        return wire.decode_frame(frame, self.limits)

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


class _PullIO:
    """One pull's messages on its endpoint, posted together before its PULL leaves: the receive of
    the reply (``frame``, tag 2*txid) and of the KV (into ``into``, tag 2*txid+1, a random sentinel
    first written into its last byte: a short message leaves it there), then the PULL itself.

    ``into`` is busy (its ``Landing``) until UCX ends the KV receive; a KV receive that ends without a
    KV message (failed, cancelled, or the empty message that follows a PULL_ERR) first puts back the
    byte the sentinel replaced, so ``into`` is as it was. ``woken`` is the pulling task's only wait:
    it ends when the reply has ended and either the KV receive has too or the reply is not the
    PULL_OK the pull expects; it is the task's own future, so cancelling it cancels nothing posted.
    Errors are mapped as they end: a broken endpoint fails (``_Endpoint.fail``), a KV message longer
    than ``into`` fails this pull alone. Everything UCX reads or writes stays referenced until it
    has ended (ucxx keeps none of it)."""

    __slots__ = ("conn", "into", "txid", "tag", "landing", "frame", "want", "tail", "sentinel", "woken", "kv_future",
                 "reply_error", "kv_error", "reaping", "_reply_done", "_kv_done", "_ended", "_buf", "_saved", "_reqs")

    def __init__(self, conn: _Endpoint, into: torch.Tensor, txid: int, landing: Landing) -> None:
        self.conn, self.into, self.txid, self.tag, self.landing = conn, into, txid, 2 * txid + 1, landing
        self.frame = bytearray(wire.FRAME_BYTES)
        self.want = b""  # the PULL_OK this pull expects, tail 0 (``wire.pull_ok_frame``)
        self.tail: int | None = None  # once the reply came: its tail if it is byte for byte that PULL_OK
        self.sentinel = 0
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.kv_future: asyncio.Future[Any] | None = None  # ucxx's, of the KV receive
        self.reply_error: TransportError | None = None
        self.kv_error: TransportError | None = None
        self.reaping = False  # a background task waits for the KV receive to end
        self._reply_done = self._kv_done = self._ended = False
        self._buf: Any = None  # the bytes of `into` that UCX writes
        self._saved = 0  # the byte the sentinel replaced
        self._reqs: list[Any] = []  # ucxx cancels a request whose object is collected: kept with this
        landing.begin()

    def post(self, template: wire.Pull) -> wire.Pull:
        """Post both receives and send the PULL, with no await in between; the PULL sent. A failure
        fails the endpoint (``PeerClosed``), which ends whatever was posted."""
        conn = self.conn
        try:
            conn._check()
            buf = self._buf = _ucx_buffer(self.into)
            self._saved = int(buf[-1])  # a device sync for CUDA
            self.sentinel = random.getrandbits(8)
            buf[-1] = self.sentinel
            if isinstance(buf, torch.Tensor) and buf.is_cuda:  # the write lands before UCX's may
                torch.cuda.current_stream(buf.device).synchronize()
        except BaseException:
            self.end()
            raise
        msg = dataclasses.replace(template, txid=self.txid, tag=self.tag, sentinel=self.sentinel)
        self.want = wire.pull_ok_frame(msg)
        pull = wire.encode_frame(msg)
        try:
            kv = post_recv(conn.ep, buf, self.tag)
        except Exception as exc:
            buf[-1] = self._saved
            self.end()
            raise conn._broke(exc) from exc
        self._reqs = [kv]
        self.kv_future = kv.future
        self.kv_future.add_done_callback(self._kv_ended)
        try:
            reply = post_recv(conn.ep, self.frame, 2 * self.txid)
            self._reqs.append(reply)
            reply.future.add_done_callback(self._reply_ended)
            conn.watch_send(post_send(conn.ep, pull, CONTROL_TAG), pull)
        except Exception as exc:
            raise conn._broke(exc) from exc
        return msg

    def _reply_ended(self, fut: asyncio.Future[Any]) -> None:
        exc = _outcome(fut)
        if exc is not None:
            self.reply_error = self.conn._broke(exc)
        else:
            self.tail = wire.pull_ok_tail(self.frame, self.want)
        self._reply_done = True
        self._wake()

    def _kv_ended(self, fut: asyncio.Future[Any]) -> None:
        exc = _outcome(fut)
        if exc is not None or self.frame[5] == wire.MsgType.PULL_ERR:  # its type byte: no KV message came
            self._buf[-1] = self._saved
        if exc is not None:
            self.kv_error = (ProtocolViolation(f"{self.conn.peer} sent a KV message longer than its PULL_OK said",
                                               peer=self.conn.peer)
                             if "truncated" in str(exc).lower() else self.conn._broke(exc))
        self._kv_done = True
        self.end()
        self._wake()

    def _wake(self) -> None:
        if self.woken.done() or not self._reply_done:
            return
        if self._kv_done or self.tail is None:  # a failed or unexpected reply wakes the task at once
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

    def needs_crc(self, answer: wire.PullOk) -> bool:
        """The CTX's last byte is the sentinel: only the CRC-32 tells whether all of it landed."""
        return answer.tail == self.sentinel

    def verify(self, answer: wire.PullOk) -> None:
        """The whole KV message landed: its last byte is the CTX's ``tail`` (a short message left the
        sentinel there, which differs from ``tail`` unless ``needs_crc``)."""
        if self.kv_error is not None:
            raise self.kv_error
        if int(self._buf[-1]) != answer.tail:
            raise self._short()

    def verify_crc(self, answer: wire.PullOk) -> None:
        """The CRC-32 of ``into`` is the PULL_OK's (a worker thread runs it for large messages)."""
        if self.kv_error is not None:
            raise self.kv_error
        if kv_crc32(self.into) != answer.crc:
            raise self._short()

    def _short(self) -> ProtocolViolation:
        return ProtocolViolation(f"{self.conn.peer} sent a KV message shorter than its PULL_OK said "
                                 f"({self.into.numel() * self.into.element_size()} B)", peer=self.conn.peer)
