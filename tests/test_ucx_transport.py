"""UCXTransport (in this process) against a UCXKVServer in another process (tests/_ucx_peer.py).

The conformance tests (every test that takes the ``backend`` fixture) run against both data planes:
``ucx`` (UCXTransport / UCXKVServer) and ``nixl`` (NIXLTransport / NIXLKVServer, the same peer
process with ``--backend nixl``); the nixl ones skip only if ``nixl_cu12`` cannot be imported.
The rest test what only the UCX path has (its wire frames, tags, UCX settings, the receive grace)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch

from tests._ucx_peer import LAYOUT, block_ids, handle_for, make_pool
from transports import (
    AuthenticationFailed,
    KVSlice,
    Landing,
    PeerClosed,
    ProtocolViolation,
    Transport,
    TransportError,
    UnknownRequest,
)
from transports import wire

ucxx = pytest.importorskip("ucxx")

from transports.ucx import UCXConfig, UCXTransport as _UCXTransport, _ucx_buffer, apply_ucx_defaults  # noqa: E402


class PresentsHandles:
    """Mixed into a real transport: a pull or release that names no handle presents the one the test
    peer issued for that request (``handle_for``), as a GEN presents the CTX's handle from the prefill."""

    async def pull(self, peer, request_id, kv_slice, into, *, handle=None, **kw):  # type: ignore[override]
        return await super().pull(peer, request_id, kv_slice, into, handle=handle or _handle(request_id), **kw)

    async def release(self, peer, request_id, *, handle=None):  # type: ignore[override]
        return await super().release(peer, request_id, handle=handle or _handle(request_id))


class UCXTransport(PresentsHandles, _UCXTransport):
    pass


def _nixl_missing() -> str | None:
    try:
        import nixl_cu12._api  # noqa: F401
    except ImportError as exc:
        return f"nixl_cu12 cannot be imported ({exc}); run.sh installs it (pip install -c constraints.txt '.[nixl]')"
    return None


