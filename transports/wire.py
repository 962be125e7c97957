"""The control-message wire protocol between a GEN node (client) and a CTX node (server).

Every control message is a fixed 20-byte header followed by a typed body, big-endian::

    magic  b"KVOW" | version u8 | type u8 | flags u16 | body_len u32 | txid u64 | body ...

``txid`` is chosen by the client and echoed by the server, so replies are matched by id. On UCX
each message travels in one fixed-size frame of ``FRAME_BYTES`` (the message, zero padded): the
receiver always posts a recv of exactly that size, so nothing is ever allocated from a field that a
peer declared.

Life cycle of one pull (after the handshake): one message before the data, the KV's receive posted
before it leaves, and nothing but the KV after it when all is well (as the libraries' own
two-message exchange)::

    GEN                                                  CTX
    writes a random byte (the probe) over the last byte of ``into``, posts the receive of the KV
    (into ``into``, tag 2*txid+1), then
    PULL(txid, id, handle, slice, dtype, shape, nbytes, tag, probe[, KEEP]) ->
                                          validates it (handle, slice, dtype, shape, bytes), then
                                       <- the KV on the data tag, exactly ``nbytes``; then releases
                                          the entry (unless FLAG_KEEP: a chunk); and, only if the
                                          last byte of what it sent is the probe,
                                       <- PULL_WHOLE(txid, bytes sent) on the reply tag (2*txid)
                                       or PULL_ERR(txid, status) on the reply tag, then an
                                          empty message on the data tag (it ends the posted receive)
    once the receive ends: the last byte of ``into`` is no longer the probe (the whole KV landed),
    or it still is: only then does GEN post the receive of the reply (tag 2*txid) and wait for a
    PULL_WHOLE naming ``nbytes`` (the KV ends in that byte) or a PULL_ERR. A pull that does not
    succeed puts the probe's byte back: a refused pull leaves ``into`` as it was.
    RELEASE(txid, id, handle) ->       <- RELEASE_OK(txid, released)
    HOLD(txid, [(id, handle), ...]) ->    (no reply) renews the leases of requests GEN holds waiting

Integrity (DESIGN invariant 12): ucxx (0.52) completes a message shorter than the posted buffer
without reporting its length, so the length is checked through the data: a message that reaches
the last byte of ``into`` is whole (a longer one fails its receive as truncated); a short one,
whatever its length, never writes that byte, so the probe stays. A whole KV that ends in the probe
(1 pull in 256) is told by the CTX, which compares the last byte of the buffer it sends and names
that buffer's length: a short message is never taken for a whole one, and none waits for a reply it
will not get. The data tag ties the message to its PULL (UCX hashes it with the endpoint's own
tag). Every PULL that names its own data tag (2*txid+1) and a txid not in flight gets exactly one
data message (the KV, or the empty message after a PULL_ERR), which GEN always receives (also when
the pull was cancelled meanwhile), or the endpoint closes.

Handshake (mutual HMAC, see ``_auth``): CTX sends AUTH_CHALLENGE(nonce), GEN answers AUTH_RESPONSE
(nonce, mac), CTX answers AUTH_OK(mac, PeerInfo: its KV layout, head range, pull limit, lease) or
AUTH_FAIL and closes. GEN checks the layout once there, not at every pull.

``decode``/``decode_frame`` validate every field against a ``WireLimits`` before building anything,
and raise ``ProtocolViolation`` (never another exception) for anything malformed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import struct

from ._errors import ProtocolViolation
from ._layout import KVSlice, _DTYPES

MAGIC = b"KVOW"
VERSION = 6  # 6: the PULL names GEN's last byte; PULL_WHOLE when the KV ends in it (5: a secret 8-byte sentinel)
FRAME_BYTES = 1024
NONCE_BYTES = 32
MAC_BYTES = 32

_HEADER = struct.Struct("!4sBBHIQ")
HEADER_BYTES = _HEADER.size  # 20
_PULL_FIXED = struct.Struct("!HBBIIIIQQB")  # id_len, dtype_len, rank, l0, l1, h0, h1, nbytes, tag, probe (+ id, handle, shape)
_INFO_FIXED = struct.Struct("!IIIIIIIIB")  # layers, total heads, h0, h1, head_dim, block_size, max_pulls, lease_ms, dtype_len
HANDLE_BYTES = 32
_ERR_FIXED = struct.Struct("!HH")  # status, reason_len
_U16 = struct.Struct("!H")
_U8 = struct.Struct("!B")
_DIM = struct.Struct("!Q")

_REQUEST_ID_RE = re.compile(rb"[A-Za-z0-9._:\-]+")  # the rule of transports._ids, on bytes
_HANDLE_RE = re.compile(rb"[0-9a-f]{32}")
_REASON_RE = re.compile(rb"[\x20-\x7e]*")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
assert set(_ITEMSIZE) == set(_DTYPES)

FLAG_AUTH_REQUIRED = 0x0001  # AUTH_CHALLENGE: the server wants a MAC
FLAG_KEEP = 0x0002  # PULL: do not release the entry after a successful send (a chunk, not the last)
_ALLOWED_FLAGS = {"AUTH_CHALLENGE": FLAG_AUTH_REQUIRED, "PULL": FLAG_KEEP}


class MsgType(enum.IntEnum):
    AUTH_CHALLENGE = 1
    AUTH_RESPONSE = 2
    AUTH_OK = 3
    AUTH_FAIL = 4
    PULL = 10  # 11 was PULL_OK (wire versions 1-4)
    PULL_ERR = 12
    PULL_WHOLE = 13  # the KV sent ends in the PULL's probe byte: GEN could not tell it from a short one
    RELEASE = 20
    RELEASE_OK = 21
    HOLD = 22


class Status(enum.IntEnum):
    """Why a PULL or the handshake failed."""

    UNKNOWN_REQUEST = 1
    BUSY = 2
    SHAPE_MISMATCH = 3
    BAD_REQUEST = 4
    AUTH_FAILED = 5
    INTERNAL = 6
    SHUTTING_DOWN = 7


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """What a node accepts from a peer; everything a message declares is checked against these."""

    max_request_id_len: int = 128
    max_transfer_bytes: int = 4 << 30
    max_layers: int = 1024
    max_heads: int = 1024
    max_rank: int = 8
    max_dim: int = 1 << 32
    max_reason_len: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"WireLimits.{f.name} must be positive")
        worst = HEADER_BYTES + _PULL_FIXED.size + self.max_request_id_len + HANDLE_BYTES + 16 + 8 * self.max_rank
        if worst > FRAME_BYTES:
            raise ValueError(f"WireLimits allow a PULL of {worst} bytes, more than a frame ({FRAME_BYTES})")
        if HEADER_BYTES + _ERR_FIXED.size + self.max_reason_len > FRAME_BYTES:
            raise ValueError("WireLimits.max_reason_len does not fit in a frame")


# -- messages -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuthChallenge:
    nonce: bytes
    auth_required: bool = True
    txid: int = 0


@dataclasses.dataclass(frozen=True)
class AuthResponse:
    nonce: bytes
    mac: bytes
    txid: int = 0


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """What a CTX node tells a GEN node in AUTH_OK: the KV it serves and its limits."""

    num_layers: int
    total_kv_heads: int
    """KV heads of the whole model."""
    head_start: int
    head_end: int
    """The KV heads this node holds (all of them unless the CTX runs tensor-parallel)."""
    head_dim: int
    block_size: int
    dtype: str
    max_pulls: int
    """Pulls it serves at once on one endpoint; more are refused BUSY."""
    lease_ms: int
    """How long it holds a request's KV that nobody pulls, renews or releases."""


