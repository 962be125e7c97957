"""The tiny model: determinism, tokenizer, paged == unpaged, batch invariance, exact block writes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.tiny_model import BOS_ID, EOS_ID, ByteTokenizer, ModelConfig, TinyModel
from transports import gather, scatter

BLOCK = 16
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(ModelConfig(seed=0))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [BOS_ID, *torch.randint(0, 256, (n - 1,), generator=g).tolist()]


def _digest(m: TinyModel) -> str:
    h = hashlib.sha256()
    for name, t in m.state_dict().items():
        h.update(name.encode())
        h.update(t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _run_paged(m: TinyModel, prompt: list[int], steps: int, pool: torch.Tensor, blocks: torch.Tensor):
    """Prefill then decode one sequence alone; (tokens, logits [steps, vocab])."""
    logits = [m.prefill_logits(prompt, pool, blocks)]
    tokens = [int(torch.argmax(logits[0]))]
    for i in range(steps - 1):
        step = m.decode_logits(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + i]), [blocks], pool)
        logits.append(step[0])
        tokens.append(int(torch.argmax(step[0])))
    return tokens, torch.stack(logits)


# --- weights --------------------------------------------------------------------------------


def test_same_seed_same_weights_different_seed_different() -> None:
    a, b, c = TinyModel(ModelConfig(seed=7)), TinyModel(ModelConfig(seed=7)), TinyModel(ModelConfig(seed=8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)
    assert _digest(a) == _digest(b) != _digest(c)


def test_weights_and_tokens_identical_in_another_process(model: TinyModel) -> None:
    """A fresh process (one BLAS thread, this one uses the default) builds the same weights and tokens."""
    prompt = _prompt(37, 1)
    code = (
        "import json, sys, torch; torch.set_num_threads(1)\n"
        "from examples.tiny_model import ModelConfig, TinyModel\n"
        "from tests.test_tiny_model import _digest\n"
        "m = TinyModel(ModelConfig(seed=0))\n"
        f"print(json.dumps([_digest(m), m.generate_reference({prompt!r}, 8)]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    digest, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert digest == _digest(model)
    assert tokens == model.generate_reference(prompt, 8)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError):
        ModelConfig(vocab_size=100)
    with pytest.raises(ValueError):
        ModelConfig(max_seq_len=1 << 20)  # P·V would no longer be exact
    with pytest.raises(ValueError):
        ModelConfig(dtype=torch.bfloat16)


def test_kv_layout(model: TinyModel) -> None:
    layout = model.kv_layout(BLOCK)
    c = model.config
    assert layout.block_shape == (c.num_layers, 2, c.num_kv_heads, BLOCK, c.head_dim)
    assert layout.dtype == torch.float32


# --- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "Grüße, 日本語 🙂\n\t", "a" * 300])
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode([*ids, EOS_ID]) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_tokenizer_invalid_utf8_is_replaced() -> None:
    assert ByteTokenizer().decode([0xFF, ord("a")]) == "\ufffda"


# --- paged vs unpaged -----------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 33, 70])
def test_paged_prefill_decode_matches_reference(model: TinyModel, length: int) -> None:
    steps = 24  # crosses at least one block boundary during decode
    prompt = _prompt(length, length)
    ref_tokens, ref_logits = model.reference_logits(prompt, steps)
    assert ref_tokens == model.generate_reference(prompt, steps)
    layout = model.kv_layout(BLOCK)
    pool = layout.new_pool(40)
    blocks = torch.randperm(40, generator=torch.Generator().manual_seed(length))[: layout.blocks_for(length + steps)]
    tokens, logits = _run_paged(model, prompt, steps, pool, blocks)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)


def test_shuffled_blocks_give_identical_results(model: TinyModel) -> None:
    prompt, steps = _prompt(45, 3), 12
    layout = model.kv_layout(BLOCK)
    nblocks = layout.blocks_for(len(prompt) + steps)
    pool_a, pool_b = layout.new_pool(nblocks), layout.new_pool(64)
    blocks_a = torch.arange(nblocks)
    blocks_b = torch.tensor([50, 3, 17, 9])[:nblocks]
    assert nblocks == 4
    tok_a, log_a = _run_paged(model, prompt, steps, pool_a, blocks_a)
    tok_b, log_b = _run_paged(model, prompt, steps, pool_b, blocks_b)
    assert tok_a == tok_b
    assert torch.equal(log_a, log_b)
    # The request's KV, gathered in block order, is the same bytes in both pools.
    full = layout.full_slice()
    assert torch.equal(gather(pool_a, blocks_a, full), gather(pool_b, blocks_b, full))


def test_prefill_writes_exactly_the_given_blocks(model: TinyModel) -> None:
    layout = model.kv_layout(BLOCK)
    pool = torch.randn((24, *layout.block_shape), generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    prompt = _prompt(37, 4)  # 2 full blocks + 5 slots of a third
    blocks = torch.tensor([19, 2, 11])
    model.prefill(prompt, pool, blocks)
    untouched = [i for i in range(24) if i not in blocks.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    assert not torch.equal(pool[19], before[19]) and not torch.equal(pool[2], before[2])
    # Last block: slots 0..4 written, 5..15 untouched.
    assert torch.equal(pool[11, :, :, :, 5:], before[11, :, :, :, 5:])
    assert not torch.equal(pool[11, :, :, :, :5], before[11, :, :, :, :5])
    # Token t sits in block_ids[t // BLOCK], slot t % BLOCK: compare against a contiguous prefill.
    contiguous = layout.new_pool(3)
    model.prefill(prompt, contiguous, torch.arange(3))
    assert torch.equal(pool[19], contiguous[0]) and torch.equal(pool[2], contiguous[1])
    assert torch.equal(pool[11, :, :, :, :5], contiguous[2, :, :, :, :5])
    with pytest.raises(ValueError):
        model.prefill(prompt, pool, torch.tensor([1, 2]))  # too few blocks


def test_kv_moved_between_pools_continues_exactly(model: TinyModel) -> None:
    """CTX prefill -> gather -> scatter into a GEN pool at other blocks -> decode == reference."""
    prompt, steps = _prompt(50, 6), 10
    layout = model.kv_layout(BLOCK)
    ctx_pool, gen_pool = layout.new_pool(8), layout.new_pool(32)
    ctx_blocks = torch.tensor([5, 1, 7, 0])
    first = model.prefill(prompt, ctx_pool, ctx_blocks)
    gen_blocks = torch.tensor([30, 12, 4, 21])  # 50 + 10 tokens fit in 4 blocks
    scatter(gen_pool, gen_blocks, gather(ctx_pool, ctx_blocks, layout.full_slice()), layout.full_slice())
    tokens = [first]
    for i in range(steps - 1):
        tokens.append(int(model.decode(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + i]), [gen_blocks], gen_pool)[0]))
    assert tokens == model.generate_reference(prompt, steps)


# --- batch invariance -----------------------------------------------------------------------


class _Batch:
    """Several prefilled sequences sharing one pool; decode any subset at their next position."""

    def __init__(self, m: TinyModel, lengths: list[int], seed: int):
        self.m = m
        layout = m.kv_layout(BLOCK)
        per_seq = [layout.blocks_for(n + 1) for n in lengths]
        self.pool = layout.new_pool(sum(per_seq) + 5)
        perm = torch.randperm(self.pool.shape[0], generator=torch.Generator().manual_seed(seed))
        self.blocks, self.pos, self.tok, start = [], [], [], 0
        for i, (n, k) in enumerate(zip(lengths, per_seq, strict=True)):
            b = perm[start : start + k]
            start += k
            self.blocks.append(b)
            self.pos.append(n)
            self.tok.append(m.prefill(_prompt(n, seed * 100 + i), self.pool, b))

    def logits(self, members: list[int], padded: bool = False, extra_cols: int = 0) -> torch.Tensor:
        tokens = torch.tensor([self.tok[i] for i in members])
        positions = torch.tensor([self.pos[i] for i in members])
        if not padded:
            return self.m.decode_logits(tokens, positions, [self.blocks[i] for i in members], self.pool)
        width = max(len(self.blocks[i]) for i in members) + extra_cols
        table = torch.full((len(members), width), -1, dtype=torch.int64)
        for r, i in enumerate(members):
            table[r, : len(self.blocks[i])] = self.blocks[i]
        lengths = torch.tensor([len(self.blocks[i]) for i in members])
        return self.m.decode_logits(tokens, positions, table, self.pool, lengths)


def test_decode_is_batch_invariant(model: TinyModel) -> None:
    lengths = [1, 5, 16, 17, 31, 32, 40, 64, 3, 100, 9, 47]
    batch = _Batch(model, lengths, seed=1)
    alone = torch.stack([batch.logits([i])[0] for i in range(len(lengths))])
    g = torch.Generator().manual_seed(2)
    compositions = [list(range(len(lengths))), list(reversed(range(len(lengths)))), [3, 0], [9, 9, 9, 1]]
    compositions += [torch.randperm(len(lengths), generator=g)[: 2 + k].tolist() for k in range(8)]
    for members in compositions:
        together = batch.logits(members)
        for r, i in enumerate(members):
            assert torch.equal(together[r], alone[i]), (members, i)
    # Padded tensor tables (padding -1, any amount of extra columns) change nothing either.
    for extra in (0, 3):
        together = batch.logits(list(range(len(lengths))), padded=True, extra_cols=extra)
        assert torch.equal(together, alone)


def test_batched_generation_matches_reference_per_sequence(model: TinyModel) -> None:
    """Sequences join and leave a running decode batch; each one's tokens == its reference."""
    specs = [(12, 20), (40, 9), (3, 25), (17, 14), (33, 6)]  # (prompt length, new tokens)
    join_at = [0, 0, 2, 5, 7]
    layout = model.kv_layout(BLOCK)
    pool = layout.new_pool(60)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(9)).tolist()
    prompts = [_prompt(n, 50 + i) for i, (n, _) in enumerate(specs)]
    blocks, out, pos = {}, {}, {}
    for step in range(40):
        for i, when in enumerate(join_at):
            if when == step:
                need = layout.blocks_for(specs[i][0] + specs[i][1])
                blocks[i] = torch.tensor([perm.pop() for _ in range(need)])
                out[i] = [model.prefill(prompts[i], pool, blocks[i])]
                pos[i] = specs[i][0]
        live = [i for i in out if len(out[i]) < specs[i][1]]
        if not live and len(out) == len(specs):
            break
        if live:
            nxt = model.decode(
                torch.tensor([out[i][-1] for i in live]), torch.tensor([pos[i] for i in live]), [blocks[i] for i in live], pool
            )
            for i, t in zip(live, nxt.tolist(), strict=True):
                out[i].append(t)
                pos[i] += 1
    for i, (_, steps) in enumerate(specs):
        assert out[i] == model.generate_reference(prompts[i], steps), i


