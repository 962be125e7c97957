"""The engine end to end: receive group on the test's event loop, in-process CTX peers.

Every test ends with the at-rest check of the ``harness_factory`` fixture: budget full, nothing in
flight, no request live, every KV block free. The step function verifies that each decoded
request's KV equals what CTX computed.
"""

from __future__ import annotations

import anyio
import pytest
import structlog

from orchestrator import DeferReason, FailureReason, InvalidRequest, KVSlice, Mode, RequestState
from transports import PeerClosed, ProtocolViolation
from tests.harness import BLOCK, LAYOUT, PEER, make_config

pytestmark = pytest.mark.anyio


async def test_requests_receive_then_decode_exact_kv(harness_factory) -> None:
    h = await harness_factory()
    for i in range(5):
        h.submit(f"r{i}", prompt_len=5 + i, max_tokens=4)
    await h.run_until_idle()
    for i in range(5):
        assert h.final(f"r{i}").state is RequestState.FINISHED
        assert h.tokens(f"r{i}") == [8, 9, 10]  # first token 7 came from CTX
    assert h.peer.store.statistics().held_requests == 0  # CTX freed each copy after the pull


async def test_a_request_ends_at_its_eos_token_or_its_max_tokens(harness_factory) -> None:
    h = await harness_factory()
    h.submit("eos", max_tokens=16, eos_token=10)
    h.submit("no-eos", max_tokens=6)
    await h.run_until_idle()
    assert h.final("eos").state is RequestState.FINISHED and h.final("no-eos").state is RequestState.FINISHED
    assert h.tokens("eos") == [8, 9, 10]  # 10 is the EOS: it is emitted, and nothing after it
    assert h.tokens("no-eos") == [8, 9, 10, 11, 12]  # 7 from the CTX and 5 more: 6 tokens


async def test_decode_continues_while_receives_are_slow_or_deferred(harness_factory) -> None:
    h = await harness_factory(make_config(transfer_budget_bytes=2 * BLOCK))
    h.submit("running", prompt_len=4, max_tokens=30)
    await h.step()  # admitted, received
    await h.step()
    assert h.engine.num_running == 1
    h.transport.stall("slow")
    h.submit("slow", prompt_len=8, max_tokens=2)  # takes the whole budget and never completes
    h.submit("deferred", prompt_len=4, max_tokens=2)  # denied by the budget
    for _ in range(10):
        report = await h.step()
        assert report.batch_size == 1  # the running request decodes every single step
        assert report.blocked_s == 0.0
    assert h.engine.statistics().deferral_episodes[DeferReason.BACKPRESSURE] == 1
    # 11 decodes; the last one's token is emitted once the group agreed it, at the next step
    assert len(h.tokens("running")) == 10
    h.engine.abort("slow")
    await h.run_until_idle()
    assert h.final("running").state is RequestState.FINISHED
    assert h.final("deferred").state is RequestState.FINISHED
    assert h.final("slow").state is RequestState.ABORTED


async def test_decode_step_does_no_receive_io(harness_factory) -> None:
    h = await harness_factory()
    h.submit("a", max_tokens=5)
    await h.step()
    pulls_before = h.transport.counters.pulls
    h.transport.stall("b")
    h.submit("b")
    h.engine.step()  # admits "b" and decodes "a", without yielding to the event loop
    assert h.transport.counters.pulls == pulls_before
    assert h.transport.counters.in_flight == 0  # the receive only starts on the event loop
    await h.settle()
    assert h.transport.counters.in_flight == 1
    h.engine.abort("b")
    await h.run_until_idle()