BACKENDS = [pytest.param("ucx"),
            pytest.param("nixl", marks=pytest.mark.skipif(_nixl_missing() is not None, reason=str(_nixl_missing())))]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The data plane under test: ``ucx`` or ``nixl``."""
    return request.param


def make_transport(backend: str, *, secret: bytes | None = b"test-secret-0123456789abcdef", layout=None,
                   total_kv_heads=None, **config: object):
    """The GEN side of ``backend``: UCXConfig/NIXLConfig share these knob names."""
    if backend == "ucx":
        return UCXTransport(UCXConfig(secret=secret, **config), layout=layout, total_kv_heads=total_kv_heads)  # type: ignore[arg-type]
    from transports.nixl import NIXLConfig, NIXLTransport

    cls = type("NIXLTransport", (PresentsHandles, NIXLTransport), {})
    return cls(NIXLConfig(secret=secret, **config), layout=layout, total_kv_heads=total_kv_heads)  # type: ignore[arg-type]


def _handle(request_id: str) -> str | None:
    return handle_for(request_id) if isinstance(request_id, str) else None

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"test-secret-0123456789abcdef"
REQUESTS, BLOCKS = 40, 8
TOTAL = REQUESTS * BLOCKS + 8


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # ucxx is asyncio-only


class Peer:
    """A CTX process; ``stats()`` asks it what its store still holds."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, secret: bytes | None = SECRET,
                 prefix: list[str] | None = None, log: Path | None = None, backend: str = "ucx") -> None:
        full_env = {**os.environ, **(env or {})}
        full_env.pop("KVO_SHARED_SECRET", None)
        if secret is not None:
            full_env["KVO_SHARED_SECRET"] = secret.decode()
        cmd = [*(prefix or []), sys.executable, "-m", "tests._ucx_peer", "--requests", str(REQUESTS), "--blocks", str(BLOCKS), *args,
               "--backend", backend]
        stderr = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
        if log is not None:
            stderr.close()
        self.port = int(self._reply()["port"])

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer exited with {self.proc.poll()}")
            if line.startswith("{"):
                return json.loads(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self._reply()

    async def astats(self) -> dict:
        return await anyio.to_thread.run_sync(self.stats)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


@pytest.fixture(scope="module")
def peer(backend: str) -> Iterator[Peer]:
    p = Peer(backend=backend)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def slow_peer(backend: str) -> Iterator[Peer]:
    p = Peer("--gather-delay", "0.6", backend=backend)
    yield p
    p.stop()


@pytest.fixture
async def transport(backend: str):
    t = make_transport(backend, connect_timeout_s=5)
    yield t
    await t.aclose()


POOL = make_pool(LAYOUT, TOTAL)


def expected(index: int, kv_slice: KVSlice | None = None) -> torch.Tensor:
    s = kv_slice or LAYOUT.full_slice()
    picked = POOL[block_ids(index, BLOCKS, TOTAL)]
    return picked[:, s.layer_start : s.layer_end, :, s.head_start : s.head_end].contiguous()


def empty(kv_slice: KVSlice | None = None, blocks: int = BLOCKS) -> torch.Tensor:
    return torch.full(LAYOUT.wire_shape(blocks, kv_slice), float("nan"), dtype=LAYOUT.dtype)


async def wait_released(peer: Peer, *ids: str) -> dict:
    while True:
        stats = await peer.astats()
        if not set(ids) & set(stats["held"]):
            return stats
        await anyio.sleep(0.05)


def ucxx_probe(conn, tag: int) -> bool:
    """Whether a message for ``tag`` waits, unreceived, on ``conn``'s ucxx endpoint."""
    from transports._ucx_common import _tag

    return bool(conn.ep._ctx.worker.tag_probe(_tag(conn.ep, tag, "msg_recv")).matched)


def test_defaults_do_not_override_user_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_RNDV_SCHEME", "get_zcopy")
    monkeypatch.delenv("UCX_CMA_SEG_SIZE", raising=False)
    applied = apply_ucx_defaults()
    assert applied["UCX_RNDV_SCHEME"] == "get_zcopy"
    assert applied["UCX_CMA_SEG_SIZE"] == "4M"


def test_config_requires_secret_or_explicit_insecure() -> None:
    with pytest.raises(ValueError, match="shared secret"):
        UCXConfig()
    with structlog_capture() as logs:
        UCXTransport(UCXConfig(allow_insecure=True))
    assert any(e["event"] == "ucx_auth_disabled" for e in logs)
    assert SECRET.decode() not in repr(UCXConfig(secret=SECRET))


@pytest.mark.anyio
async def test_bad_or_dead_address_is_unreachable(backend: str) -> None:
    from transports import PeerUnreachable

    with anyio.fail_after(15):
        async with make_transport(backend, connect_timeout_s=1.0) as transport:
            with pytest.raises(PeerUnreachable, match="host:port"):
                await transport.connect("no-port-here")
            t0 = anyio.current_time()
            with pytest.raises(PeerUnreachable):  # nothing listens there
                await transport.pull("127.0.0.1:1", "req-0", LAYOUT.full_slice(), empty())
            assert anyio.current_time() - t0 < 3


def structlog_capture():
    import structlog.testing

    return structlog.testing.capture_logs()


@pytest.mark.anyio
async def test_pull_is_bit_identical_and_released(peer: Peer, transport: UCXTransport) -> None:
    assert isinstance(transport, Transport)
    with anyio.fail_after(20):
        into = empty()
        n = await transport.pull(peer.address, "req-0", LAYOUT.full_slice(), into)
        assert n == into.nbytes == LAYOUT.wire_bytes(BLOCKS)
        assert torch.equal(into, expected(0))
        part = KVSlice(1, 3, 1, 4)
        into = empty(part)
        await transport.pull(peer.address, "req-1", part, into)
        assert torch.equal(into, expected(1, part))
        stats = await wait_released(peer, "req-0", "req-1")
        assert stats["pulls_served"] >= 2
        assert transport.statistics().endpoints == 1
        with pytest.raises(UnknownRequest):  # released after a successful pull
            await transport.pull(peer.address, "req-0", LAYOUT.full_slice(), empty())


@pytest.mark.anyio
async def test_chunked_pull_keeps_the_entry_until_the_last_chunk(peer: Peer, transport: UCXTransport) -> None:
    with anyio.fail_after(20):
        first, last = KVSlice(0, 2, 0, 4), KVSlice(2, 4, 0, 4)
        a, b = empty(first), empty(last)
        await transport.pull(peer.address, "req-28", first, a, release=False)
        assert "req-28" in (await peer.astats())["held"]
        await transport.pull(peer.address, "req-28", last, b)
        assert torch.equal(a, expected(28, first)) and torch.equal(b, expected(28, last))
        await wait_released(peer, "req-28")


@pytest.mark.anyio
async def test_concurrent_pulls_on_one_endpoint_do_not_mix(peer: Peer, transport: UCXTransport) -> None:
    ids = range(2, 26)
    out = {i: empty() for i in ids}
    with anyio.fail_after(30), structlog_capture() as logs:
        async with anyio.create_task_group() as tg:
            for i in ids:
                tg.start_soon(transport.pull, peer.address, f"req-{i}", LAYOUT.full_slice(), out[i])
    assert [e["event"] for e in logs].count(f"{transport.name}_connected") == 1  # one connect, shared by all
    for i in ids:
        assert torch.equal(out[i], expected(i)), i
    assert transport.statistics().endpoints == 1
    assert transport.statistics().pulls_ok == len(ids)


@pytest.mark.anyio
async def test_unknown_request_and_bad_into(peer: Peer, transport: UCXTransport) -> None:
    with anyio.fail_after(20):
        with pytest.raises(UnknownRequest):
            await transport.pull(peer.address, "no-such-request", LAYOUT.full_slice(), empty())
        # wrong number of blocks: the server refuses before sending a byte, the entry stays held
        wrong = empty(blocks=BLOCKS - 1)
        with pytest.raises(ProtocolViolation, match="SHAPE_MISMATCH"):
            await transport.pull(peer.address, "req-26", LAYOUT.full_slice(), wrong)
        assert torch.isnan(wrong).all()
        assert transport.statistics().endpoints == 1  # a refusal does not cost the endpoint
        # `into` that cannot hold the slice, a bad dtype, a bad id: refused before any message
        for bad_into, rid in [
            (empty(KVSlice(0, 2, 0, 4)), "req-26"),
            (empty().float(), "req-26"),
            (empty().transpose(0, 1), "req-26"),
            (empty(), "bad id with spaces"),
        ]:
            with pytest.raises(ProtocolViolation):
                await transport.pull(peer.address, rid, LAYOUT.full_slice(), bad_into)
        assert "req-26" in (await peer.astats())["held"]
        # the endpoint is still fine
        into = empty()
        await transport.pull(peer.address, "req-26", LAYOUT.full_slice(), into)
        assert torch.equal(into, expected(26))


@pytest.mark.anyio
async def test_release(peer: Peer, transport: UCXTransport) -> None:
    with anyio.fail_after(20):
        await transport.release(peer.address, "req-27")
        assert "req-27" not in (await peer.astats())["held"]
        await transport.release(peer.address, "req-27")  # already released: fine
        with pytest.raises(UnknownRequest):
            await transport.pull(peer.address, "req-27", LAYOUT.full_slice(), empty())


@pytest.fixture(scope="module")
def run_peer() -> Iterator[Peer]:
    """A UCX CTX whose requests each sit in one ascending run of blocks: it serves their whole-layout
    pulls from a zero-copy view of its pool, in its read loop (no task per pull)."""
    p = Peer("--runs")
    yield p
    p.stop()


async def wait_unpinned(peer: Peer, *released: str) -> dict:
    """The peer's statistics once ``released`` are gone and no send pins a block (a pull ends here
    when its KV lands, a moment before the CTX sees its send end)."""
    with anyio.fail_after(5):
        while True:
            stats = await peer.astats()
            if not set(released) & set(stats["held"]) and stats["open_pins"] == 0:
                return stats
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_zero_copy_pulls_served_in_the_read_loop(run_peer: Peer) -> None:
    """The CTX's read-loop path (a whole-layout pull of one run of blocks) checks, pins, sends,
    unpins and releases like the task path: exact KV, KEEP honoured, refusals keep the entry, and
    afterwards no block stays pinned."""
    pool = make_pool(LAYOUT, TOTAL)

    def want(i: int) -> torch.Tensor:
        return pool[block_ids(i, BLOCKS, TOTAL, runs=True)]

    served = (await run_peer.astats())["pulls_served"]  # other tests share this peer
    async with make_transport("ucx", connect_timeout_s=5) as t:
        with anyio.fail_after(30):
            into = empty()
            assert await t.pull(run_peer.address, "req-0", LAYOUT.full_slice(), into) == into.nbytes
            assert torch.equal(into, want(0))
            kept = empty()
            await t.pull(run_peer.address, "req-1", LAYOUT.full_slice(), kept, release=False)
            assert torch.equal(kept, want(1))
            stats = await wait_unpinned(run_peer, "req-0")
            assert "req-1" in stats["held"]  # KEEP: a chunk leaves the entry held
            out = {i: empty() for i in range(2, 12)}
            async with anyio.create_task_group() as tg:
                for i in out:
                    tg.start_soon(functools.partial(t.pull, run_peer.address, f"req-{i}", LAYOUT.full_slice(), out[i]))
            assert all(torch.equal(out[i], want(i)) for i in out)
            wrong = empty(blocks=BLOCKS - 1)  # refused before a byte moves; the entry stays
            with pytest.raises(ProtocolViolation, match="SHAPE_MISMATCH"):
                await t.pull(run_peer.address, "req-12", LAYOUT.full_slice(), wrong)
            assert torch.isnan(wrong).all()
            with pytest.raises(UnknownRequest):
                await t.pull(run_peer.address, "req-0", LAYOUT.full_slice(), empty())
            stats = await wait_unpinned(run_peer, "req-0", *(f"req-{i}" for i in out))
            assert {"req-1", "req-12"} <= set(stats["held"])
            assert stats["pulls_served"] - served == 2 + len(out) and t.statistics().endpoints == 1


@pytest.mark.anyio
async def test_concurrent_pulls_of_one_request_and_cancel(slow_peer: Peer, transport: UCXTransport, backend: str) -> None:
    results: dict[str, object] = {}

    async def pull(name: str, into: torch.Tensor, kv_slice: KVSlice) -> None:
        try:
            results[name] = await transport.pull(slow_peer.address, "req-0", kv_slice, into, release=False)
        except TransportError as exc:
            results[name] = exc

    with anyio.fail_after(20):
        # two pulls of one request at once (as tensor-parallel GEN ranks pull their head slices):
        # both are served, from pinned blocks; the entry stays until it is released
        halves = KVSlice(0, LAYOUT.num_layers, 0, 2), KVSlice(0, LAYOUT.num_layers, 2, 4)
        a, b = empty(halves[0]), empty(halves[1])
        await transport.connect(slow_peer.address)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pull, "a", a, halves[0])
            await anyio.sleep(0.2)
            tg.start_soon(pull, "b", b, halves[1])
        assert results["a"] == a.nbytes and torch.equal(a, expected(0, halves[0]))
        assert results["b"] == b.nbytes and torch.equal(b, expected(0, halves[1]))
        assert "req-0" in (await slow_peer.astats())["held"]
        await transport.release(slow_peer.address, "req-0")

        # cancel a pull while the server prepares it: the pull returns at once, but the receive it
        # posted cannot be withdrawn, so its landing stays busy until the KV has landed (the CTX
        # answers every PULL); after that nothing writes the buffer again; the endpoint survives
        c, landing = empty(), Landing()
        with anyio.move_on_after(0.2) as scope:
            await transport.pull(slow_peer.address, "req-1", LAYOUT.full_slice(), c, landing=landing)
        if backend == "ucx":
            assert scope.cancelled_caught and landing.busy
            await wait_idle(landing)
            assert torch.equal(c, expected(1))
            await wait_released(slow_peer, "req-1")  # it was sent in full, with release
        else:  # NIXL: cancelled before its READ was posted (the lookup is slow): nothing may land, the
            # CTX unpins when its answer comes, and keeps the entry
            assert scope.cancelled_caught and not landing.busy
            await anyio.sleep(0.8)  # past the lookup's answer
            assert torch.isnan(c).all() and "req-1" in (await slow_peer.astats())["held"]
            assert (await slow_peer.astats())["pinned"] == 0
        d = empty()
        await transport.pull(slow_peer.address, "req-2", LAYOUT.full_slice(), d)  # same endpoint
        assert torch.equal(d, expected(2))
        assert transport.statistics().endpoints == 1


