"""NIXLTransport (GEN) against a NIXLKVServer (CTX), both in this process: parity with the CTX's
blocks (scattered ids, full and partial slices), authentication (a wrong secret moves zero bytes),
clean refusals, a stale connection replaced once, head slices from a CTX holding some heads, and
the transport benchmark's NIXL paths in quick mode. The conformance tests shared with the UCX path
(a CTX in another process) are in test_ucx_transport.py, parametrised by backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
import torch

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from transports import (  # noqa: E402
    AuthenticationFailed,
    KVLayout,
    KVSlice,
    KVStore,
    Landing,
    PeerClosed,
    ProtocolViolation,
    Transport,
    UnknownRequest,
    gather,
)
from transports.nixl import NIXLConfig, NIXLKVServer, NIXLTransport, segments  # noqa: E402

pytestmark = pytest.mark.integration

SECRET = b"test-secret-0123456789abcdef"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype=torch.float16)
IDS = torch.tensor([5, 2, 3, 7, 8, 9, 0])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _store() -> KVStore:
    return KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())


@contextlib.asynccontextmanager
async def _served_r1() -> AsyncIterator[tuple[KVStore, str, NIXLKVServer, str, NIXLTransport]]:
    """A CTX (``NIXLKVServer``) holding request "r1" and a GEN transport: (store, handle, server, peer, t)."""
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        async with NIXLTransport(config, layout=LAYOUT) as t:
            yield store, handle, server, f"127.0.0.1:{server.port}", t


async def _until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_segments_merge_runs() -> None:
    full = LAYOUT.full_slice()
    remote, local, lengths = segments(LAYOUT, [4, 5, 6, 1], full)
    assert list(lengths) == [3 * LAYOUT.block_bytes, LAYOUT.block_bytes]  # 4,5,6 is one run
    assert list(remote) == [4 * LAYOUT.block_bytes, LAYOUT.block_bytes] and list(local) == [0, 3 * LAYOUT.block_bytes]
    part = KVSlice(1, 3, 1, 3)
    _, _, lengths = segments(LAYOUT, [0, 1], part)
    assert int(lengths.sum()) == LAYOUT.wire_bytes(2, part)


@pytest.mark.anyio
async def test_parity_full_and_partial_then_release() -> None:
    async with _served_r1() as (store, handle, server, peer, t):
        assert isinstance(t, Transport)
        part = KVSlice(1, 3, 1, 3)
        into = torch.zeros(LAYOUT.wire_shape(len(IDS), part), dtype=LAYOUT.dtype)
        assert await t.pull(peer, "r1", part, into, handle=handle, release=False) == into.nbytes
        assert torch.equal(into, gather(store.pool, IDS, part))
        arena = torch.zeros(LAYOUT.wire_shape(len(IDS) + 2), dtype=LAYOUT.dtype)
        t.register(arena)  # registered once: the pull needs no registration of its own
        landing = Landing()
        into = arena[1 : 1 + len(IDS)]
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing)
        assert not landing.busy
        assert torch.equal(into, gather(store.pool, IDS, LAYOUT.full_slice()))
        assert t.statistics().adhoc_registrations == 1 and t.statistics().pulls_ok == 2
        await _until(lambda: store.statistics().held_requests == 0)  # the notification released it
        assert server.statistics().served == 2 and server.statistics().pinned == 0
        with pytest.raises(UnknownRequest):  # released: a second pull finds nothing
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)


@pytest.mark.anyio
async def test_wrong_secret_moves_zero_bytes() -> None:
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    async with NIXLKVServer(store, NIXLConfig(secret=SECRET), host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        for config in (NIXLConfig(secret=b"another-secret-0123456789"), NIXLConfig(allow_insecure=True)):
            async with NIXLTransport(config, layout=LAYOUT) as t:
                into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
                with pytest.raises(AuthenticationFailed):
                    await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)
                assert not into.any() and t.statistics().bytes_moved == 0
        # the wrong secret fails on the CTX; the secretless GEN gives up itself (the CTX asks for auth)
        assert server.statistics().auth_failures == 1 and server.statistics().served == 0
        assert store.statistics().held_requests == 1  # the entry is still there


@pytest.mark.anyio
async def test_unknown_request_wrong_handle_and_shape_fail_cleanly() -> None:
    async with _served_r1() as (store, handle, server, peer, t):
        into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "nope", LAYOUT.full_slice(), into, handle=handle)
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle="0" * 32)
        with pytest.raises(ProtocolViolation):  # a shape the CTX does not hold: refused, entry kept
            await t.pull(peer, "r1", LAYOUT.full_slice(), into[:-1], handle=handle)
        with pytest.raises(ProtocolViolation):  # no handle: refused locally
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=None)
        assert not into.any() and server.statistics().pinned == 0
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)  # the connection still serves
        assert torch.equal(into, gather(store.pool, IDS, LAYOUT.full_slice()))
        await t.release(peer, "r1", handle=handle)  # best effort on a released entry: no raise


@pytest.mark.anyio
async def test_cancelled_pull_keeps_landing_until_read_ends() -> None:
    async with _served_r1() as (store, handle, server, peer, t):
        await t.connect(peer)
        into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
        landing = Landing()
        task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle,
                                            landing=landing, release=False))
        for _ in range(200):  # cancel once the READ is posted
            if landing.busy or task.done():
                break
            await asyncio.sleep(0)
        task.cancel()  # on one host the READ may complete inside transfer(): the pull is then already done
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _until(lambda: not landing.busy)  # NIXL ended the READ; only then is `into` free
        await _until(lambda: server.statistics().pinned == 0)
    assert store.statistics().held_requests == 1


def test_bench_transport_nixl_quick(tmp_path) -> None:
    """``python -m examples.bench transport`` with its NIXL paths, tiny budget, shared memory only."""
    from examples import bench_transport

    out = tmp_path / "t.json"
    assert bench_transport.main(["--quick", "--modes", "nixl-read,nixl-pull", "--configs", "shm",
                                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"nixl-read [shm]", "nixl-pull [shm]"}, res["meta"]["notes"]
    pull = res["results"]["nixl-pull [shm]"]
    assert pull["1"]["gbps"] > 0 and pull["lookup_us"] > 0 and pull["adhoc_registrations"] == 0
    assert pull["unpinned_reads"] > 0  # the block ids and the epoch given: no pin on the way
    assert any(c["target"].startswith("nixl-pull [shm] / raw") for c in res["targets"])


@pytest.mark.anyio
async def test_ctx_restart_reconnects_and_hold_renews() -> None:
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=0.5)
    config = NIXLConfig(secret=SECRET)
    async with NIXLTransport(config, layout=LAYOUT) as t:
        into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
        async with NIXLKVServer(store, config, host="127.0.0.1", expire_interval_s=0.1, lease_s=0.5) as first:
            port = first.port
            peer = f"127.0.0.1:{port}"
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False)
            for _ in range(6):  # renewals keep the 0.5 s lease alive for 0.9 s
                await t.hold(peer, [("r1", handle)])
                await asyncio.sleep(0.15)
            assert store.statistics().held_requests == 1
        await asyncio.sleep(0.1)  # the GEN's control connection sees the CTX go
        async with NIXLKVServer(store, config, host="127.0.0.1", port=port) as second:  # a new NIXL agent
            into.zero_()
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)
            assert torch.equal(into, gather(store.pool, IDS, LAYOUT.full_slice()))
            await _until(lambda: second.statistics().served == 1)


class _DropsConnections(NIXLKVServer):
    """A CTX that drops every GEN connection when a lookup of a request in ``drop_on`` arrives (as a
    CTX that restarted between two pulls does), before answering it: no READ can have been posted."""

    drop_on: set[str] = set()

    async def _before_send(self, msg) -> None:
        if msg.get("rid") in self.drop_on:
            if msg["rid"].endswith("-once"):
                self.drop_on.discard(msg["rid"])
            for w in list(self._conns):
                w.close()
            await asyncio.sleep(3600)  # never answered: the connection is gone


@pytest.mark.anyio
async def test_a_stale_connection_is_replaced_once_before_any_read() -> None:
    store = _store()
    h1 = store.put("r1", IDS, num_tokens=25, lease_s=60)
    h2 = store.put("r2-once", torch.tensor([1, 4]), num_tokens=8, lease_s=60)
    h3 = store.put("r3", torch.tensor([6]), num_tokens=4, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with _DropsConnections(store, config, host="127.0.0.1") as server:
        server.drop_on = {"r2-once", "r3"}
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=LAYOUT) as t:
            into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=h1)  # the connection served once
            two = torch.zeros(LAYOUT.wire_shape(2), dtype=LAYOUT.dtype)
            await t.pull(peer, "r2-once", LAYOUT.full_slice(), two, handle=h2)  # dropped, then retried on a new one
            assert torch.equal(two, gather(store.pool, torch.tensor([1, 4]), LAYOUT.full_slice()))
            assert t.statistics().pulls_retried == 1
            one = torch.zeros(LAYOUT.wire_shape(1), dtype=LAYOUT.dtype)
            with pytest.raises(PeerClosed):  # dropped on the retry too: one retry only, then it fails
                await t.pull(peer, "r3", LAYOUT.full_slice(), one, handle=h3)
            assert t.statistics().pulls_retried == 2 and not one.any()
            assert store.statistics().held_requests == 1  # r3 is still held (r1, r2 were pulled)


@pytest.mark.anyio
async def test_head_slices_from_a_ctx_that_holds_only_some_heads() -> None:
    """GEN tensor parallelism: a GEN rank holding 2 of the model's 4 KV heads pulls heads 2..4 from a
    CTX that holds all four, and heads 0..2 (its own numbering) from a CTX rank that holds only the
    model's heads 2..4; a CTX whose model has another number of heads is refused at connect."""
    from transports import IncompatiblePeer

    gen_layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    full = _store()
    hf = full.put("r1", IDS, num_tokens=25, lease_s=60)
    half = KVStore(gen_layout, gen_layout.new_pool(16).uniform_())
    hh = half.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(full, config, host="127.0.0.1") as a, \
            NIXLKVServer(half, config, host="127.0.0.1", head_start=2, total_kv_heads=4) as b, \
            NIXLKVServer(half, config, host="127.0.0.1") as c:  # says its model has 2 heads
        async with NIXLTransport(config, layout=gen_layout, total_kv_heads=4) as t:
            upper = KVSlice(0, 3, 2, 4)
            into = torch.zeros(gen_layout.wire_shape(len(IDS)), dtype=gen_layout.dtype)
            await t.pull(f"127.0.0.1:{a.port}", "r1", upper, into, handle=hf)
            assert torch.equal(into, gather(full.pool, IDS, upper))
            into.zero_()
            await t.pull(f"127.0.0.1:{b.port}", "r1", gen_layout.full_slice(), into, handle=hh)
            assert torch.equal(into, gather(half.pool, IDS, gen_layout.full_slice()))
            with pytest.raises(IncompatiblePeer, match="kv_heads 2 vs 4"):
                await t.connect(f"127.0.0.1:{c.port}")


