"""Virtual time for a replay: trio's ``MockClock`` as the library's ``Clock``, and an execution thread
whose blocking waits the event loop serves in that time.

    trio.run(main, clock=MockClock(autojump_threshold=0))     virtual time jumps whenever every task
                                                               of the loop is blocked
    VirtualClock(mock).now()                                  that virtual time, from any thread
    VirtualClock.event().wait(timeout)                        on the execution thread: hands the wait
                                                               to the loop (below); never on the loop's thread
    await ExecutionThread.call(fn)                            runs ``fn`` (an engine step) on its own
                                                               thread while the loop's thread waits for it

The hand-over is strict: while ``fn`` runs, the loop's thread is parked *synchronously* inside
``call`` (not at an await), so the loop cannot run and virtual time cannot move while real Python
runs a step. When ``fn`` waits on a virtual event (the inline path's ``acquire_blocking`` or
``connect_blocking``), the thread parks and ``call`` awaits that event on the loop, with the
timeout in virtual time; the receive tasks run meanwhile, and the thread resumes with the outcome.
So a step that blocks costs exactly the virtual time it waited, and a run is a deterministic
function of its inputs (and of trio's scheduling seed, which ``seed_scheduler`` fixes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio
import trio.testing

T = TypeVar("T")


def seed_scheduler(seed: int) -> None:
    """Fix the order in which trio runs tasks that are ready at once (trio randomises it, from a
    ``random.Random`` it lets test tools seed: hypothesis does the same)."""
    trio._core._run._r.seed(seed)  # type: ignore[attr-defined]


class VirtualEvent:
    """``threading.Event``'s ``set``/``is_set``/``wait`` in virtual time (see the module docstring)."""

    __slots__ = ("_clock", "_flag", "_trio")

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._flag = False
        self._trio = trio.Event()

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        if threading.get_ident() == self._clock.loop_thread:
            self._trio.set()
        else:  # the execution thread: the loop sets it at the next hand-over (it is parked until then)
            self._clock._pending.append(self)

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        return self._clock._block(self, timeout)


class VirtualClock:
    """The library's ``Clock`` (``orchestrator._clock``) over a ``trio.testing.MockClock``."""

    def __init__(self, mock: trio.testing.MockClock) -> None:
        """Make it on the loop's thread (inside ``trio.run``)."""
        self._mock = mock
        self.loop_thread: int | None = threading.get_ident()
        self._pending: list[VirtualEvent] = []
        self._thread: ExecutionThread | None = None
        self.blocked_waits = 0
        """Blocking waits the execution thread handed to the loop (inline only)."""

    def __call__(self) -> float:
        return self._mock.current_time()

    def now(self) -> float:
        return self._mock.current_time()

    def event(self) -> VirtualEvent:
        return VirtualEvent(self)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            event._trio.set()

    def _block(self, event: VirtualEvent, timeout: float | None) -> bool:
        if self._thread is None or threading.get_ident() != self._thread.ident:
            raise RuntimeError("a blocking wait outside the replay's execution thread (it would stop the event loop)")
        self.blocked_waits += 1
        return self._thread._block(event, timeout)


class ExecutionThread:
    """One thread that runs the sync calls given to ``call``, one at a time, in lockstep with the loop."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        clock.loop_thread = threading.get_ident()
        clock._thread = self
        self._to_thread: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._to_loop: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="replay-execution", daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def _main(self) -> None:
        while True:
            fn = self._to_thread.get()
            if fn is None:
                return
            try:
                result = fn()
            except BaseException as exc:  # handed to the loop's thread, raised there
                self._to_loop.put(("done", None, exc))
            else:
                self._to_loop.put(("done", result, None))

    def _block(self, event: VirtualEvent, timeout: float | None) -> bool:
        self._to_loop.put(("wait", event, timeout))
        return bool(self._to_thread.get())

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the execution thread; its virtual waits are served here, in virtual time."""
        self._to_thread.put(fn)
        while True:
            kind, a, b = self._to_loop.get()  # the loop's thread parks here, synchronously
            self._clock._flush()
            if kind == "done":
                if b is not None:
                    raise b
                return a  # type: ignore[no-any-return]
            event: VirtualEvent = a
            with trio.CancelScope(shield=True):  # the thread is parked mid-step: never abandon it
                if b is None:
                    await event._trio.wait()
                else:
                    with trio.move_on_after(max(0.0, b)):
                        await event._trio.wait()
            self._to_thread.put(event._flag)

    def close(self) -> None:
        self._to_thread.put(None)
        self._thread.join(timeout=5)
