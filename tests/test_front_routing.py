"""The front's decisions, in process (no node process, no network): routing per role, the admission
queue, request validation and the small endpoints. Nodes are ``Node`` records whose state (up, load)
the test sets as a poll would; nothing here talks to a node."""

from __future__ import annotations

import collections
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from starlette.testclient import TestClient

from examples.serve._admission import Admission
from examples.serve import _api
from examples.serve._api import ApiError, TextStream
from examples.serve._app import VERSION, Front
from examples.serve.cluster import Cluster, Node, Router, describe
from examples.serve.config import ConfigError, parse


def _stats(role: str, load: int = 0, used_blocks: int = 0) -> dict[str, Any]:
    if role == "gen":
        return {"healthy": True, "engine": {"waiting": 0, "receiving": 0, "ready": 0, "running": load,
                                            "pool": {"used_blocks": used_blocks}}}
    return {"store": {"held_requests": load}, "pool": {"used_blocks": used_blocks}}


def _up(node: Node, load: int = 0, used_blocks: int = 0) -> Node:
    node.stats, node.down = _stats(node.role, load, used_blocks), None
    return node


def _cluster(n_ctx: int, n_gen: int, **policies: str) -> Cluster:
    c = Cluster([f"127.0.0.1:{9000 + i}" for i in range(n_ctx)], [f"127.0.0.1:{9100 + i}" for i in range(n_gen)],
                secret=b"x" * 32, policies=policies)
    for n in c.nodes:
        _up(n)
    return c


def _front(cluster: Cluster, **extra: Any) -> Front:
    raw = {"model": "tiny", "routing": {"retry_after_s": 3}, "ctx": [{"addr": "127.0.0.1:9"}],
           "gen": [{"addr": "127.0.0.1:9"}], **extra}
    return Front(parse(raw), cluster)


# -- routing --------------------------------------------------------------------------------------

def test_ties_go_round_robin_within_each_role() -> None:
    """Issue 19: CTX and GEN picks shared one counter, so with two CTX and one GEN every sequential
    request went to the first CTX."""
    c = _cluster(2, 1)
    picked = []
    for _ in range(6):
        picked.append(c.pick("ctx").addr)  # type: ignore[union-attr]
        assert c.pick("gen") is not None
    assert collections.Counter(picked) == {"127.0.0.1:9000": 3, "127.0.0.1:9001": 3}


def test_policies() -> None:
    c = _cluster(3, 1, ctx="least_loaded")
    a, b, d = c.of("ctx")
    _up(a, load=5)
    _up(b, load=1)
    _up(d, load=1, used_blocks=40)  # the same requests, more live KV: b is less loaded
    assert {c.pick("ctx").addr for _ in range(10)} == {b.addr}  # type: ignore[union-attr]
    b.inflight = 3  # the front's own requests count too
    assert c.pick("ctx") is d

    rr = Router("round_robin")
    nodes = [_up(Node("gen", f"h:{i}"), load=10 * i) for i in range(3)]
    assert [rr.choose(nodes).addr for _ in range(6)] == ["h:0", "h:1", "h:2"] * 2  # type: ignore[union-attr]

    import random
    p2 = Router("power_of_two", rng=random.Random(7))
    counts = collections.Counter(p2.choose(nodes).addr for _ in range(300))  # type: ignore[union-attr]
    assert counts["h:2"] == 0 and counts["h:0"] > counts["h:1"] > 0  # the most loaded one never wins a pair
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")


def test_draining_and_down_nodes_take_nothing_new() -> None:
    c = _cluster(1, 2)
    g0, g1 = c.of("gen")
    g0.draining = True
    assert {c.pick("gen").addr for _ in range(4)} == {g1.addr}  # type: ignore[union-attr]
    c.mark_down(g1, "test")
    assert c.pick("gen") is None and not c.ready()
    assert c.health()["status"] == "unavailable"


def test_a_503_leaves_no_node_load_behind() -> None:
    """Issue 19: each 503 no_node_available lowered a CTX's in-flight count (aclose gave back what
    start never took), so after an outage the CTX loads went negative and routing was skewed."""
    c = _cluster(2, 1)
    c.mark_down(c.of("gen")[0], "killed")
    http = TestClient(_front(c).app)
    for _ in range(5):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_node_available"
    assert [n.inflight for n in c.nodes] == [0, 0, 0]


