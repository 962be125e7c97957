"""GEN tensor parallelism with real processes over UCX (issue 9): CTX TP1 -> GEN TP2 / TP4.

Each GEN rank is its own process (torch.distributed gloo group), pulls only its KV heads from the
CTX and decodes its shard of the tiny model; tokens must equal a single-process run bit for bit and
every rank's per-head KV checksums must equal the CTX's. Invariant 11 (rank consistency) is checked
through the ranks' admission digests that rank 0 compares every step.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from examples.two_node import client, control
from examples.two_node.launch import NodeProcess, node_env
from tests.test_two_node import check, run_demo

pytestmark = pytest.mark.integration


def same_admissions(report_tp: dict, n: int) -> None:
    admitted = report_tp["rank_admitted"]
    assert len(admitted) == report_tp["world_size"]
    assert all(a == admitted[0] for a in admitted), admitted  # same requests, same order, every rank
    assert admitted[0][0] == n


@pytest.mark.parametrize("tp", [2, 4])
def test_ctx_tp1_to_gen_tp_equals_a_single_process(tp: int) -> None:
    _, report = run_demo("--gen-tp", str(tp), "--requests", "12", "--concurrency", "6", "--isl", "64", "--osl", "8")
    check(report, 12)  # tokens equal the reference; every (block, head) checksum equals the CTX's
    assert report["gen"]["tp"]["world_size"] == tp
    same_admissions(report["gen"]["tp"], 12)
    # every rank answered rank 0's last statistics request (not a stale once-a-second report)
    loops = report["gen"]["tp"]["rank_loop"]
    assert sorted(loops) == [str(r) for r in range(tp)] and loops["0"]["seq"] > 0
    assert all(v["seq"] == loops["0"]["seq"] for v in loops.values()), {r: v["seq"] for r, v in loops.items()}


def test_backpressure_at_tp4_defers_and_admits_the_same_requests_on_every_rank() -> None:
    # the budget holds one prompt's KV slice: 16 requests at concurrency 16 queue on it
    _, report = run_demo("--gen-tp", "4", "--requests", "16", "--concurrency", "16", "--isl", "64", "--osl", "6",
                         "--max-tokens-in-buffer", "64")
    check(report, 16)
    assert report["gen"]["deferrals"]["backpressure"] > 0
    same_admissions(report["gen"]["tp"], 16)


async def _load(ctx: NodeProcess, gen: NodeProcess, prefix: str, n: int, *, release: bool = False) -> client.LoadResult:
    return await client.run_load(ctx=[ctx.info["ctrl"]], gen=gen.info["ctrl"], secret=ctx.secret,
                                 prompts=client.make_prompts(n, 48, seed=3), max_tokens=4, concurrency=4,
                                 progress=False, id_prefix=prefix, timeout_s=60, release=release)


async def _stats(node: NodeProcess) -> dict:
    return await control.call(node.info["ctrl"], {"op": "stats"}, secret=node.secret)


def test_one_ranks_failed_pull_fails_the_request_on_every_rank_and_all_come_to_rest() -> None:
    env = node_env()
    with NodeProcess.start(["ctx"], env=env) as ctx, \
            NodeProcess.start(["gen", "--tp", "2", "--step", "device", "--inject-pull-failure", "1:doomed"], env=env) as gen:

        async def drive() -> tuple[client.LoadResult, client.LoadResult, dict, dict]:
            doomed = await _load(ctx, gen, "doomed", 4)
            fine = await _load(ctx, gen, "fine", 4)
            with anyio.fail_after(30):
                while (g := await _stats(gen))["rest_problems"]:
                    await anyio.sleep(0.05)
                while (c := await _stats(ctx))["store"]["held_requests"]:
                    await anyio.sleep(0.05)
            return doomed, fine, g, c

        doomed, fine, g, c = anyio.run(drive)
    assert all(r.state == "failed" and r.failure == "peer_error" for r in doomed.records), [r.message for r in doomed.records]
    assert all(r.ok for r in fine.records)
    assert g["engine"]["failed"]["peer_error"] == 4 and g["healthy"]
    same_admissions(g["tp"], 8)
    assert c["store"]["held_requests"] == 0  # rank 0 told the CTX to free each failed copy


def test_a_killed_rank_fails_clients_with_one_readable_cause_and_the_group_serves_again() -> None:
    # TP2 here; TP4 under load, SIGSTOP, and the times the issue asks for: tests/test_tp_heal.py
    env = node_env()
    with NodeProcess.start(["ctx"], env=env) as ctx, \
            NodeProcess.start(["gen", "--tp", "2", "--step", "device", "--kv-transfer-timeout-ms", "10000"], env=env) as gen:

        async def drive() -> tuple[client.LoadResult, client.LoadResult, dict, client.LoadResult, dict]:
            ok = await _load(ctx, gen, "before", 4)
            pid = (await _stats(gen))["tp"]["rank_pids"][0]
            os.kill(pid, signal.SIGKILL)
            # while the group breaks and re-forms: a GEN that refuses a request never saw its KV, so
            # this client frees it (what the GEN held, the GEN frees: tests/test_tp_heal.py)
            after = await _load(ctx, gen, "after", 4, release=True)
            with anyio.fail_after(60):
                while not ((ping := await control.call(gen.info["ctrl"], {"op": "ping"}, secret=gen.secret))["healthy"]
                           and ping["tp"]["restarts"] == 1):
                    await anyio.sleep(0.1)
            again = await _load(ctx, gen, "again", 4)
            with anyio.fail_after(10):  # every CTX copy was freed at once (no lease wait: the lease is 30 s)
                while (c := await _stats(ctx))["store"]["held_requests"]:
                    await anyio.sleep(0.1)
            return ok, after, ping, again, c

        ok, after, ping, again, c = anyio.run(drive)
        assert gen.alive()
    assert all(r.ok for r in ok.records)
    assert ping["tp"]["last_cause"].startswith("GEN rank 1 (pid ") and "was killed by SIGKILL" in ping["tp"]["last_cause"]
    # whichever detector fired first (the watchdog, the step exchange, the decode step), a client that
    # failed sees the one cause, never the transport's text
    assert all(ping["tp"]["last_cause"] in r.message for r in after.records if not r.ok), [r.message for r in after.records]
    assert all(r.ok for r in again.records), [(r.state, r.message) for r in again.records]
    assert c["store"]["held_requests"] == 0


# -- CTX tensor parallelism and fan-in --------------------------------------------------------------

@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (2, 4), (4, 1)])
def test_ctx_tp_to_gen_tp_fans_in_and_equals_a_single_process(ctx_tp: int, gen_tp: int) -> None:
    # (2, 1): GEN's one rank pulls head 0 from CTX rank 0 and head 1 from CTX rank 1 (fan-in);
    # (2, 4): each GEN rank pulls a slice of one CTX rank; (4, 1): two KV heads on four CTX ranks
    # are replicated (vLLM's rule): GEN pulls each head once and the copies nobody pulls are freed
    _, report = run_demo("--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp), "--requests", "10", "--concurrency", "5",
                         "--isl", "64", "--osl", "6")
    check(report, 10)  # tokens equal the reference; every (block, head) checksum equals the CTX ranks'
    assert report["ctx"]["tp"] == [ctx_tp]
    assert report["gen"]["tp"]["world_size"] == gen_tp


def test_a_killed_ctx_rank_fails_what_needs_it_and_the_ctx_group_serves_again() -> None:
    env = node_env()
    with NodeProcess.start(["ctx", "--tp", "2", "--tp-step-timeout-s", "5"], env=env) as ctx, \
            NodeProcess.start(["gen", "--step", "device", "--kv-transfer-timeout-ms", "10000"], env=env) as gen:

        async def drive() -> tuple[client.LoadResult, dict, client.LoadResult, dict]:
            ok = await _load(ctx, gen, "before", 4)
            c = await _stats(ctx)
            assert c["tp"]["world_size"] == 2 and [r["head_range"] for r in c["tp"]["ranks"]] == [[0, 1], [1, 2]]
            os.kill(c["tp"]["rank_pids"][0], signal.SIGKILL)
            with anyio.fail_after(60):
                while not ((ping := await control.call(ctx.info["ctrl"], {"op": "ping"}, secret=ctx.secret))["healthy"]
                           and ping["tp"]["restarts"] == 1):
                    await anyio.sleep(0.1)
            after = await _load(ctx, gen, "after", 4)
            with anyio.fail_after(30):
                while (g := await _stats(gen))["rest_problems"]:
                    await anyio.sleep(0.05)
            return ok, ping, after, g

        ok, ping, after, g = anyio.run(drive)
        assert ctx.alive()
    assert all(r.ok for r in ok.records)
    assert ping["tp"]["last_cause"].startswith("CTX rank 1 (pid ") and "was killed by SIGKILL" in ping["tp"]["last_cause"]
    assert all(r.ok for r in after.records), [(r.state, r.failure, r.message) for r in after.records]
    assert g["healthy"] and g["rest_problems"] == []


@pytest.mark.parametrize(("role", "tp", "why"), [("ctx", "3", "must be 1, 2, 4 or 8"), ("ctx", "8", "does not fit"),
                                                 ("gen", "8", "does not fit")])
def test_a_tp_size_the_model_cannot_split_is_refused_at_start(role: str, tp: str, why: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "examples.two_node", role, "--tp", tp, "--insecure"],
                          capture_output=True, text=True, timeout=120, env=node_env())
    assert proc.returncode != 0
    assert why in proc.stderr, proc.stderr


# -- a stop signal for the whole node -----------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_a_tp_gen_s_process_group_is_a_graceful_stop_of_the_whole_group(sig: int) -> None:
    """A supervisor stops a node by signalling its process group (the launcher's ``killpg``, systemd's
    cgroup kill): every GEN rank gets the SIGTERM. Before, ranks 1..N-1 exited at once, the group
    broke and rank 0's graceful stop failed the live request; now they step on until rank 0 stops
    the group: the live request finishes, a new one is refused, every rank exits 0. An operator's
    Ctrl-C (SIGINT to the group) is the same stop: it was a KeyboardInterrupt traceback per rank,
    exit 130, and the live requests failed as "rank 1 was killed by SIGINT" (an outside drill)."""
    env = node_env()
    with NodeProcess.start(["ctx", "--num-blocks", "256"], env=env) as ctx, \
            NodeProcess.start(["gen", "--tp", "2", "--step", "device", "--device-step-ms", "20", "--num-blocks", "256",
                               "--graceful-shutdown-timeout-s", "20"], env=env) as gen:

        async def generate(rid: str, max_tokens: int) -> control.JsonStream:
            r = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid,
                                                      "prompt_ids": list(range(40, 100)), "max_tokens": max_tokens},
                                   secret=ctx.secret)
            stream = await control.connect(gen.info["ctrl"], secret=gen.secret)
            await stream.send({"op": "generate", "request_id": rid, "prompt_len": r["prompt_len"],
                               "first_token": r["first_token"], "max_tokens": max_tokens, "kv_peer": r["kv_peer"],
                               "kv_handle": r["kv_handle"]})
            return stream

        async def drive() -> tuple[list[int], dict, dict, list[int]]:
            pids = (await _stats(gen))["tp"]["rank_pids"]
            live = await generate("live", 80)
            tokens = list((await live.receive())["tokens"])
            os.killpg(gen.proc.pid, sig)  # rank 0 and rank 1 alike
            with anyio.fail_after(10):
                while not (await control.call(gen.info["ctrl"], {"op": "ping"}, secret=gen.secret))["shutting_down"]:
                    await anyio.sleep(0.02)
            refused = await (await generate("late", 4)).receive()
            with anyio.fail_after(30):
                while not (msg := await live.receive()).get("done"):
                    tokens += msg.get("tokens", [])
            return tokens, msg, refused, pids

        tokens, final, refused, pids = anyio.run(drive)
        gen.proc.wait(30)
        assert gen.proc.returncode == 0, gen.log_tail()
        # its own stop is not a break: no heal killed the ranks it was stopping (an outside drill)
        assert "tp_group_healing" not in gen.log_path.read_text(errors="replace"), gen.log_tail()
        assert "Traceback" not in gen.log_path.read_text(errors="replace"), gen.log_tail()
    assert final["state"] == "finished", final
    assert len(tokens) == 80 - 1  # the first token came from the CTX
    assert "shutting down" in refused.get("error", ""), refused
    for pid in pids:  # every rank is gone (reaped by rank 0), none was killed by its SIGTERM
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("signals", [1, 2])
def test_a_rank_s_sigterm_waits_for_rank_0_at_most_its_bound_and_a_second_one_exits_at_once(signals: int) -> None:
    import subprocess
    import sys

    code = f"""