@dataclasses.dataclass(frozen=True)
class AuthOk:
    mac: bytes
    info: PeerInfo
    txid: int = 0


@dataclasses.dataclass(frozen=True)
class AuthFail:
    status: Status
    reason: str
    txid: int = 0


@dataclasses.dataclass(frozen=True)
class Pull:
    txid: int
    request_id: str
    handle: str
    kv_slice: KVSlice
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    tag: int
    release: bool = True  # False: the CTX keeps the entry after this pull (FLAG_KEEP)
    probe: int = 0  # the byte GEN wrote last in its receive buffer (0-255): a KV ending in it gets a PULL_WHOLE


@dataclasses.dataclass(frozen=True)
class PullErr:
    txid: int
    status: Status
    reason: str


@dataclasses.dataclass(frozen=True)
class PullWhole:
    txid: int
    nbytes: int  # the length of the KV message the CTX sent


@dataclasses.dataclass(frozen=True)
class Release:
    txid: int
    request_id: str
    handle: str


@dataclasses.dataclass(frozen=True)
class ReleaseOk:
    txid: int
    released: bool


@dataclasses.dataclass(frozen=True)
class Hold:
    txid: int
    items: tuple[tuple[str, str], ...]
    """(request id, handle) pairs whose leases GEN asks to renew."""


