"""The GEN side's control connection to one NIXL CTX (``transports.nixl.NIXLTransport``): requests
matched to answers by id, the answers read by the connection's protocol as they arrive (no reader
task: the waiting pull is woken straight from the socket's callback), and the failure that ended it
(if any)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import anyio
import structlog

from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._layout import KVLayout
from ._nixl_common import _HEAD, _MAX_MESSAGE_BYTES, parse_msg, write_msg

log = structlog.get_logger("transports.nixl")


class _Conn:
    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: dict[str, Any],
                 agent_name: str, remote: KVLayout) -> None:
        self.peer, self.reader, self.writer, self.info, self.agent_name = peer, reader, writer, info, agent_name
        self.remote = remote  # the CTX's KV layout (its pool: only the heads it holds)
        self.answered = 0  # lookups it answered (a connection that served before may have gone stale since)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.error: TransportError | None = None
        self.ids = itertools.count(1)
        self.pin_s = max(float(info.get("pin_ms", 30_000)) / 1000, 0.01)  # the CTX's pin lease

    def start(self) -> None:
        """Read the answers from here on in the connection's own protocol (after the handshake, which
        read through ``reader``): each is dispatched from the socket's callback, with no task."""
        proto = _Answers(self)
        transport = self.writer.transport
        buffered = bytes(getattr(self.reader, "_buffer", b""))  # none expected: GEN asked nothing yet
        transport.set_protocol(proto)
        if buffered:
            proto.data_received(buffered)

    def dispatch(self, msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        fut = self.waiting.pop(rid, None) if isinstance(rid, int) else None  # no number: no question of ours
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif msg.get("t") == "found":  # its pull was cancelled or timed out: unpin at once
            self.send({"t": "unpin", "token": msg.get("token")})

    def fail(self, err: TransportError) -> None:
        if self.error is None:
            self.error = err
            log.info("nixl_connection_failed", peer=self.peer, reason=str(err))
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self.waiting.clear()
        self.writer.close()

    def ask(self, msg: dict[str, Any]) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """Send ``msg`` now; its answer resolves the future (``forget(id)`` when no longer wanted)."""
        if self.error is not None:
            raise self.error
        rid = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        write_msg(self.writer, {**msg, "id": rid})
        return rid, fut

    def forget(self, rid: int) -> None:
        fut = self.waiting.pop(rid, None)
        if fut is not None:
            fut.cancel()

    async def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        rid, fut = self.ask(msg)
        return await self.answer(rid, fut, msg["t"], timeout)

    async def answer(self, rid: int, fut: asyncio.Future[dict[str, Any]], what: str, timeout: float) -> dict[str, Any]:
        """The answer to an ``ask``, within ``timeout`` (then ``PeerClosed``, the question forgotten)."""
        if fut.done():
            return fut.result()
        try:
            with anyio.fail_after(timeout):
                return await fut
        except TimeoutError:
            self.waiting.pop(rid, None)
            raise PeerClosed(f"{self.peer} did not answer {what} within {timeout}s", peer=self.peer) from None

    def send(self, msg: dict[str, Any]) -> None:
        if self.error is None:
            write_msg(self.writer, msg)


class _Answers(asyncio.Protocol):
    """The connection's protocol once the handshake is done: frames (``_nixl_common``: a 4-byte
    length, then one JSON object) parsed as bytes arrive, each answer handed to ``_Conn.dispatch``;
    a malformed or oversized frame, or the connection's end, fails the connection."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= _HEAD.size and self.conn.error is None:
            (n,) = _HEAD.unpack_from(buf)
            if n > _MAX_MESSAGE_BYTES:
                self._ended(ProtocolViolation(f"message of {n} bytes exceeds {_MAX_MESSAGE_BYTES}"))
                return
            if len(buf) < _HEAD.size + n:
                return
            body = bytes(buf[_HEAD.size:_HEAD.size + n])
            del buf[:_HEAD.size + n]
            try:
                msg = parse_msg(body)
            except ProtocolViolation as exc:
                self._ended(exc)
                return
            self.conn.dispatch(msg)

    def connection_lost(self, exc: Exception | None) -> None:  # also after the peer's EOF (the transport closes)
        self._ended(exc or EOFError("the peer closed the connection"))

    def _ended(self, exc: BaseException) -> None:
        conn = self.conn
        conn.fail(PeerClosed(f"control connection to {conn.peer} ended: {type(exc).__name__}: {exc}", peer=conn.peer))
