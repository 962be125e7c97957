"""Invariant 12 on the NIXL data plane (issue 17): no CTX block is freed or reused while a READ of it
may be in flight, and every path of a READ ends what it started (landing, pin, handle), bounded.

GEN (``NIXLTransport``) and CTX (``NIXLKVServer``) run in this process over shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator

import anyio
import pytest
import torch

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from transports import KVLayout, KVStore, Landing, PeerClosed, ProtocolViolation, gather  # noqa: E402
from transports.nixl import NIXLConfig, NIXLKVServer, NIXLTransport  # noqa: E402

pytestmark = pytest.mark.integration

SECRET = b"test-secret-0123456789abcdef"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype=torch.float16)
IDS = torch.tensor([5, 2, 3, 7, 8, 9, 0])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


@contextlib.asynccontextmanager
async def _served(*, lease_s: float = 60, gen: type[NIXLTransport] = NIXLTransport, server: type[NIXLKVServer] = NIXLKVServer,
                  server_kw: dict | None = None,
                  **config_kw: object) -> AsyncIterator[tuple[KVStore, str, NIXLKVServer, str, NIXLTransport]]:
    """A CTX holding "r1" (its freed blocks are overwritten at once, as a reuse would) and a GEN."""
    store = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())

    def reuse() -> None:
        store.pool[IDS] = -1.0

    config = NIXLConfig(secret=SECRET, **config_kw)  # type: ignore[arg-type]
    async with server(store, config, host="127.0.0.1", lease_s=lease_s, **(server_kw or {})) as srv:
        handle = store.put("r1", IDS, num_tokens=25, lease_s=lease_s, on_release=reuse)  # its handle names "r1"
        async with gen(config, layout=LAYOUT) as t:
            yield store, handle, srv, f"127.0.0.1:{srv.port}", t


def _into() -> torch.Tensor:
    return torch.zeros(LAYOUT.wire_shape(len(IDS)), dtype=LAYOUT.dtype)


@pytest.mark.anyio
async def test_a_read_held_past_the_pin_lease_finds_its_blocks_intact() -> None:
    """The CTX's pin lease (0.3 s) and the entry's lease (0.3 s) pass several times between the lookup
    and the READ: the GEN renews the pin while it may READ, so the blocks are neither freed nor
    reused; the READ gets the CTX's KV (CRC equal), and the pin ends with the READ's notification."""

    class SlowReader(NIXLTransport):
        async def _before_read(self, peer: str, request_id: str) -> None:
            await asyncio.sleep(1.2)

    async with _served(lease_s=0.3, gen=SlowReader, pin_timeout_s=0.3, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)
        assert torch.equal(into, want), "a block was freed and reused under the READ"
        assert server.statistics().pins_expired == 0
        await _until(lambda: server.statistics().pinned == 0 and store.statistics().held_requests == 0)


@pytest.mark.anyio
async def test_a_dead_gen_s_pin_still_ends_with_its_lease() -> None:
    """Renewal is the GEN's: a pin nobody renews (its READ never came) ends with its lease."""
    async with _served(pin_timeout_s=0.3, server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        conn = await t._conn(peer)
        answer = await conn.request({"t": "lookup", "rid": "r1", "handle": handle, "slice": [0, 3, 0, 4],
                                     "dtype": "float16", "shape": list(LAYOUT.wire_shape(len(IDS))), "keep": True},
                                    timeout=5)
        assert answer["t"] == "found" and server.statistics().pinned == 1
        await _until(lambda: server.statistics().pinned == 0, timeout=3)
        assert server.statistics().pins_expired == 1 and store.statistics().held_requests == 1


@pytest.mark.anyio
@pytest.mark.parametrize("off_loop", [False, True], ids=["inline", "poller-thread"])
async def test_a_transfer_that_raises_ends_its_landing_and_its_pin(off_loop: bool) -> None:
    """Also when the poller thread posts it (a READ large enough that its inline copy on one host
    would stall the event loop)."""
    async with _served(inline_copy_bytes=0 if off_loop else 1 << 20) as (store, handle, server, peer, t):
        await t.connect(peer)

        def broken(xfer, notif=b""):  # noqa: ANN001
            raise RuntimeError("NIXL_ERR_BACKEND")

        t.agent.transfer = broken
        landing = Landing()
        with pytest.raises(PeerClosed, match="could not be posted|failed"), anyio.fail_after(10):  # never hangs
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, landing=landing)
        assert not landing.busy
        await _until(lambda: server.statistics().pinned == 0)
        assert store.statistics().held_requests == 1 and not t._pinned


