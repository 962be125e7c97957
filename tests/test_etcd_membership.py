"""Membership through a real etcd (started here on a free loopback port): nodes given ``--etcd``
register under a lease, fronts watch the prefix. A GEN that joins under load takes traffic within
2 s; a GEN SIGKILLed leaves within its TTL and no request is lost to it; draining (SIGTERM on a GEN,
POST /admin/drain for a CTX) under load loses nothing; two fronts see the same set."""

from __future__ import annotations

import base64
import contextlib
import functools
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from examples.tiny_model import ByteTokenizer, ModelConfig, TinyModel
from examples.two_node import control
from examples.two_node.launch import NodeProcess, node_env
from examples.two_node.membership import Etcd, start_etcd, watch_members
from tests.test_serve import running_front

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
TTL_S = 2
PROMPTS = [f"membership prompt {i}" for i in range(4)]
N_TOKENS = 6
LONG = 200  # the drain test's requests: each decodes for well over the drain's quiet period (0.5 s; 120 did not, on a quiet machine)


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    with start_etcd() as url:
        yield url


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(ModelConfig())


@pytest.fixture(scope="module")
def refs(model: TinyModel) -> list[list[int]]:
    return [model.generate_reference(TOK.encode(p), N_TOKENS) for p in PROMPTS]


def front_yaml(url: str, prefix: str) -> str:
    return f"""
model: tiny
listen: {{host: 127.0.0.1, port: 0}}
limits: {{max_prompt_tokens: 512, max_tokens: 200, default_max_tokens: 4}}
routing: {{stats_interval_s: 0.25, retry_after_s: 1, connect_timeout_s: 5}}
router: {{ctx: least_loaded, gen: least_loaded}}
max_retries: 2
etcd: {{url: "{url}", prefix: "{prefix}"}}
"""


class Nodes:
    """Nodes started with ``--etcd`` (the test's, not a front's); all stopped on exit."""

    def __init__(self, url: str, prefix: str, secret: str) -> None:
        self.url, self.prefix, self.env = url, prefix, node_env(secret)
        self.procs: list[NodeProcess] = []

    def start(self, role: str, *extra: str) -> NodeProcess:
        args = [role, "--no-kv-checksums", "--num-blocks", "128", "--etcd", self.url, "--etcd-prefix", self.prefix,
                "--etcd-ttl-s", str(TTL_S), *extra]
        proc = NodeProcess.start(args, env=self.env)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@contextlib.contextmanager
def cluster(tmp: Path, url: str, n_fronts: int = 1) -> Iterator[tuple[Nodes, list[dict[str, Any]]]]:
    prefix = f"/kvo/test-{secrets.token_hex(4)}/"
    secret = secrets.token_hex(32)
    nodes = Nodes(url, prefix, secret)
    try:
        nodes.start("ctx")
        nodes.start("gen")
        with contextlib.ExitStack() as stack:
            fronts = []
            for i in range(n_fronts):
                folder = tmp / f"front{i}"
                folder.mkdir()
                fronts.append(stack.enter_context(running_front(folder, front_yaml(url, prefix), secret=secret)))
            yield nodes, fronts
    finally:
        nodes.stop()


def members(front: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["addr"]: n for n in httpx.get(front["url"] + "/health", timeout=10).json()["nodes"]}


def wait_for(cond: Any, timeout: float, what: Any) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what() if callable(what) else what
        time.sleep(0.02)
    return time.monotonic() - t0