async def test_failed_receive_fails_alone_and_releases_everything(harness_factory) -> None:
    h = await harness_factory()
    h.transport.fail("bad", PeerClosed("connection reset by peer", peer="ctx-0", bytes_moved=128))
    for rid in ("a", "bad", "b"):
        h.submit(rid)
    with structlog.testing.capture_logs() as logs:
        await h.run_until_idle()
    bad = h.final("bad")
    assert bad.state is RequestState.FAILED and bad.failure is FailureReason.PEER_ERROR
    assert h.final("a").state is h.final("b").state is RequestState.FINISHED
    failed = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert len(failed) == 1  # one structured event per failure
    assert failed[0]["event"] == "receive_failed"
    assert failed[0]["request_id"] == "bad" and failed[0]["peer"] == "ctx-0"
    assert failed[0]["reason"] == "peer_error" and failed[0]["bytes_moved"] == 128


async def test_protocol_error_is_reported_as_such(harness_factory) -> None:
    h = await harness_factory()
    h.transport.fail("x", ProtocolViolation("bad header", peer="ctx-0"))
    h.submit("x")
    await h.run_until_idle()
    assert h.final("x").failure is FailureReason.PROTOCOL_ERROR


async def test_timeout_fails_the_request_within_kv_transfer_timeout(harness_factory) -> None:
    h = await harness_factory(make_config(kv_transfer_timeout_ms=100))
    h.transport.stall("stuck")
    h.submit("stuck")
    h.submit("fine")
    start = anyio.current_time()
    await h.run_until_idle(timeout=5)
    assert anyio.current_time() - start < 2.0
    stuck = h.final("stuck")
    assert stuck.state is RequestState.FAILED and stuck.failure is FailureReason.TIMEOUT
    assert h.final("fine").state is RequestState.FINISHED
    assert h.peer.store.statistics().held_requests == 0  # the CTX was told to release


async def test_a_transports_own_timeout_fails_the_request_as_a_timeout(harness_factory) -> None:
    """A pull that raises TimeoutError (a transport's own bound, e.g. ``fail_after``) is a TIMEOUT,
    as the receive's deadline is, not an internal error."""
    h = await harness_factory()
    h.transport.fail("x", TimeoutError("no answer"))
    h.submit("x")
    await h.run_until_idle()
    assert h.final("x").state is RequestState.FAILED and h.final("x").failure is FailureReason.TIMEOUT


async def test_abort_while_waiting_receiving_and_running(harness_factory) -> None:
    h = await harness_factory(make_config(transfer_budget_bytes=2 * BLOCK))
    h.submit("running", prompt_len=1, max_tokens=100)
    await h.step()
    await h.step()
    assert h.engine.num_running == 1
    h.transport.stall("receiving")
    h.submit("receiving", prompt_len=8)  # holds the whole budget
    h.submit("waiting", prompt_len=4)  # deferred for backpressure
    await h.step()
    stats = h.engine.statistics()
    assert (stats.running, stats.receiving, stats.waiting) == (1, 1, 1)
    h.engine.abort("waiting")
    h.engine.abort("receiving")
    await h.step()
    await h.step()
    assert h.final("waiting").state is RequestState.ABORTED
    assert h.final("receiving").state is RequestState.ABORTED
    assert h.engine.num_running == 1
    # CTX was told about both aborts (in flight, and waiting for admission) and freed both copies
    assert h.transport.counters.releases == 2
    assert h.peer.store.statistics().held_requests == 0
    h.engine.abort("running")
    await h.run_until_idle()
    assert h.final("running").state is RequestState.ABORTED


async def test_abort_of_unknown_or_finished_request_is_ignored(harness_factory) -> None:
    h = await harness_factory()
    h.submit("a", max_tokens=2)
    await h.run_until_idle()
    h.engine.abort("a")
    h.engine.abort("never-seen")
    await h.step()
    assert h.final("a").state is RequestState.FINISHED


async def test_oversized_request_progresses_in_chunks_within_the_budget(harness_factory) -> None:
    h = await harness_factory(make_config(transfer_budget_bytes=4 * BLOCK))
    h.submit("small", prompt_len=4)
    h.submit("huge", prompt_len=10 * LAYOUT.block_size)  # 10 blocks of KV, budget holds 4
    h.submit("after", prompt_len=4)
    await h.run_until_idle()
    for rid in ("small", "huge", "after"):
        assert h.final(rid).state is RequestState.FINISHED
    stats = h.engine.statistics()
    assert stats.budget.oversized_grants == 1
    assert stats.peak_staging_bytes <= 4 * BLOCK  # chunked: staging never exceeds the budget


