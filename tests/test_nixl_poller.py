"""The GEN's NIXL READ poller on its own: what it posts, watches and hands back, and its closing.

NIXL's agent is replaced here by a recorder with its two calls (``transfer``, ``check_xfer_state``)
so that the thread's order of events can be held still; the transport's tests run it on the real
agent (tests/test_dataplane_nixl.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from transports._nixl_poller import ReadPoller


class _Agent:
    def __init__(self) -> None:
        self.posted: list[str] = []
        self.states: dict[str, str] = {}
        self.hold = threading.Event()
        self.hold.set()
        self.in_transfer = threading.Event()

    def transfer(self, xfer: str) -> str:
        self.in_transfer.set()
        self.hold.wait(5)
        self.posted.append(xfer)
        return self.states.get(xfer, "DONE")

    def check_xfer_state(self, xfer: str) -> str:
        return self.states.get(xfer, "DONE")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_posts_in_order_watches_what_is_in_progress_and_hands_back_each_state() -> None:
    agent = _Agent()
    agent.states = {"b": "PROC", "c": "ERR"}
    poller = ReadPoller(agent)
    try:
        a, b, c = (poller.post(x, 5.0) for x in "abc")
        assert await asyncio.wait_for(a, 5) == "DONE" and await asyncio.wait_for(c, 5) == "ERR"
        assert not b.done() and poller.in_flight == 1  # transfer() said PROC: watched since
        agent.states["b"] = "DONE"
        assert await asyncio.wait_for(b, 5) == "DONE"
        assert agent.posted == ["a", "b", "c"] and poller.in_flight == 0 and poller.watched == 3
    finally:
        poller.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_read_not_posted_before_close_is_never_posted() -> None:
    """Closed while copying one READ: the next one is handed back ERR (nothing moved), not posted
    into an agent that is going away; one posted after close is ERR at once."""
    agent = _Agent()
    agent.hold.clear()
    poller = ReadPoller(agent)
    with poller._cond:  # (re-entrant) both in the thread's first batch: b waits behind a's copy
        first, second = poller.post("a", 5.0), poller.post("b", 5.0)
    assert await asyncio.to_thread(agent.in_transfer.wait, 5)
    closing = asyncio.create_task(asyncio.to_thread(poller.close, 5.0))
    await asyncio.sleep(0.05)
    agent.hold.set()
    await closing
    assert await first == "DONE" and await second == "ERR" and agent.posted == ["a"]
    late = poller.post("c", 5.0)
    assert await late == "ERR" and agent.posted == ["a"]