async def wait_idle(landing: Landing, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while landing.busy:
            await anyio.sleep(0.01)


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["ucx"], indirect=True)  # the receive grace is UCX's (NIXL: test_nixl_transport)
async def test_cancelled_pull_returns_at_once_and_its_landing_ends_with_the_receive(transport: UCXTransport) -> None:
    """A pull cancelled while its receive is posted returns at once with its landing busy; within the
    grace the KV lands and the landing ends, the endpoint survives. Past the grace the endpoint (and
    the pulls on it) go, which ends the landing before the CTX sends; nothing lands afterwards, the
    CTX keeps the entries, and a new pull works."""
    lazy = Peer("--send-delay", "1.2")
    try:
        with anyio.fail_after(25):
            await transport.connect(lazy.address)
            a, landing = empty(), Landing()
            t0 = anyio.current_time()
            with anyio.move_on_after(0.3) as scope:
                await transport.pull(lazy.address, "req-0", LAYOUT.full_slice(), a, landing=landing)
            assert scope.cancelled_caught and anyio.current_time() - t0 < 0.8  # not held up by the transfer
            assert landing.busy
            await wait_idle(landing)
            assert torch.equal(a, expected(0))
            assert transport.statistics().endpoints == 1

            async with UCXTransport(UCXConfig(secret=SECRET, cancel_grace_s=0.2)) as hasty:
                await hasty.connect(lazy.address)
                b, c, landing = empty(), empty(), Landing()
                other: list[BaseException] = []

                async def bystander() -> None:
                    try:
                        await hasty.pull(lazy.address, "req-2", LAYOUT.full_slice(), c)
                    except PeerClosed as exc:
                        other.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(bystander)
                    with anyio.move_on_after(0.3):
                        await hasty.pull(lazy.address, "req-1", LAYOUT.full_slice(), b, landing=landing)
                assert len(other) == 1 and hasty.statistics().endpoints == 0
                await wait_idle(landing, timeout=1.0)  # closing the endpoint cancelled the receive
                await anyio.sleep(1.2)  # past the CTX's send delay
                assert torch.isnan(b).all() and torch.isnan(c).all()
                assert {"req-1", "req-2"} <= set((await lazy.astats())["held"])
                await hasty.pull(lazy.address, "req-1", LAYOUT.full_slice(), b)
                assert torch.equal(b, expected(1))
    finally:
        lazy.stop()