def test_health_shows_no_stale_load_for_a_down_node() -> None:
    """Review 6: a GEN that exited (SIGTERM, exit 0: not restarted) under load kept the live
    requests of its last stats in /health's ``load`` for good, with nothing in flight."""
    c = _cluster(1, 1)
    g = _up(c.of("gen")[0], load=2)
    assert c.health()["nodes"][1]["load"] == 2
    c.mark_down(g, "OSError: All connection attempts failed")
    assert c.health()["nodes"][1]["load"] == 0
    g.inflight = 1  # this front's own requests on it still count
    assert c.health()["nodes"][1]["load"] == 1


def test_describe_never_gives_an_empty_reason() -> None:
    assert describe(anyio.EndOfStream()) == "the node closed the connection (EndOfStream)"
    assert describe(ConnectionResetError()) == "ConnectionResetError"
    assert describe(ConnectionRefusedError(111, "Connection refused")) == \
        "ConnectionRefusedError: [Errno 111] Connection refused"


# -- admission ------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_admission_queues_fifo_then_429() -> None:
    adm = Admission(1, 2, timeout_s=5.0)
    await adm.enter()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.enter()
        order.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 1)
        await wait_all_tasks_blocked()
        tg.start_soon(waiter, 2)
        await wait_all_tasks_blocked()
        assert repr(adm) == "<Admission [1/1 active, 2/2 queued]>"
        with pytest.raises(ApiError) as err:  # the queue is full: 429 at once
            await adm.enter()
        assert err.value.status == 429 and err.value.code == "too_many_requests"
        adm.leave()
        await wait_all_tasks_blocked()
        assert order == [1]
        adm.leave()
    assert order == [1, 2]
    adm.leave()
    assert repr(adm) == "<Admission [0/1 active, 0/2 queued]>"


@pytest.mark.anyio
async def test_admission_timeout_and_cancel_pass_the_slot_on() -> None:
    adm = Admission(1, 4, timeout_s=0.05)
    await adm.enter()
    with pytest.raises(ApiError) as err:  # waited timeout_s for a slot
        await adm.enter()
    assert err.value.status == 429 and "waited" in err.value.message
    assert adm.statistics().waiting == 0

    adm.timeout_s = 5.0
    got: list[str] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await adm.enter()
                got.append("cancelled")  # never: it is cancelled once granted, before it runs
                adm.leave()

        async def patient() -> None:
            await adm.enter()
            got.append("patient")

        tg.start_soon(cancelled)
        await wait_all_tasks_blocked()
        tg.start_soon(patient)
        await wait_all_tasks_blocked()
        scope.cancel()  # the client of the first waiter went away: it leaves the queue
        await wait_all_tasks_blocked()
        assert adm.statistics().waiting == 1
        adm.leave()  # the slot reaches `patient`, not the cancelled one nor the pool
    assert got == ["patient"] and adm.active == 1


@pytest.mark.anyio
async def test_admission_takes_a_requests_slots_at_once_in_fifo_order() -> None:
    """Requests of n choices take their n slots in one step: two that each hold part of what they need
    can not hold every slot and wait for each other (the review's deadlock until queue.timeout_s)."""
    adm = Admission(3, 8, timeout_s=5.0)
    await adm.enter()
    await adm.enter()  # two plain requests running: 1 slot free
    order: list[str] = []

    async def request(name: str, n: int) -> None:
        await adm.enter(n)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "a3", 3)
        await wait_all_tasks_blocked()
        tg.start_soon(request, "b2", 2)
        await wait_all_tasks_blocked()
        tg.start_soon(request, "c1", 1)
        await wait_all_tasks_blocked()
        assert repr(adm) == "<Admission [2/3 active, 3/8 queued]>"  # nobody holds part of what it waits for
        adm.leave()
        await wait_all_tasks_blocked()
        assert order == [] and adm.active == 1  # a3 needs 3; c1 does not overtake it
        adm.leave()
        await wait_all_tasks_blocked()
        assert order == ["a3"] and adm.active == 3
        adm.leave(3)  # both fit now: granted together, in queue order
    assert order[0] == "a3" and sorted(order[1:]) == ["b2", "c1"] and adm.active == 3
    adm.leave(2)
    adm.leave()
    assert repr(adm) == "<Admission [0/3 active, 0/8 queued]>"
    with pytest.raises(ValueError):
        await adm.enter(4)


@pytest.mark.anyio
async def test_admission_a_head_that_leaves_lets_the_next_in() -> None:
    adm = Admission(2, 8, timeout_s=5.0)
    await adm.enter()
    got: list[str] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def big() -> None:
            with scope:
                await adm.enter(2)

        async def small() -> None:
            await adm.enter()
            got.append("small")

        tg.start_soon(big)
        await wait_all_tasks_blocked()
        tg.start_soon(small)
        await wait_all_tasks_blocked()
        assert got == []
        scope.cancel()  # the waiter for 2 went away: the one behind it fits in the free slot now
    assert got == ["small"] and adm.active == 2