import os, signal, time
from examples.two_node import tp_group
tp_group.wait_for_rank0_on_sigterm(1.5)
t = time.monotonic()
try:
    for _ in range({signals}):
        os.kill(os.getpid(), signal.SIGTERM)
    while True:
        time.sleep(0.05)
except SystemExit:
    print(round(time.monotonic() - t, 2), flush=True)
    raise
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=node_env())
    assert proc.returncode == 143, proc.stderr
    took = float(proc.stdout.split()[-1])
    if signals == 1:
        assert 1.4 <= took < 10, took  # waited its bound for rank 0 to stop the group, then left
    else:
        assert took < 1.0, took  # a second SIGTERM: at once


def test_sigterm_to_a_tp_ctx_s_process_group_stops_its_ranks_in_order_not_as_a_break() -> None:
    """Rank 0's healer, cancelled as the node stopped, SIGKILLed rank 1 before the node's own stop
    told it to leave: every stop of a CTX group was logged as a broken group (tp_group_broken at
    error, 'rank 1 was killed by SIGKILL'). Now rank 1 leaves when told, and nothing says broken."""
    env = node_env()
    with NodeProcess.start(["ctx", "--tp", "2"], env=env) as ctx:
        pids = anyio.run(_stats, ctx)["tp"]["rank_pids"]
        os.killpg(ctx.proc.pid, signal.SIGTERM)
        ctx.proc.wait(30)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        log = ctx.log_tail(400)
    assert "tp_group_broken" not in log and "SIGKILL" not in log, log
    assert ctx.proc.returncode == 0, log  # a graceful stop (nothing held: at once)