@pytest.mark.anyio
async def test_a_cancelled_read_keeps_its_landing_busy_until_the_data_is_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ cannot be withdrawn: a pull cancelled while its 32 MiB READ runs returns at once, and
    its landing goes idle only when NIXL ended the READ, by which time every byte has landed.

    Over TCP: on shared memory / cma, NIXL's ``transfer()`` copies the data before it returns (the
    READ is never in flight when the pull could be cancelled); over TCP UCX emulates the GET with
    the target's progress thread, so the READ runs for tens of ms after ``transfer()``."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # read when the agents below create their UCX contexts
    big = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=256, dtype=torch.float16)  # 4 MiB blocks
    store = KVStore(big, big.new_pool(10).uniform_())
    ids = torch.arange(1, 9)
    handle = store.put("big", ids, num_tokens=8 * 256, lease_s=60)
    want = gather(store.pool, ids, big.full_slice())
    config = NIXLConfig(secret=SECRET)
    async with asyncio.timeout(60), NIXLKVServer(store, config, host="127.0.0.1") as server:  # (a hang fails)
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=big) as t:
            into = torch.zeros(big.wire_shape(len(ids)), dtype=big.dtype)
            t.register(into)
            await t.connect(peer)
            landing, at_idle = Landing(), []
            task = asyncio.ensure_future(t.pull(peer, "big", big.full_slice(), into, handle=handle, landing=landing,
                                                release=False))
            while not landing.busy:  # the READ is posted
                assert not task.done()
                await asyncio.sleep(0)
            task.cancel()
            landing.when_idle(lambda: at_idle.append(torch.equal(into, want)))
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until(lambda: not landing.busy)
            assert at_idle == [True]  # idle only once the whole READ had landed
            await _until(lambda: server.statistics().pinned == 0)
    assert store.statistics().held_requests == 1


@pytest.mark.anyio
async def test_the_engine_registers_its_kv_pool_once_and_in_place_pulls_register_nothing() -> None:
    from orchestrator import GenEngine, OrchestratorConfig

    async with _served_r1() as (store, handle, server, peer, t):
        engine = GenEngine(OrchestratorConfig(layout=LAYOUT, num_blocks=16, transfer_budget_bytes=1 << 20), t,
                           lambda batch: batch.tokens)
        try:
            blocks = engine.pool.kv[3 : 3 + len(IDS)]  # a run of the engine's blocks: the pull lands in place
            await t.pull(peer, "r1", LAYOUT.full_slice(), blocks, handle=handle)
            assert torch.equal(blocks, gather(store.pool, IDS, LAYOUT.full_slice()))
            assert t.statistics().adhoc_registrations == 0 and t.statistics().pulls_ok == 1
        finally:
            engine.close()