class Load:
    """Requests through the fronts from a thread (concurrency ``n``), until ``stop``; each answer is
    checked against the single-process reference. Not streamed: a request whose GEN dies under it
    has sent the client nothing yet, and the front retries it whole on other nodes."""

    def __init__(self, fronts: list[dict[str, Any]], refs: list[list[int]], n: int = 4) -> None:
        self.fronts, self.refs, self.n = fronts, refs, n
        self.tokens = len(refs[0])
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: anyio.run(self._run), daemon=True)

    async def _one(self, http: httpx.AsyncClient, i: int) -> None:
        front = self.fronts[i % len(self.fronts)]
        body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": self.tokens, "ignore_eos": True,
                "return_token_ids": True, "temperature": 0}
        try:
            r = await http.post(front["url"] + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self.failures.append(repr(exc))
            return
        if r.status_code != 200:
            self.failures.append(f"{r.status_code} {r.text[:300]}")
        elif r.json()["choices"][0]["token_ids"] != self.refs[i % len(PROMPTS)]:
            self.failures.append("wrong tokens")
        else:
            self.ok += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            async def worker(w: int) -> None:
                i = w
                while not self._stop.is_set():
                    await self._one(http, i)
                    i += self.n

            async with anyio.create_task_group() as tg:
                for w in range(self.n):
                    tg.start_soon(worker, w)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def gen_taken(node: NodeProcess) -> int:
    """Requests the GEN has taken: in any state, or over."""
    e = anyio.run(lambda: control.call(node.info["ctrl"], {"op": "stats"}, secret=node.secret))["engine"]
    return sum(e[k] for k in ("waiting", "receiving", "ready", "running", "finished", "aborted"))


def gen_finished(node: NodeProcess) -> int:
    return anyio.run(lambda: control.call(node.info["ctrl"], {"op": "stats"}, secret=node.secret))["engine"]["finished"]


def gen_retries(front: dict[str, Any]) -> float:
    """The front's GEN hand-offs and whole flights tried again on another node."""
    text = httpx.get(front["url"] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('kvo_front_retries_total{role="gen"}'))


def test_join_under_load_two_fronts_and_a_sigkilled_gen_leaves(tmp_path: Path, etcd_url: str,
                                                               refs: list[list[int]]) -> None:
    with cluster(tmp_path, etcd_url, n_fronts=2) as (nodes, fronts):
        first = {n.info["ctrl"] for n in nodes.procs}
        for f in fronts:  # both fronts see the same set
            assert set(members(f)) == first and all(n["up"] for n in members(f).values())
        with Load(fronts, refs) as load:
            wait_for(lambda: load.ok >= 8, 30, lambda: f"the load runs: {load.failures[:3]}")
            new = nodes.start("gen")  # READY: it registers right after
            joined = time.monotonic()
            took = wait_for(lambda: gen_taken(new) > 0, 10, "the new GEN takes traffic")
            assert took < 2.0, f"the new GEN took its first request {took:.2f} s after it started"
            wait_for(lambda: gen_finished(new) > 0, 30, "and serves it")
            for f in fronts:
                assert members(f).keys() == first | {new.info["ctrl"]}
            assert time.monotonic() - joined < 10
            before = load.ok
            new.kill(signal.SIGKILL)
            killed = time.monotonic()
            for f in fronts:  # it leaves the routing set (down at once, gone from the set within its TTL)
                wait_for(lambda f=f: new.info["ctrl"] not in members(f), TTL_S + 1.0,
                         "a SIGKILLed GEN leaves within its lease TTL (+1 s: etcd checks leases every 500 ms)")
            left = time.monotonic() - killed
            wait_for(lambda: load.ok >= before + 8, 30, lambda: f"the load goes on: {load.failures[:3]}")
        assert load.failures == [], load.failures[:5]
        assert left <= TTL_S + 1.0


def gen_running(node: NodeProcess) -> int:
    return anyio.run(lambda: control.call(node.info["ctrl"], {"op": "stats"}, secret=node.secret))["engine"]["running"]


def test_a_front_that_launches_its_nodes_with_etcd_is_ready_with_them(tmp_path: Path, etcd_url: str,
                                                                       refs: list[list[int]]) -> None:
    """The nodes a front starts register in etcd only after their READY: its READY came before the
    watch saw them ("ctx": [], and its first request a 503 no_node_available, in 3 of 3 starts of an
    outside review). READY now names them, and the first request is served."""
    prefix = f"/kvo/test-{secrets.token_hex(4)}/"
    yaml = front_yaml(etcd_url, prefix) + """
ctx:
  - launch: {args: ["--num-blocks", "128", "--etcd-ttl-s", "2"]}
gen:
  - launch: {args: ["--num-blocks", "128", "--etcd-ttl-s", "2"]}
"""
    with running_front(tmp_path, yaml) as front:
        started = {n["role"]: n["ctrl"] for n in front["started"]}
        assert front["ctx"] == [started["ctx"]] and front["gen"] == [started["gen"]], front
        r = httpx.post(front["url"] + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": N_TOKENS, "ignore_eos": True,
                             "return_token_ids": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == refs[0]
        assert set(members(front)) == {started["ctx"], started["gen"]}  # once each, though etcd named them too


def test_drain_under_load_loses_nothing(tmp_path: Path, etcd_url: str, model: TinyModel) -> None:
    refs = [model.generate_reference(TOK.encode(p), LONG) for p in PROMPTS]
    with cluster(tmp_path, etcd_url) as (nodes, fronts):
        front = fronts[0]
        # one request decoded at a time: the drained GEN's live work (its running request and those queued
        # behind it) outlasts the drain's quiet period (0.5 s) by far, however fast this machine decodes
        gen2, ctx2 = nodes.start("gen", "--max-num-seqs", "1"), nodes.start("ctx")
        wait_for(lambda: len(members(front)) == 4 and all(n["up"] for n in members(front).values()), 10, "4 nodes")
        with Load(fronts, refs, n=6) as load:
            wait_for(lambda: load.ok >= 6 and gen_finished(gen2) > 0 and gen_running(gen2) > 0, 60,
                     lambda: f"both GENs take traffic: {load.failures[:3]}")
            retried = gen_retries(front)
            gen2.proc.send_signal(signal.SIGTERM)  # drains: takes nothing new, finishes, deregisters, exits
            r = httpx.post(front["url"] + "/admin/drain", json={"node": ctx2.info["ctrl"]},
                           headers={"authorization": f"Bearer {front['secret'].decode()}"}, timeout=10)
            assert r.status_code == 200 and r.json()["draining"] is True, r.text
            for proc in (gen2, ctx2):
                wait_for(lambda proc=proc: proc.proc.poll() is not None, 20, "a drained node exits")
                assert proc.proc.returncode == 0, proc.log_tail()
                assert proc.info["ctrl"] not in members(front)
            before = load.ok
            wait_for(lambda: load.ok >= before + 6, 60, lambda: f"the load goes on on the other nodes: {load.failures[:3]}")
        assert load.failures == [], load.failures[:5]
        # the drained GEN finished its live requests itself: none was cut and run again elsewhere (the
        # front retries a non-streamed flight whose GEN went away, so the load alone could not tell)
        assert gen_retries(front) == retried
        r = httpx.post(front["url"] + "/admin/drain", json={"node": "127.0.0.1:1"},
                       headers={"authorization": f"Bearer {front['secret'].decode()}"})
        assert r.status_code == 404
        assert httpx.post(front["url"] + "/admin/drain", json={"node": "x"}).status_code == 401


def test_etcd_client_lease_and_watch(etcd_url: str) -> None:
    async def main() -> None:
        etcd = Etcd(etcd_url)
        try:
            lease = await etcd.grant(2)
            await etcd.put("/t/a", "1", lease=lease)
            kvs, rev = await etcd.list("/t/")
            assert kvs == {"/t/a": "1"}
            seen = []
            with anyio.move_on_after(10):
                async for ev in etcd.watch("/t/", rev + 1):
                    seen.append(ev)
                    if ev[0] == "DELETE":
                        break
            assert seen == [("DELETE", "/t/a", None)]  # the lease ran out: the key went with it
        finally:
            await etcd.aclose()

    anyio.run(main)


def test_a_malformed_member_is_skipped_and_the_watch_goes_on(etcd_url: str) -> None:
    """Anyone may write under the prefix: an entry whose control address is not ``host:port`` or whose
    value is not UTF-8 is logged (``etcd_member_unreadable``) and skipped, when listed and when watched;
    the nodes around it still come and go."""
    prefix = "/kvo/malformed/"
    raw = {prefix + "gen/bad": b'{"role": "gen", "ctrl": "bad"}',
           prefix + "gen/127.0.0.1:1": b"\xff\xfe{",
           prefix + "ctx/127.0.0.1:2": b'{"role": "ctx", "ctrl": "127.0.0.1:2"}'}

    async def put_raw(key: str, value: bytes) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.post(etcd_url + "/v3/kv/put", json={"key": base64.b64encode(key.encode()).decode(),
                                                            "value": base64.b64encode(value).decode()})
            assert r.status_code == 200

    async def main() -> list[tuple[str, str]]:
        for key, value in raw.items():
            await put_raw(key, value)
        seen: list[tuple[str, str]] = []
        listed = anyio.Event()

        async def on_put(role: str, meta: dict[str, Any]) -> None:
            seen.append((role, meta["ctrl"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(watch_members, etcd_url, prefix, on_put=on_put,
                                            on_delete=lambda role, ctrl: None, on_listed=listed.set))
            with anyio.fail_after(10):
                await listed.wait()
                await put_raw(prefix + "gen/x:y", b'{"role": "gen", "ctrl": "x:y"}')  # watched, not listed
                await put_raw(prefix + "gen/127.0.0.1:3", b"\x80")
                await put_raw(prefix + "gen/127.0.0.1:4", b'{"role": "gen", "ctrl": "127.0.0.1:4"}')
                while ("gen", "127.0.0.1:4") not in seen:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        return seen

    with capture_logs() as logs:
        seen = anyio.run(main)
    assert seen == [("ctx", "127.0.0.1:2"), ("gen", "127.0.0.1:4")]
    unreadable = sorted(e["key"] for e in logs if e["event"] == "etcd_member_unreadable")
    assert unreadable == sorted([prefix + "gen/bad", prefix + "gen/127.0.0.1:1", prefix + "gen/x:y",
                                 prefix + "gen/127.0.0.1:3"])


def test_an_unreachable_etcd_is_retried_with_backoff_and_logged_sparingly() -> None:
    """etcd down: the watch retried every 0.5 s and logged a warning each time (a front's log
    filled). Now each failure in a row doubles the wait (up to max_retry_s) and only the 1st, 2nd,
    4th, 8th ... are logged."""
    errors: list[object] = []

    async def main() -> None:
        async def on_put(role: str, meta: dict[str, Any]) -> None:
            raise AssertionError("nothing to list")

        with anyio.move_on_after(1.0):
            await watch_members("http://127.0.0.1:1", "/kvo/none/", on_put=on_put, on_delete=lambda r, c: None,
                                on_error=errors.append, retry_s=0.01, max_retry_s=0.16)

    with capture_logs() as logs:
        anyio.run(main)
    warned = [e["failures_in_a_row"] for e in logs if e["event"] == "etcd_watch_failed"]
    assert 5 <= len(errors) <= 15, len(errors)  # 0.01 + 0.02 + 0.04 + 0.08 + 0.16 ... (every 0.01 s: ~100)
    assert warned == [n for n in (1, 2, 4, 8, 16) if n <= len(errors)]


def test_a_watch_that_says_nothing_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch whose connection was black-holed (or whose etcd was SIGSTOPped) ends no stream: the front
    waited on it forever, never saw a GEN that registered meanwhile, and /health said etcd ok. A watch
    silent for idle_s is followed by a new listing (a new connection), which sees the GEN."""
    from examples.two_node import membership

    members = {"/kvo/bh/gen/127.0.0.1:1": '{"role": "gen", "ctrl": "127.0.0.1:1"}'}

    class BlackHoled:
        def __init__(self, url: str) -> None:
            pass

        async def list(self, prefix: str) -> tuple[dict[str, str], int]:
            return dict(members), 7

        async def watch(self, prefix: str, start_revision: int):  # type: ignore[no-untyped-def]
            await anyio.sleep_forever()  # nothing arrives, nothing closes
            yield ("PUT", "", "")

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(membership, "Etcd", BlackHoled)
    seen: list[str] = []

    async def main() -> None:
        async def on_put(role: str, meta: dict[str, Any]) -> None:
            seen.append(meta["ctrl"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(watch_members, "http://etcd", "/kvo/bh/", on_put=on_put,
                                            on_delete=lambda r, c: None, idle_s=0.1))
            with anyio.fail_after(5):
                while seen != ["127.0.0.1:1"]:
                    await anyio.sleep(0.01)
                members["/kvo/bh/gen/127.0.0.1:2"] = '{"role": "gen", "ctrl": "127.0.0.1:2"}'  # joins, unwatched
                while "127.0.0.1:2" not in seen:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