Message = AuthChallenge | AuthResponse | AuthOk | AuthFail | Pull | PullErr | PullWhole | Release | ReleaseOk | Hold

_HOLD_ITEM_OVERHEAD = 1 + HANDLE_BYTES  # id_len u8, handle


def hold_frames(items: list[tuple[str, str]], txid: int = 0) -> list[Hold]:
    """``items`` split into as few HOLD messages as fit one frame each."""
    out: list[Hold] = []
    room = FRAME_BYTES - HEADER_BYTES - _U16.size
    batch: list[tuple[str, str]] = []
    used = 0
    for rid, handle in items:
        need = _HOLD_ITEM_OVERHEAD + len(rid)
        if batch and used + need > room:
            out.append(Hold(txid, tuple(batch)))
            batch, used = [], 0
        batch.append((rid, handle))
        used += need
    if batch:
        out.append(Hold(txid, tuple(batch)))
    return out


# -- encoding -------------------------------------------------------------------------------------


def _shape_bytes(dtype: str, shape: tuple[int, ...]) -> bytes:
    return dtype.encode("ascii") + b"".join(_DIM.pack(d) for d in shape)


def _handle_bytes(handle: str) -> bytes:
    raw = handle.encode("ascii")
    _check_len("handle", raw, HANDLE_BYTES)
    return raw


def info_bytes(info: PeerInfo) -> bytes:
    """The wire form of ``info`` (also what the server's MAC covers)."""
    d = info.dtype.encode("ascii")
    return _INFO_FIXED.pack(info.num_layers, info.total_kv_heads, info.head_start, info.head_end, info.head_dim,
                            info.block_size, info.max_pulls, info.lease_ms, len(d)) + d


def _reason_bytes(reason: str) -> bytes:
    raw = reason.encode("ascii", "replace")[:120]
    return bytes(b if 0x20 <= b <= 0x7E else 0x3F for b in raw)


def encode(msg: Message) -> bytes:
    """The exact bytes of ``msg`` (header and body). Raises ``ValueError`` for unencodable fields."""
    flags = 0
    txid = getattr(msg, "txid", None)
    match msg:
        case AuthChallenge(nonce=nonce, auth_required=req):
            mtype, body = MsgType.AUTH_CHALLENGE, bytes(nonce)
            flags = FLAG_AUTH_REQUIRED if req else 0
            _check_len("nonce", body, NONCE_BYTES)
        case AuthResponse(nonce=nonce, mac=mac):
            _check_len("nonce", nonce, NONCE_BYTES)
            _check_len("mac", mac, MAC_BYTES)
            mtype, body = MsgType.AUTH_RESPONSE, bytes(nonce) + bytes(mac)
        case AuthOk(mac=mac, info=info):
            _check_len("mac", mac, MAC_BYTES)
            mtype, body = MsgType.AUTH_OK, bytes(mac) + info_bytes(info)
        case AuthFail(status=status, reason=reason) | PullErr(status=status, reason=reason):
            mtype = MsgType.AUTH_FAIL if isinstance(msg, AuthFail) else MsgType.PULL_ERR
            r = _reason_bytes(reason)
            body = _ERR_FIXED.pack(int(status), len(r)) + r
        case Pull(request_id=rid, handle=handle, kv_slice=s, dtype=dtype, shape=shape, nbytes=nbytes, tag=tag,
                  release=release, probe=probe):
            r = rid.encode("ascii")
            flags = 0 if release else FLAG_KEEP
            body = (
                _PULL_FIXED.pack(len(r), len(dtype), len(shape), s.layer_start, s.layer_end,
                                 s.head_start, s.head_end, nbytes, tag, probe)
                + r
                + _handle_bytes(handle)
                + _shape_bytes(dtype, shape)
            )
            mtype = MsgType.PULL
        case Release(request_id=rid, handle=handle):
            r = rid.encode("ascii")
            mtype, body = MsgType.RELEASE, _U16.pack(len(r)) + r + _handle_bytes(handle)
        case Hold(items=items):
            parts = [_U16.pack(len(items))]
            for rid, handle in items:
                r = rid.encode("ascii")
                parts.append(_U8.pack(len(r)) + r + _handle_bytes(handle))
            mtype, body = MsgType.HOLD, b"".join(parts)
        case PullWhole(nbytes=nbytes):
            mtype, body = MsgType.PULL_WHOLE, _DIM.pack(nbytes)
        case ReleaseOk(released=released):
            mtype, body = MsgType.RELEASE_OK, _U8.pack(1 if released else 0)
        case _:
            raise ValueError(f"not a wire message: {msg!r}")
    try:
        return _HEADER.pack(MAGIC, VERSION, int(mtype), flags, len(body), txid) + body
    except struct.error as exc:
        raise ValueError(f"cannot encode {type(msg).__name__}: {exc}") from None


