"""Tensor parallelism for the tiny model: which rank holds what, and a local CPU rank group.

Sharding (Megatron / vLLM)
--------------------------
``plan_shards(config, tp)`` says what rank ``tp.rank`` of ``tp.size`` holds, in global numbering:

* query heads: ``num_heads / size`` consecutive heads each (``size`` must divide ``num_heads``);
* KV heads: ``num_kv_heads / size`` consecutive heads each when ``size`` divides ``num_kv_heads``;
  when ``size > num_kv_heads`` (and ``num_kv_heads`` divides ``size``) each KV head is replicated on
  ``size / num_kv_heads`` consecutive ranks, which hold exactly the query heads that read it (vLLM's
  rule); any other combination is a ``ValueError``;
* MLP: ``ffn_dim / size`` consecutive columns of gate and of up, the same rows of down.

Embeddings, norms and the LM head are replicated. QKV and gate/up are column-parallel (each rank
computes its own heads / columns), the output projection and down are row-parallel: each rank's
partial accumulator is integer-valued float64, so the all-reduce (SUM) before scaling is exact and
gives the single-process bits (see ``examples.tiny_model``). Two all-reduces per transformer layer
per forward step; nothing per head or per sequence.

Life cycle of a rank
--------------------
1. The process joins a group (``torch.distributed``: gloo on CPU, NCCL for the model on CUDA) and
   builds ``TinyModel(config, device, TensorParallel.from_group(group))``: every rank generates the
   full weights from the seed and keeps its slices, bit-identical to the single-process ones.
2. Its KV pool has ``model.kv_layout(block_size)`` (local heads only). A GEN rank fed by a CTX TP1
   node pulls ``model.kv_slice()`` (all layers, heads ``model.kv_head_range()``) of the CTX blocks.
3. Every rank calls ``prefill`` / ``decode`` in lockstep with the same inputs; each gets the same
   tokens.

``run_local_group(fn, size, *args)`` runs ``fn(tp, *args)`` on ``size`` fresh CPU processes joined
in a gloo group on 127.0.0.1 (tests, ``python -m examples.tp`` benchmark).

Cost (``python -m examples.tp``: defaults, ~200-token contexts, one thread a rank; 2-core VM shared
with other work, so +-30 %): a decode step at B=1 / 16 / 64 takes ~3 / 6 / 16 ms at TP1, ~10 / 15 /
27 ms at TP2 and ~38 / 47 / 70 ms at TP4; a 512-token prefill ~50 / 65-125 / 115-160 ms. TP is a
loss here because the ranks share two cores: a rank's own compute does shrink (B=64: ~17 -> 10 ->
9 ms at TP1 / 2 / 4; the replicated embedding, norms and LM head do not), but every all-reduce is a
rendezvous of processes that the scheduler does not run together. The step's 4 all-reduces alone
take ~2-3 ms at TP2 and ~25-35 ms at TP4 (4 ranks on 2 cores). On GPUs with NCCL each is a
[B, hidden] float64 all-reduce of a few kB, microseconds.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from examples.tiny_model import ModelConfig

__all__ = ["ShardPlan", "Span", "TensorParallel", "plan_shards", "run_local_group"]


class Span(NamedTuple):
    """Half-open range ``[start, stop)`` of heads or columns in global numbering; unpacks as ``(start, stop)``."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A rank's place in a tensor-parallel group. ``TensorParallel()`` is the single process.

    ``group`` is the ``torch.distributed`` process group the model's all-reduces use; None means
    the default group (only read when ``size > 1``).
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not a valid rank")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This process's rank and the size of ``group`` (None: the default group, initialised)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def check_group(self) -> None:
        """If ``torch.distributed`` is initialised, the group must have this rank and size."""
        if self.size == 1 or not dist.is_initialized():
            return
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (rank, size) != (self.rank, self.size):
            raise ValueError(f"TensorParallel(rank={self.rank}, size={self.size}) but the group has rank {rank} of {size}")

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (every rank calls it, same shape); returns ``t``."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What one rank holds, in global numbering (see the module docstring)."""

    q_heads: Span
    kv_heads: Span
    ffn: Span
    kv_replicas: int  # ranks that hold each of this rank's KV heads: 1 when split, > 1 when replicated

    def qkv_columns(self, config: ModelConfig) -> torch.Tensor:
        """This rank's columns of the fused ``[Q | K | V]`` projection: its Q heads, K heads, V heads."""
        d, q_dim, kv_dim = config.head_dim, config.hidden_size, config.num_kv_heads * config.head_dim
        q, kv = self.q_heads, self.kv_heads
        return torch.cat([
            torch.arange(q.start * d, q.stop * d),
            torch.arange(q_dim + kv.start * d, q_dim + kv.stop * d),
            torch.arange(q_dim + kv_dim + kv.start * d, q_dim + kv_dim + kv.stop * d),
        ])

    def gate_up_columns(self, config: ModelConfig) -> torch.Tensor:
        """This rank's columns of the fused ``[gate | up]`` projection."""
        f = self.ffn
        return torch.cat([torch.arange(f.start, f.stop), torch.arange(config.ffn_dim + f.start, config.ffn_dim + f.stop)])

    def o_rows(self, config: ModelConfig) -> Span:
        """This rank's rows of the output projection (its query heads' outputs)."""
        return Span(self.q_heads.start * config.head_dim, self.q_heads.stop * config.head_dim)