@pytest.mark.anyio
@pytest.mark.parametrize("in_progress", [False, True], ids=["copied-at-once", "reported-in-progress"])
async def test_a_large_read_is_posted_by_the_poller_thread_not_the_loop(monkeypatch: pytest.MonkeyPatch,
                                                                         in_progress: bool) -> None:
    """transfer() copies on one host: a READ over the inline limit is posted (and copied) by the GEN's
    poller thread, a small one on the loop; both land the CTX's bytes. A posted READ that
    transfer() reports still in progress (between hosts) is then watched by the same thread."""
    async with _served() as (store, handle, server, peer, t):
        await t.connect(peer)
        real, callers = t.agent.transfer, []

        def recorded(xfer, notif=b""):  # noqa: ANN001
            callers.append(threading.current_thread().name)
            state = real(xfer) if not notif else real(xfer, notif)
            return "PROC" if in_progress and state == "DONE" else state  # check_xfer_state says DONE later

        t.agent.transfer = recorded
        want = gather(store.pool, IDS, LAYOUT.full_slice())
        into = _into()
        monkeypatch.setattr(t, "config", dataclasses.replace(t.config, inline_copy_bytes=into.nbytes - 1))
        with anyio.fail_after(10):
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False)
        assert torch.equal(into, want) and callers == ["nixl-read-poller"] and t._poller.watched == 1
        if in_progress:  # learnt from what transfer() said (the first READ of a connection may be in
            assert (await t._conn(peer)).copies_inline is False  # progress anyway: UCX wires up then)
        monkeypatch.setattr(t, "config", dataclasses.replace(t.config, inline_copy_bytes=into.nbytes))
        small = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), small, handle=handle, release=False)
        assert torch.equal(small, want) and callers[1] == threading.current_thread().name
        await _until(lambda: server.statistics().pinned == 0)


@pytest.mark.anyio
@pytest.mark.parametrize("blocks", [["5", 2, 3, 7, 8, 9, 0], [5, 2, 3], [5, 2, 3, 7, 8, 9, 99], [5, 2, 3, 7, 8, 9, 0.0],
                                    "5,2,3", None])
async def test_a_bad_block_list_is_a_protocol_violation(blocks: object) -> None:
    """Block ids are checked (count, type, range) before anything is built from them."""
    async with _served() as (store, handle, server, peer, t):
        real = server._lookup

        def lying(msg: dict, reader: object) -> dict:
            answer = real(msg, reader)
            return {**answer, "blocks": blocks}

        server._lookup = lying  # type: ignore[method-assign]
        landing = Landing()
        with pytest.raises(ProtocolViolation, match="block list"):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, landing=landing)
        assert not landing.busy
        await _until(lambda: server.statistics().pinned == 0)
        assert store.statistics().held_requests == 1


