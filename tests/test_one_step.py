"""One engine, one step, every tensor-parallel size: what holds for a lone rank holds for a group.

Each test runs at TP1 (``GenEngine`` with its solo agreement) and at TP2/TP4 (the same engine per
rank, in this process, agreeing through ``LocalGroup``: every message goes through the binary wire
form). Ranks hold their own KV heads of one CTX TP1 copy; every test ends at rest on every rank.
"""

from __future__ import annotations

import threading
import tracemalloc

import anyio
import pytest
import structlog
import structlog.testing

from orchestrator import (
    FailureReason,
    GenEngine,
    GenRequest,
    LocalGroup,
    Mode,
    RequestState,
)
from orchestrator._step import Abort, Outcome, StepMessage, Submit, decode, encode
from tests.group_harness import FULL, PEER, Group
from transports import PeerClosed

pytestmark = pytest.mark.anyio

SIZES = pytest.mark.parametrize("world", [1, 2, 4])


@SIZES
async def test_requests_decode_exact_kv_and_every_ctx_copy_is_freed(make_group, world: int) -> None:
    g = await make_group(world)
    for i in range(6):
        g.submit(f"r{i}", prompt_len=5 + i, max_tokens=4)
    await g.run_until_idle()
    for i in range(6):
        assert g.final(f"r{i}").state is RequestState.FINISHED and g.tokens(f"r{i}") == [8, 9, 10]
    assert all(s.decoded == g.steps[0].decoded for s in g.steps)
    assert g.ctx.store.statistics().held_requests == 0


@SIZES
async def test_quarantined_blocks_come_back_only_when_every_rank_is_quiet(make_group, world: int) -> None:
    g = await make_group(world, num_blocks=3, transfer_budget_bytes=4 * FULL.block_bytes)
    g.each("stall_landing", "late")
    g.submit("late", prompt_len=8, max_tokens=4)  # 3 blocks: the whole pool of every rank
    await g.step()
    g.lead.abort("late")
    for _ in range(3):
        await g.step()
    assert g.final("late").state is RequestState.ABORTED  # the client hears at once
    for e in g.engines:
        s = e.statistics()
        assert s.quarantined_blocks == 3 and s.pool.used_blocks == 3 and s.budget.in_use > 0
    g.submit("next", prompt_len=4, max_tokens=4)
    g.transports[0].finish_landing("late")  # rank 0's receive is over; the others' are not (TP > 1)
    for _ in range(5):
        await g.step()
    waiting = [e.statistics().waiting for e in g.engines]
    assert waiting == ([0] if world == 1 else [1] * world)  # admitted only when every rank is quiet
    g.each("finish_landing", "late")
    await g.run_until_idle()
    assert g.final("next").state is RequestState.FINISHED
    assert g.ctx.store.statistics().held_requests == 0


