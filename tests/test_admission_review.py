"""Findings of an outside review of the admission code, one test each (each fails on the code before
its fix): bad input at the call that takes it, never an engine that dies in a later step."""

from __future__ import annotations

import asyncio
import math
import time

import anyio
import pytest
import structlog

from orchestrator import (EngineThreads, FailureReason, GenEngine, GenRequest, InvalidRequest, Mode,
                          OrchestratorConfig, RequestState)
from tests.harness import BLOCK, LAYOUT, CheckingStep, CtxPeer, make_config
from transports.inproc import InProcTransport


# -- 1. abort() of a non-str id ------------------------------------------------------------------
async def test_abort_of_a_non_str_id_is_refused_at_the_call_and_the_engine_lives(harness_factory) -> None:
    h = await harness_factory()
    h.submit("running", max_tokens=6)
    await h.step()
    await h.step()
    h.submit("queued")  # drained in the same step as the bad abort would have been
    for bad in (42, None, b"running", ("running",)):
        with pytest.raises(TypeError, match="request id"):
            h.engine.abort(bad)  # type: ignore[arg-type]
    await h.run_until_idle()
    assert h.engine.health() is None
    assert h.final("running").state is RequestState.FINISHED and h.final("queued").state is RequestState.FINISHED


async def test_an_inbox_item_that_is_neither_id_nor_request_is_dropped_alone(harness_factory) -> None:
    h = await harness_factory()
    h.engine._inbox.put(3.5)  # what abort() lets through no more: the rest of the batch must not be lost
    h.submit("after")
    await h.run_until_idle()
    assert h.engine.health() is None and h.final("after").state is RequestState.FINISHED


# -- 2. submit checks field types and ranges -------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("prompt_len", 8.0), ("prompt_len", True), ("max_tokens", 4.0), ("max_tokens", "4"),
    ("first_token", None), ("first_token", 2**63), ("first_token", -5), ("first_token", 2**31), ("first_token", 1.0),
    ("eos_token", 2**64), ("eos_token", -1), ("eos_token", 2**31), ("eos_token", 3.0),
])
async def test_wrongly_typed_or_out_of_range_request_fields_are_refused_at_submit(harness_factory, field: str,
                                                                                  value: object) -> None:
    h = await harness_factory()
    req = h.request("bad", prefill=False)
    import dataclasses

    with pytest.raises(InvalidRequest, match=field):
        h.engine.submit(dataclasses.replace(req, **{field: value}))
    h.submit("good", eos_token=2**31 - 1)  # the largest token id is still one
    await h.run_until_idle()
    assert h.engine.health() is None and h.final("good").state is RequestState.FINISHED
    assert h.engine.live_requests == 0


def _second_allocation_raises(monkeypatch, pool, exc: Exception):  # noqa: ANN001, ANN202
    """``pool.allocate`` raises ``exc`` at its second call this step; returns the real one."""
    allocate, calls = pool.allocate, []

    def second_raises(n):  # noqa: ANN001, ANN202
        calls.append(n)
        if len(calls) == 2:
            raise exc
        return allocate(n)

    monkeypatch.setattr(pool, "allocate", second_raises)
    return allocate


def test_a_grant_taken_for_a_request_whose_allocation_raises_is_given_back(monkeypatch) -> None:
    # defence in depth: prompt_len=8.0 reached pool.allocate (TypeError) after the budget was taken;
    # the grant was never attached to the request, so never released
    from orchestrator import KVBlockPool, TransferBudget
    from orchestrator._requests import Sequence
    from orchestrator._scheduler import Scheduler

    config = make_config(num_blocks=16)
    budget, pool = TransferBudget(config.transfer_budget_bytes), KVBlockPool(LAYOUT, 16)
    sched = Scheduler(config, budget, pool)
    for rid in ("ok", "bad"):
        sched.add(Sequence(request=GenRequest(rid, 8, 1, 1, peer="p"), arrival=0.0, num_blocks=2,
                           num_prompt_blocks=2, cost=2 * BLOCK))
    allocate = _second_allocation_raises(monkeypatch, pool, TypeError("'float' object cannot be interpreted as an integer"))
    with pytest.raises(TypeError):
        sched.schedule(active=0)
    assert budget.statistics().in_use == 0 and pool.statistics().used_blocks == 0
    assert sorted(s.request_id for s in sched.waiting) == ["bad", "ok"]
    monkeypatch.setattr(pool, "allocate", allocate)
    assert [a.seq.request_id for a in sched.schedule(active=0).admitted] == ["ok", "bad"]  # FCFS kept


