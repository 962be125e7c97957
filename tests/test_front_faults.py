"""The front against fake CTX and GEN nodes (the real control protocol, insecure, in this process)
and a real uvicorn on loopback: admission of n choices, GEN refusals and deaths, drains refused,
deadlines, membership trouble, metrics per HTTP request. Each fake node records what the front asked
of it (prefills, releases, generates, aborts), so a test asserts what the nodes were left holding."""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import uvicorn

from examples.serve._app import Front
from examples.serve.cluster import Cluster
from examples.serve.config import parse
from examples.two_node import control

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeCtx:
    """Prefills answer at once (after ``delay_s``) with ``first_token``; the KV "held" until released."""

    def __init__(self, first_token: int = 65, delay_s: float = 0.0) -> None:
        self.first_token = first_token
        self.delay_s = delay_s
        self.prefills: list[str] = []
        self.held: dict[str, str] = {}
        self.released: list[str] = []
        self.addr = ""

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        op = msg.get("op")
        if op == "stats":
            await stream.send({"ok": True, "store": {"held_requests": len(self.held)}, "pool": {"used_blocks": 0}})
        elif op == "prefill":
            rid = msg["request_id"]
            self.prefills.append(rid)
            await anyio.sleep(self.delay_s)
            self.held[rid] = handle = secrets.token_hex(16)
            await stream.send({"ok": True, "request_id": rid, "first_token": self.first_token,
                               "prompt_len": len(msg["prompt_ids"]), "kv_peer": "127.0.0.1:1", "kv_handle": handle})
        elif op == "release":
            self.released.append(msg["request_id"])
            self.held.pop(msg["request_id"], None)
            await stream.send({"ok": True, "released": True})
        elif op == "drain":
            await stream.send({"ok": False, "error": "this node is not registered in etcd (--etcd)"})
        else:
            raise control.ControlError(f"unknown op {op!r}")


Behaviour = Callable[[dict[str, Any], control.JsonStream, "FakeGen"], Awaitable[None]]


class FakeGen:
    """``generate``: ``behaviour(msg, stream, gen)`` when given, else ``finish``: the pull (the KV
    leaves ``ctx``), then max_tokens - 1 tokens "a" (97), one per ``delay_s``, then done/finished."""

    def __init__(self, behaviour: Behaviour | None = None, *, ctx: FakeCtx | None = None, delay_s: float = 0.005) -> None:
        self.behaviour = behaviour
        self.ctx = ctx
        self.delay_s = delay_s
        self.healthy = True
        self.generates: list[str] = []
        self.addr = ""

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        op = msg.get("op")
        if op == "stats":
            await stream.send({"ok": True, "healthy": self.healthy, "mode": "orchestrated",
                               "engine": {"waiting": 0, "receiving": 0, "ready": 0, "running": 0,
                                          "pool": {"used_blocks": 0}}})
        elif op == "generate":
            self.generates.append(msg["request_id"])
            if self.behaviour is not None:
                await self.behaviour(msg, stream, self)
                return
            await finish(msg, stream, self)
        elif op == "drain":
            await stream.send({"ok": False, "error": "this node is not registered in etcd (--etcd)"})
        else:
            raise control.ControlError(f"unknown op {op!r}")


