"""What the replay models, with every parameter, its default and where the default comes from.

    decode step      step_s(batch) = step_base_ms + step_per_seq_us x batch   (a virtual sleep per
                     engine step, after the step's own decisions, which take no virtual time)
    CTX prefill      ctx_prefill_slots servers in FIFO, each prefill = ctx_prefill_base_ms +
                     ctx_prefill_ms_per_ktok x ISL / 1000
    link             one per (CTX, GEN rank): latency + bytes / bandwidth, the bandwidth shared
                     equally by the transfers on it, at most link_concurrency at once (FIFO beyond)
    CTX egress       one NIC per CTX rank (CTX TP1: one), ctx_nic_gbyte_s, crossed by every GEN
                     rank's pulls: a transfer runs at the smaller of its two fair shares
    KV geometry      layers x KV heads x head dim x dtype, paged in blocks of block_size tokens;
                     each GEN rank holds and pulls num_kv_heads / gen_tp heads
    budget           max_tokens_in_buffer tokens of KV per rank (OrchestratorConfig.transfer_budget_for_tokens)
    client           closed loop at ``concurrency``: warmup requests, then ``requests`` measured

``ModelledTransport`` is the link as a ``transports.Transport``: it plugs in where ``transports.ucx``
or ``transports.inproc`` plug in, and moves no data (the KV pool lives on torch's ``meta`` device:
shapes and byte counts, no memory), so a replay at the public case's geometry fits in this machine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import torch
import trio

from transports import KVLayout, KVSlice, Landing, PeerUnreachable
from transports._layout import dtype_from_name

CTX_PEER = "ctx0:5000"

# -- the public case (../shared/seeds/): figures every preset is judged against ----------------------
SEED = {
    "v1_output_tok_s": 16084.10, "v1_tpot_ms": 4.464,
    "orig_v2_output_tok_s": 12559.23, "orig_v2_vs_v1": -0.2192, "orig_v2_tpot_ms": 18.312,
    "patched_v1_output_tok_s": 16066.51, "patched_v1_tpot_ms": 4.472,
    "patched_v2_output_tok_s": 15880.01, "patched_v2_vs_v1": -0.0116, "patched_v2_tpot_ms": 4.932,
}

MAX_REQUESTS = 1 << 22
"""warmup + requests at most (4,194,304: 205x the public case's, hours of replay): a replay keeps a
record per request, and a billion of them took the machine's memory before it started."""

IDLE_POLL_MIN_MS = 0.1
"""Below this an idle wait costs too many empty engine steps (a receive's 60 s timeout: 600,000)."""

_STEP_SLOPE_US = (4.581 - 4.337) / (80 - 72) * 1e3  # 30.5 us per sequence
_STEP_BASE_MS = 4.337 - 72 * _STEP_SLOPE_US / 1e3  # 2.141 ms


@dataclasses.dataclass(frozen=True)
class SimParams:
    # KV geometry (GPT-OSS 120B model card / config.json)
    num_layers: int = 36
    num_kv_heads: int = 8
    head_dim: int = 64
    kv_dtype: str = "bfloat16"
    block_size: int = 32
    # load (the seed)
    isl: int = 8192
    osl: int = 1024
    isl_choices: tuple[int, ...] = ()
    """Prompt lengths drawn per request (seeded); empty: every prompt is ``isl`` tokens."""
    concurrency: int = 1024
    warmup: int = 10240
    requests: int = 10240
    gen_tp: int = 4
    # timing models
    step_base_ms: float = round(_STEP_BASE_MS, 4)
    step_per_seq_us: float = round(_STEP_SLOPE_US, 3)
    ctx_prefill_base_ms: float = 0.0
    ctx_prefill_ms_per_ktok: float = round(1024 / SEED["v1_output_tok_s"] * 1e3 / 8.192, 4)
    ctx_prefill_slots: int = 1
    link_gbyte_s: float = 50.0
    ctx_nic_gbyte_s: float | None = None
    """The CTX rank's egress, shared by the pulls of every GEN rank; None: one NIC as fast as a GEN
    rank's link (``link_gbyte_s``)."""
    link_latency_us: float = 10.0
    link_concurrency: int = 4
    link_burst_bytes: int = 0
    """A shaped link's token bucket (``tc ... tbf burst``): bytes a transfer that starts on an idle
    link sends at once, refilled at the link's bandwidth while it carries nothing; 0: none."""
    connect_ms: float = 1.0
    host_us_per_pull: float = 0.0
    """GEN host CPU per pull that the execution thread loses: added to the decode step after the
    pull ends (the step of the rank that pulled; a group step waits for its slowest rank). On one
    Python interpreter the pull's own Python and the transport's threads compete with the step's;
    0: not modelled."""
    # the orchestrator's knobs
    max_tokens_in_buffer: int = 8192
    max_num_seqs: int = 256
    max_prefetch_seqs: int | None = None
    inline_reserve_timeout_s: float = 0.2
    kv_transfer_timeout_ms: int = 60_000
    kv_pool_requests: int | None = None
    """GEN KV pool per rank, in requests of the longest prompt + OSL; None: max_num_seqs + prefetch."""
    # what-if
    pipelined: bool = False
    """Layer-wise pipelined transfer: GEN may pull layer i once CTX has prefilled it (see ``ModelledTransport``)."""
    iterations_per_step: int = 1
    """Device iterations one engine step stands for (its model time is that many step times; a
    request then needs ceil((osl - 1) / k) engine steps, so it decodes ceil((osl - 1) / k) x k
    iterations, up to k - 1 more than osl - 1: ``decode_iterations_per_request``). 1 is exact; larger trades admission
    granularity for speed and is sound only while one engine step stays shorter than the CTX's
    time between two first tokens (the output reports the most admissions seen in one step)."""
    idle_poll_ms: float = 50.0
    """The longest an idle execution loop sleeps without a wakeup: ``DecodeLoop``'s ``idle_wait_s``
    (50 ms). A submission or any receive's end (failed or not) wakes it at once, so where nothing
    else happens this changes no result, only how many empty steps a long idle wait costs."""
    seed: int = 0

    # -- derived ---------------------------------------------------------------------------------
    def step_s(self, batch: int) -> float:
        return (self.step_base_ms + self.step_per_seq_us * batch / 1e3) / 1e3

    def engine_max_tokens(self) -> int:
        """``max_tokens`` given to the engine: the CTX's token plus ceil((osl - 1) / k) decode steps."""
        k = self.iterations_per_step
        return 1 + -(-(self.osl - 1) // k)

    def prefill_s(self, isl: int) -> float:
        return (self.ctx_prefill_base_ms + self.ctx_prefill_ms_per_ktok * isl / 1e3) / 1e3

    def transfer_s(self, isl: int) -> float:
        """One request's transfer alone on the links: a GEN rank's slice over its link, or every
        rank's slices over the CTX's egress, whichever takes longer."""
        rank = self.rank_bytes(isl)
        return max(rank / (self.link_gbyte_s * 1e9), rank * self.gen_tp / self.ctx_nic_bytes_s())

    def rank_bytes(self, isl: int) -> int:
        """What one GEN rank pulls of an ``isl``-token prompt: whole blocks of its heads (the last
        block's unused tokens too, as the pulls move them)."""
        layout = self.rank_layout()
        return layout.blocks_for(isl) * layout.block_bytes

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.gen_tp

    def rank_layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.heads_per_rank, self.head_dim, self.block_size, dtype_from_name(self.kv_dtype))

    def kv_bytes_per_token(self) -> int:
        """Whole model (all KV heads), K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype_from_name(self.kv_dtype)).element_size()

    def prompt_lengths(self) -> list[int]:
        import random

        n = self.warmup + self.requests
        if not self.isl_choices:
            return [self.isl] * n
        rng = random.Random(self.seed)
        return [rng.choice(self.isl_choices) for _ in range(n)]

    def ctx_nic_bytes_s(self) -> float:
        return (self.link_gbyte_s if self.ctx_nic_gbyte_s is None else self.ctx_nic_gbyte_s) * 1e9

    def check(self) -> None:
        """Raise ``ValueError`` naming the first parameter a replay cannot run with (one that would
        hang it, divide by zero or mean nothing)."""
        if self.iterations_per_step > max(1, self.osl - 1):
            raise ValueError(f"iterations_per_step must be <= osl - 1 = {max(1, self.osl - 1)}, the iterations a request "
                             f"decodes (more would decode each request {self.iterations_per_step} iterations and credit "
                             f"it {self.osl} tokens), got {self.iterations_per_step}")
        if self.link_burst_bytes and self.gen_tp > 1:
            raise ValueError("link_burst_bytes (a shaped link's token bucket) is modelled on a GEN rank's own link: "
                             f"at GEN TP {self.gen_tp} each rank would have a bucket of its own, where one shaped "
                             "CTX link has one; use it at gen_tp 1")
        if self.num_kv_heads % self.gen_tp:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split over GEN TP {self.gen_tp}")
        if min(self.concurrency, self.requests, self.osl, self.iterations_per_step) < 1 or self.warmup < 0:
            raise ValueError("concurrency, requests and osl must be >= 1, warmup >= 0")
        if self.warmup + self.requests > MAX_REQUESTS:
            raise ValueError(f"warmup + requests must be <= {MAX_REQUESTS:,} (a replay keeps a record of each), "
                             f"got {self.warmup + self.requests:,}")
        at_least_one = ("num_layers", "num_kv_heads", "head_dim", "block_size", "isl", "gen_tp", "ctx_prefill_slots",
                        "link_concurrency", "max_tokens_in_buffer", "max_num_seqs", "kv_transfer_timeout_ms")
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prefetch_seqs", "kv_pool_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if any(n < 1 for n in self.isl_choices):
            raise ValueError(f"isl_choices must all be >= 1, got {self.isl_choices}")
        if not self.idle_poll_ms >= IDLE_POLL_MIN_MS:  # (NaN too)
            raise ValueError(f"idle_poll_ms must be >= {IDLE_POLL_MIN_MS} ms (an idle loop steps once per idle_poll_ms "
                             f"of virtual time: below that a {self.kv_transfer_timeout_ms / 1e3:g} s receive timeout "
                             f"costs millions of empty steps), got {self.idle_poll_ms}")
        positive = ["link_gbyte_s", "idle_poll_ms"] + ([] if self.ctx_nic_gbyte_s is None else ["ctx_nic_gbyte_s"])
        non_negative = ("step_base_ms", "step_per_seq_us", "ctx_prefill_base_ms", "ctx_prefill_ms_per_ktok",
                        "link_latency_us", "connect_ms", "host_us_per_pull", "inline_reserve_timeout_s", "link_burst_bytes")
        for name in (*positive, *non_negative):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (v == 0 and name in positive):
                raise ValueError(f"{name} must be a finite number {'> 0' if name in positive else '>= 0'}, got {v}")

    def coarse_step_warning(self, mean_batch: float) -> str | None:
        """A warning when ``iterations_per_step`` > 1 distorts the result: a finished receive's grant
        comes back at the next engine step, up to one (coarse) step late, so while one transfer plus
        one engine step is not shorter than the time between two CTX first tokens the next
        reservation finds the budget still held (docs/sim.md, "Exactness of iterations_per_step")."""
        k = self.iterations_per_step
        if k == 1:
            return None
        lengths = self.isl_choices or (self.isl,)
        step = k * self.step_s(max(1, round(mean_batch)))
        transfer = self.transfer_s(max(lengths))
        between = sum(self.prefill_s(n) for n in lengths) / len(lengths) / self.ctx_prefill_slots
        if transfer + step < between:
            return None
        return (f"WARNING: iterations_per_step {k}: a transfer ({transfer * 1e3:.1f} ms) + one engine step "
                f"({step * 1e3:.1f} ms at batch {mean_batch:.0f}) is not shorter than the {between * 1e3:.1f} ms between "
                f"two CTX first tokens; a finished receive's grant comes back up to one engine step late, so the "
                f"modes that pull are distorted (inline most): rerun with --set iterations_per_step=1 (exact)")

    def describe(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["derived"] = {
            "kv_bytes_per_token_model": self.kv_bytes_per_token(),
            "kv_bytes_per_request_per_rank": self.rank_bytes(max(self.isl_choices or (self.isl,))),
            "transfer_s_per_request_per_rank": self.transfer_s(max(self.isl_choices or (self.isl,))),
            "ctx_nic_gbyte_s": self.ctx_nic_bytes_s() / 1e9,
            "step_ms_at_72": round(self.step_s(72) * 1e3, 4),
            "step_ms_at_80": round(self.step_s(80) * 1e3, 4),
            "prefill_ms_at_isl": round(self.prefill_s(self.isl) * 1e3, 3),
            "decode_iterations_per_request": (self.engine_max_tokens() - 1) * self.iterations_per_step,
        }
        return d


SOURCES = {
    "num_layers": "GPT-OSS 120B model card / config.json: num_hidden_layers 36",
    "num_kv_heads": "config.json: num_key_value_heads 8 (GQA, 64 query heads)",
    "head_dim": "config.json: head_dim 64",
    "kv_dtype": "ASSUMED bf16 KV cache (the seed gives FP4 weights, not the KV dtype; FP8 KV halves every transfer)",
    "block_size": "ASSUMED 32 tokens per block (TensorRT-LLM's default tokens_per_block)",
    "isl": "seed: ISL 8192", "osl": "seed: OSL 1024", "concurrency": "seed: concurrency 1024",
    "warmup": "seed: 10,240 warm-up requests", "requests": "seed: 10,240 measured requests",
    "gen_tp": "seed: CTX TP1 -> GEN TP4",
    "step_base_ms": "seed: line through 4.337 ms @ batch 72 and 4.581 ms @ batch 80 (two kernel configs, per the seed)",
    "step_per_seq_us": "seed: slope of the same line",
    "ctx_prefill_ms_per_ktok": "FITTED: one CTX prefill of 8192 tokens = OSL / V1 throughput = 1024 / 16,084 s "
                               "(V1 was CTX-bound: GEN batch ~72 = 16,084 tok/s x 4.464 ms)",
    "ctx_prefill_slots": "ASSUMED: one prefill at a time on CTX TP1",
    "link_gbyte_s": "ASSUMED 50 GB/s per GEN rank (one 400 Gb/s NIC per GB200 GPU); the sweep varies it",
    "ctx_nic_gbyte_s": "ASSUMED one 400 Gb/s NIC per CTX GPU, as on GEN (None: = link_gbyte_s); CTX TP1 sends every "
                       "GEN rank's heads through it, so GEN TP does not multiply the CTX's egress",
    "idle_poll_ms": "DecodeLoop's idle_wait_s (50 ms): an idle execution loop wakes at once at a submission or a "
                    "receive's end (failed or not), else after this",
    "link_latency_us": "ASSUMED", "link_concurrency": "ASSUMED", "connect_ms": "ASSUMED (first connect per peer only)",
    "link_burst_bytes": "0: a NIC's link has no token bucket (the check's shaped veth link has tbf's)",
    "host_us_per_pull": "NOT MODELLED (0): no public figure for the host time a pull takes from TensorRT-LLM's "
                        "execution thread",
    "max_tokens_in_buffer": "ASSUMED = ISL (one request in flight per rank; this project's GEN default 8192)",
    "max_num_seqs": "ASSUMED 256: the original V2's mean batch was ~230 (12,559 tok/s x 18.3 ms), so the cap is above it",
    "iterations_per_step": "SPEED: 8 device iterations per engine step (35 ms < the 63.7 ms between two CTX first "
                           "tokens); docs/sim.md compares it with 1 (exact). A request decodes ceil((osl - 1) / k) x k iterations "
                           "(OSL 1024, k 8: 1,024 for 1,023)",
    "inline_reserve_timeout_s": "the inline path's blocking reservation timeout (0.2 s), then a slow fallback",
}


def public_case() -> SimParams:
    return SimParams(iterations_per_step=8)


def sources_of(p: SimParams, preset: str, set_names: Collection[str] = ()) -> dict[str, str]:
    """Each parameter's source for ``p``: ``SOURCES`` (which describe the public case's figures)
    where its value is the public case's, else what set it (``--set``, or the preset), with the
    public case's value beside it."""
    public = public_case()
    out = {}
    for f in dataclasses.fields(SimParams):
        value, theirs = getattr(p, f.name), getattr(public, f.name)
        if value == theirs:
            out[f.name] = SOURCES.get(f.name, "")
        else:
            by = "--set" if f.name in set_names else f"the {preset} preset"
            out[f.name] = f"{by} (public case: {theirs})"
    return out


