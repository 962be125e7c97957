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
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._owned = bytearray(num_blocks)
        self._peak = 0
        self._allocations = 0
        self._exhaustions = 0
        self._poison = poison_freed

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> torch.Tensor:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        with self._lock:
            if n > len(self._free):
                self._exhaustions += 1
                raise KVExhausted(f"need {n} KV blocks, {len(self._free)} of {self._num_blocks} free")
            ids = [self._free.pop() for _ in range(n)]
            for i in ids:
                self._owned[i] = 1
            self._allocations += 1
            self._peak = max(self._peak, self._num_blocks - len(self._free))
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, block_ids: torch.Tensor) -> None:
        ids = block_ids.tolist()
        with self._lock:
            bad = [i for i in ids if not (0 <= i < self._num_blocks) or not self._owned[i]]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"freeing blocks that are not allocated: {bad or ids}")
            for i in ids:
                self._owned[i] = 0
            if self._poison:
                self.kv.index_fill_(0, block_ids.to(self.kv.device), float("nan"))
            self._free.extend(reversed(ids))

    def statistics(self) -> PoolStatistics:
        with self._lock:
            free = len(self._free)
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
