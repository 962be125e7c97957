"""An in-process transport for tests and benchmarks: peers are ``KVStore``s in this process.

It behaves like a network: each pull costs ``latency_s + nbytes / bandwidth_bytes_per_s`` of
waiting (an anyio sleep, so the CPU stays free), and faults can be injected per request or peer::

    transport.fail(request_id, PeerClosed("boom"))   # the next pull of it raises that
    transport.stall(request_id)                       # its pull never completes (until cancelled)
    transport.set_peer_down(peer, True)               # connect and pull to it raise PeerUnreachable

Counters (``pulls``, ``bytes_moved``, ``releases``, ``in_flight``) let tests check what moved.
"""

from __future__ import annotations

import dataclasses

import anyio
import torch

from ._errors import PeerUnreachable, ProtocolViolation, TransportError, UnknownRequest
from ._layout import KVSlice
from ._store import KVStore


@dataclasses.dataclass
class InProcCounters:
    connects: int = 0
    pulls: int = 0
    bytes_moved: int = 0
    releases: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0


class InProcTransport:
    name = "inproc"

    def __init__(
        self,
        stores: dict[str, KVStore],
        *,
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
        connect_latency_s: float = 0.0,
    ) -> None:
        self._stores = stores
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.connect_latency_s = connect_latency_s
        self._failures: dict[str, TransportError] = {}
        self._stalled: set[str] = set()
        self._down: set[str] = set()
        self._connected: set[str] = set()
        self.counters = InProcCounters()

    # -- fault injection ---------------------------------------------------------------------------
    def fail(self, request_id: str, error: TransportError) -> None:
        self._failures[request_id] = error

    def stall(self, request_id: str) -> None:
        self._stalled.add(request_id)

    def set_peer_down(self, peer: str, down: bool) -> None:
        (self._down.add if down else self._down.discard)(peer)
        self._connected.discard(peer)

    # -- Transport -------------------------------------------------------------------------------
    def _store(self, peer: str) -> KVStore:
        if peer in self._down or peer not in self._stores:
            raise PeerUnreachable(f"cannot reach {peer}", peer=peer)
        return self._stores[peer]

    async def connect(self, peer: str) -> None:
        self._store(peer)
        if peer not in self._connected:
            self.counters.connects += 1
            if self.connect_latency_s:
                await anyio.sleep(self.connect_latency_s)
            self._connected.add(peer)
        await anyio.lowlevel.checkpoint()

    async def pull(
        self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, *, release: bool = True
    ) -> int:
        store = self._store(peer)
        c = self.counters
        c.in_flight += 1
        c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
        try:
            if request_id in self._failures:
                raise self._failures.pop(request_id)
            if request_id in self._stalled:
                await anyio.sleep_forever()
            data = store.gather(request_id, kv_slice)
            if tuple(data.shape) != tuple(into.shape) or data.dtype != into.dtype:
                raise ProtocolViolation(
                    f"{request_id}: peer has {tuple(data.shape)} {data.dtype}, receiver expects "
                    f"{tuple(into.shape)} {into.dtype}",
                    peer=peer,
                )
            nbytes = data.numel() * data.element_size()
            delay = self.latency_s + (nbytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0)
            await anyio.sleep(delay)
            into.copy_(data)
            c.pulls += 1
            c.bytes_moved += nbytes
            if release:
                store.release(request_id)
            return nbytes
        finally:
            c.in_flight -= 1

    async def release(self, peer: str, request_id: str) -> None:
        store = self._store(peer)
        self.counters.releases += 1
        store.release(request_id)
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._connected.clear()


__all__ = ["InProcTransport", "InProcCounters", "UnknownRequest"]
