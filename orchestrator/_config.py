"""Configuration: one frozen dataclass, knobs named as the field names them."""

from __future__ import annotations

import dataclasses
import enum

from transports import KVLayout, KVSlice


KV_TRANSPORTS = ("ucx", "nixl")
"""The names ``OrchestratorConfig.kv_transport`` accepts."""


class Mode(enum.Enum):
    """How the GEN node sets up receives."""

    ORCHESTRATED = "orchestrated"  # this design: early budget, receive setup on the event loop
    INLINE = "inline"  # the original path (baseline): setup on the execution thread, blocking reserve
    IDEAL = "ideal"  # no transfer at all: KV is present at admission (the ceiling, for benchmarks)

    def __repr__(self) -> str:
        return f"Mode.{self.name}"


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    layout: KVLayout
    num_blocks: int
    """KV blocks in the GEN pool."""
    transfer_budget_bytes: int
    """The transfer budget: bytes of receives in flight (``max_tokens_in_buffer`` expressed in bytes)."""
    mode: Mode = Mode.ORCHESTRATED
    kv_transfer_timeout_ms: int = 60_000
    """A receive that has not completed within this time fails with reason TIMEOUT."""
    max_num_seqs: int = 256
    """Most requests decoding at once (the decode batch)."""
    max_prefetch_seqs: int | None = None
    """Most requests holding KV without decoding (RECEIVING + READY): receives run ahead of the
    decode batch so that a freed slot is filled at once. None: as many as ``max_num_seqs``.
    ``inline`` mode has no prefetch: there RECEIVING + RUNNING share ``max_num_seqs``."""
    max_model_len: int = 1 << 16
    """Longest prompt + output a request may ask for."""
    kv_hold_interval_s: float = 10.0
    """How often the engine asks each CTX node to renew the leases of requests still WAITING here, so
    that a request admitted late still finds its KV (keep it well below the CTX's ``--lease-s``,
    30 s by default; a pull also renews the lease when it starts)."""
    inline_reserve_timeout_s: float = 0.2
    """``inline`` mode only: how long the execution thread waits for staging before the slow fallback."""
    max_blocking_wait_s: float | None = None
    """Longest blocking wait the execution thread may make (``inline`` mode's reserve and peer
    handshake). A tensor-parallel node sets it below its step timeout, so that a rank blocked in a
    wait never looks dead to its group. None: bounded by ``kv_transfer_timeout_ms`` alone."""
    kv_head_offset: int = 0
    """Tensor parallelism: the model-wide index of this rank's first KV head. The pool holds
    ``layout.num_kv_heads`` heads from there; requests pull that head range from their CTX."""
    device: str = "cpu"
    kv_transport: str = "ucx"
    """The KV data plane the node builds its transport with: ``ucx`` (ucxx tag messages; the default:
    fastest over TCP, measured in docs/transport.md) or ``nixl`` (one-sided NIXL READ; for shared
    memory, cma, RDMA). Only a name here: the orchestrator never imports either library."""
    debug_poison_freed_blocks: bool = False
    """Fill every freed KV block with NaN, so that a read of a freed block cannot go unnoticed."""

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.transfer_budget_bytes <= 0 or self.max_num_seqs <= 0:
            raise ValueError("num_blocks, transfer_budget_bytes and max_num_seqs must be positive")
        if self.kv_transfer_timeout_ms <= 0:
            raise ValueError("kv_transfer_timeout_ms must be positive")
        if self.kv_head_offset < 0:
            raise ValueError("kv_head_offset must be >= 0")
        if self.kv_hold_interval_s <= 0:
            raise ValueError("kv_hold_interval_s must be positive")
        if self.max_prefetch_seqs is not None and self.max_prefetch_seqs < 1:
            raise ValueError("max_prefetch_seqs must be >= 1")
        if self.max_blocking_wait_s is not None and not 0 < self.inline_reserve_timeout_s <= self.max_blocking_wait_s:
            raise ValueError("max_blocking_wait_s must be positive and at least inline_reserve_timeout_s")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, not {self.kv_transport!r}")

    @property
    def kv_slice(self) -> KVSlice:
        """What a request pulls by default: every layer of this rank's KV heads (model numbering)."""
        off = self.kv_head_offset
        return KVSlice(0, self.layout.num_layers, off, off + self.layout.num_kv_heads)

    @property
    def prefetch_seqs(self) -> int:
        return self.max_num_seqs if self.max_prefetch_seqs is None else self.max_prefetch_seqs

    @staticmethod
    def transfer_budget_for_tokens(layout: KVLayout, max_tokens_in_buffer: int) -> int:
        """The byte budget that holds ``max_tokens_in_buffer`` tokens' KV (whole blocks)."""
        return layout.blocks_for(max_tokens_in_buffer) * layout.block_bytes
