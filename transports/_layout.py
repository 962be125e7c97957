"""The paged KV layout both ends agree on, and the slices a pull can name.

A KV pool is one tensor, block-major, so that every block is one contiguous region::

    pool[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]

A pull names a layer range and a head range (a ``KVSlice``); what moves on the wire for a request
is the gathered tensor ``pool[block_ids][:, l0:l1, :, h0:h1]`` made contiguous, whose shape is
``wire_shape(num_blocks, kv_slice)``. A full-range slice of a request is byte-for-byte the
request's blocks in pool order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap

import numpy as np
import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


_NAMES = {value: name for name, value in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable, so not a dtype
        raise ValueError(f"unsupported KV dtype {dtype}") from None


@dataclasses.dataclass(frozen=True)
class KVSlice:
    """A half-open layer range and kv-head range of a request's KV."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape of one paged KV pool. Both nodes of a pair must agree on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        dtype_name(self.dtype)  # validates

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def block_bytes(self) -> int:  # on every pull's path: computed once (the layout is frozen)
        return math.prod(self.block_shape) * self.element_size

    def is_whole(self, kv_slice: KVSlice) -> bool:
        """Whether ``kv_slice`` covers every layer and KV head of this layout."""
        return kv_slice.num_layers == self.num_layers and kv_slice.num_heads == self.num_kv_heads

    def full_slice(self) -> KVSlice:
        return self._full_slice

    @functools.cached_property
    def _full_slice(self) -> KVSlice:  # one instance (a KVSlice is frozen): compared on every pull's path
        return KVSlice(0, self.num_layers, 0, self.num_kv_heads)

    def check_slice(self, kv_slice: KVSlice) -> None:
        if not (0 <= kv_slice.layer_start < kv_slice.layer_end <= self.num_layers):
            raise ValueError(f"layer range {kv_slice.layer_start}:{kv_slice.layer_end} outside 0:{self.num_layers}")
        if not (0 <= kv_slice.head_start < kv_slice.head_end <= self.num_kv_heads):
            raise ValueError(f"head range {kv_slice.head_start}:{kv_slice.head_end} outside 0:{self.num_kv_heads}")

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def wire_shape(self, num_blocks: int, kv_slice: KVSlice | None = None) -> tuple[int, ...]:
        s = kv_slice or self.full_slice()
        return (num_blocks, s.num_layers, 2, s.num_heads, self.block_size, self.head_dim)

    def wire_bytes(self, num_blocks: int, kv_slice: KVSlice | None = None) -> int:
        return math.prod(self.wire_shape(num_blocks, kv_slice)) * self.element_size

    def new_pool(self, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A zeroed pool; in host memory, on transparent huge pages where the kernel allows (``host_memory``)."""
        shape = (num_blocks, *self.block_shape)
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=device)
        return host_memory(math.prod(shape) * self.element_size).view(self.dtype).view(shape)


HUGE_PAGE = 2 << 20


def host_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed host memory as a uint8 tensor, 2 MiB-aligned and advised onto transparent
    huge pages (``madvise(MADV_HUGEPAGE)``: Linux with THP in ``madvise`` or ``always`` mode; elsewhere
    ordinary pages). Every page is touched here, as ``torch.zeros`` does, not on a first transfer.

    Why: a shared-memory UCX transfer (CMA, ``process_vm_readv``) and a NIXL registration handle
    every page they move. On this project's machine a ucxx pull between two torch pools on 4 KiB
    pages ran at 0.68x raw ucxx at 8 MiB and 0.71x at 64 MiB; with both pools on huge pages, 0.85x
    and 0.97x, side by side in one run (``python -m examples.bench transport``). numpy advises its
    own large arrays so (the raw benchmark's buffers were on huge pages); torch's allocator does not."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    # private and anonymous (page-aligned, zero-filled; the tensor keeps it): a shared mapping would
    # be shmem, which THP's ``madvise`` mode leaves on small pages
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: ordinary pages
        pass
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    out = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=-base % HUGE_PAGE)
    out.zero_()  # touch every page now
    return out


def run_start(block_ids: torch.Tensor) -> int | None:
    """The first id when ``block_ids`` are one ascending run (``[k, k+1, ...]``); None otherwise."""
    n = int(block_ids.numel())
    if n == 0:
        return None
    if n <= _LIST_CHECK_MAX:  # on every pull's path: a Python list beats numpy's per-call cost for a request's ids
        ids = block_ids.reshape(-1).tolist()
        first = int(ids[0])
        if n > 1 and (int(ids[-1]) - first != n - 1 or ids != list(range(first, first + n))):
            return None
        return first
    arr = block_ids.detach().cpu().numpy().reshape(-1)
    first = int(arr[0])
    if int(arr[-1]) - first != n - 1 or not bool((np.diff(arr) == 1).all()):
        return None
    return first


_LIST_CHECK_MAX = 1024


def whole_run_view(pool: torch.Tensor, block_ids: torch.Tensor, kv_slice: KVSlice) -> torch.Tensor | None:
    """``pool[block_ids]`` as a zero-copy view when ``kv_slice`` covers whole blocks and the ids are
    one ascending run (then the wire form *is* that region of the pool); None otherwise."""
    if kv_slice.num_layers != pool.shape[1] or kv_slice.num_heads != pool.shape[3]:
        return None
    first = run_start(block_ids)
    return None if first is None else pool[first : first + int(block_ids.numel())]


def gather(pool: torch.Tensor, block_ids: torch.Tensor, kv_slice: KVSlice) -> torch.Tensor:
    """Copy a request's slice out of a pool into one contiguous tensor (the wire form)."""
    picked = pool.index_select(0, block_ids.to(pool.device))
    return picked[:, kv_slice.layer_start : kv_slice.layer_end, :, kv_slice.head_start : kv_slice.head_end].contiguous()


def scatter(pool: torch.Tensor, block_ids: torch.Tensor, staged: torch.Tensor, kv_slice: KVSlice) -> None:
    """Write a staged (wire-form) slice into a pool's blocks; one copy, no per-block Python loop."""
    ids = block_ids.to(pool.device)
    if kv_slice.num_layers == pool.shape[1] and kv_slice.num_heads == pool.shape[3]:
        pool.index_copy_(0, ids, staged.to(pool.device, non_blocking=True))
        return
    view = pool[:, kv_slice.layer_start : kv_slice.layer_end, :, kv_slice.head_start : kv_slice.head_end]
    view.index_copy_(0, ids, staged.to(pool.device, non_blocking=True))
