"""Faults with real processes: a GEN engine in this process, CTX peers in others, UCX between them.

Each scenario is a failure reported in the field (see issue 5): CTX killed mid-transfer, GEN killed
while CTX holds KV, client aborts in flight and while waiting, a completion that never arrives.
Every test ends with the engine at rest (budget full, nothing in flight, every block free) and the
CTX holding nothing it should not. Each test runs with both KV transports (``backend``: ucx, nixl;
nixl skips only when ``nixl_cu12`` cannot be imported).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time

import anyio
import anyio.abc
import pytest
import torch

from examples.two_node import control
from examples.two_node.launch import NodeProcess, node_env
from orchestrator import DecodeBatch, FailureReason, GenEngine, GenRequest, OrchestratorConfig, RequestState
from tests._scripts import load_script
from tests._ucx_peer import LAYOUT, handle_for
from tests.test_ucx_transport import BACKENDS, Peer, expected, make_transport, wait_released

pytestmark = pytest.mark.integration

BLOCKS = 8  # per request on the test peer
TOKENS = BLOCKS * LAYOUT.block_size


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The KV transport of the GEN engine and of the CTX peers: ``ucx`` or ``nixl``."""
    return request.param


class ExactStep:
    """Decode step that checks every decoded request's prompt blocks hold exactly the CTX's KV."""

    def __init__(self) -> None:
        self.decoded: set[str] = set()

    def __call__(self, batch: DecodeBatch) -> torch.Tensor:
        for rid, blocks in zip(batch.request_ids, batch.block_tables):
            index = int(rid.rsplit("-", 1)[1])
            assert torch.equal(batch.kv[blocks[:BLOCKS]], expected(index)), f"{rid}: KV differs from CTX's"
            self.decoded.add(rid)
        return batch.tokens + 1


class Gen:
    """A GEN engine stepped from the test's event loop (its receive group runs there too)."""

    def __init__(self, engine: GenEngine, step: ExactStep, transport: object) -> None:
        self.engine = engine
        self.transport = transport
        self.step = step
        self.final: dict[str, object] = {}
        self.ended_at: dict[str, float] = {}

    def submit(self, rid: str, peer: Peer, max_tokens: int = 3) -> None:
        self.engine.submit(GenRequest(rid, prompt_len=TOKENS, first_token=1, max_tokens=max_tokens, peer=peer.address,
                                      kv_handle=handle_for(rid)))

    async def step_until(self, done, timeout: float = 20.0) -> None:
        with anyio.fail_after(timeout):
            while True:
                self.engine.step()
                for out in self.engine.poll():
                    if out.finished:
                        self.final[out.request_id] = out
                        self.ended_at[out.request_id] = time.monotonic()
                if done():
                    return
                await anyio.sleep(0.005)

    async def rest(self) -> None:
        await self.step_until(lambda: not self.engine.rest_problems(), timeout=10)


@pytest.fixture
async def gen(backend: str):
    transport = make_transport(backend, connect_timeout_s=5)
    made: list[Gen] = []

    async with anyio.create_task_group() as tg:

        async def make(**overrides: object) -> Gen:
            cfg = dict(layout=LAYOUT, num_blocks=256, transfer_budget_bytes=64 * LAYOUT.block_bytes, kv_transfer_timeout_ms=20_000)
            cfg.update(overrides)
            step = ExactStep()
            engine = GenEngine(OrchestratorConfig(**cfg), transport, step)  # type: ignore[arg-type]
            await engine.start(tg)
            made.append(Gen(engine, step, transport))
            return made[-1]

        try:
            yield make
            for g in made:
                await g.rest()
                assert g.engine.rest_problems() == []
        finally:
            for g in made:
                g.engine.close()
            with anyio.CancelScope(shield=True):
                await transport.aclose()


def state(g: Gen, rid: str):
    return g.final[rid].state  # type: ignore[attr-defined]