def plan_shards(config: ModelConfig, tp: TensorParallel) -> ShardPlan:
    """The rank's heads and MLP columns; ``ValueError`` for a combination that cannot be split."""
    n, r = tp.size, tp.rank
    hq, hkv = config.num_heads, config.num_kv_heads
    if hq % n:
        raise ValueError(f"tensor-parallel size {n} must divide num_heads ({hq})")
    if config.ffn_dim % n:
        raise ValueError(f"tensor-parallel size {n} must divide ffn_dim ({config.ffn_dim})")
    if hkv % n == 0:
        per, replicas = hkv // n, 1
        kv = Span(r * per, (r + 1) * per)
    elif n % hkv == 0:
        replicas = n // hkv
        kv = Span(r // replicas, r // replicas + 1)
    else:
        raise ValueError(
            f"tensor-parallel size {n} and num_kv_heads ({hkv}): KV heads are split when the size divides "
            "num_kv_heads and replicated when num_kv_heads divides the size; neither holds"
        )
    q_per, f_per = hq // n, config.ffn_dim // n
    return ShardPlan(Span(r * q_per, (r + 1) * q_per), kv, Span(r * f_per, (r + 1) * f_per), replicas)


# --- a local CPU rank group -------------------------------------------------------------------


def run_local_group(fn: Callable[..., None], size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``fn(tp, *args)`` on ranks ``0..size-1``, each a fresh process with one torch thread,
    joined in a gloo group on 127.0.0.1; returns when all are done, raises if one failed (the
    others are then terminated). ``fn`` and ``args`` must pickle (``fn`` module-level). CPU only.

    Ranks are forked from multiprocessing's fork server, which has imported torch but never run
    it (so no thread pool is forked): a rank starts in milliseconds instead of importing torch
    again (seconds each on a busy machine). The server lives as long as this process. This process
    holds the rendezvous store on a port the kernel picks, so there is no race for a free port;
    every rank destroys its process group on the way out.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(
            _rank_main, args=(size, store.port, fn, args, timeout_s), nprocs=size, join=True, start_method="forkserver"
        )
    finally:
        del store


def _rank_main(rank: int, size: int, port: int, fn: Callable[..., None], args: tuple[Any, ...], timeout_s: float) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    try:
        fn(TensorParallel.from_group(), *args)
    finally:
        dist.destroy_process_group()


# --- benchmark: python -m examples.tp -----------------------------------------------------------


def _bench_rank(tp: TensorParallel, out_path: str, block_size: int, context: int) -> None:
    """Median ms of decode steps (B=1/16/64) and of the step's all-reduces alone, on rank 0."""
    import json
    import time

    from examples.tiny_model import TinyModel

    model = TinyModel(tp=tp)
    c = model.config
    layout = model.kv_layout(block_size)
    per_seq = layout.blocks_for(context + 8)
    pool = layout.new_pool(64 * per_seq + 32)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(pool.shape[0], generator=gen)

    def median_ms(fn: Callable[[], object], reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            if tp.size > 1:
                dist.barrier(group=tp.group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    out: dict[str, float] = {}
    for batch in (1, 16, 64):
        tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        positions = torch.randint(context - 8, context + 8, (batch,), generator=gen)
        tokens = torch.randint(0, 256, (batch,), generator=gen)
        out[f"decode_B{batch}_ms"] = median_ms(lambda: model.decode(tokens, positions, tables, pool), 30)
        acc = torch.zeros(batch, 1, c.hidden_size, dtype=torch.float64)

        def reduces(acc: torch.Tensor = acc) -> None:
            for _ in range(2 * c.num_layers):
                tp.all_reduce_(acc)

        out[f"allreduce_B{batch}_ms"] = median_ms(reduces, 30)
    prompt = torch.randint(0, 256, (512,), generator=gen).tolist()
    out["prefill_512_ms"] = median_ms(lambda: model.prefill(prompt, pool, perm[: layout.blocks_for(512)]), 7)
    if tp.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def _benchmark(sizes: tuple[int, ...] = (1, 2, 4), block_size: int = 16, context: int = 200) -> dict[int, dict[str, float]]:
    import json
    import os
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            path = os.path.join(tmp, f"tp{size}.json")
            run_local_group(_bench_rank, size, path, block_size, context)
            with open(path) as f:
                results[size] = json.load(f)
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="decode-step cost of the tiny model at TP1/TP2/TP4 on CPU (gloo)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    sizes = tuple(parser.parse_args().sizes)
    res = _benchmark(sizes)
    keys = list(res[sizes[0]])
    print("metric".ljust(18) + "".join(f"TP{s}".rjust(10) for s in sizes))
    for key in keys:
        print(key.ljust(18) + "".join(f"{res[s][key]:10.2f}" for s in sizes))
