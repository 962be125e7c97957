"""Rank-consistent admission and completion (invariant 11), without processes: N TPGenEngine ranks in
this process, each with its own receive group, budget, pool (its KV heads only) and transport,
pulling head slices of one CTX TP1 copy, stepped in lockstep with ``LocalGroup.step_all`` (the
gloo collective of a real group is exercised by tests/test_tp_two_node.py)."""

from __future__ import annotations

import anyio
import pytest

from orchestrator import (
    FailureReason,
    GenRequest,
    Mode,
    RequestState,
    Unavailable,
)
from tests.group_harness import PEER
from transports import KVLayout, PeerClosed

pytestmark = pytest.mark.anyio

@pytest.mark.parametrize("world", [2, 4])
async def test_every_rank_receives_its_head_slice_and_decodes_in_lockstep(make_group, world: int) -> None:
    g = await make_group(world)
    for i in range(6):
        g.submit(f"r{i}", prompt_len=5 + i, max_tokens=4)
    await g.run_until_idle()
    for i in range(6):
        assert g.final(f"r{i}").state is RequestState.FINISHED
    assert all(s.decoded == g.steps[0].decoded for s in g.steps)  # the same batches, in the same order
    assert g.ctx.store.statistics().held_requests == 0  # rank 0 released each copy once every rank had its slice
    assert sum(t.counters.releases for t in g.transports) == 6
    for e in g.engines[1:]:
        assert e.poll() == []  # only rank 0 speaks to clients


@pytest.mark.parametrize("differs", [{"num_blocks": 32}, {"max_num_seqs": 4}, {"transfer_budget_bytes": 1 << 20}])
async def test_ranks_with_other_settings_break_the_group_at_its_first_step_not_at_a_request(make_group, differs) -> None:
    g = await make_group(2, rank1=differs)  # e.g. a pool half the size on rank 1: the first request that fits
    await g.step()  # one rank and not the other broke the group then, failing every live request
    for e in g.engines:
        assert "rank 1 runs other settings than rank 0" in (e.health() or ""), e.health()
    with pytest.raises(Unavailable, match="other settings"):
        g.submit("r0")
    g.ctx.store.release("r0")  # prefilled by the harness before the refusal


async def test_a_request_decodes_only_when_every_rank_has_its_slice(make_group) -> None:
    g = await make_group(2)
    g.transports[1].latency_s = 0.2  # rank 1's pull is slow
    g.submit("slow")
    for _ in range(5):
        await g.step()
    assert all(e.statistics().receiving == 1 and e.num_running == 0 for e in g.engines)
    await g.run_until_idle()
    assert g.final("slow").state is RequestState.FINISHED


async def test_backpressure_admits_the_same_requests_in_the_same_order_on_every_rank(make_group) -> None:
    g = await make_group(4, transfer_budget_bytes=2 * KVLayout(2, 1, 4, 4).block_bytes)
    for t in g.transports:
        t.latency_s = 0.01
    g.transports[2].latency_s = 0.03  # one rank is slower: grants still come back at the same step
    for i in range(12):
        g.submit(f"r{i}", prompt_len=4 + (i % 3) * 4, max_tokens=2)
    await g.run_until_idle()
    logs = [e.admission_log for e in g.engines]
    assert len(logs[0]) == 12 and all(log == logs[0] for log in logs)
    assert all(e.statistics().deferral_episodes == g.lead.statistics().deferral_episodes for e in g.engines)
    assert g.lead.statistics().deferral_episodes[next(iter(g.lead.statistics().deferral_episodes))] >= 1


async def test_one_ranks_failure_fails_the_request_on_every_rank_and_ctx_is_told_once(make_group) -> None:
    g = await make_group(4)
    g.transports[2].fail("doomed", PeerClosed("rank 2 lost its peer"))
    g.transports[3].stall("doomed")  # rank 3's receive would never end by itself: it is cancelled
    g.submit("doomed")
    g.submit("fine")
    await g.run_until_idle()
    assert g.final("doomed").state is RequestState.FAILED and g.final("doomed").failure is FailureReason.PEER_ERROR
    assert g.final("fine").state is RequestState.FINISHED
    assert all(e.statistics().failed[FailureReason.PEER_ERROR] == 1 for e in g.engines)
    assert sum(t.counters.releases for t in g.transports) == 2  # one per request, by rank 0
    assert g.ctx.store.statistics().held_requests == 0


