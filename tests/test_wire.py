"""The wire codec: every message round-trips, every malformed field is a ProtocolViolation."""

from __future__ import annotations

import struct

import pytest

from transports import KVSlice, ProtocolViolation
from transports import wire
from transports.wire import HEADER_BYTES, WireLimits

LIMITS = WireLimits(max_request_id_len=64, max_transfer_bytes=1 << 30, max_layers=32, max_heads=16)
SHAPE = (3, 2, 2, 4, 16, 64)
NBYTES = 3 * 2 * 2 * 4 * 16 * 64 * 2


HANDLE = "0123456789abcdef0123456789abcdef"
INFO = wire.PeerInfo(num_layers=32, total_kv_heads=16, head_start=4, head_end=8, head_dim=128, block_size=16,
                     dtype="bfloat16", max_pulls=256, lease_ms=30_000)


def _pull(**kw: object) -> wire.Pull:
    base = dict(txid=7, request_id="req-1", handle=HANDLE, kv_slice=KVSlice(0, 2, 0, 4), dtype="float16", shape=SHAPE,
                nbytes=NBYTES, tag=15)
    base.update(kw)
    return wire.Pull(**base)  # type: ignore[arg-type]


MESSAGES = [
    wire.AuthChallenge(b"n" * 32, True),
    wire.AuthChallenge(b"n" * 32, False),
    wire.AuthResponse(b"c" * 32, b"m" * 32),
    wire.AuthOk(b"m" * 32, INFO),
    wire.AuthFail(wire.Status.AUTH_FAILED, "bad credentials"),
    _pull(),
    _pull(release=False),
    _pull(probe=255),
    _pull(kv_slice=KVSlice(31, 32, 15, 16), shape=(1, 1, 2, 1, 16, 64), nbytes=1 * 1 * 2 * 16 * 64 * 2),
    wire.PullErr(7, wire.Status.UNKNOWN_REQUEST, "no KV held"),
    wire.PullWhole(7, NBYTES),
    wire.Release(9, "a.b:c-d_e", HANDLE),
    wire.Hold(10, (("a", HANDLE), ("b.c:d-e_f" * 6, HANDLE))),
    wire.ReleaseOk(9, True),
    wire.ReleaseOk(9, False),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: wire.Message) -> None:
    raw = wire.encode(msg)
    assert wire.decode(raw, LIMITS) == msg
    frame = wire.encode_frame(msg)
    assert len(frame) == wire.FRAME_BYTES
    assert wire.decode_frame(frame, LIMITS) == msg


def _with_header(raw: bytes, **fields: int) -> bytes:
    magic, version, mtype, flags, body_len, txid = struct.unpack_from("!4sBBHIQ", raw)
    vals = dict(version=version, mtype=mtype, flags=flags, body_len=body_len, txid=txid)
    vals.update(fields)
    head = struct.pack("!4sBBHIQ", magic, vals["version"], vals["mtype"], vals["flags"], vals["body_len"], vals["txid"])
    return head + raw[HEADER_BYTES:]


def _reject(raw: bytes | bytearray, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        wire.decode(raw, LIMITS)


def test_header_fields_rejected() -> None:
    raw = wire.encode(_pull())
    _reject(b"", "truncated header")
    _reject(raw[:10], "truncated header")
    _reject(b"XXXX" + raw[4:], "bad magic")
    _reject(_with_header(raw, version=1), "unsupported protocol version 1")
    _reject(_with_header(raw, mtype=99), "unknown message type 99")
    _reject(_with_header(raw, flags=1), "unknown flags")
    _reject(_with_header(wire.encode(wire.ReleaseOk(1, True)), flags=2), "unknown flags")  # KEEP is for PULL only
    _reject(_with_header(raw, body_len=len(raw)), "declared length")
    _reject(_with_header(raw, body_len=1 << 31), "exceeds the frame")
    _reject(raw + b"\0", "declared length")
    _reject(raw[:-1], "declared length")


def test_frame_checks() -> None:
    frame = wire.encode_frame(wire.ReleaseOk(1, True))
    frame[-1] = 1
    with pytest.raises(ProtocolViolation, match="non-zero bytes"):
        wire.decode_frame(frame, LIMITS)
    with pytest.raises(ProtocolViolation, match="frame of"):
        wire.decode_frame(bytes(10), LIMITS)


def test_truncated_body_rejected() -> None:
    raw = wire.encode(_pull())
    for cut in range(HEADER_BYTES, len(raw)):
        body = raw[HEADER_BYTES:cut]
        _reject(_with_header(raw[:HEADER_BYTES], body_len=len(body)) + body, "PULL")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(request_id="x" * 65), "request id length 65"),
        (dict(request_id="bad id"), "characters outside"),
        (dict(request_id="a/b"), "characters outside"),
        (dict(dtype="int8", nbytes=NBYTES // 2), "unknown dtype 'int8'"),
        (dict(dtype="float32"), "nbytes .* != prod"),
        (dict(nbytes=NBYTES + 2), "nbytes .* != prod"),
        (dict(shape=(3, 2, 2, 4, 16, 0), nbytes=0), "dim 5 = 0"),
        (dict(shape=(1,) * 9, nbytes=2), "rank 9"),
        (dict(kv_slice=KVSlice(0, 33, 0, 4)), "layer range 0:33"),
        (dict(kv_slice=KVSlice(2, 2, 0, 4)), "layer range 2:2"),
        (dict(kv_slice=KVSlice(0, 2, 3, 17)), "head range 3:17"),
        (dict(shape=(1 << 20, 1024, 1), nbytes=(1 << 31)), "exceeds max_transfer_bytes"),
    ],
)
def test_pull_fields_rejected(kw: dict[str, object], match: str) -> None:
    _reject(wire.encode(_pull(**kw)), match)


