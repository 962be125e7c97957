"""The OpenAI-compatible front (examples.serve): the real ``openai`` client against a front that
starts one CTX and one GEN node itself (``python -m examples.serve -c cluster.yaml``), tokens
against the single-process reference, SSE bytes, errors, a client that leaves mid-stream, metrics.
The validation, 429 and 503 paths run in-process against a front whose nodes are down."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from examples.serve import _api
from examples.serve._api import TextStream, render_chat
from examples.serve._app import Front
from examples.serve.cluster import Cluster, node_args
from examples.serve.config import ConfigError, parse
from examples.tiny_model import ByteTokenizer, ModelConfig, TinyModel
from examples.two_node import control
from examples.two_node.launch import ROOT

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
CLUSTER_YAML = """
model: tiny
listen: {host: 127.0.0.1, port: 0}
transfer: {backend: ucx, max_tokens_in_buffer: 256, kv_transfer_timeout_ms: 20000}
limits: {max_body_bytes: 65536, max_prompt_tokens: 512, max_tokens: 600, default_max_tokens: 8}
routing: {stats_interval_s: 0.25, retry_after_s: 2}
ctx:
  - launch: {metrics_port: 0, args: ["--num-blocks", "256"]}
gen:
  - launch: {mode: orchestrated, step: model, metrics_port: 0, args: ["--num-blocks", "256"]}
"""


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(ModelConfig())


@contextlib.contextmanager
def running_front(folder: Path, cluster_yaml: str, *, secret: str | None = None, own_secret: bool = False) -> Any:
    """``python -m examples.serve`` on this file; yields its READY fields plus ``secret`` and ``url``;
    stops it (SIGTERM) and checks that it stopped the nodes it started."""
    cfg = folder / "cluster.yaml"
    cfg.write_text(cluster_yaml)
    secret = secret or secrets.token_hex(32)
    env = {**os.environ, "KVO_SHARED_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    if own_secret:  # the front makes one (it starts every node) and says where it wrote it
        del env["KVO_SHARED_SECRET"]
    log = open(folder / "front.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "examples.serve", "-c", str(cfg), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    info: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until READY (or the front exits)
        assert line.startswith("READY "), (folder / "front.log").read_text()[-3000:]
        info = json.loads(line[6:])
        info["secret"] = Path(info["secret_file"]).read_bytes() if own_secret else secret.encode()
        info["url"] = f"http://{info['http']}"
        info["log"] = folder / "front.log"
        yield info
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        for node in info.get("started", []):  # the front stops its nodes; make sure of it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node["pid"], signal.SIGKILL)
                pytest.fail(f"the front left node {node} running")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A front that started its own CTX and GEN node."""
    with running_front(tmp_path_factory.mktemp("serve"), CLUSTER_YAML) as info:
        yield info


@pytest.fixture(scope="module")
def client(front: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


async def _stats(front: Any, role: str) -> dict[str, Any]:
    return await control.call(front[role][0], {"op": "stats"}, secret=front["secret"])


def node_stats(front: Any, role: str) -> dict[str, Any]:
    return anyio.run(_stats, front, role)


def gen_and_ctx_stats(front: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both nodes' ``stats`` asked at once (one probe's time, not two in turn: a latency bound
    polled with them measures the nodes more than the probe)."""
    async def both() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}

        async def one(role: str) -> None:
            out[role] = await _stats(front, role)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "gen")
            tg.start_soon(one, "ctx")
        return out

    out = anyio.run(both)
    return out["gen"], out["ctx"]


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def front_gen_pulls(front: Any) -> bool:
    """Whether the front's GEN receives KV (not the ``ideal`` mode)."""
    return node_stats(front, "gen")["mode"] != "ideal"


def ref_text(ids: list[int]) -> str:
    return TOK.decode(ids)


# -- against the live cluster -------------------------------------------------------------------

def test_completions_match_reference(front: Any, client: openai.OpenAI, model: TinyModel) -> None:
    prompt = "Disaggregated serving moves the KV cache"
    n = 12
    ref = model.generate_reference(TOK.encode(prompt), n)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body=extra)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ref
    assert choice.text == ref_text(ref) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt) + 1, n)

    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text(ref)
    assert [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])] == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_matches_reference(client: openai.OpenAI, model: TinyModel) -> None:
    messages = [{"role": "system", "content": "You are tiny."}, {"role": "user", "content": "Say something."}]
    n = 10
    ref = model.generate_reference(TOK.encode(render_chat(messages)), n)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].message.content == ref_text(ref) and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == n
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text(ref)
    assert chunks[-1].usage.prompt_tokens == len(TOK.encode(render_chat(messages)))


