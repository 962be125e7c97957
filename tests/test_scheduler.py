"""Admission decisions, without an event loop: the scheduler is sync and does no I/O."""

from __future__ import annotations

from orchestrator import DeferReason, KVBlockPool, Mode, RequestState, TransferBudget
from orchestrator._requests import GenRequest, Sequence
from orchestrator._scheduler import Scheduler
from tests.harness import BLOCK, LAYOUT, make_config


def seq(rid: str, prompt_blocks: int, total_blocks: int | None = None) -> Sequence:
    prompt_len = prompt_blocks * LAYOUT.block_size
    return Sequence(
        request=GenRequest(rid, prompt_len=prompt_len, first_token=1, max_tokens=1, peer="p"),
        arrival=0.0,
        num_blocks=total_blocks or prompt_blocks,
        num_prompt_blocks=prompt_blocks,
        cost=prompt_blocks * BLOCK,
    )


def make(num_blocks: int = 64, staging_blocks: int = 8, **kw: object):
    config = make_config(num_blocks=num_blocks, transfer_budget_bytes=staging_blocks * BLOCK, **kw)
    budget = TransferBudget(config.transfer_budget_bytes)
    pool = KVBlockPool(LAYOUT, num_blocks)
    return Scheduler(config, budget, pool), budget, pool


def ids(result) -> list[str]:
    return [a.seq.request_id for a in result.admitted]


def test_budget_is_checked_before_kv_allocation_no_rollback() -> None:
    sched, budget, pool = make(staging_blocks=8)
    for rid, n in [("a", 6), ("b", 6)]:
        sched.add(seq(rid, n))
    result = sched.schedule(active=0)
    assert ids(result) == ["a"]
    assert result.deferred[DeferReason.BACKPRESSURE] == 1
    # "b" was denied by the budget: it was never allocated (one allocation only, for "a").
    assert pool.statistics().allocations == 1
    assert pool.statistics().used_blocks == 6
    assert [s.request_id for s in sched.waiting] == ["b"]
    assert sched.waiting[0].block_ids is None and sched.waiting[0].state is RequestState.WAITING


def test_fcfs_among_kv_fitting_requests_no_overtaking() -> None:
    sched, budget, pool = make(staging_blocks=8)
    hold = budget.acquire_nowait(4 * BLOCK)  # 4 blocks of budget free
    sched.add(seq("big", 6))
    sched.add(seq("small", 1))  # would fit in the budget, but must not overtake "big"
    result = sched.schedule(active=0)
    assert ids(result) == []
    assert result.deferred[DeferReason.BACKPRESSURE] == 2
    hold.release()
    result = sched.schedule(active=0)
    assert ids(result) == ["big", "small"]


def test_request_that_does_not_fit_in_kv_neither_takes_nor_blocks_the_budget() -> None:
    sched, budget, pool = make(num_blocks=10, staging_blocks=8)
    held = pool.allocate(6)  # 4 KV blocks free
    sched.add(seq("huge-kv", 2, total_blocks=8))  # small transfer, but needs 8 KV blocks
    sched.add(seq("fits", 2, total_blocks=3))
    result = sched.schedule(active=0)
    assert ids(result) == ["fits"]
    assert result.deferred == {DeferReason.KV_EXHAUSTED: 1, DeferReason.BACKPRESSURE: 0}
    assert budget.statistics().in_use == 2 * BLOCK  # only "fits" holds tokens
    pool.free(held)


def test_backpressure_and_kv_exhaustion_are_counted_apart() -> None:
    sched, budget, pool = make(num_blocks=8, staging_blocks=2)
    sched.add(seq("a", 2))
    sched.add(seq("c", 1, total_blocks=20))  # can never fit this pool in KV right now
    sched.add(seq("b", 2))  # budget full after "a"
    sched.add(seq("d", 1))  # behind the budget-blocked "b": left waiting, not even looked at
    result = sched.schedule(active=0)
    assert ids(result) == ["a"]
    assert result.deferred == {DeferReason.BACKPRESSURE: 2, DeferReason.KV_EXHAUSTED: 1}
    sched.schedule(active=1)  # same reasons again: one episode each (the blocked head, the KV misfit)
    assert sched.deferral_episodes == {DeferReason.BACKPRESSURE: 1, DeferReason.KV_EXHAUSTED: 1}


