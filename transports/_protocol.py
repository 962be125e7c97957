"""What the orchestrator needs from a transport, and nothing more.

GEN side life cycle, per peer::

    connect(peer) -> pull(peer, request_id, slice, into, handle=...) ... -> release(peer, request_id)
                  -> hold(peer, [(request_id, handle), ...])  (renew leases of requests still waiting)
                  -> aclose()

``pull`` fills ``into`` (a contiguous tensor of ``layout.wire_shape(num_blocks, slice)``, CPU or
CUDA) with the request's KV slice in wire form and returns the bytes moved. It raises a
``TransportError`` subclass on failure (``PeerBusy``: refused for now, worth a retry). It is
cancel-safe and returns promptly when cancelled, but a receive already posted into ``into`` may not
be withdrawable: the transport then keeps ``landing`` busy until the network layer reports that
receive ended (completed, failed or cancelled by closing the endpoint), and the caller must not
reuse ``into``'s memory before ``landing`` is idle. ``release`` tells the peer it may free its copy;
the peer also frees on a successful pull and when its lease expires.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ._layout import KVSlice


def parse_peer(peer: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (IPv6 hosts may be bracketed); ``ValueError`` otherwise."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected an address 'host:port', got {peer!r}")
    return host.strip("[]"), int(port)


class Landing:
    """Whether a transport may still write into a pull's destination.

    The transport calls ``begin()`` before it posts a receive into the destination and ``end()`` once
    the network layer reports that receive over (any outcome), both on the event-loop thread.
    ``busy`` may be read from any thread; ``when_idle(fn)`` runs ``fn`` at once when idle, else on
    the ``end()`` that makes it idle.
    """

    __slots__ = ("_pending", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._pending = 0  # written under the lock; one int read is atomic, so ``busy`` needs none
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def begin(self) -> None:
        with self._lock:
            self._pending += 1

    def end(self) -> None:
        with self._lock:
            if self._pending <= 0:
                raise RuntimeError("Landing.end() without begin()")
            self._pending -= 1
            if self._pending:
                return
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def when_idle(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pending:
                self._callbacks.append(fn)
                return
        fn()

    def __repr__(self) -> str:
        return f"<Landing {'busy' if self.busy else 'idle'}>"


@runtime_checkable
class Transport(Protocol):
    name: str
    requires_handle: bool
    """Every pull names the handle its peer issued with the prefill (UCX, NIXL: a request id alone
    reads nothing); the engine refuses a request without one at ``submit``."""

    async def connect(self, peer: str) -> None:
        """Make sure an endpoint to ``peer`` exists (reused by later pulls)."""

    def connected(self, peer: str) -> bool:
        """Whether a usable endpoint to ``peer`` exists now (no I/O; callable from any thread). A
        hint: True lets a caller skip ``connect``, and a connection that broke since fails the pull."""

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
        """Pull ``request_id``'s KV ``kv_slice`` from ``peer`` into ``into``; returns bytes moved.

        ``handle`` is the one the peer issued with the prefill. With ``release`` the peer frees its
        copy once this pull succeeded; a request pulled in several chunks passes ``release=False``
        for every chunk but the last. ``landing`` tracks receives posted into ``into``.
        ``remote_blocks``: the peer's block ids of the request, when its prefill reply named them
        (``kv_transfer_params``-style); a one-sided transport then reads without asking for them
        first, a two-sided one ignores them. The engine passes it only when it is known.
        ``remote_epoch``: the peer store's epoch before it put the request (with
        ``remote_blocks``, when the prefill reply named it): a one-sided transport may then READ
        without pinning the blocks first; others ignore it."""

    async def release(self, peer: str, request_id: str, *, handle: str | None = None) -> None:
        """Tell ``peer`` that its KV for ``request_id`` will not be pulled (best effort, never raises)."""

    async def hold(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        """Ask ``peer`` to renew the leases of these (request id, handle) pairs (best effort)."""

    async def aclose(self) -> None:
        """Close every endpoint."""
