"""Fan-in (issue 9): a CTX that runs tensor-parallel holds each KV head on one rank (or a few, when
heads are replicated); a GEN rank pulls each of its heads from a source that holds it and lands each
part in place. In-process: CTX ranks are stores holding a head range of each request's KV, served by
the in-process transport; GEN ranks are stepped in lockstep (``LocalGroup.step_all``). The real
processes over UCX are in tests/test_tp_two_node.py."""

from __future__ import annotations

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from orchestrator import (
    DecodeBatch,
    FailureReason,
    GenEngine,
    GenRequest,
    InvalidRequest,
    KVSource,
    LocalGroup,
    Mode,
    OrchestratorConfig,
    RequestState,
    TPGenEngine,
)
from tests.harness import request_kv
from transports import KVLayout, KVStore, PeerClosed, new_handle
from transports.inproc import InProcTransport

pytestmark = pytest.mark.anyio

FULL = KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, block_size=4, dtype=torch.float32)


def sub_layout(heads: int) -> KVLayout:
    return KVLayout(FULL.num_layers, heads, FULL.head_dim, FULL.block_size, FULL.dtype)


class ShardedCtx:
    """A CTX of ``len(ranges)`` ranks: rank r holds KV heads ``ranges[r]`` of every request, all under
    one handle (as ``ctx --tp M`` issues them)."""

    def __init__(self, ranges: list[tuple[int, int]], num_blocks: int = 128) -> None:
        self.ranges = ranges
        self.stores = {f"ctx-{r}": KVStore(sub_layout(h1 - h0), sub_layout(h1 - h0).new_pool(num_blocks))
                       for r, (h0, h1) in enumerate(ranges)}
        self._free = {peer: list(range(num_blocks)) for peer in self.stores}
        self.expected: dict[str, torch.Tensor] = {}

    def prefill(self, rid: str, prompt_len: int, *, name_blocks: bool = False) -> tuple[str, tuple[KVSource, ...]]:
        n = FULL.blocks_for(prompt_len)
        kv = request_kv(rid, n, FULL)  # [n, layers, 2, heads, bs, d]
        self.expected[rid] = kv
        handle = new_handle()
        sources = []
        for (peer, store), (h0, h1) in zip(self.stores.items(), self.ranges):
            ids = torch.tensor([self._free[peer].pop() for _ in range(n)], dtype=torch.int64)
            store.pool[ids] = kv[:, :, :, h0:h1]
            epoch = store.epoch
            store.put(rid, ids, num_tokens=prompt_len, lease_s=60.0, handle=handle,
                      on_release=lambda p=peer, i=ids: self._free[p].extend(i.tolist()))
            sources.append(KVSource(peer, h0, h1, kv_blocks=tuple(ids.tolist()) if name_blocks else None,
                                    kv_epoch=epoch if name_blocks else None))
        return handle, tuple(sources)

    def held(self) -> dict[str, int]:
        return {peer: s.statistics().held_requests for peer, s in self.stores.items()}


class Step:
    def __init__(self, ctx: ShardedCtx, h0: int, h1: int) -> None:
        self.ctx, self.h0, self.h1 = ctx, h0, h1
        self.checked = 0

    def __call__(self, batch: DecodeBatch) -> list[int]:
        for rid, blocks in zip(batch.request_ids, batch.block_tables):
            expected = self.ctx.expected[rid][:, :, :, self.h0 : self.h1]
            assert torch.equal(batch.kv[blocks[: expected.shape[0]]], expected), f"{rid}: KV heads differ"
            self.checked += 1
        return [(int(t) + 1) % 256 for t in batch.tokens]


