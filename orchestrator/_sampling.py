"""Sampling one token from a row of logits, reproducibly: the same (seed, position, logits) gives the
same token in every process (the CTX's first token, each GEN step, a single-process reference run),
so that a disaggregated sampled run equals a single-process one, as greedy runs do.

    logits [V] ──suppress (EOS / stop ids before min_tokens)──> temperature == 0: argmax
              ──/ temperature──> top_k ──> softmax (float64) ──> top_p (nucleus)
              ──inverse CDF at u──> token,   u = uniform(Generator(mix(seed, position)))

The draw ``u`` depends only on the request's seed and the token's position (not on the batch, the
node or the step), and the probabilities are computed in float64 from logits that are bit-identical
across processes (invariant 10), so every process picks the same token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

_MASK63 = (1 << 63) - 1
SEED_MASK = (1 << 64) - 1
"""A request's seed is 64 bits: one in [-2^63, 2^63) (vLLM's range) maps to one of these, one to one."""
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (as vLLM's _SAMPLING_EPS)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 (or below ``GREEDY_BELOW``): greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0: every token."""
    seed: int = 0
    min_tokens: int = 0
    """Output tokens before ``suppress`` ids (EOS, stop token ids) may be drawn."""
    suppress: tuple[int, ...] = ()
    """Token ids that cannot be drawn while fewer than ``min_tokens`` were output."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0 and self.min_tokens >= 0):
            raise ValueError(f"invalid sampling parameters {self}")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or so small that dividing the logits by it would overflow them to
        infinities (then the last of them was drawn, whatever the model said), or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"suppress": list(self.suppress)}

    @classmethod
    def from_wire(cls, raw: Any) -> SamplingParams:
        """From a control message (a JSON object); ``ValueError`` on anything malformed."""
        if not isinstance(raw, dict) or set(raw) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("sampling: an object with temperature, top_p, top_k, seed, min_tokens, suppress")

        def number(name: str, default: float) -> float:  # an int or a float: not a bool, not "0.7"
            v = raw.get(name, default)
            if type(v) not in (int, float):
                raise ValueError(f"sampling: {name} must be a number, not {str(v)[:20]!r}")
            return float(v)

        def integer(name: str) -> int:  # not a bool, not 2.9 (taken as 2), not "5"
            v = raw.get(name, 0)
            if type(v) is not int:
                raise ValueError(f"sampling: {name} must be an integer, not {str(v)[:20]!r}")
            return v

        suppress = raw.get("suppress", [])
        if not isinstance(suppress, list) or any(type(t) is not int for t in suppress):  # "257" is not (2, 5, 7)
            raise ValueError("sampling: suppress must be a list of token ids")
        return cls(temperature=number("temperature", 1.0), top_p=number("top_p", 1.0), top_k=integer("top_k"),
                   seed=integer("seed") & SEED_MASK, min_tokens=integer("min_tokens"), suppress=tuple(suppress))


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position) (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def sample(logits: torch.Tensor, params: SamplingParams, *, position: int, index: int) -> int:
    """The token at ``position`` (the ``index``-th output token, 0 for the first) from ``logits`` [V]."""
    x = logits.detach().to("cpu", torch.float64).reshape(-1)
    if params.suppress and index < params.min_tokens:
        x = x.clone()
        x[[t for t in params.suppress if 0 <= t < x.numel()]] = float("-inf")
    if params.greedy:
        return int(torch.argmax(x))
    x = x / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    probs = torch.softmax(x, dim=0)
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    cum = torch.cumsum(sorted_probs, dim=0)
    if params.top_p < 1.0:
        keep = int(torch.searchsorted(cum, torch.tensor(params.top_p, dtype=torch.float64)).item()) + 1
        sorted_probs, order = sorted_probs[:keep], order[:keep]
        cum = torch.cumsum(sorted_probs, dim=0)
    gen = torch.Generator().manual_seed(_mix(params.seed, position))
    u = torch.rand((), generator=gen, dtype=torch.float64) * cum[-1]
    i = min(int(torch.searchsorted(cum, u, right=True).item()), len(order) - 1)
    return int(order[i])


def logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the model's distribution (temperature 1, as OpenAI and
    vLLM report them) and the ``top`` most likely tokens with theirs."""
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64).reshape(-1), dim=0)
    best = torch.topk(lp, top) if top > 0 else None
    return float(lp[token]), ([] if best is None else [(int(i), float(v)) for v, i in zip(best.values, best.indices)])


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams | None], positions: Sequence[int],
                indices: Sequence[int]) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]; a row without params is greedy."""
    out = torch.argmax(logits, dim=-1).to("cpu", torch.int64)
    for b, p in enumerate(params):
        if p is not None:
            out[b] = sample(logits[b], p, position=positions[b], index=indices[b])
    return out