async def test_layer_and_head_slice_is_pulled_and_scattered(harness_factory) -> None:
    h = await harness_factory()
    h.submit("sliced", prompt_len=8, kv_slice=KVSlice(1, 2, 0, 1))
    await h.run_until_idle()  # the checking step compares the pulled layer/head range
    assert h.final("sliced").state is RequestState.FINISHED
    assert h.transport.counters.bytes_moved == LAYOUT.wire_bytes(2, KVSlice(1, 2, 0, 1))


async def test_backpressure_and_kv_exhaustion_counted_apart_end_to_end(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=8, transfer_budget_bytes=2 * BLOCK))
    h.transport.stall("a")
    h.submit("a", prompt_len=8, max_tokens=1)  # 2 blocks of KV, the whole budget
    h.submit("b", prompt_len=4, max_tokens=1)  # fits KV, denied by budget
    h.submit("c", prompt_len=20, max_tokens=4)  # 6 blocks: KV exhausted while "a" holds 2 and "b"...
    await h.step()
    stats = h.engine.statistics()
    assert stats.deferral_episodes[DeferReason.BACKPRESSURE] >= 1
    h.engine.abort("a")
    await h.run_until_idle()
    assert h.final("b").state is RequestState.FINISHED and h.final("c").state is RequestState.FINISHED


async def test_invalid_requests_are_rejected_at_submit_with_nothing_queued(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=8, max_model_len=64))
    bad = [
        dict(rid="", prompt_len=4),
        dict(rid="x" * 300, prompt_len=4),
        dict(rid="zero", prompt_len=0),
        dict(rid="toolong", prompt_len=60, max_tokens=10),
        dict(rid="toobig", prompt_len=40, max_tokens=1),  # 10 blocks, pool has 8
        dict(rid="badslice", prompt_len=4, kv_slice=KVSlice(0, 5, 0, 1)),
        dict(rid="nopeer", prompt_len=4, peer=""),
    ]
    for kw in bad:
        rid = kw.pop("rid")
        with pytest.raises(InvalidRequest):
            h.engine.submit(h.request(rid, prefill=False, **kw))
    h.submit("dup")
    with pytest.raises(InvalidRequest):
        h.engine.submit(h.request("dup", prefill=False))
    await h.run_until_idle()
    assert h.engine.statistics().finished == 1


async def test_local_kv_of_the_wrong_shape_or_dtype_is_rejected_at_submit(harness_factory) -> None:
    # IDEAL mode copies a request's local_kv into its blocks when it is admitted; one of the wrong
    # shape raised there, after the scheduler had taken it and others of its step from the queue
    # (they leaked: live for good, blocks never freed). Checked at submit now.
    import torch

    from orchestrator import GenRequest

    h = await harness_factory(make_config(mode=Mode.IDEAL, num_blocks=16))
    good_shape = LAYOUT.wire_shape(LAYOUT.blocks_for(8))
    for kv in (torch.zeros(3, dtype=LAYOUT.dtype), torch.zeros(good_shape, dtype=torch.float64)):
        with pytest.raises(InvalidRequest, match="local_kv"):
            h.engine.submit(GenRequest("bad", prompt_len=8, first_token=1, max_tokens=2, local_kv=kv))
    h.engine.submit(GenRequest("good", prompt_len=8, first_token=1, max_tokens=2,
                               local_kv=torch.zeros(good_shape, dtype=LAYOUT.dtype)))
    await h.run_until_idle()
    assert h.engine.statistics().finished == 1 and not h.engine.rest_problems()