async def finish(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
    if gen.ctx is not None:
        gen.ctx.held.pop(msg["request_id"], None)  # pulled: the CTX frees its copy
    for _ in range(msg["max_tokens"] - 1):
        await anyio.sleep(gen.delay_s)
        await stream.send({"tokens": [97]})
    await stream.send({"done": True, "state": "finished", "failure": None, "message": ""})


@contextlib.asynccontextmanager
async def front_on(ctxs: list[FakeCtx], gens: list[FakeGen], **extra: Any) -> AsyncIterator[tuple[Front, httpx.AsyncClient]]:
    """The fake nodes serving, a front over them on a loopback port, and an HTTP client for it."""
    async with anyio.create_task_group() as tg:
        for n in [*ctxs, *gens]:
            port = await tg.start(lambda task_status, n=n: control.serve(
                "127.0.0.1", 0, n.handle, secret=None, insecure=True, task_status=task_status))
            n.addr = f"127.0.0.1:{port}"
        cfg = parse({"model": "tiny", "insecure": True,
                     "routing": {"stats_interval_s": 0.2, "retry_after_s": 1, "connect_timeout_s": 2},
                     "ctx": [{"addr": n.addr} for n in ctxs], "gen": [{"addr": n.addr} for n in gens], **extra})
        cluster = Cluster([n.addr for n in ctxs], [n.addr for n in gens], secret=None,
                          interval_s=cfg.routing.stats_interval_s, timeout_s=cfg.routing.connect_timeout_s,
                          policies={"ctx": cfg.router.ctx, "gen": cfg.router.gen})
        front = Front(cfg, cluster)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(front.app, host="127.0.0.1", port=port, log_level="error"))
        tg.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                yield front, http
        finally:
            server.should_exit = True
            tg.cancel_scope.cancel()


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.01)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0, **fields}


# -- admission of n choices -----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_requests_of_n_choices_never_deadlock_admission(stream: bool) -> None:
    """Two slow requests hold 2 of 3 slots; A (n=3) then B (n=2) queue. Taking one slot per choice,
    A and B each ended up holding part of what they needed and waited for each other until the queue
    timeout (429); taken all at once, both are served once the slow ones end."""
    gates = {50: anyio.Event(), 60: anyio.Event()}

    async def gated(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
        if msg["max_tokens"] in gates:
            await gates[msg["max_tokens"]].wait()
        await finish(msg, stream, gen)

    status: dict[str, int] = {}
    async with front_on([FakeCtx()], [FakeGen(gated)], limits={"max_concurrent_requests": 3, "max_tokens": 100},
                        queue={"size": 8, "timeout_s": 2}) as (front, http):
        await wait_until(front.cluster.ready)

        async def post(name: str, **fields: Any) -> None:
            status[name] = (await http.post("/v1/completions", json=completion(stream=stream, **fields))).status_code

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: post("r1", max_tokens=50))
            tg.start_soon(lambda: post("r2", max_tokens=60))
            await wait_until(lambda: front.admission.active == 2)
            tg.start_soon(lambda: post("a", n=3))
            await wait_until(lambda: front.admission.statistics().waiting == 1)
            tg.start_soon(lambda: post("b", n=2))
            await wait_until(lambda: front.admission.statistics().waiting == 2)
            gates[50].set()
            await wait_until(lambda: "r1" in status)
            gates[60].set()
        assert front.admission.active == 0
    assert status == {"r1": 200, "r2": 200, "a": 200, "b": 200}


# -- /admin/drain ---------------------------------------------------------------------------------

async def test_a_drain_the_node_refused_leaves_it_serving() -> None:
    """A node started without --etcd refuses the drain (ok: false): this front must not stop sending
    it requests as if it were draining."""
    ctx = FakeCtx()
    async with front_on([ctx], [FakeGen()]) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/admin/drain", json={"node": ctx.addr})
        assert r.status_code == 503 and r.json()["error"]["code"] == "node_unavailable"
        assert "etcd" in r.json()["error"]["message"]
        health = (await http.get("/health")).json()
        assert health["status"] == "ok"
        assert [n["draining"] for n in health["nodes"] if n["addr"] == ctx.addr] == [False]
        assert (await http.post("/v1/completions", json=completion())).status_code == 200


