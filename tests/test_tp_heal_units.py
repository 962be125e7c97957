"""The healing group's decisions without a cluster (issue 16, items 6, 7, 9): one cause whichever
detector asks first, the step and model groups' own timeouts and backends, CUDA placement per rank,
and KV checksums computed off the event loop from a snapshot. The CUDA test skips without GPUs."""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from examples import _proc
from examples.two_node import gen_tp, tp_group


class FakeChild:
    """What RankWatch reads of a rank process: ``pid`` and ``poll()``."""

    def __init__(self, pid: int, code: int | None = None) -> None:
        self.pid = pid
        self.code = code

    def poll(self) -> int | None:
        return self.code


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_rank_killed_by_a_signal_is_the_cause_whichever_detector_asks_first() -> None:
    # ranks 1 and 3 exited *because* rank 2 was killed: the kill is the cause, and every detector
    # (the watchdog's poll, a failed exchange, a failed model step) reads the same sentence
    children = [FakeChild(11, 0), FakeChild(12, -signal.SIGKILL), FakeChild(13, 0)]
    first = tp_group.RankWatch("GEN", children, 10.0)
    assert first.cause(RuntimeError("[pair.cc:537] Read error")) == "GEN rank 2 (pid 12) was killed by SIGKILL"
    other = tp_group.RankWatch("GEN", children, 10.0)
    assert other.poll() == "GEN rank 2 (pid 12) was killed by SIGKILL"
    children[1].code = None  # later evidence never changes a decided cause
    assert first.cause(TimeoutError("Connection closed by peer")) == first.decided == other.poll()


def test_with_no_sign_on_any_rank_the_cause_says_so_without_the_transport_text() -> None:
    watch = tp_group.RankWatch("GEN", [FakeChild(2**22 + 7)], 10.0)
    text = watch.cause(RuntimeError("[/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset"),
                       settle_s=0.0)
    assert text == "the GEN group lost a connection between its ranks (no rank had exited or stopped yet)"
    assert "pair.cc" not in text
    timed_out = tp_group.RankWatch("CTX", [FakeChild(2**22 + 7)], 4.0)
    assert timed_out.cause(RuntimeError("Timed out waiting 4000ms"), settle_s=0.0) == \
        "a CTX rank stopped answering: no step exchange for 4 s"


