"""A weighted, FIFO, thread-safe token budget over staging bytes.

The scarce resource of a receive is the bytes it has in flight (its staging region). Each receive
holds a ``Grant`` for its cost from admission until it ends; the grant's ``release()`` returns the
tokens exactly once, whichever thread calls it and however often::

    acquire_nowait(cost) ──granted──> Grant ──release()──> tokens back, next waiters woken
          │ WouldBlock (not enough free, or someone is already waiting: strict FIFO)
    acquire(cost)          async; waits in FIFO order; cancel-safe
    acquire_blocking(cost, timeout)   sync wait on a thread (only the ``inline`` baseline uses it), in
                                      the time of the budget's clock (``_clock``: real by default)

Oversized rule: a cost above the whole capacity is charged as the whole capacity, so it is granted
only when nothing is held, and it holds the window alone until released.

Decisions happen under one ``threading.Lock`` that is never held across a wait or any I/O; waiters
are woken through their own loop (``loop_caller``) or ``threading.Event``, never from under the lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable

import anyio

from ._clock import Clock, as_clock
from ._errors import WouldBlock
from ._threads import loop_caller


@dataclasses.dataclass(frozen=True)
class BudgetStatistics:
    capacity: int
    in_use: int
    holders: int
    waiters: int
    peak_in_use: int
    grants: int
    oversized_grants: int
    nowait_denials: int

    @property
    def available(self) -> int:
        return max(0, self.capacity - self.in_use)


class Grant:
    """Tokens held for one receive. ``release()`` is idempotent and thread-safe."""

    __slots__ = ("_budget", "cost", "charged", "_released")

    def __init__(self, budget: TransferBudget, cost: int, charged: int) -> None:
        self._budget = budget
        self.cost = cost
        self.charged = charged
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def oversized(self) -> bool:
        return self.cost > self.charged

    def release(self) -> bool:
        """Give the tokens back; True the first time, False on every later call."""
        return self._budget._release(self)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Grant cost={self.cost} charged={self.charged} {state}>"


class _Waiter:
    __slots__ = ("charged", "cost", "wake", "grant")

    def __init__(self, cost: int, charged: int, wake: Callable[[], None]) -> None:
        self.cost = cost
        self.charged = charged
        self.wake = wake
        self.grant: Grant | None = None


class TransferBudget:
    def __init__(self, capacity: int, *, clock: Clock | Callable[[], float] | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"budget capacity must be positive, got {capacity}")
        self._capacity = capacity
        self.clock = as_clock(clock)
        """Whose time ``acquire_blocking`` waits in (``RealClock`` unless a replay injects virtual time)."""
        self._lock = threading.Lock()
        self._in_use = 0
        self._holders = 0
        self._waiters: deque[_Waiter] = deque()
        self._peak = 0
        self._grants = 0
        self._oversized = 0
        self._denials = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def charge_for(self, cost: int) -> int:
        if cost <= 0:
            raise ValueError(f"cost must be positive, got {cost}")
        return min(cost, self._capacity)

    # -- acquiring -------------------------------------------------------------------------------
    def acquire_nowait(self, cost: int) -> Grant:
        """Grant ``cost`` now or raise ``WouldBlock``; fails while anyone is waiting (FIFO)."""
        charged = self.charge_for(cost)
        with self._lock:
            if self._waiters or self._in_use + charged > self._capacity:
                self._denials += 1
                raise WouldBlock(f"budget: {self._capacity - self._in_use} of {self._capacity} free, need {charged}")
            return self._grant_locked(cost, charged)

    async def acquire(self, cost: int) -> Grant:
        """Wait in FIFO order for ``cost``. If cancelled after being granted, gives it back."""
        charged = self.charge_for(cost)
        await anyio.lowlevel.checkpoint_if_cancelled()
        event = anyio.Event()
        call = loop_caller()
        with self._lock:
            if not self._waiters and self._in_use + charged <= self._capacity:
                grant = self._grant_locked(cost, charged)
            else:
                grant = None
                waiter = _Waiter(cost, charged, lambda: call(event.set))
                self._waiters.append(waiter)
        if grant is not None:
            return grant
        try:
            await event.wait()
        except BaseException:
            if not self._abandon(waiter):  # granted while being cancelled: give it back
                assert waiter.grant is not None
                waiter.grant.release()
            raise
        assert waiter.grant is not None
        return waiter.grant

    def acquire_blocking(self, cost: int, timeout: float) -> Grant:
        """Block this (non-event-loop) thread up to ``timeout`` s of the budget's clock; raises
        ``WouldBlock`` on timeout."""
        charged = self.charge_for(cost)
        event = self.clock.event()
        with self._lock:
            if not self._waiters and self._in_use + charged <= self._capacity:
                return self._grant_locked(cost, charged)
            waiter = _Waiter(cost, charged, event.set)
            self._waiters.append(waiter)
        event.wait(timeout)
        if not self._abandon(waiter):
            assert waiter.grant is not None
            return waiter.grant
        raise WouldBlock(f"budget: no {charged} bytes free within {timeout:.3f} s")

    # -- internals -------------------------------------------------------------------------------
    def _grant_locked(self, cost: int, charged: int) -> Grant:
        self._in_use += charged
        self._holders += 1
        self._grants += 1
        if cost > charged:
            self._oversized += 1
        self._peak = max(self._peak, self._in_use)
        return Grant(self, cost, charged)

    def _abandon(self, waiter: _Waiter) -> bool:
        """A waiter gives up. Returns True if it held no grant (it is removed from the queue);
        False if it had been granted (the caller keeps the grant)."""
        with self._lock:
            if waiter.grant is None:
                self._waiters.remove(waiter)
                wake = self._grant_waiters_locked()  # the head may have been what blocked the others
                granted = False
            else:
                wake = []
                granted = True
        for fn in wake:
            fn()
        return not granted

    def _release(self, grant: Grant) -> bool:
        with self._lock:
            if grant._released:
                return False
            grant._released = True
            self._in_use -= grant.charged
            self._holders -= 1
            wake = self._grant_waiters_locked()
        for fn in wake:
            fn()
        return True

    def _grant_waiters_locked(self) -> list[Callable[[], None]]:
        wake = []
        while self._waiters and self._in_use + self._waiters[0].charged <= self._capacity:
            waiter = self._waiters.popleft()
            waiter.grant = self._grant_locked(waiter.cost, waiter.charged)
            wake.append(waiter.wake)
        return wake

    def statistics(self) -> BudgetStatistics:
        with self._lock:
            return BudgetStatistics(
                capacity=self._capacity,
                in_use=self._in_use,
                holders=self._holders,
                waiters=len(self._waiters),
                peak_in_use=self._peak,
                grants=self._grants,
                oversized_grants=self._oversized,
                nowait_denials=self._denials,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<TransferBudget [{s.in_use}/{s.capacity} in use, {s.holders} holders, {s.waiters} waiting]>"