def test_huge_dims_rejected_before_allocation() -> None:
    # dims whose product is astronomically large: rejected by arithmetic, nothing is allocated
    msg = _pull(shape=(1 << 32,) * 8, nbytes=2)
    _reject(wire.encode(msg), "nbytes 2 != prod")
    _reject(wire.encode(_pull(shape=(1 << 33,), nbytes=2)), "dim 0")


def test_other_fields_rejected() -> None:
    err = bytearray(wire.encode(wire.PullErr(1, wire.Status.BUSY, "busy")))
    err[HEADER_BYTES + 1] = 99  # status 99
    _reject(err, "unknown status 99")
    err = bytearray(wire.encode(wire.PullErr(1, wire.Status.BUSY, "busy")))
    err[HEADER_BYTES + 4] = 0x07  # a control character in the reason
    _reject(err, "printable")
    long_reason = struct.pack("!HH", 1, 300) + b"a" * 300
    _reject(_with_header(wire.encode(wire.ReleaseOk(1, True)), mtype=int(wire.MsgType.PULL_ERR), body_len=len(long_reason))[:HEADER_BYTES] + long_reason, "300 bytes exceeds")
    ok = bytearray(wire.encode(wire.ReleaseOk(1, True)))
    ok[-1] = 2
    _reject(ok, "released flag 2")
    ok_with_more = _with_header(wire.encode(wire.ReleaseOk(1, True)), body_len=2) + b"\0"
    _reject(ok_with_more, "trailing bytes")
    _reject(wire.encode(_pull()).replace(b"float16", b"float17"), "unknown dtype")
    _reject(_with_header(wire.encode(_pull()), mtype=11), "unknown message type 11")  # PULL_OK, gone in version 5
    rel = wire.encode(wire.Release(1, "abc", HANDLE)).replace(b"abc", b"a\xffc")
    _reject(rel, "characters outside")
    _reject(wire.encode(wire.Release(1, "abc", HANDLE)).replace(HANDLE.encode(), HANDLE.upper().encode()), "KV handle")
    _reject(wire.encode(_pull()).replace(HANDLE.encode(), b"g" * 32), "KV handle")
    info = bytearray(wire.encode(wire.AuthOk(b"m" * 32, INFO)))
    struct.pack_into("!I", info, HEADER_BYTES + 32 + 8, 17)  # head_start beyond total heads
    _reject(info, "peer info out of range")


def test_malformed_frame_names_its_request() -> None:
    frame = wire.encode_frame(_pull(request_id="bad id"))
    with pytest.raises(ProtocolViolation) as caught:
        wire.decode_frame(frame, LIMITS)
    assert caught.value.kind is wire.MsgType.PULL and caught.value.txid == 7  # type: ignore[attr-defined]


def test_hold_frames_split_to_fit() -> None:
    items = [(f"request-{i:0100d}", HANDLE) for i in range(50)]
    frames = wire.hold_frames(items, txid=3)
    assert len(frames) > 1 and [it for f in frames for it in f.items] == items
    for f in frames:
        assert wire.decode_frame(wire.encode_frame(f), wire.WireLimits()) == f


def test_encode_refuses_bad_fields() -> None:
    with pytest.raises(ValueError):
        wire.encode(wire.AuthOk(b"short", INFO))
    with pytest.raises(ValueError):
        wire.encode(_pull(txid=-1))
    with pytest.raises(ValueError):
        wire.encode("not a message")  # type: ignore[arg-type]


def test_limits_must_fit_a_frame() -> None:
    with pytest.raises(ValueError):
        WireLimits(max_request_id_len=4096)
    with pytest.raises(ValueError):
        WireLimits(max_transfer_bytes=0)


def test_load_secret(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transports import _auth

    monkeypatch.delenv(_auth.SECRET_ENV, raising=False)
    assert _auth.load_secret() is None
    monkeypatch.setenv(_auth.SECRET_ENV, "  from-the-environment-123  ")
    assert _auth.load_secret() == b"from-the-environment-123"
    f = tmp_path / "secret"
    f.write_bytes(b"from-a-file-0123456789\n")
    assert _auth.load_secret(path=f) == b"from-a-file-0123456789"  # a file wins over the env
    monkeypatch.setenv(_auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        _auth.load_secret()


def test_macs_are_mutual_and_role_bound() -> None:
    from transports import _auth

    k, ns, nc = b"k" * 32, _auth.new_nonce(), _auth.new_nonce()
    c, s = _auth.client_mac(k, ns, nc), _auth.server_mac(k, ns, nc)
    assert c != s  # a client MAC cannot be replayed as the server's proof
    assert _auth.server_mac(k, ns, nc, b"info") != s  # what the server says of itself is covered
    assert _auth.verify(c, _auth.client_mac(k, ns, nc))
    assert not _auth.verify(c, _auth.client_mac(b"x" * 32, ns, nc))
    assert not _auth.verify(c, _auth.client_mac(k, nc, ns))
    assert not _auth.verify(c, c[:-1])