async def test_a_drain_without_a_node_is_a_400_naming_it() -> None:
    """A body without a usable ``node`` was a 404 "no node None in this cluster" (an outside review):
    the request is malformed, not about a node that does not exist."""
    async with front_on([FakeCtx()], [FakeGen()]) as (front, http):
        await wait_until(front.cluster.ready)
        for body, code in (({"nodes": "x"}, "missing_required_parameter"), ({"node": 5}, "invalid_value"),
                           ({"node": ""}, "invalid_value"), ({"node": ["a"]}, "invalid_value")):
            r = await http.post("/admin/drain", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == "node" and r.json()["error"]["code"] == code, r.text
        r = await http.post("/admin/drain", json={"node": "127.0.0.1:1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found"


async def test_a_body_that_trickles_in_is_a_408_and_frees_its_connection() -> None:
    """A client that sent its headers and part of its body, then nothing, held its connection and its
    buffer for as long as it liked (no read timeout on the body): now ``limits.body_timeout_s``."""
    async with front_on([FakeCtx()], [FakeGen()], limits={"body_timeout_s": 0.5}) as (front, http):
        await wait_until(front.cluster.ready)
        port = int(str(http.base_url).rsplit(":", 1)[1].strip("/"))
        t0 = time.monotonic()
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", ')
            answer, closed = b"", False
            with anyio.fail_after(5):
                while not closed:  # the answer, then the server closes the connection (a trickler holds none)
                    try:
                        answer += await sock.receive()
                    except anyio.EndOfStream:
                        closed = True
        assert time.monotonic() - t0 < 3.0
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower(), answer[:300]
        assert b'"code":"request_timeout"' in answer.replace(b" ", b""), answer
        r = await http.post("/v1/completions", json=completion())  # the front serves on
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("queue_size", [0, 2], ids=["queue-full", "queue-wait-ends"])
async def test_a_request_the_queue_turns_away_while_the_front_stops_is_told_to_go_elsewhere(queue_size: int) -> None:
    """During the front's graceful stop, a queued request whose wait ended got 429 "retry later" with
    Retry-After (an outside review): later, here, nothing will serve it. It is 503 shutting_down; a
    request still admitted within the grace is served as before."""
    async with front_on([FakeCtx()], [FakeGen()], limits={"max_concurrent_requests": 1},
                        queue={"size": queue_size, "timeout_s": 0.3}) as (front, http):
        await wait_until(front.cluster.ready)
        front.admission.active = 1  # every slot taken (a request in flight)
        front.begin_shutdown()
        r = await http.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        front.admission.leave(1)
        assert (await http.post("/v1/completions", json=completion())).status_code == 200


# -- a CTX that stops (SIGTERM without etcd) -------------------------------------------------------

class StoppingCtx(FakeCtx):
    """A CTX after SIGTERM without etcd: it refuses every new prefill with code ``unavailable``."""

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        if msg.get("op") == "prefill":
            self.prefills.append(msg["request_id"])
            raise control.ControlError("this CTX node is shutting down: send the prefill to another CTX",
                                       code=control.UNAVAILABLE)
        await super().handle(msg, stream)


async def test_a_ctx_that_refuses_as_stopping_takes_no_further_prefill() -> None:
    """Review 6 (SIGTERM on a CTX under load): its refusal with code ``unavailable`` left it routable,
    so every other request paid a refused prefill and a retry until it exited (with max_retries 0,
    a 503 each); like a refusing GEN it is down until a later poll succeeds."""
    stopping, good = StoppingCtx(), FakeCtx()
    async with front_on([stopping, good], [FakeGen(ctx=good)], router={"ctx": "round_robin", "gen": "round_robin"},
                        routing={"stats_interval_s": 30, "retry_after_s": 1, "connect_timeout_s": 2},
                        max_retries=1) as (front, http):
        await wait_until(front.cluster.ready)
        for _ in range(4):
            r = await http.post("/v1/completions", json=completion())
            assert r.status_code == 200
        assert len(stopping.prefills) == 1 and len(good.prefills) == 4
        assert not front.cluster.find(stopping.addr).up  # type: ignore[union-attr]
        assert front.metrics.retries.labels("ctx")._value.get() == 1


# -- a GEN that refuses or dies before it pulled ------------------------------------------------

async def refuse(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
    raise control.ControlError("GEN engine unavailable: starting")  # the node answers {"ok": false}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gen_refusal_before_any_token_goes_to_another_gen(stream: bool) -> None:
    """A refusal touches nothing on GEN: the request goes to another GEN with the same KV (no token
    but the CTX's first has reached the client), and the refusing GEN is marked down."""
    ctx = FakeCtx()
    bad, good = FakeGen(refuse), FakeGen(ctx=ctx)
    async with front_on([ctx], [bad, good], router={"ctx": "round_robin", "gen": "round_robin"},
                        max_retries=2) as (front, http):
        await wait_until(front.cluster.ready)
        for _ in range(2):  # round robin: one of them goes to the refusing GEN first
            r = await http.post("/v1/completions", json=completion(max_tokens=4, stream=stream))
            assert r.status_code == 200
            assert ("Aaaa" in r.text) if not stream else r.text.count('"text":"a"') == 3
        assert len(bad.generates) == 1 and len(good.generates) == 2
        assert not front.cluster.find(bad.addr).up  # type: ignore[union-attr]
        assert front.metrics.retries.labels("gen")._value.get() == 1
        assert ctx.held == {} and ctx.released == []  # the healthy GEN pulled both


async def test_a_gen_refusal_with_no_other_gen_releases_the_kv_at_once() -> None:
    ctx = FakeCtx()
    async with front_on([ctx], [FakeGen(refuse)]) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "gen_refused"
        await wait_until(lambda: ctx.released == ctx.prefills)
        assert ctx.held == {}


async def refuse_too_large(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
    raise control.ControlError(f"{msg['request_id']}: needs 14 KV blocks, the pool has 8", code="context_length_exceeded")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gen_refusal_about_the_request_is_a_400_and_marks_no_node_down(stream: bool) -> None:
    """A request no GEN can hold (its KV over the pool) was refused by each GEN in turn: each was
    marked down for every client (503 no_node_available for good requests) and the client got a 503
    with Retry-After, which SDKs retry. The GEN says the refusal is about the request: a 400, once."""
    ctx = FakeCtx()
    gens = [FakeGen(refuse_too_large), FakeGen(refuse_too_large)]
    async with front_on([ctx], gens, max_retries=2) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=4, stream=stream))
        if stream:  # the refusal comes after the first chunk: an error event, then [DONE]
            assert r.status_code == 200 and '"code":"context_length_exceeded"' in r.text and r.text.endswith("[DONE]\n\n")
        else:
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "Retry-After" not in r.headers
        assert sum(len(g.generates) for g in gens) == 1  # not retried on the other GEN
        assert all(n.up for n in front.cluster.nodes) and (await http.get("/health")).status_code == 200
        assert front.metrics.retries.labels("gen")._value.get() == 0
        await wait_until(lambda: ctx.released == ctx.prefills)  # the CTX's copy released at once


async def test_no_gen_up_after_the_prefill_says_so() -> None:
    """The only GEN went down while a request was prefilled: its 503 said "no CTX node is up"."""
    ctx, gen = FakeCtx(delay_s=0.5), FakeGen()
    async with front_on([ctx], [gen], routing={"stats_interval_s": 60, "connect_timeout_s": 2}) as (front, http):
        await wait_until(front.cluster.ready)
        async with anyio.create_task_group() as tg:
            answer: dict[str, Any] = {}

            async def post() -> None:
                answer["r"] = await http.post("/v1/completions", json=completion())

            tg.start_soon(post)
            await wait_until(lambda: len(ctx.prefills) == 1)
            front.cluster.mark_down(front.cluster.find(gen.addr), "test")  # type: ignore[arg-type]
        r = answer["r"]
        assert r.status_code == 503 and r.json()["error"]["message"] == "no GEN node is up"
        await wait_until(lambda: ctx.released == ctx.prefills)


async def two_byte_char(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
    lp = [[-0.5, []]]
    await stream.send({"tokens": [0xC3], "logprobs": lp})  # "é" in two tokens, then "b", "c"
    await stream.send({"tokens": [0xA9, 98], "logprobs": lp * 2})
    await stream.send({"tokens": [99], "logprobs": lp})
    await stream.send({"done": True, "state": "finished", "failure": None, "message": ""})


async def test_text_offset_indexes_the_text_the_same_streamed_or_not() -> None:
    """text_offset advanced by len("bytes:\\xc3") (10) per byte of a character: offsets pointed past
    the end of the text, and the streamed answer (advanced by the text sent) said other offsets."""
    import json

    async with front_on([FakeCtx()], [FakeGen(two_byte_char)]) as (front, http):
        await wait_until(front.cluster.ready)
        body = completion(max_tokens=5, logprobs=0)
        whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        streamed: list[int] = []
        r = await http.post("/v1/completions", json={**body, "stream": True})
        for line in r.text.splitlines():
            if line.startswith("data: {") and (lp := json.loads(line[6:])["choices"][0]["logprobs"]):
                streamed += lp["text_offset"]
    assert whole["text"] == "A\u00e9bc"
    assert whole["logprobs"]["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "b", "c"]  # (the CTX's "A" has none)
    assert whole["logprobs"]["text_offset"] == [1, 1, 2, 3] == streamed


async def test_a_gen_that_dies_before_it_pulled_has_the_ctx_copy_released() -> None:
    """Not streamed, a GEN that died mid-request costs a retry of the whole flight: the first
    prefill's KV, never pulled, is released on the CTX (not left to its lease), the retry's is pulled."""
    ctx = FakeCtx()

    async def die(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
        await stream.send({"tokens": [97]})
        await stream.aclose()  # the node went away before its pull

    dying, good = FakeGen(die), FakeGen(ctx=ctx)
    async with front_on([ctx], [dying, good], router={"ctx": "round_robin", "gen": "round_robin"}) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=4))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Aaaa"
        assert len(ctx.prefills) == 2 and dying.generates == ctx.prefills[:1]
        await wait_until(lambda: ctx.released == ctx.prefills[:1])
        assert ctx.held == {}


async def test_min_tokens_holds_stop_strings_back() -> None:
    """vLLM applies no stop string before min_tokens tokens: the CTX's "A", then GEN's "a"s."""
    async with front_on([FakeCtx()], [FakeGen()]) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=8, min_tokens=6, stop="a"))
        choice, used = r.json()["choices"][0], r.json()["usage"]
        assert (choice["text"], choice["finish_reason"], used["completion_tokens"]) == ("Aaaaa", "stop", 6)


# -- etcd ------------------------------------------------------------------------------------------

async def test_a_front_serves_its_fixed_nodes_while_etcd_is_unreachable() -> None:
    """etcd down when the front starts: it serves its fixed nodes at once, says why in /health, and
    keeps trying etcd in the background."""
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    async with front_on([FakeCtx()], [FakeGen()], etcd={"url": dead, "prefix": "/kvo/none/"}) as (front, http):
        await wait_until(front.cluster.ready)
        assert (await http.post("/v1/completions", json=completion())).status_code == 200
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["etcd"]["url"] == dead and health["etcd"]["ok"] is False
        assert "127.0.0.1" in health["etcd"]["error"]


# -- request_timeout_s ------------------------------------------------------------------------------

async def test_a_prefill_slower_than_the_request_timeout_is_a_504_and_its_kv_released() -> None:
    """The request's time ran out, not the CTX: a 504, the CTX still up, and the prefill's KV (it
    answers late, to nobody) released at once, not left to the CTX's lease."""
    ctx, gen = FakeCtx(delay_s=1.5), FakeGen()
    async with front_on([ctx], [gen], routing={"request_timeout_s": 0.3, "stats_interval_s": 0.2,
                                               "connect_timeout_s": 2}) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion())
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert gen.generates == []  # the 504 came at the deadline, while the prefill still ran
        assert front.cluster.find(ctx.addr).up  # type: ignore[union-attr]
        assert front.metrics.retries.labels("ctx")._value.get() == 0
        await wait_until(lambda: len(ctx.prefills) == 1 and ctx.released == ctx.prefills)
        assert ctx.held == {}


async def test_a_retried_request_keeps_its_deadline() -> None:
    """Not streamed, a GEN that dies costs a retry of the whole flight: within the same
    request_timeout_s, not a fresh one (1 s here; the retry alone would fit in it, both do not)."""
    ctx = FakeCtx()

    async def die_late(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
        await anyio.sleep(0.7)
        await stream.aclose()

    slow = FakeGen(ctx=ctx, delay_s=0.2)  # 3 tokens from GEN: 0.6 s
    async with front_on([ctx], [FakeGen(die_late), slow], router={"ctx": "round_robin", "gen": "round_robin"},
                        routing={"request_timeout_s": 1, "stats_interval_s": 0.2, "connect_timeout_s": 2}) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=4))
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert len(slow.generates) == 1  # it was retried, and that retry ran out of the request's time
        await wait_until(lambda: ctx.held == {})