@pytest.mark.anyio
async def test_peer_killed_mid_pull_then_restarted(transport: UCXTransport, backend: str) -> None:
    victim = Peer("--send-delay", "5", backend=backend)  # the pulls wait in the data phase (UCX: receive posted)
    port = victim.port
    try:
        with anyio.fail_after(30):
            assert not transport.connected(victim.address)
            await transport.connect(victim.address)
            assert transport.connected(victim.address)  # what the inline path asks before it connects
            failures: list[BaseException] = []

            async def doomed(i: int) -> None:
                try:
                    await transport.pull(victim.address, f"req-{i}", LAYOUT.full_slice(), empty())
                except PeerClosed as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(doomed, i)
                await anyio.sleep(0.8)
                killed_at = anyio.current_time()
                await anyio.to_thread.run_sync(victim.kill)
            assert len(failures) == 3
            assert anyio.current_time() - killed_at < 5
            assert transport.statistics().endpoints == 0  # the stale endpoint is gone
            assert not transport.connected(victim.address)

            again = Peer("--port", str(port), backend=backend)
            try:
                into = empty()
                await transport.pull(again.address, "req-2", LAYOUT.full_slice(), into)
                assert torch.equal(into, expected(2))
            finally:
                again.stop()
    finally:
        victim.stop()


@pytest.mark.anyio
async def test_wrong_or_missing_secret_moves_zero_bytes(peer: Peer, backend: str) -> None:
    rid = "req-39"
    with anyio.fail_after(30):
        for config in ({"secret": b"wrong-secret-wrong-secret"}, {"secret": None, "allow_insecure": True}):
            async with make_transport(backend, **config) as t:  # type: ignore[arg-type]
                into = empty()
                with pytest.raises(AuthenticationFailed):
                    await t.pull(peer.address, rid, LAYOUT.full_slice(), into)
                assert torch.isnan(into).all()
                assert t.statistics().endpoints == 0 and t.statistics().bytes_moved == 0
        if backend == "nixl":  # a raw client that skips the handshake and looks the request up
            import asyncio

            from transports.nixl import read_msg, write_msg

            reader, writer = await asyncio.open_connection("127.0.0.1", peer.port)
            try:
                assert (await read_msg(reader, 1024))["t"] == "challenge"
                write_msg(writer, {"t": "lookup", "id": 1, "rid": rid, "handle": handle_for(rid), "slice": [0, 4, 0, 4],
                                   "dtype": "float16", "shape": list(LAYOUT.wire_shape(BLOCKS)), "keep": False})
                assert (await read_msg(reader, 1024))["t"] == "fail"  # no metadata, so no rkey: nothing can be read
                assert await reader.read() == b""  # and the connection is closed
            finally:
                writer.close()
            stats = await peer.astats()
            assert rid in stats["held"] and stats["auth_failures"] >= 2  # wrong secret, raw lookup
            return
        # a raw client that skips the handshake and asks for KV straight away
        apply_ucx_defaults()
        ep = await ucxx.create_endpoint("127.0.0.1", peer.port)
        try:
            pull = wire.Pull(1, rid, handle_for(rid), LAYOUT.full_slice(), "float16", LAYOUT.wire_shape(BLOCKS),
                             LAYOUT.wire_bytes(BLOCKS), 3)
            await ep.send(wire.encode_frame(pull), tag=0)
            into = empty()
            with anyio.move_on_after(1.5):
                await ep.recv(_ucx_buffer(into), tag=3)
            assert torch.isnan(into).all()
        except Exception:
            pass  # the server closing the endpoint is the expected outcome
        finally:
            ep.abort()
            ucxx.reset()
        stats = await peer.astats()
        assert rid in stats["held"]
        assert stats["auth_failures"] >= 2  # wrong secret, raw PULL (the secretless client gives up itself)


@pytest.mark.anyio
async def test_secure_client_refuses_insecure_server(backend: str) -> None:
    open_peer = Peer("--insecure", secret=None, backend=backend)
    try:
        with anyio.fail_after(20):
            async with make_transport(backend) as t:
                with pytest.raises(AuthenticationFailed, match="does not authenticate"):
                    await t.connect(open_peer.address)
            async with make_transport(backend, secret=None, allow_insecure=True) as t:
                into = empty()
                await t.pull(open_peer.address, "req-3", LAYOUT.full_slice(), into)
                assert torch.equal(into, expected(3))
    finally:
        open_peer.stop()


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is missing"
    return None


