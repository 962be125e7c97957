"""What both ends of the NIXL data plane share (``transports.nixl`` GEN side, ``transports._nixl_server``
CTX side): settings, the agent, READ descriptors of a slice, and the control connection's framing
(a 4-byte length, then one JSON object)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import _auth
from ._errors import ProtocolViolation
from ._layout import KVLayout, KVSlice, dtype_name
from ._ucx_common import apply_ucx_defaults

try:
    from nixl_cu12 import _api as _nixl_api
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"transports.nixl needs nixl-cu12 (pip install -c constraints.txt '.[nixl]'): {exc}") from exc

NOTIF_PREFIX = b"kvo1:"  # + a pin's token: the READ of a pinned request ended
NOTIF_READ = b"kvo2:"  # + JSON [request id, handle, keep]: a READ no pin covered (revocations did) ended
_MAX_REVOKED = 4096  # GEN: request ids revoked on one connection remembered (more: its epoch rises)
_HEAD = struct.Struct("!I")
_PRE_AUTH_BYTES = 1024  # any message before the handshake is done
_MAX_MESSAGE_BYTES = 4 << 20  # an ok with NIXL metadata, a lookup answer with block ids, a long hold


@dataclasses.dataclass(frozen=True)
class NIXLConfig:
    secret: bytes | None = None
    allow_insecure: bool = False
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    request_timeout_s: float = 5.0  # a lookup or release answer
    pin_timeout_s: float = 30.0  # CTX: a pin's lease: GEN renews it while it may READ the blocks (every third of it)
    # GEN: the most one READ posted on the event loop may copy (on one host NIXL's transfer() copies
    # inline: 4 MiB ~120 µs here, each transfer() ~20 µs more): larger READs of whole blocks from such
    # a peer are posted in pieces of at most this, the loop's other work between them; other large
    # READs by the poller thread
    inline_copy_bytes: int = 4 << 20
    read_timeout_s: float = 60.0  # GEN: a READ still in progress this long gets its peer dropped (which ends it)
    close_timeout_s: float = 5.0  # GEN: aclose() waits this long for READs in flight (then drops their peers)
    max_unauthenticated: int = 64  # CTX: control connections still in their handshake; more are closed at once
    dead_peer_backoff_s: float = 1.0  # GEN: after a failed connect, pulls to that peer fail at once this long
    max_peers: int = 256  # GEN: distinct CTX peers connected (or connecting) at once
    max_pulls_per_connection: int = 256  # CTX: lookups and pins at once for one GEN connection (more: BUSY)
    progress_delay_us: int = 1000  # the NIXL progress thread's poll() timeout (0 spins a core)
    progress_thread: bool = True
    ucx_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _auth.check_config_secret("NIXLConfig", self.secret, self.allow_insecure)
        if self.inline_copy_bytes < 0:
            raise ValueError(f"NIXLConfig.inline_copy_bytes must be >= 0, got {self.inline_copy_bytes}")


def make_agent(name: str, config: NIXLConfig) -> Any:
    """A NIXL agent with the UCX backend whose progress thread sleeps ``progress_delay_us`` in poll().

    NIXL's Python ``nixl_agent`` hard-codes the thread's ``pthrDelay`` to 0, which the UCX backend
    passes to ``poll()`` as its timeout: the thread never sleeps (48 % of this machine's 2 cores at
    rest, measured). The binding's config is set by wrapping its constructor for this one call."""
    apply_ucx_defaults(dict(config.ucx_env))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    real = _nixl_api.nixlBind.nixlAgent

    def construct(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = int(config.progress_delay_us)
        return real(agent_name, cfg)

    _nixl_api.nixlBind.nixlAgent = construct
    try:
        return _nixl_api.nixl_agent(name, _nixl_api.nixl_agent_config(
            enable_prog_thread=config.progress_thread, backends=["UCX"],
            sync_mode=_nixl_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))  # READs are polled off the loop
    finally:
        _nixl_api.nixlBind.nixlAgent = real


def mem_type(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


def segments(layout: KVLayout, block_ids: Sequence[int], kv_slice: KVSlice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets (remote in the pool, local in the wire-form ``into``) and lengths of a slice of
    ``block_ids``, adjacent pieces merged: one piece per contiguous run of blocks for a full slice."""
    if kv_slice == layout.full_slice():  # whole blocks: one piece per run of consecutive ids, no numpy
        bb = layout.block_bytes
        r: list[int] = []
        lo: list[int] = []
        ln: list[int] = []
        prev = -2
        for i, b in enumerate(int(x) for x in block_ids):
            if b == prev + 1:
                ln[-1] += bb
            else:
                r.append(b * bb)
                lo.append(i * bb)
                ln.append(bb)
            prev = b
        return np.array(r, dtype=np.int64), np.array(lo, dtype=np.int64), np.array(ln, dtype=np.int64)
    e = layout.element_size
    heads, tokens = layout.num_kv_heads, layout.block_size * layout.head_dim
    block_bytes = layout.block_bytes
    nl, nh = kv_slice.num_layers, kv_slice.num_heads
    seg = nh * tokens * e
    wire_block = nl * 2 * nh * tokens * e
    lk = np.arange(nl * 2)  # (layer, k/v) pairs of the slice, in wire order
    within_remote = ((kv_slice.layer_start * 2 + lk) * heads + kv_slice.head_start) * tokens * e
    within_local = lk * seg
    ids = np.asarray(block_ids, dtype=np.int64)
    remote = (ids[:, None] * block_bytes + within_remote[None, :]).ravel()
    local = (np.arange(len(ids))[:, None] * wire_block + within_local[None, :]).ravel()
    if remote.size == 0:
        return remote, local, remote.copy()
    starts = np.flatnonzero(np.r_[True, (np.diff(remote) != seg) | (np.diff(local) != seg)])
    lengths = np.diff(np.r_[starts, remote.size]) * seg
    return remote[starts], local[starts], lengths


# -- framing: 4-byte length, then one JSON object ---------------------------------------------------


async def read_msg(reader: asyncio.StreamReader, limit: int) -> dict[str, Any]:
    (n,) = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    if n > limit:
        raise ProtocolViolation(f"message of {n} bytes exceeds {limit}")
    return parse_msg(await reader.readexactly(n))


def parse_msg(body: bytes) -> dict[str, Any]:
    """One message's JSON body: an object with a string ``t``, else ``ProtocolViolation``."""
    try:
        msg = json.loads(body)
    except ValueError as exc:
        raise ProtocolViolation(f"malformed message: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolViolation("malformed message: not an object with a type")
    return msg


def write_msg(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    writer.write(_HEAD.pack(len(body)) + body)


def layout_info(layout: KVLayout) -> dict[str, Any]:
    return {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "block_size": layout.block_size, "dtype": dtype_name(layout.dtype)}