# -- metrics, per HTTP request --------------------------------------------------------------------

def sample(front: Front, name: str, **labels: str) -> float:
    return front.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_failing_health_check_is_counted() -> None:
    gen = FakeGen()
    gen.healthy = False
    async with front_on([FakeCtx()], [gen]) as (front, http):
        await wait_until(lambda: front.cluster.find(gen.addr).stats is not None)  # type: ignore[union-attr]
        assert (await http.get("/health")).status_code == 503
        assert sample(front, "kvo_front_requests_total", endpoint="/health", status="503") == 1


async def test_a_retried_request_is_counted_once() -> None:
    """Not streamed, a GEN that died costs a retry of the whole flight: one request, one finish
    (length, no error), one TTFT, and the 4 tokens returned (not the dead flight's too)."""
    ctx = FakeCtx()

    async def die(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
        await stream.send({"tokens": [97]})
        await stream.aclose()

    async with front_on([ctx], [FakeGen(die), FakeGen(ctx=ctx)],
                        router={"ctx": "round_robin", "gen": "round_robin"}) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=4))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert sample(front, "kvo_front_retries_total", role="gen") == 1
        assert sample(front, "kvo_front_requests_total", endpoint="/v1/completions", status="200") == 1
        assert sample(front, "kvo_front_requests_finished_total", finish_reason="length") == 1
        assert sample(front, "kvo_front_requests_finished_total", finish_reason="error") == 0
        assert sample(front, "kvo_front_time_to_first_token_seconds_count") == 1
        assert sample(front, "kvo_front_generation_tokens_total") == 4