def test_decode_b64_and_garbage_in_unread_slots(model: TinyModel) -> None:
    """B=64 works; NaN/Inf in never-written blocks and slots past a position change nothing."""
    layout = model.kv_layout(BLOCK)
    lengths = [int(x) for x in torch.randint(150, 230, (64,), generator=torch.Generator().manual_seed(3))]
    batch = _Batch(model, lengths, seed=4)
    clean = batch.logits(list(range(64)))
    assert clean.shape == (64, model.config.vocab_size)
    assert torch.isfinite(clean).all()
    assert torch.equal(batch.logits([10])[0], clean[10])
    # Poison every slot that no sequence has written (unused blocks, tails of last blocks).
    used = torch.zeros(batch.pool.shape[0], BLOCK, dtype=torch.bool)
    for b, n in zip(batch.blocks, lengths, strict=True):
        t = torch.arange(n)
        used[b[t // BLOCK], t % BLOCK] = True
    poisoned = batch.pool.permute(0, 4, 1, 2, 3, 5)  # [N, slot, ...] view
    garbage = torch.full(poisoned[~used].shape, float("nan"))
    garbage[::2] = float("inf")
    garbage[1::4] = -float("inf")
    poisoned[~used] = garbage
    assert torch.equal(batch.logits(list(range(64)), padded=True, extra_cols=2), clean)
    assert layout.blocks_for(max(lengths) + 1) <= 15


def test_decode_validates_inputs(model: TinyModel) -> None:
    pool = model.kv_layout(BLOCK).new_pool(4)
    with pytest.raises(ValueError):  # position 16 needs a second block
        model.decode(torch.tensor([1]), torch.tensor([16]), [torch.tensor([0])], pool)
    with pytest.raises(ValueError):
        model.decode(torch.tensor([1, 2]), torch.tensor([3]), [torch.tensor([0])], pool)
    with pytest.raises(ValueError):
        model.decode(torch.tensor([1]), torch.tensor([3]), [torch.tensor([0])], model.kv_layout(BLOCK).new_pool(4)[:, :1])
    assert model.decode(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), [], pool).shape == (0,)


def test_deterministic_exp_is_accurate_and_position_independent() -> None:
    from examples.tiny_model import _exp_, _silu

    x = torch.linspace(-30.0, 30.0, 10_007)
    e = _exp_(x.clone())
    assert torch.allclose(e, torch.exp(x), rtol=1e-6, atol=0.0)
    assert torch.allclose(_silu(x), torch.nn.functional.silu(x), rtol=1e-5, atol=1e-6)
    for start in range(0, 40, 3):  # vectorised body or scalar tail: the same bits
        for n in (1, 5, 17, 33):
            assert torch.equal(_exp_(x[start : start + n].clone()), e[start : start + n])
            assert torch.equal(_silu(x[start : start + n].clone()), _silu(x)[start : start + n])


def test_prefill_equals_token_by_token_decode(model: TinyModel) -> None:
    """A 150-token prefill (chunked attention, M=150 linears) == feeding the prompt one token at a time."""
    prompt = _prompt(150, 8)
    layout = model.kv_layout(BLOCK)
    blocks = torch.randperm(12, generator=torch.Generator().manual_seed(8))[: layout.blocks_for(150)]
    pool_a, pool_b = layout.new_pool(12), layout.new_pool(12)
    expected = model.prefill_logits(prompt, pool_a, blocks)
    for t, token in enumerate(prompt):
        last = model.decode_logits(torch.tensor([token]), torch.tensor([t]), [blocks], pool_b)[0]
    assert torch.equal(last, expected)
    assert torch.equal(pool_a, pool_b)
