"""The clock the engine reads, and the blocking waits of the ``inline`` path, in one injectable object.

    clock()  / clock.now()     seconds, monotonic (deadlines, arrival times, step timings)
    clock.event()              a one-shot flag: ``set()`` from any thread; ``wait(timeout) -> bool``
                               blocks the calling (non-event-loop) thread until it is set or
                               ``timeout`` seconds of *this clock* have passed

``RealClock`` (the default everywhere) is ``time.perf_counter`` and ``threading.Event``. A replay in
virtual time (``examples/sim``) passes a clock whose ``now()`` is the event loop's virtual time and
whose events wait in that time; the library's code is the same in both cases. Only the ``inline``
baseline waits on ``event()`` (``TransferBudget.acquire_blocking``, ``ReceiveGroup.connect_blocking``);
``orchestrated`` never waits.

``GenEngine(clock=...)`` also accepts a bare callable returning seconds (as it always has):
``as_clock`` wraps it in a ``RealClock`` that waits in real time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class ClockEvent(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block this thread until set or ``timeout`` (clock seconds); True if set."""
        ...


@runtime_checkable
class Clock(Protocol):
    def __call__(self) -> float: ...

    def now(self) -> float: ...

    def event(self) -> ClockEvent: ...


class RealClock:
    """Wall time: ``now`` is ``time.perf_counter`` (or the callable given), events are ``threading.Event``."""

    __slots__ = ("_now",)

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now

    def __call__(self) -> float:
        return self._now()

    def now(self) -> float:
        return self._now()

    def event(self) -> ClockEvent:
        return threading.Event()

    def __repr__(self) -> str:
        return f"<RealClock {getattr(self._now, '__qualname__', self._now)!r}>"


REAL_CLOCK = RealClock()


def as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    """``clock`` itself when it is a ``Clock``; a ``RealClock`` reading a bare callable; the default for None."""
    if clock is None:
        return REAL_CLOCK
    if isinstance(clock, Clock):
        return clock
    return RealClock(clock)
