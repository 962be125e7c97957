"""The CTX node: prefill prompts into paged KV, hold it, serve it over UCX until pulled.

    control "prefill" ─> check the request id (before anything is allocated)
                     ─> allocate KV blocks (waits while the pool is full, bounded)
                     ─> prefill on the execution thread (one at a time) ─> KVStore.put(lease) -> handle
                     ─> reply first_token, prompt_len, kv_peer, kv_handle, block checksums
    UCX PULL from GEN ─> UCXKVServer serves the blocks, then the store frees them
    GEN's RELEASE, a control "release" with the handle, or the lease expiring ─> the store frees them
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import anyio
import structlog
import torch

from examples.metrics import ctx_node_stats, serve_node_metrics
from examples.two_node import control
from examples.two_node.common import announce_ready, block_checksums, build_model, control_server, ucx_config
from examples.two_node.gen_tp import head_checksums
from orchestrator import KVBlockPool, KVExhausted, loop_caller
from transports import KVStore
from transports.ucx import UCXKVServer

log = structlog.get_logger("examples.ctx")


class CtxNode:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = build_model(args)
        self.layout = self.model.kv_layout(args.block_size)
        self.pool = KVBlockPool(self.layout, args.num_blocks)
        self.store = KVStore(self.layout, self.pool.kv)
        self.ucx_addr = ""
        self._freed = anyio.Event()
        self._exec = anyio.CapacityLimiter(1)  # the CTX execution thread: one prefill at a time
        self._prefills = 0
        self.control = control_server(args, self.handle, self.model.config)

    def _on_free(self, block_ids: torch.Tensor) -> None:
        """Any thread: give the blocks back and wake every prefill waiting for blocks."""
        self.pool.free(block_ids)
        self._call(self._wake_allocators)

    def _wake_allocators(self) -> None:
        freed, self._freed = self._freed, anyio.Event()  # one event per generation of frees
        freed.set()

    async def _allocate(self, n: int) -> torch.Tensor:
        with anyio.fail_after(self.args.alloc_wait_s):
            while True:
                freed = self._freed  # taken before trying, so a free in between is not missed
                try:
                    return self.pool.allocate(n)
                except KVExhausted:
                    await freed.wait()

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        op = msg.get("op")
        if op == "prefill":
            await stream.send(await self._prefill(msg))
        elif op == "release":  # only with the handle of the prefill: a wrong one releases nothing
            rid, handle = control.request_id(msg), control.kv_handle(msg)
            await stream.send({"ok": True, "released": self.store.release(rid, handle=handle)})
        elif op == "stats":
            s, p = self.store.statistics(), self.pool.statistics()
            await stream.send({"ok": True, "role": "ctx", "prefills": self._prefills,
                               "store": dataclasses.asdict(s),
                               "pool": {"num_blocks": p.num_blocks, "used_blocks": p.used_blocks,
                                        "peak_used_blocks": p.peak_used_blocks},
                               "control": dataclasses.asdict(self.control.statistics())})
        elif op == "ping":
            await stream.send({"ok": True, "role": "ctx"})
        else:
            raise control.ControlError(f"unknown op {op!r}")

    async def _prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.model.config
        rid = control.request_id(msg)  # before anything is allocated for it
        max_tokens = control.field(msg, "max_tokens", int, lo=1, hi=cfg.max_seq_len)
        prompt = control.int_list(msg, "prompt_ids", max_len=cfg.max_seq_len - max_tokens, lo=0, hi=cfg.vocab_size - 1)
        n = self.layout.blocks_for(len(prompt))
        if n > self.pool.num_blocks:
            raise control.ControlError(f"prompt needs {n} KV blocks, the CTX pool has {self.pool.num_blocks}")
        try:
            block_ids = await self._allocate(n)
        except TimeoutError:
            raise control.ControlError(f"no {n} free KV blocks within {self.args.alloc_wait_s} s") from None
        try:
            t0 = time.perf_counter()
            first = await anyio.to_thread.run_sync(self.model.prefill, prompt, self.pool.kv, block_ids, limiter=self._exec)
            checksums = block_checksums(self.pool.kv, block_ids) if self.args.kv_checksums else []
            per_head = head_checksums(self.pool.kv, block_ids) if self.args.kv_checksums else []
            handle = self.store.put(rid, block_ids, num_tokens=len(prompt), lease_s=self.args.lease_s,
                                    on_release=lambda: self._on_free(block_ids))
        except ValueError as exc:  # duplicate id
            self.pool.free(block_ids)
            raise control.ControlError(str(exc)) from None
        except BaseException:
            self.pool.free(block_ids)
            raise
        self._prefills += 1
        log.debug("prefill_done", request_id=rid, tokens=len(prompt), ms=round((time.perf_counter() - t0) * 1e3, 2))
        return {"ok": True, "request_id": rid, "first_token": first, "prompt_len": len(prompt),
                "kv_peer": self.ucx_addr, "kv_handle": handle, "block_checksums": checksums,
                "head_checksums": per_head}

    async def run(self) -> None:
        self._call = loop_caller()
        async with UCXKVServer(self.store, ucx_config(self.args), port=self.args.ucx_port, lease_s=self.args.lease_s) as server:
            self.ucx_addr = f"{self.args.advertise or self.args.host}:{server.port}"
            async with anyio.create_task_group() as tg:
                port = await tg.start(self.control.serve, self.args.host, self.args.port)
                metrics = (None if self.args.metrics_port is None else serve_node_metrics(
                    "ctx", lambda: ctx_node_stats(self), host=self.args.host, port=self.args.metrics_port))
                announce_ready(role="ctx", ctrl=f"{self.args.host}:{port}", ucx=self.ucx_addr, metrics=metrics)
                log.info("ctx_ready", ctrl_port=port, ucx=self.ucx_addr)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="control-plane bind address")
    p.add_argument("--port", type=int, default=0, help="control-plane port (0: pick one)")
    p.add_argument("--ucx-port", type=int, default=0, help="UCX listener port (0: pick one)")
    p.add_argument("--advertise", help="host GEN should use to reach the UCX listener (default: --host)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in the CTX pool")
    p.add_argument("--lease-s", type=float, default=30.0, help="free a request's KV if GEN has not pulled it by then")
    p.add_argument("--alloc-wait-s", type=float, default=30.0, help="how long a prefill waits for free KV blocks")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: pick one; default: off)")
    p.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=True,
                   help="CRC32 of each prefilled KV block in the prefill reply (a parity check; costs CPU per request)")


def main(args: argparse.Namespace) -> int:
    anyio.run(CtxNode(args).run, backend="asyncio")
    return 0
