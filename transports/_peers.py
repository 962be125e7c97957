"""Per-peer connection bookkeeping of the GEN-side transports (``transports.ucx``, ``transports.nixl``).

One connect attempt per peer at a time, shared by every pull waiting for it (a cancelled waiter
does not cancel it); a failed attempt marks the peer down for ``backoff_s`` so that later pulls
fail at once instead of each waiting out a timeout (not after a timeout: that already cost its
waiters the whole time); at most ``max_peers`` peers connected or connecting, and at most that
many remembered as down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ._errors import IncompatiblePeer, PeerClosed, PeerUnreachable, TransportError
from ._layout import KVLayout, dtype_name

C = TypeVar("C")


def again(exc: TransportError, peer: str) -> TransportError:
    """A fresh copy of a shared failure (one connect attempt fails every pull that waited for it)."""
    copy = type(exc)(str(exc), peer=peer)
    copy.__cause__ = exc
    return copy


def check_layout(peer: str, theirs: tuple[int, int, int, int, str], layout: KVLayout, total_kv_heads: int) -> None:
    """Refuse (``IncompatiblePeer``) a CTX whose KV layout (layers, model-wide KV heads, head_dim,
    block_size, dtype name) is not this GEN's: checked once, at connect."""
    ours = (layout.num_layers, total_kv_heads, layout.head_dim, layout.block_size, dtype_name(layout.dtype))
    if theirs != ours:
        names = ("layers", "kv_heads", "head_dim", "block_size", "dtype")
        diff = ", ".join(f"{n} {t} vs {o}" for n, t, o in zip(names, theirs, ours) if t != o)
        raise IncompatiblePeer(f"{peer} serves KV of another layout (CTX vs this GEN: {diff})", peer=peer)


class PeerConnections(Generic[C]):
    def __init__(self, open_: Callable[[str], Awaitable[C]], *, max_peers: int, backoff_s: float,
                 usable: Callable[[C], bool], discard: Callable[[C], None]) -> None:
        self._open, self._usable, self._discard = open_, usable, discard
        self.max_peers, self.backoff_s = max_peers, backoff_s
        self.conns: dict[str, C] = {}
        self._connecting: dict[str, asyncio.Future[C]] = {}
        self._down: dict[str, tuple[float, TransportError]] = {}  # peer -> (until, why)
        self.closed = False

    @property
    def live(self) -> int:
        return sum(1 for c in self.conns.values() if self._usable(c))

    @property
    def down(self) -> int:
        now = time.monotonic()
        return sum(1 for until, _ in self._down.values() if until > now)

    def has(self, peer: str) -> bool:
        """A usable connection to ``peer`` exists (a read of one dict entry: safe from any thread)."""
        conn = self.conns.get(peer)
        return conn is not None and self._usable(conn)

    def ready(self, peer: str) -> C | None:
        """The usable connection to ``peer``, if one is open (no I/O: a pull's first look; ``get``
        opens one)."""
        conn = self.conns.get(peer)
        return conn if conn is not None and not self.closed and self._usable(conn) else None

    async def get(self, peer: str) -> C:
        conn = self.ready(peer)
        if conn is not None:
            return conn
        if self.closed:
            raise PeerClosed("transport is closed", peer=peer)
        if peer in self.conns:  # no longer usable
            del self.conns[peer]
        down = self._down.get(peer)
        if down is not None:
            until, why = down
            if time.monotonic() < until:
                raise again(why, peer)
            del self._down[peer]
        attempt = self._connecting.get(peer)
        if attempt is None:
            self.conns = {p: c for p, c in self.conns.items() if self._usable(c)}  # dead ones do not count
            if len(self.conns) + len(self._connecting) >= self.max_peers:
                raise PeerUnreachable(f"too many KV peers: {self.max_peers} already connected", peer=peer)
            attempt = asyncio.ensure_future(self._open(peer))
            self._connecting[peer] = attempt
            attempt.add_done_callback(lambda fut: self._connected(peer, fut))
        try:
            return await asyncio.shield(attempt)  # one attempt per peer, whoever started it is cancelled
        except TransportError as exc:
            raise again(exc, peer) from exc

    def _connected(self, peer: str, fut: asyncio.Future[C]) -> None:
        self._connecting.pop(peer, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            if self.closed:
                self._discard(fut.result())
            else:
                self.conns[peer] = fut.result()
            return
        if isinstance(exc, TransportError) and not isinstance(exc.__cause__, TimeoutError):
            now = time.monotonic()
            self._down = {p: d for p, d in self._down.items() if d[0] > now}  # bounded: expired ones go
            if len(self._down) < self.max_peers:
                self._down[peer] = (now + self.backoff_s, exc)

    def drop(self, peer: str, conn: C) -> None:
        if self.conns.get(peer) is conn:
            del self.conns[peer]

    def close(self) -> list[C]:
        """Stop: cancel connect attempts, forget every connection and return them (to close)."""
        self.closed = True
        for attempt in list(self._connecting.values()):
            attempt.cancel()
        conns, self.conns = list(self.conns.values()), {}
        return conns