class Gen:
    """A GEN of ``world`` ranks (1: a plain ``GenEngine``) fed by ``ctx``."""

    def __init__(self, ctx: ShardedCtx, world: int, *, connect_latency_s: float = 0.0, **cfg: object) -> None:
        self.ctx = ctx
        local = FULL.num_kv_heads // world
        group = LocalGroup(world)
        self.engines: list[GenEngine] = []
        self.transports: list[InProcTransport] = []
        self.steps: list[Step] = []
        for rank in range(world):
            layout = sub_layout(local)
            base: dict[str, object] = dict(layout=layout, num_blocks=64, transfer_budget_bytes=8 * layout.block_bytes,
                                           kv_transfer_timeout_ms=2_000, kv_head_offset=rank * local)
            base.update(cfg)
            transport = InProcTransport(ctx.stores, connect_latency_s=connect_latency_s)
            step = Step(ctx, rank * local, (rank + 1) * local)
            config = OrchestratorConfig(**base)  # type: ignore[arg-type]
            engine = (GenEngine(config, transport, step) if world == 1
                      else TPGenEngine(config, transport, step, sync=group.sync(rank)))
            self.engines.append(engine)
            self.transports.append(transport)
            self.steps.append(step)
        self.outputs: dict[str, list] = {}

    def submit(self, rid: str, prompt_len: int = 9, max_tokens: int = 3, *, name_blocks: bool = False) -> None:
        handle, sources = self.ctx.prefill(rid, prompt_len, name_blocks=name_blocks)
        self.engines[0].submit(GenRequest(rid, prompt_len=prompt_len, first_token=7, max_tokens=max_tokens,
                                          kv_handle=handle, kv_sources=sources))

    async def step(self) -> None:
        if len(self.engines) == 1:
            self.engines[0].step()
        else:
            LocalGroup.step_all(self.engines)  # type: ignore[arg-type]
        for out in self.engines[0].poll():
            self.outputs.setdefault(out.request_id, []).append(out)
        await checkpoint()
        await wait_all_tasks_blocked()

    async def run_until_idle(self) -> None:
        with anyio.fail_after(30):  # a hang guard, not a timing bound
            while True:
                await self.step()
                if all(e.live_requests == 0 and not e.rest_problems() for e in self.engines):
                    return
                await anyio.sleep(0.001)

    def final(self, rid: str):
        outs = self.outputs.get(rid, [])
        assert outs and outs[-1].finished, f"{rid}: {outs}"
        return outs[-1]


@pytest.fixture
async def make_gen(anyio_backend):
    made: list[Gen] = []
    async with anyio.create_task_group() as tg:

        async def make(ctx: ShardedCtx, world: int, **cfg: object) -> Gen:
            g = Gen(ctx, world, **cfg)
            for e in g.engines:
                await e.start(tg)
            made.append(g)
            return g

        try:
            yield make
            for g in made:  # every rank at rest, every CTX rank holds nothing
                await g.run_until_idle()
                for e in g.engines:
                    assert e.rest_problems() == [], e.rest_problems()
                with anyio.fail_after(5):
                    while any(g.ctx.held().values()):
                        await anyio.sleep(0.01)
        finally:
            for g in made:
                for e in g.engines:
                    e.close()


@pytest.mark.parametrize(("ctx_ranges", "gen_world"), [
    ([(0, 2), (2, 4)], 1),          # CTX TP2 -> GEN TP1: one GEN rank pulls from both CTX ranks
    ([(0, 1), (1, 2), (2, 3), (3, 4)], 1),  # CTX TP4 -> GEN TP1
    ([(0, 1), (1, 2), (2, 3), (3, 4)], 2),  # CTX TP4 -> GEN TP2: each GEN rank from two CTX ranks
    ([(0, 2), (2, 4)], 4),          # CTX TP2 -> GEN TP4: each GEN rank one head of one CTX rank
    ([(0, 2), (2, 4)], 2),          # CTX TP2 -> GEN TP2: aligned
])
async def test_each_gen_rank_pulls_its_heads_from_the_ctx_ranks_that_hold_them(make_gen, ctx_ranges, gen_world) -> None:
    ctx = ShardedCtx(ctx_ranges)
    g = await make_gen(ctx, gen_world)
    for i in range(5):
        g.submit(f"r{i}", prompt_len=5 + 3 * i)
    await g.run_until_idle()
    for i in range(5):
        assert g.final(f"r{i}").state is RequestState.FINISHED
    assert all(s.checked for s in g.steps)
    # every CTX rank was told once per request (GEN TP1: by the pull's release; TP: by rank 0)
    assert ctx.held() == {peer: 0 for peer in ctx.stores}
    moved = sum(t.counters.bytes_moved for t in g.transports)
    assert moved == sum(FULL.wire_bytes(FULL.blocks_for(5 + 3 * i), FULL.full_slice()) for i in range(5))


async def test_chunked_fan_in_stays_within_the_budget(make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    # one layer of one head of a 9-token prompt (3 blocks): the budget holds less than a source's part
    one = FULL.wire_bytes(3, FULL.full_slice()) // (FULL.num_layers * FULL.num_kv_heads)
    g = await make_gen(ctx, 1, transfer_budget_bytes=one)
    g.submit("chunky", prompt_len=9)
    await g.run_until_idle()
    assert g.final("chunky").state is RequestState.FINISHED
    assert g.transports[0].counters.pulls == FULL.num_layers * FULL.num_kv_heads
    assert g.engines[0].receiver.peak_staging_bytes <= one  # type: ignore[union-attr]


async def test_a_replicated_head_is_pulled_once_and_the_unused_copy_freed_at_once(make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (0, 2), (2, 4)])  # ranks 0 and 1 both hold heads 0:2
    g = await make_gen(ctx, 1)
    g.submit("rep")
    await g.run_until_idle()
    assert g.final("rep").state is RequestState.FINISHED
    assert ctx.held() == {"ctx-0": 0, "ctx-1": 0, "ctx-2": 0}
    assert g.transports[0].counters.pulls == 2  # heads 0:2 once (from ctx-0), heads 2:4 once


