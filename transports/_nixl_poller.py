"""One thread per GEN that watches every NIXL READ still in progress, and posts the large ones.

NIXL reports a READ's end only when asked (``check_xfer_state``), and asyncio cannot sleep less
than a millisecond, so the asking happens off the event loop. A worker thread per READ (what the
GEN did before) costs a thread hop per READ and, through anyio's default limit of 40 worker
threads, makes the 41st READ in flight wait for another to end before anyone watches it.

    poller = ReadPoller(agent)
    state = await poller.wait(xfer, timeout_s)    "DONE", "ERR", ... or "PROC" once timeout_s passed
    state = await poller.post(xfer, timeout_s)    the same for a READ this thread posts first
    poller.close()                                the thread ends (READs still watched: "PROC")

``post``: on one host NIXL's ``transfer()`` does the copy itself, in the calling thread, so a large
READ is posted here, not on the event loop (which it would stall for the copy: ~0.8 ms at 8 MiB).
This thread, already there, costs one hand-over each way (~33 µs here, against ~71 µs through
asyncio's default executor, whose future is wrapped for the loop) and no task of its own; the
READs it posts are copied one at a time (a READ between hosts is not copied by ``transfer()``: it
returns at once). A ``transfer()`` that raises ends the READ as ``ERR`` (nothing was posted).

The thread asks about every READ in flight, then waits on a condition: 20 µs, doubling to 1 ms
while nothing ends; a new READ or an ended one starts the naps over. With no READ in flight it
waits without a timeout (no idle CPU). Outcomes reach the loop with ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_FIRST_NAP_S = 20e-6
_LONGEST_NAP_S = 1e-3


class ReadPoller:
    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._cond = threading.Condition()
        self._reads: list[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[str], float]] = []
        self._to_post: list[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[str], float,
                                  Callable[[str], None] | None]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.watched = 0
        """READs handed to the poller so far."""

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._reads)

    def wait(self, xfer: Any, timeout_s: float) -> asyncio.Future[str]:
        """A future of the READ's state once it leaves ``PROC``, or ``PROC`` after ``timeout_s``."""
        return self._add(False, xfer, timeout_s)

    def post(self, xfer: Any, timeout_s: float, posted: Callable[[str], None] | None = None) -> asyncio.Future[str]:
        """``transfer(xfer)`` on this thread, then as ``wait`` (``timeout_s`` from now); ``posted``
        is told (on this thread) what ``transfer()`` answered."""
        return self._add(True, xfer, timeout_s, posted)

    def _add(self, to_post: bool, xfer: Any, timeout_s: float,
             posted: Callable[[str], None] | None = None) -> asyncio.Future[str]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        with self._cond:
            if self._closed:
                fut.set_result("ERR" if to_post else "PROC")  # a READ not posted moved nothing
                return fut
            # the list is looked up under the lock: the thread swaps ``_to_post`` for a new one
            deadline = time.monotonic() + timeout_s
            if to_post:
                self._to_post.append((xfer, loop, fut, deadline, posted))
            else:
                self._reads.append((xfer, loop, fut, deadline))
            self.watched += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nixl-read-poller", daemon=True)
                self._thread.start()
            self._cond.notify()
        return fut

    def close(self, timeout_s: float = 1.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        nap = _FIRST_NAP_S
        while True:
            with self._cond:
                while not self._reads and not self._to_post and not self._closed:
                    self._cond.wait()
                    nap = _FIRST_NAP_S
                if self._closed:
                    ended = [(loop, fut, "PROC") for _, loop, fut, _ in self._reads]
                    ended += [(loop, fut, "ERR") for _, loop, fut, _, _ in self._to_post]
                    self._reads.clear()
                    self._to_post.clear()
                    _deliver(ended)
                    return
                posts, self._to_post = self._to_post, []
            for xfer, loop, fut, deadline, posted in posts:  # outside the lock: the copy may take a while
                if self._closed:  # closed meanwhile: what is not posted yet never will be
                    _deliver([(loop, fut, "ERR")])
                    continue
                try:
                    state = self._agent.transfer(xfer)
                except Exception as exc:  # NIXL refused to post it: nothing can land
                    log.warning("nixl_read_not_posted", reason=str(exc))
                    state = "ERR"
                if posted is not None:
                    posted(state)
                if state == "PROC":
                    with self._cond:
                        self._reads.append((xfer, loop, fut, deadline))
                else:
                    _deliver([(loop, fut, state)])
            with self._cond:
                reads = list(self._reads)
            now = time.monotonic()
            ended = []
            for entry in reads:
                xfer, loop, fut, deadline = entry
                try:
                    state = self._agent.check_xfer_state(xfer)
                except Exception as exc:  # NIXL lost the handle: the READ is over, failed
                    log.warning("nixl_read_state_failed", reason=str(exc))
                    state = "ERR"
                if state == "PROC" and now < deadline:
                    continue
                ended.append((loop, fut, state))
                with self._cond:
                    self._reads.remove(entry)
            _deliver(ended)
            with self._cond:
                if ended or posts or len(self._reads) != len(reads):  # something ended or came: look again soon
                    nap = _FIRST_NAP_S
                if self._to_post:
                    continue
                if self._reads and not self._closed:
                    nap = _FIRST_NAP_S if self._cond.wait(nap) else min(nap * 2, _LONGEST_NAP_S)  # woken: a new READ


def _deliver(ended: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[str], str]]) -> None:
    for loop, fut, state in ended:
        try:
            loop.call_soon_threadsafe(_settle, fut, state)
        except RuntimeError:  # that loop is closed: nobody waits any more
            pass


def _settle(fut: asyncio.Future[str], state: str) -> None:
    if not fut.done():  # the waiter may have been cancelled
        fut.set_result(state)