def test_scan_stops_at_the_first_budget_denial_whatever_the_queue_length() -> None:
    sched, budget, pool = make(num_blocks=64, staging_blocks=2)
    hold = budget.acquire_nowait(2 * BLOCK)  # the budget is full
    for i in range(5000):
        sched.add(seq(f"r{i}", 1))
    result = sched.schedule(active=0)
    assert ids(result) == [] and result.scanned == 1  # O(admitted), not O(queue)
    assert result.deferred[DeferReason.BACKPRESSURE] == 5000
    assert sched.deferral_episodes[DeferReason.BACKPRESSURE] == 1
    hold.release()
    result = sched.schedule(active=0)
    assert ids(result) == ["r0", "r1"] and result.scanned == 3
    assert sched.remove("r4999") is not None and sched.num_waiting == 4997


def test_kv_skips_per_step_are_bounded() -> None:
    # DESIGN 4: a request that does not fit in KV neither takes nor blocks the budget. The scan used
    # to give up after max_kv_skips misfits: 64 of them blocked a later, fitting request every step
    # (with the budget empty). Now the fitting ones go, in FCFS order, and a step's work stays
    # bounded however many misfits wait (nothing walks them: an index by KV need finds the first fit).
    sched, budget, pool = make(num_blocks=8, staging_blocks=8)
    for i in range(500):
        sched.add(seq(f"big{i}", 1, total_blocks=20))  # none fits the pool
    sched.add(seq("small", 1, total_blocks=3))
    sched.add(seq("small2", 1, total_blocks=3))
    sched.add(seq("small3", 1, total_blocks=3))  # 9 blocks with the two before it: does not fit now
    result = sched.schedule(active=0)
    assert ids(result) == ["small", "small2"]  # FCFS among the ones that fit
    assert result.scanned <= 2 + Scheduler.max_kv_skips
    assert result.deferred == {DeferReason.KV_EXHAUSTED: 501, DeferReason.BACKPRESSURE: 0}
    assert budget.statistics().in_use == 2 * BLOCK  # the misfits took nothing
    for i in range(20_000):
        sched.add(seq(f"huge{i}", 1, total_blocks=20))
    first = result
    result = sched.schedule(active=2)  # 20,501 misfits waiting: the step looks at a bounded few
    assert ids(result) == [] and result.scanned == Scheduler.max_kv_skips
    pool.free(first.admitted[0].seq.block_ids)
    result = sched.schedule(active=1)
    assert ids(result) == ["small3"] and result.scanned <= 1 + Scheduler.max_kv_skips


def test_oversized_request_is_admitted_alone_when_the_window_is_empty() -> None:
    sched, budget, pool = make(staging_blocks=4)
    sched.add(seq("small", 1))
    sched.add(seq("oversized", 10))
    sched.add(seq("after", 1))
    result = sched.schedule(active=0)
    assert ids(result) == ["small"]
    result.admitted[0].grant.release()
    result = sched.schedule(active=1)
    assert ids(result) == ["oversized"]
    grant = result.admitted[0].grant
    assert grant.oversized and budget.statistics().available == 0
    assert ids(sched.schedule(active=2)) == []  # "after" waits: the window is held
    grant.release()
    assert ids(sched.schedule(active=2)) == ["after"]


def test_max_num_seqs_caps_admission_without_counting_a_deferral() -> None:
    sched, budget, pool = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(seq(rid, 1))
    result = sched.schedule(active=1)
    assert ids(result) == ["a"]
    assert sum(result.deferred.values()) == 0
    assert [s.request_id for s in sched.waiting] == ["b", "c"]


def test_inline_mode_has_no_early_window() -> None:
    sched, budget, pool = make(staging_blocks=1, mode=Mode.INLINE)
    for rid in "ab":
        sched.add(seq(rid, 4))
    result = sched.schedule(active=0)
    assert ids(result) == ["a", "b"]  # allocated first; staging is reserved later, blocking
    assert all(a.grant is None for a in result.admitted)
    assert budget.statistics().grants == 0
