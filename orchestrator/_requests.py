"""Requests, their states, and the outcomes that cross between threads.

Life cycle of a GEN request (``Sequence`` is the engine's record of one)::

    submit ─> WAITING ──admit (budget, then KV)──> RECEIVING ──Completed──> READY ──slot──> RUNNING ──> FINISHED
                 │  deferred: BACKPRESSURE | KV_EXHAUSTED    │ Failed(reason)       │ abort         │ abort
                 │ abort                                     ▼                      ▼               ▼
                 └──────────────────────────────────────> FAILED / ABORTED <──────────────────────┘

READY requests have their KV and wait for a decode slot (``max_num_seqs`` bounds RUNNING only), so
a freed slot is filled at once, without waiting for a pull. ``IDEAL`` mode skips RECEIVING (KV is
present at admission).
"""

from __future__ import annotations

import dataclasses
import enum
import typing

import torch

from transports import KVLayout, KVSlice, Landing

from ._budget import Grant
from ._sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"
    READY = "ready"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.ABORTED)

    def __repr__(self) -> str:
        return f"RequestState.{self.name}"


class DeferReason(enum.Enum):
    """Why an admissible-looking request stayed WAITING this step."""

    BACKPRESSURE = "backpressure"  # the transfer budget is full (or an earlier request waits on it)
    KV_EXHAUSTED = "kv_exhausted"  # the KV pool has too few free blocks for it

    def __repr__(self) -> str:
        return f"DeferReason.{self.name}"


class FailureReason(enum.Enum):
    TIMEOUT = "timeout"  # kv_transfer_timeout_ms passed
    PEER_ERROR = "peer_error"  # unreachable, connection closed, endpoint error
    UNKNOWN_REQUEST = "unknown_request"  # the peer holds no KV for this id (released, lease expired)
    PROTOCOL_ERROR = "protocol_error"  # the peer broke the wire protocol
    AUTH_ERROR = "auth_error"  # authentication with the peer failed
    ABORTED = "aborted"  # the request was aborted (client cancel) or the node is shutting down
    INTERNAL = "internal"  # a bug; logged with its traceback

    def __repr__(self) -> str:
        return f"FailureReason.{self.name}"


@dataclasses.dataclass(frozen=True)
class KVSource:
    """Where some of a request's KV heads are held: one CTX rank's transport address, the model-wide
    KV heads ``[head_start, head_end)`` it holds (``head_end`` None: every head from ``head_start``),
    and the handle it issued (None: the request's ``kv_handle``).

    A CTX running tensor-parallel holds each KV head on one rank (or a few, when heads are
    replicated); a GEN rank pulls each of its heads from one source that holds it (fan-in)."""

    peer: str
    head_start: int = 0
    head_end: int | None = None
    kv_handle: str | None = None
    kv_blocks: tuple[int, ...] | None = None
    """Its block ids of the request (None: the request's ``kv_blocks``, if any): a one-sided
    transport reads them without asking for them first."""
    kv_epoch: int | None = None
    """Its store's epoch before it put the request (``KVStore.epoch``; None: the request's ``kv_epoch``,
    if any): with it, a one-sided transport may READ those blocks without pinning them first."""

    def covers(self, head: int) -> bool:
        return self.head_start <= head and (self.head_end is None or head < self.head_end)