# -- 3. and 4. OrchestratorConfig checks every knob ---------------------------------------------------
@pytest.mark.parametrize("knob, value", [
    ("num_blocks", "64"), ("num_blocks", 64.0), ("num_blocks", math.nan), ("num_blocks", True),
    ("transfer_budget_bytes", math.nan), ("transfer_budget_bytes", 1e4),
    ("max_num_seqs", math.nan), ("max_num_seqs", 8.5), ("max_num_seqs", 0),
    ("max_prefetch_seqs", math.nan), ("max_prefetch_seqs", 2.0),
    ("max_model_len", 0), ("max_model_len", -5), ("max_model_len", 1), ("max_model_len", 2**31), ("max_model_len", 64.0),
    ("kv_transfer_timeout_ms", math.nan), ("kv_transfer_timeout_ms", math.inf), ("kv_transfer_timeout_ms", 0),
    ("kv_hold_interval_s", math.nan), ("kv_hold_interval_s", -1.0), ("kv_hold_interval_s", "10"),
    ("inline_reserve_timeout_s", -1.0), ("inline_reserve_timeout_s", math.nan),
    ("max_blocking_wait_s", math.nan), ("max_blocking_wait_s", -1.0),
    ("kv_head_offset", -1), ("kv_head_offset", 0.0),
    ("mode", "fast"), ("mode", 1), ("mode", None),
])
def test_config_refuses_nan_wrong_types_and_out_of_range_knobs_naming_them(knob: str, value: object) -> None:
    with pytest.raises(ValueError, match=knob):
        make_config(**{knob: value})


def test_config_keeps_meaningful_values() -> None:
    cfg = make_config(max_model_len=2, kv_transfer_timeout_ms=2.5, inline_reserve_timeout_s=0, kv_hold_interval_s=1)
    assert cfg.max_model_len == 2 and cfg.inline_reserve_timeout_s == 0


@pytest.mark.parametrize("name", ["orchestrated", "inline", "ideal"])
def test_a_mode_given_by_name_is_that_mode(name: str) -> None:
    cfg = make_config(mode=name)
    assert cfg.mode is Mode(name) and cfg == make_config(mode=Mode(name))


async def test_a_mode_given_as_a_string_takes_the_budget_before_kv(harness_factory) -> None:
    # "orchestrated" as a str used to select the inline path (`mode is Mode.ORCHESTRATED` was False):
    # no early budget (invariant 1), the execution thread blocked on reserves (invariant 3)
    h = await harness_factory(make_config(mode="orchestrated", transfer_budget_bytes=2 * BLOCK))
    h.transport.stall("a")
    h.submit("a")
    h.submit("b")
    await h.step()
    s = h.engine.statistics()
    assert s.receiving == 1 and s.waiting == 1 and s.budget.in_use == 2 * BLOCK
    h.engine.abort("a")
    h.engine.abort("b")
    await h.run_until_idle()


# -- 5. a transport's stray cancellation fails its receive alone -------------------------------------
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_cancellation_the_receive_did_not_cause_fails_that_receive_alone(harness_factory) -> None:
    h = await harness_factory()
    pull = h.transport.pull

    async def cancelled_by_its_connection_layer(peer, request_id, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        if request_id == "victim":
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.cancel)  # e.g. a connection torn down under it
            await fut
        return await pull(peer, request_id, *a, **kw)

    h.transport.pull = cancelled_by_its_connection_layer  # type: ignore[method-assign]
    h.submit("running", max_tokens=8)
    await h.step()
    h.submit("victim")
    h.submit("other")
    with anyio.fail_after(10):
        await h.run_until_idle()
    assert h.engine.health() is None and h.engine.receiver.failure is None
    victim = h.final("victim")
    assert victim.state is RequestState.FAILED and victim.failure is FailureReason.PEER_ERROR
    assert "cancelled by something other than this receive" in victim.message
    assert h.final("running").state is RequestState.FINISHED and h.final("other").state is RequestState.FINISHED


