"""What the orchestrator needs from a transport, and nothing more.

GEN side life cycle, per peer::

    connect(peer) -> pull(peer, request_id, slice, into) ... -> release(peer, request_id) -> aclose()

``pull`` fills ``into`` (a contiguous tensor of ``layout.wire_shape(num_blocks, slice)``, CPU or
CUDA) with the request's KV slice in wire form and returns the bytes moved. It raises a
``TransportError`` subclass on failure; it is cancel-safe (a cancelled pull leaves the endpoint usable
or closes it, never half-delivers into a later pull's buffer). ``release`` tells the peer it may free
its copy (after an abort); the peer also frees on a successful pull and when the lease expires.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ._layout import KVSlice


@runtime_checkable
class Transport(Protocol):
    name: str

    async def connect(self, peer: str) -> None:
        """Make sure an endpoint to ``peer`` exists (reused by later pulls)."""

    async def pull(
        self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, *, release: bool = True
    ) -> int:
        """Pull ``request_id``'s KV ``kv_slice`` from ``peer`` into ``into``; returns bytes moved.

        With ``release`` the peer frees its copy once this pull succeeded; a request pulled in
        several chunks passes ``release=False`` for every chunk but the last."""

    async def release(self, peer: str, request_id: str) -> None:
        """Tell ``peer`` that its KV for ``request_id`` will not be pulled (best effort)."""

    async def aclose(self) -> None:
        """Close every endpoint."""