def failure(g: Gen, rid: str):
    return g.final[rid].failure  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_ctx_killed_mid_transfer_fails_its_requests_only_then_restart_works(gen, backend: str) -> None:
    slow = Peer("--gather-delay", "3", backend=backend)  # its pulls are in flight for 3 s
    fast = Peer(backend=backend)
    try:
        g = await gen()
        doomed = [f"req-{i}" for i in range(4)]
        fine = [f"req-{i}" for i in range(10, 14)]
        for rid in doomed:
            g.submit(rid, slow)
        for rid in fine:
            g.submit(rid, fast)
        await g.step_until(lambda: all(r in g.final for r in fine))
        assert g.engine.statistics().receiving == 4  # the slow ones are mid-transfer
        killed_at = time.monotonic()
        slow.kill()
        await g.step_until(lambda: all(r in g.final for r in doomed))
        for rid in doomed:
            assert state(g, rid) is RequestState.FAILED and failure(g, rid) is FailureReason.PEER_ERROR
            # the endpoint error, not the transfer timeout (20 s) that would also end them
            assert g.ended_at[rid] - killed_at < 0.5 * g.engine.config.kv_transfer_timeout_ms / 1e3
        for rid in fine:
            assert state(g, rid) is RequestState.FINISHED
        await g.rest()  # budget full and every block free after the failures

        # Same address: no stale endpoint may be reused. Started off the event loop, so that the GEN's
        # releases of the doomed requests (refused: nobody listens yet) end while it starts; the
        # refused connect marks the peer down for `dead_peer_backoff_s`, which the pull then waits out.
        # (Started on the loop, the 3 s start blocked it, the refusals were seen only after and marked
        # the restarted peer down: CI failure of 2026-12-04.)
        restarted = await anyio.to_thread.run_sync(lambda: Peer("--port", str(slow.port), backend=backend))
        try:
            with anyio.fail_after(5):
                while g.transport.statistics().peers_down:  # type: ignore[attr-defined]
                    await anyio.sleep(0.05)
            g.submit("req-5", restarted)
            await g.step_until(lambda: "req-5" in g.final)
            assert state(g, "req-5") is RequestState.FINISHED
            assert "req-5" in g.step.decoded
        finally:
            restarted.stop()
    finally:
        slow.stop()
        fast.stop()


@pytest.mark.anyio
async def test_abort_in_flight_and_while_waiting_returns_everything_and_tells_ctx(gen, backend: str) -> None:
    peer = Peer("--gather-delay", "1.5", backend=backend)
    try:
        g = await gen(transfer_budget_bytes=BLOCKS * LAYOUT.block_bytes)  # the budget holds one request
        g.submit("req-20", peer)  # in flight (slow gather)
        g.submit("req-21", peer)  # waits for the budget
        await g.step_until(lambda: g.engine.statistics().receiving == 1)
        assert g.engine.statistics().waiting == 1
        g.engine.abort("req-20")
        g.engine.abort("req-21")
        await g.step_until(lambda: {"req-20", "req-21"} <= set(g.final))
        assert state(g, "req-20") is state(g, "req-21") is RequestState.ABORTED
        await g.rest()
        with anyio.fail_after(10):
            stats = await wait_released(peer, "req-20", "req-21")  # CTX was told and freed both copies
        assert "req-22" in stats["held"]  # and nothing else
        assert not {"req-20", "req-21"} & g.step.decoded
    finally:
        peer.stop()


@pytest.mark.anyio
async def test_completion_that_never_arrives_times_out_instead_of_hanging(gen, backend: str) -> None:
    peer = Peer("--send-delay", "60", backend=backend)  # agrees to send (UCX) or to look up (NIXL), then never does
    try:
        g = await gen(kv_transfer_timeout_ms=1_000)
        start = time.monotonic()
        g.submit("req-30", peer)
        await g.step_until(lambda: "req-30" in g.final, timeout=10)
        assert failure(g, "req-30") is FailureReason.TIMEOUT
        # not before the 1 s timeout; the upper bound is the step_until limit (a hang fails there)
        assert g.ended_at["req-30"] - start >= 0.99
        await g.rest()
    finally:
        peer.stop()


