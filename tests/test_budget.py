"""The transfer budget: weighted, FIFO, thread-safe, cancel-safe, released exactly once."""

from __future__ import annotations

import random
import sys
import time
import threading

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from orchestrator import TransferBudget, WouldBlock


def test_nowait_grants_within_capacity_and_refuses_beyond() -> None:
    b = TransferBudget(100)
    g1 = b.acquire_nowait(60)
    with pytest.raises(WouldBlock):
        b.acquire_nowait(41)
    g2 = b.acquire_nowait(40)
    s = b.statistics()
    assert (s.in_use, s.holders, s.available, s.nowait_denials) == (100, 2, 0, 1)
    g1.release()
    g2.release()
    assert b.statistics().in_use == 0


def test_release_is_exactly_once() -> None:
    b = TransferBudget(100)
    g = b.acquire_nowait(70)
    assert g.release() is True
    assert g.release() is False
    assert b.statistics().in_use == 0
    g2 = b.acquire_nowait(100)  # a double release must not have made room beyond capacity
    with pytest.raises(WouldBlock):
        b.acquire_nowait(1)
    g2.release()


def test_oversized_cost_is_granted_only_when_nothing_is_held() -> None:
    b = TransferBudget(100)
    small = b.acquire_nowait(10)
    with pytest.raises(WouldBlock):
        b.acquire_nowait(500)
    small.release()
    big = b.acquire_nowait(500)
    assert big.oversized and big.charged == 100 and big.cost == 500
    with pytest.raises(WouldBlock):  # it holds the window alone
        b.acquire_nowait(1)
    big.release()
    assert b.statistics().oversized_grants == 1
    assert b.statistics().in_use == 0


def test_invalid_costs_are_rejected() -> None:
    b = TransferBudget(10)
    for bad in (0, -5):
        with pytest.raises(ValueError):
            b.acquire_nowait(bad)
    with pytest.raises(ValueError):
        TransferBudget(0)


@pytest.mark.anyio
async def test_nowait_fails_while_someone_waits_fifo() -> None:
    b = TransferBudget(100)
    held = b.acquire_nowait(90)
    got: list[str] = []

    async def waiter(name: str, cost: int) -> None:
        g = await b.acquire(cost)
        got.append(name)
        g.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "big", 50)
        await wait_all_tasks_blocked()
        # 5 bytes are free, but "big" waits first: nobody overtakes it.
        with pytest.raises(WouldBlock):
            b.acquire_nowait(5)
        assert b.statistics().waiters == 1
        held.release()
    assert got == ["big"]
    assert b.statistics().in_use == 0


@pytest.mark.anyio
async def test_waiters_are_woken_in_fifo_order() -> None:
    b = TransferBudget(10)
    held = b.acquire_nowait(10)
    order: list[int] = []

    async def waiter(i: int) -> None:
        g = await b.acquire(6)
        order.append(i)
        await anyio.sleep(0)
        g.release()

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(waiter, i)
            await wait_all_tasks_blocked()
        held.release()
    assert order == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_the_queue_and_unblocks_the_next() -> None:
    b = TransferBudget(10)
    held = b.acquire_nowait(8)
    done: list[str] = []
    head_scope = anyio.CancelScope()

    async def waiter(name: str, cost: int, scope: anyio.CancelScope | None = None) -> None:
        with scope or anyio.CancelScope():
            g = await b.acquire(cost)
            done.append(name)
            g.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "head", 10, head_scope)  # needs all 10
        await wait_all_tasks_blocked()
        tg.start_soon(waiter, "small", 2)
        await wait_all_tasks_blocked()
        assert done == []  # 2 are free, but the small one queues behind the head
        head_scope.cancel()
        await wait_all_tasks_blocked()
        assert done == ["small"]  # removing the head let the small one through
        held.release()
    assert done == ["small"]
    s = b.statistics()
    assert (s.in_use, s.waiters) == (0, 0)


@pytest.mark.anyio
async def test_waiter_cancelled_after_grant_gives_it_back() -> None:
    b = TransferBudget(10)
    held = b.acquire_nowait(10)
    returned: list[object] = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def wait_then_be_cancelled() -> None:
                returned.append(await b.acquire(10))

            tg.start_soon(wait_then_be_cancelled)
            await wait_all_tasks_blocked()
            # Another thread releases: the waiter is granted and its wake-up is queued on the loop;
            # in the same turn, before the wake-up runs, the waiter is cancelled.
            t = threading.Thread(target=held.release)
            t.start()
            t.join()
            assert b.statistics().holders == 1  # granted to the waiter
            scope.cancel()
    assert returned == []  # it was cancelled, and it gave the grant back
    assert b.statistics().in_use == 0
    assert b.acquire_nowait(10).release()


def test_blocking_acquire_times_out_then_is_granted_from_another_thread() -> None:
    b = TransferBudget(10)
    held = b.acquire_nowait(10)
    with pytest.raises(WouldBlock):
        b.acquire_blocking(5, timeout=0.05)
    assert b.statistics().waiters == 0  # the timed-out waiter left the queue
    threading.Timer(0.05, held.release).start()
    g = b.acquire_blocking(5, timeout=5.0)
    g.release()
    assert b.statistics().in_use == 0


class _YieldingBudget(TransferBudget):
    """Yields the GIL inside the grant step: harmless under the lock, a sure race without it."""

    def _grant_locked(self, cost: int, charged: int):
        time.sleep(0)
        return super()._grant_locked(cost, charged)


def test_threads_hammering_never_exceed_capacity_and_end_full() -> None:
    capacity = 1000
    b = _YieldingBudget(capacity)
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(10_000):
                if held and rng.random() < 0.5:
                    held.pop(rng.randrange(len(held))).release()
                else:
                    try:
                        held.append(b.acquire_nowait(rng.randint(1, 400)))
                    except WouldBlock:
                        pass
                if rng.random() < 0.01:
                    for g in held[:2]:
                        g.release()  # a second release of these below must be a no-op
            for g in held:
                g.release()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to open every race window
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    s = b.statistics()
    assert s.peak_in_use <= capacity
    assert (s.in_use, s.holders, s.waiters) == (0, 0, 0)
    assert s.grants > 1000
