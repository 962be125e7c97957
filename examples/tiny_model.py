"""A tiny, deterministic, batch-invariant decoder-only transformer used by both nodes.

Architecture (defaults in ``ModelConfig``)
------------------------------------------
Byte-level vocabulary (256 bytes + BOS + EOS), token embedding, ``num_layers`` pre-norm blocks,
final RMSNorm and an untied LM head. Each block::

    h = h + Wo · Attention(RoPE(Wq · RMSNorm(h)), RoPE(Wk · RMSNorm(h)), Wv · RMSNorm(h))
    h = h + Wd · (SiLU(Wg · RMSNorm(h)) * (Wu · RMSNorm(h)))          # SwiGLU MLP

with grouped-query attention (``num_heads`` query heads share ``num_kv_heads`` K/V heads, query
head ``i`` reads K/V head ``i // (num_heads // num_kv_heads)``) and rotary position embeddings.
Weights come from ``torch.Generator().manual_seed(config.seed)`` on the CPU, so every process
that builds ``TinyModel(config)`` holds bit-identical weights (a tensor-parallel rank: the
bit-identical slices of them).

Life cycle in disaggregated serving
-----------------------------------
1. CTX node: ``model.prefill(prompt_ids, pool, block_ids)`` runs the whole prompt, writes the K
   and V of every prompt position into the paged pool (``transports.KVLayout`` from
   ``model.kv_layout(block_size)``; token ``t`` lives in block ``block_ids[t // block_size]``,
   slot ``t % block_size``) and returns the first generated token (greedy).
2. The transport moves the request's blocks, byte for byte, into the GEN node's pool (the block
   ids there are generally different and not contiguous).
3. GEN node: every step, ``model.decode(tokens, positions, block_tables, pool)`` runs one token
   for each of a batch of unrelated sequences: it writes the new token's K/V at ``positions``
   into the sequence's blocks and attends over positions ``0..pos`` read through the block
   table. The first decode call for a request feeds the token returned by prefill at position
   ``len(prompt)``.
4. ``model.generate_reference(prompt_ids, n)`` is the single-process, unpaged oracle (contiguous
   KV cache, its own storage code) that the disaggregated run must match token for token.

Exactness (why the arithmetic looks unusual)
--------------------------------------------
The disaggregated run must equal the single-process run bit for bit, whatever other sequences
share a decode batch and however long the padded block tables are. Plain float32 kernels do not
guarantee that on a CPU: BLAS picks different blocking (hence a different summation order) for
different row counts, and elementwise transcendental kernels (``sigmoid``…) give different last
bits in their vectorised body and their scalar tail, so a value's result depends on where it sits
in the tensor. Both were observed with torch 2.13 / MKL here. The model therefore:

* does every *reduction* (linear layers, RMSNorm's sum of squares, Q·K, softmax denominator,
  P·V) on integer-valued float64 tensors: operands are put on a fixed-point grid first and the
  bounds in ``_check_exact_bounds`` keep every partial sum an integer below 2**53, so every
  addition is exact and the result is independent of summation order, blocking, threading,
  batch size, padding and device;
* does every *elementwise* step with IEEE correctly-rounded operations only (+, -, *, /, sqrt,
  round, clamp, bit shifts): ``exp`` (softmax, SiLU) is a range reduction + polynomial built from
  those, never ``torch.exp``/``torch.sigmoid``;
* stores K and V already on their fixed-point grid, so the pool holds exactly what attention
  consumes and a KV block moved byte for byte is a bit-exact hand-over.

The price is fixed-point rounding of activations (2**-16 for linear inputs, 2**-12 for Q/K/V,
2**-20 for attention probabilities), irrelevant for a test model.

Tensor parallelism
------------------
``TinyModel(config, device, tp=TensorParallel(rank, size, group))`` is one rank of a Megatron /
vLLM-style group; the split (``examples.tp.plan_shards``): query heads evenly, KV heads evenly or
replicated when ``size > num_kv_heads``, QKV and gate/up column-parallel, o and down row-parallel,
embeddings, norms and LM head replicated; a combination that does not split is a ``ValueError``.
Every rank generates the full weights and keeps its slices. A row-parallel accumulator is an
integer-valued float64 partial sum, all-reduced (SUM) *before* scaling, so the sum is exact and
every rank gets the single-process bits: two all-reduces per layer per step, none per head or per
sequence. All ranks call ``prefill`` / ``decode`` / ``reference_logits`` in lockstep with the same
inputs. A rank's pool holds only its KV heads (``kv_layout``, global heads ``kv_head_range()``);
a GEN rank fed by a CTX TP1 node pulls ``kv_slice()`` of the CTX blocks. On this 2-core VM TP is
slower than TP1 (the ranks share the cores; costs in ``examples.tp``).

Cost (defaults, one CPU thread, ``python -m examples.tiny_model``; 2-core VM, torch 2.13 CPU):
a decode step over ~200-token contexts takes ~1.4 ms for B=1, ~3.3 ms for B=16, ~8 ms for
B=64; a 512-token prefill ~28 ms. At B=64 most of the step is reading the paged KV (gather of
the blocks plus the float64 conversion, ~1.5 ms per layer), which is bandwidth bound.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Sequence

import torch

from examples.tp import ShardPlan, Span, TensorParallel, plan_shards
from orchestrator._sampling import SamplingParams, sample
from transports._layout import KVLayout, KVSlice

__all__ = ["BOS_ID", "EOS_ID", "ByteTokenizer", "ModelConfig", "TensorParallel", "TinyModel"]

BOS_ID = 256
EOS_ID = 257

# Fixed-point grids: value = integer * 2**-FRAC, |integer| <= LIMIT * 2**FRAC.
_X_FRAC, _X_LIMIT = 16, 1024.0  # inputs of linear layers
_W_UNIT, _W_MAX = 512.0, 4095.0  # integer weights: round(N(0,1) * 512) clamped to +-4095
_N_FRAC, _N_LIMIT = 12, 512.0  # residual stream as seen by RMSNorm's sum of squares
_KV_FRAC, _KV_LIMIT = 12, 1024.0  # Q and K (after RoPE); also V's grid
_V_LIMIT = 255.0  # V range (tighter: P·V sums over up to max_seq_len positions)
_P_BITS = 20  # attention probabilities: round(exp(s - max) * 2**20)
_EXACT = 2.0**53
_Q_CHUNK = 64  # prefill attention query rows per chunk (keeps temporaries small; no effect on bits)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 258  # 256 bytes + BOS + EOS
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 384
    max_seq_len: int = 2048
    seed: int = 0
    dtype: torch.dtype = torch.float32  # KV pool / activation dtype
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @functools.cached_property
    def fingerprint(self) -> str:
        """Which model this is (every field that shapes its KV, the seed of its weights included;
        not ``max_seq_len``), as 16 hex digits, computed once: a CTX and a GEN of different models
        would exchange KV of the right shape and decode garbage without a word."""
        import hashlib

        fields = dataclasses.replace(self, max_seq_len=1)
        return hashlib.sha256(repr(dataclasses.astuple(fields)).encode()).hexdigest()[:16]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")
        if self.vocab_size < 258:
            raise ValueError("vocab_size must cover the 256 bytes plus BOS and EOS (>= 258)")
        if self.dtype != torch.float32:
            # Q/K/V grids (up to 2**22 steps) are exactly representable in float32 only.
            raise ValueError("only float32 is supported: narrower KV would break bit-exactness")
        _check_exact_bounds(self)

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _check_exact_bounds(c: ModelConfig) -> None:
    """Every integer-valued float64 reduction must stay below 2**53 in absolute value."""
    x_int = _X_LIMIT * 2**_X_FRAC
    checks = {
        "linear (hidden in)": x_int * _W_MAX * c.hidden_size,
        "linear (ffn in)": x_int * _W_MAX * c.ffn_dim,
        "rmsnorm": (_N_LIMIT * 2**_N_FRAC) ** 2 * c.hidden_size,
        "q.k": (_KV_LIMIT * 2**_KV_FRAC) ** 2 * c.head_dim,
        "p.v": 2.0**_P_BITS * (_V_LIMIT * 2**_KV_FRAC) * c.max_seq_len,
    }
    for what, bound in checks.items():
        if bound >= _EXACT:
            raise ValueError(f"config too large for exact {what} reductions ({bound:.3g} >= 2**53)")


class ByteTokenizer:
    """UTF-8 bytes are token ids 0..255; BOS = 256, EOS = 257."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# --- deterministic elementwise / exact-reduction helpers -------------------------------------

