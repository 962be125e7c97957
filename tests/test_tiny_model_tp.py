"""The tiny model tensor-parallel: TP2 and TP4 rank groups (real processes, gloo on 127.0.0.1)
give the single-process tokens and KV bit for bit, and take over a TP1 prefill's KV head slices.

The default config has 4 query heads and 2 KV heads: TP2 splits the KV heads, TP4 replicates
each on 2 ranks. Each group is started once per module (``tp_run``) and runs every scenario; the
tests then compare what the ranks saved against this process's single-process model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.tiny_model import BOS_ID, ModelConfig, TensorParallel, TinyModel
from examples.tp import Span, plan_shards, run_local_group
from transports import KVLayout, gather, scatter

BLOCK = 16
CONFIG = ModelConfig()
GEN_SPECS = [(23, 9), (40, 5), (5, 11), (17, 7), (33, 8)]  # (prompt length, new tokens): batched paged run
HANDOVER_SPECS = [(50, 8), (16, 6), (29, 9)]  # prefilled by a TP1 CTX node, decoded by the TP group


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(2000 + seed)
    return [BOS_ID, *torch.randint(0, 256, (n - 1,), generator=g).tolist()]


def _allocate(layout: KVLayout, specs: list[tuple[int, int]], seed: int, spare: int = 7) -> tuple[int, list[torch.Tensor]]:
    """A pool size and, per sequence, its shuffled block ids (room for prompt + new tokens)."""
    need = [layout.blocks_for(n + k) for n, k in specs]
    total = sum(need) + spare
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    starts = [sum(need[:i]) for i in range(len(need))]
    return total, [perm[s : s + k] for s, k in zip(starts, need, strict=True)]


def _decode_all(model: TinyModel, pool: torch.Tensor, blocks, prompts, out: list[list[int]], specs) -> None:
    """Batched decode steps until every sequence has its tokens; sequences leave as they finish.
    Odd steps pass a padded [B, width] table (padding -1) instead of a list."""
    pos = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
    for step in range(100):
        live = [i for i, (_, k) in enumerate(specs) if len(out[i]) < k]
        if not live:
            return
        tokens = torch.tensor([out[i][-1] for i in live])
        positions = torch.tensor([pos[i] for i in live])
        tables: list[torch.Tensor] | torch.Tensor = [blocks[i] for i in live]
        if step % 2:
            width = max(len(t) for t in tables) + 2
            padded = torch.full((len(live), width), -1, dtype=torch.int64)
            for r, t in enumerate(tables):
                padded[r, : len(t)] = t
            tables = padded
        for i, t in zip(live, model.decode(tokens, positions, tables, pool).tolist(), strict=True):
            out[i].append(t)
            pos[i] += 1
    raise AssertionError("decode did not finish")


def _paged_generation(model: TinyModel) -> dict:
    """Paged prefill of every GEN_SPECS prompt, then batched decode; pools after prefill and at the end."""
    layout = model.kv_layout(BLOCK)
    total, blocks = _allocate(layout, GEN_SPECS, seed=11)
    pool = layout.new_pool(total)
    prompts = [_prompt(n, i) for i, (n, _) in enumerate(GEN_SPECS)]
    out = [[model.prefill(p, pool, b)] for p, b in zip(prompts, blocks, strict=True)]
    after_prefill = pool.clone()
    _decode_all(model, pool, blocks, prompts, out, GEN_SPECS)
    return {"tokens": out, "blocks": blocks, "after_prefill": after_prefill, "final": pool}


def _ctx_prefill_tp1(model: TinyModel) -> dict:
    """The CTX TP1 side of the hand-over: prompts prefilled into a CTX pool at its own blocks."""
    layout = model.kv_layout(BLOCK)
    prompts = [_prompt(n, 100 + i) for i, (n, _) in enumerate(HANDOVER_SPECS)]
    total, blocks = _allocate(layout, [(n, 0) for n, _ in HANDOVER_SPECS], seed=12, spare=3)
    pool = layout.new_pool(total)
    firsts = [model.prefill(p, pool, b) for p, b in zip(prompts, blocks, strict=True)]
    return {"pool": pool, "blocks": blocks, "firsts": firsts, "prompts": prompts}


def _handover_decode(model: TinyModel, ctx: dict) -> list[list[int]]:
    """GEN side: pull this rank's head slice of each request's CTX blocks into other blocks, decode."""
    layout = model.kv_layout(BLOCK)
    total, blocks = _allocate(layout, HANDOVER_SPECS, seed=13)
    pool = layout.new_pool(total)
    for ctx_blocks, gen_blocks in zip(ctx["blocks"], blocks, strict=True):
        staged = gather(ctx["pool"], ctx_blocks, model.kv_slice())  # what the wire carries for this rank
        scatter(pool, gen_blocks[: len(ctx_blocks)], staged, layout.full_slice())
    out = [[t] for t in ctx["firsts"]]
    _decode_all(model, pool, blocks, ctx["prompts"], out, HANDOVER_SPECS)
    return out


def _count_all_reduces(fn):
    """``fn()`` and how many all-reduces it made in this process."""
    import examples.tp as tp_module

    calls = []
    real = tp_module.dist.all_reduce

    def counting(t, *args, **kwargs):
        calls.append(t.shape)
        return real(t, *args, **kwargs)

    tp_module.dist.all_reduce = counting
    try:
        result = fn()
    finally:
        tp_module.dist.all_reduce = real
    return result, len(calls)


def _logit_probes(model: TinyModel) -> list:
    """(logits, all-reduces) of a 70-token prefill and of a B=3 decode step over it and others."""
    pool = model.kv_layout(BLOCK).new_pool(8)
    return [
        _count_all_reduces(lambda: model.prefill_logits(_prompt(70, 7), pool, torch.arange(5))),
        _count_all_reduces(
            lambda: model.decode_logits(torch.tensor([1, 2, 3]), torch.tensor([70, 3, 20]), [torch.arange(5), [5], [6, 7]], pool)
        ),
    ]


def _rank(tp: TensorParallel, workdir: str) -> None:
    """One rank of the group: every scenario, results saved for the test process to compare."""
    ctx = torch.load(Path(workdir, "ctx.pt"))
    model = TinyModel(CONFIG, tp=tp)
    gen = _paged_generation(model)
    handover = _handover_decode(model, ctx)
    layout = model.kv_layout(BLOCK)
    probes = _logit_probes(model)
    try:
        TinyModel(CONFIG, tp=TensorParallel((tp.rank + 1) % tp.size, tp.size))  # not this process's rank
        wrong_rank = "accepted"
    except ValueError as exc:
        wrong_rank = str(exc)
    torch.save(
        {
            "kv_head_range": tuple(model.kv_head_range()),
            "local_kv_heads": layout.num_kv_heads,
            "gen": gen,
            "handover": handover,
            "probes": probes,
            "wrong_rank": wrong_rank,
        },
        Path(workdir, f"rank{tp.rank}.pt"),
    )


# --- fixtures: the single-process oracle and one run of each group --------------------------------


@pytest.fixture(scope="module")
def tp1() -> TinyModel:
    return TinyModel(CONFIG)


@pytest.fixture(scope="module")
def tp1_gen(tp1: TinyModel) -> dict:
    return _paged_generation(tp1)


@pytest.fixture(scope="module")
def tp1_ctx(tp1: TinyModel) -> dict:
    return _ctx_prefill_tp1(tp1)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_run(request: pytest.FixtureRequest, tp1_ctx: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    size = request.param
    workdir = tmp_path_factory.mktemp(f"tp{size}")
    torch.save(tp1_ctx, workdir / "ctx.pt")
    run_local_group(_rank, size, str(workdir), timeout_s=90)
    results = [torch.load(workdir / f"rank{r}.pt") for r in range(size)]
    for f in workdir.iterdir():
        f.unlink()
    return results


# --- tests ------------------------------------------------------------------------------------


def test_tp_generation_equals_reference(tp_run: list[dict], tp1: TinyModel, tp1_gen: dict) -> None:
    """Paged prefill + batched paged decode on every rank == generate_reference, bit for bit."""
    prompts = [_prompt(n, i) for i, (n, _) in enumerate(GEN_SPECS)]
    expected = [tp1.generate_reference(p, k) for p, (_, k) in zip(prompts, GEN_SPECS, strict=True)]
    assert tp1_gen["tokens"] == expected
    for r, res in enumerate(tp_run):
        assert res["gen"]["tokens"] == expected, f"rank {r}"


def test_tp_pools_are_head_slices_of_tp1(tp_run: list[dict], tp1_gen: dict) -> None:
    """Each rank's pool, after prefill and after decoding, == its KV heads of the TP1 pool, per block."""
    size = len(tp_run)
    plans = [plan_shards(CONFIG, TensorParallel(r, size)) for r in range(size)]
    for r, res in enumerate(tp_run):
        h0, h1 = res["kv_head_range"]
        assert (h0, h1) == plans[r].kv_heads
        assert res["local_kv_heads"] == h1 - h0
        for key in ("after_prefill", "final"):
            mine, full = res["gen"][key], tp1_gen[key]
            assert mine.shape[3] == h1 - h0
            for seq_blocks in tp1_gen["blocks"]:
                for b in seq_blocks.tolist():
                    assert torch.equal(mine[b], full[b, :, :, h0:h1]), (r, key, b)
            assert torch.equal(mine, full[:, :, :, h0:h1]), (r, key)  # untouched blocks stay zero on both