@pytest.mark.netns
@pytest.mark.skipif(_netns_unavailable() is not None, reason=_netns_unavailable() or "")
def test_pull_across_network_namespaces() -> None:
    """CTX in one namespace, GEN in another, joined by a veth pair; UCX over tcp only on the veth."""
    tag = uuid.uuid4().hex[:6]
    ns_ctx, ns_gen = f"kvo-ctx-{tag}", f"kvo-gen-{tag}"
    veth_ctx, veth_gen = f"kvc{tag}", f"kvg{tag}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    peer: Peer | None = None
    try:
        try:
            ip("netns", "add", ns_ctx)
            ip("netns", "add", ns_gen)
            ip("link", "add", veth_ctx, "type", "veth", "peer", "name", veth_gen)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create namespaces here: {exc.stderr.decode().strip()}")
        ip("link", "set", veth_ctx, "netns", ns_ctx)
        ip("link", "set", veth_gen, "netns", ns_gen)
        for ns, dev, addr in ((ns_ctx, veth_ctx, "10.213.0.1/24"), (ns_gen, veth_gen, "10.213.0.2/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": veth_ctx}
        peer = Peer(env=env, prefix=["ip", "netns", "exec", ns_ctx])
        client_env = {**os.environ, "KVO_SHARED_SECRET": SECRET.decode(), "UCX_TLS": "tcp", "UCX_NET_DEVICES": veth_gen}
        cmd = ["ip", "netns", "exec", ns_gen, sys.executable, "-m", "tests._ucx_peer", "client",
               "--peer", f"10.213.0.1:{peer.port}", "--index", "5", "--requests", str(REQUESTS), "--blocks", str(BLOCKS)]
        done = subprocess.run(cmd, cwd=ROOT, env=client_env, capture_output=True, text=True, timeout=40)
        result = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
        assert result == {"ok": True, "bytes": LAYOUT.wire_bytes(BLOCKS), "equal": True}, done.stderr[-2000:]
        assert "req-5" not in peer.stats()["held"]
    finally:
        if peer is not None:
            peer.stop()
        for ns in (ns_ctx, ns_gen):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# -- issue 8: hardening of the data plane -----------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["ucx"], indirect=True)  # UCX wire frames
async def test_a_malformed_frame_fails_its_request_only(peer: Peer, transport: UCXTransport) -> None:
    """A PULL whose request id breaks the rule gets PULL_ERR and one empty message on its data tag (it
    ends the KV receive a GEN posts with its PULL), nothing more; a RELEASE of such an id gets
    RELEASE_OK(False); pulls sharing the endpoint go on, the endpoint survives."""
    with anyio.fail_after(20):
        await transport.connect(peer.address)
        conn = transport._eps[peer.address]
        good = wire.encode_frame(wire.Pull(9001, "req-30", handle_for("req-30"), LAYOUT.full_slice(), "float16",
                                           LAYOUT.wire_shape(BLOCKS), LAYOUT.wire_bytes(BLOCKS), 2 * 9001 + 1))
        bad = bytearray(good.replace(b"req-30", "ré-30".encode()[:6]))  # same length, non-ASCII id
        reply = conn.post(reply_frame := bytearray(wire.FRAME_BYTES), 2 * 9001)
        data = conn.post(data_buf := bytearray(b"\x55" * 64), 2 * 9001 + 1)
        release_reply = conn.post(release_frame := bytearray(wire.FRAME_BYTES), 2 * 9002)
        bad_release = bytearray(wire.encode_frame(wire.Release(9002, "req-31", handle_for("req-31"))).replace(b"req-31", b"req 31"))
        neighbours = {i: empty() for i in (32, 33)}
        async with anyio.create_task_group() as tg:
            for i, buf in neighbours.items():
                tg.start_soon(transport.pull, peer.address, f"req-{i}", LAYOUT.full_slice(), buf)
            await conn.ep.send(bad, tag=0)
            await conn.ep.send(bad_release, tag=0)
            await reply
            await release_reply
            await data
        answer = wire.decode_frame(reply_frame, wire.WireLimits())
        assert isinstance(answer, wire.PullErr) and answer.status is wire.Status.BAD_REQUEST
        assert data_buf == b"\x55" * 64  # the data message was empty
        assert not ucxx_probe(conn, 2 * 9001 + 1)  # and nothing else follows on the data tag
        assert wire.decode_frame(release_frame, wire.WireLimits()) == wire.ReleaseOk(9002, False)
        for i, buf in neighbours.items():
            assert torch.equal(buf, expected(i))
        assert transport.statistics().endpoints == 1 and conn.error is None
        stats = await peer.astats()
        assert stats["malformed_frames"] == 2 and "req-31" in stats["held"]


@pytest.mark.anyio
async def test_a_wrong_handle_reads_and_frees_nothing(peer: Peer, transport: UCXTransport) -> None:
    with anyio.fail_after(20):
        into = empty()
        with pytest.raises(UnknownRequest):
            await transport.pull(peer.address, "req-34", LAYOUT.full_slice(), into, handle="0" * 32)
        assert torch.isnan(into).all()
        await transport.release(peer.address, "req-34", handle="0" * 32)
        assert "req-34" in (await peer.astats())["held"]
        await transport.pull(peer.address, "req-34", LAYOUT.full_slice(), into)
        assert torch.equal(into, expected(34))


@pytest.mark.anyio
async def test_a_bad_request_id_never_reaches_the_wire_and_release_does_not_raise(peer: Peer, transport: UCXTransport) -> None:
    with anyio.fail_after(20):
        for rid in ("é-ü", "x" * 129, "a b"):
            with pytest.raises(ProtocolViolation):
                await transport.pull(peer.address, rid, LAYOUT.full_slice(), empty(), handle="0" * 32)
            await transport.release(peer.address, rid, handle="0" * 32)  # logged, never raised
        assert transport.statistics().endpoints <= 1


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["ucx"], indirect=True)  # UCX wire frames
async def test_a_bad_hold_item_is_dropped_before_the_wire_and_costs_nothing_else(peer: Peer, transport: UCXTransport) -> None:
    """``hold`` is best effort like ``release``: an item with a bad request id or handle is dropped
    (logged) here. Before, one that could not be encoded failed the endpoint (every pull in flight on
    it), and one the CTX could not decode made it drop the whole HOLD frame, renewing none of the
    other leases in it."""
    with anyio.fail_after(20):
        await transport.connect(peer.address)
        conn = transport._eps[peer.address]
        before = (await peer.astats())["malformed_frames"]
        with structlog_capture() as logs:
            for bad in [("a b", handle_for("a b")), ("req-32", "0" * 31), ("é", handle_for("é")), ("x" * 300, handle_for("x"))]:
                await transport.hold(peer.address, [bad, ("req-33", handle_for("req-33"))])
        assert conn.error is None and transport._eps[peer.address] is conn
        assert sum(e["event"] == "ucx_hold_item_dropped" for e in logs) == 4
        into = empty()  # after the HOLDs on the same endpoint: the CTX has read them
        await transport.pull(peer.address, "req-38", LAYOUT.full_slice(), into)
        assert torch.equal(into, expected(38))
        assert (await peer.astats())["malformed_frames"] == before


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["nixl"], indirect=True)
async def test_a_bad_nixl_hold_item_is_dropped_not_the_batch_with_it(peer: Peer, transport) -> None:
    """NIXL's ``hold`` checked every item while it built the batch: one bad item raised, and the
    whole batch (every other request's lease renewal) was dropped with it. It drops that item."""
    with anyio.fail_after(20):
        await transport.connect(peer.address)
        conn = await transport._conn(peer.address)
        sent: list[dict] = []
        real_send = conn.send
        conn.send = lambda msg: (sent.append(msg), real_send(msg))[1]
        with structlog_capture() as logs:
            for bad in [("a b", handle_for("a b")), ("req-32", "0" * 31), ("x" * 300, handle_for("x"))]:
                await transport.hold(peer.address, [bad, ("req-33", handle_for("req-33"))])
        assert sum(e["event"] == "nixl_hold_item_dropped" for e in logs) == 3
        assert [m["items"] for m in sent] == [[["req-33", handle_for("req-33")]]] * 3
        into = empty()
        await transport.pull(peer.address, "req-38", LAYOUT.full_slice(), into)
        assert torch.equal(into, expected(38))