def test_sigterm_to_a_tp_ctx_lets_the_prefills_it_took_finish() -> None:
    """A CTX group's prefill runs on its execution thread, not in the executor that ``busy()``
    counted: a TP CTX that got SIGTERM with prefills running (nothing held yet) read itself idle and
    stopped at once, and every one of them lost its connection with no answer. Now each prefill
    taken before the SIGTERM is answered, and the node stops at its grace (their KV is never pulled)."""
    env = node_env()
    with NodeProcess.start(["ctx", "--tp", "2", "--num-blocks", "256", "--graceful-shutdown-timeout-s", "2"],
                           env=env) as ctx:

        async def one(rid: str, out: dict[str, str]) -> None:
            try:
                await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": rid, "prompt_ids":
                                                      [i % 200 for i in range(400)], "max_tokens": 4},
                                   secret=ctx.secret)
                out[rid] = "ok"
            except control.ControlError as exc:  # taken after the SIGTERM: refused (another CTX takes it)
                out[rid] = exc.code or str(exc)
            except Exception as exc:  # noqa: BLE001 (the bug: the connection closed with no answer)
                out[rid] = f"lost: {type(exc).__name__} {exc}"

        async def scenario() -> dict[str, str]:
            out: dict[str, str] = {}
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, f"r{i}", out)
                with anyio.fail_after(10):  # a prefill is in (the group runs them one by one): 30 ms of
                    while not (await control.call(ctx.info["ctrl"], {"op": "stats"}, secret=ctx.secret))["busy"]:
                        await anyio.sleep(0.005)  # sleep was not always enough on a loaded machine
                ctx.proc.send_signal(signal.SIGTERM)
            return out

        out = anyio.run(scenario, backend="asyncio")
        ctx.proc.wait(20)
        assert ctx.proc.returncode == 0, ctx.log_tail()
    assert out and all(v in ("ok", control.UNAVAILABLE) for v in out.values()), out
    assert "ok" in out.values(), out


