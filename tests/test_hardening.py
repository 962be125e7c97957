"""Issue 8: the holes a field engineer found, each with the test that would have caught it.

Engine-level tests run on both anyio backends with in-process CTX peers (``tests.harness``);
every one ends with the engine at rest (budget full, nothing in flight, every block free).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

import anyio
import pytest
import structlog
import torch

from orchestrator import (
    FailureReason,
    GenEngine,
    GenRequest,
    InvalidRequest,
    KVSlice,
    RequestState,
    TransferBudget,
    Unavailable,
    plan_chunks,
)
from orchestrator._receiver import ReceiveGroup, ReceiveJob
from tests.harness import BLOCK, LAYOUT, make_config, make_harness
from transports import (
    InvalidRequestId,
    KVStore,
    PeerClosed,
    ProtocolViolation,
    UnknownRequest,
    check_request_id,
)

pytestmark = pytest.mark.anyio

BAD_IDS = ["é-ü", "a b", "x" * 129, "", "a/b", "tab\there"]


# -- 1. one request-id rule, checked at the edge ------------------------------------------------
@pytest.mark.parametrize("rid", BAD_IDS)
async def test_bad_request_ids_are_refused_before_anything_is_allocated(harness_factory, rid: str) -> None:
    h = await harness_factory()
    with pytest.raises(InvalidRequest):
        h.engine.submit(GenRequest(rid, prompt_len=8, first_token=1, max_tokens=2, peer="ctx-0"))
    with pytest.raises(InvalidRequestId):
        check_request_id(rid)
    with pytest.raises(ValueError):  # a CTX cannot hold KV under an id GEN could never pull
        h.peer.store.put(rid, torch.arange(2), num_tokens=8, lease_s=1.0)
    await h.step()
    s = h.engine.statistics()
    assert s.pool.allocations == 0 and s.budget.grants == 0 and h.engine.live_requests == 0


async def test_the_rule_admits_the_longest_legal_id(harness_factory) -> None:
    h = await harness_factory()
    rid = "A-z_0.9:" * 16  # 128 characters
    h.submit(rid)
    await h.run_until_idle()
    assert h.final(rid).state is RequestState.FINISHED


async def test_a_release_that_raises_anything_never_takes_the_group_down(harness_factory) -> None:
    h = await harness_factory()

    async def broken_release(peer: str, request_id: str, *, handle: str | None = None) -> None:
        raise UnicodeEncodeError("ascii", "é", 0, 1, "not ascii")  # not a TransportError

    h.transport.release = broken_release  # type: ignore[method-assign]
    h.submit("waiting", prefill=True)
    h.engine.abort("waiting")  # aborted while waiting: the engine asks the peer to release
    with structlog.testing.capture_logs() as logs:
        await h.step()
        await h.step()
    assert any(e["event"] == "release_not_delivered" for e in logs)
    assert h.engine.health() is None and h.engine.receiver.running
    h.submit("after")
    await h.run_until_idle()
    assert h.final("after").state is RequestState.FINISHED


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_a_release_still_unanswered_when_the_group_stops_gets_its_grace_and_is_logged(how: str) -> None:
    """A release is bounded by its transport (and a 30 s backstop) while the group runs; once the
    group stops, closed or cancelled with its node, a release still waiting gets the group's
    ``release_timeout_s`` (1 s) and no longer, and its loss is logged (the peer's lease frees it)."""
    h = make_harness()

    async def unanswered(peer: str, request_id: str, *, handle: str | None = None) -> None:
        await anyio.sleep_forever()

    h.transport.release = unanswered  # type: ignore[method-assign]
    group = ReceiveGroup(h.transport, h.engine.pool.kv, LAYOUT, timeout_s=5, on_result=lambda r: None)
    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(group.run)
                group.release_soon("ctx-0", "r")
                await anyio.sleep(0.2)
                assert not any(e["event"] == "release_not_delivered" for e in logs)  # still waiting
                if how == "cancel":
                    tg.cancel_scope.cancel()
                else:
                    group.close()
                    await anyio.sleep(0.3)
                    group.release_soon("ctx-0", "late")  # asked while the group stops: the grace too
        took = time.monotonic() - started
    assert 1.0 <= took < 3.0, took  # 0.2 s, then the 1 s grace
    lost = sorted((e for e in logs if e["event"] == "release_not_delivered"), key=lambda e: e["request_id"])
    assert [e["request_id"] for e in lost] == (["late", "r"] if how == "close" else ["r"]), lost
    assert all("receive group stopped" in e["error"] for e in lost), lost


# -- 2. a supervised receive group ------------------------------------------------------------------
async def test_a_dead_receive_group_fails_live_requests_and_the_engine_refuses_new_ones() -> None:
    h = make_harness(make_config(transfer_budget_bytes=2 * BLOCK))
    h.transport.stall("receiving")
    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as group_scope:  # the event loop side of the receive group
            await tg.start(h.engine.receiver.run)
        h.submit("receiving")
        h.submit("waiting")
        h.engine.step()
        await h.settle()
        assert h.engine.statistics().receiving == 1 and h.engine.statistics().waiting == 1
        group_scope.cancel()  # the group goes away without close(): its loop cancelled it
        tg.cancel_scope.cancel()
    assert h.engine.health() is not None
    with pytest.raises(Unavailable, match="receive group stopped"):
        h.engine.submit(h.request("late"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            h.engine.step()  # never raises although the loop is gone
    # a cancelled group is its node stopping (SIGTERM), not a failure: said once, at info
    assert [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("engine_")] == [("engine_stopped", "info")]
    outs = {o.request_id: o for o in h.engine.poll()}
    assert outs["receiving"].state is RequestState.FAILED and outs["receiving"].failure is FailureReason.INTERNAL
    assert outs["waiting"].state is RequestState.FAILED and "unavailable" in outs["waiting"].message
    assert h.engine.rest_problems() == []


async def test_receives_submitted_after_the_group_stopped_end_at_once() -> None:
    h = make_harness()
    async with anyio.create_task_group() as tg:
        await tg.start(h.engine.receiver.run)
        h.engine.close()
    h.submit("after-close")
    h.engine.step()  # the admission hands the job to a stopped group: no NotRunning, one result
    h.engine.step()
    (out,) = h.engine.poll()
    assert out.state is RequestState.ABORTED and out.failure is FailureReason.ABORTED
    assert h.engine.rest_problems() == []


async def test_a_crashing_decode_step_marks_the_engine_unhealthy_and_frees_everything() -> None:
    from orchestrator import EngineThreads

    calls = 0

    def exploding(batch):  # noqa: ANN001
        nonlocal calls
        calls += 1
        raise RuntimeError("device fell off the bus")

    h = make_harness(step_fn=exploding)
    with pytest.raises(RuntimeError, match="decode loop crashed"):
        with EngineThreads(h.engine, idle_wait_s=0.005) as threads:
            h.engine.submit(h.request("a"))
            h.engine.submit(h.request("b"))
            deadline = time.monotonic() + 10
            while h.engine.live_requests and time.monotonic() < deadline:
                time.sleep(0.01)
            assert h.engine.health() is not None and "decode loop crashed" in h.engine.health()
            with pytest.raises(Unavailable):
                h.engine.submit(h.request("c"))
            assert threads.loop.error is not None
    outs = h.engine.poll()
    assert {o.request_id for o in outs if o.finished} == {"a", "b"}
    assert all(o.failure is FailureReason.INTERNAL for o in outs if o.finished)
    assert calls == 1 and h.engine.rest_problems() == []


@pytest.mark.parametrize("where", ["orchestrator", "tp_group"])
async def test_a_model_collective_that_breaks_reports_the_groups_one_cause(where: str) -> None:
    """A decode step whose collective finds the group broken (GroupBroken, as the node's model
    group raises it) marks the engine with that cause verbatim: the text does not depend on which
    collective met the failure first. ``tp_group``: the class the GEN node's model group really
    raises (``RankWatch.collective``); before, it was a plain RuntimeError, so a SIGSTOPped rank's
    clients read "decode loop crashed: GroupBroken: <cause>" and a SIGKILLed one's "<cause>"."""
    from orchestrator import EngineThreads
    if where == "orchestrator":
        from orchestrator import GroupBroken
    else:
        from examples.two_node.tp_group import GroupBroken

    cause = "GEN rank 2 (pid 4242) was killed by SIGKILL"

    def broken(batch):  # noqa: ANN001
        raise GroupBroken(cause)

    h = make_harness(step_fn=broken)
    with structlog.testing.capture_logs() as logs, pytest.raises(RuntimeError):
        with EngineThreads(h.engine, idle_wait_s=0.005):
            h.engine.submit(h.request("a"))
            deadline = time.monotonic() + 10
            while h.engine.live_requests and time.monotonic() < deadline:
                time.sleep(0.01)
    assert h.engine.health() == cause
    # a broken group is a fault the node reports in one line, not a crash with a traceback
    loop_logs = [e for e in logs if e["event"].startswith("decode_loop")]
    assert loop_logs and all(e["event"] == "decode_loop_group_broken" and "exc_info" not in e for e in loop_logs), loop_logs
    assert loop_logs[0]["cause"] == cause
    outs = [o for o in h.engine.poll() if o.finished]
    assert [o.message for o in outs] == [f"GEN engine unavailable: {cause}"] and h.engine.rest_problems() == []


# -- 3. a receive publishes its result before it talks to the peer again ----------------------------
async def test_a_timed_out_receive_is_published_before_its_release_completes(harness_factory) -> None:
    h = await harness_factory(make_config(kv_transfer_timeout_ms=200))
    releases = anyio.Event()

    async def slow_release(peer: str, request_id: str, *, handle: str | None = None) -> None:
        releases.set()
        await anyio.sleep(0.8)  # a peer that is slow to answer RELEASE

    h.transport.release = slow_release  # type: ignore[method-assign]
    h.transport.stall("stuck")
    h.submit("stuck")
    t0 = time.monotonic()
    with anyio.fail_after(5):
        while "stuck" not in h.outputs or not h.outputs["stuck"][-1].finished:
            await h.step()
            await anyio.sleep(0.005)
    elapsed = time.monotonic() - t0
    assert h.final("stuck").failure is FailureReason.TIMEOUT
    assert elapsed < 0.2 + 0.5, elapsed  # not held up by the 0.8 s release
    assert h.engine.statistics().budget.in_use == 0  # the budget came back with the result
    assert releases.is_set()


@pytest.mark.parametrize(
    ("error", "released"),
    [(PeerClosed("gone"), True), (ProtocolViolation("garbled"), True), (UnknownRequest("none"), False)],
    ids=["peer", "protocol", "unknown"],
)
async def test_release_is_sent_after_any_failed_pull(harness_factory, error: Exception, released: bool) -> None:
    h = await harness_factory()
    h.transport.fail("r", error)  # type: ignore[arg-type]
    h.submit("r")
    await h.run_until_idle()
    assert h.final("r").state is RequestState.FAILED
    assert h.transport.counters.releases == (1 if released else 0)
    if released:  # the CTX does not hold the KV until its lease ends
        assert h.peer.store.statistics().held_requests == 0


async def test_an_internal_error_also_releases(harness_factory) -> None:
    h = await harness_factory()
    h.transport.fail("r", RuntimeError("bug"))  # type: ignore[arg-type]
    h.submit("r")
    with structlog.testing.capture_logs():
        await h.run_until_idle()
    assert h.final("r").failure is FailureReason.INTERNAL
    assert h.transport.counters.releases == 1


# -- 4. no KV block is reused while a transfer may still land in it ------------------------------
async def test_blocks_stay_quarantined_until_the_late_receive_ends(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=3, transfer_budget_bytes=4 * BLOCK))
    h.transport.stall_landing("late")
    h.submit("late", prompt_len=8, max_tokens=4)  # 3 blocks: the whole pool
    await h.step()
    h.engine.abort("late")
    await h.step()  # the cancel reaches the receive, which publishes its result at once
    await h.step()
    assert h.final("late").state is RequestState.ABORTED  # the client hears at once
    s = h.engine.statistics()
    assert s.quarantined_blocks == 3 and s.pool.used_blocks == 3
    assert s.budget.in_use == 2 * BLOCK  # the bytes may still be moving: the window stays taken
    h.submit("next", prompt_len=4, max_tokens=4)  # needs 2 blocks: none is reusable yet
    for _ in range(5):
        await h.step()
    assert h.engine.statistics().waiting == 1
    assert h.engine.rest_problems()  # quarantined blocks are not at rest
    h.transport.finish_landing("late")  # UCX reports the receive over
    await h.run_until_idle()
    assert h.final("next").state is RequestState.FINISHED
    assert h.engine.statistics().quarantined_blocks == 0


async def test_a_receive_reported_whole_while_its_landing_is_busy_keeps_its_blocks_until_it_ends(harness_factory) -> None:
    # A transport bug: the pull returns (success) while the receive it posted may still write into
    # the blocks. The request decodes and finishes, but its blocks, and its budget (its bytes may
    # still be moving: DESIGN 9), are held until the landing ends.
    h = await harness_factory(make_config(num_blocks=3, transfer_budget_bytes=4 * BLOCK))
    h.transport.land_late("early")  # the pull completes, its landing stays busy
    h.submit("early", prompt_len=8, max_tokens=4)  # 3 blocks: the whole pool
    with structlog.testing.capture_logs() as logs, anyio.fail_after(10):
        while not (h.outputs.get("early") and h.outputs["early"][-1].finished):
            await h.step()
            await anyio.sleep(0.001)  # the pull's modelled transfer time passes
    assert h.final("early").state is RequestState.FINISHED
    assert any(e["event"] == "receive_ok_while_landing_busy" for e in logs)
    s = h.engine.statistics()
    assert s.quarantined_blocks == 3 and s.pool.used_blocks == 3
    assert s.budget.in_use == 2 * BLOCK
    h.submit("next", prompt_len=4, max_tokens=4)  # needs 2 blocks: none is reusable yet
    for _ in range(5):
        await h.step()
    assert h.engine.statistics().waiting == 1
    assert h.engine.rest_problems()
    h.transport.finish_landing("early")
    await h.run_until_idle()
    assert h.final("next").state is RequestState.FINISHED
    assert h.engine.statistics().quarantined_blocks == 0 and not h.engine.rest_problems()


async def test_a_busy_landing_that_ends_while_its_request_runs_gives_the_budget_back_then(harness_factory) -> None:
    # The same transport bug, the landing ending while the request still decodes: the budget comes
    # back at that step (not only when the request ends), and the blocks stay with the request.
    h = await harness_factory(make_config(num_blocks=16, transfer_budget_bytes=4 * BLOCK))
    h.transport.land_late("long")
    h.submit("long", prompt_len=8, max_tokens=40)
    with anyio.fail_after(10):
        while h.engine.statistics().running == 0:
            await h.step()
            await anyio.sleep(0.001)
    for _ in range(3):
        await h.step()
    s = h.engine.statistics()
    assert s.running == 1 and s.budget.in_use == 2 * BLOCK  # decoding, its bytes may still move
    h.transport.finish_landing("long")
    await h.step()
    await h.step()
    s = h.engine.statistics()
    assert s.running == 1 and s.budget.in_use == 0 and s.quarantined_blocks == 0
    await h.run_until_idle()
    assert h.final("long").state is RequestState.FINISHED and not h.engine.rest_problems()


async def test_statistics_count_a_request_ended_only_once_its_blocks_are_back(harness_factory) -> None:
    # A node's stats reply is read from another thread while the execution thread ends requests;
    # it reads the counters before the pool. Counted first and freed after, a reply could say
    # "6 aborted" with their blocks still used and a rest check taken a moment later saying "at
    # rest" (CI: test_clients_resetting_mid_stream_do_not_kill_gen saw 98 blocks used).
    h = await harness_factory(make_config(num_blocks=64, transfer_budget_bytes=64 * BLOCK))
    seen: list[tuple[int, int]] = []
    free = h.engine.pool.free

    def spying_free(ids):  # the moment just before a request's blocks come back
        s = h.engine.statistics()
        seen.append((s.finished + s.aborted + sum(s.failed.values()), len(seen)))
        free(ids)

    h.engine.pool.free = spying_free  # type: ignore[method-assign]
    for i in range(4):
        h.submit(f"r{i}", prompt_len=8, max_tokens=3)
    h.submit("gone", prompt_len=8, max_tokens=50)
    await h.step()
    await h.step()
    h.engine.abort("gone")
    await h.run_until_idle()
    assert len(seen) == 5
    assert all(counted == freed_before for counted, freed_before in seen), seen


# -- 5. CUDA: scatters on a transfer stream, staging kept until its event -----------------------------
class _FakeStreamScatter:
    """Stands for the CUDA transfer stream: scatters are queued, and ``wait`` returns only when the
    test completes the 'event'."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self.event = anyio.Event()
        self.queued: list[tuple[torch.Tensor, torch.Tensor, KVSlice]] = []
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def block_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_ids

    def scatter(self, ids: torch.Tensor, staged: torch.Tensor, chunk: KVSlice, keep: list[torch.Tensor]) -> None:
        self.queued.append((ids, staged, chunk))
        self.refs.append(weakref.ref(staged))
        keep.append(staged)

    async def wait(self, keep: list[torch.Tensor]) -> None:
        await self.event.wait()
        from transports import scatter

        for ids, staged, chunk in self.queued:
            scatter(self.pool, ids, staged, chunk)
        self.queued.clear()
        keep.clear()


async def test_a_receive_is_published_after_its_stream_event_with_staging_alive_until_then() -> None:
    h = make_harness()
    results = []
    group = ReceiveGroup(h.transport, h.engine.pool.kv, LAYOUT, timeout_s=5, on_result=results.append)
    fake = _FakeStreamScatter(h.engine.pool.kv)
    group._scatter = fake  # type: ignore[assignment]
    h.peer.prefill("r", 8)
    ids = torch.tensor([5, 2])  # not one run: staged, then scattered
    async with anyio.create_task_group() as tg:
        await tg.start(group.run)
        group.submit(ReceiveJob("r", "ctx-0", ids, (LAYOUT.full_slice(),), None, handle=h.peer.handles["r"]))
        await anyio.wait_all_tasks_blocked()
        assert results == []  # the scatter is queued on the stream: not published yet
        assert fake.refs and all(ref() is not None for ref in fake.refs)  # staging still referenced
        fake.event.set()
        with anyio.fail_after(5):
            while not results:
                await anyio.sleep(0.001)
        group.close()
    assert results[0].ok
    assert torch.equal(h.engine.pool.kv[ids], h.peer.expected["r"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_pool_receives_without_device_wide_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden() -> None:
        raise AssertionError("torch.cuda.synchronize() on the receive path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    h = make_harness(make_config(device="cuda"))
    async with anyio.create_task_group() as tg:
        await h.engine.start(tg)
        for i in range(4):
            h.submit(f"r{i}")
        await h.run_until_idle()
        h.engine.close()
    for i in range(4):
        assert h.final(f"r{i}").state is RequestState.FINISHED


# -- 6. per-step work does not grow with the queue ---------------------------------------------------
async def test_a_step_with_thousands_waiting_scans_only_what_it_admits(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=20_000, transfer_budget_bytes=2 * BLOCK))
    h.transport.stall("head")
    h.submit("head", prompt_len=8)  # takes the whole budget and keeps it
    await h.step()
    for i in range(3000):
        h.engine.submit(GenRequest(f"w{i}", prompt_len=8, first_token=1, max_tokens=2, peer="ctx-0"))
    await h.step()  # drains the inbox
    scanned = []
    original = h.engine.scheduler.schedule

    def counting(*a, **kw):  # noqa: ANN002, ANN003
        result = original(*a, **kw)
        scanned.append(result.scanned)
        return result

    h.engine.scheduler.schedule = counting  # type: ignore[method-assign]
    for _ in range(5):
        await h.step()
    assert scanned and max(scanned) <= 1
    assert h.engine.statistics().deferral_episodes[DeferReasonBP] == 1
    h.engine.abort("head")
    for i in range(3000):
        h.engine.abort(f"w{i}")
    await h.run_until_idle()


from orchestrator import DeferReason  # noqa: E402

DeferReasonBP = DeferReason.BACKPRESSURE


def _blocking_calls(fn):  # noqa: ANN001, ANN202
    """Run ``fn()`` on this thread and list every blocking wait it made: a queue ``get``, a
    ``sleep``, an ``Event``/``Condition`` wait, a future's ``result``, a thread ``join`` (however
    short its timeout). Locks held only across bookkeeping are not waits for another thread's I/O."""
    seen: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "c_call":
            owner = type(getattr(arg, "__self__", None)).__name__
            name = getattr(arg, "__name__", "")
            if (owner, name) in {("SimpleQueue", "get"), ("module", "sleep")}:
                seen.append(f"{owner}.{name}")
        elif event == "call" and frame.f_code.co_name in ("wait", "result", "join", "get") and \
                frame.f_code.co_filename.endswith(("threading.py", "_base.py", "queue.py")):
            seen.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, seen


async def test_step_never_waits_for_the_event_loop() -> None:
    """The execution thread's step() makes no blocking wait at all (a queue, a future, an event, a
    sleep): checked call by call, not by a time bound a short wait would pass; and with the loop's
    thread blocked for a second, every step still completes."""
    from anyio.from_thread import start_blocking_portal

    h = make_harness(make_config(num_blocks=256, transfer_budget_bytes=4 * BLOCK))
    with start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(h.engine.receiver.run)
        for i in range(40):
            h.engine.submit(h.request(f"r{i}"))
        blocked = threading.Event()
        portal.call(lambda: h.engine.receiver.call_soon(lambda: (blocked.set(), time.sleep(1.0))))
        blocked.wait(5)
        t_end = time.monotonic() + 0.8
        steps = 0
        while time.monotonic() < t_end:  # the loop thread sleeps all this time
            report, waits = _blocking_calls(h.engine.step)
            assert waits == [] and report.blocked_s == 0.0, waits
            steps += 1
        assert steps > 10
        deadline = time.monotonic() + 20
        while h.engine.live_requests and time.monotonic() < deadline:
            _, waits = _blocking_calls(h.engine.step)
            assert waits == [], waits
            time.sleep(0.002)
        h.engine.close()
        future.result(10)
    h.engine.step()
    assert h.engine.live_requests == 0 and h.engine.rest_problems() == []


# -- 7. failures that admission could have prevented --------------------------------------------------
async def test_a_busy_peer_is_backpressure_retried_within_the_timeout(harness_factory) -> None:
    h = await harness_factory()
    h.transport.busy("r", 3)  # refused three times, as a CTX over its pull limit does
    h.submit("r")
    await h.run_until_idle()
    assert h.final("r").state is RequestState.FINISHED


async def test_requests_waiting_at_gen_keep_their_kv_at_ctx(harness_factory) -> None:
    """A request admitted long after its prefill still finds its KV: the engine renews the lease of
    every waiting request (one batched HOLD per peer), so the CTX's short lease never ends while
    GEN holds the request."""
    h = await harness_factory(make_config(transfer_budget_bytes=2 * BLOCK, kv_hold_interval_s=0.05))
    h.transport.hold_lease_s = 0.3
    h.transport.stall("blocker")
    h.submit("blocker", prompt_len=8)  # holds the whole budget
    await h.step()
    h.submit("late", prompt_len=8, lease_s=0.3)  # its lease would end long before admission
    with anyio.fail_after(5):
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            await h.step()
            h.peer.store.expire()
            await anyio.sleep(0.02)
    assert "late" in h.peer.store._held  # type: ignore[attr-defined]
    assert h.transport.counters.holds >= 5
    h.engine.abort("blocker")
    await h.run_until_idle()
    assert h.final("late").state is RequestState.FINISHED


async def test_a_receive_gets_its_full_timeout_from_its_own_start(harness_factory) -> None:
    # (timeout 1 s, not 0.4: under load a 0.25 s pull took 0.55 s and failed the test, not the code)
    h = await harness_factory(make_config(transfer_budget_bytes=2 * BLOCK, kv_transfer_timeout_ms=1000))
    hog = h.engine.budget.acquire_nowait(2 * BLOCK)  # the whole window, held elsewhere
    h.submit("patient", prompt_len=8)
    await h.step()
    h.transport.latency_s = 0.25  # shorter than the timeout, but the wait for budget was longer
    await anyio.sleep(1.3)  # "patient" waits for budget longer than kv_transfer_timeout_ms
    await h.step()
    assert h.engine.statistics().waiting == 1
    hog.release()
    await h.run_until_idle()
    assert h.final("patient").state is RequestState.FINISHED


# -- 13. stronger tests of what the suite did not exercise ----------------------------------------------
async def test_one_release_wakes_several_waiters_at_once() -> None:
    """One release with room for three grants them all at once: each waiter keeps its grant, so
    a wake loop that woke only the first (the others then woken by its release) is caught."""
    budget = TransferBudget(4 * BLOCK)
    big = budget.acquire_nowait(4 * BLOCK)
    grants: list[object] = []

    async def waiter() -> None:
        grants.append(await budget.acquire(BLOCK))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert budget.statistics().waiters == 3
        big.release()  # one release, room for all three
        await anyio.wait_all_tasks_blocked()
        stats = budget.statistics()
        tg.cancel_scope.cancel()  # a waiter left waiting (the bug) must not hang the test
    assert len(grants) == 3 and stats.holders == 3 and stats.waiters == 0 and stats.in_use == 3 * BLOCK
    for g in grants:
        g.release()  # type: ignore[attr-defined]
    assert budget.statistics().in_use == 0


async def test_a_kv_misfit_between_a_budget_blocked_head_and_a_small_request_lets_nothing_overtake(harness_factory) -> None:
    h = await harness_factory(make_config(num_blocks=20, transfer_budget_bytes=4 * BLOCK))
    h.transport.stall("hog")
    h.submit("hog", prompt_len=8, max_tokens=1)  # 3 KV blocks, 2 blocks of budget, held
    await h.step()
    h.submit("head", prompt_len=16, max_tokens=1)  # 4 blocks of budget: blocked
    h.submit("kv-misfit", prompt_len=4, max_tokens=68)  # 18 KV blocks: does not fit while "hog" holds 3
    h.submit("small", prompt_len=4, max_tokens=1)  # 1 block: would fit the budget, must not overtake
    for _ in range(3):
        await h.step()
    assert h.engine.statistics().waiting == 3 and "small" not in h.outputs
    h.engine.abort("hog")
    h.engine.abort("kv-misfit")
    await h.run_until_idle()
    order = [o.request_id for outs in h.outputs.values() for o in outs if o.state is RequestState.FINISHED]
    assert order.index("head") < order.index("small")


@pytest.mark.parametrize("blocks", [1, 3, 7, 64])
@pytest.mark.parametrize("budget_blocks", [1, 2, 5])
def test_chunk_plans_never_exceed_the_budget(blocks: int, budget_blocks: int) -> None:
    from transports import KVLayout

    layout = KVLayout(num_layers=6, num_kv_heads=4, head_dim=8, block_size=4)
    capacity = budget_blocks * layout.block_bytes // 3  # forces per-layer and per-head plans
    full = layout.full_slice()
    try:
        chunks = plan_chunks(layout, blocks, full, capacity)
    except ValueError:
        assert layout.wire_bytes(blocks, KVSlice(0, 1, 0, 1)) > capacity
        return
    assert all(layout.wire_bytes(blocks, c) <= capacity for c in chunks)
    covered = {(l, hd) for c in chunks for l in range(c.layer_start, c.layer_end) for hd in range(c.head_start, c.head_end)}
    assert covered == {(l, hd) for l in range(6) for hd in range(4)}
    assert sum(c.num_layers * c.num_heads for c in chunks) == 6 * 4  # no overlap


def test_kv_store_handles_are_required_when_presented() -> None:
    store = KVStore(LAYOUT, LAYOUT.new_pool(4))
    handle = store.put("r", torch.tensor([0, 1]), num_tokens=8, lease_s=10)
    assert len(handle) == 32
    with pytest.raises(UnknownRequest):
        store.gather("r", LAYOUT.full_slice(), handle="0" * 32)
    assert not store.release("r", handle="0" * 32)
    assert store.release("r", handle=handle)


def test_engine_type_is_untouched() -> None:
    assert GenEngine.submit.__doc__ and "Unavailable" in GenEngine.submit.__doc__