@pytest.mark.parametrize("pulled_before", [False, True], ids=["never-connected", "connected"])
def test_gen_killed_while_ctx_holds_kv_ctx_frees_it_when_the_lease_expires(backend: str, pulled_before: bool) -> None:
    """Also when the GEN had pulled before (over NIXL its control connection then held a lease under
    which it could READ without pins: its death closes that connection, so the CTX's revocations of
    the expired requests wait for nobody)."""
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--lease-s", "1.5", "--num-blocks", "256", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], *kv], env=env) as gen_node:

        async def scenario() -> dict:
            if pulled_before:
                r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": "first",
                                                          "prompt_ids": list(range(40, 90)), "max_tokens": 2},
                                       secret=ctx.secret)
                stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
                await stream.send({"op": "generate", "request_id": "first", "prompt_len": r["prompt_len"],
                                   "first_token": r["first_token"], "max_tokens": 2, "kv_peer": r["kv_peer"],
                                   "kv_handle": r["kv_handle"]})
                while not (msg := await stream.receive()).get("done"):
                    assert "error" not in msg, msg
                await stream.aclose()
                with anyio.fail_after(10):  # the CTX frees it as the READ's notice comes (over NIXL a
                    # moment after the GEN's "done": the suite under load saw it still held here)
                    while (await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret)
                           )["store"]["held_requests"]:
                        await anyio.sleep(0.02)
            for i in range(3):
                await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": f"held-{i}",
                                                      "prompt_ids": list(range(40, 90)), "max_tokens": 4},
                                   secret=ctx.secret)
            held = await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret)
            assert held["store"]["held_requests"] == 3 and held["pool"]["used_blocks"] > 0
            gen_node.kill(signal.SIGKILL)  # the GEN dies before pulling anything
            with anyio.fail_after(10):
                while (s := await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret))["store"]["held_requests"]:
                    await anyio.sleep(0.1)
            return s

        stats = anyio.run(scenario, backend="asyncio")
        assert stats["store"]["expired"] == 3
        if pulled_before and stats["pool"]["used_blocks"]:  # NIXL: a revocation's blocks follow within a round trip
            async def freed() -> dict:
                with anyio.fail_after(2):
                    while (s := await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret))["pool"]["used_blocks"]:
                        await anyio.sleep(0.05)
                return s
            stats = anyio.run(freed, backend="asyncio")
        assert stats["pool"]["used_blocks"] == 0  # the blocks went back to the CTX pool


async def open_generation(ctx: NodeProcess, gen_node: NodeProcess, rid: str, prompt_len: int) -> control.JsonStream:
    """Prefill ``rid`` on CTX, start a long generation on GEN, return the stream once tokens flow."""
    r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                              "prompt_ids": list(range(40, 40 + prompt_len)), "max_tokens": 1500},
                           secret=ctx.secret)
    stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
    await stream.send({"op": "generate", "request_id": rid, "prompt_len": r["prompt_len"],
                       "first_token": r["first_token"], "max_tokens": 1500, "kv_peer": r["kv_peer"],
                       "kv_handle": r["kv_handle"]})
    assert "tokens" in await stream.receive()
    return stream


async def wait_aborted_and_at_rest(gen_node: NodeProcess, aborted: int, timeout: float) -> dict:
    with anyio.fail_after(timeout):
        while True:
            s = await control.call(gen_node.info["ctrl"], {"op": "stats"}, secret=gen_node.secret)
            if s["engine"]["aborted"] == aborted and not s["rest_problems"]:
                return s
            await anyio.sleep(0.05)


def test_client_cancel_mid_generation_releases_everything(backend: str) -> None:
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "256", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "256", *kv], env=env) as gen_node:

        async def scenario() -> dict:
            stream = await open_generation(ctx, gen_node, "cancel-me", prompt_len=80)
            await stream.aclose()  # the client goes away mid-generation
            return await wait_aborted_and_at_rest(gen_node, 1, timeout=10)

        stats = anyio.run(scenario, backend="asyncio")
        assert stats["engine"]["pool"]["used_blocks"] == 0 and stats["engine"]["budget"]["in_use"] == 0


