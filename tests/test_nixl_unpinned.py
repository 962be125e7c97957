"""Unpinned NIXL READs (issue 17): with the prefill reply's block ids and epoch (the CTX store's
epoch before it put the request: its tag and revocation count), a GEN READs at once and waits for
no pin answer.

What keeps that safe (DESIGN invariant 12): the CTX frees nothing it decides to free on its own (a
lease's end, a release not from the reader) before every GEN that may READ without a pin has
acknowledged the revocation, which a GEN does only once its READs of that request ended; a GEN
that may have missed a revocation of a request (it connected later, or heard of it) READs it with a
pin; a GEN whose connection lease ended (no "alive" answered) uses no unpinned READ's bytes; and a
GEN that vanished holds a revocation only until its lease ends. GEN and CTX run in this process
over shared memory."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from tests.test_dataplane_nixl import IDS, LAYOUT, SECRET, _into, _served, _until  # noqa: E402
from transports import KVStore, Landing, PeerClosed, ProtocolViolation, UnknownRequest, gather  # noqa: E402
from transports.nixl import NIXLConfig, NIXLKVServer, NIXLTransport  # noqa: E402

pytestmark = pytest.mark.integration

BLOCKS = [int(b) for b in IDS.tolist()]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Unanswering(NIXLKVServer):
    """A CTX that leaves "alive" messages unanswered while ``silent`` (a stalled network, as its
    GENs see it): their connection leases run out on both ends."""

    silent = False

    def _handle(self, msg: dict, gen: Any) -> dict | None:
        if self.silent and msg.get("t") == "alive":
            return None
        return super()._handle(msg, gen)


def _deferred_reads(t: NIXLTransport) -> asyncio.Event:
    """Make ``t``'s READs copy only once the returned event is set (NIXL reports them in progress
    until then), so that a READ is really in flight while the CTX acts."""
    agent = t.agent
    real_transfer, real_state = agent.transfer, agent.check_xfer_state
    go = asyncio.Event()
    copied: set[int] = set()

    def transfer(xfer: Any, notif: bytes = b"") -> str:
        return "PROC"

    def state(xfer: Any) -> str:
        if not go.is_set():
            return "PROC"
        if id(xfer) not in copied:
            copied.add(id(xfer))
            real_transfer(xfer)  # the copy happens now: blocks freed and reused before would show
        return real_state(xfer)

    agent.transfer, agent.check_xfer_state = transfer, state
    return go


@pytest.mark.anyio
async def test_a_pull_named_with_its_epoch_reads_without_a_pin() -> None:
    async with _served() as (store, handle, server, peer, t):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS, remote_epoch=store.epoch)
        assert torch.equal(into, want)
        assert t.statistics().unpinned_reads == 1 and not t._pinned
        await _until(lambda: store.statistics().held_requests == 0)  # released on its notification
        stats = server.statistics()
        assert stats.unpinned_reads == 1 and stats.lookups == 0 and stats.pinned == 0 and not server._early
        assert store.statistics().open_pins == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["released-by-the-ctx", "lease-ended"])
async def test_a_revocation_waits_for_the_unpinned_read_in_flight(how: str) -> None:
    """The CTX frees the request on its own while an unpinned READ of it runs: the blocks stay until
    the READ ended and the GEN acknowledged (also past the connection's lease of 0.6 s, which the
    GEN renews); the READ gets the CTX's KV (equal), then the blocks go."""
    async with _served(lease_s=0.3 if how == "lease-ended" else 60, pin_timeout_s=0.6,
                       server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        await t.connect(peer)
        go = _deferred_reads(t)
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into, landing = _into(), Landing()
        pull = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing,
                                            remote_blocks=BLOCKS, remote_epoch=store.epoch))
        await _until(lambda: landing.busy)
        if how == "released-by-the-ctx":
            assert store.release("r1", handle=handle)
        await _until(lambda: server.statistics().revocations == 1)
        await asyncio.sleep(0.9)  # longer than the entry's and the connection's lease: nothing frees them
        assert "r1" not in store._held and server.statistics().revocations_pending == 1
        assert store.statistics().open_pins == 1 and torch.equal(gather(store.pool, IDS, LAYOUT.full_slice()), want)
        assert not pull.done()
        go.set()
        assert await asyncio.wait_for(pull, 5) == want.numel() * want.element_size()
        assert torch.equal(into, want), "a block was freed and reused under the READ"
        await _until(lambda: server.statistics().revocations_pending == 0 and store.statistics().open_pins == 0)
        assert bool((store.pool[IDS] == -1).all())  # freed (and reused) once the GEN let go


