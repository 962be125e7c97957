"""Checks a request passes at ``submit``, before anything is queued or allocated."""

from __future__ import annotations

from transports import InvalidRequestId, check_handle, check_request_id

from ._config import Mode, OrchestratorConfig
from ._errors import InvalidRequest
from ._receiver import plan_chunks, shift_heads
from ._requests import GenRequest, plan_sources


def validate_request(cfg: OrchestratorConfig, r: GenRequest, world_size: int = 1) -> None:
    """Raise ``InvalidRequest`` naming what is wrong with ``r`` for an engine of ``cfg``."""
    layout = cfg.layout
    try:
        check_request_id(r.request_id)
        if r.kv_handle is not None:
            check_handle(r.kv_handle)
    except InvalidRequestId as exc:
        raise InvalidRequest(str(exc)) from None
    if r.prompt_len < 1 or r.max_tokens < 1:
        raise InvalidRequest(f"{r.request_id}: prompt_len and max_tokens must be >= 1")
    if r.prompt_len + r.max_tokens > cfg.max_model_len:
        raise InvalidRequest(f"{r.request_id}: prompt_len + max_tokens exceeds max_model_len {cfg.max_model_len}")
    if world_size > 1 and (r.kv_slice is not None or r.local_kv is not None):
        raise InvalidRequest(f"{r.request_id}: a tensor-parallel rank pulls its own heads; give no kv_slice or local_kv")
    need = layout.blocks_for(r.prompt_len + r.max_tokens)
    if need > cfg.num_blocks:
        raise InvalidRequest(f"{r.request_id}: needs {need} KV blocks, the pool has {cfg.num_blocks}")
    kv_slice = r.kv_slice or cfg.kv_slice
    try:
        layout.check_slice(shift_heads(kv_slice, -cfg.kv_head_offset))
        plan_chunks(layout, layout.blocks_for(r.prompt_len), kv_slice, cfg.transfer_budget_bytes)
    except ValueError as exc:
        raise InvalidRequest(f"{r.request_id}: {exc}") from None
    if cfg.mode is Mode.IDEAL:
        return
    sources = r.sources()
    if not sources:
        raise InvalidRequest(f"{r.request_id}: a peer (the CTX node's address) is required")
    try:
        for src in r.kv_sources:
            if not src.peer or src.head_start < 0 or (src.head_end is not None and src.head_end <= src.head_start):
                raise ValueError(f"bad KV source {src.peer!r} heads {src.head_start}:{src.head_end}")
            if src.kv_handle is not None:
                check_handle(src.kv_handle)
        plan_sources(sources, kv_slice.head_start, kv_slice.head_end)  # this rank's heads are all held
    except (ValueError, InvalidRequestId) as exc:
        raise InvalidRequest(f"{r.request_id}: {exc}") from None