def test_ctx_stopped_during_the_first_connect_then_continued_gen_lives_and_serves(backend: str) -> None:
    # A CTX stopped (SIGSTOP) before the GEN's first connect to it: the kernel accepts the TCP
    # connection, UCX gets no answer. The receive times out (2 s) and the connect gives up (5 s).
    # Regression (ucx): the given-up ucxx create_endpoint left its peer-info receive posted into a
    # freed buffer, and the GEN died of SIGSEGV when the CTX was continued. Found by an outside drill.
    import os

    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "256", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--num-blocks", "256", "--kv-transfer-timeout-ms", "2000", *kv],
                              env=env) as gen_node:

        async def generate(rid: str) -> dict:
            r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                      "prompt_ids": list(range(40, 100)), "max_tokens": 4},
                                   secret=ctx.secret)
            if rid == "frozen":
                os.killpg(ctx.proc.pid, signal.SIGSTOP)
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            try:
                await stream.send({"op": "generate", "request_id": rid, "prompt_len": r["prompt_len"],
                                   "first_token": r["first_token"], "max_tokens": 4, "kv_peer": r["kv_peer"],
                                   "kv_handle": r["kv_handle"]})
                while not (msg := await stream.receive()).get("done"):
                    pass
                return msg
            finally:
                await stream.aclose()

        async def scenario() -> dict:
            t0 = time.monotonic()
            with anyio.fail_after(10):
                failed = await generate("frozen")
            assert failed["state"] == "failed" and failed["failure"] == "timeout", failed
            await anyio.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))  # past the connect's 5 s
            os.killpg(ctx.proc.pid, signal.SIGCONT)
            await anyio.sleep(2.0)  # the CTX answers what it was sent while stopped
            assert gen_node.alive(), gen_node.log_tail(40)
            if backend == "ucx":  # the given-up connect ran to its end (not cancelled): its late answer
                # closed (a GEN that cancelled it survives where ucxx no longer crashes, as here now)
                with anyio.fail_after(15):
                    while "ucx_connect_answered_late" not in gen_node.log_path.read_text():
                        await anyio.sleep(0.2)
            with anyio.fail_after(20):
                while (done := await generate("after")).get("failure") == "peer_error":
                    await anyio.sleep(0.5)  # (nixl: the peer marked down for a moment)
            assert done["state"] == "finished", done
            return await wait_aborted_and_at_rest(gen_node, 0, timeout=10)

        try:
            anyio.run(scenario, backend="asyncio")
        finally:
            os.killpg(ctx.proc.pid, signal.SIGCONT)
        assert gen_node.alive()


def test_clients_resetting_mid_stream_do_not_kill_gen(backend: str) -> None:
    # A client that vanishes with a TCP reset while tokens stream: GEN's next send fails before (or
    # instead of) its EOF watcher noticing. Regression: that error escaped the request's task group
    # as an ExceptionGroup and took the control server, and the GEN node, down with it.
    import socket
    import struct

    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "512", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "512", *kv], env=env) as gen_node:

        async def scenario() -> dict:
            for i in range(6):
                stream = await open_generation(ctx, gen_node, f"reset-{i}", prompt_len=60)
                raw = stream._stream.extra(anyio.abc.SocketAttribute.raw_socket)  # type: ignore[attr-defined]
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await stream.aclose()  # RST, not FIN
            return await wait_aborted_and_at_rest(gen_node, 6, timeout=15)

        stats = anyio.run(scenario, backend="asyncio")
        assert gen_node.alive()
        assert stats["engine"]["pool"]["used_blocks"] == 0


def test_drill_ctx_killed_mid_load_then_restarted_gen_at_rest_every_round(backend: str) -> None:
    # The node-CLI drill (scripts/drill_ctx_kill.py) in small: 5 MiB pulls (over NIXL, READs the
    # GEN's poller thread posts), the CTX SIGKILLed at a random moment of each round's load.
    import io

    out = io.StringIO()
    report = load_script("drill_ctx_kill.py").run_drill(kv_transport=backend, rounds=2, requests=48, concurrency=8, seed=1, out=out)
    assert report["ok"], out.getvalue()
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["failed"] > 0, f"the kill came after the load ended: it tested nothing ({out.getvalue()})"
        assert not r["rest_problems"]