_LOG2E = 1.0 / math.log(2.0)
_LN2_HI = 0.693359375  # ln 2 split (Cody-Waite): n * _LN2_HI is exact in float32 for |n| < 2**15
_LN2_LO = math.log(2.0) - _LN2_HI
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(8)]  # Taylor, |r| <= ~0.35: error < 1e-8


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place exp of a float32 tensor from correctly-rounded ops only (range reduction to
    |r| <= ~ln2/2, Taylor polynomial, exact scaling by 2**n built from the exponent bits), so a
    value gets the same bits wherever it sits in whatever tensor. In place because fresh large
    temporaries cost page faults on every call."""
    r = x.clamp_(-80.0, 80.0)
    n = torch.round(r * _LOG2E)
    r.sub_(n * _LN2_HI).sub_(n * _LN2_LO)
    p = r * _EXP_COEFFS[-1]
    p.add_(_EXP_COEFFS[-2])
    for c in reversed(_EXP_COEFFS[:-2]):
        p.mul_(r).add_(c)
    two_n = n.to(torch.int32).add_(127).bitwise_left_shift_(23).view(torch.float32)
    return x.copy_(p.mul_(two_n))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / _exp_(-x).add_(1.0)


def _to_grid_int(x: torch.Tensor, frac: int, limit: float) -> torch.Tensor:
    """float32 -> integer-valued float64: clamp(round(x * 2**frac))."""
    bound = limit * 2**frac
    return torch.round(x * float(2**frac)).clamp_(-bound, bound).to(torch.float64)


def _to_grid(x: torch.Tensor, frac: int, limit: float) -> torch.Tensor:
    """float32 -> float32 on the grid (exactly representable as long as limit * 2**frac < 2**24)."""
    bound = limit * 2**frac
    return torch.round(x * float(2**frac)).clamp_(-bound, bound).mul_(2.0**-frac)


class _Linear:
    """y = x @ W, exact: integer weights, fixed-point input, integer-valued float64 accumulation.

    A row-parallel shard has ``reduce`` (the group's in-place SUM all-reduce): its partial
    accumulator is integer-valued below 2**53, so summing it over the ranks *before* the scaling is
    exact and gives the single-process accumulator bit for bit."""

    def __init__(self, weight: torch.Tensor, scale: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.weight = weight
        self.scale = scale
        self._reduce = reduce

    @classmethod
    def generate(cls, in_features: int, out_features: int, gen: torch.Generator, gain: float) -> _Linear:
        """The full layer on the CPU (the generator sequence of the single-process model)."""
        w = torch.randn(in_features, out_features, generator=gen, dtype=torch.float32)
        weight = torch.round(w * _W_UNIT).clamp_(-_W_MAX, _W_MAX).to(torch.float64)
        return cls(weight, gain / math.sqrt(in_features) / _W_UNIT * 2.0**-_X_FRAC)

    def shard(self, device: torch.device, *, columns: torch.Tensor | None = None, rows: Span | None = None,
              reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> _Linear:
        """This layer's ``columns`` (column-parallel) or ``rows`` (row-parallel, with ``reduce``) on
        ``device``, or all of it; the scale stays the full layer's."""
        w = self.weight if columns is None else self.weight.index_select(1, columns)
        if rows is not None:
            w = w[rows.start : rows.stop].contiguous()
        return _Linear(w.to(device), self.scale, reduce)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        acc = _to_grid_int(x, _X_FRAC, _X_LIMIT) @ self.weight
        if self._reduce is not None:
            self._reduce(acc)
        return (acc * self.scale).to(torch.float32)


class _RMSNorm:
    def __init__(self, dim: int, gen: torch.Generator, eps: float, device: torch.device):
        g = 1.0 + 0.1 * torch.randn(dim, generator=gen, dtype=torch.float32)
        self.gain = g.to(torch.float64).to(device)
        self.dim = dim
        self.eps = eps

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        hi = _to_grid_int(h, _N_FRAC, _N_LIMIT)
        ms = (hi * hi).sum(-1, keepdim=True) * (2.0 ** (-2 * _N_FRAC) / self.dim)
        inv = 1.0 / torch.sqrt(ms + self.eps)
        return (h.to(torch.float64) * inv * self.gain).to(torch.float32)


@dataclasses.dataclass
class _Layer:
    attn_norm: _RMSNorm
    qkv: _Linear
    o: _Linear
    mlp_norm: _RMSNorm
    gate_up: _Linear
    down: _Linear


class TinyModel:
    """See the module docstring. Not an ``nn.Module``: inference only, no autograd.

    ``tp`` (default: the single process) makes this object one rank of a tensor-parallel group:
    it holds its shard of the weights and of the KV heads, and every ``prefill`` / ``decode`` /
    ``reference_logits`` call all-reduces inside, so all ranks must make the same calls with the
    same inputs in the same order. A combination that cannot be split is a ``ValueError`` here.
    """

    def __init__(self, config: ModelConfig | None = None, device: str | torch.device = "cpu", tp: TensorParallel | None = None):
        self.config = c = config or ModelConfig()
        self.device = torch.device(device)
        self.tp = tp = tp or TensorParallel()
        self.shard: ShardPlan = plan_shards(c, tp)
        tp.check_group()
        self._hq, self._hkv, self._ffn = self.shard.q_heads.count, self.shard.kv_heads.count, self.shard.ffn.count
        gen = torch.Generator(device="cpu").manual_seed(c.seed)
        dev = self.device
        residual_gain = 1.0 / math.sqrt(2 * c.num_layers)
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen, dtype=torch.float32).to(dev)
        hidden, kv_dim = c.hidden_size, c.num_kv_heads * c.head_dim
        # Every rank generates every full layer (the single-process generator sequence), then keeps
        # its slice: QKV and gate/up by columns, o and down by rows (all-reduced); the rest whole.
        plan = self.shard
        qkv_cols, gate_up_cols, o_rows = plan.qkv_columns(c), plan.gate_up_columns(c), plan.o_rows(c)
        reduce = tp.all_reduce_ if tp.size > 1 else None
        self.layers = [
            _Layer(
                attn_norm=_RMSNorm(hidden, gen, c.norm_eps, dev),
                qkv=_Linear.generate(hidden, hidden + 2 * kv_dim, gen, 1.0).shard(dev, columns=qkv_cols),
                o=_Linear.generate(hidden, hidden, gen, residual_gain).shard(dev, rows=o_rows, reduce=reduce),
                mlp_norm=_RMSNorm(hidden, gen, c.norm_eps, dev),
                gate_up=_Linear.generate(hidden, 2 * c.ffn_dim, gen, 1.0).shard(dev, columns=gate_up_cols),
                down=_Linear.generate(c.ffn_dim, hidden, gen, residual_gain).shard(dev, rows=plan.ffn, reduce=reduce),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = _RMSNorm(hidden, gen, c.norm_eps, dev)
        self.lm_head = _Linear.generate(hidden, c.vocab_size, gen, 4.0).shard(dev)
        # RoPE tables: built once, same shape in every process, indexed by position.
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(c.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self._cos = torch.cos(angles).to(torch.float32).to(dev)
        self._sin = torch.sin(angles).to(torch.float32).to(dev)
        self._score_scale = 2.0 ** (-2 * _KV_FRAC) / math.sqrt(c.head_dim)
        self._local = threading.local()  # per-thread scratch buffers for decode

    # --- public API --------------------------------------------------------------------------

    def kv_layout(self, block_size: int) -> KVLayout:
        """This rank's pool layout: its own KV heads only (all of them at TP1)."""
        c = self.config
        return KVLayout(c.num_layers, self._hkv, c.head_dim, block_size, c.dtype)

    def kv_head_range(self) -> Span:
        """The global KV heads ``(start, stop)`` this rank's pool holds, in pool order."""
        return self.shard.kv_heads

    def kv_slice(self) -> KVSlice:
        """What this rank pulls from a CTX TP1 node's blocks: all layers, heads ``kv_head_range()``."""
        h0, h1 = self.shard.kv_heads
        return KVSlice(0, self.config.num_layers, h0, h1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights by name (for checks: same seed -> equal tensors); a TP rank's own shards."""
        out = {"embed": self.embed, "final_norm": self.final_norm.gain, "lm_head": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            for f in dataclasses.fields(layer):
                mod = getattr(layer, f.name)
                out[f"layers.{i}.{f.name}"] = mod.gain if isinstance(mod, _RMSNorm) else mod.weight
        return out

    @torch.no_grad()
    def prefill_logits(self, token_ids: Sequence[int], pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt, write its K/V into ``pool`` at ``block_ids``; logits [vocab] of the last position."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n > self.config.max_seq_len:
            raise ValueError(f"prompt of {n} tokens exceeds max_seq_len {self.config.max_seq_len}")
        block_size = self._check_pool(pool)
        block_ids = torch.as_tensor(block_ids, dtype=torch.int64).to(self.device).reshape(-1)
        if block_ids.numel() < -(-n // block_size):
            raise ValueError(f"{n} tokens need {-(-n // block_size)} blocks of {block_size}, got {block_ids.numel()}")
        pos = torch.arange(n, device=self.device)
        blk = block_ids[pos // block_size]
        slot = pos % block_size
        causal = (pos[None, :] <= pos[:, None])[None]  # [1, Q, T]

        def attend(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            layer_pool = pool[:, li]  # [N, 2, Hkv, bs, D] view
            layer_pool[blk, :, :, slot] = torch.stack((k[0], v[0]), dim=1).to(pool.dtype)
            k64 = k[0].transpose(0, 1)[None].to(torch.float64)
            return k64, v[0].transpose(0, 1)[None].to(torch.float64), causal

        h = self._forward(torch.as_tensor(list(token_ids), dtype=torch.int64, device=self.device)[None], pos[None], attend)
        return self._logits(h[0, -1:])[0]

    def prefill(self, token_ids: Sequence[int], pool: torch.Tensor, block_ids: torch.Tensor) -> int:
        """Run the prompt, write every position's K/V into the paged pool; return the greedy next token."""
        return int(torch.argmax(self.prefill_logits(token_ids, pool, block_ids)))

    @torch.no_grad()
    def decode_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: Sequence[torch.Tensor] | torch.Tensor,
        pool: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step for a batch; logits [B, vocab]. See ``decode``."""
        dev = self.device
        tokens = torch.as_tensor(tokens, dtype=torch.int64).to(dev).reshape(-1)
        positions = torch.as_tensor(positions, dtype=torch.int64).to(dev).reshape(-1)
        batch = tokens.numel()
        if positions.numel() != batch:
            raise ValueError(f"{batch} tokens but {positions.numel()} positions")
        if batch == 0:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=dev)
        if int(positions.min()) < 0 or int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"positions must lie in [0, {self.config.max_seq_len})")
        block_size = self._check_pool(pool)
        table = self._pad_tables(block_tables, batch)
        need = positions // block_size + 1  # blocks each sequence reads, the new token's included
        max_need = int(need.max())
        if table.shape[1] < max_need:
            raise ValueError(f"block tables have {table.shape[1]} columns, position needs {max_need}")
        if lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64).to(dev).reshape(-1)
            if bool((lengths < need).any()):
                raise ValueError("a block table is shorter than its position requires")
        table = table[:, :max_need]
        cols = torch.arange(max_need, device=dev)
        # Padding entries (any value, -1 included) are never read: replaced by block 0, masked out.
        flat = torch.where(cols[None, :] < need[:, None], table, torch.zeros_like(table)).reshape(-1)
        new_blk = table[torch.arange(batch, device=dev), positions // block_size]
        new_slot = positions % block_size
        span = max_need * block_size
        mask = (torch.arange(span, device=dev)[None, :] <= positions[:, None])[:, None, :]  # [B, 1, T]
        hkv, d = self._hkv, self.config.head_dim

        def attend(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            layer_pool = pool[:, li]  # [N, 2, Hkv, bs, D] view
            layer_pool[new_blk, :, :, new_slot] = torch.stack((k[:, 0], v[:, 0]), dim=1).to(pool.dtype)
            # One gather into a reused buffer, then one converting copy into [2, B, Hkv, T, D]
            # float64 (reused too: fresh multi-MB allocations cost page faults every step).
            picked = self._scratch("picked", (batch * max_need, 2, hkv, block_size, d), pool.dtype)
            torch.index_select(layer_pool, 0, flat, out=picked)
            kv = self._scratch("kv64", (2, batch, hkv, max_need, block_size, d), torch.float64)
            kv.copy_(picked.view(batch, max_need, 2, hkv, block_size, d).permute(2, 0, 3, 1, 4, 5))
            kv = kv.view(2, batch, hkv, span, d)
            # Masked positions get probability exactly 0, and 0 * finite = 0 keeps P·V exact and
            # independent of them; but 0 * NaN/Inf (a never-written or foreign slot) would leak.
            # Written values are always finite, so clearing non-finite values is enough.
            torch.nan_to_num_(kv[1], nan=0.0, posinf=0.0, neginf=0.0)
            return kv[0], kv[1], mask

        h = self._forward(tokens[:, None], positions[:, None], attend)
        return self._logits(h[:, 0])

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: Sequence[torch.Tensor] | torch.Tensor,
        pool: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One greedy decode step for B sequences.

        ``tokens[b]`` sits at ``positions[b]``; its K/V are written into the pool there, and it
        attends over positions ``0..positions[b]`` of its own blocks. ``block_tables`` is either a
        list of B 1-D block-id tensors or a padded [B, max_blocks] integer tensor (padding ignored;
        ``lengths``, the valid entries per row, is optional and only validated). Returns the next
        tokens, int64 [B]. Each row's result is bit-identical whatever else shares the batch.
        """
        return torch.argmax(self.decode_logits(tokens, positions, block_tables, pool, lengths), dim=-1)

    @torch.no_grad()
    def reference_logits(self, prompt_ids: Sequence[int], max_new_tokens: int,
                         sampling: SamplingParams | None = None) -> tuple[list[int], torch.Tensor]:
        """Unpaged single-process run: (new tokens, logits [max_new_tokens, vocab]); greedy, or drawn
        with ``sampling`` (``orchestrator._sampling.sample``: the token at position p depends only on
        the seed, p and the logits, as on the CTX and GEN nodes)."""
        c = self.config
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n + max_new_tokens - 1 > c.max_seq_len:
            raise ValueError("prompt + generation exceeds max_seq_len")
        dev = self.device
        # Contiguous cache: cache[layer] = (K [1, Hkv, max_seq_len, D], V [...]) filled up to `length`.
        cache = [
            (torch.zeros(1, self._hkv, c.max_seq_len, c.head_dim, dtype=c.dtype, device=dev),
             torch.zeros(1, self._hkv, c.max_seq_len, c.head_dim, dtype=c.dtype, device=dev))
            for _ in range(c.num_layers)
        ]
        state = {"start": 0}

        def attend(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            start, q_len = state["start"], k.shape[1]
            end = start + q_len
            kc, vc = cache[li]
            kc[0, :, start:end] = k[0].transpose(0, 1).to(c.dtype)
            vc[0, :, start:end] = v[0].transpose(0, 1).to(c.dtype)
            qpos = torch.arange(start, end, device=dev)
            mask = (torch.arange(end, device=dev)[None, :] <= qpos[:, None])[None]
            return kc[:, :, :end].to(torch.float64), vc[:, :, :end].to(torch.float64), mask

        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            start = state["start"]
            x = torch.tensor(ids, dtype=torch.int64, device=dev)[None]
            pos = torch.arange(start, start + len(ids), device=dev)[None]
            h = self._forward(x, pos, attend)
            state["start"] = start + len(ids)
            step = self._logits(h[0, -1:])[0]
            logits.append(step)
            tokens.append(int(torch.argmax(step)) if sampling is None else
                          sample(step, sampling, position=n + len(tokens), index=len(tokens)))
            ids = [tokens[-1]]
        out = torch.stack(logits) if logits else torch.empty(0, c.vocab_size)
        return tokens, out

    def generate_reference(self, prompt_ids: Sequence[int], max_new_tokens: int,
                           sampling: SamplingParams | None = None) -> list[int]:
        """Greedy (or ``sampling``) tokens of a plain unpaged run (contiguous KV cache); the parity oracle.

        Returns the ``max_new_tokens`` new tokens: the first is what ``prefill`` returns, the
        next ones what successive ``decode`` steps return.
        """
        return self.reference_logits(prompt_ids, max_new_tokens, sampling)[0]

    # --- internals ---------------------------------------------------------------------------

    def _check_pool(self, pool: torch.Tensor) -> int:
        c = self.config
        if pool.dim() != 6 or tuple(pool.shape[1:4]) != (c.num_layers, 2, self._hkv) or pool.shape[5] != c.head_dim:
            raise ValueError(f"pool shape {tuple(pool.shape)} does not match the model's KV layout")
        if pool.dtype != c.dtype:
            raise ValueError(f"pool dtype {pool.dtype} != model dtype {c.dtype}")
        return pool.shape[4]

    def _pad_tables(self, block_tables: Sequence[torch.Tensor] | torch.Tensor, batch: int) -> torch.Tensor:
        if isinstance(block_tables, torch.Tensor):
            table = block_tables.to(self.device, torch.int64)
            if table.dim() != 2:
                raise ValueError("a block-table tensor must be [B, max_blocks]")
        else:
            rows = [torch.as_tensor(t, dtype=torch.int64).reshape(-1) for t in block_tables]
            table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(self.device) if rows else None
        if table is None or table.shape[0] != batch:
            raise ValueError(f"need {batch} block tables")
        return table

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused per-thread buffer viewed as ``shape`` (contents undefined)."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        n = math.prod(shape)
        buf = bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = bufs[name] = torch.empty(n + n // 4, dtype=dtype, device=self.device)
        return buf[:n].view(shape)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, Q, H, D] float32, pos [B, Q]."""
        half = self.config.head_dim // 2
        cos = self._cos[pos][:, :, None, :]
        sin = self._sin[pos][:, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """tokens, pos [B, Q] -> final hidden [B, Q, hidden]. ``attend(layer, k, v)`` stores the new
        K/V ([B, Q, Hkv, D] float32, on the grid) and returns (K, V [B, Hkv, T, D] float64, mask [B, Q, T]).
        Head counts are this rank's; ``o`` and ``down`` all-reduce, so ``h`` is the same on every rank."""
        c = self.config
        b, q_len = tokens.shape
        hq, hkv, d, ffn = self._hq, self._hkv, c.head_dim, self._ffn
        h = self.embed[tokens]  # [B, Q, hidden]
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.attn_norm(h))
            q = qkv[..., : hq * d].reshape(b, q_len, hq, d)
            k = qkv[..., hq * d : (hq + hkv) * d].reshape(b, q_len, hkv, d)
            v = qkv[..., (hq + hkv) * d :].reshape(b, q_len, hkv, d)
            q = _to_grid(self._rope(q, pos), _KV_FRAC, _KV_LIMIT)
            k = _to_grid(self._rope(k, pos), _KV_FRAC, _KV_LIMIT)
            v = _to_grid(v, _KV_FRAC, _V_LIMIT)
            keys, values, mask = attend(li, k, v)
            h = h + layer.o(self._attention(q, keys, values, mask))
            gu = layer.gate_up(layer.mlp_norm(h))
            h = h + layer.down(_silu(gu[..., :ffn]) * gu[..., ffn:])
        return h

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, D] float32, keys/values [B, Hkv, T, D] float64, all on the 2**-12 grid;
        mask [B, Q, T] -> [B, Q, H*D] float32.

        Integer q times grid-valued k (and integer p times grid-valued v) are multiples of 2**-12
        below 2**41 (2**40), so both matmuls and the denominator are exact in any order. Long
        query runs (prefill) go in chunks of ``_Q_CHUNK`` rows, each against the keys up to its
        last unmasked column: masked columns contribute exactly nothing, so chunking changes no bit.
        """
        q_len = q.shape[1]
        if q_len > _Q_CHUNK:
            parts = []
            for start in range(0, q_len, _Q_CHUNK):
                sub = mask[:, start : start + _Q_CHUNK]
                cols = sub.any(dim=1).any(dim=0).nonzero()
                span = int(cols.max()) + 1 if cols.numel() else 1
                parts.append(self._attention(q[:, start : start + _Q_CHUNK], keys[:, :, :span], values[:, :, :span], sub[..., :span]))
            return torch.cat(parts, dim=1)
        b = q.shape[0]
        hkv, d = self._hkv, self.config.head_dim
        g = self._hq // hkv
        scale = float(2**_KV_FRAC)
        qi = (q.to(torch.float64) * scale).reshape(b, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * q_len, d)
        s = (qi @ keys.transpose(-1, -2)).view(b, hkv, g, q_len, -1)  # exact, multiples of 2**-12
        m = mask[:, None, None]  # [B, 1, 1, Q, T]
        s.masked_fill_(~m, -math.inf)
        top = s.amax(dim=-1, keepdim=True)
        z = s.sub_(top).mul_(self._score_scale * scale).to(torch.float32)
        p = _exp_(z).mul_(float(2**_P_BITS)).round_().masked_fill_(~m, 0.0)
        p = p.to(torch.float64).view(b, hkv, g * q_len, -1)
        num = p @ values  # exact [B, Hkv, G*Q, D]
        den = p.sum(dim=-1, keepdim=True)  # exact integer
        out = (num / den).to(torch.float32)
        return out.view(b, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(b, q_len, hkv * g * d)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(h))


def _benchmark(block_size: int = 16, context: int = 200) -> dict[str, float]:
    """Median milliseconds on the current thread setting: decode steps (B=1/16/64, ~``context``-token
    contexts, shuffled blocks) and a 512-token prefill. ``python -m examples.tiny_model``."""
    import time

    model = TinyModel()
    layout = model.kv_layout(block_size)
    per_seq = layout.blocks_for(context + 8)
    pool = layout.new_pool(64 * per_seq + 32)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(pool.shape[0], generator=gen)

    def median_ms(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    out = {}
    for batch in (1, 16, 64):
        tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        positions = torch.randint(context - 8, context + 8, (batch,), generator=gen)
        tokens = torch.randint(0, 256, (batch,), generator=gen)
        out[f"decode_B{batch}_ms"] = median_ms(lambda: model.decode(tokens, positions, tables, pool), 30)
    prompt = torch.randint(0, 256, (512,), generator=gen).tolist()
    out["prefill_512_ms"] = median_ms(lambda: model.prefill(prompt, pool, perm[: layout.blocks_for(512)]), 7)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for key, value in _benchmark().items():
        print(f"{key}: {value:.2f}")