@pytest.mark.anyio
async def test_a_request_revoked_before_the_gen_connected_is_read_with_a_pin() -> None:
    """No GEN was connected when the CTX revoked "r1" (freed at once); a GEN that connects later
    cannot know it was that one, so its prefill epoch (from before the revocation) makes it pin: the
    pin is refused and the bytes are not used. A request put after it connected needs no pin."""
    store = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())

    def reuse() -> None:
        store.pool[IDS] = -1.0

    config = NIXLConfig(secret=SECRET)
    async with NIXLKVServer(store, config, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        epoch = store.epoch
        handle = store.put("r1", IDS, num_tokens=25, lease_s=60, on_release=reuse)
        assert store.release("r1", handle=handle) and store.statistics().open_pins == 0  # nobody to wait for
        async with NIXLTransport(config, layout=LAYOUT) as t:
            with pytest.raises(UnknownRequest):
                await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS,
                             remote_epoch=epoch)
            assert t.statistics().unpinned_reads == 0
            other = [1, 4, 6, 10, 11, 12, 13]
            epoch2 = store.epoch
            h2 = store.put("r2", torch.tensor(other), num_tokens=25, lease_s=60)
            into = _into()
            await t.pull(peer, "r2", LAYOUT.full_slice(), into, handle=h2, remote_blocks=other, remote_epoch=epoch2)
            assert torch.equal(into, gather(store.pool, torch.tensor(other), LAYOUT.full_slice()))
            assert t.statistics().unpinned_reads == 1
            await _until(lambda: store.statistics().held_requests == 0 and server.statistics().pinned == 0)


@pytest.mark.anyio
async def test_a_request_the_gen_heard_revoked_is_read_with_a_pin() -> None:
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        await t.connect(peer)
        epoch = store.epoch  # r1's (put before any revocation)
        assert store.release("r1", handle=handle)  # the CTX's own decision: revoked, acknowledged, freed
        await _until(lambda: store.statistics().open_pins == 0)
        assert server.statistics().revocations == 1 and bool((store.pool[IDS] == -1).all())
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
        assert t.statistics().unpinned_reads == 0 and server.statistics().pinned == 0


@pytest.mark.anyio
async def test_a_cut_connection_holds_a_revocation_only_until_its_lease_ends() -> None:
    """The CTX's end of a GEN's control connection goes (as when the network cuts it: the GEN
    hears nothing yet and may still READ): a revocation waits for that GEN until its connection
    lease (0.6 s) ends, not a moment less, and then frees the blocks."""
    async with _served(pin_timeout_s=0.6, server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        await t.connect(peer)
        await asyncio.sleep(0.3)  # its "alive" renewals run
        for writer in list(server._conns):
            writer.close()
        await _until(lambda: server.statistics().connections == 0)
        assert store.release("r1", handle=handle)
        await asyncio.sleep(0.1)
        assert server.statistics().revocations_pending == 1 and store.statistics().open_pins == 1
        await _until(lambda: store.statistics().open_pins == 0, timeout=3)
        assert server.statistics().gens == 0 and bool((store.pool[IDS] == -1).all())


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["dies", "closes"])
async def test_a_gen_that_closed_its_connection_holds_nothing(how: str) -> None:
    """A GEN whose socket closed (its process died, or ``aclose`` with no READ left, which says bye
    first) trusts nothing any more: a revocation does not wait for it."""
    async with _served(pin_timeout_s=60, server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        conn = await t._conn(peer)
        assert server.statistics().gens == 1
        if how == "dies":
            conn.writer.transport.abort()  # as the kernel closes a killed process's socket
        else:
            await t.aclose()
        await _until(lambda: server.statistics().gens == 0)
        assert store.release("r1", handle=handle) and store.statistics().open_pins == 0


@pytest.mark.anyio
async def test_the_bytes_of_an_unpinned_read_that_outlived_the_lease_are_not_used() -> None:
    """The CTX stops answering "alive" (its lease for this GEN runs out while a READ runs): the GEN
    cannot know whether a revocation it never heard of freed the blocks, so the pull fails; the next
    pull of a request uses a pin."""

    async with _served(pin_timeout_s=0.6, server=Unanswering, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        await t.connect(peer)
        go = _deferred_reads(t)
        landing = Landing()
        pull = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, landing=landing,
                                            remote_blocks=BLOCKS, remote_epoch=store.epoch, release=False))
        await _until(lambda: landing.busy)
        server.silent = True
        await asyncio.sleep(0.8)  # past the lease
        go.set()
        with pytest.raises(PeerClosed, match="lost its lease"):
            await asyncio.wait_for(pull, 5)
        await _until(lambda: not landing.busy)
        assert t.statistics().unpinned_reads == 1
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS, remote_epoch=store.epoch)
        assert torch.equal(into, want)
        assert t.statistics().unpinned_reads == 1  # the second READ was pinned
        await _until(lambda: store.statistics().held_requests == 0 and server.statistics().pinned == 0)