@pytest.mark.anyio
async def test_a_read_that_never_ends_is_bounded_and_so_is_aclose() -> None:
    """A READ NIXL still reports in progress after ``read_timeout_s`` gets its peer dropped, which
    ends it; the pull fails, its landing ends only then, and ``aclose`` does not hang on it."""
    async with _served(read_timeout_s=0.3, close_timeout_s=0.5) as (store, handle, server, peer, t):
        await t.connect(peer)
        real_transfer, real_state, real_remove = t.agent.transfer, t.agent.check_xfer_state, t.agent.remove_remote_agent
        dropped: list[str] = []

        def transfer(xfer, notif=b""):  # noqa: ANN001  (the copy happens, NIXL just does not say so)
            real_transfer(xfer, notif) if notif else real_transfer(xfer)
            return "PROC"

        def state(xfer):  # noqa: ANN001
            return "ERR" if dropped else "PROC"

        def remove(name):  # noqa: ANN001
            dropped.append(name)
            return real_remove(name)

        t.agent.transfer, t.agent.check_xfer_state, t.agent.remove_remote_agent = transfer, state, remove
        landing = Landing()
        t0 = time.monotonic()
        with pytest.raises(PeerClosed, match="failed"):
            await asyncio.wait_for(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, landing=landing,
                                          release=False), 5)
        assert time.monotonic() - t0 < 3 and dropped and not landing.busy
        t.agent.check_xfer_state = real_state

        # aclose with a READ that stays in progress until its peer is dropped: bounded
        dropped.clear()
        t.agent.check_xfer_state = state
        task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle,
                                            landing=(landing := Landing()), release=False))
        await _until(lambda: landing.busy or task.done())
        assert not task.done(), task.exception()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        t.config = NIXLConfig(secret=SECRET, read_timeout_s=60, close_timeout_s=0.5)  # only aclose can end it now
        t0 = time.monotonic()
        await asyncio.wait_for(t.aclose(), 5)
        assert time.monotonic() - t0 < 3 and dropped and not landing.busy


@pytest.mark.anyio
async def test_unauthenticated_control_connections_are_capped() -> None:
    async with _served(max_unauthenticated=2, handshake_timeout_s=5) as (store, handle, server, peer, t):
        host, port = "127.0.0.1", server.port
        silent = [socket.create_connection((host, port)) for _ in range(2)]
        try:
            await _until(lambda: server._handshaking == 2)
            extra = socket.create_connection((host, port))
            extra.settimeout(2)
            data = await asyncio.to_thread(extra.recv, 1)  # the server runs on this loop
            assert data == b"", "a third connection in its handshake was served"
            extra.close()
        finally:
            for s in silent:
                s.close()
        await _until(lambda: server._handshaking == 0)
        into = _into()  # an authenticated GEN is served as before
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle)


@pytest.mark.anyio
async def test_a_registered_tensor_is_kept_until_aclose_deregisters_it() -> None:
    config = NIXLConfig(secret=SECRET)
    t = NIXLTransport(config, layout=LAYOUT)
    pool = torch.zeros(1 << 16)
    ref = weakref.ref(pool)
    t.register(pool)
    del pool
    gc.collect()
    assert ref() is not None, "NIXL may still write into memory that was freed"
    await t.aclose()
    gc.collect()
    assert ref() is None


