"""The paged KV block pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orchestrator import KVBlockPool, KVExhausted
from tests.harness import LAYOUT


def test_blocks_are_contiguous_regions_of_one_block_major_tensor() -> None:
    pool = KVBlockPool(LAYOUT, 8)
    assert pool.kv.shape == (8, *LAYOUT.block_shape)
    for i in range(8):
        assert pool.kv[i].is_contiguous()
    assert pool.kv[1].data_ptr() - pool.kv[0].data_ptr() == LAYOUT.block_bytes


def test_allocate_and_free_track_statistics() -> None:
    pool = KVBlockPool(LAYOUT, 8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a.tolist() + b.tolist()) == list(range(8))
    s = pool.statistics()
    assert (s.used_blocks, s.free_blocks, s.peak_used_blocks, s.allocations) == (8, 0, 8, 2)
    pool.free(a)
    pool.free(b)
    assert pool.statistics().free_blocks == 8


def test_exhaustion_is_its_own_outcome_and_changes_nothing() -> None:
    pool = KVBlockPool(LAYOUT, 4)
    held = pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(KVExhausted):
        pool.allocate(2)
    s = pool.statistics()
    assert (s.used_blocks, s.exhaustions) == (3, 1)
    pool.free(held)


def test_double_free_and_foreign_blocks_are_errors() -> None:
    pool = KVBlockPool(LAYOUT, 4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError):
        pool.free(ids)
    with pytest.raises(ValueError):
        pool.free(torch.tensor([99]))
    assert pool.statistics().free_blocks == 4


def test_freed_blocks_come_back_in_order_so_a_request_gets_one_run_again() -> None:
    """Freed ids return to the top of the stack first-id-first: after a free, the same request
    size gets the same ascending run (a whole-run view needs no gather)."""
    pool = KVBlockPool(LAYOUT, 8)
    a = pool.allocate(3)
    assert a.tolist() == [0, 1, 2]
    b = pool.allocate(2)
    pool.free(a)
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert b.tolist() == [3, 4]
    pool.free(b)
    assert pool.allocate(1).tolist() == [3]


def test_a_free_naming_a_block_twice_changes_nothing() -> None:
    pool = KVBlockPool(LAYOUT, 4)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.tensor([int(ids[0]), int(ids[0])]))
    with pytest.raises(ValueError, match=r"\[-1\]"):
        pool.free(torch.tensor([-1, int(ids[1])]))
    with pytest.raises(ValueError, match=r"\[3\]"):  # in range, but never handed out
        pool.free(torch.tensor([int(ids[1]), 3]))
    assert pool.statistics().used_blocks == 2
    pool.free(ids)
    assert pool.statistics().free_blocks == 4


def test_poisoned_pool_fills_freed_blocks_with_nan() -> None:
    pool = KVBlockPool(LAYOUT, 4, poison_freed=True)
    ids = pool.allocate(2)
    pool.kv[ids] = 1.0
    pool.free(ids)
    assert torch.isnan(pool.kv[ids]).all() and not torch.isnan(pool.kv[2:]).any()


def test_a_whole_run_view_only_for_one_ascending_run_of_whole_blocks() -> None:
    from transports._layout import run_start, whole_run_view

    pool = KVBlockPool(LAYOUT, 8)
    whole = LAYOUT.full_slice()
    view = whole_run_view(pool.kv, torch.tensor([3, 4, 5]), whole)
    assert view is not None and view.data_ptr() == pool.kv[3].data_ptr() and view.shape[0] == 3
    assert run_start(torch.tensor([6])) == 6
    for ids in ([3, 5, 6], [3, 2, 5], [4, 4, 5], [5, 4, 3], []):  # a gap, out of order with the right ends, a repeat
        assert run_start(torch.tensor(ids, dtype=torch.int64)) is None, ids
    for n in (100, 5000):  # a request's ids (checked as a list) and a long prompt's (checked with numpy)
        run = torch.arange(7, 7 + n)
        assert run_start(run) == 7 and run_start(run.reshape(2, -1)) == 7
        swapped = run.clone()
        swapped[[10, 11]] = swapped[[11, 10]]  # the ends right, the middle out of order
        assert run_start(swapped) is None
    if LAYOUT.num_kv_heads > 1:
        part = dataclasses.replace(whole, head_end=whole.head_end - 1)
        assert whole_run_view(pool.kv, torch.tensor([3, 4]), part) is None
