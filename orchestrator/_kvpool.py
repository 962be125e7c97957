"""A paged KV block pool on one block-major torch tensor.

``kv[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (see ``transports._layout``):
every block is one contiguous region, so a request's KV can be scattered with one indexed copy.

    allocate(n) -> block ids (int64 tensor)   raises KVExhausted (its own outcome) when n > free
    free(block_ids)                            a block freed twice, or never allocated, is an error
                                               (``poison_freed``: freed blocks are filled with NaN)

The pool is owned by the execution thread; a lock keeps ``statistics()`` consistent from others.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from transports import KVLayout

from ._errors import KVExhausted


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    peak_used_blocks: int
    allocations: int
    exhaustions: int


class KVBlockPool:
    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", *, poison_freed: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.kv = layout.new_pool(num_blocks, device)
        self._num_blocks = num_blocks
        self._lock = threading.Lock()
        # a stack of free ids (the top hands out 0, 1, 2, ... first) and who is out, as arrays: a
        # request takes hundreds of blocks, and a per-id Python loop on every admission and end
        # was a visible share of an engine step
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._top = num_blocks  # self._free[:self._top] are free
        self._owned = np.zeros(num_blocks, dtype=np.bool_)
        self._peak = 0
        self._allocations = 0
        self._exhaustions = 0
        self._poison = poison_freed

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return self._top

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    def allocate(self, n: int) -> torch.Tensor:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        with self._lock:
            top = self._top
            if n > top:
                self._exhaustions += 1
                raise KVExhausted(f"need {n} KV blocks, {top} of {self._num_blocks} free")
            ids = self._free[top - n : top][::-1].copy()  # popped one by one: the top first
            self._top = top - n
            self._owned[ids] = True
            self._allocations += 1
            self._peak = max(self._peak, self._num_blocks - self._top)
        return torch.from_numpy(ids)

    def free(self, block_ids: torch.Tensor) -> None:
        ids = block_ids.detach().to("cpu", torch.int64).numpy().reshape(-1).copy()  # the caller keeps its tensor
        with self._lock:
            inside = (ids >= 0) & (ids < self._num_blocks)
            if not inside.all() or not self._owned[ids].all() or _repeats(ids):
                known = ids[inside]
                bad = sorted(set(ids[~inside].tolist()) | set(known[~self._owned[known]].tolist()))
                raise ValueError(f"freeing blocks that are not allocated: {bad or ids.tolist()}")
            self._owned[ids] = False
            if self._poison:
                self.kv.index_fill_(0, block_ids.to(self.kv.device), float("nan"))
            top = self._top
            self._free[top : top + ids.size] = ids[::-1]  # pushed in reverse: the first id is on top
            self._top = top + ids.size

    def statistics(self) -> PoolStatistics:
        with self._lock:
            free = self._top
            return PoolStatistics(
                num_blocks=self._num_blocks,
                free_blocks=free,
                used_blocks=self._num_blocks - free,
                peak_used_blocks=self._peak,
                allocations=self._allocations,
                exhaustions=self._exhaustions,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<KVBlockPool [{s.used_blocks}/{s.num_blocks} blocks used]>"


def _repeats(ids: np.ndarray) -> bool:
    """Does an id occur twice? (A request's ids are mostly one ascending run: checked without a sort.)"""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return False
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())