def _pull_each_rank_s_part_while_the_ctx_stops(extra_args: list[str], gap_s: float,
                                               wait_stopping: bool) -> list[str]:
    """A TP2 CTX holding one request gets SIGTERM; a GEN TP1 then pulls rank 0's heads and, ``gap_s``
    later, rank 1's. Returns each pull's outcome; the CTX must exit 0 soon after the last."""
    import torch

    from transports import KVLayout, KVSlice
    from transports.ucx import UCXConfig, UCXTransport

    env = node_env()
    layout = KVLayout(2, 2, 32, 16, torch.float32)  # the tiny model's (a GEN TP1's pool: both heads)
    with NodeProcess.start(["ctx", "--tp", "2", "--num-blocks", "64", "--graceful-shutdown-timeout-s", "20",
                            *extra_args], env=env) as ctx:

        async def scenario() -> tuple[list[str], float]:
            held = await control.call(ctx.info["ctrl"], {"op": "prefill", "request_id": "held",
                                                         "prompt_ids": list(range(40, 80)), "max_tokens": 4},
                                      secret=ctx.secret)
            os.killpg(ctx.proc.pid, signal.SIGTERM)
            with anyio.fail_after(5):
                while wait_stopping and not (await control.call(ctx.info["ctrl"], {"op": "ping"},
                                                                secret=ctx.secret))["shutting_down"]:
                    await anyio.sleep(0.02)
            if not wait_stopping:
                await anyio.sleep(0.5)  # the drain has begun (it starts on the signal)
            transport = UCXTransport(UCXConfig(secret=env["KVO_SHARED_SECRET"].encode()), layout=layout,
                                     total_kv_heads=2)
            outcomes: list[str] = []
            try:
                for source in held["kv_sources"]:  # rank 0's heads, then rank 1's, as a GEN TP1 may
                    part = KVSlice(0, 2, 0, source["head_end"] - source["head_start"])  # the rank's own numbering
                    into = torch.empty(layout.wire_shape(layout.blocks_for(held["prompt_len"]), part))
                    try:
                        with anyio.fail_after(10):
                            await transport.pull(source["peer"], "held", part, into, handle=held["kv_handle"])
                        outcomes.append("ok")
                    except Exception as exc:  # noqa: BLE001 (the bug: rank 1 had left)
                        outcomes.append(f"{type(exc).__name__}: {exc}")
                    await anyio.sleep(gap_s)  # the next part waits (the GEN's budget, its other work)
            finally:
                await transport.aclose()
            return outcomes, time.monotonic()

        outcomes, pulled_at = anyio.run(scenario, backend="asyncio")
        ctx.proc.wait(15)
        assert ctx.proc.returncode == 0 and time.monotonic() - pulled_at < 10, ctx.log_tail()
    return outcomes


