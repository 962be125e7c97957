"""A NIXL pull whose prefill reply named the CTX's block ids (issue 17, item 2): the READ is posted at
once and its pin travels beside it on the control connection, so no lookup round trip comes first.

What must still hold (DESIGN invariant 12 and the integrity rules): the bytes a READ got are used
only when the CTX vouches for them (the request is still held with exactly those blocks), a
notification or an unpin that overtakes its pin ends it all the same, and a bad block list fails
the request, not the connection. GEN and CTX run in this process over shared memory."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("nixl_cu12._api", reason="nixl-cu12 is not installed (pip install -c constraints.txt '.[nixl]')")

from tests.test_dataplane_nixl import IDS, LAYOUT, _into, _served, _until  # noqa: E402
from transports import ProtocolViolation, UnknownRequest, gather  # noqa: E402
from transports.nixl import NIXLKVServer, NIXLTransport  # noqa: E402

pytestmark = pytest.mark.integration

BLOCKS = [int(b) for b in IDS.tolist()]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class SlowPins(NIXLKVServer):
    """Answers pin messages only after ``delay_s``: the READ (and its notification) come first."""

    delay_s = 0.3

    async def _before_send(self, msg: dict) -> None:
        if msg.get("t") == "pin":
            await asyncio.sleep(self.delay_s)


@pytest.mark.anyio
async def test_a_pull_with_the_block_ids_reads_the_kv_without_a_lookup() -> None:
    async with _served() as (store, handle, server, peer, t):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        n = await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS)
        assert n == into.numel() * into.element_size()
        assert torch.equal(into, want)
        stats = server.statistics()
        assert stats.lookups == 0
        await _until(lambda: store.statistics().held_requests == 0 and server.statistics().pinned == 0)  # released on its notification
        assert server.statistics().served == 1


@pytest.mark.anyio
async def test_a_pin_refused_fails_the_pull_and_the_connection_stays() -> None:
    """Blocks of another request, or a request the CTX no longer holds: the READ may have run, but
    its bytes are not vouched for, so the pull fails; nothing stays pinned; the next pull works."""
    async with _served(server_kw={"expire_interval_s": 0.05}) as (store, handle, server, peer, t):
        other = [1, 4, 6, 10, 11, 12, 13]
        h2 = store.put("r2", torch.tensor(other), num_tokens=25, lease_s=60)
        with pytest.raises(ProtocolViolation, match="not the ones"):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=other)
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r3", LAYOUT.full_slice(), _into(), handle=h2, remote_blocks=other)
        h4 = store.put("r4", torch.tensor([14, 15]), num_tokens=8, lease_s=0.05)
        await _until(lambda: "r4" not in store._held)  # its lease ended before the GEN read it
        with pytest.raises(UnknownRequest):
            await t.pull(peer, "r4", LAYOUT.full_slice(), torch.zeros(LAYOUT.wire_shape(2), dtype=LAYOUT.dtype),
                         handle=h4, remote_blocks=[14, 15])
        assert server.statistics().pinned == 0 and t.statistics().endpoints == 1
        into = _into()
        await t.pull(peer, "r2", LAYOUT.full_slice(), into, handle=h2, remote_blocks=other)
        assert torch.equal(into, gather(store.pool, torch.tensor(other), LAYOUT.full_slice()))
        await _until(lambda: store.statistics().held_requests == 1)  # r2 released on its notification
        assert "r1" in store._held  # refused, so still held for a good pull


@pytest.mark.anyio
@pytest.mark.parametrize("blocks", [[5, 2, 3], [5, 2, 3, 7, 8, 9, 99], [5, 2, 3, 7, 8, 9, "0"]], ids=["short", "outside", "not-int"])
async def test_a_bad_block_list_from_the_prefill_reply_fails_the_request_not_the_peer(blocks: list) -> None:
    async with _served() as (store, handle, server, peer, t):
        with pytest.raises(ProtocolViolation, match="prefill reply"):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=blocks)
        assert t.statistics().endpoints == 1 and server.statistics().pinned == 0
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS)
        assert torch.equal(into, want)


@pytest.mark.anyio
async def test_a_notification_that_overtakes_its_pin_releases_once() -> None:
    released = []
    async with _served(gen=NIXLTransport, server=SlowPins, server_kw={"idle_notif_poll_s": 0.01}) as (
            store, handle, server, peer, t):
        want = gather(store.pool, IDS, LAYOUT.full_slice()).clone()
        into = _into()
        await t.pull(peer, "r1", LAYOUT.full_slice(), into, handle=handle, remote_blocks=BLOCKS)
        assert torch.equal(into, want)
        released.append(store.statistics().released)
        assert server.statistics().pinned == 0 and not server._early
        assert store.statistics().held_requests == 0 and released == [1]


@pytest.mark.anyio
async def test_an_unpin_that_overtakes_its_pin_leaves_nothing_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _served(server=SlowPins) as (store, handle, server, peer, t):
        def refuse(_xfer: object) -> str:
            raise RuntimeError("NIXL refused to post")

        monkeypatch.setattr(t.agent, "transfer", refuse)
        with pytest.raises(Exception, match="could not be posted"):
            await t.pull(peer, "r1", LAYOUT.full_slice(), _into(), handle=handle, remote_blocks=BLOCKS)
        await asyncio.sleep(SlowPins.delay_s + 0.1)  # the pin arrives after its unpin
        assert server.statistics().pinned == 0 and not server._early
        assert store.statistics().held_requests == 1  # not released: the READ never ran