@pytest.mark.anyio
async def test_whole_block_reads_into_a_registered_pool_use_prepared_descriptor_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full-slice pull into whole blocks of a registered pool is one make_prepped_xfer from lists
    prepared once (the CTX pool per peer, the GEN pool at register); the data is the CTX's blocks.
    A head subset, or memory outside a registered pool, takes the per-READ descriptors."""
    from transports import KVSlice

    async with _served() as (store, handle, server, peer, t):
        pool = LAYOUT.new_pool(16).zero_()
        t.register(pool)
        want = gather(store.pool, IDS, LAYOUT.full_slice())
        into = pool[3:3 + len(IDS)]
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False)  # inline
        assert torch.equal(into, want) and t.statistics().prepped_reads == 1
        assert not pool[:3].any() and not pool[3 + len(IDS):].any()  # nothing else written
        # the second READ off the loop: a peer not known to copy inline, a limit it exceeds
        monkeypatch.setattr(t, "config", dataclasses.replace(t.config, inline_copy_bytes=0))
        (await t._conn(peer)).copies_inline = None
        into2 = pool[9:9 + len(IDS)]
        await t.pull(peer, "r1", LAYOUT.full_slice(), into2, handle=handle, release=False)
        assert torch.equal(into2, want) and t.statistics().prepped_reads == 2
        part = KVSlice(0, 3, 1, 3)
        sub = torch.zeros(LAYOUT.wire_shape(len(IDS), part), dtype=LAYOUT.dtype)
        await t.pull(peer, "r1", part, sub, handle=handle, release=False)
        assert torch.equal(sub, gather(store.pool, IDS, part)) and t.statistics().prepped_reads == 2
        await _until(lambda: server.statistics().pinned == 0)


@contextlib.asynccontextmanager
async def _in_pieces(**config_kw: object) -> AsyncIterator[tuple[KVStore, str, NIXLKVServer, str, NIXLTransport,
                                                                 torch.Tensor, list[str], list[int], list[bytes]]]:
    """A GEN whose READs of more than two blocks are posted in pieces (one host: NIXL copies
    inline), into a registered pool; ``calls`` records the thread of every transfer(), ``sizes``
    the blocks of every prepared READ and ``notifs`` every notification the CTX got."""
    async with _served(inline_copy_bytes=2 * LAYOUT.block_bytes, **config_kw) as (store, handle, server, peer, t):
        pool = LAYOUT.new_pool(16).zero_()
        t.register(pool)
        small = store.put("r2", torch.tensor([10, 11]), num_tokens=8, lease_s=60)
        for _ in range(2):  # the first READ of a connection is in progress (UCX wires its endpoint up)
            await t.pull(peer, "r2", LAYOUT.full_slice(), pool[:2], remote_blocks=[10, 11], handle=small, release=False)
        assert (await t._conn(peer)).copies_inline is True  # learnt from the last READ: copied at once
        pool[:2] = 0
        real_transfer, real_prep, real_notifs = t.agent.transfer, t.agent.make_prepped_xfer, server.agent.get_new_notifs
        calls: list[str] = []
        sizes: list[int] = []
        notifs: list[bytes] = []

        def transfer(xfer, notif=b""):  # noqa: ANN001
            calls.append(threading.current_thread().name)
            return real_transfer(xfer, notif) if notif else real_transfer(xfer)

        def make_prepped_xfer(op, local, local_ids, remote, remote_ids, notif=b"", *a, **kw):  # noqa: ANN001, ANN002, ANN003
            sizes.append(len(remote_ids))
            return real_prep(op, local, local_ids, remote, remote_ids, notif, *a, **kw)

        def get_new_notifs():  # noqa: ANN202
            got = real_notifs()
            notifs.extend(m for msgs in got.values() for m in msgs)
            return got

        t.agent.transfer, t.agent.make_prepped_xfer, server.agent.get_new_notifs = transfer, make_prepped_xfer, get_new_notifs
        await _until(lambda: server.statistics().pinned == 0)
        notifs.clear()
        yield store, handle, server, peer, t, pool, calls, sizes, notifs


@pytest.mark.anyio
async def test_a_large_read_from_a_peer_that_copies_inline_is_posted_on_the_loop_in_pieces() -> None:
    """One host: a READ of 7 whole blocks over the inline limit (2 blocks) is posted by the loop
    itself as 4 READs of at most 2 blocks (no hand-over to the poller thread), the loop's other work
    between them; the CTX gets one notification, with the last, and releases only then (its
    release overwrites the blocks: a release before the last piece would show in the bytes)."""
    async with _in_pieces() as (store, handle, server, peer, t, pool, calls, sizes, notifs):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        prepped, watched, seen = t.statistics().prepped_reads, t._poller.watched, set()

        async def ticker() -> None:  # the loop's other work runs between the pieces
            while True:
                seen.add(len(calls))
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        landing = Landing()
        into = pool[3:3 + len(IDS)]
        with anyio.fail_after(10):
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing)
        tick.cancel()
        assert torch.equal(into, want) and not landing.busy
        assert calls == [threading.current_thread().name] * 4 and sizes == [2, 2, 2, 1] and t._poller.watched == watched
        assert t.statistics().prepped_reads - prepped == 4 and {1, 2, 3} <= seen
        await _until(lambda: store.statistics().held_requests == 1 and server.statistics().pinned == 0)  # r2 only
        assert len(notifs) == 1, notifs
        assert not pool[:3].any() and not pool[3 + len(IDS):].any()  # nothing else written


@pytest.mark.anyio
async def test_a_read_in_pieces_cancelled_between_them_ends_its_landing_and_pin_and_keeps_the_kv() -> None:
    """Cancelled after its first piece: nothing is in flight (each piece was copied at once), so the
    landing ends at once, the pin is given back, no notification went (the CTX keeps the request:
    the GEN never finished reading it) and a later pull reads it whole."""
    async with _in_pieces() as (store, handle, server, peer, t, pool, calls, sizes, notifs):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        landing = Landing()
        task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), pool[3:3 + len(IDS)], handle=handle,
                                            landing=landing))
        real = t.agent.transfer

        def cancel_after_first(xfer, notif=b""):  # noqa: ANN001
            task.cancel()  # delivered at the pull's next await: between two pieces
            return real(xfer, notif) if notif else real(xfer)

        t.agent.transfer = cancel_after_first
        with pytest.raises(asyncio.CancelledError):
            await task
        t.agent.transfer = real
        assert len(calls) == 1 and not landing.busy and not t._pinned
        await _until(lambda: server.statistics().pinned == 0)
        assert notifs == [] and store.statistics().held_requests == 2
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False)
        assert torch.equal(into, want)


@pytest.mark.anyio
async def test_a_piece_nixl_reports_in_progress_is_watched_and_the_rest_follows_as_one_read() -> None:
    """A peer learnt to copy inline whose second piece transfer() reports in progress (not a
    one-host copy after all): that piece is watched to its end and the rest posted as one READ;
    the bytes are the CTX's and everything ends."""
    async with _in_pieces() as (store, handle, server, peer, t, pool, calls, sizes, notifs):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        real = t.agent.transfer

        def second_in_progress(xfer, notif=b""):  # noqa: ANN001
            state = real(xfer, notif) if notif else real(xfer)
            return "PROC" if len(calls) == 2 else state  # check_xfer_state says DONE later

        t.agent.transfer = second_in_progress
        landing, watched = Landing(), t._poller.watched
        into = pool[3:3 + len(IDS)]
        with anyio.fail_after(10):
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False, landing=landing)
        assert torch.equal(into, want) and not landing.busy and sizes == [2, 2, 3] and t._poller.watched == watched + 1
        await _until(lambda: server.statistics().pinned == 0)
        assert len(notifs) == 1 and store.statistics().held_requests == 2 and not t._reads