def plan_sources(sources: tuple[KVSource, ...], head_start: int, head_end: int) -> list[tuple[KVSource, int, int]]:
    """Which source serves which of the heads ``[head_start, head_end)``: ``(source, h0, h1)`` runs in
    head order, each head from the first source that holds it. Raises ValueError naming the first
    head no source holds."""
    runs: list[tuple[KVSource, int, int]] = []
    for head in range(head_start, head_end):
        src = next((s for s in sources if s.covers(head)), None)
        if src is None:
            raise ValueError(f"no KV source holds KV head {head} (sources: "
                             + ", ".join(f"{s.peer} heads {s.head_start}:{'' if s.head_end is None else s.head_end}"
                                         for s in sources) + ")")
        if runs and runs[-1][0] is src and runs[-1][2] == head:
            runs[-1] = (src, runs[-1][1], head + 1)
        else:
            runs.append((src, head, head + 1))
    return runs


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """A request whose prompt was prefilled on ``peer`` (a CTX node) and is to be decoded here.

    ``first_token`` is the token the CTX prefill produced (at position ``prompt_len``);
    ``max_tokens`` counts output tokens including that first one. A CTX that runs tensor-parallel
    holds the KV heads on several ranks: ``kv_sources`` then names each of them (and ``peer`` may be
    left out); a GEN rank pulls each of its heads from a source that holds it.
    """

    request_id: str
    prompt_len: int
    first_token: int
    max_tokens: int
    peer: str | None = None
    kv_handle: str | None = None
    """The handle the CTX node issued with the prefill (``KVStore.put``); presented to pull/release."""
    kv_slice: KVSlice | None = None
    eos_token: int | None = None
    local_kv: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    """``IDEAL`` mode only: the prompt's KV in wire form, copied in at admission if given."""
    kv_sources: tuple[KVSource, ...] = ()
    """The CTX ranks holding the KV (tensor-parallel CTX); empty: ``peer`` holds every head."""
    sampling: SamplingParams | None = None
    """How the model draws this request's tokens (None: greedy). It reaches every rank of a
    tensor-parallel group with the request, so every rank draws the same token from the same
    logits (rank 0's is the group's; the step's batch digest checks they agree)."""
    kv_blocks: tuple[int, ...] | None = None
    """The CTX's block ids holding the prompt's KV, in order, when its prefill reply named them
    (vLLM's ``remote_block_ids``): a one-sided (NIXL) pull then needs no lookup round trip."""
    kv_epoch: int | None = None
    """The CTX store's epoch before it put the request (``KVStore.epoch``), when its prefill reply named
    it: a one-sided (NIXL) pull of ``kv_blocks`` then needs no pin (``KVStore.revocations``)."""

    def _filled(self, s: KVSource) -> KVSource:
        handle = s.kv_handle if s.kv_handle is not None else self.kv_handle
        blocks = s.kv_blocks if s.kv_blocks is not None else self.kv_blocks
        epoch = s.kv_epoch if s.kv_epoch is not None else self.kv_epoch
        if (handle, blocks, epoch) == (s.kv_handle, s.kv_blocks, s.kv_epoch):
            return s
        return dataclasses.replace(s, kv_handle=handle, kv_blocks=blocks, kv_epoch=epoch)

    def sources(self) -> tuple[KVSource, ...]:
        """Every source of this request's KV, each with its handle filled in."""
        if self.kv_sources:
            return tuple(self._filled(s) for s in self.kv_sources)
        return (KVSource(self.peer, 0, None, self.kv_handle, self.kv_blocks, self.kv_epoch),) if self.peer else ()


@dataclasses.dataclass(frozen=True)
class ReceiveResult:
    """The outcome of one receive, pushed by the event loop, drained by the execution thread."""

    request_id: str
    peer: str | None
    bytes_moved: int
    elapsed_s: float
    failure: FailureReason | None = None
    message: str = ""
    landing: Landing | None = dataclasses.field(default=None, compare=False)
    """Set when the transport may still write into the request's blocks (a receive it could not
    withdraw): the blocks stay quarantined until ``landing`` is idle."""

    @property
    def ok(self) -> bool:
        return self.failure is None


class RequestOutput(typing.NamedTuple):
    """What the engine emits: new tokens of a request, and its state once it ends.

    Immutable; a named tuple, not a frozen dataclass: one is built per token (a step of the
    public case's batch builds ~70), and a frozen dataclass took ~3x as long to build."""

    request_id: str
    new_tokens: tuple[int, ...]
    state: RequestState
    failure: FailureReason | None = None
    message: str = ""

    @property
    def finished(self) -> bool:
        return self.state.terminal


def kv_blocks_needed(layout: KVLayout, prompt_len: int, max_tokens: int) -> int:
    """KV blocks a request holds: one KV row per token whose KV is ever written, the prompt's and
    every output token's but the last. Decode writes a token's KV when it is fed back (at position
    ``prompt_len + num_tokens - 1``, ``RunningBatch.positions``); the last token is only sampled."""
    return layout.blocks_for(prompt_len + max_tokens - 1)


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    """The engine's record of one request (owned by the execution thread)."""

    request: GenRequest
    arrival: float
    num_blocks: int
    """KV blocks reserved at admission: prompt plus every output token (no preemption later)."""
    num_prompt_blocks: int
    cost: int
    """Bytes of its KV that pass through staging: the budget's one cost function."""
    seq_no: int = 0
    """The group's number for it, given at arrival (the same on every rank; ids never cross the
    step exchange again)."""
    state: RequestState = RequestState.WAITING
    block_ids: torch.Tensor | None = None
    grant: Grant | None = None
    """Its budget tokens while it receives: the engine releases them at the agreed step."""
    num_tokens: int = 1
    """Tokens it has, the CTX's first token included (while RUNNING: its ``RunningBatch`` column)."""
    last_token: int = 0
    """Its newest token: the next decode step's input (while RUNNING: its ``RunningBatch`` column)."""
    last_defer: DeferReason | None = None
    abort_requested: bool = False
    reported: int = 0
    """Bit r: rank r's receive of it ended (an outcome was agreed)."""
    quiet: int = 0
    """Bit r: nothing writes into rank r's blocks of it any more."""
    failure: tuple[FailureReason, str] | None = None
    """The first failure a rank reported (in rank order)."""
    cancelled: bool = False
    """This rank asked its receive to stop."""
    told: bool = False
    """Rank 0 told the CTXs holding its KV that they may free it (once every rank's blocks were quiet)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id