@pytest.mark.anyio
async def test_a_reply_of_a_ctx_that_restarted_since_is_read_with_a_pin() -> None:
    """The CTX restarts on the same address: its new store holds other KV in the blocks an old reply
    named. The old reply's epoch carries the old store's tag, so the GEN pins (refused: the new CTX
    holds no such request), and the pull fails instead of returning the new CTX's bytes."""
    config = NIXLConfig(secret=SECRET)
    old = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())
    epoch = old.epoch
    handle = old.put("r1", IDS, num_tokens=25, lease_s=60)
    async with NIXLTransport(config, layout=LAYOUT) as t:
        async with NIXLKVServer(old, config, host="127.0.0.1") as first:
            port = first.port
            await t.connect(f"127.0.0.1:{port}")
        new = KVStore(LAYOUT, LAYOUT.new_pool(16).uniform_())
        while new.epoch >= epoch:  # a tag below the old one: order alone would vouch for the old reply
            new = KVStore(LAYOUT, new.pool)
        new.put("other", IDS, num_tokens=25, lease_s=60)
        async with NIXLKVServer(new, config, host="127.0.0.1", port=port) as second:
            peer = f"127.0.0.1:{second.port}"
            await _until(lambda: t.statistics().endpoints == 0)  # the old connection ended
            into = _into()
            with pytest.raises(UnknownRequest):
                await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS,
                             remote_epoch=epoch)
            assert t.statistics().unpinned_reads == 0  # pinned: whatever the READ got is not used


@pytest.mark.anyio
async def test_a_lease_that_ended_is_not_renewed_so_a_missed_revocation_cannot_be_trusted() -> None:
    """The GEN's "alive" messages go unanswered past its lease (a stalled network): the CTX lets go
    of that GEN and revokes "r1" without asking it. When the GEN's messages flow again, the CTX
    refuses to renew the lease it let end: the GEN READs pinned on that connection from then on,
    so the revocation it never heard of fails its pull instead of handing it reused blocks."""

    async with _served(pin_timeout_s=0.6, server=Unanswering, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        conn = await t._conn(peer)
        epoch = store.epoch
        server.silent = True
        await _until(lambda: server.statistics().gens == 0, timeout=3)  # its lease ended on the CTX
        assert store.release("r1", handle=handle) and store.statistics().open_pins == 0  # nobody asked
        server.silent = False
        await asyncio.sleep(0.5)  # the GEN's next "alive" is refused
        assert conn.epoch is None and t.statistics().endpoints == 1
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS,
                         remote_epoch=epoch)
        assert t.statistics().unpinned_reads == 0