def test_sse_bytes_as_benchmark_clients_read_them(front: Any, model: TinyModel) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", front["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: ") and b"\n" not in ev
        payloads.append(json.loads(ev[len(b"data: "):]))
    usage = payloads[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads[:-1])
    text = "".join(p["choices"][0]["text"] for p in payloads[:-1])
    assert text == ref_text(model.generate_reference(TOK.encode("abc"), 6))


def test_stop_string_ends_the_output(client: openai.OpenAI, model: TinyModel) -> None:
    prompt = "Stop here, please."
    ref = model.generate_reference(TOK.encode(prompt), 24)
    text = ref_text(ref)
    cut = next((i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i),
               None)
    if cut is None:
        pytest.skip("the reference output has no usable stop string")
    stop = text[cut:cut + 2]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == text[:cut]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(front: Any, client: openai.OpenAI) -> None:
    cases = [
        (dict(model="nope", prompt="x"), "model", "model_not_found"),
        (dict(model="tiny", prompt="x", temperature=2.5), "temperature", "invalid_value"),
        (dict(model="tiny", prompt="x", max_tokens=601), "max_tokens", "invalid_value"),
        (dict(model="tiny", prompt="x" * 600), "prompt", "context_length_exceeded"),
        (dict(model="tiny", prompt="x", n=9), "n", "invalid_value"),
        (dict(model="tiny", prompt="x", presence_penalty=0.5), "presence_penalty", "unsupported_value"),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**kwargs)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param and err.value.body["code"] == code, err.value.body
    url = front["url"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 70_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(url + "/version").json()["version"]
    with pytest.raises(openai.BadRequestError) as err:  # the parameter the client sent, not max_tokens
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=100000)
    assert err.value.body["param"] == "max_completion_tokens"
    for extra in ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
                  {"tool_choice": "none"}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **extra)
        assert err.value.body["param"] == next(iter(extra)), err.value.body
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_client_gone_mid_stream_leaves_nodes_at_rest(front: Any) -> None:
    before = metrics(front["url"] + "/metrics")
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", front["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        seen = [line for line, _ in zip(it, range(6))]
        assert seen[0].startswith("data: ")
    # the front closed its generate connection: GEN aborted the request, CTX holds nothing
    deadline = time.monotonic() + 20
    while True:
        gen, ctx = gen_and_ctx_stats(front)
        if not gen["rest_problems"] and ctx["store"]["held_requests"] == 0:
            break
        assert time.monotonic() < deadline, (gen["rest_problems"], ctx["store"])
        time.sleep(0.1)
    assert gen["engine"]["aborted"] >= 1
    deadline = time.monotonic() + 10
    while (after := metrics(front["url"] + "/metrics")) and value(after, "kvo_front_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert value(after, "kvo_front_requests_total", endpoint="/v1/completions", status="499") == \
        value(before, "kvo_front_requests_total", endpoint="/v1/completions", status="499") + 1
    assert value(after, "kvo_front_requests_finished_total", finish_reason="abort") >= 1


def test_client_gone_not_streamed_is_aborted_within_100ms(front: Any) -> None:
    """Issue 19: a non-streaming client that went away was not aborted: GEN decoded to the end and
    the front logged 200. Its ``http.disconnect`` now cancels the flight: GEN aborts the request and
    CTX holds nothing within 100 ms of the client closing its socket."""
    before = node_stats(front, "gen")["engine"]["aborted"]
    body = json.dumps({"model": "tiny", "prompt": "a long answer, not streamed", "max_tokens": 600,
                       "ignore_eos": True}).encode()
    host, port = front["http"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 20
    while node_stats(front, "gen")["engine"]["running"] == 0:  # decoding on GEN
        assert time.monotonic() < deadline
    sock.close()
    t0 = time.monotonic()
    while True:
        asked = time.monotonic() - t0
        gen, ctx = gen_and_ctx_stats(front)
        if gen["engine"]["aborted"] > before and gen["engine"]["running"] == 0 and ctx["store"]["held_requests"] == 0:
            break
        assert asked < 5, (gen["engine"], ctx["store"])
    assert asked < 0.1, f"aborted {asked * 1e3:.0f} ms after the client left"
    m = metrics(front["url"] + "/metrics")
    assert value(m, "kvo_front_requests_total", endpoint="/v1/completions", status="499") >= 1


def test_client_gone_from_a_streamed_n_choices_request_leaves_the_front_whole(front: Any) -> None:
    """A client that closed a streamed ``n`` > 1 request made its producer raise (wrapped in an
    ExceptionGroup) into the front's task group, which also runs the node poller and the supervisor:
    the stats froze, every later streamed ``n`` > 1 request got a 500 and kept its admission slots."""
    url = front["url"]
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 200, "n": 2, "stream": True, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert [line for line, _ in zip(r.iter_lines(), range(2))][0].startswith("data: ")
    time.sleep(1.0)  # several stats rounds (stats_interval_s 0.25)
    m = metrics(url + "/metrics")
    ages = [v for (name, _), v in m.items() if name == "kvo_front_node_stats_age_seconds"]
    assert ages and max(ages) < 2.0, ages  # the node poller still runs
    whole = dict(body, max_tokens=5)
    with httpx.stream("POST", url + "/v1/completions", json=whole, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert {json.loads(line[6:])["choices"][0]["index"] for line in lines[:-1]} == {0, 1}
    deadline = time.monotonic() + 20
    while True:
        m = metrics(url + "/metrics")
        gen, ctx = gen_and_ctx_stats(front)
        if value(m, "kvo_front_requests_running") == 0 and not gen["rest_problems"] and ctx["store"]["held_requests"] == 0:
            break
        assert time.monotonic() < deadline, (value(m, "kvo_front_requests_running"), gen["rest_problems"], ctx["store"])
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert "background_task_failed" not in front["log"].read_text()  # a client gone is no failure


def test_client_gone_during_the_prefill_has_its_kv_released_not_left_to_the_lease(front: Any) -> None:
    """A non-streamed client that went away while its prompt was being prefilled cancelled the
    front's prefill call: the CTX prefilled anyway and held the KV, with no handle at the front to
    release it, until its lease (30 s) ended. Each of these clients leaves at a different moment."""
    before = node_stats(front, "ctx")["store"]
    host, port = front["http"].rsplit(":", 1)
    for i in range(12):
        body = json.dumps({"model": "tiny", "prompt": f"{i} " + "x" * 480, "max_tokens": 50}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.003 * i)
        sock.close()
    deadline = time.monotonic() + 5  # well inside the CTX's lease
    while (ctx := node_stats(front, "ctx")["store"])["held_requests"]:
        assert time.monotonic() < deadline, ctx
        time.sleep(0.05)
    assert ctx["expired"] == before["expired"]  # released, none left to the lease
    assert not node_stats(front, "gen")["rest_problems"]


def test_bodies_json_cannot_hold_are_400s_not_500s(front: Any) -> None:
    url = front["url"]
    deep = b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "foo": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    huge = b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"
    for raw in (deep, huge):
        r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    for path, body, param in (
            ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
            ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
             "messages")):
        r = httpx.post(url + path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1.0, 2.0]})
    assert r.status_code == 400 and "integers" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True,
                                                  "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage", r.text
    # values of refused fields that ask for nothing: accepted
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2, "tools": [], "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                       "max_completion_tokens": 3, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text  # checked, not dropped
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"], r.headers