async def test_real_cancellations_still_abort_and_time_out(harness_factory) -> None:
    h = await harness_factory(make_config(kv_transfer_timeout_ms=100))
    h.transport.stall("aborted")
    h.transport.stall("timed-out")
    h.submit("aborted")
    h.submit("timed-out")
    await h.step()
    h.engine.abort("aborted")
    with anyio.fail_after(10):
        await h.run_until_idle()
    assert h.final("aborted").failure is FailureReason.ABORTED
    assert h.final("timed-out").failure is FailureReason.TIMEOUT


# -- 6. KV blocks: the last sampled token never gets KV --------------------------------------------
async def test_a_request_holds_the_blocks_its_decode_writes_and_no_more(harness_factory) -> None:
    # block size 4: prompt 8 + 5 outputs writes KV at positions 0..11 (the last output is only
    # sampled): 3 blocks, not blocks_for(13) = 4
    h = await harness_factory(make_config(num_blocks=3, max_model_len=16))
    h.submit("exact", prompt_len=8, max_tokens=5)  # refused before: "needs 4 KV blocks, the pool has 3"
    h.transport.stall("exact")
    await h.step()
    assert h.engine.statistics().pool.used_blocks == 3
    h.engine.abort("exact")
    await h.run_until_idle()
    h.submit("decodes", prompt_len=8, max_tokens=5)
    await h.run_until_idle()
    assert h.tokens("decodes") == [8, 9, 10, 11] and h.final("decodes").state is RequestState.FINISHED


# -- 8. a graceful stop aborts, it does not fail ----------------------------------------------------
def test_engine_threads_exit_aborts_live_requests_and_logs_a_stop() -> None:
    ctx = CtxPeer(num_blocks=64)
    transport = InProcTransport({"ctx": ctx.store})
    engine = GenEngine(make_config(), transport, CheckingStep({"ctx": ctx}))
    transport.stall("stuck")
    ctx.prefill("stuck", 8)
    with structlog.testing.capture_logs() as logs:
        with EngineThreads(engine):
            engine.submit(GenRequest("stuck", prompt_len=8, first_token=1, max_tokens=4, peer="ctx",
                                     kv_handle=ctx.handles["stuck"]))
            deadline = time.monotonic() + 10
            while engine.statistics().receiving == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
    (out,) = [o for o in engine.poll() if o.finished]
    assert out.state is RequestState.ABORTED and out.failure is FailureReason.ABORTED, out
    assert "stopping" in out.message
    assert [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("engine_")] == [("engine_stopped", "info")]
    assert engine.rest_problems() == []


def test_a_stop_from_another_thread_between_a_step_s_reads_is_still_a_stop() -> None:
    """stop() sets its flag, then its reason; a step that read the flag (not yet set) and then the
    reason (set) took the stop for a failure: engine_broken at error, live requests FAILED."""
    ctx = CtxPeer(num_blocks=64)
    engine = GenEngine(make_config(), InProcTransport({"ctx": ctx.store}), CheckingStep({"ctx": ctx}))
    ctx.prefill("r", 8)
    engine.submit(GenRequest("r", prompt_len=8, first_token=1, max_tokens=4, peer="ctx", kv_handle=ctx.handles["r"]))
    real = engine.health
    calls = [0]

    def health() -> str | None:  # as if another thread's stop() ran right after the step's first read
        calls[0] += 1
        if calls[0] == 1:
            engine.health = real  # type: ignore[method-assign]
            engine.stop("node stopping")
        return real()

    engine.health = health  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        engine.step()
    (out,) = [o for o in engine.poll() if o.finished]
    assert out.state is RequestState.ABORTED and engine.stopped_gracefully, out
    assert [e["event"] for e in logs if e["event"].startswith("engine_")] == ["engine_stopped"]