def tiny(**overrides: object) -> SimParams:
    """Seconds in CI: two-layer toy geometry, a mix of prompt lengths, one of them above the budget."""
    base = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=8, isl=48, osl=16, isl_choices=(24, 48, 160),
                concurrency=16, warmup=16, requests=48, gen_tp=1, max_tokens_in_buffer=64, max_num_seqs=8,
                ctx_prefill_ms_per_ktok=20.0, step_base_ms=4.0, step_per_seq_us=50.0,
                link_gbyte_s=0.0005, link_latency_us=100.0, link_concurrency=2, connect_ms=0.5)
    base.update(overrides)
    return SimParams(**base)  # type: ignore[arg-type]


PRESETS = {"public-case": public_case, "tiny": tiny}


class _Flow:
    __slots__ = ("remaining", "rate", "links", "scope")

    def __init__(self, nbytes: float, links: tuple[ModelledLink, ...]) -> None:
        self.remaining = nbytes
        self.rate = 0.0
        self.links = links
        self.scope: trio.CancelScope | None = None


class _Fabric:
    """The transfers in flight over a set of links that share some of them (the GEN ranks' links
    and the CTX's egress): each runs at the smallest fair share (bandwidth / transfers) among the
    links it crosses, recomputed whenever one starts or ends. (Not max-min fair: a share a transfer
    cannot use on one link is not handed to the others on it.)"""

    def __init__(self) -> None:
        self.flows: list[_Flow] = []
        self._last = 0.0

    def advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            for flow in self.flows:
                flow.remaining -= dt * flow.rate
        self._last = now

    def reschedule(self, now: float) -> None:
        for flow in self.flows:
            flow.rate = min(link.bandwidth / link.active for link in flow.links)
            if flow.scope is not None:
                flow.scope.deadline = now + max(0.0, flow.remaining) / flow.rate