async def test_many_requests_small_budget_all_finish_and_release(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=40, transfer_budget_bytes=6 * BLOCK), bandwidth_bytes_per_s=2e6)
    for i in range(40):
        h.submit(f"r{i}", prompt_len=1 + (i * 7) % 20, max_tokens=1 + i % 5)
    await h.run_until_idle(max_steps=5000)
    s = h.engine.statistics()
    assert s.finished == 40 and sum(s.failed.values()) == 0
    assert s.budget.peak_in_use <= 6 * BLOCK
    assert s.peak_staging_bytes <= 6 * BLOCK


async def test_inline_mode_blocks_the_execution_thread_then_falls_back(harness_factory) -> None:
    cfg = make_config(mode=Mode.INLINE, transfer_budget_bytes=2 * BLOCK, inline_reserve_timeout_s=0.05)
    h = await harness_factory(cfg)
    h.transport.stall("hog")
    h.submit("hog", prompt_len=8)  # takes the whole staging region and never finishes
    await h.step()
    h.submit("next", prompt_len=4)

    # the blocking reservation and handshake run on a worker thread (as the execution thread would);
    # the event loop stays free to serve them
    report = await anyio.to_thread.run_sync(h.engine.step)
    assert report.blocked_s >= 0.05  # waited the reservation timeout on the execution thread
    assert h.engine.statistics().inline_fallbacks == 1
    h.engine.abort("hog")
    await h.settle()
    await h.run_until_idle_off_loop()
    assert h.final("next").state is RequestState.FINISHED
    assert h.final("hog").state is RequestState.ABORTED


async def test_inline_reserve_is_woken_by_a_receive_ending_not_by_a_step(harness_factory) -> None:
    """The original path: a reservation waiting on the execution thread gets the staging the
    moment another receive ends (on the event loop). Grants held until a later step of the very
    thread that waits would turn every contended reservation into a timeout and a fallback."""
    cfg = make_config(mode=Mode.INLINE, transfer_budget_bytes=2 * BLOCK, inline_reserve_timeout_s=1.0)
    h = await harness_factory(cfg, latency_s=0.1)
    h.submit("first", prompt_len=8)  # the whole staging region, for 0.1 s
    h.submit("second", prompt_len=8)
    report = await anyio.to_thread.run_sync(h.engine.step)  # admits both; the second waits for the first
    assert report.admitted == 2 and 0.05 <= report.blocked_s < 0.9
    assert h.engine.statistics().inline_fallbacks == 0
    with anyio.fail_after(10):  # a hang guard: the second pull takes its 0.1 s too
        while h.engine.live_requests:
            await h.step_off_loop()
            await anyio.sleep(0.01)
    assert h.final("first").state is h.final("second").state is RequestState.FINISHED


async def test_inline_connects_on_the_loop_only_when_the_peer_is_not_connected(harness_factory) -> None:
    """The inline path waits for the event loop to connect a new peer; a connected one costs no
    hand-over (each one is a wait of the execution thread on a possibly busy loop)."""
    h = await harness_factory(make_config(mode=Mode.INLINE))
    receiver = h.engine.receiver
    hops: list[object] = []
    call_soon = receiver.call_soon
    receiver.call_soon = lambda fn: hops.append(fn) or call_soon(fn)  # type: ignore[method-assign]
    for rid in ("a", "b"):
        h.submit(rid, max_tokens=2)
        await h.run_until_idle_off_loop()
    assert len(hops) == 1  # the first connect only
    h.transport.set_peer_down(PEER, True)  # the connection is gone: the next admission asks again
    h.transport.set_peer_down(PEER, False)
    h.submit("c", max_tokens=2)
    await h.run_until_idle_off_loop()
    assert len(hops) == 2
    assert all(h.final(r).state is RequestState.FINISHED for r in "abc")


async def test_ideal_mode_runs_at_once_without_transport(harness_factory) -> None:
    h = await harness_factory(make_config(mode=Mode.IDEAL))
    h.engine.submit(h.request("i", peer="", prefill=False, max_tokens=3))
    await h.run_until_idle()
    assert h.tokens("i") == [8, 9]


