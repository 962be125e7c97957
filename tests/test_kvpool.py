"""The paged KV block pool."""

from __future__ import annotations

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