class ModelledLink:
    """Transfers on one link: each waits for one of ``concurrency`` slots (FIFO), then ``latency``,
    then its bytes flow at ``bandwidth / n`` while ``n`` transfers share the link (processor sharing).
    A transfer may also cross other links of the same fabric (``via``: the CTX's egress), and then
    runs at the smallest of its fair shares (``_Fabric``).

    A transfer ends at the deadline its rate gives it (not when its remaining bytes reach zero), so
    a duration below the clock's float resolution still ends, at once.

    ``burst_bytes``: a token bucket of that depth (a ``tbf`` qdisc's burst). It fills at
    ``bandwidth`` while no bytes flow on the link; a transfer whose bytes start flowing on an idle
    link sends what the bucket holds at once (while bytes flow, the bucket stays empty: the queue
    takes each token as it comes)."""

    def __init__(self, bandwidth_bytes_s: float, latency_s: float, concurrency: int,
                 fabric: _Fabric | None = None, burst_bytes: int = 0) -> None:
        if not bandwidth_bytes_s > 0 or concurrency < 1 or burst_bytes < 0:
            raise ValueError(f"a link needs a bandwidth > 0, concurrency >= 1 and a burst >= 0, got {bandwidth_bytes_s}, "
                             f"{concurrency}, {burst_bytes}")
        self.bandwidth = bandwidth_bytes_s
        self.latency = latency_s
        self.burst = burst_bytes
        self._tokens = float(burst_bytes)
        self._idle_since = 0.0
        self.fabric = fabric or _Fabric()
        self._slots = trio.Semaphore(concurrency)
        self.active = 0
        self.peak_active = 0
        self.bytes_in_flight = 0
        self.peak_bytes_in_flight = 0

    async def transfer(self, nbytes: int, via: Sequence[ModelledLink] = ()) -> None:
        try:  # a free slot is taken without a scheduling round (trio's acquire always yields once)
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            self.bytes_in_flight += nbytes
            self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, self.bytes_in_flight)
            try:
                await trio.sleep(self.latency)
                await self._flow(nbytes, (self, *via))
            finally:
                self.bytes_in_flight -= nbytes
        finally:
            self._slots.release()

    def _from_bucket(self, nbytes: int, now: float) -> float:
        """The bytes of a transfer starting now that still have to flow (the bucket's go at once)."""
        if not self.burst or self.active:
            return float(nbytes)
        self._tokens = min(float(self.burst), self._tokens + (now - self._idle_since) * self.bandwidth)
        sent = min(self._tokens, float(nbytes))
        self._tokens -= sent
        return nbytes - sent

    async def _flow(self, nbytes: int, links: tuple[ModelledLink, ...]) -> None:
        fabric = self.fabric
        remaining = self._from_bucket(nbytes, trio.current_time())
        if remaining <= 0:  # the bucket sent it all: nothing flows (and the link stays idle for the next)
            return
        flow = _Flow(remaining, links)
        fabric.advance(trio.current_time())
        for link in links:
            link.active += 1
            link.peak_active = max(link.peak_active, link.active)
        fabric.flows.append(flow)
        try:
            with trio.CancelScope() as scope:
                flow.scope = scope
                fabric.reschedule(trio.current_time())
                await trio.sleep_forever()  # until its deadline (moved by every start and end)
        finally:
            flow.scope = None
            now = trio.current_time()
            fabric.advance(now)
            fabric.flows.remove(flow)
            for link in links:
                link.active -= 1
                if not link.active:
                    link._idle_since = now
            fabric.reschedule(now)


