"""The front over several real nodes (2 CTX, 4 GEN, running: started here, given to the front by
address, so that it does not restart the ones killed here): ties round-robin within each role, a GEN killed mid-stream (the stream ends with its reason, /health says so at once), and
retries on another node when a prefill or a hand-off fails before any token. The front polls its
nodes only every 30 s here, so what marks a node down is the failure itself, never a poll."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest

from examples.two_node import control
from examples.two_node.launch import NodeProcess, node_env
from tests.test_serve import metrics, running_front, value

pytestmark = pytest.mark.integration

HEAD = """
model: tiny
listen: {host: 127.0.0.1, port: 0}
transfer: {backend: ucx, max_tokens_in_buffer: 256, kv_transfer_timeout_ms: 20000}
limits: {max_prompt_tokens: 512, max_tokens: 600, default_max_tokens: 4}
routing: {stats_interval_s: 30, retry_after_s: 2, connect_timeout_s: 5}
router: {ctx: least_loaded, gen: least_loaded}
max_retries: 2
"""
GEN_ARGS = ["--step", "device", "--num-blocks", "128", "--device-step-ms", "20", "--max-tokens-in-buffer", "256",
            "--kv-transfer-timeout-ms", "20000"]


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Any:
    secret = secrets.token_hex(32)
    env = node_env(secret)
    roles = ["ctx", "ctx", "gen", "gen", "gen", "gen"]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(roles)) as pool:
        futures = [pool.submit(NodeProcess.start, [r, "--no-kv-checksums", *(GEN_ARGS if r == "gen" else
                                                                             ["--num-blocks", "128"])], env=env)
                   for r in roles]
        nodes = [stack.enter_context(f.result()) for f in futures]
        yaml = HEAD + "ctx:\n" + "".join(f"  - addr: {n.info['ctrl']}\n" for n in nodes[:2]) + \
            "gen:\n" + "".join(f"  - addr: {n.info['ctrl']}\n" for n in nodes[2:])
        with running_front(tmp_path_factory.mktemp("front_cluster"), yaml, secret=secret) as info:
            info["pids"] = {n.info["ctrl"]: n.proc.pid for n in nodes}
            yield info


def stats(front: Any, addr: str) -> dict[str, Any]:
    return anyio.run(lambda: control.call(addr, {"op": "stats"}, secret=front["secret"]))


def complete(front: Any, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": "route me", "max_tokens": 3, "ignore_eos": True, **extra}
    return httpx.post(front["url"] + "/v1/completions", json=body, timeout=30)


def pid_of(front: Any, addr: str) -> int:
    return front["pids"][addr]


def test_sequential_requests_alternate_within_each_role(front: Any) -> None:
    before_ctx = [stats(front, a)["prefills"] for a in front["ctx"]]
    before_gen = [stats(front, a)["engine"]["finished"] for a in front["gen"]]
    for _ in range(8):
        assert complete(front).status_code == 200
    assert [stats(front, a)["prefills"] - b for a, b in zip(front["ctx"], before_ctx)] == [4, 4]
    assert [stats(front, a)["engine"]["finished"] - b for a, b in zip(front["gen"], before_gen)] == [2, 2, 2, 2]


def test_gen_killed_mid_stream_ends_it_with_a_reason_and_health_knows_at_once(front: Any) -> None:
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", front["url"] + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while len(events) < 4:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line[6:])
        victim = next(a for a in front["gen"] if stats(front, a)["engine"]["running"])
        os.kill(pid_of(front, victim), signal.SIGKILL)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "gen_unavailable"
    assert f"GEN {victim} went away mid-request: " in error["message"]
    reason = error["message"].split("went away mid-request: ", 1)[1]
    assert reason.strip(), error  # issue 19: the reason was empty
    health = httpx.get(front["url"] + "/health").json()  # no poll for 30 s: the failure marked it down
    assert [n["up"] for n in health["nodes"] if n["addr"] == victim] == [False]
    m = metrics(front["url"] + "/metrics")
    assert value(m, "kvo_front_node_up", node=victim, role="gen") == 0
    assert not [k for k in m if k[0].startswith("kvo_gen_") and ("node", victim) in k[1]]


def test_a_non_streamed_request_outlives_its_gen(front: Any) -> None:
    """Not streamed, nothing has reached the client when its GEN dies mid-decode: the front runs the
    request again on other nodes (a retry) and answers 200 with every token."""
    import threading

    before = metrics(front["url"] + "/metrics")
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=complete(front, max_tokens=150)))
    t.start()
    deadline = time.monotonic() + 20
    victim = None
    while victim is None:
        assert time.monotonic() < deadline
        up = [n["addr"] for n in httpx.get(front["url"] + "/health").json()["nodes"] if n["role"] == "gen" and n["up"]]
        victim = next((a for a in up if stats(front, a)["engine"]["running"]), None)
    os.kill(pid_of(front, victim), signal.SIGKILL)
    t.join(60)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 150 and r.json()["choices"][0]["finish_reason"] == "length"
    after = metrics(front["url"] + "/metrics")
    assert value(after, "kvo_front_retries_total", role="gen") == value(before, "kvo_front_retries_total", role="gen") + 1


def test_failures_before_the_first_token_are_retried_on_another_node(front: Any) -> None:
    """Runs after the GEN kills above: one CTX and one more GEN die unseen (no poll for 30 s); every
    request still succeeds, the failed prefills and hand-offs being tried again elsewhere."""
    up_gens = [n["addr"] for n in httpx.get(front["url"] + "/health").json()["nodes"] if n["role"] == "gen" and n["up"]]
    assert len(up_gens) == 2
    before = metrics(front["url"] + "/metrics")
    for addr in (front["ctx"][0], up_gens[0]):
        os.kill(pid_of(front, addr), signal.SIGKILL)
    time.sleep(0.5)  # the kernel has closed their sockets
    for _ in range(4):
        r = complete(front)
        assert r.status_code == 200, r.text
    after = metrics(front["url"] + "/metrics")
    for role in ("ctx", "gen"):
        assert value(after, "kvo_front_retries_total", role=role) > value(before, "kvo_front_retries_total", role=role)
    health = httpx.get(front["url"] + "/health").json()
    assert {n["addr"] for n in health["nodes"] if not n["up"]} >= {front["ctx"][0], up_gens[0]}
