"""The front's admission: at most ``limit`` requests in flight, then a bounded FIFO queue with a
timeout, then 429 (SGLang's ``--max-concurrent-requests`` / ``--queue-size`` / ``--queue-timeout-secs``).

    enter():  a free slot and nobody waiting ──> in
              else room in the queue ──> wait (FIFO) for a slot ──> in     (timeout_s passed: 429)
              else ──> 429 at once
    leave():  the slot goes to the oldest waiter (it never returns to the pool while one waits)

A waiter cancelled (its client gone) after it was handed a slot gives the slot to the next one.
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
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


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

    def enter_nowait(self) -> bool:
        """Take a slot if one is free and nobody waits (FIFO: no overtaking)."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """A slot, now or after waiting in the queue; ``ApiError(429)`` when the queue is full or the
        wait passed ``timeout_s``."""
        if self.enter_nowait():
            return
        if len(self._waiters) >= self.queue_size:
            raise ApiError(429, f"the front has {self.active} requests in flight (limit {self.limit}) and "
                           f"{len(self._waiters)} queued (queue size {self.queue_size}); retry later",
                           code="too_many_requests", retry_after=self.retry_after_s)
        w = _Waiter()
        self._waiters.append(w)
        try:
            with anyio.move_on_after(self.timeout_s):
                await w.event.wait()
        except BaseException:  # cancelled: a slot handed to us meanwhile goes to the next waiter
            self._abandon(w)
            raise
        if not w.granted:
            self._abandon(w)
            raise ApiError(429, f"waited {self.timeout_s:g} s in the queue for one of {self.limit} slots; retry later",
                           code="too_many_requests", retry_after=self.retry_after_s)

    def _abandon(self, w: _Waiter) -> None:
        if w.granted:
            self.leave()
        else:
            self._waiters.remove(w)

    def leave(self) -> None:
        """A request ended: its slot goes to the oldest waiter, else back to the pool."""
        if self._waiters:
            w = self._waiters.popleft()
            w.granted = True
            w.event.set()
        else:
            self.active -= 1