@pytest.mark.anyio
async def test_an_unpinned_read_s_notification_releases_only_with_the_request_s_handle() -> None:
    """What the CTX does with "kvo2:" notifications (any NIXL peer can send one): a wrong handle, a
    malformed body or "keep" releases nothing; the request's own handle releases it."""
    async with _served(server_kw={"idle_notif_poll_s": 0.01}) as (store, handle, server, peer, t):
        conn = await t._conn(peer)
        for body in (b'kvo2:["r1","' + b"0" * 32 + b'",false]', b"kvo2:[r1", b'kvo2:["r1",null,false]',
                     b'kvo2:["r1","' + handle.encode() + b'",true]'):
            t.agent.send_notif(conn.agent_name, body)
        await _until(lambda: server.statistics().served == 1)  # the kept one, with its handle
        await asyncio.sleep(0.1)
        assert "r1" in store._held and server.statistics().unpinned_reads == 1
        t.agent.send_notif(conn.agent_name, b'kvo2:["r1","' + handle.encode() + b'",false]')
        await _until(lambda: "r1" not in store._held)
        assert server.statistics().served == 2 and store.statistics().open_pins == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["unpinned-read", "pinned-read", "release"])
async def test_one_gen_s_release_waits_for_another_gen_reading_the_same_request(how: str) -> None:
    """Two GENs hold "r1"'s handle and block ids (a front's hand-off retry): the second's unpinned
    READ is in flight when the first lets go (its READ's notification, unpinned or pinned, or its
    ``release``). The blocks stay until the second's READ ended and it acknowledged; it gets the
    CTX's KV; the first GEN is not asked (its own READs ended); then the blocks go."""
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, first):
        async with NIXLTransport(NIXLConfig(secret=SECRET), layout=LAYOUT) as second:
            await first.connect(peer)
            await second.connect(peer)
            go = _deferred_reads(second)
            heard: list[str] = []  # the revocations the first GEN is sent (it is not asked: it let go)
            first_conn = await first._conn(peer)
            real_revoke = first_conn._revoke
            first_conn._revoke = lambda msg: (heard.append(msg.get("rid")), real_revoke(msg))  # type: ignore[method-assign]
            want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
            epoch = store.epoch
            into, landing = _into(), Landing()
            pull = asyncio.ensure_future(second.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle,
                                                     landing=landing, remote_blocks=BLOCKS, remote_epoch=epoch))
            await _until(lambda: landing.busy)
            if how == "release":
                await first.release(peer, "r1", handle=handle)
            else:
                mine = _into()
                blocks = {"remote_blocks": BLOCKS, "remote_epoch": epoch} if how == "unpinned-read" else {}
                await first.pull(peer, "r1", LAYOUT.full_slice(), mine, handle=handle, **blocks)
                assert torch.equal(mine, want)
            await _until(lambda: "r1" not in store._held)
            await asyncio.sleep(0.2)
            assert server.statistics().revocations_pending == 1 and server.statistics().handed_on == 1
            assert store.statistics().open_pins == 1 and torch.equal(gather(store.pool, IDS, LAYOUT.full_slice()), want)
            assert "r1" in (await second._conn(peer)).revoked and heard == []  # revoked there; the first GEN
            # was not asked, but remembers its own free (READ, or released) wherever it knew r1's epoch
            assert ("r1" in first_conn.revoked) == (how != "pinned-read")
            go.set()
            assert await asyncio.wait_for(pull, 5) == want.numel() * want.element_size()
            assert torch.equal(into, want), "another GEN's release freed the blocks under this READ"
            await _until(lambda: server.statistics().revocations_pending == 0 and store.statistics().open_pins == 0)
            assert bool((store.pool[IDS] == -1).all()) and server.statistics().revocations == 0


@pytest.mark.anyio
async def test_a_gen_that_connects_after_a_reader_s_release_reads_that_request_pinned() -> None:
    """The only GEN READs "r1" and lets go (freed at once: nobody else to ask); a GEN that connects
    afterwards with the same hand-off (epoch from before) cannot know, so it pins: refused, and
    the freed (reused) blocks' bytes are never used."""
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, first):
        epoch = store.epoch
        await first.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS,
                         remote_epoch=epoch)
        await _until(lambda: "r1" not in store._held and store.statistics().open_pins == 0)
        assert bool((store.pool[IDS] == -1).all())
        async with NIXLTransport(NIXLConfig(secret=SECRET), layout=LAYOUT) as late:
            with pytest.raises(UnknownRequest):
                await late.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS,
                                remote_epoch=epoch)
            assert late.statistics().unpinned_reads == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["lookup", "pin"])