def test_metrics_move_with_requests(front: Any, client: openai.OpenAI) -> None:
    url = front["url"] + "/metrics"
    time.sleep(0.6)  # two polls of the nodes' stats: an earlier test's last receive is counted before this
    before = metrics(url)
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    time.sleep(0.6)  # two polls of the nodes' stats
    after = metrics(url)
    ok = dict(endpoint="/v1/completions", status="200")
    assert value(after, "kvo_front_requests_total", **ok) == value(before, "kvo_front_requests_total", **ok) + 1
    for h in ("kvo_front_time_to_first_token_seconds_count", "kvo_front_e2e_request_latency_seconds_count"):
        assert value(after, h) == value(before, h) + 1
    assert value(after, "kvo_front_generation_tokens_total") == value(before, "kvo_front_generation_tokens_total") + 5
    gen, ctx = front["gen"][0], front["ctx"][0]
    assert value(after, "kvo_front_node_up", node=gen, role="gen") == 1
    assert value(after, "kvo_gen_requests_finished_total", node=gen) > value(before, "kvo_gen_requests_finished_total", node=gen)
    assert value(after, "kvo_ctx_prefills_total", node=ctx) > value(before, "kvo_ctx_prefills_total", node=ctx)
    assert value(after, "kvo_gen_transfer_budget_capacity_bytes", node=gen) > 0
    assert ("kvo_gen_exec_blocked_seconds", (("node", gen), ("quantile", "0.99"))) in after
    # quantiles belong to a summary (issue 19: they were gauges with a quantile label, not aggregatable)
    types = {f.name: f.type for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}
    for label in ("orchestration", "blocked", "stalled", "model"):
        assert types[f"kvo_gen_exec_{label}_seconds"] == "summary"
    assert value(after, "kvo_gen_exec_blocked_seconds_count", node=gen) > 0
    if front_gen_pulls(front):  # the transfer histograms move with every receive
        for h in ("kvo_gen_kv_transfer_duration_seconds_count", "kvo_gen_kv_transfer_bytes_count"):
            assert value(after, h, node=gen) == value(before, h, node=gen) + 1
        assert value(after, "kvo_gen_kv_transfer_bytes_sum", node=gen) > value(before, "kvo_gen_kv_transfer_bytes_sum", node=gen)
    # each node's own endpoint: the same series, without the node label
    for node in front["started"]:
        own = metrics(f"http://127.0.0.1:{node['metrics']}/metrics")
        name = "kvo_gen_requests_finished_total" if node["role"] == "gen" else "kvo_ctx_prefills_total"
        assert value(own, name) >= 1