@pytest.mark.anyio
async def test_a_layout_mismatch_fails_the_connection_once_with_a_clear_error(peer: Peer, backend: str) -> None:
    from transports import IncompatiblePeer, KVLayout

    other = KVLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim,
                     block_size=32, dtype=LAYOUT.dtype)
    with anyio.fail_after(20):
        async with make_transport(backend, dead_peer_backoff_s=30, layout=other) as t:
            with structlog_capture() as logs:
                with pytest.raises(IncompatiblePeer, match="block_size 16 vs 32"):
                    await t.connect(peer.address)
                t0 = anyio.current_time()
                for _ in range(5):  # later pulls fail at once, without connecting again
                    with pytest.raises(IncompatiblePeer):
                        await t.pull(peer.address, "req-35", LAYOUT.full_slice(), empty())
                assert anyio.current_time() - t0 < 0.5
            assert [e["event"] for e in logs].count(f"{backend}_incompatible_peer") == 1  # one handshake
            assert t.statistics().peers_down == 1
        async with make_transport(backend, layout=LAYOUT) as t:  # the right layout connects
            await t.connect(peer.address)


@pytest.mark.anyio
async def test_gen_keeps_below_the_ctx_pull_limit_so_nothing_is_refused_busy() -> None:
    small = Peer("--max-pulls", "2", "--gather-delay", "0.05")
    try:
        with anyio.fail_after(30):
            async with UCXTransport(UCXConfig(secret=SECRET)) as t:
                out = {i: empty() for i in range(10)}
                async with anyio.create_task_group() as tg:
                    for i, buf in out.items():
                        tg.start_soon(t.pull, small.address, f"req-{i}", LAYOUT.full_slice(), buf)
                assert all(torch.equal(buf, expected(i)) for i, buf in out.items())
                assert t.statistics().pulls_ok == 10
            assert (await small.astats())["pulls_refused"] == 0
    finally:
        small.stop()


@pytest.mark.anyio
async def test_a_refused_port_and_a_dead_peer_fail_at_once_not_one_connect_timeout_each(backend: str) -> None:
    from transports import PeerUnreachable

    with anyio.fail_after(30):
        async with make_transport(backend, connect_timeout_s=5.0) as t:
            t0 = anyio.current_time()
            with pytest.raises(PeerUnreachable, match="refused"):
                await t.pull("127.0.0.1:1", "req-0", LAYOUT.full_slice(), empty())
            assert anyio.current_time() - t0 < 1.0  # not the 5 s connect timeout
            victim = Peer(backend=backend)
            try:
                await t.pull(victim.address, "req-0", LAYOUT.full_slice(), empty())
            finally:
                victim.kill()
            errors: list[BaseException] = []

            async def doomed(i: int) -> None:
                try:
                    await t.pull(victim.address, f"req-{i}", LAYOUT.full_slice(), empty())
                except TransportError as exc:
                    errors.append(exc)

            t0 = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for i in range(1, 7):
                    tg.start_soon(doomed, i)
            assert len(errors) == 6 and all(isinstance(e, (PeerUnreachable, PeerClosed)) for e in errors)
            assert anyio.current_time() - t0 < 3.0  # together, not 6 x 5 s one after another


@pytest.mark.anyio
async def test_a_ctx_restarted_while_idle_is_reached_on_the_first_try(backend: str) -> None:
    first = Peer(backend=backend)
    port = first.port
    try:
        with anyio.fail_after(40):
            async with make_transport(backend) as t:
                into = empty()
                await t.pull(first.address, "req-0", LAYOUT.full_slice(), into)  # an endpoint, now idle
                first.kill()
                second = Peer("--port", str(port), backend=backend)
                try:
                    await t.pull(second.address, "req-1", LAYOUT.full_slice(), into)  # the stale endpoint is replaced
                    assert torch.equal(into, expected(1))
                finally:
                    second.stop()
    finally:
        first.stop()


@pytest.mark.anyio
async def test_auth_failures_are_logged_with_the_peer_address(tmp_path: Path, backend: str) -> None:
    log = tmp_path / "ctx.log"
    p = Peer(log=log, backend=backend)
    try:
        with anyio.fail_after(20):
            async with make_transport(backend, secret=b"wrong-secret-wrong-secret") as t:
                with pytest.raises(AuthenticationFailed):
                    await t.connect(p.address)
            await p.astats()
    finally:
        p.stop()
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("event") == f"{backend}_auth_failed"]
    assert failed and failed[0]["peer"] and failed[0]["peer"].startswith("127.0.0.1:")


@pytest.mark.anyio
async def test_unauthenticated_endpoints_are_bounded() -> None:
    p = Peer("--max-unauthenticated", "2", "--handshake-timeout", "3")
    apply_ucx_defaults()
    silent = []
    try:
        with anyio.fail_after(30):
            for _ in range(5):  # connect and never answer the challenge
                silent.append(await ucxx.create_endpoint("127.0.0.1", p.port))
            await anyio.sleep(0.5)
            stats = await p.astats()
            assert stats["connections"] <= 2  # the others were closed at once
            async with UCXTransport(UCXConfig(secret=SECRET, connect_timeout_s=10, handshake_timeout_s=10)) as t:
                await anyio.sleep(3.5)  # the silent ones time out and free their slots
                into = empty()
                await t.pull(p.address, "req-2", LAYOUT.full_slice(), into)
                assert torch.equal(into, expected(2))
    finally:
        for ep in silent:
            ep.abort()
        p.stop()


@pytest.mark.anyio
async def test_peers_are_bounded(peer: Peer, backend: str) -> None:
    """``max_peers``: a GEN keeps per-peer state for at most that many CTX peers at once."""
    from transports import PeerUnreachable

    second = Peer(backend=backend)
    try:
        with anyio.fail_after(30):
            async with make_transport(backend, max_peers=1) as t:
                await t.pull(peer.address, "req-36", LAYOUT.full_slice(), empty())
                with pytest.raises(PeerUnreachable, match="too many KV peers"):
                    await t.pull(second.address, "req-36", LAYOUT.full_slice(), empty())
                assert t.statistics().endpoints == 1
            async with make_transport(backend, max_peers=2) as t:  # within the bound: both connect
                await t.connect(peer.address)
                await t.connect(second.address)
                assert t.statistics().endpoints == 2
    finally:
        second.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["ucx"], indirect=True)  # ucxx tag messages (NIXL: test_nixl_transport)
@pytest.mark.parametrize("corrupt", ["short", "short1", "short7", "short-told", "whole-foreign", "long", "foreign",
                                     "long-reply", "garbage-reply"])
