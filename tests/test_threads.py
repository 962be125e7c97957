"""The real two-thread arrangement: an event-loop thread and an execution thread."""

from __future__ import annotations

import time

from examples import embed
from orchestrator import EngineThreads, GenEngine, Mode, RequestState
from tests.harness import BLOCK, CheckingStep, CtxPeer, make_config
from transports.inproc import InProcTransport


def test_readme_embedding_example_runs() -> None:
    tokens = embed.main()
    assert tokens == {f"req-{i}": [101, 102, 103, 104] for i in range(4)}


def run_load(mode: Mode, n: int = 60) -> tuple[GenEngine, dict[str, RequestState], EngineThreads]:
    ctx = CtxPeer(num_blocks=512)
    transport = InProcTransport({"ctx": ctx.store}, bandwidth_bytes_per_s=5e6, latency_s=0.001)
    config = make_config(mode=mode, num_blocks=64, transfer_budget_bytes=6 * BLOCK, inline_reserve_timeout_s=0.02)
    engine = GenEngine(config, transport, CheckingStep({"ctx": ctx}))
    states: dict[str, RequestState] = {}
    threads = EngineThreads(engine)
    with threads:
        for i in range(n):
            rid = f"r{i}"
            ctx.prefill(rid, 1 + (i * 5) % 17)
            engine.submit(threads_request(rid, 1 + (i * 5) % 17, 2 + i % 7))
        deadline = time.monotonic() + 60
        while len(states) < n and time.monotonic() < deadline:
            for out in engine.poll():
                if out.finished:
                    states[out.request_id] = out.state
            time.sleep(0.005)
    return engine, states, threads


def threads_request(rid: str, prompt_len: int, max_tokens: int):
    from orchestrator import GenRequest

    return GenRequest(rid, prompt_len=prompt_len, first_token=1, max_tokens=max_tokens, peer="ctx")


def test_engine_threads_finish_a_load_and_come_to_rest() -> None:
    engine, states, threads = run_load(Mode.ORCHESTRATED)
    assert len(states) == 60 and set(states.values()) == {RequestState.FINISHED}
    assert engine.rest_problems() == []
    stats = threads.loop.statistics()
    assert stats.decode_iterations > 0
    assert stats.blocked_ms.max == 0.0  # orchestrated: no explicit blocking wait on the execution thread


def test_leaving_engine_threads_with_live_requests_aborts_them_and_comes_to_rest() -> None:
    """Left while one request decodes, one still receives and one waits: each gets a
    final output (before: only the receiving one did; the last step even admitted the waiting one
    into the stopped receive group) and the engine is at rest. Leaving is the node stopping, not a
    failure: they end ABORTED (FailureReason.ABORTED: "client cancel or the node is shutting down")."""
    from orchestrator import GenRequest

    ctx = CtxPeer(num_blocks=64)
    transport = InProcTransport({"ctx": ctx.store})
    transport.stall("stuck")
    step = CheckingStep({"ctx": ctx})
    engine = GenEngine(make_config(num_blocks=128, transfer_budget_bytes=2 * BLOCK), transport,
                       lambda batch: (time.sleep(0.01), step(batch))[1])
    outs = []
    with EngineThreads(engine):
        for rid, prompt_len, max_tokens in (("run", 4, 200), ("stuck", 4, 4), ("wait", 8, 4)):
            ctx.prefill(rid, prompt_len)
            engine.submit(GenRequest(rid, prompt_len=prompt_len, first_token=1, max_tokens=max_tokens, peer="ctx",
                                     kv_handle=ctx.handles[rid]))
        deadline = time.monotonic() + 5
        while not (engine.statistics().running and engine.statistics().receiving) and time.monotonic() < deadline:
            time.sleep(0.01)
        outs += engine.poll()
        s = engine.statistics()
        assert s.running == 1 and s.receiving == 1  # "wait" waits for budget (or is still in the inbox)
    outs += engine.poll()
    final = {o.request_id: o for o in outs if o.finished}
    assert set(final) == {"run", "stuck", "wait"}
    assert final["run"].state is RequestState.ABORTED and "threads exited" in final["run"].message  # not run on
    assert final["wait"].state is RequestState.ABORTED
    assert not engine.rest_problems()


def test_inline_mode_under_the_same_load_blocks_the_execution_thread() -> None:
    engine, states, threads = run_load(Mode.INLINE)
    assert len(states) == 60 and set(states.values()) == {RequestState.FINISHED}
    assert engine.rest_problems() == []
    assert threads.loop.statistics().blocked_ms.max > 0.0


def test_decode_loop_statistics_are_bounded_and_keep_the_newest() -> None:
    from orchestrator import DecodeLoop, StepReport

    loop = DecodeLoop(engine=None, history=8)  # type: ignore[arg-type]
    for i in range(20):  # 20 iterations into a ring of 8: only i = 12..19 remain
        loop._record(StepReport(batch_size=i % 2, admitted=1, deferred={}, orchestration_s=i / 1e3,
                                blocked_s=0.0, stalled_s=0.0, model_s=0.002))
    stats = loop.statistics()
    assert stats.iterations == 8 and stats.decode_iterations == 4
    assert stats.orchestration_ms.max == 19.0 and stats.mean_batch == 1.0
    assert loop._ring.nbytes == 5 * 8 * 8  # fixed, whatever the number of iterations
    loop.reset_statistics()
    assert loop.statistics().iterations == 0


def test_a_request_admitted_while_nothing_runs_decodes_without_waiting_out_the_idle_wait() -> None:
    """IDEAL mode admits a request straight to READY, after the step filled its decode slots: with
    nothing running, the loop slept its idle wait (here 2 s) before the next step started it. Each
    of three requests submitted one at a time to an idle engine now gets its first token at once."""
    from orchestrator import GenRequest

    engine = GenEngine(make_config(mode=Mode.IDEAL, num_blocks=64), None, lambda batch: batch.tokens + 1)
    with EngineThreads(engine, idle_wait_s=2.0):
        for i in range(3):
            started = time.monotonic()
            engine.submit(GenRequest(f"r{i}", prompt_len=4, first_token=1, max_tokens=2))
            done = None
            while done is None and time.monotonic() - started < 5:
                done = next((o for o in engine.poll() if o.finished), None)
                time.sleep(0.002)
            assert done is not None and done.state is RequestState.FINISHED
            assert time.monotonic() - started < 1.0, "the request waited out the idle wait"
    assert engine.rest_problems() == []