def test_a_tp_ctx_s_graceful_stop_waits_for_every_rank_s_copy_to_be_pulled() -> None:
    """A GEN TP1 pulls each CTX rank's heads on its own and frees each rank's copy with its pull (the
    parts one after the other when its budget does not fit them at once). A TP CTX stopping on
    SIGTERM counted only rank 0's copies: once rank 0's part was pulled it stopped the group, and
    the pull of rank 1's heads was refused (PeerUnreachable). Now it waits for every rank's copy,
    then stops at once (well before its grace)."""
    outcomes = _pull_each_rank_s_part_while_the_ctx_stops([], 0.3, wait_stopping=True)
    assert outcomes == ["ok", "ok"], outcomes


def test_a_tp_ctx_s_etcd_drain_waits_for_every_rank_s_copy_to_be_pulled() -> None:
    """The same with ``--etcd``, where SIGTERM drains: the drain counted rank 0's copies only, so it
    deregistered and stopped the group 0.5 s after rank 0's part was pulled, and rank 1's pull
    (1.2 s later) was refused."""
    from examples.two_node.membership import start_etcd

    with start_etcd() as url:
        outcomes = _pull_each_rank_s_part_while_the_ctx_stops(["--etcd", url], 1.2, wait_stopping=False)
    assert outcomes == ["ok", "ok"], outcomes