def ctx_egress(p: SimParams) -> ModelledLink:
    """The CTX rank's NIC (``ctx_nic_gbyte_s``): no latency or slots of its own (the GEN links
    have them), only bandwidth that every GEN rank's pulls share."""
    return ModelledLink(p.ctx_nic_bytes_s(), 0.0, 1 << 30)


class ModelledTransport:
    """A ``transports.Transport`` whose pulls take the modelled link's time and move no data.

    Pipelined what-if (``ready_at``): a request's pull cannot end before its CTX has prefilled the
    last layer and that layer has crossed the link: ``max(flow end, prefill end + latency + bytes /
    layers / bandwidth)``."""

    name = "modelled"

    def __init__(self, params: SimParams, ready_at: dict[str, float] | None = None,
                 ctx_nic: ModelledLink | None = None) -> None:
        self._p = params
        bw = params.link_gbyte_s * 1e9
        self.ctx_nic = ctx_nic or ctx_egress(params)
        """The CTX's egress: a replay gives every GEN rank's transport the same one."""
        self._links = {CTX_PEER: ModelledLink(bw, params.link_latency_us / 1e6, params.link_concurrency,
                                              self.ctx_nic.fabric, params.link_burst_bytes)}
        self._last_layer_bw = min(bw, self.ctx_nic.bandwidth / params.gen_tp)
        """Pipelined: the last layer crosses while every rank pulls it at once."""
        self._connected: set[str] = set()
        self._connecting: dict[str, trio.Event] = {}
        self._ready_at = ready_at
        self.pulls = 0
        self.bytes_moved = 0
        self.staging_bytes = 0
        """Bytes of the pulls under way (from their call, queued for a link slot or not): what their
        landings hold, which the budget bounds in orchestrated mode."""
        self.peak_staging_bytes = 0
        self.host_debt_s = 0.0
        """Host time of pulls ended since the execution loop last took it (``host_us_per_pull``)."""

    @property
    def link(self) -> ModelledLink:
        return self._links[CTX_PEER]

    def connected(self, peer: str) -> bool:
        return peer in self._connected

    async def connect(self, peer: str) -> None:
        if peer not in self._links:
            raise PeerUnreachable(f"cannot reach {peer}", peer=peer)
        while peer not in self._connected:  # as the real transports: a connected peer costs no event-loop turn
            pending = self._connecting.get(peer)
            if pending is not None:  # someone is connecting: connected when they are, not before
                await pending.wait()
                continue
            pending = self._connecting[peer] = trio.Event()
            try:
                await trio.sleep(self._p.connect_ms / 1e3)
                self._connected.add(peer)
            finally:
                del self._connecting[peer]
                pending.set()

    async def pull(self, peer: str, request_id: str, kv_slice: KVSlice, into: torch.Tensor, *,
                   handle: str | None = None, release: bool = True, landing: Landing | None = None) -> int:
        link = self._links.get(peer)
        if link is None:
            raise PeerUnreachable(f"cannot reach {peer}", peer=peer)
        nbytes = into.numel() * into.element_size()
        self.staging_bytes += nbytes
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)
        try:
            await link.transfer(nbytes, via=(self.ctx_nic,))
            if self._ready_at is not None and request_id in self._ready_at:
                last_layer = nbytes / max(1, kv_slice.num_layers) / self._last_layer_bw
                end = self._ready_at[request_id] + link.latency + last_layer
                if end > trio.current_time():
                    await trio.sleep_until(end)
        finally:
            self.staging_bytes -= nbytes
        self.pulls += 1
        self.bytes_moved += nbytes
        self.host_debt_s += self._p.host_us_per_pull / 1e6
        return nbytes

    async def release(self, peer: str, request_id: str, *, handle: str | None = None) -> None:
        await trio.lowlevel.checkpoint()

    async def hold(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._connected.clear()
