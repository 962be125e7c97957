"""The running batch's columns, kept between decode steps, are what building them afresh gives."""

from __future__ import annotations

import random

import numpy as np
import torch

from orchestrator import GenRequest
from orchestrator._batch import RunningBatch
from orchestrator._requests import Sequence


def _seq(i: int, rng: random.Random) -> Sequence:
    request = GenRequest(f"r{i}", prompt_len=rng.randint(1, 50), first_token=rng.randint(0, 99),
                         max_tokens=rng.randint(2, 9), eos_token=rng.choice([None, 3, 5]))
    return Sequence(request=request, arrival=0.0, num_blocks=1, num_prompt_blocks=1, cost=1, seq_no=i,
                    block_ids=torch.tensor([i]), num_tokens=1, last_token=request.first_token)


def test_columns_kept_between_steps_equal_columns_built_afresh() -> None:
    """Random joins, leaves (also a join and leave between two decodes) and agreed tokens: the kept
    columns always equal those of the running requests in the order they started, with every
    request's token count and newest token as if they were kept per request."""
    rng = random.Random(7)
    batch = RunningBatch()
    running: dict[int, Sequence] = {}  # what the engine's ``_running`` holds, in order
    counts: dict[int, tuple[int, int]] = {}  # per request: (tokens, newest token), kept one by one
    n = 0
    given: list[tuple[torch.Tensor, np.ndarray]] = []  # inputs handed to a step, and their values then
    for _ in range(300):
        for _ in range(rng.randint(0, 3)):
            seq = _seq(n, rng)
            n += 1
            running[seq.seq_no] = seq
            counts[seq.seq_no] = (1, seq.last_token)
            batch.add(seq)
        for seq_no in rng.sample(sorted(running), k=min(len(running), rng.randint(0, 2))):
            batch.remove(running.pop(seq_no))
        b = batch.columns()
        assert not b.changed
        assert b.seqs == list(running.values())
        assert b.request_ids == [s.request_id for s in running.values()]
        assert [t.item() for t in b.block_tables] == list(running)
        assert b.seq_nos.tolist() == list(running)
        assert b.lengths.tolist() == [counts[k][0] for k in running]
        assert b.inputs.tolist() == [counts[k][1] for k in running]
        assert b.positions().tolist() == [s.request.prompt_len + counts[k][0] - 1 for k, s in running.items()]
        sampled = np.array([rng.randint(0, 9) for _ in running], dtype=np.int64)
        expected_ends = [counts[k][0] + 1 >= s.request.max_tokens or t == s.request.eos_token
                         for (k, s), t in zip(running.items(), sampled.tolist())]
        assert b.ends(sampled).tolist() == expected_ends
        copy = torch.from_numpy(b.inputs.copy())
        given.append((copy, copy.numpy().copy()))
        b.advance(sampled)
        for k, t in zip(running, sampled.tolist()):
            counts[k] = (counts[k][0] + 1, t)
    for tensor, values in given:  # advancing never changed what a step was given
        assert np.array_equal(tensor.numpy(), values)


def test_a_request_that_joins_and_leaves_between_two_decodes_never_appears() -> None:
    rng = random.Random(1)
    batch = RunningBatch()
    a, b, c = (_seq(i, rng) for i in range(3))
    batch.add(a)
    batch.add(b)
    assert batch.changed
    batch.columns()
    batch.add(c)
    batch.remove(c)
    batch.remove(a)
    cols = batch.columns()
    assert cols.seqs == [b] and cols.seq_nos.tolist() == [1]