class OddGen(FakeGen):
    """A node that answers ``stats`` without the fields routing reads (another program, or version)."""

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        if msg.get("op") == "stats":
            await stream.send({"ok": True, "healthy": True, "engine": {"waiting": 0}})
            return
        await super().handle(msg, stream)


async def test_a_node_whose_stats_lack_what_routing_reads_is_not_routed_to() -> None:
    """Routing read a GEN's load from its last stats answer by key: one without them raised
    KeyError in every pick (an outside review). Such an answer now marks the node down, with why,
    and the requests go to the other GEN."""
    ctx = FakeCtx()
    odd, good = OddGen(ctx=ctx), FakeGen(ctx=ctx)
    async with front_on([ctx], [odd, good]) as (front, http):
        await wait_until(lambda: front.cluster.find(odd.addr).down is not None)  # type: ignore[union-attr]
        assert "stats answer lacks" in front.cluster.find(odd.addr).down  # type: ignore[union-attr, operator]
        for _ in range(3):
            r = await http.post("/v1/completions", json=completion(max_tokens=3))
            assert r.status_code == 200, r.text
        assert odd.generates == [] and len(good.generates) == 3


# -- clients that leave before their answer starts -------------------------------------------------

async def _leave_when(http: httpx.AsyncClient, cond: Callable[[], bool], *, stream: bool) -> None:
    """A client (its own connection) that posts a request and goes away once ``cond()`` holds."""
    async with httpx.AsyncClient(base_url=http.base_url, timeout=30) as own:
        async with anyio.create_task_group() as tg:
            async def post() -> None:
                if stream:
                    async with own.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    await own.post("/v1/completions", json=completion())

            tg.start_soon(post)
            await wait_until(cond)
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_while_queued_frees_its_place_and_reaches_no_node(stream: bool) -> None:
    """One request holds the only slot; a second waits in the queue and its client goes away. Before,
    it kept its place until a slot freed (new clients got 429 meanwhile), then ran on the nodes for
    nobody (a prefill, and streamed a generate too)."""
    gate = anyio.Event()

    async def gated(msg: dict[str, Any], stream_: control.JsonStream, gen: FakeGen) -> None:
        await gate.wait()
        await finish(msg, stream_, gen)

    ctx, gen = FakeCtx(), FakeGen(gated)
    async with front_on([ctx], [gen], limits={"max_concurrent_requests": 1}, queue={"size": 4, "timeout_s": 20}) \
            as (front, http):
        await wait_until(front.cluster.ready)
        async with anyio.create_task_group() as tg:
            holder: dict[str, int] = {}

            async def hold() -> None:
                holder["status"] = (await http.post("/v1/completions", json=completion())).status_code

            tg.start_soon(hold)
            await wait_until(lambda: len(gen.generates) == 1)
            await _leave_when(http, lambda: front.admission.statistics().waiting == 1, stream=stream)
            await wait_until(lambda: front.admission.statistics().waiting == 0, timeout_s=2)  # freed at once
            assert sample(front, "kvo_front_requests_total", endpoint="/v1/completions", status="499") == 1
            gate.set()
        assert holder["status"] == 200
        await anyio.sleep(0.3)  # anything still on its way to a node
        assert len(ctx.prefills) == 1 and len(gen.generates) == 1  # the holder's only
        assert front.admission.active == 0


