"""The GEN's NIXL control connection after the handshake (``transports._nixl_conn``): answers are read
by the connection's own protocol, each handed to the question that asked for it, over a real TCP
connection to a peer that writes exactly the frames a test gives it (a 4-byte length, then JSON).

A frame that is malformed or larger than ``_MAX_MESSAGE_BYTES``, or the peer's end, fails the
connection and every question still open on it; an answer whose id is not a number, or names no open
question, is dropped (a stray "found" is unpinned at once) and the connection goes on."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator

import anyio
import pytest

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from transports import KVLayout, PeerClosed  # noqa: E402
from transports._nixl_common import _MAX_MESSAGE_BYTES  # noqa: E402
from transports._nixl_conn import _Conn  # noqa: E402

import torch  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float16)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def frame(msg: object) -> bytes:
    body = json.dumps(msg).encode() if not isinstance(msg, bytes) else msg
    return struct.pack("!I", len(body)) + body


class Peer:
    """The CTX end: what the GEN sent (parsed), and a way to write raw bytes back."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.got: list[dict] = []
        self.connected = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.connected.set()
        try:
            while True:
                (n,) = struct.unpack("!I", await reader.readexactly(4))
                self.got.append(json.loads(await reader.readexactly(n)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[_Conn, Peer]]:
    peer = Peer()
    server = await asyncio.start_server(peer.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = _Conn(f"127.0.0.1:{port}", reader, writer, {"pin_ms": 30_000}, "ctx-agent", LAYOUT)
    conn.start()
    await peer.connected.wait()
    try:
        yield conn, peer
    finally:
        writer.close()
        if peer.writer is not None:
            peer.writer.close()
        server.close()
        await server.wait_closed()


async def _until(cond, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await asyncio.sleep(0.005)


@pytest.mark.anyio
async def test_answers_reach_their_questions_in_pieces_and_batches(pair: tuple[_Conn, Peer]) -> None:
    conn, peer = pair
    a, fa = conn.ask({"t": "lookup", "rid": "a"})
    b, fb = conn.ask({"t": "lookup", "rid": "b"})
    await _until(lambda: len(peer.got) == 2)
    assert [m["id"] for m in peer.got] == [a, b]
    both = frame({"t": "pinned", "id": b}) + frame({"t": "found", "token": "t" * 24, "blocks": [1], "id": a})
    await peer.send(both[:3])  # a length cut in two, then the rest with a second frame
    await asyncio.sleep(0.02)
    assert not fa.done() and not fb.done()
    await peer.send(both[3:])
    assert (await conn.answer(b, fb, "pin", 5))["t"] == "pinned"
    assert (await conn.answer(a, fa, "lookup", 5))["blocks"] == [1]
    assert conn.error is None and not conn.waiting


@pytest.mark.anyio
async def test_an_answer_without_a_question_is_dropped_and_a_stray_pin_released(pair: tuple[_Conn, Peer]) -> None:
    conn, peer = pair
    rid, fut = conn.ask({"t": "lookup", "rid": "a"})
    await peer.send(frame({"t": "found", "token": "s" * 24, "id": "x"}))  # not a number: no question of ours
    await peer.send(frame({"t": "found", "token": "u" * 24, "id": 999}))  # names no open question
    await _until(lambda: len([m for m in peer.got if m["t"] == "unpin"]) == 2)
    assert {m["token"] for m in peer.got if m["t"] == "unpin"} == {"s" * 24, "u" * 24}
    await peer.send(frame({"t": "pinned", "id": rid}))
    assert (await conn.answer(rid, fut, "pin", 5))["t"] == "pinned"
    assert conn.error is None


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["oversized", "malformed", "no-type", "closed"])
async def test_a_bad_frame_or_the_peers_end_fails_the_connection_and_its_questions(
        pair: tuple[_Conn, Peer], bad: str) -> None:
    conn, peer = pair
    rid, fut = conn.ask({"t": "lookup", "rid": "a"})
    if bad == "oversized":
        await peer.send(struct.pack("!I", _MAX_MESSAGE_BYTES + 1))
    elif bad == "malformed":
        await peer.send(frame(b"{not json"))
    elif bad == "no-type":
        await peer.send(frame([1, 2]))
    else:
        assert peer.writer is not None
        peer.writer.close()
    with pytest.raises(PeerClosed):
        await conn.answer(rid, fut, "lookup", 2)
    assert conn.error is not None and not conn.waiting  # failed, not merely unanswered
    with pytest.raises(PeerClosed):
        conn.ask({"t": "lookup", "rid": "b"})


@pytest.mark.anyio
async def test_revocations_are_acknowledged_after_the_reads_of_their_request_and_bounded(
        pair: tuple[_Conn, Peer]) -> None:
    """A revocation of a request with a READ in flight is acknowledged when that READ ends, others at
    once; a revoked request is not vouched for; past ``_MAX_REVOKED`` remembered revocations the
    connection forgets them and raises its epoch instead (whatever was put before is pinned)."""
    from transports._nixl_common import _MAX_REVOKED

    conn, peer = pair
    tag = 7 << 32  # the CTX store's (KVStore.epoch: a random tag, then the revocation count)
    conn.epoch = tag | 5
    conn.lease_from(time.monotonic())
    assert conn.vouches("a", tag | 5) and conn.vouches("b", tag | 6) and not conn.vouches("a", tag | 4)
    assert not conn.vouches("a", None) and not conn.vouches("a", (8 << 32) | 6)  # another store's (a restart)
    conn.read_begins("a")
    await peer.send(frame({"t": "revoke", "rid": "a", "n": 1, "epoch": tag | 6})
                    + frame({"t": "revoke", "rid": "b", "n": 2, "epoch": tag | 7}))
    await _until(lambda: len(peer.got) == 1)
    assert peer.got == [{"t": "revoked", "n": [2]}] and not conn.vouches("a", tag | 5) and not conn.vouches("b", tag | 9)
    conn.read_ends("a")
    await _until(lambda: len(peer.got) == 2)
    assert peer.got[1] == {"t": "revoked", "n": [1]}
    await peer.send(b"".join(frame({"t": "revoke", "rid": f"x{i}", "n": 10 + i, "epoch": tag | (100 + i)})
                             for i in range(_MAX_REVOKED)))
    await _until(lambda: len(peer.got) == 2 + _MAX_REVOKED)
    assert len(conn.revoked) < _MAX_REVOKED and conn.epoch >= tag | (100 + _MAX_REVOKED - 2)
    assert not conn.vouches("a", tag | 5) and not conn.vouches("x0", tag | 50)
    assert conn.vouches("new", tag | (100 + _MAX_REVOKED))
    assert conn.error is None


def test_a_free_of_another_store_s_request_never_moves_the_connection_s_epoch() -> None:
    """A GEN remembers the requests it freed with an epoch past each; past the limit the largest
    becomes the connection's epoch. A pinned READ of a restarted CTX's old hand-off (another
    store's epoch) was remembered too, and the max across stores moved the epoch into the old
    store: every fresh request READ pinned, the old store's hand-offs vouched for (an outside
    review of this change). Another store's epoch is not remembered."""
    from transports._nixl_common import _MAX_REVOKED
    from transports._nixl_conn import _Conn
    from transports._store import _EPOCH_BITS

    mine, old = 5 << _EPOCH_BITS, 9 << _EPOCH_BITS
    conn = _Conn("p", None, None, {"epoch": mine, "pin_ms": 30000}, "a", None)
    conn.trusted_until = time.monotonic() + 100
    conn.released_here("old-1", old + 8)
    for i in range(_MAX_REVOKED + 1):
        conn.released_here(f"r{i}", mine + i + 1)
    assert conn.epoch == mine + _MAX_REVOKED + 1  # raised within its own store
    assert conn.vouches("fresh", mine + _MAX_REVOKED + 1) and not conn.vouches("old-2", old + 100)
    # a CTX that revokes nothing (no epoch): nothing is vouched for, and nothing is kept (before, a
    # release's entry waiting for an epoch was never resolved there: one kept per release, for ever)
    none = _Conn("p", None, None, {"pin_ms": 30000}, "a", None)
    for i in range(_MAX_REVOKED + 10):
        none.released_here(f"r{i}", None)
        none.released_here(f"r{i}", mine + i)
    assert none.epoch is None and not none.revoked
    # releases whose epoch never came (their answers lost), past the limit: no epoch vouches any
    # more, and nothing is kept
    lost = _Conn("p", None, None, {"epoch": mine, "pin_ms": 30000}, "a", None)
    for i in range(_MAX_REVOKED + 1):
        lost.released_here(f"r{i}", None)
    assert lost.epoch is None and not lost.revoked
