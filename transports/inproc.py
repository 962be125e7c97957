"""An in-process transport for tests and benchmarks: peers are ``KVStore``s in this process.

It behaves like a network: each pull costs ``latency_s + nbytes / bandwidth_bytes_per_s`` of
waiting (an anyio sleep, so the CPU stays free), and faults can be injected per request or peer::

    transport.fail(request_id, PeerClosed("boom"))   # the next pull of it raises that
    transport.stall(request_id)                       # its pull never completes (until cancelled)
    transport.stall_landing(request_id)               # ... and its posted receive outlives the
                                                      # cancellation until finish_landing(request_id)
    transport.land_late(request_id)                   # its pull succeeds, its landing busy until then
    transport.busy(request_id, times)                 # its next ``times`` pulls raise PeerBusy
    transport.set_peer_down(peer, True)               # connect and pull to it raise PeerUnreachable

Counters (``pulls``, ``bytes_moved``, ``releases``, ``holds``, ``in_flight``) let tests check what
moved. Handles are checked as a CTX node checks them (a wrong handle is an unknown request).
"""

from __future__ import annotations

import dataclasses

import anyio
import torch

from collections.abc import Sequence

from ._errors import PeerBusy, PeerUnreachable, ProtocolViolation, TransportError, UnknownRequest
from ._layout import KVSlice
from ._protocol import Landing
from ._store import KVStore, same_store


@dataclasses.dataclass
class InProcCounters:
    connects: int = 0
    pulls: int = 0
    bytes_moved: int = 0
    releases: int = 0
    holds: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    pulls_with_blocks: int = 0  # pulls that named the peer's block ids (checked against the store)
    pulls_with_epoch: int = 0  # of those, pulls that named the peer store's epoch (not past its revocations)


class InProcTransport:
    name = "inproc"
    requires_handle = False  # in one process: the store trusts a caller that names no handle

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
        self._failures: dict[str, TransportError | TimeoutError] = {}
        self._stalled: set[str] = set()
        self._stalled_landings: dict[str, Landing | None] = {}
        self._busy: dict[str, int] = {}
        self.hold_lease_s = 60.0
        self._down: set[str] = set()
        self._connected: set[str] = set()
        self.counters = InProcCounters()

    # -- fault injection ---------------------------------------------------------------------------
    def fail(self, request_id: str, error: TransportError | TimeoutError) -> None:
        self._failures[request_id] = error

    def stall(self, request_id: str) -> None:
        self._stalled.add(request_id)

    def stall_landing(self, request_id: str) -> None:
        self.stall(request_id)
        self.land_late(request_id)

    def land_late(self, request_id: str) -> None:
        """The next pull of ``request_id`` succeeds while its landing stays busy until
        ``finish_landing``: a transport that reports a receive whole before it is over (a bug a
        GEN must survive without reusing the blocks)."""
        self._stalled_landings[request_id] = None

    def finish_landing(self, request_id: str) -> None:
        """The stalled receive of ``request_id`` ends now (as UCX would report it, late)."""
        landing = self._stalled_landings.pop(request_id, None)
        if landing is not None:
            landing.end()

    def busy(self, request_id: str, times: int) -> None:
        self._busy[request_id] = times

    def set_peer_down(self, peer: str, down: bool) -> None:
        (self._down.add if down else self._down.discard)(peer)
        self._connected.discard(peer)

    # -- Transport -------------------------------------------------------------------------------
    def _store(self, peer: str) -> KVStore:
        if peer in self._down or peer not in self._stores:
            raise PeerUnreachable(f"cannot reach {peer}", peer=peer)
        return self._stores[peer]

    def connected(self, peer: str) -> bool:
        return peer in self._connected and peer not in self._down

    async def connect(self, peer: str) -> None:
        self._store(peer)
        if peer not in self._connected:
            self.counters.connects += 1
            if self.connect_latency_s:
                await anyio.sleep(self.connect_latency_s)
            self._connected.add(peer)
        await anyio.lowlevel.checkpoint()

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
        store = self._store(peer)
        c = self.counters
        c.in_flight += 1
        c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
        try:
            if request_id in self._failures:
                raise self._failures.pop(request_id)
            if self._busy.get(request_id):
                self._busy[request_id] -= 1
                raise PeerBusy(f"{peer} is busy", peer=peer)
            if request_id in self._stalled_landings and landing is not None:
                landing.begin()  # a receive posted into `into` that cancellation cannot withdraw
                self._stalled_landings[request_id] = landing
            if request_id in self._stalled:
                await anyio.sleep_forever()
            if remote_blocks is not None:
                c.pulls_with_blocks += 1
                if list(remote_blocks) != store.block_ids(request_id, handle=handle):
                    raise ProtocolViolation(f"{request_id}: the block ids given are not the ones {peer} holds", peer=peer)
                if remote_epoch is not None:
                    c.pulls_with_epoch += 1
                    now = store.epoch
                    if not (same_store(remote_epoch, now) and remote_epoch <= now):
                        raise ProtocolViolation(f"{request_id}: epoch {remote_epoch} is not one of {peer}'s", peer=peer)
            data = store.gather(request_id, kv_slice, handle=handle)
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
                store.release(request_id, handle=handle)
            return nbytes
        finally:
            c.in_flight -= 1

    async def release(self, peer: str, request_id: str, *, handle: str | None = None) -> None:
        try:  # like UCX and NIXL: a release to a peer nothing was pulled from connects first
            await self.connect(peer)
            store = self._store(peer)
        except PeerUnreachable:
            return
        self.counters.releases += 1
        store.release(request_id, handle=handle)
        await anyio.lowlevel.checkpoint()

    async def hold(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        try:
            await self.connect(peer)
            store = self._store(peer)
        except PeerUnreachable:
            return
        self.counters.holds += 1
        for request_id, handle in items:
            store.touch(request_id, self.hold_lease_s, handle=handle)
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._connected.clear()


__all__ = ["InProcTransport", "InProcCounters", "UnknownRequest"]