@pytest.mark.anyio
async def test_a_reconnect_removes_the_old_agent_once_its_last_read_ends() -> None:
    """A CTX restarted (a new NIXL agent) while a READ from its old agent is still in flight: the
    reconnect does not remove the old agent under that READ, and removes it when the READ ends
    (before, the old agent was forgotten but never removed: a leak per restart)."""
    store = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())
    handle = store.put("r1", IDS, num_tokens=25, lease_s=60)
    config = NIXLConfig(secret=SECRET)
    async with NIXLTransport(config, layout=LAYOUT) as t:
        real_transfer, real_remove = t.agent.transfer, t.agent.remove_remote_agent
        removed: list[str] = []
        release = asyncio.Event()

        def transfer(xfer, notif=b""):  # noqa: ANN001  (the copy happens; NIXL reports it in flight)
            real_transfer(xfer, notif) if notif else real_transfer(xfer)
            return "PROC"

        def remove(name):  # noqa: ANN001
            removed.append(name.decode() if isinstance(name, bytes) else name)
            return real_remove(name)

        t.agent.transfer, t.agent.remove_remote_agent = transfer, remove
        t.agent.check_xfer_state = lambda xfer: "DONE" if release.is_set() else "PROC"
        async with NIXLKVServer(store, config, host="127.0.0.1") as first:
            port, old = first.port, first.agent.name
            peer = f"127.0.0.1:{port}"
            landing = Landing()
            reading = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle,
                                                   landing=landing, release=False))
            await _until(lambda: landing.busy)
        async with NIXLKVServer(store, config, host="127.0.0.1", port=port) as second:
            t._peers.drop(peer, t._peers.conns[peer])  # the old control connection is gone
            await t.connect(peer)
            assert t._agents[peer] == second.agent.name != old
            assert old not in removed, "the old agent was removed under its READ"
            release.set()
            with pytest.raises(PeerClosed, match="pinned READ"):  # the CTX that pinned it is gone
                await reading
            await _until(lambda: old in removed and not landing.busy)
            assert second.agent.name not in removed