@pytest.fixture
def stopped_process() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_rank_breaks_the_group_only_past_the_step_timeout(stopped_process: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    watch = tp_group.RankWatch("GEN", [FakeChild(os.getpid()), stopped_process], 10.0, clock=clock)
    os.kill(stopped_process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while _proc.state(stopped_process.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.poll() is None  # seen stopped now
    clock.t += 9.9
    assert watch.poll() is None  # a stop shorter than the step timeout fails nothing
    clock.t += 0.1
    assert watch.poll() == (f"GEN rank 2 (pid {stopped_process.pid}) stopped answering: no step exchange for 10 s "
                            "(the process is stopped)")
    tp_group.kill_ranks([stopped_process])  # SIGKILL reaches a stopped process
    assert stopped_process.returncode == -signal.SIGKILL


def test_a_continued_rank_is_forgotten(stopped_process: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    watch = tp_group.RankWatch("GEN", [stopped_process], 10.0, clock=clock)
    os.kill(stopped_process.pid, signal.SIGSTOP)
    while _proc.state(stopped_process.pid) != "T":
        time.sleep(0.01)
    assert watch.poll() is None
    os.kill(stopped_process.pid, signal.SIGCONT)
    while _proc.state(stopped_process.pid) == "T":
        time.sleep(0.01)
    assert watch.poll() is None
    clock.t += 60
    assert watch.poll() is None  # stopped 0 s now, not 60


def test_rank_0_inside_one_collective_past_the_step_timeout_breaks_the_group() -> None:
    clock = Clock()
    watch = tp_group.RankWatch("GEN", [FakeChild(2**22 + 7)], 10.0, clock=clock)
    seen: list[str | None] = []

    def collective() -> None:  # a model all-reduce that a stuck (not stopped) rank never joins
        clock.t += 9.0
        seen.append(watch.poll())
        clock.t += 1.0
        seen.append(watch.poll())

    watch.collective(collective)
    assert seen == [None, "a GEN rank stopped answering: no step exchange for 10 s"]
    assert watch.busy_since is None


def test_a_failed_collective_reads_as_the_cause_and_a_model_bug_as_itself() -> None:
    watch = tp_group.RankWatch("GEN", [FakeChild(5, -signal.SIGKILL)], 10.0)

    def broken() -> None:
        raise RuntimeError("[pair.cc:537] Read error")

    with pytest.raises(tp_group.GroupBroken, match=r"^GEN rank 1 \(pid 5\) was killed by SIGKILL$"):
        watch.collective(broken)
    healthy = tp_group.RankWatch("GEN", [FakeChild(2**22 + 7)], 10.0)

    def bug() -> None:
        raise IndexError("index 9 is out of bounds")

    with pytest.raises(IndexError):
        healthy.collective(bug)
    assert healthy.decided is None


# -- item 7 and 9: two groups, their own timeouts and backends; a device per rank -----------------------

def test_the_step_group_and_the_model_group_have_their_own_timeouts(tmp_path) -> None:
    import torch.distributed as dist

    args = argparse.Namespace(tp=1, tp_step_timeout_s=4.0, tp_model_timeout_s=None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        step, model = tp_group._make_groups(args, 0)
        cpu = torch.device("cpu")
        assert step is not model
        assert step._get_backend(cpu).options._timeout == datetime.timedelta(seconds=4)
        assert model._get_backend(cpu).options._timeout == datetime.timedelta(seconds=12)  # 3 x the step's
        assert dist.get_backend(model) == tp_group.model_backend()
    finally:
        dist.destroy_process_group()


def test_the_model_timeout_is_never_shorter_than_the_step_timeout() -> None:
    args = argparse.Namespace(tp=2, tp_step_timeout_s=10.0, tp_model_timeout_s=5.0, layers=2, heads=4, kv_heads=2,
                              head_dim=16, max_seq_len=2048, seed=0)
    with pytest.raises(SystemExit, match="at least as long"):
        gen_tp.check_args(args)


def test_cuda_placement_per_rank_and_the_model_backend() -> None:
    assert tp_group.model_backend(cuda_available=True) == "nccl"
    assert tp_group.model_backend(cuda_available=False) == "gloo"
    assert [tp_group.rank_device(r, 2) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert tp_group.rank_device(3, 0) == "cpu"


def test_kv_checksums_run_on_a_worker_thread_from_a_snapshot_of_the_blocks() -> None:
    pool = torch.arange(4 * 2 * 2 * 2 * 4 * 3, dtype=torch.float32).reshape(4, 2, 2, 2, 4, 3)  # [blocks, L, 2, H, bs, d]
    ids = torch.tensor([2, 0])
    expected = gen_tp.head_checksums(pool, ids)
    done = threading.Event()
    seen: list[tuple[str, list[list[int]], str]] = []
    calls: list[object] = []
    gate = threading.Event()

    def call(fn) -> None:  # stands in for the event loop's call_soon_threadsafe
        calls.append(fn)
        fn()

    def finished(rid: str, h0: int, per_head: list[list[int]], whole: list[int]) -> None:
        seen.append((rid, per_head, threading.current_thread().name))
        done.set()

    worker = gen_tp.ChecksumWorker(call, whole_blocks=False)
    worker._pool.submit(gate.wait)  # hold the worker: submit() must not compute on the caller's thread
    worker.submit("r-1", 0, pool, ids, finished)
    pool.zero_()  # decode writes into the blocks after the receive: the checksums are of what landed
    assert not done.is_set()
    gate.set()
    assert done.wait(10)
    worker.close()
    assert seen[0][:2] == ("r-1", expected)
    assert seen[0][2].startswith("kv-checksums")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL refuses two ranks on one GPU)")
def test_gen_tp2_on_cuda_runs_its_model_on_nccl_with_a_device_per_rank() -> None:
    from tests.test_two_node import check, run_demo

    _, report = run_demo("--gen-tp", "2", "--requests", "4", "--concurrency", "2", "--isl", "32", "--osl", "4")
    check(report, 4)
    tp = report["gen"]["tp"]
    assert tp["model_backend"] == "nccl" and tp["device"] == "cuda:0"


def test_the_fronts_health_shows_each_groups_restarts_and_last_cause() -> None:
    from examples.serve.cluster import Cluster

    cluster = Cluster(["127.0.0.1:9"], ["127.0.0.1:10"], secret=b"x" * 32)
    ctx, gen = cluster.nodes
    ctx.stats = {"store": {"held_requests": 0}, "tp": {"world_size": 1}}  # no group: nothing to show
    gen.stats = {"engine": {"waiting": 0, "receiving": 0, "ready": 0, "running": 0},
                 "tp": {"world_size": 4, "restarts": 2, "last_cause": "GEN rank 2 (pid 7) was killed by SIGKILL"}}
    nodes = cluster.health()["nodes"]
    assert "restarts" not in nodes[0]
    assert nodes[1]["restarts"] == 2 and nodes[1]["last_cause"] == "GEN rank 2 (pid 7) was killed by SIGKILL"
    assert "form_failures" not in nodes[1]  # healed at the first attempt each time: nothing more to say
    gen.stats["tp"].update(regrouping=True, form_failures=3, last_form_error="RuntimeError: rank 1 exited")
    node = cluster.health()["nodes"][1]
    assert node["regrouping"] and node["form_failures"] == 3 and node["last_form_error"] == "RuntimeError: rank 1 exited"


class _Node:
    """A GroupNode that records what the healer asked of it; its first ``broken_starts`` generations
    break before their first collective (a rank that joined died starting)."""

    def __init__(self, broken_starts: int = 0) -> None:
        self.calls: list[str] = []
        self.broken_starts = broken_starts
        self.starts = 0

    def broken(self) -> str | None:
        return "CTX rank 1 exited with code 1" if 0 < self.starts <= self.broken_starts else None

    def serving(self) -> bool:
        return self.starts > self.broken_starts

    async def fail(self, cause: str) -> None:
        self.calls.append("fail")

    async def stop(self) -> None:
        self.calls.append("stop")

    async def start(self, group: object) -> None:
        self.calls.append("start")
        self.starts += 1


def _healer(monkeypatch: pytest.MonkeyPatch, failures: int, **args: object) -> tuple[tp_group.Healer, list[float]]:
    """A healer whose ``form`` fails ``failures`` times, then succeeds; returns it and the waits it slept."""
    attempts = []

    def form(*a: object, **kw: object) -> object:
        attempts.append(1)
        if len(attempts) <= failures:
            raise RuntimeError(f"rank 1 could not start (attempt {len(attempts)})")
        return argparse.Namespace(children=[], generation=a[2])

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(tp_group, "form", form)
    monkeypatch.setattr("anyio.sleep", sleep)
    ns = argparse.Namespace(tp_step_timeout_s=10.0, argv=[], tp_reform_backoff_max_s=30.0, tp_reform_attempts=0)
    for k, v in args.items():
        setattr(ns, k, v)
    return tp_group.Healer("GEN", ns, argparse.Namespace(children=[], generation=3)), waits


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_group_that_fails_to_form_is_retried_with_a_growing_wait_then_serves(monkeypatch) -> None:
    healer, waits = _healer(monkeypatch, failures=7)
    node = _Node()
    await healer._heal(node, "GEN rank 1 was killed")
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]  # doubling, at most --tp-reform-backoff-max-s
    assert node.calls == ["fail", "stop", "start"]
    s = healer.statistics()
    assert s["restarts"] == 1 and s["generation"] == 4 and not s["regrouping"]
    assert s["form_failures"] == 7 and "attempt 7" in s["last_form_error"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_group_that_cannot_form_gives_up_after_the_attempts_allowed(monkeypatch) -> None:
    healer, waits = _healer(monkeypatch, failures=100, tp_reform_attempts=3)
    node = _Node()
    with pytest.raises(RuntimeError, match="in 3 attempts.*attempt 3"):
        await healer._heal(node, "GEN rank 1 was killed")
    assert waits == [1.0, 2.0]  # no wait after the last attempt
    assert node.calls == ["fail", "stop"]  # never served on a half-formed group
    assert healer.statistics()["regrouping"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_group_whose_rank_breaks_before_the_first_collective_is_a_failed_attempt(monkeypatch) -> None:
    """A rank that joined and died starting (its port taken): the group broke before its first
    collective. Before, that was a heal ("healthy" for a moment), then a break, for ever, with no
    backoff, no limit, and no form error. Now each is a failed attempt: backoff, the reason in
    last_form_error, healthy only once every rank took part in a collective; and a limit."""
    healer, waits = _healer(monkeypatch, failures=0)
    node = _Node(broken_starts=2)
    await healer._heal(node, "CTX rank 1 was killed")
    assert node.calls == ["fail", "stop", "start", "fail", "stop", "start", "fail", "stop", "start"]
    assert waits == [1.0, 2.0]  # the backoff between attempts
    s = healer.statistics()
    assert s["restarts"] == 1 and not s["regrouping"] and s["form_failures"] == 2
    assert "before the group's first collective: CTX rank 1 exited with code 1" in s["last_form_error"]
    healer, waits = _healer(monkeypatch, failures=0, tp_reform_attempts=2)
    with pytest.raises(RuntimeError, match="in 2 attempts"):
        await healer._heal(_Node(broken_starts=5), "CTX rank 1 was killed")
    assert healer.statistics()["regrouping"]


def test_reform_arguments_are_checked_at_start() -> None:
    parser = argparse.ArgumentParser()
    tp_group.add_timeout_args(parser.add_argument_group())
    model = dict(tp=2, layers=2, heads=4, kv_heads=2, head_dim=16, max_seq_len=2048, seed=0)
    gen_tp.check_args(argparse.Namespace(**vars(parser.parse_args([])), **model))  # the defaults pass
    for bad in (["--tp-reform-backoff-max-s", "0.5"], ["--tp-reform-attempts", "-1"]):
        with pytest.raises(SystemExit, match="reform"):
            gen_tp.check_args(argparse.Namespace(**vars(parser.parse_args(bad)), **model))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_ctx_group_that_breaks_after_rank_0_stored_a_prefill_frees_its_blocks_once() -> None:
    """The group breaks in the prefill's last exchange, after rank 0 stored the KV: the stored copy
    is released (its blocks freed once, with it). Before, the node freed the blocks the store still
    held; the next prefill got them, and the healer's release freed them again under it."""
    import types

    import anyio

    from examples.two_node import control, ctx, ctx_tp
    from orchestrator import KVBlockPool, loop_caller
    from transports import KVLayout, KVStore

    class DiesInTheLastExchange:  # a world of one whose second all_gather fails: a rank died
        gathers = 0

        def broadcast_object_list(self, box, src, group):  # noqa: ANN001, ANN201
            pass

        def all_gather_object(self, out, value, group):  # noqa: ANN001, ANN201
            self.gathers += 1
            if self.gathers == 2:
                raise RuntimeError("rank 1 died (collective timed out)")
            out[0] = value

    class Model:
        config = types.SimpleNamespace(vocab_size=100, fingerprint="fake")

        def prefill(self, prompt, kv, blocks):  # noqa: ANN001, ANN201
            kv[blocks] = 1.0
            return 7

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    node = ctx.CtxNode.__new__(ctx.CtxNode)  # the node's state only: no servers, no processes
    node.args = argparse.Namespace(inject_first_token=None, kv_transport="ucx", lease_s=60.0, kv_checksums=False,
                                   alloc_wait_s=1.0, tp_step_timeout_s=10.0, tp=2)
    node.layout, node.model = layout, Model()
    node.pool = KVBlockPool(layout, 8)
    node.store = KVStore(layout, node.pool.kv)
    node.ucx_addr, node.head_range, node.group_copies = "h:1", (0, 2), {}
    node._prefills = 0
    node._call = loop_caller()
    node._freed = anyio.Event()
    group = ctx_tp.CtxGroup(node, None, 0, 1)
    group._dist = DiesInTheLastExchange()
    node.group = group
    node.exec_thread = threading.Thread(target=group.lead, daemon=True)
    node.exec_thread.start()
    blocks = await node._allocate(2)
    with pytest.raises(control.ControlError):
        await node._prefill_in_group("r1", [1, 2, 3, 4, 5], blocks)
    assert node.pool.statistics().used_blocks == 0 and node.store.statistics().held_requests == 0
    assert node.group_copies == {}
    other = node.pool.allocate(2)  # the next prefill's blocks
    await ctx_tp.CtxRank0(node, None).stop()  # the healer releases rank 0's copies of the old group
    assert node.pool.statistics().used_blocks == 2 and node.pool.allocate(2).tolist() != other.tolist()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_ctx_computes_its_kv_checksums_off_the_event_loop(monkeypatch) -> None:
    """The checksums of a prefill's KV (a copy and CRC of the whole prompt's KV) run on the
    execution thread with the prefill, not on the event loop that serves pulls (it blocked ~6 ms per
    2,048-token prefill of the tiny model)."""
    import types

    import anyio

    from examples.two_node import ctx
    from orchestrator import KVBlockPool, loop_caller
    from transports import KVLayout, KVStore

    class Model:
        config = types.SimpleNamespace(vocab_size=100, max_seq_len=64, fingerprint="fake")

        def prefill(self, prompt, kv, blocks):  # noqa: ANN001, ANN201
            kv[blocks] = 1.0
            return 7

    threads: list[str] = []
    real_block, real_head = ctx.block_checksums, ctx.head_checksums
    monkeypatch.setattr(ctx, "block_checksums", lambda *a: (threads.append(threading.current_thread().name), real_block(*a))[1])
    monkeypatch.setattr(ctx, "head_checksums", lambda *a: (threads.append(threading.current_thread().name), real_head(*a))[1])
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    node = ctx.CtxNode.__new__(ctx.CtxNode)  # the node's state only: no servers, no processes
    node.args = argparse.Namespace(kv_transport="ucx", lease_s=60.0, kv_checksums=True, alloc_wait_s=1.0)
    node.layout, node.model, node.group = layout, Model(), None
    node.pool = KVBlockPool(layout, 8)
    node.store = KVStore(layout, node.pool.kv)
    node.ucx_addr, node.head_range, node.group_copies = "h:1", (0, 2), {}
    node._prefills, node._call, node._freed = 0, loop_caller(), anyio.Event()
    node._exec, node._prefilling = anyio.CapacityLimiter(1), set()
    node.handle_key = b"k" * 32  # (tags the block ids its prefill names)
    node.shutting_down, node.registration = False, None
    reply = await node._prefill({"op": "prefill", "request_id": "r1", "prompt_ids": [1, 2, 3, 4, 5], "max_tokens": 2})
    assert reply["block_checksums"] and reply["head_checksums"]
    assert len(threads) == 2 and threading.current_thread().name not in threads
    # registered in etcd and draining past the fronts' grace: a new prefill is refused (before, a CTX
    # took prefills for its whole drain: a client that kept sending kept the drain from ending)
    import time

    from examples.two_node import control, membership

    reg = membership.Registration.__new__(membership.Registration)
    reg.draining_since = time.monotonic() - membership.ACCEPT_WHILE_DRAINING_S - 0.1
    node.registration = reg
    with pytest.raises(control.ControlError, match="shutting down") as refused:
        await node._prefill({"op": "prefill", "request_id": "r2", "prompt_ids": [1, 2, 3], "max_tokens": 2})
    assert refused.value.code == control.UNAVAILABLE and node.pool.statistics().used_blocks == 2  # r1's only


def test_rank_0_s_own_stall_is_the_cause_not_the_rank_that_gave_up_on_it() -> None:
    """Rank 0 stopped (SIGSTOP) past the step timeout: rank 1 gave up on it and left cleanly (exit
    0). The cause names rank 0's stall, whichever detector asks first; before, clients were told
    the healthy rank 1 "exited with code 0" (an outside drill). A stall long past, or one no rank
    broke in, names nothing."""
    for first in ("poll", "exchange"):
        clock = Clock()
        child = FakeChild(2**22 + 7)
        watch = tp_group.RankWatch("GEN", [child], 10.0, clock=clock)
        assert watch.poll() is None
        clock.t += 12.0  # rank 0 frozen: its watchdog did not look
        child.code = 0
        text = watch.poll() if first == "poll" else watch.cause(RuntimeError("Connection closed by peer"), settle_s=0.0)
        assert text.startswith(f"GEN rank 0 (pid {os.getpid()}) itself made no progress for 12.0 s"), text
        assert watch.decided == text
    clock = Clock()
    child = FakeChild(2**22 + 7)
    watch = tp_group.RankWatch("GEN", [child], 10.0, clock=clock)
    assert watch.poll() is None
    clock.t += 12.0
    assert watch.poll() is None  # the whole group was frozen together: nothing broke
    for _ in range(11):
        clock.t += 1.0
        assert watch.poll() is None
    child.code = -signal.SIGKILL
    assert watch.poll() == "GEN rank 1 (pid 4194311) was killed by SIGKILL"


def test_a_late_free_of_an_old_copy_keeps_the_record_of_a_newer_prefill_of_that_id() -> None:
    """A group copy of "x" released while a pull pinned it is freed when the pin closes, perhaps
    after a new prefill of "x" stored its own copy: that free forgot the new copy's record (by id
    alone), so a heal's stop() left the new copy on rank 0 until its lease (an outside review)."""
    import types

    from examples.two_node import ctx
    from orchestrator import KVBlockPool
    from transports import KVLayout, KVStore

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    pool = KVBlockPool(layout, 8)
    store = KVStore(layout, pool.kv)
    node = types.SimpleNamespace(group_copies={}, pool=pool, group=None, _call=lambda f: None, _wake_allocators=None)

    def put(blocks: torch.Tensor) -> str:
        handle = store.new_handle("x")
        store.put("x", blocks, num_tokens=8, lease_s=60, handle=handle,
                  on_release=lambda: ctx.CtxNode.on_free(node, blocks, "x", handle))  # type: ignore[arg-type]
        node.group_copies["x"] = handle
        return handle

    old = put(pool.allocate(2))
    _, pin = store.pin("x")  # a GEN's pull of the old copy
    assert store.release("x", handle=old)  # released: freed when the pull ends
    new = put(pool.allocate(2))
    pin.close()  # the old pull ends: the old copy's blocks go back
    assert node.group_copies == {"x": new} and pool.statistics().used_blocks == 2
    assert store.release("x", handle=node.group_copies["x"])  # what the heal's stop() does
    assert node.group_copies == {} and pool.statistics().used_blocks == 0


def test_an_idle_group_s_collectives_come_well_within_a_short_step_timeout() -> None:
    """Rank 0 of an idle group ran a collective once a second (the CTX's heartbeat, the GEN's idle
    step) whatever the step timeout: at --tp-step-timeout-s 1 or less the other ranks gave up in
    it and an idle group broke and healed over and over (an outside review). Now it runs one every
    quarter of the step timeout (at most a second)."""
    import argparse
    import types

    from examples.two_node import ctx_tp
    from orchestrator import DecodeLoop

    seen: list[float] = []

    class Dist:
        def broadcast_object_list(self, box, src, group):  # noqa: ANN001, ANN201
            seen.append(time.monotonic())

    node = types.SimpleNamespace(args=argparse.Namespace(inject_first_token=None, tp_step_timeout_s=0.4))
    group = ctx_tp.CtxGroup(node, None, 0, 2)
    group._dist = Dist()
    lead = threading.Thread(target=group.lead, daemon=True)
    lead.start()
    time.sleep(0.8)
    group._jobs.put(ctx_tp._Job(("stop",), None, lambda _: None))
    lead.join(5)
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert len(seen) >= 5 and max(gaps) < 0.2, gaps  # every 0.1 s, well within 0.4 s
    assert tp_group.idle_period_s(argparse.Namespace(tp_step_timeout_s=10.0)) == 1.0
    gen_loop = DecodeLoop(types.SimpleNamespace(), tp_idle_s=tp_group.idle_period_s(node.args))
    assert gen_loop._wait_s(types.SimpleNamespace(world_size=2, live_requests=0)) == 0.1


def test_a_rank_that_exits_before_the_group_formed_fails_the_attempt_at_once() -> None:
    """Rank 0 waited in the rendezvous for the join timeout (120 s) when a new rank was killed
    before it joined (an outside review: a heal "regrouping" 122 s). Now the attempt fails as soon
    as a rank exits; a rendezvous that completes returns its result."""
    never = threading.Event()
    children = [FakeChild(11), FakeChild(12)]
    started = time.monotonic()

    def rendezvous() -> object:
        children[1].code = -signal.SIGKILL
        never.wait(30)
        return "formed"

    with pytest.raises(RuntimeError, match=r"rank 2 \(pid 12\) exited with code -9 before the group formed"):
        tp_group.join_watching(tp_group.watch_ranks(children), rendezvous, period_s=0.01)
    assert time.monotonic() - started < 2
    never.set()
    assert tp_group.join_watching(tp_group.watch_ranks([FakeChild(11)]), lambda: "formed", period_s=0.01) == "formed"
    with pytest.raises(ValueError, match="bad"):
        tp_group.join_watching(tp_group.watch_ranks([FakeChild(11)]), lambda: (_ for _ in ()).throw(ValueError("bad")), period_s=0.01)


@pytest.mark.parametrize("last_words, why", [
    # a one-line refusal (the node's "cannot start"), after an info record
    ('print(\'{"level": "info", "event": "ctx_starting"}\', file=sys.stderr); '
     'print("ctx: cannot start: [Errno 98] address already in use", file=sys.stderr); sys.exit(1)',
     "ctx: cannot start: [Errno 98] address already in use"),
    # a traceback: its last line
    ('raise RuntimeError("model shard 3 does not fit")', "RuntimeError: model shard 3 does not fit"),
    # a structured error record, then a record at info: the error's event and error
    ('print(\'{"level": "error", "event": "engine_broken", "error": "decode step raised"}\', file=sys.stderr); '
     'print(\'{"level": "info", "event": "node_stopped"}\', file=sys.stderr); sys.exit(3)',
     "engine_broken: decode step raised"),
    ("sys.exit(1)", None),  # nothing said: the exit code alone
])
def test_a_rank_that_exits_says_why_where_the_cause_is_read(last_words, why, capfd) -> None:
    """A rank that died (at start: its port taken, a shard that does not fit) was "exited with code
    1" in ping / stats, last_form_error and the log; its reason only in the node's stderr (the last
    stop's not-fixed list). Rank 0 now copies each rank's stderr on to its own and keeps the last
    lines: the cause ends with the rank's last word. The copy still reaches rank 0's stderr."""
    child = subprocess.Popen([sys.executable, "-c", f"import sys; {last_words}"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tp_group.StderrTail.attach(child)
    code = child.wait(30)
    cause = tp_group.RankWatch("CTX", [child], 10.0).cause(settle_s=0.0)
    assert cause.startswith(f"CTX rank 1 (pid {child.pid}) exited with code {code}")
    assert cause.endswith(f"code {code}" if why is None else f"code {code}: {why}"), cause
    with pytest.raises(RuntimeError) as raised:
        tp_group.join_watching(tp_group.watch_ranks([child]), lambda: threading.Event().wait(30), period_s=0.01)
    assert str(raised.value).endswith("before the group formed" + ("" if why is None else f": {why}"))
    assert (why or "").split(": ")[-1] in capfd.readouterr().err  # forwarded, as before the copy


def test_a_lost_connection_waits_for_the_rank_on_its_way_out() -> None:
    """A rank that could not start closed its connections 1.2 s before it exited (measured; more on
    a busy host): with 1 s of settling the group's cause read "lost a connection (no rank had exited
    or stopped yet)", the rank's reason nowhere but stderr. A lost connection now waits up to
    LOST_CONNECTION_SETTLE_S for the rank to be seen leaving; a timed-out exchange does not."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.6); "
                              "print('gen: cannot start: port 9 in use', file=sys.stderr); sys.exit(1)"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tp_group.StderrTail.attach(child)
    try:
        cause = tp_group.RankWatch("GEN", [child], 10.0).cause(RuntimeError("[pair.cc:537] Connection reset by peer"))
        assert cause == f"GEN rank 1 (pid {child.pid}) exited with code 1: gen: cannot start: port 9 in use"
    finally:
        child.kill()
        child.wait()
    started = time.monotonic()
    still = tp_group.RankWatch("GEN", [FakeChild(2**22 + 7)], 4.0).cause(RuntimeError("Timed out waiting 4000ms"))
    assert still == "a GEN rank stopped answering: no step exchange for 4 s" and time.monotonic() - started < 2


_REFORM_HEAD = r'''
import datetime, socket, subprocess, sys, time
import torch.distributed as dist
from examples.two_node import tp_group


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def form(n, barriers=1):
    """Rank 0 here and a fresh rank 1 form a group at a new address; rank 1 meets ``barriers`` barriers."""
    init = f"tcp://127.0.0.1:{port()}"
    peer = subprocess.Popen([sys.executable, "-c", "import datetime, torch.distributed as d; "
                             f"d.init_process_group('gloo', init_method='{init}', rank=1, world_size=2, "
                             "timeout=datetime.timedelta(seconds=20)); " + "d.barrier(); " * barriers
                             + "d.destroy_process_group()"])
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=datetime.timedelta(seconds=20))
    dist.barrier()
    print(f"attempt {n} formed", flush=True)
    return peer
'''

REFORM_AFTER_A_FAILED_ATTEMPT = _REFORM_HEAD + r'''

try:  # attempt 1: its other rank never joins (killed before it could)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port()}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=1))
    sys.exit("the first attempt formed a group of one")
except Exception as exc:
    print("attempt 1 failed:", type(exc).__name__, flush=True)
tp_group.leave()  # what form() does before every attempt
peer = form(2)
tp_group.leave()
sys.exit(peer.wait(30))
'''


REFORM_WHILE_AN_ABANDONED_ATTEMPT_WAITS = _REFORM_HEAD + r'''
import threading


box = {}


def first():  # attempt 1 in its own thread, as join_watching runs it; its other rank never joins
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port()}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=3))
        box["r"] = "formed"
    except Exception as exc:
        box["r"] = type(exc).__name__


thread = threading.Thread(target=first, daemon=True)
thread.start()
time.sleep(0.5)  # abandoned inside its rendezvous (join_watching saw its rank die): it ends on its own
tp_group.leave()
peer = form(2, barriers=2)  # while attempt 1 still waits
thread.join(20)
assert box.get("r") not in (None, "formed"), box
print("attempt 1 failed:", box["r"], flush=True)
dist.barrier()  # the group formed beside it still works once it ended
tp_group.leave()
assert peer.wait(30) == 0
peer = form(3, barriers=2)  # and the next heal forms too
dist.barrier()
tp_group.leave()
sys.exit(peer.wait(30))
'''


@pytest.mark.parametrize("script", ["after", "beside"])
def test_a_group_forms_again_after_a_failed_attempt(script: str) -> None:
    """torch names the default group from a counter that init_process_group raises before its
    rendezvous and only destroy_process_group of a formed group resets: after one failed attempt
    rank 0 named its next group default_pg/1, every fresh rank default_pg/0, and the node never
    healed (each attempt waited out the join timeout; an outside drill: "regrouping" for 4 minutes).
    Rank 0 (a fresh interpreter here: torch's state is process-wide) forms a group after a failed
    attempt; ``beside``: while that attempt's rendezvous, abandoned in its thread, still waits (it
    ends on its own later), and again after it ended."""
    code = REFORM_AFTER_A_FAILED_ATTEMPT if script == "after" else REFORM_WHILE_AN_ABANDONED_ATTEMPT_WAITS
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "attempt 1 failed" in r.stdout and "attempt 2 formed" in r.stdout, \
        r.stdout + r.stderr[-2000:]
    assert script == "after" or "attempt 3 formed" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_group_that_cannot_form_at_start_is_one_line_and_exit_1(monkeypatch, capsys) -> None:
    """A rank killed before it joined the first group ended the node with a 40-line traceback
    through run_in_group -> form -> join_watching (an outside drill); it is one line and exit 1."""
    from examples.two_node.__main__ import run_role

    def form(*a: object, **k: object) -> None:
        raise RuntimeError("rank 1 (pid 9) exited with code -9 before the group formed")

    monkeypatch.setattr(tp_group, "form", form)
    parser = argparse.ArgumentParser()
    tp_group.add_timeout_args(parser.add_argument_group())
    args = argparse.Namespace(**vars(parser.parse_args([])), tp=2, layers=2, heads=4, kv_heads=2, head_dim=16,
                              max_seq_len=2048, seed=0, tp_rank=0, argv=[], role="gen")
    assert run_role(lambda a: gen_tp.run_in_group(a, lambda: None), args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gen: stopped: could not form its tensor-parallel group at start: "
                   "rank 1 (pid 9) exited with code -9 before the group formed"], err


def test_a_rank_s_stderr_is_still_drained_when_rank_0_s_own_stderr_is_gone() -> None:
    """Rank 0 copies each rank's stderr on; if its own stderr went away (a closed pipe), the copy
    stopped reading, the rank's pipe filled and the rank blocked on its next log line (a hung rank,
    a broken group). It keeps reading, and keeps the last lines."""
    r, w = os.pipe()
    os.close(r)  # writing to w now fails (EPIPE)
    try:
        child = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(4000): print('x' * 200, i, "
                                  "file=sys.stderr)\nprint('the last word', file=sys.stderr)"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tp_group.StderrTail.attach(child, out_fd=w)
        try:
            assert child.wait(30) == 0  # 800 KB through a 64 KiB pipe: drained to the end
        finally:
            child.kill()
        assert child.stderr_tail.reason() == "the last word"  # type: ignore[attr-defined]
    finally:
        os.close(w)


def test_a_gen_stopping_its_own_group_is_not_a_break_to_heal() -> None:
    """Rank 0 of a GEN group stops its group on SIGTERM; the healer, still polling, read the
    stopped engine as broken and, in the few ms before it was cancelled, killed the ranks it was
    stopping and began forming a new group during the shutdown (an outside drill: 2 of 9 SIGTERMs
    logged tp_group_healing). Once the node is ending, its own stop is not a break."""

    class Engine:
        def health(self) -> str:
            return "the tensor-parallel group was stopped"

    class Node:
        engine = Engine()
        ending = False

    node = Node()
    rank0 = gen_tp.GenRank0(node, None)
    assert rank0.broken() == "the tensor-parallel group was stopped"  # a stop the node did not make: heal
    node.ending = True
    assert rank0.broken() is None


@pytest.mark.parametrize("rank0_lives_s", [0.0, 2.5], ids=["before-it-joined", "while-it-joins"])
def test_a_rank_whose_rank_0_died_before_the_group_formed_exits_at_once(tmp_path, rank0_lives_s: float) -> None:
    """Rank 0 stopped at once (a second SIGTERM) while it formed a generation: the ranks it had just
    started waited in the rendezvous' C++ for the 120 s join timeout, orphans that did not even run
    their SIGTERM handler (an outside drill left three for over 47 s). A rank now watches rank 0
    while it joins, and exits 1 (with one log line) when rank 0 is gone, whenever it died."""
    from examples.two_node.launch import ROOT, node_env

    script = tmp_path / "rank0.py"
    script.write_text(f"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-m", "examples.two_node", "gen", "--ctx", "127.0.0.1:1", "--tp", "2",
                          "--num-blocks", "16", "--tp-rank", "1", "--tp-init", "tcp://127.0.0.1:{tp_group._free_port()}"],
                         stdin=subprocess.DEVNULL, stderr=open({str(tmp_path / "rank1.log")!r}, "w"),
                         env={{**os.environ, {tp_group.RANK0_ENV!r}: str(os.getpid())}})
print(child.pid, flush=True)
time.sleep({rank0_lives_s})
os._exit(0)  # rank 0 gone, its group never formed
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=node_env(), cwd=ROOT, timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 30  # its start (imports) and then at most a watch period
    while _proc.state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _proc.state(pid) not in (None, "Z")
    if alive:
        os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "rank1.log").read_text(errors="replace")
    assert not alive, log[-2000:]
    assert "tp_rank_orphaned" in log, log[-2000:]


def test_a_regrouped_gen_s_counters_go_on_from_the_ended_generations() -> None:
    """Rank 0 makes a new engine per generation: its counters (and so the node's Prometheus counters,
    which must never go back) are the new engine's plus every ended one's; gauges are the new one's."""
    from examples.two_node.gen import add_counters

    def engine(finished: int, failed: dict, counts: list, peak: int, running: int) -> dict:
        hist = {"bounds": [0.1, 1.0], "counts": counts, "sum": float(sum(counts))}
        return {"finished": finished, "aborted": 1, "inline_fallbacks": 2, "failed": failed,
                "deferrals": {"backpressure": 3}, "receive_seconds": hist, "receive_bytes": dict(hist),
                "peak_staging_bytes": peak, "running": running,
                "budget": {"capacity": 10, "in_use": 0, "peak_in_use": peak, "grants": finished, "oversized_grants": 1,
                           "nowait_denials": 2},
                "pool": {"num_blocks": 64, "used_blocks": running, "peak_used_blocks": peak, "allocations": finished,
                         "exhaustions": 1}}

    ended = engine(5, {"peer_gone": 8}, [1, 2, 2], 9, 0)
    now = engine(16, {"timeout": 1}, [3, 3, 4], 4, 2)
    assert add_counters(now, None) == now
    out = add_counters(now, ended)
    assert (out["finished"], out["aborted"], out["inline_fallbacks"]) == (21, 2, 4)
    assert out["failed"] == {"peer_gone": 8, "timeout": 1} and out["deferrals"] == {"backpressure": 6}
    assert out["receive_seconds"] == {"bounds": [0.1, 1.0], "counts": [4, 5, 6], "sum": 15.0}
    assert out["receive_bytes"]["counts"] == [4, 5, 6]
    assert out["peak_staging_bytes"] == 9
    assert out["budget"] == {"capacity": 10, "in_use": 0, "peak_in_use": 9, "grants": 21, "oversized_grants": 2,
                             "nowait_denials": 4}
    assert out["pool"] == {"num_blocks": 64, "used_blocks": 2, "peak_used_blocks": 9, "allocations": 21, "exhaustions": 2}
    assert out["running"] == 2  # a gauge: the current engine's
    # summed twice (a second regroup) from the node's own reports
    assert add_counters(engine(1, {}, [0, 0, 1], 1, 0), out)["finished"] == 22