async def test_abort_while_receiving_ends_on_every_rank(make_group) -> None:
    g = await make_group(2)
    for t in g.transports:
        t.stall("stuck")
    g.submit("stuck")
    await g.step()
    await g.step()
    g.lead.abort("stuck")
    await g.run_until_idle()
    assert g.final("stuck").state is RequestState.ABORTED
    assert all(e.statistics().aborted == 1 for e in g.engines)


async def test_blocks_come_back_on_every_rank_at_the_same_step_after_a_late_landing(make_group) -> None:
    g = await make_group(2, num_blocks=3)
    g.transports[1].stall_landing("late")  # rank 1's receive outlives its cancellation
    g.transports[0].stall("late")
    g.submit("late", prompt_len=8, max_tokens=4)  # 3 blocks: the whole pool on each rank
    await g.step()
    g.lead.abort("late")
    for _ in range(4):
        await g.step()
    assert g.final("late").state is RequestState.ABORTED  # the client heard at once
    g.submit("next", prompt_len=4, max_tokens=2)
    for _ in range(4):
        await g.step()
    # neither rank reused the blocks: rank 1's may still be written, and rank 0 waits for it
    assert [e.pool.statistics().used_blocks for e in g.engines] == [3, 3]
    assert all(e.statistics().waiting == 1 for e in g.engines)
    g.transports[1].finish_landing("late")
    await g.run_until_idle()
    assert g.final("next").state is RequestState.FINISHED


async def test_only_rank_zero_takes_requests_and_explicit_slices_are_refused(make_group) -> None:
    from orchestrator import InvalidRequest
    from transports import KVSlice

    g = await make_group(2)
    with pytest.raises(InvalidRequest):
        g.engines[1].submit(GenRequest("x", prompt_len=4, first_token=1, max_tokens=2, peer=PEER))
    with pytest.raises(InvalidRequest):
        g.lead.submit(GenRequest("y", prompt_len=4, first_token=1, max_tokens=2, peer=PEER,
                                 kv_slice=KVSlice(0, 2, 0, 2)))


async def test_a_broken_group_fails_everything_locally_without_another_collective(make_group, monkeypatch) -> None:
    g = await make_group(2, breakable=True)
    for t in g.transports:
        t.stall("r")
    g.submit("r")
    await g.step()
    await g.step()
    cause = "GEN rank 1 stopped answering: no step exchange for 10 s"
    for e in g.engines:
        e.agreement.cause = cause
    handle = g.ctx.prefill("just-arrived", 8)  # taken from the inbox by the step whose collective fails
    g.lead.submit(GenRequest("just-arrived", prompt_len=8, first_token=7, max_tokens=2, peer=PEER, kv_handle=handle))
    g.lead.step()
    calls = g.lead.agreement.calls
    for out in g.lead.poll():
        g.outputs.setdefault(out.request_id, []).append(out)
    # at once, in the step that broke: every live request fails with the cause a person can read
    assert g.final("r").failure is FailureReason.INTERNAL and cause in g.final("r").message
    assert g.final("just-arrived").failure is FailureReason.INTERNAL  # never left hanging
    assert g.lead.health() == cause and g.lead.stopped
    await g.settle()
    # rank 0 told the CTX to free both at once: nothing waits for a lease
    assert g.ctx.store.statistics().held_requests == 0
    handle = g.ctx.prefill("later", 8)
    with monkeypatch.context() as m:  # a submit that passed the health check just before the break
        m.setattr(g.lead, "health", lambda: None)
        g.lead.submit(GenRequest("later", prompt_len=8, first_token=7, max_tokens=2, peer=PEER, kv_handle=handle))
    g.lead.step()
    assert any(o.request_id == "later" and o.failure is FailureReason.INTERNAL for o in g.lead.poll())
    with anyio.fail_after(5):
        while any(e.rest_problems() for e in g.engines):
            for e in g.engines:
                e.step()
            await anyio.sleep(0.001)
    assert g.lead.agreement.calls == calls  # no collective after the one that failed
    g.ctx.store.release("later")


