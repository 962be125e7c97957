"""CTX-side holding of prefilled KV until GEN pulls it, is told to release it, or its lease ends.

Life cycle of one entry::

    put(request_id, block_ids, lease) -> handle --pull ok--> released (on_release frees the blocks)
                                                 \\-release()--> released
                                                 \\-lease expires (expire())--> released
                                    touch(lease) renews the lease (a GEN that holds the request waiting,
                                    or a pull that starts)

``put`` validates the request id (``transports._ids``) and returns the entry's handle, an unguessable
token that a GEN must present (``handle=``) to read, renew or release the entry; a wrong handle looks
exactly like an unknown request. Local callers that pass no handle are trusted.

``checkout`` pins an entry while a transport sends from it: release() of a pinned entry removes it
at once (later pulls see UnknownRequest) but runs ``on_release`` only when the last checkout
closes, and expiry skips pinned entries, so the blocks are never freed (and reused) under a send.
A full-slice checkout of blocks that form one ascending run is a zero-copy view of the pool.

A one-sided transport (NIXL) whose readers READ without asking first installs ``guard_frees``:
every free is then a revocation: the entry goes at once, its blocks stay allocated until the
guard says every reader that may READ them has let go, and ``revocations`` counts them. A release
that names its ``reader`` (the reader itself let go: its READs ended) is one too, for every other
reader (a second reader may hold the same handle: a front's hand-off retry). ``epoch``
names this store (a random tag per store: a CTX that restarted has another) and that count: a
prefill reply names the epoch before its entry was put, so a reader can tell whether a revocation
it never heard of may have been of its request, and that the request is this store's.

The store is thread-safe: prefill (CTX execution) puts, the transport's event loop takes.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Hashable

import torch

from ._errors import UnknownRequest
from ._ids import check_handle, check_request_id
from ._ids import new_handle as _new_handle
from ._layout import KVLayout, KVSlice, gather, run_start


@dataclasses.dataclass
class _Held:
    block_ids: torch.Tensor
    num_tokens: int
    expires_at: float
    on_release: Callable[[], None] | None
    handle: str
    run_start: int | None = None  # the first block when the blocks are one ascending run (a zero-copy view)
    pins: int = 0
    released: bool = False


Revoker = Callable[[str, Callable[[], None], Hashable | None], None]  # (request id, done, reader that let go)

_EPOCH_BITS = 32
_EPOCH_MASK = (1 << _EPOCH_BITS) - 1


def same_store(a: int, b: int) -> bool:
    """Whether two epochs carry one store's tag (the same store, not one restarted since)."""
    return a >> _EPOCH_BITS == b >> _EPOCH_BITS


def epoch_vouches(epoch: int | None, since: int | None) -> bool:
    """Whether no revocation counted after ``since`` (a store's epoch when a reader began hearing
    its revocations) can have been of a request put at ``epoch``: both of one store, and the
    request put no earlier (and the count not at its top, where it stops counting)."""
    return (epoch is not None and since is not None and same_store(epoch, since)
            and since <= epoch < (epoch | _EPOCH_MASK))


class Checkout:
    """A pinned view (or copy) of one entry's wire form; ``close()`` unpins it (idempotent)."""

    def __init__(self, store: KVStore, held: _Held, tensor: torch.Tensor) -> None:
        self._store = store
        self._held: _Held | None = held
        self.tensor = tensor

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._store._unpin(held)

    def __enter__(self) -> Checkout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class KVStoreStatistics:
    held_requests: int
    held_blocks: int
    released: int
    expired: int
    open_pins: int = 0  # checkouts and pins not closed yet (a released entry's blocks are freed when it is 0)


