"""KV pools in host memory sit on a private mapping advised onto transparent huge pages."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from transports import KVLayout
from transports._layout import HUGE_PAGE, host_memory

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=32, dtype=torch.bfloat16)  # 1 MiB blocks


def _mapping(address: int) -> tuple[str, set[str]] | None:
    """The permissions and VmFlags of the mapping of this process that holds ``address``."""
    perms, inside = "", False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside, perms = lo <= address < hi, head[1]
            elif inside and line.startswith("VmFlags:"):
                return perms, set(head[1:])
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
def test_a_pool_is_zeroed_aligned_private_and_advised_onto_huge_pages() -> None:
    pool = LAYOUT.new_pool(8)
    assert pool.shape == (8, *LAYOUT.block_shape) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE == 0
    assert not pool.any()
    mapping = _mapping(pool.data_ptr())
    assert mapping is not None
    perms, flags = mapping
    assert perms.endswith("p"), perms  # private: a shared anonymous mapping stays on small pages
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # a kernel with THP
        assert "hg" in flags, flags  # MADV_HUGEPAGE


def test_the_memory_lives_as_long_as_the_tensor() -> None:
    view = host_memory(3 * HUGE_PAGE)[HUGE_PAGE:]  # only a view left: the mapping must stay
    gc.collect()
    view.fill_(7)
    assert int(view.sum()) == 7 * 2 * HUGE_PAGE
    pool = LAYOUT.new_pool(4).uniform_()
    moved = pool.clone()
    del pool
    gc.collect()
    assert torch.isfinite(moved.float()).all()


def test_small_pools_and_other_devices_are_plain_tensors() -> None:
    small = host_memory(4096)
    assert small.numel() == 4096 and not small.any()
    meta = LAYOUT.new_pool(64, device="meta")
    assert meta.device.type == "meta" and meta.shape == (64, *LAYOUT.block_shape)
