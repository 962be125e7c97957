"""Findings of a second outside review of admission, against the public API (each test fails on the
code before its fix): bad input is refused at the call that takes it, at every TP size."""

from __future__ import annotations

import pytest

from orchestrator import DeferReason, GenRequest, InvalidRequest, KVSource, RequestState
from orchestrator._sampling import SamplingParams
from tests.group_harness import PEER


# -- 1. sampling parameters the step exchange cannot carry ------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(top_k=2.5), SamplingParams(temperature=True),
                                      SamplingParams(suppress=(1.5,)), {"temperature": 0.5}])
async def test_sampling_the_step_exchange_refuses_is_refused_at_submit_and_the_group_lives(
        make_group, world: int, sampling: object) -> None:
    # SamplingParams checks ranges, not types: a top_k of 2.5 reached the group's step, whose wire form
    # refused it, and the group broke: every live request failed INTERNAL, not only the bad one
    g = await make_group(world)
    g.submit("innocent", max_tokens=6)
    await g.step()
    with pytest.raises(InvalidRequest, match="sampling"):
        g.lead.submit(GenRequest("bad", prompt_len=8, first_token=7, max_tokens=4, peer=PEER,
                                 kv_handle=g.ctx.prefill("bad", 8), sampling=sampling))  # type: ignore[arg-type]
    g.lead.submit(GenRequest("good", prompt_len=8, first_token=7, max_tokens=4, peer=PEER,
                             kv_handle=g.ctx.prefill("good", 8), sampling=SamplingParams(temperature=0.7, seed=3)))
    await g.run_until_idle()
    assert g.lead.health() is None
    assert g.final("innocent").state is RequestState.FINISHED and g.final("good").state is RequestState.FINISHED
    g.ctx.store.release("bad", handle=g.ctx.handles["bad"])  # (never submitted: its CTX copy goes here)


# -- 2. a peer that is not a str ---------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["peer", "kv_sources"])
async def test_a_peer_that_is_not_a_str_is_refused_at_submit_and_the_group_lives(make_group, world: int,
                                                                                  where: str) -> None:
    # a peer of 123 was accepted: a lone GEN failed it at the pull, but a group's step, which carries
    # the peers as text, could not be encoded and the group broke (every live request failed INTERNAL)
    g = await make_group(world)
    g.submit("innocent", max_tokens=6)
    await g.step()
    where_kw = {"peer": 123} if where == "peer" else {"peer": None, "kv_sources": (KVSource(123),)}  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="peer"):
        g.lead.submit(GenRequest("bad", prompt_len=8, first_token=7, max_tokens=4, kv_handle=g.ctx.prefill("bad", 8),
                                 **where_kw))  # type: ignore[arg-type]
    await g.run_until_idle()
    assert g.lead.health() is None and g.final("innocent").state is RequestState.FINISHED
    g.ctx.store.release("bad", handle=g.ctx.handles["bad"])


# -- 3. fields of the wrong type are an InvalidRequest, not whatever the first use of them raised -----
@pytest.mark.parametrize("fields", [
    {"kv_slice": (0, 1, 0, 1)},  # was AttributeError: 'tuple' object has no attribute 'layer_start'
    {"peer": None, "kv_sources": "ctx-0"},  # was AttributeError: 'str' object has no attribute 'kv_handle'
    {"peer": None, "kv_sources": (("ctx-0", 0, None),)},
    {"peer": None, "kv_sources": (KVSource("ctx-0", 0, "4"),)},  # was TypeError: '<=' between str and int
], ids=["kv_slice", "sources_str", "sources_tuples", "source_head_end_str"])
async def test_request_fields_of_the_wrong_type_are_an_invalid_request(harness_factory, fields: dict) -> None:
    h = await harness_factory()
    h.submit("before", max_tokens=3)
    with pytest.raises(InvalidRequest, match="(?i)kv.s"):
        h.engine.submit(h.request("bad", prefill=False, **fields))
    await h.run_until_idle()
    assert h.engine.health() is None and h.final("before").state is RequestState.FINISHED


