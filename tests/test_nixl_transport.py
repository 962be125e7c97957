"""NIXLTransport (GEN) against a NIXLKVServer (CTX), both in this process: parity with the CTX's
blocks (scattered ids, full and partial slices), authentication (a wrong secret moves zero bytes),
clean refusals, and the transport benchmark's NIXL paths in quick mode."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from transports import (  # noqa: E402
    AuthenticationFailed,
    KVLayout,
    KVSlice,
    KVStore,
    Landing,
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
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=LAYOUT) as t:
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
        assert server.statistics().auth_failures == 2 and server.statistics().served == 0
        assert store.statistics().held_requests == 1  # the entry is still there


@pytest.mark.anyio
async def test_unknown_request_wrong_handle_and_shape_fail_cleanly() -> None:
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=LAYOUT) as t:
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
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=LAYOUT) as t:
            await t.connect(peer)
            into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
            landing = Landing()
            task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle,
                                                landing=landing, release=False))
            for _ in range(200):  # cancel once the READ is posted
                if landing.busy or task.done():
                    break
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises((asyncio.CancelledError, Exception)):
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
    assert any(c["target"].startswith("nixl-pull [shm] / raw") for c in res["targets"])


@pytest.mark.anyio
async def test_ctx_restart_reconnects_and_hold_renews() -> None:
    store = _store()
    handle = store.put("r1", IDS, num_tokens=25, lease_s=0.5)
    config = NIXLConfig(secret=SECRET)
    async with NIXLTransport(config, layout=LAYOUT) as t:
        into = torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)
        async with NIXLKVServer(store, config, host="127.0.0.1", expire_interval_s=0.1) as first:
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
