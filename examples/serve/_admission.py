"""The front's admission: at most ``limit`` requests in flight, then a bounded FIFO queue with a
timeout, then 429 (SGLang's ``--max-concurrent-requests`` / ``--queue-size`` / ``--queue-timeout-secs``).

    enter(n):  n free slots and nobody waiting ──> in (all n at once)
               else room in the queue ──> wait (FIFO) for n slots ──> in     (timeout_s passed: 429)
               else ──> 429 at once
    leave(n):  n slots come back; the oldest waiter takes its n as soon as that many are free, and
               nobody behind it overtakes (a waiter for 3 is not starved by a stream of waiters for 1)

A request of ``n`` choices takes its ``n`` slots in one step: two requests that each held part of
what they need could otherwise hold every slot and wait for each other until ``timeout_s``. More
than ``limit`` at once can never be granted (``enter`` refuses it: the caller answers 400 first).
A waiter cancelled (its client gone) after it was granted gives its slots back, to the next one.
"""

from __future__ import annotations

import collections
import dataclasses

import anyio

from examples.serve._api import ApiError


@dataclasses.dataclass(frozen=True)
class AdmissionStatistics:
    active: int
    waiting: int
    limit: int
    queue_size: int


class _Waiter:
    __slots__ = ("event", "granted", "weight")

    def __init__(self, weight: int) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.weight = weight


class Admission:
    def __init__(self, limit: int, queue_size: int, timeout_s: float, *, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    def __repr__(self) -> str:
        return f"<Admission [{self.active}/{self.limit} active, {len(self._waiters)}/{self.queue_size} queued]>"

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(self.active, len(self._waiters), self.limit, self.queue_size)

    def enter_nowait(self, n: int = 1) -> bool:
        """Take ``n`` slots if that many are free and nobody waits (FIFO: no overtaking)."""
        self._check(n)
        if self.active + n <= self.limit and not self._waiters:
            self.active += n
            return True
        return False

    def _check(self, n: int) -> None:
        if not 0 < n <= self.limit:
            raise ValueError(f"cannot take {n} of {self.limit} slots")

    async def enter(self, n: int = 1) -> None:
        """``n`` slots, now or after waiting in the queue; ``ApiError(429)`` when the queue is full or
        the wait passed ``timeout_s``."""
        if self.enter_nowait(n):
            return
        if len(self._waiters) >= self.queue_size:
            raise ApiError(429, f"the front has {self.active} requests in flight (limit {self.limit}) and "
                           f"{len(self._waiters)} queued (queue size {self.queue_size}); retry later",
                           code="too_many_requests", retry_after=self.retry_after_s)
        w = _Waiter(n)
        self._waiters.append(w)
        try:
            with anyio.move_on_after(self.timeout_s):
                await w.event.wait()
        except BaseException:  # cancelled: slots handed to us meanwhile go to the next waiter
            self._abandon(w)
            raise
        if not w.granted:
            self._abandon(w)
            raise ApiError(429, f"waited {self.timeout_s:g} s in the queue for {n} of {self.limit} slots; "
                           "retry later", code="too_many_requests", retry_after=self.retry_after_s)

    def _abandon(self, w: _Waiter) -> None:
        if w.granted:
            self.leave(w.weight)
        else:
            self._waiters.remove(w)
            self._grant()  # it may have been the head that held back smaller waiters behind it

    def leave(self, n: int = 1) -> None:
        """A request (or ``n`` choices of one) ended: its slots come back, to the oldest waiters first."""
        self.active -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.active + self._waiters[0].weight <= self.limit:
            w = self._waiters.popleft()
            self.active += w.weight
            w.granted = True
            w.event.set()