def test_tp1_kv_handed_over_to_tp_ranks_decodes_the_same(tp_run: list[dict], tp1: TinyModel, tp1_ctx: dict) -> None:
    """CTX TP1 prefill -> each GEN rank pulls its head slice into other blocks -> TPn decode == TP1."""
    expected = [tp1.generate_reference(p, k) for p, (_, k) in zip(tp1_ctx["prompts"], HANDOVER_SPECS, strict=True)]
    assert [e[0] for e in expected] == tp1_ctx["firsts"]
    assert _handover_decode(tp1, tp1_ctx) == expected  # TP1 -> TP1, the same path
    for r, res in enumerate(tp_run):
        assert res["handover"] == expected, f"rank {r}"


def test_tp_logits_equal_tp1_and_two_all_reduces_per_layer(tp_run: list[dict], tp1: TinyModel) -> None:
    """Prefill and batched decode logits == TP1's bit for bit (tokens alone would hide a last-bit
    error); one all-reduce per row-parallel layer per step, whatever the batch or prompt length."""
    expected = [logits for logits, _ in _logit_probes(tp1)]
    for r, res in enumerate(tp_run):
        for (logits, reduces), want in zip(res["probes"], expected, strict=True):
            assert torch.equal(logits, want), f"rank {r}"
            assert reduces == 2 * CONFIG.num_layers