async def test_the_release_of_an_unused_copy_survives_a_first_connect_slower_than_a_second() -> None:
    """The release of a replicated copy nobody pulls is the first message to its CTX rank, so it
    connects first. On a loaded machine that connect took over a second, and the receive group cut
    every release at 1 s, silently: the copies stayed held until their lease (30 s on a node) ended,
    which a CTX TP4 -> GEN TP1 run's rest check caught now and then. A release waits for the
    transport's own bounds (connect and answer), not a tighter one of the group's."""
    ctx = ShardedCtx([(0, 2), (0, 2), (2, 4)])  # ranks 0 and 1 both hold heads 0:2
    async with anyio.create_task_group() as tg:
        g = Gen(ctx, 1, connect_latency_s=1.5, kv_transfer_timeout_ms=10_000)
        await g.engines[0].start(tg)
        try:
            g.submit("rep")
            await g.run_until_idle()
            assert g.final("rep").state is RequestState.FINISHED
            with anyio.fail_after(5):  # ~1.5 s: the connect
                while any(ctx.held().values()):
                    await anyio.sleep(0.01)
            assert g.transports[0].counters.releases == 1  # ctx-1's copy, freed by its release, not a lease
        finally:
            g.engines[0].close()


@pytest.mark.parametrize("gen_world", [1, 2])
async def test_one_ctx_rank_failing_fails_the_request_and_every_ctx_rank_frees_it(make_gen, gen_world) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, gen_world)
    for t in g.transports:
        t.set_peer_down("ctx-1", True)
    g.submit("bad")
    g.submit("bad2")
    await g.run_until_idle()
    for rid in ("bad", "bad2"):
        out = g.final(rid)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.PEER_ERROR, out
    for t in g.transports:
        t.set_peer_down("ctx-1", False)
    # ctx-0 was told (after the failed pull, or by rank 0); ctx-1 was unreachable: its lease frees it
    with anyio.fail_after(5):
        while ctx.held()["ctx-0"]:
            await anyio.sleep(0.01)
    for peer in ("ctx-1",):
        for rid in ("bad", "bad2"):
            ctx.stores[peer].release(rid)  # what its lease would do; the fixture checks nothing is left


async def test_a_source_list_that_leaves_a_head_unheld_is_refused_at_submit(make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, 1)
    handle, sources = ctx.prefill("gap", 9)
    with pytest.raises(InvalidRequest, match="no KV source holds KV head 2"):
        g.engines[0].submit(GenRequest("gap", prompt_len=9, first_token=1, max_tokens=2, kv_handle=handle,
                                       kv_sources=sources[:1]))
    with pytest.raises(InvalidRequest, match="bad KV source"):
        g.engines[0].submit(GenRequest("gap", prompt_len=9, first_token=1, max_tokens=2, kv_handle=handle,
                                       kv_sources=(KVSource("ctx-0", 2, 1), sources[1])))
    for store in ctx.stores.values():
        store.release("gap")


async def test_a_tp_rank_whose_heads_no_source_holds_fails_the_request_on_every_rank(make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, 2)
    handle, sources = ctx.prefill("half", 9)
    # rank 0 checks its own heads at submit (0:2, held); rank 1's (2:4) are held by no source
    g.engines[0].submit(GenRequest("half", prompt_len=9, first_token=1, max_tokens=2, kv_handle=handle,
                                   kv_sources=sources[:1]))
    await g.run_until_idle()
    out = g.final("half")
    assert out.state is RequestState.FAILED and out.failure is FailureReason.PROTOCOL_ERROR
    assert "no KV source holds KV head 2" in out.message
    ctx.stores["ctx-1"].release("half")  # never named to GEN: only its lease could free it


