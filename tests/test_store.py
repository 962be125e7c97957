"""CTX-side KVStore: leases, release, and pinned checkouts that keep blocks alive under a send."""

from __future__ import annotations

import pytest
import torch

from tests.harness import LAYOUT
from transports import KVSlice, KVStore, UnknownRequest


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def store_with(ids: list[int], clock: Clock | None = None) -> tuple[KVStore, list[str]]:
    pool = LAYOUT.new_pool(16).uniform_()
    store = KVStore(LAYOUT, pool, clock=clock or Clock())
    freed: list[str] = []
    store.put("r", torch.tensor(ids), num_tokens=len(ids) * LAYOUT.block_size, lease_s=5.0,
              on_release=lambda: freed.append("r"))
    return store, freed


def test_full_slice_of_one_run_is_a_zero_copy_view() -> None:
    store, _ = store_with([3, 4, 5])
    with store.checkout("r", LAYOUT.full_slice()) as c:
        assert c.tensor.data_ptr() == store.pool[3].data_ptr()
        assert torch.equal(c.tensor, store.pool[3:6])


def test_scattered_blocks_or_a_slice_are_gathered_copies() -> None:
    store, _ = store_with([5, 3, 4])
    with store.checkout("r", LAYOUT.full_slice()) as c:
        assert torch.equal(c.tensor, store.pool[torch.tensor([5, 3, 4])])
        assert c.tensor.data_ptr() != store.pool[5].data_ptr()
    part = KVSlice(1, 2, 0, 1)
    with store.checkout("r", part) as c:
        assert torch.equal(c.tensor, store.pool[torch.tensor([5, 3, 4])][:, 1:2, :, 0:1])


def test_release_while_checked_out_frees_only_after_the_send() -> None:
    store, freed = store_with([1, 2])
    c = store.checkout("r", LAYOUT.full_slice())
    assert store.release("r") is True
    assert freed == []  # the blocks are still being sent
    with pytest.raises(UnknownRequest):
        store.checkout("r", LAYOUT.full_slice())  # but nobody can start a new pull of it
    c.close()
    c.close()  # idempotent
    assert freed == ["r"]


def test_lease_expiry_skips_an_entry_being_sent() -> None:
    clock = Clock()
    store, freed = store_with([1, 2], clock)
    c = store.checkout("r", LAYOUT.full_slice())
    clock.now = 100.0
    assert store.expire() == []
    c.close()
    assert store.expire() == ["r"] and freed == ["r"]
    assert store.statistics().expired == 1


def test_duplicate_put_is_refused_and_release_is_once() -> None:
    store, freed = store_with([1])
    with pytest.raises(ValueError):
        store.put("r", torch.tensor([2]), num_tokens=1, lease_s=1.0)
    assert store.release("r") and not store.release("r")
    assert freed == ["r"]


def test_a_guard_turns_every_free_into_a_revocation() -> None:
    """With a guard (a one-sided transport whose readers READ without pins): a lease's end, a
    release, and a release by one reader (named to the guard, which waits for the others) free the
    blocks only when the guard's ``done`` runs (once, however often it is called), and each counts
    in ``revocations`` (the epoch)."""
    clock = Clock()
    store, freed = store_with([1, 2], clock)
    store.put("q", torch.tensor([3]), num_tokens=4, lease_s=60.0, on_release=lambda: freed.append("q"))
    store.put("s", torch.tensor([4]), num_tokens=4, lease_s=60.0, on_release=lambda: freed.append("s"))
    revoked: dict[str, object] = {}
    readers: dict[str, object] = {}

    def revoke(rid: str, done: object, reader: object) -> None:
        revoked[rid], readers[rid] = done, reader

    store.guard_frees(revoke)
    assert store.revocations == 0
    clock.now = 10.0  # "r"'s lease (5 s) ended
    assert store.expire() == ["r"] and list(revoked) == ["r"] and freed == [] and readers["r"] is None
    assert store.release("q") and list(revoked) == ["r", "q"] and freed == [] and readers["q"] is None
    assert store.revocations == 2 and store.statistics().open_pins == 2 and store.statistics().held_requests == 1
    revoked["q"]()
    revoked["q"]()
    assert freed == ["q"] and store.statistics().open_pins == 1
    # a reader's own release is a revocation too (another reader may hold the handle), naming who let go
    epoch = store.epoch
    assert store.release("s", reader="gen-a") and freed == ["q"] and readers["s"] == "gen-a"
    assert store.revocations == 3 and store.epoch == epoch + 1  # a reader that connects later READs "s" pinned
    revoked["s"]()
    revoked["r"]()
    assert freed == ["q", "s", "r"] and store.statistics().open_pins == 0 and store.revocations == 3
    store.guard_frees(None)
    store.put("t", torch.tensor([5]), num_tokens=4, lease_s=60.0, on_release=lambda: freed.append("t"))
    assert store.release("t") and freed[-1] == "t" and store.revocations == 3


