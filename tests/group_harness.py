"""A GEN of any tensor-parallel size in this process: ``world`` engines (1: a lone ``GenEngine``
with its solo agreement; more: one engine per rank agreeing through ``LocalGroup``, every message
through the binary wire form), each rank holding its KV heads of one CTX TP1 copy, stepped in
lockstep from the test's event loop. The ``make_group`` fixture checks every rank is at rest after
the test."""

from __future__ import annotations

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from orchestrator import DecodeBatch, GenEngine, GenRequest, GroupBroken, LocalGroup, Mode, OrchestratorConfig, TPGenEngine
from tests.harness import CtxPeer
from transports import KVLayout
from transports.inproc import InProcTransport

FULL = KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, block_size=4, dtype=torch.float32)
PEER = "ctx-0"
EOS = 99


class Step:
    """A rank's decode step: checks its heads of each request's KV, returns last token + 1
    (``eos_on``: this rank samples EOS for that request instead: a rank gone wrong)."""

    def __init__(self, ctx: CtxPeer | None, h0: int, h1: int) -> None:
        self.ctx, self.h0, self.h1 = ctx, h0, h1
        self.decoded: list[list[str]] = []
        self.eos_on: str | None = None
        self.crash = False
        self.record = True
        self.check = ctx is not None

    def __call__(self, batch: DecodeBatch) -> list[int]:
        if self.crash:
            raise RuntimeError("device lost")
        if self.record:
            self.decoded.append(list(batch.request_ids))
        for rid, blocks in zip(batch.request_ids, batch.block_tables if self.check else ()):
            expected = self.ctx.expected[rid][:, :, :, self.h0 : self.h1]
            assert torch.equal(batch.kv[blocks[: expected.shape[0]]], expected), f"{rid}: KV slice differs"
        return [EOS if rid == self.eos_on else (int(t) + 1) % 256 for rid, t in zip(batch.request_ids, batch.tokens)]


class Group:
    """``world`` ranks of one GEN (1: a lone GenEngine), stepped in lockstep from the test."""

    threaded = False
    """Step on a worker thread, as an execution thread does (INLINE waits on that thread for the event loop)."""

    def __init__(self, world: int, breakable: bool = False, **cfg: object) -> None:
        self.world = world
        self.steps_done = 0
        self.commands: list[list[tuple[int, object]]] = [[] for _ in range(world)]
        self.ctx = CtxPeer(FULL)
        local = FULL.num_kv_heads // world
        group = LocalGroup(world) if world > 1 else None
        self.engines: list[GenEngine] = []
        self.transports: list[InProcTransport] = []
        self.steps: list[Step] = []
        for rank in range(world):
            layout = KVLayout(FULL.num_layers, local, FULL.head_dim, FULL.block_size, FULL.dtype)
            base: dict[str, object] = dict(layout=layout, num_blocks=64, transfer_budget_bytes=8 * layout.block_bytes,
                                           kv_transfer_timeout_ms=2_000, kv_head_offset=rank * local)
            base.update({k: v for k, v in cfg.items() if not k.startswith("rank")})
            base.update(cfg.get(f"rank{rank}", {}))  # type: ignore[call-overload]
            config = OrchestratorConfig(**base)  # type: ignore[arg-type]
            transport = InProcTransport({PEER: self.ctx.store})
            step = Step(self.ctx if config.mode is not Mode.IDEAL else None, rank * local, (rank + 1) * local)
            on_command = (lambda c, r=rank: self.commands[r].append((self.steps_done, c)))
            kv = transport if config.mode is not Mode.IDEAL else None
            if group is None:
                self.engines.append(GenEngine(config, kv, step, on_command=on_command))
            else:  # a rank of a group: the engine with the group's agreement plugged in
                sync = Breakable(group.sync(rank)) if breakable else group.sync(rank)
                self.engines.append(TPGenEngine(config, kv, step, sync=sync, on_command=on_command))
            self.transports.append(transport)
            self.steps.append(step)
        self.outputs: dict[str, list] = {}

    @property
    def lead(self) -> GenEngine:
        return self.engines[0]

    def submit(self, rid: str, prompt_len: int = 8, max_tokens: int = 4, prefill: bool = True) -> None:
        handle = self.ctx.prefill(rid, prompt_len) if prefill else None
        self.lead.submit(GenRequest(rid, prompt_len=prompt_len, first_token=7, max_tokens=max_tokens, peer=PEER,
                                    kv_handle=handle, eos_token=EOS))

    def step_once(self) -> None:
        if self.world == 1:
            self.lead.step()
        else:
            LocalGroup.step_all(self.engines)
        self.steps_done += 1
        for out in self.lead.poll():
            self.outputs.setdefault(out.request_id, []).append(out)

    async def step(self) -> None:
        if self.threaded:
            await anyio.to_thread.run_sync(self.step_once)
        else:
            self.step_once()
        await self.settle()

    async def settle(self) -> None:
        await checkpoint()
        await wait_all_tasks_blocked()

    async def run_until_idle(self, max_steps: int = 2000) -> None:
        with anyio.fail_after(30):  # a hang guard, not a timing bound
            for _ in range(max_steps):
                await self.step()
                if not any(e.rest_problems() for e in self.engines):
                    return
                await anyio.sleep(0.001)
        raise AssertionError([e.rest_problems() for e in self.engines])

    def final(self, rid: str):
        outs = self.outputs.get(rid, [])
        assert outs and outs[-1].finished, f"{rid}: {outs}"
        return outs[-1]

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_tokens]

    def each(self, name: str, *args: object) -> None:
        """Call ``name(*args)`` on every rank's transport (the same fault everywhere)."""
        for t in self.transports:
            getattr(t, name)(*args)


@pytest.fixture
async def make_group(anyio_backend):
    made: list[Group] = []
    async with anyio.create_task_group() as tg:

        async def make(world: int, breakable: bool = False, **cfg: object) -> Group:
            g = Group(world, breakable, **cfg)
            for e in g.engines:
                await e.start(tg)
            made.append(g)
            return g

        try:
            yield make
            for g in made:
                await g.run_until_idle()
                for e in g.engines:
                    assert e.rest_problems() == [], e.rest_problems()
        finally:
            for g in made:
                for e in g.engines:
                    e.close()


class Breakable:
    """A rank's agreement that fails like a broken group once ``cause`` is set."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.cause: str | None = None
        self.calls = 0

    def agree(self, message):  # noqa: ANN001
        self.calls += 1
        if self.cause is not None:
            raise GroupBroken(self.cause)
        return self.inner.agree(message)
