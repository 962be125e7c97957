"""Virtual time for a replay: trio's ``MockClock`` as the library's ``Clock``, and an execution thread
whose blocking waits the event loop serves in that time.

    trio.run(main, clock=MockClock(autojump_threshold=0))     virtual time jumps whenever every task
                                                               of the loop is blocked
    VirtualClock(mock).now()                                  that virtual time, from any thread
    VirtualClock.event().wait(timeout)                        on the execution thread: hands the wait
                                                               to the loop (below); never on the loop's thread
    await ExecutionThread.call(fn)                            runs ``fn`` (an engine step) on its own
                                                               thread while the loop's thread waits for it
    await call_all(threads, fns)                              ``fns[i]`` on ``threads[i]``, their waits
                                                               overlapping in virtual time

Several threads (``call_all``: one per rank of a GEN group) run side by side in virtual time, one
at a time in real time. A replay pins itself to one CPU while it runs (``one_cpu``).

The hand-over is strict: while ``fn`` runs, the loop's thread is parked *synchronously* inside
``call`` (not at an await), so the loop cannot run and virtual time cannot move while real Python
runs a step. When ``fn`` waits on a virtual event (the inline path's ``acquire_blocking`` or
``connect_blocking``), the thread parks and ``call`` awaits that event on the loop, with the
timeout in virtual time; the receive tasks run meanwhile, and the thread resumes with the outcome.
So a step that blocks costs exactly the virtual time it waited, and a run is a deterministic
function of its inputs (and of trio's scheduling seed, which ``seed_scheduler`` fixes).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence as Seq
from typing import Any, TypeVar

import trio
import trio.testing

from examples import _proc

T = TypeVar("T")


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """Run this thread, and the execution threads it starts, on one CPU (restored after).

    A replay runs one thread at a time by construction, so a second CPU buys nothing, while every
    hand-over to an execution thread on another CPU costs a cross-CPU wake-up (on this project's
    2-core virtual machine a thread round trip took 60-110 µs across CPUs, 15-20 µs on one; an
    inline replay at GEN TP4 makes 8 per admission: 3,072 requests took 23 s unpinned, 14 s pinned)."""
    getter, setter = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:  # not Linux: as it is
        yield
        return
    before = getter(0)
    try:
        setter(0, {_current_cpu(before)})
    except OSError:
        yield
        return
    try:
        yield
    finally:
        setter(0, before)


def _current_cpu(allowed: set[int]) -> int:
    """The CPU this thread runs on now (where the OS found room for it), else the first allowed one:
    two replays at once then most likely keep to different CPUs."""
    cpu = _proc.processor("thread-self")
    return cpu if cpu in allowed else min(allowed)


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
        self._threads: list[ExecutionThread] = []
        self.blocked_waits = 0
        self.on_park: Callable[[], None] | None = None
        """Called on the loop's thread each time an execution thread parks on a virtual wait (the
        replay hands the outputs emitted so far to their clients, as the real node's event loop
        takes them at once while the execution thread waits)."""
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
        me = threading.get_ident()
        thread = next((t for t in self._threads if t.ident == me), None)
        if thread is None:
            raise RuntimeError("a blocking wait outside the replay's execution threads (it would stop the event loop)")
        self.blocked_waits += 1
        return thread._block(event, timeout)


class ExecutionThread:
    """One thread that runs the sync calls given to it, one at a time, in lockstep with the loop."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        clock.loop_thread = threading.get_ident()
        clock._threads.append(self)
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

    def _resume(self, payload: Any) -> tuple[str, Any, Any]:
        """On the loop's thread: let this thread run (a call, or a wait's outcome) and park until it
        parks again: it finished (``done``) or waits on a virtual event (``wait``)."""
        self._to_thread.put(payload)
        message = self._to_loop.get()  # the loop's thread parks here, synchronously
        self._clock._flush()
        if message[0] == "wait" and self._clock.on_park is not None:
            self._clock.on_park()  # the thread waits now: the loop hands on what it did so far
        return message

    async def _serve(self, messages: list[tuple[str, Any, Any]], i: int) -> None:
        """Serve this thread's waits in virtual time until it is done (``messages[i]``: its last message)."""
        message = messages[i]
        while message[0] == "wait":
            event: VirtualEvent = message[1]
            timeout = message[2]
            if timeout is None:
                await event._trio.wait()
            else:
                with trio.move_on_after(max(0.0, timeout)):
                    await event._trio.wait()
            message = messages[i] = self._resume(event._flag)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this thread; its virtual waits are served here, in virtual time."""
        return (await call_all([self], [fn]))[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        self._to_thread.put(None)
        self._thread.join(timeout=5)


async def call_all(threads: Seq[ExecutionThread], fns: Seq[Callable[[], Any]]) -> list[Any]:
    """Run ``fns[i]`` on ``threads[i]``, side by side in virtual time: as ranks of a group, each on its
    own thread, whose blocking waits overlap (the step takes the longest, not the sum).

    Deterministic: only one thread (or the loop) runs at a time. Each call runs until it parks, in
    order; then every wait is served at once on the loop, and a thread whose event fires (or whose
    timeout passes) runs, alone, until it parks again. Exceptions are raised in thread order, after
    every call has ended (a thread is never abandoned mid-call)."""
    if len(fns) > len(threads):
        raise ValueError(f"{len(fns)} calls for {len(threads)} execution threads")
    messages = [t._resume(fn) for t, fn in zip(threads, fns)]
    if any(m[0] == "wait" for m in messages):
        with trio.CancelScope(shield=True):  # the threads are parked mid-call: never abandon them
            async with trio.open_nursery() as nursery:
                for i, m in enumerate(messages):
                    if m[0] == "wait":
                        nursery.start_soon(threads[i]._serve, messages, i)
    for _, _, exc in messages:
        if exc is not None:
            raise exc
    return [m[1] for m in messages]