def test_tp_rank_must_match_the_group(tp_run: list[dict]) -> None:
    for res in tp_run:
        assert "but the group has rank" in res["wrong_rank"]


def test_tp_shards_are_slices_of_the_full_weights(tp1: TinyModel) -> None:
    """Built without a group (no collective runs): each rank's weights == slices of the TP1 model's."""
    c, d = CONFIG, CONFIG.head_dim
    full = tp1.state_dict()
    hidden, kv_dim = c.hidden_size, c.num_kv_heads * d
    for size in (2, 4):
        for r in range(size):
            m = TinyModel(CONFIG, tp=TensorParallel(r, size))
            q, kv, f = m.shard.q_heads, m.shard.kv_heads, m.shard.ffn
            qkv_cols = [*range(q.start * d, q.stop * d)]
            qkv_cols += [hidden + i for i in range(kv.start * d, kv.stop * d)]
            qkv_cols += [hidden + kv_dim + i for i in range(kv.start * d, kv.stop * d)]
            gu_cols = [*range(f.start, f.stop), *(c.ffn_dim + i for i in range(f.start, f.stop))]
            mine = m.state_dict()
            assert mine.keys() == full.keys()
            for name, w in mine.items():
                if name.endswith(".qkv"):
                    want = full[name][:, qkv_cols]
                elif name.endswith(".gate_up"):
                    want = full[name][:, gu_cols]
                elif name.endswith(".o"):
                    want = full[name][q.start * d : q.stop * d]
                elif name.endswith(".down"):
                    want = full[name][f.start : f.stop]
                else:
                    want = full[name]  # embed, norms, lm_head: replicated
                assert torch.equal(w, want), (size, r, name)
            assert m.layers[0].o.scale == tp1.layers[0].o.scale  # the full layer's scale


@pytest.mark.parametrize(
    ("config", "size"),
    [(ModelConfig(num_heads=4, num_kv_heads=2), 4), (ModelConfig(num_heads=8, num_kv_heads=2, head_dim=16), 8)],
)
def test_shard_plan_heads(config: ModelConfig, size: int) -> None:
    """Every query head on exactly one rank, with the KV head it reads; KV heads split or replicated."""
    plans = [plan_shards(config, TensorParallel(r, size)) for r in range(size)]
    assert [p.q_heads for p in plans] == [Span(r, r + 1) for r in range(size)]
    assert all(p.kv_replicas == size // config.num_kv_heads for p in plans)
    for p in plans:
        assert all(p.kv_heads.start <= h // config.group_size < p.kv_heads.stop for h in range(*p.q_heads))
    held = [h for p in plans for h in range(*p.kv_heads)]
    assert sorted(held) == sorted(list(range(config.num_kv_heads)) * (size // config.num_kv_heads))


def test_tp1_plan_and_layout_unchanged(tp1: TinyModel) -> None:
    assert tp1.kv_head_range() == (0, CONFIG.num_kv_heads)
    assert tp1.kv_slice() == tp1.kv_layout(BLOCK).full_slice()
    assert tp1.shard.q_heads == (0, CONFIG.num_heads) and tp1.shard.ffn == (0, CONFIG.ffn_dim)
    assert plan_shards(CONFIG, TensorParallel(0, 2)).kv_heads == (0, 1)
    assert plan_shards(CONFIG, TensorParallel(3, 4)).kv_heads == (1, 2)


@pytest.mark.parametrize(
    ("config", "rank", "size", "match"),
    [
        (CONFIG, 0, 3, "must divide num_heads"),  # 4 query heads over 3 ranks
        (CONFIG, 0, 8, "must divide num_heads"),
        (ModelConfig(num_heads=6, num_kv_heads=3), 1, 2, "neither holds"),  # 3 KV heads over 2 ranks
        (ModelConfig(num_heads=12, num_kv_heads=4, head_dim=16), 0, 6, "neither holds"),  # 6 % 4, 4 % 6
        (ModelConfig(ffn_dim=390), 0, 4, "must divide ffn_dim"),
        (CONFIG, 2, 2, "not a valid rank"),
        (CONFIG, 0, 0, "not a valid rank"),
    ],
)
def test_invalid_tp_combinations_raise(config: ModelConfig, rank: int, size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TinyModel(config, tp=TensorParallel(rank, size))