async def test_a_streamed_client_that_leaves_during_its_prefill_is_not_handed_to_a_gen() -> None:
    """Before, a streamed request's prefill and hand-off ran to their end with its client gone: the
    GEN admitted it and pulled its KV, and only the first chunk's send saw the client gone."""
    ctx, gen = FakeCtx(delay_s=1.0), FakeGen()
    async with front_on([ctx], [gen]) as (front, http):
        await wait_until(front.cluster.ready)
        await _leave_when(http, lambda: len(ctx.prefills) == 1, stream=True)
        await wait_until(lambda: ctx.released == ctx.prefills, timeout_s=5)  # released once the prefill came
        await anyio.sleep(0.2)
        assert gen.generates == [] and ctx.held == {}
        assert front.admission.active == 0
        assert sample(front, "kvo_front_requests_total", endpoint="/v1/completions", status="499") == 1


async def test_a_node_that_never_answers_its_poll_leaves_the_others_stats_fresh() -> None:
    """Each poll round waited for its slowest poll: one hung node (SIGSTOP, or a port that accepts and
    never answers) left every node's stats up to connect_timeout_s old, and a node marked down by a
    failed request down that long."""
    gen = FakeGen()
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: control.serve("127.0.0.1", 0, gen.handle, secret=None, insecure=True,
                                                                task_status=task_status))
        hung = await anyio.create_tcp_listener(local_host="127.0.0.1")
        tg.start_soon(hung.serve, lambda conn: anyio.sleep_forever())  # accepts, never says hello
        hung_addr = f"127.0.0.1:{hung.extra(anyio.abc.SocketAttribute.local_port)}"
        cluster = Cluster([hung_addr], [f"127.0.0.1:{port}"], secret=None, interval_s=0.05, timeout_s=1.5)
        tg.start_soon(cluster.run)
        good = cluster.of("gen")[0]
        await wait_until(lambda: good.up)
        await anyio.sleep(0.2)  # the hung node's first poll is still waiting (1.5 s)
        cluster.mark_down(good, "a request failed on it")
        await wait_until(lambda: good.up, timeout_s=0.5)  # the next poll brings it back, not the slow round's end
        await anyio.sleep(0.3)
        assert time.monotonic() - good.stats_at < 0.3
        tg.cancel_scope.cancel()