def test_gen_sigterm_without_etcd_ends_every_stream_and_frees_the_ctx_s_kv(backend: str) -> None:
    """A GEN without --etcd gets SIGTERM with one request running, one received ahead and one
    waiting (its KV still on the CTX, whose lease is a minute): it refuses new requests at once,
    gives the live ones its graceful-shutdown time (1 s; they would run 30 s more), aborts them
    so every stream gets its final message and the CTX frees the waiting one's KV, and exits 0.
    Before, SIGTERM unwound the node wherever it was: streams ended without a final message and
    the CTX held the waiting request's KV until its lease."""
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--lease-s", "60", "--num-blocks", "256", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "256", "--max-num-seqs", "1",
                               "--step", "device", "--device-step-ms", "20", "--graceful-shutdown-timeout-s", "1",
                               *kv], env=env) as gen_node:

        async def generate(rid: str) -> control.JsonStream:
            r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                      "prompt_ids": list(range(40, 120)), "max_tokens": 1500},
                                   secret=ctx.secret)
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            await stream.send({"op": "generate", "request_id": rid, "prompt_len": r["prompt_len"],
                               "first_token": r["first_token"], "max_tokens": 1500, "kv_peer": r["kv_peer"],
                               "kv_handle": r["kv_handle"]})
            return stream

        async def final(stream: control.JsonStream) -> dict:
            with anyio.fail_after(10):
                while not (msg := await stream.receive()).get("done"):
                    assert "error" not in msg, msg
            return msg

        async def scenario() -> tuple[list[dict], dict, str]:
            running = await generate("running")
            assert "tokens" in await running.receive()
            streams = [running, await generate("ahead"), await generate("waiting")]
            with anyio.fail_after(10):  # the third waits (one decoding, one received ahead): its KV is on the CTX
                while (s := await control.call(gen_node.info["ctrl"], {"op": "stats"}, secret=gen_node.secret)
                       )["engine"]["waiting"] != 1:
                    await anyio.sleep(0.05)
            held = await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret)
            assert held["store"]["held_requests"] == 1
            gen_node.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(5):
                while not (await control.call(gen_node.info["ctrl"], {"op": "ping"}, secret=gen_node.secret)
                           )["shutting_down"]:
                    await anyio.sleep(0.02)
            late = await generate("late")
            refused = await late.receive()
            finals = [await final(s) for s in streams]
            with anyio.fail_after(5):
                while (s := await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret)
                       )["store"]["held_requests"] > 1:  # "late" was prefilled and never pulled: its lease
                    await anyio.sleep(0.05)
            return finals, refused, s

        finals, refused, ctx_stats = anyio.run(scenario, backend="asyncio")
        assert "shutting down" in refused.get("error", ""), refused
        assert [f["state"] for f in finals] == ["aborted"] * 3, finals
        assert ctx_stats["store"]["held_requests"] == 1  # only "late"
        gen_node.proc.wait(15)
        assert gen_node.proc.returncode == 0, gen_node.log_tail()


def test_ctx_sigterm_without_etcd_takes_no_new_prefill_lets_its_kv_be_pulled_then_exits(backend: str) -> None:
    """A CTX without --etcd got SIGTERM and exited at once (143): prefills in flight and the GENs'
    pulls of the KV it held failed (an outside drill: 4 to 26 of 64 requests survived). Now it
    refuses new prefills (``unavailable``: a front sends them to another CTX), lets the GEN pull
    what it holds, and exits 0 once nothing is held; a second SIGTERM still exits at once."""
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "256", "--graceful-shutdown-timeout-s", "30", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "256", *kv], env=env) as gen_node:

        async def prefill(rid: str) -> dict:
            return await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                         "prompt_ids": list(range(40, 80)), "max_tokens": 4},
                                      secret=ctx.secret)

        async def scenario() -> tuple[dict, dict, float]:
            held = await prefill("held")  # its KV waits on the CTX for its GEN
            ctx.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(5):
                while not (await control.call(ctx.info["ctrl"], {"op": "ping"}, secret=ctx.secret))["shutting_down"]:
                    await anyio.sleep(0.02)
            with pytest.raises(control.ControlError) as refused:
                await prefill("late")
            assert refused.value.code == control.UNAVAILABLE and "shutting down" in str(refused.value)
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            await stream.send({"op": "generate", "request_id": "held", "prompt_len": held["prompt_len"],
                               "first_token": held["first_token"], "max_tokens": 4, "kv_peer": held["kv_peer"],
                               "kv_handle": held["kv_handle"]})
            with anyio.fail_after(10):
                while not (msg := await stream.receive()).get("done"):
                    assert "error" not in msg, msg
            return msg, refused.value, time.monotonic()

        final, _, pulled_at = anyio.run(scenario, backend="asyncio")
        assert final["state"] == "finished", final
        ctx.proc.wait(10)  # nothing held any more: it stops, well before its 30 s of grace
        assert ctx.proc.returncode == 0 and time.monotonic() - pulled_at < 10, ctx.log_tail()
        assert "sigterm_shutting_down" in ctx.log_path.read_text(errors="replace")