async def test_failed_receive_is_never_decoded_and_freed_blocks_are_never_read(harness_factory) -> None:
    # freed blocks are filled with NaN: a decode that read one would not match CTX's KV
    h = await harness_factory(make_config(num_blocks=12, transfer_budget_bytes=4 * BLOCK, debug_poison_freed_blocks=True))
    failing = {f"r{i}" for i in range(0, 30, 3)}
    for i in range(30):
        rid = f"r{i}"
        if rid in failing:
            h.transport.fail(rid, PeerClosed("reset", peer="ctx-0"))
        h.submit(rid, prompt_len=4 + i % 9, max_tokens=2 + i % 4)
    await h.run_until_idle(max_steps=3000)
    decoded = {rid for batch in h.step_fn.decoded for rid in batch}
    assert decoded.isdisjoint(failing)
    assert decoded == {f"r{i}" for i in range(30)} - failing
    for rid in failing:
        assert h.final(rid).failure is FailureReason.PEER_ERROR
    assert h.engine.statistics().pool.allocations == 30  # blocks were recycled many times over


async def test_blocks_in_one_run_receive_directly_others_through_staging(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=16))
    h.submit("direct", prompt_len=8, max_tokens=1)  # blocks 0..2: one run
    await h.run_until_idle()
    assert h.engine.statistics().peak_staging_bytes == 0  # landed in the KV blocks themselves
    held = h.engine.pool.allocate(16)
    h.engine.pool.free(held[::2])  # fragment the pool: every free block is isolated
    h.submit("scattered", prompt_len=8, max_tokens=2)  # decodes once: its KV is checked
    await h.run_until_idle()
    assert h.engine.statistics().peak_staging_bytes == LAYOUT.wire_bytes(2)  # staged, then scattered
    assert h.final("scattered").state is RequestState.FINISHED
    h.engine.pool.free(held[1::2])


async def test_receives_run_ahead_so_a_freed_slot_is_filled_at_once(harness_factory) -> None:
    h = await harness_factory(make_config(max_num_seqs=1, max_prefetch_seqs=1))
    h.submit("a", max_tokens=5)
    h.submit("b", max_tokens=3)
    saw_b_ready = False
    for _ in range(20):
        report = await h.step()
        stats = h.engine.statistics()
        saw_b_ready |= stats.ready == 1 and stats.running == 1  # b received while a decodes
        if h.engine.live_requests == 0:
            break
    assert saw_b_ready
    batches = [b for b in h.step_fn.decoded]
    assert batches == [["a"]] * 4 + [["b"]] * 2  # b decodes the very step after a's last, no gap
    assert h.final("b").state is RequestState.FINISHED


async def test_inline_mode_keeps_the_original_slot_accounting(harness_factory) -> None:
    h = await harness_factory(make_config(mode=Mode.INLINE, max_num_seqs=1))
    h.submit("a", max_tokens=4)
    h.submit("b", max_tokens=2)
    for _ in range(3):
        await h.step_off_loop()  # inline blocks: run it off the loop
        s = h.engine.statistics()
        assert s.receiving + s.ready + s.running <= 1  # a receive takes a decode slot, no prefetch
    await h.run_until_idle_off_loop()
    assert h.final("a").state is h.final("b").state is RequestState.FINISHED


async def test_abort_while_ready_frees_its_blocks(harness_factory) -> None:
    h = await harness_factory(make_config(max_num_seqs=1))
    h.submit("a", max_tokens=50)
    h.submit("b", max_tokens=5)
    for _ in range(4):
        await h.step()
    assert h.engine.statistics().ready == 1
    h.engine.abort("b")
    h.engine.abort("a")
    await h.run_until_idle()
    assert h.final("b").state is RequestState.ABORTED
    assert "b" not in {rid for batch in h.step_fn.decoded for rid in batch}
