"""The GEN side's control connection to one NIXL CTX (``transports.nixl.NIXLTransport``): requests
matched to answers by id, a reader task, and the failure that ended it (if any)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import anyio
import structlog

from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._layout import KVLayout
from ._nixl_common import _MAX_MESSAGE_BYTES, read_msg, write_msg

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
        self.reader_task: asyncio.Task[None] | None = None
        self.pin_s = max(float(info.get("pin_ms", 30_000)) / 1000, 0.01)  # the CTX's pin lease

    async def read_loop(self) -> None:
        try:
            while True:
                msg = await read_msg(self.reader, _MAX_MESSAGE_BYTES)
                fut = self.waiting.pop(int(msg.get("id", -1)), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif msg.get("t") == "found":  # its pull was cancelled or timed out: unpin at once
                    self.send({"t": "unpin", "token": msg.get("token")})
        except (OSError, asyncio.IncompleteReadError, ProtocolViolation) as exc:
            self.fail(PeerClosed(f"control connection to {self.peer} ended: {type(exc).__name__}: {exc}", peer=self.peer))

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