def test_a_ctx_stopping_gracefully_answers_a_prefill_that_waited_for_kv_blocks() -> None:
    """A prefill waiting for KV blocks is in no count of the executor: a CTX stopping on SIGTERM
    read itself idle once the KV it held was released, and stopped under that prefill (lost, no
    answer), though the release had just made room for it. It is taken work: it is answered. (Long
    prompts: the prefill that gets the blocks runs ~0.5 s, far longer than the stop's 20 ms poll,
    so a stop that does not count it cannot miss the moment nothing is held.)"""
    env = node_env()
    with NodeProcess.start(["ctx", "--max-seq-len", "4096", "--num-blocks", "200", "--graceful-shutdown-timeout-s", "20"],
                           env=env) as ctx:

        def prefill(rid: str) -> dict:  # 125 blocks of 16 tokens: the second waits for the first's
            return {"op": "prefill", "request_id": rid, "prompt_ids": [i % 200 for i in range(2000)], "max_tokens": 4}

        async def scenario() -> str:
            first = await control.call(ctx.info["ctrl"], prefill("first"), secret=ctx.secret)
            out: list[str] = []

            async def waiting() -> None:
                try:
                    reply = await control.call(ctx.info["ctrl"], prefill("waits"), secret=ctx.secret)
                    out.append("ok")
                    await control.call(ctx.info["ctrl"], {"op": "release", "request_id": "waits",
                                                          "kv_handle": reply["kv_handle"]}, secret=ctx.secret)
                except Exception as exc:  # noqa: BLE001 (the bug: the connection closed with no answer)
                    out.append(f"{type(exc).__name__}: {exc}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting)
                await anyio.sleep(0.3)  # it waits for blocks
                ctx.proc.send_signal(signal.SIGTERM)
                with anyio.fail_after(5):
                    while not (await control.call(ctx.info["ctrl"], {"op": "ping"}, secret=ctx.secret))["shutting_down"]:
                        await anyio.sleep(0.02)
                await control.call(ctx.info["ctrl"], {"op": "release", "request_id": "first",
                                                      "kv_handle": first["kv_handle"]}, secret=ctx.secret)
            return out[0]

        assert anyio.run(scenario, backend="asyncio") == "ok"
        ctx.proc.wait(10)  # nothing held once "waits" is released: well before the 20 s of grace
        assert ctx.proc.returncode == 0, ctx.log_tail()


def test_a_stopping_ctx_says_unhealthy_in_its_stats() -> None:
    """Review 6: a CTX stopping after SIGTERM still said healthy in ``stats``, so a front's poll put
    back in routing the node that refuses every new prefill, one refusal and retry per poll."""
    env = node_env()
    with NodeProcess.start(["ctx", "--num-blocks", "64", "--graceful-shutdown-timeout-s", "60"], env=env) as ctx:
        call = functools.partial(control.call, ctx.info["ctrl"], secret=ctx.secret)
        assert anyio.run(call, {"op": "stats"})["healthy"] is True
        anyio.run(call, {"op": "prefill", "request_id": "kept", "prompt_ids": [1, 2, 3], "max_tokens": 2})
        ctx.proc.send_signal(signal.SIGTERM)

        async def until_shutting_down() -> dict:
            with anyio.fail_after(5):
                while not (await call({"op": "ping"}))["shutting_down"]:
                    await anyio.sleep(0.02)
            return await call({"op": "stats"})

        stats = anyio.run(until_shutting_down)
        assert stats["healthy"] is False and "shutting down" in stats["health"], stats
        ctx.proc.send_signal(signal.SIGTERM)
        ctx.proc.wait(10)


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_a_sigterm_sent_the_moment_ready_is_read_is_a_graceful_stop(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor may stop a node as soon as it said READY. The graceful stop's signal receiver
    was opened in a task started after READY, and its first use imported anyio's signal module
    (0.1-1 s on a loaded machine): a SIGTERM then met the crude handler, exit 143 and a traceback
    in the log. A cold start, as a supervisor's (the suite's fork server had imported it already)."""
    from examples.two_node import forkserver

    monkeypatch.setattr(forkserver, "_enabled", False)
    env = node_env()
    with contextlib.ExitStack() as stack:
        args = ["ctx", "--num-blocks", "16"]
        if role == "gen":
            ctx = stack.enter_context(NodeProcess.start(args, env=env))
            args = ["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "16"]
        node = stack.enter_context(NodeProcess.start(args, env=env))
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(20)
        log = node.log_path.read_text(errors="replace")
        assert node.proc.returncode == 0, log[-3000:]
        assert "sigterm_shutting_down" in log and "Traceback" not in log, log[-3000:]


def test_a_second_sigterm_stops_a_ctx_that_still_holds_kv_at_once() -> None:
    env = node_env()
    with NodeProcess.start(["ctx", "--num-blocks", "64", "--graceful-shutdown-timeout-s", "60"], env=env) as ctx:
        anyio.run(lambda: control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": "kept",
                                                          "prompt_ids": [1, 2, 3], "max_tokens": 2}, secret=ctx.secret))
        ctx.proc.send_signal(signal.SIGTERM)

        async def until_shutting_down() -> None:
            with anyio.fail_after(5):
                while not (await control.call(ctx.info["ctrl"], {"op": "ping"}, secret=ctx.secret))["shutting_down"]:
                    await anyio.sleep(0.02)

        anyio.run(until_shutting_down)
        time.sleep(0.3)
        assert ctx.proc.poll() is None  # it waits for the KV it holds to be pulled
        ctx.proc.send_signal(signal.SIGTERM)
        ctx.proc.wait(10)
        assert ctx.proc.returncode == 143, ctx.log_tail()
        # the status alone: a SystemExit raised in the signal's task left the event loop at once and
        # asyncio logged the node's main task as "unhandled exception during asyncio.run() shutdown"
        log = ctx.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "unhandled exception" not in log, log[-3000:]


def test_a_second_sigterm_stops_a_gen_at_once_with_143_and_no_traceback() -> None:
    """A second SIGTERM cut a GEN's graceful stop short by raising SystemExit(143) in a task: the exit
    status was right, but the event loop was left at once and asyncio logged a 40-line exception
    group ("unhandled exception during asyncio.run() shutdown") on the node's stderr."""
    env = node_env()
    with NodeProcess.start(["ctx", "--num-blocks", "256"], env=env) as ctx, \
            NodeProcess.start(["gen", "--num-blocks", "256", "--step", "device", "--device-step-ms", "20",
                               "--graceful-shutdown-timeout-s", "60"], env=env) as gen_node:

        async def scenario() -> None:
            r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": "long", "prompt_ids":
                                                      list(range(40, 80)), "max_tokens": 1500}, secret=ctx.secret)
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            await stream.send({"op": "generate", "request_id": "long", "prompt_len": r["prompt_len"],
                               "first_token": r["first_token"], "max_tokens": 1500, "kv_peer": r["kv_peer"],
                               "kv_handle": r["kv_handle"]})
            assert "tokens" in await stream.receive()
            gen_node.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(5):
                while not (await control.call(gen_node.info["ctrl"], {"op": "ping"}, secret=gen_node.secret)
                           )["shutting_down"]:
                    await anyio.sleep(0.02)
            gen_node.proc.send_signal(signal.SIGTERM)  # the live request would run 30 s more: cut short
            with anyio.fail_after(10), contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while not (await stream.receive()).get("done"):
                    pass

        anyio.run(scenario, backend="asyncio")
        gen_node.proc.wait(10)
        assert gen_node.proc.returncode == 143, gen_node.log_tail()
        assert "Traceback" not in gen_node.log_path.read_text(errors="replace"), gen_node.log_tail(60)