async def test_requests_in_flight_when_the_front_stops_are_answered_and_aborted() -> None:
    """After uvicorn's grace on SIGTERM, requests still running were cancelled: a plain-text 500 and a
    CancelledError traceback; streams cut with no error event and no [DONE]. ``stop_requests`` (1 s
    before the grace ends) answers each with the OpenAI body, and the nodes are told as on any abort."""
    aborted: list[str] = []

    async def until_aborted(msg: dict[str, Any], stream: control.JsonStream, gen: FakeGen) -> None:
        await control.until_closed(stream)  # the front closed it before "done": a real GEN aborts
        aborted.append(msg["request_id"])

    gen = FakeGen(until_aborted)
    async with front_on([FakeCtx()], [gen], limits={"max_tokens": 100, "max_concurrent_requests": 2},
                        queue={"size": 4, "timeout_s": 30}) as (front, http):
        await wait_until(front.cluster.ready)
        got: dict[str, httpx.Response] = {}

        async def post(name: str, **fields: Any) -> None:
            got[name] = await http.post("/v1/completions", json=completion(max_tokens=100, **fields))

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: post("whole"))
            tg.start_soon(lambda: post("stream", stream=True))
            await wait_until(lambda: len(gen.generates) == 2)
            tg.start_soon(lambda: post("queued"))
            await wait_until(lambda: front.admission.statistics().waiting == 1)
            front.stop_requests()
        for name in ("whole", "queued"):
            r = got[name]
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", name
        assert got["stream"].text.endswith('"code":"shutting_down"}}\n\ndata: [DONE]\n\n')
        await wait_until(lambda: sorted(aborted) == sorted(gen.generates))
        assert front.admission.active == 0


