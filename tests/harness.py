"""A GEN engine wired to in-process CTX peers, stepped from the test's own event loop.

``Harness.step()`` runs one engine step (sync, as on the execution thread) and then lets the event
loop run until every receive task is blocked, so tests advance deterministically without sleeps.
The step function checks, for every decoded request, that its prompt KV blocks hold exactly what the
CTX peer computed (so a receive that did not land, or a freed block, is caught) and returns
last token + 1.
"""

from __future__ import annotations

import dataclasses
import hashlib

import anyio
import torch
from anyio.lowlevel import checkpoint
from anyio import wait_all_tasks_blocked

from orchestrator import DecodeBatch, GenEngine, GenRequest, Mode, OrchestratorConfig, RequestOutput
from transports import KVLayout, KVSlice, KVStore
from transports.inproc import InProcTransport

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
BLOCK = LAYOUT.block_bytes  # 256 bytes
PEER = "ctx-0"


def request_kv(request_id: str, num_blocks: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *layout.block_shape), generator=g, dtype=layout.dtype)


class CtxPeer:
    """A CTX node's KV, held in a store, as the in-process transport serves it."""

    def __init__(self, layout: KVLayout = LAYOUT, num_blocks: int = 256) -> None:
        self.layout = layout
        self.pool = layout.new_pool(num_blocks)
        self.store = KVStore(layout, self.pool)
        self._free = list(range(num_blocks))
        self.expected: dict[str, torch.Tensor] = {}
        self.handles: dict[str, str] = {}

    def prefill(self, request_id: str, prompt_len: int, lease_s: float = 60.0) -> str:
        n = self.layout.blocks_for(prompt_len)
        ids = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int64)
        kv = request_kv(request_id, n, self.layout)
        self.pool[ids] = kv
        self.expected[request_id] = kv
        handle = self.store.put(request_id, ids, num_tokens=prompt_len, lease_s=lease_s,
                                on_release=lambda: self._free.extend(ids.tolist()))
        self.handles[request_id] = handle
        return handle


class CheckingStep:
    """Decode step for tests: verifies each request's received KV, returns last token + 1."""

    def __init__(self, peers: dict[str, CtxPeer], layout: KVLayout = LAYOUT) -> None:
        self.peers = peers
        self.layout = layout
        self.decoded: list[list[str]] = []
        self.slices: dict[str, KVSlice] = {}

    def __call__(self, batch: DecodeBatch) -> list[int]:
        self.decoded.append(list(batch.request_ids))
        for rid, blocks in zip(batch.request_ids, batch.block_tables):
            for peer in self.peers.values():
                expected = peer.expected.get(rid)
                if expected is not None:
                    got = batch.kv[blocks[: expected.shape[0]]]
                    s = self.slices.get(rid)
                    if s is not None:  # only this layer/head range was pulled
                        got = got[:, s.layer_start : s.layer_end, :, s.head_start : s.head_end]
                        expected = expected[:, s.layer_start : s.layer_end, :, s.head_start : s.head_end]
                    assert torch.equal(got, expected), f"{rid}: decode reads KV that is not what CTX computed"
        return [(int(t) + 1) % 256 for t in batch.tokens]


@dataclasses.dataclass
class Harness:
    engine: GenEngine
    transport: InProcTransport
    peers: dict[str, CtxPeer]
    step_fn: CheckingStep
    outputs: dict[str, list[RequestOutput]] = dataclasses.field(default_factory=dict)

    @property
    def peer(self) -> CtxPeer:
        return self.peers[PEER]

    def request(self, rid: str, prompt_len: int = 8, max_tokens: int = 4, *, peer: str = PEER,
                prefill: bool = True, lease_s: float = 60.0, **kw: object) -> GenRequest:
        if prefill:
            kw.setdefault("kv_handle", self.peers[peer].prefill(rid, prompt_len, lease_s))
        if kw.get("kv_slice") is not None:
            self.step_fn.slices[rid] = kw["kv_slice"]  # type: ignore[assignment]
        return GenRequest(rid, prompt_len=prompt_len, first_token=7, max_tokens=max_tokens, peer=peer, **kw)

    def submit(self, rid: str, prompt_len: int = 8, max_tokens: int = 4, **kw: object) -> GenRequest:
        req = self.request(rid, prompt_len, max_tokens, **kw)
        self.engine.submit(req)
        return req

    async def settle(self) -> None:
        await checkpoint()
        await wait_all_tasks_blocked()

    async def step(self):
        report = self.engine.step()
        for out in self.engine.poll():
            self.outputs.setdefault(out.request_id, []).append(out)
        await self.settle()
        return report

    async def step_off_loop(self) -> None:
        """One step on a worker thread, as a blocking (inline-mode) execution thread needs: its
        waits are served by this event loop meanwhile."""
        await anyio.to_thread.run_sync(self.engine.step)
        await self.settle()
        for out in self.engine.poll():
            self.outputs.setdefault(out.request_id, []).append(out)

    async def run_until_idle_off_loop(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            await self.step_off_loop()
            if self.engine.live_requests == 0:
                return
        raise AssertionError(f"not idle after {max_steps} steps: {self.engine!r}")

    async def run_until_idle(self, max_steps: int = 1000, timeout: float = 10.0) -> None:
        with anyio.fail_after(timeout):
            for _ in range(max_steps):
                await self.step()
                if self.engine.live_requests == 0:
                    await self.step()  # drain the last results
                    return
                if not self.engine.num_running:
                    await anyio.sleep(0.001)  # receives in flight on a timer (bandwidth, timeouts)
        raise AssertionError(f"not idle after {max_steps} steps: {self.engine!r}")

    def final(self, rid: str) -> RequestOutput:
        outs = self.outputs.get(rid, [])
        assert outs and outs[-1].finished, f"{rid} has not ended: {outs}"
        return outs[-1]

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_tokens]


def make_config(**overrides: object) -> OrchestratorConfig:
    base: dict[str, object] = dict(layout=LAYOUT, num_blocks=64, transfer_budget_bytes=8 * BLOCK, mode=Mode.ORCHESTRATED,
                                   kv_transfer_timeout_ms=2_000)
    base.update(overrides)
    return OrchestratorConfig(**base)  # type: ignore[arg-type]


def make_harness(config: OrchestratorConfig | None = None, *, peers: tuple[str, ...] = (PEER,),
                 step_fn: object = None, **transport_kw: object) -> Harness:
    config = config or make_config()
    ctx = {p: CtxPeer(config.layout) for p in peers}
    transport = InProcTransport({p: c.store for p, c in ctx.items()}, **transport_kw)  # type: ignore[arg-type]
    checking = CheckingStep(ctx, config.layout)
    engine = GenEngine(config, transport if config.mode is not Mode.IDEAL else None, step_fn or checking)  # type: ignore[arg-type]
    return Harness(engine, transport, ctx, checking)