@pytest.mark.anyio
async def test_one_thread_watches_every_read_in_flight_beyond_the_worker_thread_limit() -> None:
    """60 READs NIXL reports in progress at once (more than anyio's 40 worker threads): one poller
    thread watches them all, each ends (its bytes landed, its landing over) once NIXL says DONE,
    and nothing is left watched afterwards."""
    async with _served() as (store, handle, server, peer, t):
        await t.connect(peer)
        real_transfer, real_state = t.agent.transfer, t.agent.check_xfer_state
        done = False

        def transfer(xfer, notif=b""):  # noqa: ANN001  (the copy happens; NIXL says it is still going)
            real_transfer(xfer, notif) if notif else real_transfer(xfer)
            return "PROC"

        def state(xfer):  # noqa: ANN001
            return real_state(xfer) if done else "PROC"

        t.agent.transfer, t.agent.check_xfer_state = transfer, state
        threads_before = threading.active_count()
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        intos = [_into() for _ in range(60)]
        landings = [Landing() for _ in intos]
        pulls = [asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing,
                                              release=False))
                 for into, landing in zip(intos, landings)]
        await _until(lambda: t._poller.in_flight == 60 or any(p.done() for p in pulls))
        assert not any(p.done() for p in pulls), [p.exception() for p in pulls if p.done()]
        assert sum(th.name == "nixl-read-poller" for th in threading.enumerate()) == 1
        assert threading.active_count() - threads_before <= 1  # the poller: no thread per READ
        done = True
        results = await asyncio.wait_for(asyncio.gather(*pulls), 10)
        assert results == [want.numel() * want.element_size()] * 60
        assert all(torch.equal(into, want) for into in intos) and not any(landing.busy for landing in landings)
        assert t._poller.in_flight == 0 and t._poller.watched >= 60
        t.agent.check_xfer_state = real_state


@pytest.mark.anyio
async def test_a_pinned_read_that_outlives_its_control_connection_fails() -> None:
    """A pinned READ still in progress when its control connection is lost: nobody renews the pin,
    the CTX lets it lapse, frees and reuses the blocks; the READ then ends DONE. Its bytes are not
    used: the pull fails (before, it succeeded with the reused blocks)."""
    async with _served(lease_s=0.3, pin_timeout_s=0.6, read_timeout_s=30,
                       server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        await t.connect(peer)
        real, go = t.agent.transfer, asyncio.Event()
        t.agent.transfer = lambda xfer, notif=b"": "PROC"  # "posted"; the bytes move when it ends:
        t.agent.check_xfer_state = lambda xfer: real(xfer) if go.is_set() else "PROC"  # copied (one host) then
        into, landing = _into(), Landing()
        task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing))
        await _until(lambda: landing.busy)
        for writer in list(server._conns):  # the control connection is lost
            writer.close()
        await _until(lambda: server.statistics().pins_expired == 1 and store.statistics().held_requests == 0)
        go.set()
        with pytest.raises(PeerClosed, match="pinned READ"), anyio.fail_after(10):
            await task
        assert not landing.busy