@SIZES
async def test_every_path_ends_at_rest_and_frees_every_ctx_copy(make_group, world: int) -> None:
    g = await make_group(world, transfer_budget_bytes=2 * FULL.block_bytes // world, max_num_seqs=2)
    g.transports[-1].fail("bad", PeerClosed("connection reset by peer", peer=PEER))
    g.each("stall", "stuck")
    for rid in ("ok", "bad", "running"):
        g.submit(rid, prompt_len=4, max_tokens=50 if rid == "running" else 3)
    for _ in range(4):
        await g.step()
    g.submit("stuck", prompt_len=8)  # takes the whole budget and never completes
    g.submit("queued", prompt_len=4)  # waits behind it
    for _ in range(2):
        await g.step()
    assert all((e.statistics().receiving, e.statistics().waiting) == (1, 1) for e in g.engines)
    g.lead.abort("stuck")  # while receiving
    g.lead.abort("queued")  # while waiting
    for _ in range(30):
        await g.step()
        if g.outputs.get("running") and len(g.tokens("running")) >= 2:
            break
    g.lead.abort("running")
    await g.run_until_idle()
    assert g.final("ok").state is RequestState.FINISHED
    bad = g.final("bad")
    assert bad.state is RequestState.FAILED and bad.failure is FailureReason.PEER_ERROR
    assert all(g.final(r).state is RequestState.ABORTED for r in ("stuck", "queued", "running"))
    assert g.ctx.store.statistics().held_requests == 0


@SIZES
async def test_a_crashing_decode_breaks_the_whole_group_and_everything_comes_back(make_group, world: int) -> None:
    g = await make_group(world)
    g.each("stall", "receiving")
    for rid in ("running", "receiving", "waiting"):
        g.submit(rid, prompt_len=4, max_tokens=100)
    for _ in range(3):
        await g.step()
    g.steps[-1].crash = True
    with pytest.raises(RuntimeError, match="device lost"):
        g.step_once()
    g.engines[-1].mark_unhealthy("decode loop crashed: RuntimeError: device lost")  # as DecodeLoop does
    await g.step()  # the next step carries it: every rank breaks at once
    assert all(e.stopped and e.health() for e in g.engines)
    for rid in ("running", "receiving", "waiting"):
        out = g.final(rid)
        assert out.failure is FailureReason.INTERNAL and "device lost" in out.message
    await g.run_until_idle()
    assert g.ctx.store.statistics().held_requests == 0


@pytest.mark.parametrize("world", [2, 4])
async def test_the_ctx_is_told_to_free_a_copy_only_once_no_rank_may_still_read_it(make_group, world: int) -> None:
    """Aborted while every rank's READ of it outlives its cancellation (NIXL cannot withdraw one):
    rank 0 tells the CTX to free its KV only once every rank's blocks are quiet (before, at once: the
    CTX could free, and reuse, blocks a rank still read). (A lone rank's transport waits itself.)"""
    g = await make_group(world)
    g.each("stall_landing", "gone")
    g.submit("gone", prompt_len=8, max_tokens=4)
    await g.step()
    g.lead.abort("gone")
    for _ in range(6):
        await g.step()
        await anyio.sleep(0.005)
    assert g.final("gone").state is RequestState.ABORTED
    assert g.ctx.store.statistics().held_requests == 1 and sum(t.counters.releases for t in g.transports) == 0
    g.each("finish_landing", "gone")
    await g.run_until_idle()
    assert g.ctx.store.statistics().held_requests == 0 and sum(t.counters.releases for t in g.transports) == 1


@pytest.mark.parametrize("world", [1, 4])
async def test_a_stale_abort_before_a_resubmission_ends_the_same_at_every_size(make_group, world: int) -> None:
    g = await make_group(world)
    g.submit("x", max_tokens=2)
    await g.run_until_idle()
    assert g.final("x").state is RequestState.FINISHED
    g.outputs.clear()
    g.lead.abort("x")  # stale: the front's abort of the finished request, sent late
    g.submit("x", max_tokens=2)  # the client's next request with the same id
    await g.run_until_idle()
    assert g.final("x").state is RequestState.FINISHED
    g.outputs.clear()
    g.submit("y", max_tokens=50)
    g.lead.abort("y")  # an abort after its submission (one step's inbox) aborts it
    await g.run_until_idle()
    assert g.final("y").state is RequestState.ABORTED


@pytest.mark.parametrize("world", [2, 4])
async def test_a_rank_that_samples_eos_alone_is_caught_the_same_step(make_group, world: int) -> None:
    g = await make_group(world)
    g.submit("a", max_tokens=20)
    g.submit("b", max_tokens=20)
    for _ in range(4):
        await g.step()
    g.steps[-1].eos_on = "a"  # this rank's sampler goes wrong for one step
    decoded = len(g.steps[0].decoded)
    await g.step()  # the decode that samples it (and the emission of the step before)
    emitted = len(g.tokens("a"))
    await g.step()  # its tokens are agreed here: the batch digests differ
    assert all(e.stopped for e in g.engines) and len(g.steps[0].decoded) == decoded + 1
    assert "decoded different batches" in g.lead.health()
    assert len(g.tokens("a")) == emitted  # nothing of the disputed step was emitted
    for rid in ("a", "b"):
        assert g.final(rid).failure is FailureReason.INTERNAL
    await g.run_until_idle()


@pytest.mark.parametrize("world", [2, 4])
async def test_a_rank_that_admits_differently_is_caught_before_it_decodes(make_group, world: int) -> None:
    g = await make_group(world)  # the same settings (else the first step breaks the group over them)
    pool = g.engines[1].pool
    taken = pool.allocate(pool.num_free - 2)  # rank 1's pool holds 2 free blocks, as if a bug leaked the rest
    g.submit("small", prompt_len=4)
    g.submit("big", prompt_len=16)  # rank 1 cannot hold its KV: its admissions differ
    for _ in range(3):
        await g.step()
    assert all(e.stopped for e in g.engines) and "admitted different requests" in g.lead.health()
    assert all(s.decoded == [] for s in g.steps)  # caught before any rank decoded
    pool.free(taken)
    await g.run_until_idle()
    assert g.ctx.store.statistics().held_requests == 0


async def test_ranks_on_their_own_threads_agree_through_the_barrier(anyio_backend) -> None:
    """Each rank steps on its own thread (as a node's execution threads do), meeting at the barrier."""
    g = Group(2, mode=Mode.IDEAL)
    for i in range(8):
        g.submit(f"r{i}", max_tokens=5, prefill=False)
    stop = threading.Event()

    def run(e: GenEngine) -> None:
        while not stop.is_set() and not e.stopped:
            e.step()

    threads = [threading.Thread(target=run, args=(e,)) for e in g.engines[1:]]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            g.lead.step()
            for out in g.lead.poll():
                g.outputs.setdefault(out.request_id, []).append(out)
            if len(g.outputs) == 8 and all(o[-1].finished for o in g.outputs.values()):
                break
        assert all(g.final(f"r{i}").state is RequestState.FINISHED for i in range(8))
        assert g.steps[0].decoded == g.steps[1].decoded
    finally:
        with structlog.testing.capture_logs() as logs:
            g.lead.request_stop()
            g.lead.step()
            stop.set()
            for t in threads:
                t.join(10)
    assert all(e.stopped for e in g.engines) and not any(e.rest_problems() for e in g.engines)
    # a stop rank 0 asked for is not a failure (it was logged as engine_broken, at error)
    assert {(e["event"], e["log_level"]) for e in logs if e["event"].startswith("engine_")} == {("engine_stopped", "info")}


def test_the_step_message_round_trips_and_stays_compact() -> None:
    reqs = [GenRequest(f"req-{i:06d}", 100 + i, 5, 16, peer="10.0.0.1:13337", kv_handle="a" * 32, eos_token=2)
            for i in range(4)]
    from orchestrator import KVSource

    reqs.append(GenRequest("fan-in", 10, 5, 16, kv_handle="not-hex-handle",
                           kv_sources=(KVSource("h1:1", 0, 2), KVSource("h2:2", 2, None, "b" * 32, (9, 10, 11, 4), 17))))
    reqs.append(GenRequest("named-blocks", 10, 5, 16, peer="h1:1", kv_blocks=(7, 8, 9, 3, 0, 1, 2, 200), kv_epoch=3))
    m = StepMessage(events=[Abort(9)] + [Submit(i, r) for i, r in enumerate(reqs[:2])] + [Abort(1)]
                    + [Submit(i + 2, r) for i, r in enumerate(reqs[2:])] + [Abort(2)],
                    outcomes=[Outcome(i, None) for i in range(64)] + [Outcome(70, FailureReason.TIMEOUT, "no KV", False)],
                    quiet=[3, 4], tokens=[7, 8 | (1 << 31)], batch_digest=123, admitted=(5, 0xDEADBEEF),
                    commands=["reset_stats"], broken="")
    assert decode(encode(m)) == m
    idle = len(encode(StepMessage()))
    per_outcome = (len(encode(StepMessage(outcomes=[Outcome(i) for i in range(64)]))) - idle) / 64
    per_token = (len(encode(StepMessage(tokens=list(range(64))))) - idle) / 64
    per_abort = (len(encode(StepMessage(events=[Abort(i) for i in range(64)]))) - idle - 4 - 6) / 64
    assert per_outcome <= 32 and per_token <= 32 and per_abort <= 32 and idle <= 64


def test_a_step_of_many_long_ids_round_trips() -> None:
    """520 arrivals with 128-character ids in one step (66 KB of ids): the wire form's string
    lengths are 4 bytes (they were 2: such a step raised struct.error after its events were drained)."""
    reqs = [GenRequest(f"{i:04d}" + "a" * 124, 4, 1, 2, peer=PEER) for i in range(520)]
    m = StepMessage(events=[Submit(i, r) for i, r in enumerate(reqs)])
    assert decode(encode(m)) == m


def test_a_rank_of_an_older_build_breaks_the_group_with_a_cause_not_struct_error() -> None:
    """A step message shorter than this build's header (an older build's rank) is refused by
    version, and the group's cause names the rank (it was ``struct.error`` from deep in decode)."""
    import struct

    from orchestrator import TorchStepSync
    from orchestrator._step import GroupBroken

    old = encode(StepMessage())[:48]
    old = old[:4] + struct.pack("<H", 1) + old[6:]
    with pytest.raises(ValueError, match="version 1, 48 bytes.*not this build's"):
        decode(old)
    sync = TorchStepSync.__new__(TorchStepSync)  # its exchange without a process group: the slots as read
    sync.rank = 0
    sync.exchange_bytes = lambda data: [data, old]
    with pytest.raises(GroupBroken, match="rank 1's step message could not be read at rank 0: ValueError: step message version 1"):
        sync.agree(StepMessage())


async def test_a_step_whose_agreement_raises_fails_what_it_drained_and_ends_at_rest(make_group) -> None:
    """A step drains its inbox and its receive outcomes before the agreement; an agreement that
    raises anything (not only GroupBroken) breaks the engine, which fails them: none is lost."""
    g = await make_group(1)
    g.submit("first", prompt_len=4, max_tokens=50)
    for _ in range(3):
        await g.step()
    engine = g.engines[0]

    def broken(message: StepMessage) -> list[StepMessage]:
        raise ValueError("cannot encode this step")

    engine.agreement.agree = broken  # type: ignore[method-assign]
    g.submit("arriving", prompt_len=4, max_tokens=4)
    await g.step()
    assert engine.stopped and "cannot encode" in (engine.health() or "")
    for rid in ("first", "arriving"):
        assert g.final(rid).failure is not None
    await g.run_until_idle()


def test_per_request_memory_is_bounded_over_100k_requests() -> None:
    """100,000 requests through two in-process ranks: what stays allocated does not grow with them.
    The bound (1 MiB for the whole run after warm-up: the admission window, dict capacities) fails
    the pre-rewrite engine, whose admission log kept every id on every rank (~90 bytes a request a
    rank: ~18 MB here)."""
    g = Group(2, mode=Mode.IDEAL, num_blocks=1024, max_num_seqs=512)
    for step in g.steps:
        step.record = False  # the test's own record of every batch would grow with the run
    n, window = 100_000, 1024

    def run(count: int, start: int) -> None:
        submitted = done = 0
        while done < count:
            while submitted < count and submitted - done < window:
                g.submit(f"r{start + submitted}", max_tokens=2, prefill=False)
                submitted += 1
            LocalGroup.step_all(g.engines)
            done += sum(1 for o in g.lead.poll() if o.finished)

    run(4_000, 0)  # warm-up: caches, histograms, the admission window, dict capacities
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(n, 4_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert not any(e.rest_problems() for e in g.engines)
    assert grown < 1 << 20, f"{grown} bytes still allocated after {n} requests"


async def test_inline_blocking_waits_never_outlast_max_blocking_wait_s(harness_factory) -> None:
    """A rank blocked longer than its group's step timeout would look dead: the inline path's
    handshake (here a peer that takes 5 s to answer) gives up at ``max_blocking_wait_s``."""
    from tests.harness import make_config

    with pytest.raises(ValueError):
        make_config(mode=Mode.INLINE, max_blocking_wait_s=0.1)  # below the inline reserve timeout
    h = await harness_factory(make_config(mode=Mode.INLINE, max_blocking_wait_s=0.5, kv_transfer_timeout_ms=10_000),
                              connect_latency_s=5.0)
    h.submit("slow-peer")
    report = await anyio.to_thread.run_sync(h.engine.step)
    assert report.admitted == 1 and 0.4 <= report.blocked_s < 2.0, report
    h.engine.abort("slow-peer")
    await h.run_until_idle_off_loop()