async def test_with_the_model_heads_known_a_source_list_that_leaves_another_ranks_heads_unheld_is_refused_at_submit(
        make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, 2, total_kv_heads=4)
    handle, sources = ctx.prefill("half", 9)
    with pytest.raises(InvalidRequest, match="no KV source holds KV head 2"):  # rank 1's heads
        g.engines[0].submit(GenRequest("half", prompt_len=9, first_token=1, max_tokens=2, kv_handle=handle,
                                       kv_sources=sources[:1]))
    assert g.engines[0].budget.statistics().in_use == 0 and not g.engines[0].scheduler.num_waiting
    g.engines[0].submit(GenRequest("half", prompt_len=9, first_token=1, max_tokens=2, kv_handle=handle,
                                   kv_sources=sources))  # the id is free again: nothing was queued
    await g.run_until_idle()
    assert g.final("half").state is RequestState.FINISHED


def test_total_kv_heads_must_hold_this_ranks_heads() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4)
    with pytest.raises(ValueError, match="total_kv_heads"):
        OrchestratorConfig(layout=layout, num_blocks=8, transfer_budget_bytes=1 << 20, kv_head_offset=2,
                           total_kv_heads=3)
    with pytest.raises(ValueError, match="total_kv_heads"):
        OrchestratorConfig(layout=layout, num_blocks=8, transfer_budget_bytes=1 << 20, total_kv_heads=0)
    OrchestratorConfig(layout=layout, num_blocks=8, transfer_budget_bytes=1 << 20, kv_head_offset=2, total_kv_heads=4)


@pytest.mark.parametrize("mode", [Mode.INLINE])
async def test_inline_mode_fans_in_too(make_gen, mode: Mode) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, 1, mode=mode, max_num_seqs=4)
    for i in range(3):
        g.submit(f"in{i}", prompt_len=6 + i)
    for _ in range(3):  # the inline path blocks this thread on the event loop: step it from a worker
        await anyio.to_thread.run_sync(g.engines[0].step)
    await g.run_until_idle()
    for i in range(3):
        assert g.final(f"in{i}").state is RequestState.FINISHED


async def test_a_failed_fan_in_pull_tells_the_other_source_to_free_its_copy(make_gen) -> None:
    ctx = ShardedCtx([(0, 2), (2, 4)])
    g = await make_gen(ctx, 1)
    g.transports[0].fail("f1", PeerClosed("boom"))  # the first pull of f1 (whichever source) fails
    g.submit("f1")
    await g.run_until_idle()
    assert g.final("f1").failure is FailureReason.PEER_ERROR
    with anyio.fail_after(5):
        while any(ctx.held().values()):
            await anyio.sleep(0.01)
    assert g.transports[0].counters.releases >= 1


@pytest.mark.parametrize(("ctx_ranges", "gen_world"), [([(0, 4)], 1), ([(0, 2), (2, 4)], 4)])
async def test_block_ids_named_by_the_prefill_reply_reach_every_rank_s_pull(make_gen, ctx_ranges, gen_world) -> None:
    """A CTX that names its block ids (per source) in the prefill reply: every GEN rank's pull
    carries them (across the group's step message), and the transport checks them against the
    CTX's store, so the KV is exact only if each rank got its source's own list."""
    ctx = ShardedCtx(ctx_ranges)
    g = await make_gen(ctx, gen_world)
    for i in range(3):
        g.submit(f"n{i}", prompt_len=5 + 4 * i, name_blocks=True)
    await g.run_until_idle()
    for i in range(3):
        assert g.final(f"n{i}").state is RequestState.FINISHED
    assert all(t.counters.pulls_with_blocks == t.counters.pulls > 0 for t in g.transports)
    assert all(t.counters.pulls_with_epoch == t.counters.pulls for t in g.transports)  # and each source's epoch


async def test_wrong_block_ids_fail_the_request_and_bad_ones_are_refused_at_submit(make_gen) -> None:
    ctx = ShardedCtx([(0, 4)])
    g = await make_gen(ctx, 1)
    handle, (src,) = ctx.prefill("wrong", 9, name_blocks=True)
    swapped = KVSource(src.peer, 0, None, None, tuple(reversed(src.kv_blocks or ())))
    g.engines[0].submit(GenRequest("wrong", 9, 7, 3, kv_handle=handle, kv_sources=(swapped,)))
    await g.run_until_idle()
    out = g.final("wrong")
    assert out.state is RequestState.FAILED and out.failure is FailureReason.PROTOCOL_ERROR
    handle, (src,) = ctx.prefill("short", 9, name_blocks=True)
    for bad in ((1, 2), (1, 2, -3), [1, 2, 3]):
        with pytest.raises(InvalidRequest, match="kv_blocks"):
            g.engines[0].submit(GenRequest("short", 9, 7, 3, kv_handle=handle, peer=src.peer, kv_blocks=bad))  # type: ignore[arg-type]
    ctx.stores[src.peer].release("short", handle=handle)