def test_concurrent_streams_each_get_their_own_tokens(front: Any, model: TinyModel) -> None:
    prompts = [f"prompt number {i}: " + "x" * (7 * i) for i in range(8)]
    refs = [model.generate_reference(TOK.encode(p), 8) for p in prompts]

    async def one(http: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        ids: list[int] = []
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids

    async def all_of_them() -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        async with httpx.AsyncClient(base_url=front["url"], timeout=60) as http, anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                async def run(i: int = i, p: str = p) -> None:
                    out[i] = await one(http, p)
                tg.start_soon(run)
        return out

    assert anyio.run(all_of_them) == refs


def test_the_load_client_drives_the_front_over_http(front: Any, model: TinyModel) -> None:
    """``python -m examples.two_node client --endpoint URL``: the same load and report through the
    OpenAI API; tokens equal the single-process reference."""
    from examples.two_node import client as load_client

    prompts = load_client.make_prompts(6, 40, seed=11)
    result = anyio.run(lambda: load_client.run_load_http(endpoint=front["url"], prompts=prompts, max_tokens=6,
                                                         concurrency=3, progress=False, timeout_s=60))
    summary = load_client.summarize(result)
    assert summary["failures"] == 0 and summary["succeeded"] == 6, summary["failure_reasons"]
    for rec in result.records:
        assert rec.tokens == model.generate_reference(prompts[rec.index], 6)
        assert rec.ttft_s is not None and len(rec.token_times) == 6
    assert summary["output_tok_s"] > 0 and summary["tpot_ms"]["n"] == 6


def test_a_dead_gen_node_means_503_with_retry_after(front: Any) -> None:
    """Runs last: it kills the cluster's GEN node."""
    gen = next(n for n in front["started"] if n["role"] == "gen")
    os.kill(gen["pid"], signal.SIGKILL)
    body = {"model": "tiny", "prompt": "anyone there?", "max_tokens": 4}
    deadline = time.monotonic() + 15
    while (health := httpx.get(front["url"] + "/health")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert health.headers["retry-after"] == "2"
    assert [n["up"] for n in health.json()["nodes"] if n["role"] == "gen"] == [False]
    r = httpx.post(front["url"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "no_node_available"
    m = metrics(front["url"] + "/metrics")
    assert value(m, "kvo_front_node_up", node=front["gen"][0], role="gen") == 0
    # its last figures are not re-exported as if current (kvo_gen_healthy 1 of a dead GEN: no alert fires)
    assert not [k for k in m if k[0].startswith("kvo_gen_") and ("node", front["gen"][0]) in k[1]]


# -- in process: validation, saturation, nodes down ------------------------------------------------

def _front(**limits: int) -> Front:
    raw = {"model": "tiny", "limits": {"max_concurrent_requests": 4, **limits}, "routing": {"retry_after_s": 3},
           "queue": {"size": 0},
           "ctx": [{"addr": "127.0.0.1:9"}], "gen": [{"addr": "127.0.0.1:9"}]}
    cfg = parse(raw)
    return Front(cfg, Cluster(["127.0.0.1:9"], ["127.0.0.1:9"], secret=b"x" * 32))


def test_nodes_down_503_and_saturated_429() -> None:
    front = _front()
    http = TestClient(front.app)  # no lifespan: the nodes are never polled, so they count as down
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "no_node_available" and r.json()["error"]["type"] == "service_unavailable"
    assert http.get("/health").status_code == 503
    front.admission.active = 4
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "too_many_requests"
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    statuses = {s.labels["status"] for s in fams["kvo_front_requests"].samples}
    assert {"429", "503"} <= statuses


def test_a_requests_background_work_that_raises_never_stops_the_front() -> None:
    """The front's task group also runs the node poller and the supervisor: an exception from one
    request's background work (a response producer, a release) is logged there and goes no further."""
    import structlog

    front = _front()
    ran: list[int] = []

    async def broken() -> None:
        raise RuntimeError("a bug in one response")

    async def fine() -> None:
        ran.append(1)

    with TestClient(front.app) as http, structlog.testing.capture_logs() as logs:
        assert http.portal is not None
        http.portal.call(front.spawn, broken)
        for _ in range(3):
            http.portal.call(anyio.sleep, 0.05)
            http.portal.call(front.spawn, fine)  # raises once the task group has died
        http.portal.call(anyio.sleep, 0.05)
        assert ran == [1, 1, 1]
        assert http.get("/health").status_code == 503  # the nodes are down: answered, not crashed
    assert [e["task"] for e in logs if e["event"] == "background_task_failed"] == [
        "test_a_requests_background_work_that_raises_never_stops_the_front.<locals>.broken"]


def test_a_prefill_that_fails_after_its_client_left_asks_nothing_more() -> None:
    """The prefill call outlives a caller that was cancelled: when it then fails (here the CTX
    accepts and hangs up without an answer), there is nothing to release and nothing to log."""
    import structlog

    from examples.serve._flight import Flight
    from examples.serve.cluster import Node

    front = _front()
    g = _api.parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 2}, model="tiny",
                              limits=front.cfg.limits, max_model_len=front.max_model_len)
    srv = socket.create_server(("127.0.0.1", 0))
    ctx = Node("ctx", "127.0.0.1:%d" % srv.getsockname()[1], down=None)
    released: list[str] = []
    front.spawn_release = lambda node, rid, handle: released.append(rid)  # type: ignore[method-assign]

    async def leave_early() -> None:
        flight = Flight(front, g, "/v1/completions", 0.0)
        with anyio.move_on_after(0.2):
            await flight._prefill(ctx)
        flight.holds_slot = False
        await flight.aclose()

    with TestClient(front.app) as http, structlog.testing.capture_logs() as logs:
        assert http.portal is not None
        http.portal.call(leave_early)
        conn, _ = srv.accept()  # the call is still waiting for an answer: the CTX goes away
        conn.close()
        srv.close()
        http.portal.call(anyio.sleep, 0.3)
    assert not released and not [e for e in logs if e["event"] == "background_task_failed"], logs


def test_text_stream_stop_eos_and_length() -> None:
    ids = list(b"hello world")
    s = TextStream(max_tokens=50, stop=("o w",))
    assert "".join(s.feed([t]) for t in ids) == "hell" and s.finish_reason == "stop"
    s = TextStream(max_tokens=50)
    assert s.feed([*b"ab", TOK.eos_id, *b"cd"]) == "ab" and s.finish_reason == "stop" and len(s.token_ids) == 3
    s = TextStream(max_tokens=50, ignore_eos=True)
    assert s.feed([*b"ab", TOK.eos_id, *b"cd"]) == "abcd" and s.finish_reason is None
    s = TextStream(max_tokens=3, stop=("zz",))
    assert s.feed([*b"abz"]) == "abz" and s.finish_reason == "length"
    s = TextStream(max_tokens=4)  # a UTF-8 character split over tokens, and one cut off by max_tokens
    assert s.feed([0xC3]) == "" and s.feed([0xA9]) == "\u00e9" and s.feed([0x41, 0xE2]) == "A\ufffd"


def test_cluster_file() -> None:
    cfg = parse({"ctx": [{"addr": "10.0.0.1:9000"}], "gen": [{"launch": {"mode": "ideal", "args": ["--num-blocks", 64]}}],
                 "transfer": {"max_tokens_in_buffer": 512, "kv_transfer_timeout_ms": 5000}})
    args = node_args(cfg.gen[0], cfg)
    assert args[:2] == ["gen", "--host"] and "--no-kv-checksums" in args and "--max-tokens-in-buffer" in args and args[-2:] == ["--num-blocks", "64"]
    assert "--mode" in args and args[args.index("--mode") + 1] == "ideal" and "--tp" not in args
    tp = parse({"ctx": [{"addr": "10.0.0.1:9000"}], "gen": [{"launch": {"tensor_parallel_size": 4}}]})
    assert node_args(tp.gen[0], tp)[-2:] == ["--tp", "4"]
    ctx_tp = parse({"ctx": [{"launch": {"tensor_parallel_size": 2}}], "gen": [{"addr": "10.0.0.2:9100"}]})
    assert node_args(ctx_tp.ctx[0], ctx_tp)[-2:] == ["--tp", "2"]
    for bad, what in [({"secret": "x"}, "secret"), ({"transfer": {"backend": "tcp"}}, "backend"),
                      ({"transfer": {"max_tokens_in_buffer": 1, "transfer_budget_bytes": 2}}, "not both"),
                      ({"limits": {"max_tokens": "many"}}, "limits.max_tokens"), ({"gen": []}, "gen"),
                      ({"ctx": [{"addr": "nohost"}]}, "ctx[0].addr"), ({"colour": 1}, "unknown"),
                      ({"ctx": [{"launch": {"tensor_parallel_size": 3}}]}, "tensor_parallel_size")]:
        raw = {"ctx": [{"addr": "10.0.0.1:9000"}], "gen": [{"addr": "10.0.0.2:9100"}], **bad}
        with pytest.raises(ConfigError, match=re.escape(what)):
            parse(raw)
    example = Path(ROOT, "examples/serve/cluster.yaml")
    from examples.serve.config import load

    assert load(example).gen[0].launched


def test_chat_template() -> None:
    text = render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert text == "<|user|>\nab\n<|assistant|>\n"
    with pytest.raises(_api.ApiError):
        render_chat([{"role": "wizard", "content": "x"}])


def test_a_front_that_cannot_listen_says_so_in_one_line_before_any_node_starts() -> None:
    """A port in use, an address this host lacks, a port out of range: each was a 12-line traceback
    (an outside run of the README); now one line (or argparse's own), exit non-zero, no node started."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = {**os.environ, "KVO_SHARED_SECRET": secrets.token_hex(32)}
    try:
        for extra, want in ((["--port", str(port)], f"error: cannot listen on 127.0.0.1:{port}"),
                            (["--host", "10.255.255.1", "--port", "0"], "error: cannot listen on 10.255.255.1:0"),
                            (["--port", "70000"], "argument --port")):
            r = subprocess.run([sys.executable, "-m", "examples.serve", "-c", "examples/serve/cluster.yaml", *extra],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode != 0 and "Traceback" not in r.stderr and want in r.stderr, (extra, r.stderr[-1500:])
            assert "node_started" not in r.stderr and "READY" not in r.stdout
    finally:
        taken.close()


def test_unknown_field_names_are_remembered_and_logged_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each unknown field name was kept for ever (to log it once) and logged: a client sending 900
    new 1,000-character names per request grew the front ~1 MiB and 900 log lines per request,
    refused requests included (an outside review of bounded memory). The names remembered are
    bounded; past the bound a request with new names is one log line."""
    import structlog

    monkeypatch.setattr(_api, "_IGNORED_LOGGED", set())
    with structlog.testing.capture_logs() as logs:
        for i in range(50):
            _api._log_ignored({"prompt": "x", **{f"f{i}_{j}_" + "n" * 1000: 1 for j in range(900)}}, "completions")
    assert len(_api._IGNORED_LOGGED) <= _api.MAX_IGNORED_LOGGED
    assert len(logs) == 50 and all(e["event"] == "ignored_request_fields" and e["count"] == 900 for e in logs)
    monkeypatch.setattr(_api, "_IGNORED_LOGGED", set())
    with structlog.testing.capture_logs() as logs:
        _api._log_ignored({"prompt": "x", "zeta": 2, "alpha": "u"}, "completions")
        _api._log_ignored({"prompt": "x", "zeta": 2}, "completions")
    assert [e["field"] for e in logs] == ["alpha", "zeta"]  # each once, as before


def test_seeds_outside_64_bits_are_refused_and_every_accepted_seed_is_its_own() -> None:
    """Seeds were reduced modulo 2^63 without a word: 0, 2^64 and 2^80 sampled the same text, and so
    did -5 and 2^64 - 5 (an outside review). A seed is now a 64-bit signed integer, as vLLM's, and
    each one reaches the nodes as a different 64-bit seed; top_p's errors agree on its range."""
    front = _front()

    def parse(**extra: Any) -> _api.Generation:
        return _api.parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 2, **extra}, model="tiny",
                                     limits=front.cfg.limits, max_model_len=front.max_model_len)

    for seed in (1 << 63, 1 << 64, 1 << 80, -(1 << 63) - 1):
        with pytest.raises(_api.ApiError) as err:
            parse(seed=seed)
        assert err.value.status == 400 and err.value.param == "seed", err.value.message
    seeds = [0, 5, -5, (1 << 63) - 5, (1 << 63) - 1, -(1 << 63)]
    sent = [parse(seed=s).sampling["seed"] for s in seeds]
    assert len(set(sent)) == len(seeds) and all(0 <= s < 1 << 64 for s in sent), sent
    assert parse(seed=5).sampling["seed"] == 5  # a non-negative seed is sent as it is (outputs unchanged)
    from orchestrator._sampling import SamplingParams
    assert len({SamplingParams.from_wire({"seed": s}).seed for s in sent}) == len(seeds)  # the node keeps them apart
    messages = set()
    for top_p in (0, 1.1, -0.5, float("nan")):
        with pytest.raises(_api.ApiError) as err:
            parse(top_p=top_p)
        messages.add(err.value.message)
    assert messages == {"top_p must be a number in (0, 1]"}