def encode_frame(msg: Message) -> bytearray:
    """``msg`` zero-padded to ``FRAME_BYTES`` (what goes on a UCX control tag)."""
    raw = encode(msg)
    if len(raw) > FRAME_BYTES:
        raise ValueError(f"{type(msg).__name__} of {len(raw)} bytes does not fit a {FRAME_BYTES}-byte frame")
    frame = bytearray(FRAME_BYTES)
    frame[: len(raw)] = raw
    return frame


def _check_len(name: str, value: bytes, n: int) -> None:
    if len(value) != n:
        raise ValueError(f"{name} must be {n} bytes, got {len(value)}")


# -- decoding -------------------------------------------------------------------------------------


def _bad(msg: str) -> ProtocolViolation:
    return ProtocolViolation(msg)


class _Reader:
    """Bounds-checked cursor over a body; every read fails with ProtocolViolation, never IndexError."""

    def __init__(self, body: memoryview, what: str) -> None:
        self.body = body
        self.pos = 0
        self.what = what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.body):
            raise _bad(f"{self.what}: truncated body (need {n} bytes at offset {self.pos}, have {len(self.body)})")
        out = bytes(self.body[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[int, ...]:
        return st.unpack(self.take(st.size))

    def done(self) -> None:
        if self.pos != len(self.body):
            raise _bad(f"{self.what}: {len(self.body) - self.pos} trailing bytes in body")


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[MsgType, int, int, int]:
    """``(type, flags, body_len, txid)`` of a message, after checking magic, version and type."""
    if len(buf) < HEADER_BYTES:
        raise _bad(f"truncated header: {len(buf)} bytes, need {HEADER_BYTES}")
    magic, version, mtype, flags, body_len, txid = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _bad(f"bad magic {magic!r}")
    if version != VERSION:
        raise _bad(f"unsupported protocol version {version} (this node speaks {VERSION})")
    try:
        kind = MsgType(mtype)
    except ValueError:
        raise _bad(f"unknown message type {mtype}") from None
    allowed = _ALLOWED_FLAGS.get(kind.name, 0)
    if flags & ~allowed:
        raise _bad(f"{kind.name}: unknown flags 0x{flags:04x}")
    if body_len > FRAME_BYTES - HEADER_BYTES:
        raise _bad(f"{kind.name}: body length {body_len} exceeds the frame ({FRAME_BYTES - HEADER_BYTES})")
    return kind, flags, body_len, txid


def decode(buf: bytes | bytearray | memoryview, limits: WireLimits) -> Message:
    """Decode exactly one message filling ``buf``; raise ``ProtocolViolation`` if anything is off."""
    kind, flags, body_len, txid = decode_header(buf)
    if HEADER_BYTES + body_len != len(buf):
        raise _bad(f"{kind.name}: declared length {HEADER_BYTES + body_len} != buffer length {len(buf)}")
    return _decode_body(kind, flags, txid, memoryview(buf)[HEADER_BYTES:], limits)


def decode_frame(frame: bytes | bytearray | memoryview, limits: WireLimits) -> Message:
    """Decode a ``FRAME_BYTES`` frame: one message, then only zero padding.

    A ``ProtocolViolation`` raised after the header was read carries ``.kind`` and ``.txid``, so a
    server can fail that one request instead of the connection."""
    if len(frame) != FRAME_BYTES:
        raise _bad(f"frame of {len(frame)} bytes, expected {FRAME_BYTES}")
    kind, flags, body_len, txid = decode_header(frame)
    try:
        end = HEADER_BYTES + body_len
        view = memoryview(frame)
        padding = FRAME_BYTES - end
        if (frame.count(0, end) if isinstance(frame, (bytes, bytearray)) else bytes(view[end:]).count(0)) != padding:
            raise _bad(f"{kind.name}: non-zero bytes after the declared length")
        return _decode_body(kind, flags, txid, view[HEADER_BYTES:end], limits)
    except ProtocolViolation as exc:
        exc.kind, exc.txid = kind, txid  # type: ignore[attr-defined]
        raise


def _request_id(raw: bytes, limits: WireLimits, what: str) -> str:
    if not raw:
        raise _bad(f"{what}: empty request id")
    if len(raw) > limits.max_request_id_len:
        raise _bad(f"{what}: request id of {len(raw)} bytes exceeds {limits.max_request_id_len}")
    if not _REQUEST_ID_RE.fullmatch(raw):
        raise _bad(f"{what}: request id has characters outside [A-Za-z0-9._:-]")
    return raw.decode("ascii")


def _handle(r: _Reader) -> str:
    raw = r.take(HANDLE_BYTES)
    if not _HANDLE_RE.fullmatch(raw):
        raise _bad(f"{r.what}: KV handle is not {HANDLE_BYTES} lowercase hex characters")
    return raw.decode("ascii")


def _dtype_and_shape(r: _Reader, dtype_len: int, rank: int, nbytes: int, limits: WireLimits) -> tuple[str, tuple[int, ...]]:
    what = r.what
    if not 0 < dtype_len <= 16:
        raise _bad(f"{what}: dtype name length {dtype_len} out of range")
    if not 0 < rank <= limits.max_rank:
        raise _bad(f"{what}: shape rank {rank} outside 1..{limits.max_rank}")
    raw = r.take(dtype_len)
    try:
        dtype = raw.decode("ascii")
    except UnicodeDecodeError:
        raise _bad(f"{what}: dtype name is not ascii") from None
    if dtype not in _ITEMSIZE:
        raise _bad(f"{what}: unknown dtype {dtype!r}")
    shape = r.unpack(_dims(rank))
    for i, d in enumerate(shape):
        if not 0 < d <= limits.max_dim:
            raise _bad(f"{what}: dim {i} = {d} outside 1..{limits.max_dim}")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if nbytes != expected:
        raise _bad(f"{what}: nbytes {nbytes} != prod(shape) * itemsize = {expected}")
    if nbytes > limits.max_transfer_bytes:
        raise _bad(f"{what}: transfer of {nbytes} bytes exceeds max_transfer_bytes {limits.max_transfer_bytes}")
    return dtype, shape


@functools.lru_cache(maxsize=None)
def _dims(rank: int) -> struct.Struct:
    return struct.Struct(f"!{rank}Q")


def _reason(r: _Reader, limits: WireLimits) -> tuple[Status, str]:
    status, reason_len = r.unpack(_ERR_FIXED)
    try:
        st = Status(status)
    except ValueError:
        raise _bad(f"{r.what}: unknown status {status}") from None
    if reason_len > limits.max_reason_len:
        raise _bad(f"{r.what}: reason of {reason_len} bytes exceeds {limits.max_reason_len}")
    raw = r.take(reason_len)
    if not _REASON_RE.fullmatch(raw):
        raise _bad(f"{r.what}: reason is not printable ascii")
    return st, raw.decode("ascii")


def _decode_body(kind: MsgType, flags: int, txid: int, body: memoryview, limits: WireLimits) -> Message:
    r = _Reader(body, kind.name)
    msg: Message
    if kind is MsgType.AUTH_CHALLENGE:
        msg = AuthChallenge(r.take(NONCE_BYTES), bool(flags & FLAG_AUTH_REQUIRED), txid)
    elif kind is MsgType.AUTH_RESPONSE:
        msg = AuthResponse(r.take(NONCE_BYTES), r.take(MAC_BYTES), txid)
    elif kind is MsgType.AUTH_OK:
        mac = r.take(MAC_BYTES)
        layers, heads, h0, h1, head_dim, block_size, max_pulls, lease_ms, dtype_len = r.unpack(_INFO_FIXED)
        if not 0 < dtype_len <= 16:
            raise _bad(f"AUTH_OK: dtype name length {dtype_len} out of range")
        dtype = r.take(dtype_len).decode("ascii", "replace")
        if dtype not in _ITEMSIZE:
            raise _bad(f"AUTH_OK: unknown dtype {dtype!r}")
        if not (0 < layers <= limits.max_layers and 0 <= h0 < h1 <= heads <= limits.max_heads
                and head_dim > 0 and block_size > 0 and max_pulls > 0):
            raise _bad("AUTH_OK: peer info out of range")
        msg = AuthOk(mac, PeerInfo(layers, heads, h0, h1, head_dim, block_size, dtype, max_pulls, lease_ms), txid)
    elif kind in (MsgType.AUTH_FAIL, MsgType.PULL_ERR):
        status, reason = _reason(r, limits)
        msg = AuthFail(status, reason, txid) if kind is MsgType.AUTH_FAIL else PullErr(txid, status, reason)
    elif kind is MsgType.PULL:
        id_len, dtype_len, rank, l0, l1, h0, h1, nbytes, tag, probe = r.unpack(_PULL_FIXED)
        if not 0 <= l0 < l1 <= limits.max_layers:
            raise _bad(f"PULL: layer range {l0}:{l1} outside 0:{limits.max_layers}")
        if not 0 <= h0 < h1 <= limits.max_heads:
            raise _bad(f"PULL: head range {h0}:{h1} outside 0:{limits.max_heads}")
        if not 0 < id_len <= limits.max_request_id_len:
            raise _bad(f"PULL: request id length {id_len} outside 1..{limits.max_request_id_len}")
        rid = _request_id(r.take(id_len), limits, "PULL")
        handle = _handle(r)
        dtype, shape = _dtype_and_shape(r, dtype_len, rank, nbytes, limits)
        msg = Pull(txid, rid, handle, KVSlice(l0, l1, h0, h1), dtype, shape, nbytes, tag, not flags & FLAG_KEEP, probe)
    elif kind is MsgType.PULL_WHOLE:
        (nbytes,) = r.unpack(_DIM)
        msg = PullWhole(txid, nbytes)
    elif kind is MsgType.RELEASE:
        (id_len,) = r.unpack(_U16)
        if not 0 < id_len <= limits.max_request_id_len:
            raise _bad(f"RELEASE: request id length {id_len} outside 1..{limits.max_request_id_len}")
        msg = Release(txid, _request_id(r.take(id_len), limits, "RELEASE"), _handle(r))
    elif kind is MsgType.HOLD:
        (count,) = r.unpack(_U16)
        if count < 1:
            raise _bad("HOLD: no items")
        items = []
        for _ in range(count):
            (id_len,) = r.unpack(_U8)
            if not 0 < id_len <= limits.max_request_id_len:
                raise _bad(f"HOLD: request id length {id_len} outside 1..{limits.max_request_id_len}")
            items.append((_request_id(r.take(id_len), limits, "HOLD"), _handle(r)))
        msg = Hold(txid, tuple(items))
    elif kind is MsgType.RELEASE_OK:
        (flag,) = r.unpack(_U8)
        if flag > 1:
            raise _bad(f"RELEASE_OK: released flag {flag} is not 0 or 1")
        msg = ReleaseOk(txid, bool(flag))
    else:  # pragma: no cover - MsgType is exhaustive above
        raise _bad(f"unhandled message type {kind.name}")
    r.done()
    return msg