async def test_a_group_that_breaks_as_a_rank_reports_ok_still_landing_keeps_those_blocks(make_group) -> None:
    # The step that breaks the group carries rank 0's "receive OK, but its transport still writes
    # into the blocks" outcome: the request fails with the rest, its blocks and budget stay
    # quarantined until that landing ends (before: freed at once, the write still in flight).
    g = await make_group(2, breakable=True)
    g.transports[0].land_late("x")
    g.transports[1].stall("x")
    g.submit("x")
    await g.step()
    rank0 = g.engines[0]
    for e in g.engines:
        e.agreement.cause = "GEN rank 1 stopped answering: no step exchange for 10 s"
    for e in g.engines:
        e.step()
    await g.settle()
    for e in g.engines:
        e.step()
    for out in g.lead.poll():
        g.outputs.setdefault(out.request_id, []).append(out)
    assert g.final("x").failure is FailureReason.INTERNAL
    assert rank0.statistics().quarantined_blocks > 0 and rank0.rest_problems()
    g.transports[0].finish_landing("x")
    with anyio.fail_after(5):
        while any(e.rest_problems() for e in g.engines):
            for e in g.engines:
                e.step()
            await anyio.sleep(0.001)


async def test_ideal_mode_admits_and_decodes_in_lockstep_without_receives(make_group) -> None:
    g = await make_group(4, mode=Mode.IDEAL, max_num_seqs=2)
    for step in g.steps:
        step.check = False
    for i in range(5):
        g.submit(f"r{i}", max_tokens=3)
    await g.run_until_idle()
    assert all(g.final(f"r{i}").state is RequestState.FINISHED for i in range(5))
    assert all(e.admission_log == g.lead.admission_log for e in g.engines) and len(g.lead.admission_log) == 5
    assert all(s.decoded == g.steps[0].decoded for s in g.steps) and max(map(len, g.steps[0].decoded)) == 2
    assert sum(t.counters.pulls for t in g.transports) == 0
    for i in range(5):  # an ideal GEN never pulls: the client frees the CTX's copy (the benchmark does)
        g.ctx.store.release(f"r{i}")


async def test_inline_mode_takes_decode_slots_and_keeps_the_ranks_consistent(make_group) -> None:
    g = await make_group(2, mode=Mode.INLINE, max_num_seqs=2)
    g.threaded = True
    g.transports[1].latency_s = 0.02  # one slow rank: the other waits for it in the step collective
    for i in range(6):
        g.submit(f"r{i}", max_tokens=3)
    peak = 0
    for _ in range(60):
        await g.step()
        for e in g.engines:  # a receive holds a decode slot, as on the original inline path
            st = e.statistics()
            peak = max(peak, st.receiving + st.ready + st.running)
        await anyio.sleep(0.005)
    assert peak == 2
    await g.run_until_idle()
    assert all(g.final(f"r{i}").state is RequestState.FINISHED for i in range(6))
    assert all(e.admission_log == g.lead.admission_log for e in g.engines) and len(g.lead.admission_log) == 6
    assert all(s.decoded == g.steps[0].decoded for s in g.steps)
    assert all(e.budget.statistics().available == e.budget.capacity for e in g.engines)
    assert g.ctx.store.statistics().held_requests == 0


async def test_a_broadcast_reaches_every_rank_at_the_same_step(make_group) -> None:
    g = await make_group(4)
    await g.step()
    g.lead.broadcast("reset_stats")
    g.lead.broadcast(["report_stats", 7])  # JSON-able: it crosses the step exchange
    await g.step()
    await g.step()
    assert all(c == [(1, "reset_stats"), (1, ["report_stats", 7])] for c in g.commands), g.commands
    from orchestrator import InvalidRequest

    with pytest.raises(InvalidRequest):
        g.engines[1].broadcast("x")
