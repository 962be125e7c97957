"""The GEN side's control connection to one NIXL CTX (``transports.nixl.NIXLTransport``): requests
matched to answers by id, the answers read by the connection's protocol as they arrive (no reader
task: the waiting pull is woken straight from the socket's callback), and the failure that ended it
(if any).

It also keeps what lets a READ go without a pin (docs/transport.md, "Unpinned READs"): the CTX's
epoch (its store's when this connection began, raised when too many revocations were
remembered), the requests revoked since, the READs in flight per request (a revocation is
acknowledged once its request's READs ended), and the connection's lease (``trusted_until``: the
CTX keeps every block a revocation names until this GEN acknowledged it or its lease ended)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from typing import Any

import anyio
import structlog

from ._errors import PeerClosed, ProtocolViolation, TransportError
from ._ids import InvalidRequestId, check_request_id
from ._layout import KVLayout
from ._nixl_common import _HEAD, _MAX_MESSAGE_BYTES, _MAX_REVOKED, parse_msg, write_msg
from ._store import epoch_vouches, same_store

log = structlog.get_logger("transports.nixl")


class _Conn:
    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: dict[str, Any],
                 agent_name: str, remote: KVLayout) -> None:
        self.peer, self.reader, self.writer, self.info, self.agent_name = peer, reader, writer, info, agent_name
        self.remote = remote  # the CTX's KV layout (its pool: only the heads it holds)
        self.num_blocks = int(info["pool"]["num_blocks"]) if "pool" in info else 0  # checked at connect
        self.answered = 0  # lookups it answered (a connection that served before may have gone stale since)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.error: TransportError | None = None
        self.ids = itertools.count(1)
        self.pin_s = max(float(info.get("pin_ms", 30_000)) / 1000, 0.01)  # the CTX's pin lease
        epoch = info.get("epoch")
        self.epoch: int | None = epoch if type(epoch) is int else None  # None: this CTX revokes nothing
        self.trusted_until = 0.0  # monotonic: unpinned READs are vouched for until then (see lease_from)
        self.revoked: OrderedDict[str, int | None] = OrderedDict()
        """Requests freed since the epoch (revoked, or released by this GEN), each with an epoch past
        it (None: not known yet): READ with a pin, never unpinned (``vouches``)."""
        self.reading: dict[str, int] = {}  # request id -> READs of it in flight on this connection
        self._ended_waiters: dict[str, list[asyncio.Future[None]]] = {}  # reads_ended() callers
        self._acks_due: dict[str, list[int]] = {}  # revocations acknowledged once those READs end
        self._alive: int | None = None  # the id of the "alive" question not answered yet
        self.copies_inline: bool | None = None  # transfer() of a READ from this peer copied it at once (one host)

    def copied(self, state: str) -> None:
        """What ``transfer()`` answered for a READ from this peer (any thread): done at once means
        NIXL copies inline here (one host), in progress that it does not."""
        if state in ("DONE", "PROC"):
            self.copies_inline = state == "DONE"

    # -- unpinned READs ------------------------------------------------------------------------------

    def lease_from(self, sent_at: float) -> None:
        """The CTX granted a lease on a message this GEN sent at ``sent_at`` (monotonic): the CTX
        started it on receipt, later, so until ``sent_at + pin_s`` this GEN is inside it."""
        self.trusted_until = max(self.trusted_until, sent_at + self.pin_s)

    def leased(self) -> bool:
        """The connection is up and inside its lease, by a margin of a tenth of it (the two nodes'
        clocks may run at slightly different rates)."""
        return self.error is None and time.monotonic() < self.trusted_until - self.pin_s / 10

    def vouches(self, request_id: str, epoch: int | None) -> bool:
        """Whether a READ of ``request_id`` (put when the CTX's epoch was ``epoch``) may go without a
        pin: the request is this CTX store's (not a restarted CTX's predecessor's), no revocation
        this connection did not hear of can have been of it, none it heard of was, and the
        connection's lease runs."""
        return (epoch_vouches(epoch, self.epoch)
                and request_id not in self.revoked and self.leased())

    def read_begins(self, request_id: str) -> None:
        self.reading[request_id] = self.reading.get(request_id, 0) + 1

    def read_ends(self, request_id: str) -> None:
        left = self.reading.get(request_id, 0) - 1
        if left > 0:
            self.reading[request_id] = left
            return
        self.reading.pop(request_id, None)
        for fut in self._ended_waiters.pop(request_id, ()):
            if not fut.done():
                fut.set_result(None)
        due = self._acks_due.pop(request_id, None)
        if due:
            self.send({"t": "revoked", "n": due})

    async def reads_ended(self, request_id: str) -> None:
        """Until no READ of ``request_id`` is in flight on this connection."""
        while self.reading.get(request_id):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._ended_waiters.setdefault(request_id, []).append(fut)
            try:
                await fut
            finally:
                waiters = self._ended_waiters.get(request_id)
                if waiters and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self._ended_waiters[request_id]

    def _revoke(self, msg: dict[str, Any]) -> None:
        rid, n, epoch = msg.get("rid"), msg.get("n"), msg.get("epoch")
        try:  # an id outside the rule is no request of ours, and kept here it would be memory a CTX could fill
            check_request_id(rid)
        except InvalidRequestId:
            rid = None
        if not isinstance(rid, str) or type(n) is not int or type(epoch) is not int:
            self.fail(ProtocolViolation(f"malformed revocation from {self.peer}", peer=self.peer))
            return
        self._remember(rid, epoch)
        if self.reading.get(rid):
            self._acks_due.setdefault(rid, []).append(n)
        else:
            self.send({"t": "revoked", "n": [n]})

    def released_here(self, request_id: str, past: int | None) -> None:
        """This GEN let the CTX free ``request_id`` (a READ without keep, whose notification frees
        it; a release): ``past`` an epoch past it (its put's + 1, or the CTX's answer), None if not
        known yet. The CTX revokes a request only at the GENs that did not free it, so without this
        a replay of the same hand-off here (same id, handle, blocks and epoch) was vouched for and
        READ, unpinned, the blocks the CTX had freed and given to another request (an outside drill:
        "finished", with the other request's KV)."""
        self._remember(request_id, past)

    def _remember(self, rid: str, past: int | None) -> None:
        if self.epoch is None:  # nothing is vouched for on this connection: nothing to remember
            return
        if past is not None and not same_store(past, self.epoch):
            return  # another store's request (a restarted CTX's hand-off) is never vouched for here; its
            # epoch must not raise this connection's (a max across stores: fresh requests pinned, old vouched)
        known = self.revoked.pop(rid, None)
        self.revoked[rid] = past if known is None else known if past is None else max(known, past)
        if len(self.revoked) > _MAX_REVOKED:
            # too many to remember: every one whose epoch is known was put before the highest of
            # them, which becomes the epoch (whatever was put before it is READ with a pin); the
            # ones not known yet (a release on its way) stay, and if they alone overflow, no epoch
            # vouches for anything any more on this connection
            known_epochs = [e for e in self.revoked.values() if e is not None]
            if known_epochs:
                self.epoch = max(self.epoch, *known_epochs)
            self.revoked = OrderedDict((r, None) for r, e in self.revoked.items() if e is None)
            if len(self.revoked) > _MAX_REVOKED:
                self.epoch = None
                self.revoked.clear()

    def ask_alive(self) -> None:
        """Renew the connection's lease (the answer extends ``trusted_until``); the question before
        it, if still unanswered, is forgotten."""
        if self._alive is not None:
            self.forget(self._alive)
        sent = time.monotonic()
        rid, fut = self.ask({"t": "alive"})
        self._alive = rid

        def answered(f: asyncio.Future[dict[str, Any]]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            if f.result().get("t") == "alive":
                self.lease_from(sent)
            else:  # the CTX let this connection's lease end: READ with pins from here on
                self.epoch = None
        fut.add_done_callback(answered)

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
        if msg.get("t") == "revoke":
            self._revoke(msg)
            return
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
        except BaseException:  # cancelled: an answer that came meanwhile is not used
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result().get("t") == "found":
                self.send({"t": "unpin", "token": fut.result().get("token")})  # a pin nobody will READ
            raise

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