async def test_a_pinned_read_whose_control_connection_stalled_past_the_pin_lease_is_not_used(how: str) -> None:
    """The control connection stalls (the CTX reads nothing from it; nothing fails) for longer than
    the pin lease (0.6 s) while a pinned READ runs: the CTX lets the pin lapse, the entry's lease
    (0.3 s) and the GEN's connection lease end, and the blocks are freed and reused. Then the
    connection recovers and the READ ends: its bytes are not used (PeerClosed). Before, the pull
    succeeded with the reused bytes (the GEN's renewals had been sent, never read)."""
    async with _served(lease_s=0.3, pin_timeout_s=0.6, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        await t.connect(peer)
        go = _deferred_reads(t)
        into, landing = _into(), Landing()
        blocks = {} if how == "lookup" else {"remote_blocks": BLOCKS}  # no epoch: READ with a pin beside it
        pull = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing,
                                            **blocks))
        await _until(lambda: landing.busy and server.statistics().pinned == 1)
        await asyncio.sleep(0.05)  # the pin's answer is back
        for writer in list(server._conns):
            writer.transport.pause_reading()
        await _until(lambda: store.statistics().open_pins == 0 and bool((store.pool[IDS] == -1).all()), timeout=5)
        for writer in list(server._conns):
            writer.transport.resume_reading()
        go.set()
        with pytest.raises(PeerClosed, match="lapsed"):
            await asyncio.wait_for(pull, 5)
        assert t.statistics().pins_lapsed == 1 and server.statistics().pins_expired == 1


@pytest.mark.anyio
async def test_a_slow_pinned_read_whose_pin_was_renewed_is_used() -> None:
    """The same slow READ (1.5 s against a 0.6 s pin lease) on a connection that does not stall:
    the renewals keep the pin, the CTX says so, and the bytes are used."""
    async with _served(lease_s=0.3, pin_timeout_s=0.6, server_kw={"expire_interval_s": 0.05}) as (
            store, handle, server, peer, t):
        go = _deferred_reads(t)
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into, landing = _into(), Landing()
        pull = asyncio.ensure_future(t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, landing=landing))
        await _until(lambda: landing.busy)
        await asyncio.sleep(1.5)
        go.set()
        await asyncio.wait_for(pull, 5)
        assert torch.equal(into, want) and t.statistics().pins_lapsed == 0 and server.statistics().pins_expired == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["another-id", "another-handle"])
async def test_an_unpinned_read_needs_the_handle_issued_for_that_request_id(how: str) -> None:
    """The GEN READs without asking only when the handle is the one the CTX issued for that request
    id (it names the id under the shared secret): a generate that names "r1"'s blocks and epoch
    with another request's id, or "r1" with a handle of its own making, goes through a pin, which
    the CTX refuses; nothing is read into it. Before, both READ "r1"'s KV unasked and succeeded (an
    outside drill: a generate streamed another request's tokens; over UCX they failed)."""
    async with _served() as (store, handle, server, peer, t):
        epoch = store.epoch
        rid, h = ("r2", handle) if how == "another-id" else ("r1", "0" * 32 if handle != "0" * 32 else "1" * 32)
        into = _into()
        with pytest.raises(UnknownRequest):
            await t.pull(peer, rid, LAYOUT.full_slice(), into, handle=h, remote_blocks=BLOCKS, remote_epoch=epoch)
        assert t.statistics().unpinned_reads == 0 and server.statistics().unpinned_reads == 0
        assert "r1" in store._held  # still there for its own pull, which needs no pin
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
        assert torch.equal(into, want) and t.statistics().unpinned_reads == 1


@pytest.mark.anyio
async def test_a_revocation_heard_while_the_pull_awaited_before_its_read_stops_the_read() -> None:
    """The connection vouched for "r1" when the pull began; a revocation of it heard while the pull
    awaited before posting its READ (the test seam: the loop ran meanwhile) stops it, nothing read.
    With no seam nothing awaits between the vouching and the READ, so it is vouched once."""

    class Awaiting(NIXLTransport):
        async def _before_read(self, peer: str, request_id: str) -> None:
            await asyncio.sleep(0)
            self._peers.conns[peer].released_here(request_id, None)  # as the revocation would, heard now

    async with _served(gen=Awaiting) as (store, handle, server, peer, t):
        with pytest.raises(UnknownRequest, match="before its READ was posted"):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS,
                         remote_epoch=store.epoch)
        assert t.statistics().unpinned_reads == 0 and server.statistics().unpinned_reads == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["read", "release"])