@pytest.mark.parametrize("with_handle", [True, False])
def test_a_checkout_gathers_the_blocks_it_pinned_even_if_its_id_is_put_again(with_handle: bool) -> None:
    """Released and put again (another thread) between the checkout's pin and its gather: the
    checkout holds the blocks it pinned, never fails and never gathers the new entry's blocks
    (before, it looked the id up again: UnknownRequest, or the new entry's bytes under the old pin)."""
    half = KVSlice(0, LAYOUT.num_layers, 0, 1)  # not the whole layout: the gather path
    pool = LAYOUT.new_pool(8)
    pool[0:2] = 1.0
    pool[4:6] = 2.0

    class Racy(KVStore):
        hook = None

        def _view(self, held, kv_slice):  # noqa: ANN001, ANN202 - between the pin and the gather
            if self.hook is not None:
                hook, self.hook = self.hook, None
                hook()
            return super()._view(held, kv_slice)

    store = Racy(LAYOUT, pool)
    h1 = store.put("r", torch.tensor([0, 1]), num_tokens=8, lease_s=60)

    def other_thread() -> None:
        store.release("r", handle=h1)
        store.put("r", torch.tensor([4, 5]), num_tokens=8, lease_s=60)

    store.hook = other_thread
    with store.checkout("r", half, handle=h1 if with_handle else None) as c:
        assert set(c.tensor.flatten().tolist()) == {1.0}


def test_a_store_that_names_its_handles_ties_each_to_its_request_id() -> None:
    from transports._ids import handle_key, handle_names

    store, _ = store_with([1, 2])
    assert not handle_names(store._held["r"].handle, "r", handle_key(b"s" * 32))  # plain random before
    store.name_handles(handle_key(b"s" * 32))
    h = store.put("q", torch.tensor([3]), num_tokens=4, lease_s=60.0)
    assert handle_names(h, "q", handle_key(b"s" * 32))
    assert not handle_names(h, "r", handle_key(b"s" * 32)) and not handle_names(h, "q", handle_key(b"t" * 32))
    assert not handle_names(h[:-1] + ("0" if h[-1] != "0" else "1"), "q", handle_key(b"s" * 32))
    assert not handle_names("not hex", "q", handle_key(b"s" * 32))
    assert handle_names(store.new_handle("x"), "x", handle_key(b"s" * 32))


def test_a_named_handle_names_its_request_and_prompt_length() -> None:
    from transports._ids import handle_key, handle_names, handle_tokens

    key = handle_key(b"k" * 32)
    store = KVStore(LAYOUT, torch.zeros(8, *LAYOUT.block_shape, dtype=LAYOUT.dtype))
    store.name_handles(key)
    h = store.put("r1", torch.tensor([0, 1]), num_tokens=20, lease_s=60)
    assert handle_names(h, "r1", key) and handle_tokens(h, "r1", key) == 20
    assert handle_tokens(h, "r2", key) is None  # given with another request's id
    assert handle_tokens(h, "r1", handle_key(b"x" * 32)) is None  # another cluster's key
    plain = KVStore(LAYOUT, torch.zeros(8, *LAYOUT.block_shape, dtype=LAYOUT.dtype))
    assert handle_tokens(plain.put("r1", torch.tensor([0]), num_tokens=20, lease_s=60), "r1", key) is None


def test_a_handle_s_tag_is_hmac_sha256_of_its_nonce_and_request_id_for_any_key() -> None:
    """The tag is computed from the key's padded states, hashed once per key (a pull checks a
    handle each time): it is HMAC-SHA256 exactly, for keys shorter than, as long as and longer than
    SHA-256's block, so a handle made by an older build (or another language) checks the same."""
    import hmac
    import random

    from transports._ids import HANDLE_LEN, _tag

    rng = random.Random(7)
    for key_len in (0, 1, 32, 63, 64, 65, 200):
        for _ in range(20):
            key, nonce = rng.randbytes(key_len), rng.randbytes(HANDLE_LEN // 4)
            rid = "".join(rng.choice("abc-._:0129XYZ") for _ in range(rng.randint(1, 128)))
            assert _tag(key, nonce, rid) == hmac.digest(key, nonce + rid.encode(), "sha256")[:HANDLE_LEN // 4]