def test_a_hand_off_whose_kv_blocks_were_altered_is_refused(backend: str) -> None:
    """A CTX tags the block ids (and epoch) it names with a prefill; a NIXL GEN READs them unasked.
    Before, a generate with the request's own valid handle but another held request's block ids,
    or its own reordered, READ those and "finished" on the wrong KV (an outside drill; over UCX the
    ids are not used). A changed list is refused now; one without its tag is not trusted (the CTX
    finds the blocks itself) and the request finishes on its own KV."""
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "64", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "64", "--step", "device",
                               "--kv-checksums", *kv], env=env) as gen_node:

        async def prefill(rid: str, first: int) -> dict:
            return await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                         "prompt_ids": list(range(first, first + 40)), "max_tokens": 3},
                                      secret=ctx.secret)

        async def generate(r: dict, **source: object) -> dict:
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            await stream.send({"op": "generate", "request_id": r["request_id"], "prompt_len": r["prompt_len"],
                               "first_token": r["first_token"], "max_tokens": 3, "kv_peer": r["kv_peer"],
                               "kv_handle": r["kv_handle"], "kv_sources": [{**r["kv_sources"][0], **source}]})
            with anyio.fail_after(30):
                while not ((msg := await stream.receive()).get("done") or "error" in msg):
                    pass
            await stream.aclose()
            return msg

        async def scenario() -> list[dict]:
            x, y, w = await prefill("x", 10), await prefill("y", 60), await prefill("w", 110)
            other = await generate(y, kv_blocks=x["kv_sources"][0]["kv_blocks"])
            reordered = await generate(w, kv_blocks=x["kv_sources"][0]["kv_blocks"][::-1])
            untagged = await generate(y, kv_blocks=x["kv_sources"][0]["kv_blocks"], kv_blocks_tag=None)  # not used
            tagged = await generate(w)
            for r in (x,):  # never handed off
                await control.call(ctx.info["ctrl"], {"op": "release", "request_id": r["request_id"],
                                                      "kv_handle": r["kv_handle"]}, secret=ctx.secret)
            return [other, reordered, untagged, tagged, y, w]

        other, reordered, untagged, tagged, y, w = anyio.run(scenario, backend="asyncio")
        for refused in (other, reordered):
            assert "are not those its CTX named" in refused.get("error", ""), refused
        assert untagged.get("state") == "finished" and untagged.get("kv_checksums") == y["block_checksums"], untagged
        assert tagged.get("state") == "finished" and tagged.get("kv_checksums") == w["block_checksums"], tagged