class RefusingCtx(FakeCtx):
    """Refuses every prefill with ``code`` (None: a refusal about this node, e.g. no free blocks in time)."""

    def __init__(self, code: str | None) -> None:
        super().__init__()
        self.code = code

    async def handle(self, msg: dict[str, Any], stream: control.JsonStream) -> None:
        if msg.get("op") == "prefill":
            self.prefills.append(msg["request_id"])
            raise control.ControlError("prompt needs 20 KV blocks, the CTX pool has 8" if self.code
                                       else "no 20 free KV blocks within 1.0 s", code=self.code)
        await super().handle(msg, stream)


async def test_a_ctx_refusal_about_the_request_is_a_400_and_not_tried_elsewhere() -> None:
    """A prompt no CTX can hold was refused by every CTX in turn and answered 503 with Retry-After,
    which SDKs retry for nothing (a review of the front after its GEN refusals became 400s). The CTX
    says the refusal is about the request: a 400, once; a refusal about the node still tries another."""
    ctxs = [RefusingCtx("context_length_exceeded"), RefusingCtx("context_length_exceeded")]
    async with front_on(ctxs, [FakeGen()], max_retries=2) as (front, http):
        await wait_until(front.cluster.ready)
        r = await http.post("/v1/completions", json=completion(max_tokens=4))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "Retry-After" not in r.headers and sum(len(c.prefills) for c in ctxs) == 1
        assert front.metrics.retries.labels("ctx")._value.get() == 0
    busy, fine = RefusingCtx(None), FakeCtx()
    async with front_on([busy, fine], [FakeGen(ctx=fine)], max_retries=2,
                        router={"ctx": "round_robin", "gen": "round_robin"}) as (front, http):
        await wait_until(front.cluster.ready)
        answers = [await http.post("/v1/completions", json=completion(max_tokens=4)) for _ in range(2)]
        assert all(a.status_code == 200 for a in answers) and busy.prefills  # tried, then the other CTX