async def test_a_replayed_hand_off_after_this_gen_freed_the_request_is_refused_not_read(how: str) -> None:
    """The CTX revokes a request only at the GENs that did not free it. The GEN that did (its
    READ's notification, or its release) kept vouching for it: the same hand-off sent to it again
    (same id, handle, blocks, epoch) READ, unpinned, the blocks the CTX had freed and given to
    another request, and "finished" with that request's KV (an outside drill, over the node CLIs).
    It is READ with a pin now, and the CTX refuses it."""
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        epoch = store.epoch
        if how == "read":
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
            assert t.statistics().unpinned_reads == 1
        else:
            await t.connect(peer)
            await t.release(peer, "r1", handle=handle)
        await _until(lambda: store.statistics().held_requests == 0 and bool((store.pool[IDS] == -1).all()))
        store.pool[IDS] = 7.0  # another request's KV in the same blocks
        store.put("z", IDS, num_tokens=25, lease_s=60)
        reads = t.statistics().unpinned_reads
        into = _into()
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
        assert t.statistics().unpinned_reads == reads  # asked the CTX (a pin), which holds no "r1"
        assert store.release("z")
        await _until(lambda: server.statistics().pinned == 0 and store.statistics().held_requests == 0)


@pytest.mark.anyio
async def test_a_gen_that_freed_more_requests_than_it_remembers_raises_its_epoch_past_them(monkeypatch) -> None:
    """Its own frees are remembered like revocations, and bounded the same way: past the limit the
    connection's epoch rises past every one whose epoch is known (each is then READ pinned), and a
    request put since still reads without a pin."""
    import transports._nixl_conn as nixl_conn

    monkeypatch.setattr(nixl_conn, "_MAX_REVOKED", 1)
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        epoch = store.epoch
        await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
        await _until(lambda: store.statistics().held_requests == 0)
        conn = t._peers.conns[peer]
        fresh = store.epoch
        h2 = store.put("r2", IDS, num_tokens=25, lease_s=60)
        await t.pull(peer, "r2", LAYOUT.full_slice(), _into(), handle=h2, remote_blocks=BLOCKS, remote_epoch=fresh)
        assert t.statistics().unpinned_reads == 2  # put after r1's free: still vouched for
        await _until(lambda: store.statistics().held_requests == 0)
        assert conn.epoch == fresh + 1 and not conn.revoked  # two frees over a limit of one: the epoch rose past both
        reads = t.statistics().unpinned_reads
        with pytest.raises(UnknownRequest):  # forgotten by name, but put below the epoch: pinned, and refused
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS, remote_epoch=epoch)
        assert t.statistics().unpinned_reads == reads
        await _until(lambda: server.statistics().pinned == 0)


@pytest.mark.anyio
async def test_what_a_peer_names_in_unpins_and_revocations_is_not_kept_beyond_its_rule() -> None:
    """An authenticated GEN's unpin of a made-up 1 MiB token was kept 30 s (the CTX grew 1 GiB in
    1,000 unpins), and a CTX's revocation of an id of any length was kept on the GEN's connection
    (750 MiB in 3,000): an outside review of bounded memory. A token outside a pin's length is not
    remembered; a revocation of an id outside the request-id rule fails that connection."""
    async with _served() as (store, handle, server, peer, t):
        conn = await t._conn(peer)
        conn.send({"t": "unpin", "token": "x" * (1 << 20)})
        conn.send({"t": "unpin", "token": "a" * 24})  # a pin's own length, no such pin: remembered a while
        await _until(lambda: len(server._early) == 1)
        assert "a" * 24 in server._early
        conn.dispatch({"t": "revoke", "rid": "r" * 100_000, "n": 1, "epoch": conn.epoch})
        assert not conn.revoked and isinstance(conn.error, ProtocolViolation)