@pytest.mark.anyio
async def test_memory_a_stuck_read_may_write_stays_registered_after_aclose() -> None:
    """A READ NIXL never lets go of (its peer dropped, still in progress): its landing stays busy,
    its agent stays counted in use, and aclose() keeps the registered memory it may write."""
    async with _served(read_timeout_s=0.3, close_timeout_s=0.3) as (store, handle, server, peer, t):
        await t.connect(peer)
        pool = LAYOUT.new_pool(16).zero_()
        t.register(pool)
        t.agent.transfer = lambda xfer, notif=b"": "PROC"
        t.agent.check_xfer_state = lambda xfer: "PROC"  # NIXL never lets go of it
        dereg: list[object] = []
        real = t.agent.deregister_memory
        t.agent.deregister_memory = lambda d: (dereg.append(d), real(d))[1]
        landing = Landing()
        with pytest.raises(PeerClosed), anyio.fail_after(10):
            await t.pull(peer, "r1", LAYOUT.full_slice(), pool[2:2 + len(IDS)], handle=handle, landing=landing)
        assert landing.busy and sum(t._reads.values()) == 1
        await t.aclose()
        assert dereg == [] and len(t._regions) == 1


@pytest.mark.anyio
async def test_a_read_timing_out_after_a_reconnect_does_not_break_the_new_connection() -> None:
    """A READ from connection A times out after the peer was reconnected (B, the same CTX agent):
    dropping A's agent drops B too, so the next pull reconnects (before, B stayed 'usable' with its
    agent removed and every later pull failed)."""
    async with _served(read_timeout_s=1.0) as (store, handle, server, peer, t):
        conn_a = await t._conn(peer)
        real_transfer, removed = t.agent.transfer, []
        real_remove = t.agent.remove_remote_agent
        t.agent.remove_remote_agent = lambda name: (removed.append(name), real_remove(name))[1]
        t.agent.transfer = lambda xfer, notif=b"": "PROC"
        real_state = t.agent.check_xfer_state
        t.agent.check_xfer_state = lambda xfer: "ERR" if removed else "PROC"
        landing = Landing()
        task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle,
                                            landing=landing, release=False))
        await _until(lambda: landing.busy)
        conn_a.fail(PeerClosed("control connection lost", peer=peer))
        conn_b = await t._conn(peer)
        assert conn_b.agent_name == conn_a.agent_name
        t.agent.transfer = real_transfer
        with pytest.raises(PeerClosed), anyio.fail_after(10):
            await task
        t.agent.check_xfer_state = real_state
        assert removed and conn_b.error is not None
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, release=False)
        assert torch.equal(into, gather(store.pool, IDS, LAYOUT.full_slice()))


@pytest.mark.anyio
async def test_a_lookup_answered_as_its_pull_is_cancelled_is_unpinned_at_once() -> None:
    """The lookup's answer (a pin) arrives in the same loop turn as the pull's cancellation: the
    answer is not used, and the pin is given back at once (before, it stayed until its lease)."""
    async with _served(pin_timeout_s=30, server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        conn = await t._conn(peer)
        holder: dict[str, asyncio.Future[int]] = {}
        real = conn.dispatch

        def dispatch(msg):  # noqa: ANN001, ANN202
            real(msg)
            if msg.get("t") == "found":
                holder["task"].cancel()

        conn.dispatch = dispatch
        holder["task"] = task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle))
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: server.statistics().pinned == 0, timeout=3)
        assert server.statistics().pins_expired == 0 and store.statistics().held_requests == 1