# -- 4. a submit that races the node's shutdown --------------------------------------------------------
def test_a_submit_that_passed_its_health_check_as_the_threads_exited_is_refused_not_lost(monkeypatch) -> None:
    # submit read health() (None), then validated while EngineThreads' exit stopped the engine and
    # stepped it to rest; the request was then queued and held live in an engine nobody steps any
    # more: accepted, yet never answered
    import orchestrator._engine as engine_module
    from orchestrator import EngineThreads, GenEngine, Unavailable
    from tests.harness import CheckingStep, CtxPeer, make_config
    from transports.inproc import InProcTransport

    ctx = CtxPeer()
    engine = GenEngine(make_config(), InProcTransport({"ctx-0": ctx.store}), CheckingStep({"ctx-0": ctx}))
    threads = EngineThreads(engine)
    threads.__enter__()
    validate = engine_module.validate_request

    def validate_while_the_threads_exit(*args, **kw):  # noqa: ANN002, ANN003
        threads.__exit__(None, None, None)
        return validate(*args, **kw)

    monkeypatch.setattr(engine_module, "validate_request", validate_while_the_threads_exit)
    with pytest.raises(Unavailable, match="threads exited"):
        engine.submit(GenRequest("late", prompt_len=8, first_token=7, max_tokens=3, peer="ctx-0",
                                 kv_handle=ctx.prefill("late", 8)))
    assert engine.live_requests == 0 and not engine.rest_problems()
    ctx.store.release("late", handle=ctx.handles["late"])


# -- 5. submit of something that is not a GenRequest -------------------------------------------------
async def test_submit_of_what_is_not_a_gen_request_is_a_type_error_and_nothing_stays_live(harness_factory) -> None:
    # a look-alike (every field, and sources()) passed validation, was queued, and the step dropped
    # it (``inbox_item_dropped``): no output ever, its id live for good, the engine never at rest;
    # None or a dict left submit as an AttributeError
    import dataclasses
    import types

    h = await harness_factory()
    real = h.request("real")
    look_alike = types.SimpleNamespace(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)},
                                       sources=real.sources)
    for bad in (look_alike, None, {"request_id": "real"}):
        with pytest.raises(TypeError, match="GenRequest"):
            h.engine.submit(bad)  # type: ignore[arg-type]
    assert h.engine.live_requests == 0
    h.engine.submit(real)
    await h.run_until_idle()
    assert h.final("real").state is RequestState.FINISHED


# -- 6. EngineThreads' exit tells the CTX to free what it aborts ----------------------------------------
def test_engine_threads_exit_frees_the_ctx_copy_of_every_request_it_aborts() -> None:
    # the exit closed the receive group before it stopped the engine: the stop's releases of the
    # requests still waiting (the group was gone) were dropped, and each CTX held their KV until
    # its lease ran out (30 s by default), for every restart of an embedding engine
    import time

    from orchestrator import EngineThreads, GenEngine
    from tests.harness import BLOCK, CheckingStep, CtxPeer, make_config
    from transports.inproc import InProcTransport

    ctx = CtxPeer()
    transport = InProcTransport({"ctx": ctx.store})
    engine = GenEngine(make_config(transfer_budget_bytes=2 * BLOCK), transport, CheckingStep({"ctx": ctx}))
    transport.stall("stuck")
    rids = ("stuck", "waiting-0", "waiting-1")
    with EngineThreads(engine):
        for rid in rids:  # 2 blocks each: the stalled one holds the whole budget, the others wait
            engine.submit(GenRequest(rid, prompt_len=8, first_token=7, max_tokens=3, peer="ctx",
                                     kv_handle=ctx.prefill(rid, 8)))
        deadline = time.monotonic() + 10
        while engine.statistics().deferral_episodes[DeferReason.BACKPRESSURE] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
    finals = {o.request_id: o.state for o in engine.poll() if o.finished}
    assert finals == {rid: RequestState.ABORTED for rid in rids}
    assert engine.rest_problems() == []
    assert [rid for rid in rids if ctx.store.holds(rid)] == []


# -- 7. a receive the closing group cancels still frees the CTX copy --------------------------------
async def test_a_receive_cancelled_by_the_group_closing_frees_its_ctx_copy(harness_factory) -> None:
    # a receive ended by an abort or a timeout tells its CTX to free the KV; one the closing group
    # cancelled ended ABORTED ("shutting down") but skipped that release (the cancellation went on past
    # it), so the CTX held the KV until its lease ran out
    h = await harness_factory()
    h.transport.stall("stuck")
    h.submit("stuck")
    await h.step()
    assert h.engine.statistics().receiving == 1
    h.engine.close()
    await h.settle()
    await h.step()
    assert h.final("stuck").state is RequestState.ABORTED
    assert not h.peer.store.holds("stuck")
