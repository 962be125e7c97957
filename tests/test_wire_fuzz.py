"""Fuzzing the wire decoder: whatever arrives, the answer is a valid message or ProtocolViolation.

About 11,000 generated inputs per run: random bytes, random frames and mutations of valid messages.
A successful decode must re-encode to the very same bytes (nothing is silently accepted that is not
canonical).
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transports import KVSlice, ProtocolViolation
from transports import wire

LIMITS = wire.WireLimits(max_request_id_len=64, max_transfer_bytes=1 << 28, max_layers=32, max_heads=16)
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=False)

SEEDS = [
    wire.encode(wire.Pull(3, "r", "ab" * 16, KVSlice(1, 2, 1, 2), "bfloat16", (1, 1, 2, 1, 4, 8), 128, 7, False)),
]
SEEDS += [
    wire.encode(m)
    for m in (
        wire.AuthChallenge(b"n" * 32, True),
        wire.AuthResponse(b"c" * 32, b"m" * 32),
        wire.AuthOk(b"m" * 32, wire.PeerInfo(2, 4, 0, 4, 64, 16, "float16", 8, 1000)),
        wire.AuthFail(wire.Status.AUTH_FAILED, "no"),
        wire.Pull(7, "req-1", "cd" * 16, KVSlice(0, 2, 0, 4), "float16", (3, 2, 2, 4, 16, 64), 3 * 2 * 2 * 4 * 16 * 64 * 2, 15),
        wire.PullErr(7, wire.Status.BUSY, "busy"),
        wire.Release(2, "req-2", "ef" * 16),
        wire.Hold(3, (("req-3", "01" * 16),)),
        wire.ReleaseOk(2, True),
    )
]


def _check(raw: bytes) -> None:
    try:
        msg = wire.decode(raw, LIMITS)
    except ProtocolViolation:
        return
    assert wire.encode(msg) == raw


def _check_frame(raw: bytes) -> None:
    try:
        wire.decode_frame(raw, LIMITS)
    except ProtocolViolation:
        pass


@settings(FUZZ, max_examples=3000)
@given(st.binary(max_size=wire.FRAME_BYTES + 64))
def test_random_bytes(raw: bytes) -> None:
    _check(raw)


@settings(FUZZ, max_examples=2000)
@given(
    st.sampled_from([int(t) for t in wire.MsgType] + [0, 255]),
    st.integers(0, 3),
    st.binary(max_size=300),
    st.integers(0, 2**64 - 1),
)
def test_valid_header_random_body(mtype: int, flags: int, body: bytes, txid: int) -> None:
    raw = struct.pack("!4sBBHIQ", wire.MAGIC, wire.VERSION, mtype, flags, len(body), txid) + body
    _check(raw)
    frame = raw + bytes(max(0, wire.FRAME_BYTES - len(raw)))
    _check_frame(frame[: wire.FRAME_BYTES])


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "u64"]))
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "u64" and len(raw) >= pos + 8:
            raw[pos : pos + 8] = struct.pack("!Q", draw(st.sampled_from([0, 1, 2**31, 2**32, 2**63, 2**64 - 1])))
    return bytes(raw)


@settings(FUZZ, max_examples=4000)
@given(_mutated())
def test_mutated_messages(raw: bytes) -> None:
    _check(raw)


@settings(FUZZ, max_examples=2000)
@given(_mutated(), st.integers(0, 40))
def test_mutated_frames(raw: bytes, pad: int) -> None:
    frame = (raw + bytes(wire.FRAME_BYTES))[: wire.FRAME_BYTES]
    _check_frame(frame)
    _check_frame(frame[: wire.FRAME_BYTES - pad] if pad else frame + b"\0")
