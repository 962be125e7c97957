"""Configuration: one frozen dataclass, knobs named as the field names them."""

from __future__ import annotations

import dataclasses
import enum
import math

from transports import KVLayout, KVSlice


KV_TRANSPORTS = ("ucx", "nixl")
"""The names ``OrchestratorConfig.kv_transport`` accepts."""

MAX_MODEL_LEN = 1 << 31
"""``max_model_len`` is below this: a request's lengths cross the tensor-parallel step exchange as u4."""


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    """An int knob (not a bool, not a float that happens to be whole) in ``[low, high)``."""
    if type(value) is not int or value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _seconds(name: str, value: object, *, zero: bool = False) -> None:
    """A duration knob: a finite real number, > 0 (>= 0 where ``zero``: no wait at all)."""
    if (type(value) not in (int, float) or not math.isfinite(value)  # type: ignore[arg-type]
            or value < 0 or (value == 0 and not zero)):
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}")


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
    """How receives are set up. Its value as a str (``"orchestrated"``) is taken too: it becomes the
    ``Mode`` here, so that every ``config.mode is Mode.X`` holds."""
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
    total_kv_heads: int | None = None
    """Tensor parallelism: the model's KV heads, every rank's together. Set, ``submit`` refuses a
    request whose sources leave one of them unheld (each rank's heads, not only this rank's);
    None: only this rank's are checked there, and a rank whose heads no source holds fails the
    request on every rank after it took budget and blocks."""
    device: str = "cpu"
    kv_transport: str = "ucx"
    """The KV data plane the node builds its transport with: ``ucx`` (ucxx tag messages; the default:
    fastest over TCP, measured in docs/transport.md) or ``nixl`` (one-sided NIXL READ; for shared
    memory, cma, RDMA). Only a name here: the orchestrator never imports either library."""
    debug_poison_freed_blocks: bool = False
    """Fill every freed KV block with NaN, so that a read of a freed block cannot go unnoticed."""

    def __post_init__(self) -> None:
        # every knob is checked by type and range: NaN passes any `<=` check, and a float or a str
        # where an int goes fails (or hangs) far from here
        try:
            mode = Mode(self.mode)  # a Mode, or its name as a str ("orchestrated"): `is Mode.X` holds
        except ValueError:
            names = ", ".join(m.value for m in Mode)
            raise ValueError(f"mode must be a Mode or one of {names}, not {self.mode!r}") from None
        object.__setattr__(self, "mode", mode)
        _int("num_blocks", self.num_blocks, 1)
        _int("transfer_budget_bytes", self.transfer_budget_bytes, 1)
        _int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_prefetch_seqs is not None:
            _int("max_prefetch_seqs", self.max_prefetch_seqs, 1)
        _int("max_model_len", self.max_model_len, 2, MAX_MODEL_LEN)  # a prompt token and an output token
        _int("kv_head_offset", self.kv_head_offset, 0)
        if self.total_kv_heads is not None:
            _int("total_kv_heads", self.total_kv_heads, 1)
            if self.kv_head_offset + self.layout.num_kv_heads > self.total_kv_heads:
                raise ValueError(f"this rank's KV heads ({self.kv_head_offset}:"
                                 f"{self.kv_head_offset + self.layout.num_kv_heads}) are not among the model's "
                                 f"total_kv_heads ({self.total_kv_heads})")
        _seconds("kv_transfer_timeout_ms", self.kv_transfer_timeout_ms)
        _seconds("kv_hold_interval_s", self.kv_hold_interval_s)
        _seconds("inline_reserve_timeout_s", self.inline_reserve_timeout_s, zero=True)
        if self.max_blocking_wait_s is not None:
            _seconds("max_blocking_wait_s", self.max_blocking_wait_s)
            if self.inline_reserve_timeout_s > self.max_blocking_wait_s or self.inline_reserve_timeout_s == 0:
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