def test_a_step_whose_allocation_raises_puts_its_admissions_back_where_they_arrived(monkeypatch) -> None:
    """They went back to the very front, ahead of a KV misfit that had arrived before them (which
    they would then overtake once it fit): a review of the scheduler's rewrite."""
    from orchestrator import KVBlockPool, TransferBudget
    from orchestrator._requests import Sequence
    from orchestrator._scheduler import Scheduler

    config = make_config(num_blocks=8)
    budget, pool = TransferBudget(config.transfer_budget_bytes), KVBlockPool(LAYOUT, 8)
    sched = Scheduler(config, budget, pool)
    for rid, need in (("m1", 20), ("a", 2), ("b", 2)):
        sched.add(Sequence(request=GenRequest(rid, 8, 1, 1, peer="p"), arrival=0.0, num_blocks=need,
                           num_prompt_blocks=2, cost=BLOCK))
    allocate = _second_allocation_raises(monkeypatch, pool, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        sched.schedule(active=0)
    assert [q.request_id for q in sched.waiting] == ["m1", "a", "b"]
    assert budget.statistics().in_use == 0 and pool.statistics().used_blocks == 0
    monkeypatch.setattr(pool, "allocate", allocate)
    assert [a.seq.request_id for a in sched.schedule(active=0).admitted] == ["a", "b"]  # m1 still does not fit


# -- 9. an id still quarantined is refused with why ---------------------------------------------------
async def test_an_id_whose_receive_is_still_ending_is_refused_saying_so(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=8))
    h.transport.stall_landing("late")
    h.submit("late")
    await h.step()
    h.engine.abort("late")
    await h.step()
    await h.step()
    assert h.final("late").state is RequestState.ABORTED and h.engine.statistics().quarantined_blocks
    with pytest.raises(InvalidRequest, match="still has a receive ending.*retry later"):
        h.engine.submit(h.request("late", prefill=False))
    h.submit("live")
    with pytest.raises(InvalidRequest, match="already live"):
        h.engine.submit(h.request("live", prefill=False))
    h.transport.finish_landing("late")
    await h.run_until_idle()


# -- a request without the KV handle its transport needs ------------------------------------------
async def test_a_request_without_the_handle_its_transport_needs_is_refused_at_submit(harness_factory,
                                                                                     monkeypatch) -> None:
    """The README's embedding snippet (UCX, no kv_handle) was accepted by submit, took budget and
    blocks, and failed at the pull as a protocol error (an outside run of the README): a transport
    that pulls only with the CTX's handle says so (``requires_handle``) and submit refuses it."""
    import dataclasses

    from transports.nixl import NIXLTransport
    from transports.ucx import UCXTransport

    assert UCXTransport.requires_handle and NIXLTransport.requires_handle and not InProcTransport.requires_handle
    monkeypatch.setattr(InProcTransport, "requires_handle", True)
    h = await harness_factory()
    bare = h.request("bare", prefill=False)
    assert bare.kv_handle is None
    with pytest.raises(InvalidRequest, match="kv_handle is required .* none for 'ctx-0'"):
        h.engine.submit(bare)
    h.submit("named")
    await h.run_until_idle()
    assert h.final("named").state is RequestState.FINISHED and h.engine.live_requests == 0


# -- one CTX peer named twice in kv_sources -----------------------------------------------------------
@pytest.mark.parametrize("sources", [((0, 1), (0, None)), ((0, 1), (1, 2))])
async def test_a_peer_named_twice_in_kv_sources_is_refused_at_submit(harness_factory, sources) -> None:
    """One peer named twice (an outside review of the engine's API): with its parts pulled in turn,
    the first part's release freed the CTX's copy and the second failed UNKNOWN_REQUEST (with a
    larger budget they ran together and it worked: success depending on the budget); named with
    two head numberings, the second part read other heads than it said and decoded wrong KV with no
    error. One source per peer, refused at submit."""
    from orchestrator import KVSource

    h = await harness_factory()
    req = h.request("twice", prefill=False)
    import dataclasses

    twice = dataclasses.replace(req, peer=None, kv_sources=tuple(KVSource(req.peer, a, b) for a, b in sources))
    with pytest.raises(InvalidRequest, match="named more than once"):
        h.engine.submit(twice)
    h.submit("once")
    await h.run_until_idle()
    assert h.final("once").state is RequestState.FINISHED and h.engine.live_requests == 0
