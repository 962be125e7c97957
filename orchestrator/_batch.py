"""The running batch as columns, kept from one decode step to the next.

A decode step reads, for every RUNNING request, its newest token, its position, its block table
and (for the finish decisions) its ``max_tokens`` and EOS token. The engine keeps those as columns
(numpy arrays and lists, in the order the requests started running) instead of gathering them
from every request at every step and rank:

    add(seq) / remove(seq)   a request starts running / ends: noted, applied at the next ``columns()``
    columns()                before a decode: the pending changes applied (one pass), then the batch
    advance(tokens)          an agreed step gave every request of the decoded batch its next token

A request leaves the batch only by ending, so its token count and newest token live here while it
runs (``Sequence.num_tokens``/``last_token`` are its values before it runs)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ._requests import GenRequest, Sequence


_SEQ_NO, _PROMPT, _LIMIT, _EOS, _LENGTH, _INPUT = range(6)


class RunningBatch:
    __slots__ = ("seqs", "requests", "request_ids", "block_tables", "cols", "_added", "_removed")

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.requests: list[GenRequest] = []
        self.request_ids: list[str] = []
        self.block_tables: list[torch.Tensor] = []
        self.cols = np.zeros((6, 0), dtype=np.int64)
        """One row per column (one array: a join or leave is one numpy operation, not six)."""
        self._added: list[Sequence] = []
        self._removed: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def seq_nos(self) -> np.ndarray:
        return self.cols[_SEQ_NO]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens each request has (the CTX's first token included)."""
        return self.cols[_LENGTH]

    @property
    def inputs(self) -> np.ndarray:
        """Each request's newest token: the next decode step's input."""
        return self.cols[_INPUT]

    @property
    def changed(self) -> bool:
        """Requests joined or left since the last ``columns()``."""
        return bool(self._added or self._removed)

    def add(self, seq: Sequence) -> None:
        self._added.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self._added:  # joined and left between two decodes
            self._added.remove(seq)
        else:
            self._removed.append(seq)

    def columns(self) -> RunningBatch:
        """The batch with every pending change applied (in ``_running``'s order: joiners at the end)."""
        if self._removed:
            keep = np.ones(len(self.seqs), dtype=bool)
            index = {id(s): i for i, s in enumerate(self.seqs)} if len(self._removed) > 4 else None
            for seq in self._removed:
                keep[index[id(seq)] if index is not None else self.seqs.index(seq)] = False
            self._removed = []
            flags = keep.tolist()
            self.seqs = list(itertools.compress(self.seqs, flags))
            self.requests = list(itertools.compress(self.requests, flags))
            self.request_ids = list(itertools.compress(self.request_ids, flags))
            self.block_tables = list(itertools.compress(self.block_tables, flags))
            self.cols = self.cols[:, keep]
        if self._added:
            added, self._added = self._added, []
            requests = [s.request for s in added]
            self.seqs += added
            self.requests += requests
            self.request_ids += [r.request_id for r in requests]
            self.block_tables += [s.block_ids for s in added]  # type: ignore[misc]
            new = np.array([(s.seq_no, r.prompt_len, r.max_tokens, -1 if r.eos_token is None else r.eos_token,
                             s.num_tokens, s.last_token) for s, r in zip(added, requests)], dtype=np.int64)
            self.cols = np.concatenate((self.cols, new.T), axis=1)
        return self

    def positions(self) -> np.ndarray:
        """Where each request's newest token goes (its position in the sequence)."""
        return self.cols[_PROMPT] + self.cols[_LENGTH] - 1

    def ends(self, sampled: np.ndarray) -> np.ndarray:
        """Does each request end with its ``sampled`` token appended (``GenEngine._done``, for the batch)?"""
        return (self.cols[_LENGTH] + 1 >= self.cols[_LIMIT]) | (sampled == self.cols[_EOS])

    def advance(self, tokens: np.ndarray) -> None:
        """Every request of the decoded batch got its token of an agreed step (in place: a decode
        batch handed to the step function was given copies)."""
        self.cols[_INPUT] = tokens
        self.cols[_LENGTH] += 1