async def test_a_wrong_kv_message_fails_its_pull_only(transport: UCXTransport, corrupt: str) -> None:
    """Invariant 12: a CTX that answers a PULL with a short KV message (ucxx completes it into the
    larger receive without a word: half the KV, or all but its last byte or 7, with no reply; or all
    but the last byte, ending in the probe, with a PULL_WHOLE naming its length, or the whole length
    and another pull), a long one, or no
    KV and a PULL_ERR that names another pull or a reply longer than a frame (which ucxx fails as
    truncated: it once cost the endpoint and every pull on it) or a frame of garbage fails that pull
    with ProtocolViolation, whose message names the peer; `into` is as
    it was but for what the short message wrote, its landing ends, the endpoint and the other pulls
    go on."""
    bad = Peer("--corrupt", corrupt)
    try:
        with anyio.fail_after(20):
            into, landing = empty().fill_(3.0), Landing()
            with pytest.raises(ProtocolViolation, match="shorter|longer|unexpected reply|its PULL asked|malformed") as err:
                await transport.pull(bad.address, "req-1", LAYOUT.full_slice(), into, landing=landing)
            assert err.value.peer == bad.address and str(err.value).startswith(bad.address)  # one line, naming the peer
            await wait_idle(landing)
            before = empty().fill_(3.0).reshape(-1).view(torch.uint8)[-1]
            assert into.reshape(-1).view(torch.uint8)[-1] == before  # the byte the probe replaced, put back
            conn = transport._eps[bad.address]
            assert conn.error is None and transport.statistics().endpoints == 1
            for i in (0, 2):
                b = empty()
                assert await transport.pull(bad.address, f"req-{i}", LAYOUT.full_slice(), b) == b.numel() * 2
                assert torch.equal(b, expected(i))
            assert transport.statistics().endpoints == 1
    finally:
        bad.stop()


@pytest.mark.anyio  # the ucxx pull's probe byte
@pytest.mark.parametrize("zero_copy", [False, True], ids=["gathered", "zero-copy"])
async def test_a_kv_ending_in_the_probe_lands_whole_told_by_a_pull_whole(monkeypatch: pytest.MonkeyPatch,
                                                                         zero_copy: bool) -> None:
    """The probe GEN writes over the last byte of ``into`` is random; a KV that ends in it (1 pull
    in 256, forced here) looks like a short message, so the CTX, which sees the last byte of what it
    sends, follows the KV with a PULL_WHOLE naming its length: the pull succeeds with the whole KV
    (the probe's byte is the KV's, not put back), on the gathered path and on the zero-copy one
    (which hands such a pull to its task). Then unforced pulls need no reply (none counted)."""
    from transports import _ucx_endpoint

    peer = Peer(*(["--runs"] if zero_copy else []))
    try:
        pool = make_pool(LAYOUT, TOTAL)

        def want(i: int) -> torch.Tensor:
            return pool[block_ids(i, BLOCKS, TOTAL, runs=zero_copy)]

        last = int(want(13).reshape(-1).view(torch.uint8)[-1])
        async with UCXTransport(UCXConfig(secret=SECRET, cancel_grace_s=0.2)) as t:
            with anyio.fail_after(30):
                for _ in range(3):
                    with monkeypatch.context() as m:
                        m.setattr(_ucx_endpoint.random, "getrandbits", lambda bits: last)
                        into, landing = empty(), Landing()
                        await t.pull(peer.address, "req-13", LAYOUT.full_slice(), into, landing=landing, release=False)
                    assert torch.equal(into, want(13)) and not landing.busy
                stats = await peer.astats()
                while stats["pulls_served"] < 3:  # counted when its send ends, after the GEN has the KV
                    await anyio.sleep(0.05)
                    stats = await peer.astats()
                assert stats["pulls_ending_in_probe"] == 3 and stats["pulls_served"] == 3
                conn = t._eps[peer.address]
                assert conn.error is None and not conn.unanswered
                for i in (13, 14):
                    b = empty()
                    await t.pull(peer.address, f"req-{i}", LAYOUT.full_slice(), b, release=False)
                    assert torch.equal(b, want(i))
    finally:
        peer.stop()


@pytest.mark.anyio  # the ucxx pull's probe byte
async def test_a_pull_cancelled_while_its_reply_decides_still_ends_its_landing() -> None:
    """A short message leaves the probe, so the pull waits for a reply (none comes); cancelled then,
    its landing still ends once the grace has passed (the grace's end is decided by the outcome, not
    by the cancelled pull's own future)."""
    bad = Peer("--corrupt", "short1")
    try:
        async with UCXTransport(UCXConfig(secret=SECRET, cancel_grace_s=0.3)) as t:
            await t.connect(bad.address)
            landing = Landing()
            with anyio.fail_after(10):
                with anyio.move_on_after(0.15):  # the short message has come; its reply is awaited
                    await t.pull(bad.address, "req-1", LAYOUT.full_slice(), empty(), landing=landing, release=False)
                await wait_idle(landing)
    finally:
        bad.stop()


@pytest.mark.anyio  # the ucxx pull's probe byte
async def test_short_messages_no_reply_explains_are_bounded_per_endpoint() -> None:
    """A short message leaves the probe; with no PULL_ERR or PULL_WHOLE within the grace the pull
    fails as short, its reply receive stays posted: more than ``MAX_UNANSWERED`` of them cost the
    endpoint, which a new pull replaces."""
    from transports import _ucx_endpoint

    bad = Peer("--corrupt", "short1")
    try:
        async with UCXTransport(UCXConfig(secret=SECRET, cancel_grace_s=0.2)) as t:
            with anyio.fail_after(30):
                with pytest.raises(ProtocolViolation, match="shorter"):
                    await t.pull(bad.address, "req-1", LAYOUT.full_slice(), empty(), release=False)
                conn = t._eps[bad.address]
                assert conn.error is None and len(conn.unanswered) == 1
                for _ in range(_ucx_endpoint.MAX_UNANSWERED):
                    with pytest.raises(ProtocolViolation, match="shorter"):
                        await t.pull(bad.address, "req-1", LAYOUT.full_slice(), empty(), release=False)
                assert conn.error is not None and t.statistics().endpoints == 0  # 17 unanswered: the endpoint went
                b = empty()
                await t.pull(bad.address, "req-2", LAYOUT.full_slice(), b)
                assert torch.equal(b, expected(2))
    finally:
        bad.stop()