class KVStore:
    def __init__(self, layout: KVLayout, pool: torch.Tensor, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.pool = pool
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released = 0
        self._expired = 0
        self._pins = 0  # open checkouts and pins, of held and released entries
        self._revoker: Revoker | None = None
        self._handle_key: bytes | None = None  # set: the handles it issues name their request (_ids)
        self._revocations = 0
        self._tag = (secrets.randbits(30) + 1) << _EPOCH_BITS  # this store among all (restarts included)

    def name_handles(self, key: bytes | None) -> None:
        """Issue handles that name their request under ``key`` (``transports._ids.handle_names``)
        from here on (``None``: plain random handles)."""
        self._handle_key = key

    def new_handle(self, request_id: str, num_tokens: int = 0) -> str:
        """A handle for ``request_id`` (a prompt of ``num_tokens``) as ``put`` would issue it (a TP
        CTX's rank 0 issues one for the whole group)."""
        return _new_handle(check_request_id(request_id), self._handle_key, num_tokens=num_tokens)

    def guard_frees(self, revoker: Revoker | None) -> None:
        """Route every free through ``revoker(request_id, done, reader)`` (called after the entry is
        gone, on the releasing thread; ``reader``: the one that let go, ``None`` when the store
        decided): its blocks stay allocated until ``done()`` is called. ``None`` removes the guard
        (revocations under way still end with their ``done``)."""
        with self._lock:
            self._revoker = revoker

    @property
    def revocations(self) -> int:
        """Revocations so far (frees while a guard was installed)."""
        with self._lock:
            return self._revocations

    @property
    def epoch(self) -> int:
        """This store's random tag (high bits) and its revocations so far (low 32 bits); past 2**32
        revocations the count stays at its top (``epoch_vouches`` then vouches for nothing)."""
        with self._lock:
            return self._tag | min(self._revocations, _EPOCH_MASK)

    def _guard_locked(self, held: _Held) -> Callable[[], None] | None:
        """With a guard installed: pin ``held`` until its revocation ends; that pin's ``done`` (a
        checkout's idempotent ``close``)."""
        if self._revoker is None:
            return None
        held.pins += 1
        self._pins += 1
        self._revocations += 1
        return Checkout(self, held, None).close  # type: ignore[arg-type]

    def put(
        self,
        request_id: str,
        block_ids: torch.Tensor,
        *,
        num_tokens: int,
        lease_s: float,
        on_release: Callable[[], None] | None = None,
        handle: str | None = None,
    ) -> str:
        """Hold ``block_ids`` for ``request_id`` until pulled, released or ``lease_s`` passes; returns
        its handle (``handle`` if given). Raises ``ValueError`` (``InvalidRequestId`` for a bad id) for
        an id that breaks the rule or is already held."""
        check_request_id(request_id)
        handle = self.new_handle(request_id, num_tokens) if handle is None else check_handle(handle)
        with self._lock:
            if request_id in self._held:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._held[request_id] = _Held(block_ids.clone(), num_tokens, self._clock() + lease_s, on_release, handle,
                                           run_start(block_ids))
        return handle

    def _get_locked(self, request_id: str, handle: str | None) -> _Held:
        held = self._held.get(request_id)
        if held is None or (handle is not None and not hmac.compare_digest(held.handle, handle)):
            raise UnknownRequest(f"no KV held for request {request_id!r}")
        return held

    def holds(self, request_id: str) -> bool:
        """Whether KV is held for ``request_id`` now (a ``put`` of it would be refused)."""
        with self._lock:
            return request_id in self._held

    def num_blocks(self, request_id: str, *, handle: str | None = None) -> int:
        with self._lock:
            return int(self._get_locked(request_id, handle).block_ids.numel())

    def block_ids(self, request_id: str, *, handle: str | None = None) -> list[int]:
        """The pool blocks holding ``request_id``'s KV, in order (what a prefill reply names for a
        one-sided reader); raises ``UnknownRequest`` if not held."""
        with self._lock:
            return [int(b) for b in self._get_locked(request_id, handle).block_ids.tolist()]

    def pin(self, request_id: str, *, handle: str | None = None) -> tuple[list[int], Checkout]:
        """Pin ``request_id``'s blocks in place (no gather; a one-sided READ reads them): their ids
        and a ``Checkout`` without a tensor. Released blocks stay allocated until it is closed."""
        with self._lock:
            held = self._get_locked(request_id, handle)
            held.pins += 1
            self._pins += 1
            blocks = [int(b) for b in held.block_ids.tolist()]
        return blocks, Checkout(self, held, None)  # type: ignore[arg-type]

    def touch(self, request_id: str, lease_s: float, *, handle: str | None = None) -> bool:
        """Renew ``request_id``'s lease to at least ``lease_s`` from now; False when not held."""
        with self._lock:
            try:
                held = self._get_locked(request_id, handle)
            except UnknownRequest:
                return False
            held.expires_at = max(held.expires_at, self._clock() + lease_s)
            return True

    def gather(self, request_id: str, kv_slice: KVSlice, *, handle: str | None = None) -> torch.Tensor:
        """The wire form of ``request_id``'s slice; raises ``UnknownRequest`` if not held."""
        self.layout.check_slice(kv_slice)
        with self._lock:
            block_ids = self._get_locked(request_id, handle).block_ids
        return gather(self.pool, block_ids, kv_slice)

    def _gather_held(self, held: _Held, kv_slice: KVSlice) -> torch.Tensor:
        """The wire form of a pinned entry's slice, from its own blocks (never looked up again by
        id: released and put again meanwhile, the id would name other blocks)."""
        return gather(self.pool, held.block_ids, kv_slice)

    def checkout(self, request_id: str, kv_slice: KVSlice, *, handle: str | None = None) -> Checkout:
        """The wire form of ``request_id``'s slice, pinned until the checkout is closed.

        A zero-copy view of the pool when the slice is the whole layout and the blocks are one
        ascending run; a gathered copy otherwise. Raises ``UnknownRequest`` if not held.
        """
        self.layout.check_slice(kv_slice)
        with self._lock:
            held = self._get_locked(request_id, handle)
            held.pins += 1
            self._pins += 1
        try:
            view = self._view(held, kv_slice)
            tensor = view if view is not None else self._gather_held(held, kv_slice)
        except BaseException:
            self._unpin(held)
            raise
        return Checkout(self, held, tensor)

    def checkout_view(self, request_id: str, kv_slice: KVSlice, *, handle: str | None = None) -> Checkout | None:
        """Like ``checkout``, but only when no copy is needed (a zero-copy view of the pool); None
        (nothing pinned) when a gather would be. Raises ``UnknownRequest`` if not held."""
        self.layout.check_slice(kv_slice)
        with self._lock:
            held = self._get_locked(request_id, handle)
            view = self._view(held, kv_slice)
            if view is None:
                return None
            held.pins += 1
            self._pins += 1
        return Checkout(self, held, view)

    def _view(self, held: _Held, kv_slice: KVSlice) -> torch.Tensor | None:
        """The entry's wire form as a zero-copy view of the pool: a whole-layout slice of blocks that
        form one ascending run (found once, at ``put``); None when it needs a gather."""
        if held.run_start is None or not self.layout.is_whole(kv_slice):
            return None
        return self.pool[held.run_start : held.run_start + held.block_ids.numel()]

    def _unpin(self, held: _Held) -> None:
        with self._lock:
            held.pins -= 1
            self._pins -= 1
            free_now = held.pins == 0 and held.released
        if free_now and held.on_release is not None:
            held.on_release()

    def release(self, request_id: str, *, handle: str | None = None, reader: Hashable | None = None) -> bool:
        """Free ``request_id``'s KV (after its last checkout closes, and its revocation: every reader
        but ``reader``, the one that let go, if named); False when it was not held (or ``handle``
        is not its handle)."""
        with self._lock:
            try:
                held = self._get_locked(request_id, handle)
            except UnknownRequest:
                return False
            del self._held[request_id]
            self._released += 1
            held.released = True
            revoked = self._guard_locked(held)
            revoker = self._revoker
            free_now = held.pins == 0
        if revoked is not None and revoker is not None:
            revoker(request_id, revoked, reader)
        if free_now and held.on_release is not None:
            held.on_release()
        return True

    def expire(self) -> list[str]:
        """Release every entry whose lease has ended and that no transport is sending; their ids."""
        now = self._clock()
        with self._lock:
            dead = [rid for rid, h in self._held.items() if h.expires_at <= now and h.pins == 0]
            held = [self._held.pop(rid) for rid in dead]
            self._expired += len(dead)
            for h in held:
                h.released = True
            revoked = [self._guard_locked(h) for h in held]
            revoker = self._revoker
        for rid, h, done in zip(dead, held, revoked):
            if done is not None and revoker is not None:
                revoker(rid, done, None)
            elif h.on_release is not None:
                h.on_release()
        return dead

    def statistics(self) -> KVStoreStatistics:
        with self._lock:
            return KVStoreStatistics(
                held_requests=len(self._held),
                held_blocks=sum(int(h.block_ids.numel()) for h in self._held.values()),
                released=self._released,
                expired=self._expired,
                open_pins=self._pins,
            )