@pytest.mark.anyio
async def test_every_pin_a_gen_renews_is_kept_beyond_max_pulls_per_connection() -> None:
    """The GEN renews all its pins on a peer in one message, over its current connection (a reconnect
    keeps them); the CTX renews every one (before, only the first ``max_pulls_per_connection``: the
    rest lapsed although renewed). Here 4 pins made on one connection, 2 on the next."""
    async with _served(pin_timeout_s=0.6, max_pulls_per_connection=4,
                       server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        for count in (4, 2):
            conn = await t._conn(peer)
            for _ in range(count):
                answer = await conn.request({"t": "lookup", "rid": "r1", "handle": handle, "slice": [0, 3, 0, 4],
                                             "dtype": "float16", "shape": list(LAYOUT.wire_shape(len(IDS))),
                                             "keep": True}, 5)
                t._pin(conn, answer["token"])
            if count == 4:
                t._peers.drop(peer, conn)  # a reconnect: the pins stay the GEN's
        await asyncio.sleep(2.0)  # > 3 pin leases, renewed every 0.2 s
        assert server.statistics().pinned == 6 and server.statistics().pins_expired == 0
        for token in list(t._pinned):
            t._unpin(conn, token, tell=True)
        await _until(lambda: server.statistics().pinned == 0)


@pytest.mark.anyio
async def test_a_read_the_poller_cannot_take_ends_its_landing_and_its_read_count() -> None:
    """Posting a large READ to the poller thread fails (e.g. no thread can be started): the pull
    fails, its landing ends and the request's READ count drops (before, both stayed: the landing
    busy for good and a revocation of the request never acknowledged)."""
    async with _served(inline_copy_bytes=0) as (store, handle, server, peer, t):
        conn = await t._conn(peer)

        def post(*args: object, **kw: object) -> None:
            raise RuntimeError("can't start new thread")

        t._poller.post = post  # type: ignore[method-assign]
        landing = Landing()
        with pytest.raises(PeerClosed, match="could not be posted"), anyio.fail_after(10):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, landing=landing)
        assert not landing.busy and not conn.reading
        await _until(lambda: server.statistics().pinned == 0)


@pytest.mark.anyio
async def test_a_release_waits_until_no_read_of_the_request_is_in_flight() -> None:
    """An unpinned READ cancelled in flight (its landing stays busy), then the GEN's own release (what
    the receiver sends after an abort or a timeout): the CTX frees on a release at once, so the
    release waits until that READ ended (before, the CTX freed and reused the blocks under it)."""
    store = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())
    freed: list[bool] = []

    def reuse() -> None:
        freed.append(True)
        store.pool[IDS] = -1.0

    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        async with NIXLTransport(config, layout=LAYOUT) as t:
            await t.connect(peer)
            epoch = store.epoch
            handle = store.put("r1", IDS, num_tokens=25, lease_s=60, on_release=reuse)
            go = asyncio.Event()
            t.agent.transfer = lambda xfer, notif=b"": "PROC"  # a READ in flight (a slow link)
            t.agent.check_xfer_state = lambda xfer: "DONE" if go.is_set() else "PROC"
            landing = Landing()
            task = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle,
                                                landing=landing, remote_blocks=IDS.tolist(), remote_epoch=epoch))
            await _until(lambda: landing.busy)
            assert t.statistics().unpinned_reads == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release = asyncio.ensure_future(t.release(peer, "r1", handle=handle))
            await asyncio.sleep(0.3)
            assert landing.busy and not freed and not release.done()
            go.set()
            with anyio.fail_after(5):
                await release
            assert freed and not landing.busy


@pytest.mark.anyio
async def test_pins_per_connection_are_capped_and_come_back_as_they_end() -> None:
    """One GEN connection holds at most ``max_pulls_per_connection`` pins (lookups answered at once
    included): beyond, BUSY; an unpin makes room again (before, the cap counted only lookups still
    being answered, so a connection could pin without bound)."""
    async with _served(max_pulls_per_connection=8, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        conn = await t._conn(peer)
        ask = {"t": "lookup", "rid": "r1", "handle": handle, "slice": [0, 3, 0, 4], "dtype": "float16",
               "shape": list(LAYOUT.wire_shape(len(IDS))), "keep": True}
        answers = [await conn.request(ask, 5) for _ in range(12)]
        found = [a["token"] for a in answers if a["t"] == "found"]
        assert len(found) == 8 and [a.get("status") for a in answers[8:]] == ["BUSY"] * 4
        assert server.statistics().pinned == 8
        conn.send({"t": "unpin", "token": found[0]})
        await _until(lambda: server.statistics().pinned == 7)
        again = await conn.request(ask, 5)
        assert again["t"] == "found"
        for token in [*found[1:], again["token"]]:
            conn.send({"t": "unpin", "token": token})
        await _until(lambda: server.statistics().pinned == 0)