@pytest.mark.anyio
async def test_concurrent_pulls_of_one_request_make_a_bounded_number_of_copies() -> None:
    """A GEN that pulls one request many times at once (release=False) cannot make the CTX hold many
    gathered copies of it: at most ``max_gathers_per_request`` are made at once, every pull succeeds."""
    blocks = 24  # 1.5 MiB: gathered in worker threads, which could run at once
    peer = Peer("--gather-delay", "0.2", "--max-gathers", "2", "--blocks", str(blocks))
    try:
        with anyio.fail_after(30):
            total = REQUESTS * blocks + 8
            want = make_pool(LAYOUT, total)[block_ids(3, blocks, total)]
            async with UCXTransport(UCXConfig(secret=SECRET)) as t:
                out = [empty(blocks=blocks) for _ in range(6)]
                async with anyio.create_task_group() as tg:
                    for buf in out:
                        tg.start_soon(functools.partial(t.pull, peer.address, "req-3", LAYOUT.full_slice(), buf,
                                                        release=False))
                assert all(torch.equal(buf, want) for buf in out)
            stats = await peer.astats()
            assert stats["max_gathers"] == 2 and "req-3" in stats["held"]
    finally:
        peer.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("runs", [True, False], ids=["zero-copy", "gathered"])
async def test_a_gen_stopped_mid_pull_holds_the_ctx_s_blocks_no_longer_than_the_send_timeout(runs: bool) -> None:
    """A GEN stopped, hung or cut off with its pull posted never ends the CTX's KV send (UCX does not
    notice), and a pinned entry outlives its lease: its blocks were held for good (until the GEN
    process died). The CTX aborts a send not ended within ``send_timeout_s``: the pin goes and the
    lease frees the blocks. Here the PULL goes out without the KV receive a GEN posts with it."""
    p = Peer("--send-timeout", "2.5", "--lease", "1", *(["--runs"] if runs else []))
    try:
        with anyio.fail_after(30):
            async with UCXTransport(UCXConfig(secret=SECRET)) as t:
                await t.connect(p.address)
                assert p.proc.stdin is not None
                p.proc.stdin.write("put stuck\n")  # held from now, for its 1 s lease
                p.proc.stdin.flush()
                assert p._reply() == {"ok": True}
                txid = 9100
                t._eps[p.address].post_send(wire.Pull(txid, "stuck", handle_for("stuck"), LAYOUT.full_slice(), "float16",
                                                      LAYOUT.wire_shape(BLOCKS), LAYOUT.wire_bytes(BLOCKS), 2 * txid + 1))
                while (s := await p.astats())["open_pins"] == 0:  # its send is posted, its blocks pinned
                    await anyio.sleep(0.02)
                posted = anyio.current_time()
                await anyio.sleep(1.5)  # past its lease: the pin keeps it
                s = await p.astats()
                assert "stuck" in s["held"] and s["open_pins"] == 1 and s["sends_timed_out"] == 0, s
                while "stuck" in (s := await p.astats())["held"]:
                    await anyio.sleep(0.05)
                assert anyio.current_time() - posted < 10
                assert s["sends_timed_out"] == 1 and s["open_pins"] == 0 and s["expired"] >= 1, s
    finally:
        p.stop()


@pytest.mark.anyio
async def test_releases_a_ctx_never_answers_keep_a_bounded_number_of_receives_posted() -> None:
    from transports._ucx_endpoint import MAX_UNANSWERED

    p = Peer("--ignore-releases")
    try:
        with anyio.fail_after(30):
            async with UCXTransport(UCXConfig(secret=SECRET, release_timeout_s=0.05, connect_timeout_s=0.5)) as t:
                await t.connect(p.address)
                conn = t._eps[p.address]
                async with anyio.create_task_group() as tg:  # each gives up after its 0.55 s
                    for i in range(MAX_UNANSWERED):
                        tg.start_soon(t.release, p.address, f"req-{i}")
                assert conn.error is None and conn.releases_unanswered == MAX_UNANSWERED
                await t.release(p.address, f"req-{MAX_UNANSWERED}")  # one more: the endpoint goes
                assert conn.error is not None and "RELEASEs unanswered" in str(conn.error)
                while conn.releases_unanswered:  # closing the endpoint ends every reply receive still posted
                    await anyio.sleep(0.02)
                into = empty()
                await t.pull(p.address, "req-30", LAYOUT.full_slice(), into)  # a new endpoint serves
                assert torch.equal(into, expected(30)) and t._eps[p.address] is not conn
            held = (await p.astats())["held"]
            assert not [f"req-{i}" for i in range(MAX_UNANSWERED + 1) if f"req-{i}" in held]  # each RELEASE freed
    finally:
        p.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["ucx"], indirect=True)  # UCX wire frames
async def test_an_oversized_control_frame_is_counted_and_the_endpoint_serves_on(peer: Peer, transport: UCXTransport) -> None:
    """A control frame longer than one overflows the CTX's receive (UCX: truncated): it names no
    request, so it is counted as malformed and dropped; before, it ended the endpoint and failed
    every pull in flight on it."""
    with anyio.fail_after(20):
        await transport.connect(peer.address)
        conn = transport._eps[peer.address]
        before = (await peer.astats())["malformed_frames"]
        await conn.ep.send(bytearray(2 * wire.FRAME_BYTES), tag=0)
        into = empty()
        await transport.pull(peer.address, "req-37", LAYOUT.full_slice(), into)
        assert torch.equal(into, expected(37))
        assert conn.error is None and transport._eps[peer.address] is conn
        assert (await peer.astats())["malformed_frames"] == before + 1


def test_the_last_ucx_owner_wakes_the_notifier_thread_instead_of_waiting_out_its_poll() -> None:
    """``ucxx.reset()`` queues "shutdown" for its notifier thread and joins it, but the thread reads
    its queue only when its 1 s wait for requests ends: every node's stop waited up to a second for
    it. The last owner now wakes the wait itself (measured on an idle CTX's SIGTERM: 1.6-1.7 s to
    exit before, 0.8-0.9 s after). Nothing is queued here: only the wake can end the thread."""
    from transports import _ucx_common as uc

    uc.apply_ucx_defaults()
    ucxx = uc._ucx_acquire()
    try:
        assert uc._owners == 1  # a context of this test's own: waking it stops nobody else's
        thread = ucxx.core._get_ctx().notifier_thread
        assert thread is not None and thread.is_alive()
        uc._wake_notifier(ucxx)
        thread.join(5)
        assert not thread.is_alive()
    finally:
        uc._ucx_release()
    assert uc._owners == 0