def test_a_generate_whose_prompt_len_disagrees_with_the_prefill_is_refused(backend: str) -> None:
    """A CTX node's handle names its prompt's length; the GEN refuses a generate that says otherwise.
    Before, 17 or 32 for a 20-token prefill (two 16-token blocks either way) pulled the same KV and
    decoded from the wrong position, finished, with matching KV checksums; 20 still serves."""
    env = node_env()
    kv = ["--kv-transport", backend]
    with NodeProcess.start(["ctx", "--num-blocks", "64", *kv], env=env) as ctx, \
            NodeProcess.start(["gen", "--ctx", ctx.info["ctrl"], "--num-blocks", "64", "--step", "device", *kv],
                              env=env) as gen_node:

        async def generate(rid: str, prompt_len: int | None) -> dict:
            r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                      "prompt_ids": list(range(40, 60)), "max_tokens": 3},
                                   secret=ctx.secret)
            stream = await control.connect(gen_node.info["ctrl"], secret=gen_node.secret)
            await stream.send({"op": "generate", "request_id": rid, "prompt_len": prompt_len or r["prompt_len"],
                               "first_token": r["first_token"], "max_tokens": 3, "kv_peer": r["kv_peer"],
                               "kv_handle": r["kv_handle"], **({"kv_sources": r["kv_sources"]} if "kv_sources" in r else {})})
            with anyio.fail_after(20):
                while not ((msg := await stream.receive()).get("done") or "error" in msg):
                    pass
            await stream.aclose()
            if "error" in msg:  # refused before anything was pulled: the client frees the CTX's copy
                await control.call(ctx.info["ctrl"], {"op": "release", "request_id": rid, "kv_handle": r["kv_handle"]},
                                   secret=ctx.secret)
            return msg

        async def scenario() -> list[dict]:
            return [await generate("short", 17), await generate("long", 32), await generate("right", None)]

        short, long, right = anyio.run(scenario, backend="asyncio")
    assert "disagrees with the CTX's prefill" in short.get("error", "") and "20 tokens" in short["error"], short
    assert "disagrees with the CTX's prefill" in long.get("error", ""), long
    assert right.get("state") == "finished", right
