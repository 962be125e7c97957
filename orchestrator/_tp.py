"""Tensor parallelism is a way of agreeing, not a second engine.

A GEN tensor-parallel group runs one ``GenEngine`` per rank, each with its own execution thread,
event loop, receive group, budget and KV pool holding only its KV heads
(``OrchestratorConfig.kv_head_offset``). The step is the same at every size (see ``_engine``); a
group only plugs in an agreement that is one collective per step (``_step.TorchStepSync`` over
torch.distributed, ``_step.LocalGroup`` for ranks in one process). ``TPGenEngine`` is that
constructor, nothing more.
"""

from __future__ import annotations

from typing import Any

from ._engine import GenEngine
from ._step import Agreement


class TPGenEngine(GenEngine):
    """A ``GenEngine`` that is one rank of a tensor-parallel group: ``sync`` is its agreement."""

    def __init__(self, *args: Any, sync: Agreement, **kwargs: Any) -> None:
        super().__init__(*args, agreement=sync, **kwargs)
