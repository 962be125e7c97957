"""The GEN side's ucxx endpoint (``transports.ucx.UCXTransport``): one authenticated endpoint per CTX
peer, the requests posted on it (each a ucxx request whose future ends with it, its ucxx error
mapped: a broken endpoint fails, a truncated KV message fails its pull only), and one pull's KV
receive (``_KVReceive``: the ``Landing`` of ``into``, the sentinel and the length check)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import structlog
import torch

from . import wire
from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._protocol import Landing
from ._ucx_common import CONTROL_TAG, _ucx_buffer, last_byte, post_recv, post_send

log = structlog.get_logger("transports.ucx")


def _cancelled() -> type[BaseException]:
    return anyio.get_cancelled_exc_class()


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome so that asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


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
        self.pulls = 0  # pulls started on it (a reused endpoint may have gone stale)

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

    def _settled(self, req: Any, buf: Any, *, data: bool = False) -> asyncio.Future[Any]:
        """A future that ends with the ucxx request ``req``, its ucxx error mapped (a broken
        endpoint fails; a truncated KV message fails only its pull); its outcome is always retrieved.
        ``req`` and its buffer ``buf`` stay referenced until then (ucxx keeps neither)."""
        out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(fut: asyncio.Future[Any], req: Any = req, buf: Any = buf) -> None:
            if out.done():
                return
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled():
                out.set_exception(self._broke(RuntimeError("request cancelled")))
            elif exc is None:
                out.set_result(None)
            elif data and "truncated" in str(exc).lower():
                out.set_exception(ProtocolViolation(f"{self.peer} sent a KV message longer than its PULL_OK said",
                                                    peer=self.peer))
            else:
                out.set_exception(self._broke(exc))

        out.add_done_callback(_consume)
        req.future.add_done_callback(done)
        return out

    def post(self, buf: Any, tag: int, *, data: bool = False) -> asyncio.Future[Any]:
        """Post a receive now; the returned future ends when UCX ends it."""
        self._check()
        try:
            return self._settled(post_recv(self.ep, buf, tag), buf, data=data)
        except Exception as exc:
            raise self._broke(exc) from exc

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


class _KVReceive:
    """The KV message of one pull: ``into`` is busy (its ``Landing``) from the PULL until the receive
    posted into it ends, or until it is known that none will be posted (``end``, idempotent)."""

    __slots__ = ("conn", "into", "tag", "landing", "frame", "posted", "reaping", "_ended", "_buf")

    def __init__(self, conn: _Endpoint, into: torch.Tensor, tag: int, landing: Landing, frame: bytearray) -> None:
        self.conn, self.into, self.tag, self.landing, self.frame = conn, into, tag, landing, frame
        self.posted: asyncio.Future[Any] | None = None
        self._buf: Any = None  # the bytes of `into` that UCX writes (once posted)
        self.reaping = False  # a background task ends it now
        self._ended = False
        landing.begin()

    def end(self, *_: object) -> None:
        if not self._ended:
            self._ended = True
            self.landing.end()

    def post(self, tail: int | None) -> None:
        """Post the KV receive into ``into``, its last byte first set to differ from ``tail`` (the
        CTX's last byte): a short message leaves it, so ``verify`` sees it."""
        buf = self._buf = _ucx_buffer(self.into)
        if tail is not None:
            buf[-1] = tail ^ 0xFF
        try:
            self.posted = self.conn.post(buf, self.tag, data=True)
        except BaseException:
            self.end()
            raise
        self.posted.add_done_callback(self.end)

    def verify(self, tail: int) -> None:
        if (int(self._buf[-1]) if self._buf is not None else last_byte(self.into)) != tail:
            raise ProtocolViolation(f"{self.conn.peer} sent a KV message shorter than its PULL_OK said "
                                    f"({self.into.numel() * self.into.element_size()} B)", peer=self.conn.peer)