def test_n_over_max_concurrent_requests_is_a_400() -> None:
    http = TestClient(_front(_cluster(1, 1), limits={"max_concurrent_requests": 2}).app)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_concurrent_requests" in r.json()["error"]["message"]


def test_a_temperature_below_1e_5_is_greedy() -> None:
    """Logits divided by 5e-324 overflow to inf and the sampler always drew EOS: vLLM reads a
    temperature under 1e-5 as greedy, and so does the front (no sampling sent to the nodes)."""
    cfg = parse({"model": "tiny", "ctx": [{"addr": "127.0.0.1:9"}], "gen": [{"addr": "127.0.0.1:9"}]})

    def sampling(**fields: Any) -> Any:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **fields}
        return _api.parse_completion(body, model="tiny", limits=cfg.limits, max_model_len=cfg.limits.max_model_len).sampling

    for tiny in (5e-324, 1e-300, 9.9e-6):
        assert sampling(temperature=tiny) is None, tiny
    assert sampling(temperature=tiny, min_tokens=2)["temperature"] == 0  # sampled for min_tokens, still greedy
    assert sampling(temperature=1e-5)["temperature"] == 1e-5


def test_no_stop_string_before_min_tokens() -> None:
    s = TextStream(max_tokens=8, stop=("a",), min_tokens=6)
    assert s.feed([*b"Aaaa"]) == "Aaaa" and s.finish_reason is None
    assert s.feed([*b"aaaa"]) == "a" and s.finish_reason == "stop" and len(s.token_ids) == 6
    s = TextStream(max_tokens=8, stop=("xy",), min_tokens=3)  # the first "xy" came too early: the second ends it
    assert s.feed([*b"xyxyxy"]) == "xy" and s.finish_reason == "stop" and len(s.token_ids) == 4


# -- the HTTP surface -----------------------------------------------------------------------------

def test_refused_fields_and_errors_name_the_parameter_sent() -> None:
    http = TestClient(_front(_cluster(1, 1)).app)
    msgs = [{"role": "user", "content": "x"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_completion_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_completion_tokens": 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for field, val in [("tools", tools), ("tool_choice", "auto"), ("response_format", {"type": "json_object"}),
                       ("logit_bias", {"65": 10})]:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, field: val})
        assert r.status_code == 400, field
        assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "unsupported_parameter"


def test_model_by_id_and_version() -> None:
    http = TestClient(_front(_cluster(1, 1)).app)
    r = http.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = http.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": VERSION}


def test_cluster_file_router_queue_retries_etcd() -> None:
    base = {"ctx": [{"addr": "10.0.0.1:9000"}], "gen": [{"addr": "10.0.0.2:9100"}]}
    cfg = parse({**base, "router": {"ctx": "round_robin", "gen": "power_of_two"}, "queue": {"size": 8, "timeout_s": 2},
                 "max_retries": 3})
    assert (cfg.router.ctx, cfg.router.gen, cfg.queue.size, cfg.queue.timeout_s, cfg.max_retries) == \
        ("round_robin", "power_of_two", 8, 2.0, 3)
    cfg = parse({"etcd": {"url": "http://127.0.0.1:2379/", "prefix": "/kvo/a/"}})  # nodes come from etcd
    assert cfg.etcd is not None and cfg.etcd.url == "http://127.0.0.1:2379" and cfg.ctx == cfg.gen == ()
    for bad, what in [({"router": {"gen": "random"}}, "router.gen"), ({"max_retries": -1}, "max_retries"),
                      ({"queue": {"size": -1}}, "queue"), ({"etcd": {"url": "127.0.0.1:2379"}}, "etcd.url"),
                      ({"router": {"dispatch": "x"}}, "unknown"),
                      # each passed before and crashed the front: an IndexError at start; the poll loop's
                      # ValueError after READY (every request a 500 while /health said 200)
                      ({"etcd": {"url": "http://127.0.0.1:2379", "prefix": ""}}, "etcd.prefix"),
                      ({"etcd": {"url": "http://127.0.0.1:2379", "prefix": "/kvo"}}, "etcd.prefix"),
                      ({"routing": {"stats_interval_s": float("nan")}}, "routing.stats_interval_s must be a finite"),
                      ({"routing": {"request_timeout_s": float("inf")}}, "routing.request_timeout_s"),
                      ({"queue": {"timeout_s": float("nan")}}, "queue.timeout_s")]:
        with pytest.raises(ConfigError, match=what):
            parse({**base, **bad})
    with pytest.raises(ConfigError, match="gen"):
        parse({"ctx": [{"addr": "10.0.0.1:9000"}]})
