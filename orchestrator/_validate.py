"""Checks a request passes at ``submit``, before anything is queued or allocated."""

from __future__ import annotations

from transports import InvalidRequestId, KVSlice, check_handle, check_request_id

from ._config import Mode, OrchestratorConfig
from ._errors import ContextTooLong, InvalidRequest
from ._receiver import plan_chunks, shift_heads
from ._requests import GenRequest, KVSource, kv_blocks_needed, plan_sources
from ._sampling import SamplingParams

MAX_TOKEN_ID = 1 << 31
"""Token ids are below this: a step word's bit 31 is its FINISH flag, and the tensor-parallel step
exchange carries tokens as u4 (``_step``)."""


def validate_request(cfg: OrchestratorConfig, r: GenRequest, world_size: int = 1, *,
                     requires_handle: bool = False) -> None:
    """Raise ``InvalidRequest`` naming what is wrong with ``r`` for an engine of ``cfg``;
    ``requires_handle``: its transport pulls only with the handle the CTX issued (``Transport.requires_handle``)."""
    layout = cfg.layout
    try:
        check_request_id(r.request_id)
        if r.kv_handle is not None:
            check_handle(r.kv_handle)
    except InvalidRequestId as exc:
        raise InvalidRequest(str(exc)) from None
    if r.peer is not None and type(r.peer) is not str:  # a tensor-parallel step carries peers as text: any
        # other type broke the group's step (every live request failed), so it is refused here at every size
        raise InvalidRequest(f"{r.request_id}: peer must be a str (the CTX node's address), not {type(r.peer).__name__}")
    for name in ("prompt_len", "max_tokens"):
        value = getattr(r, name)
        if type(value) is not int or value < 1:  # a float or bool breaks the step, not the submit
            raise InvalidRequest(f"{r.request_id}: {name} must be an int >= 1, got {value!r}")
    for name in ("first_token", "eos_token"):
        value = getattr(r, name)
        if (value is not None or name == "first_token") and (type(value) is not int or not 0 <= value < MAX_TOKEN_ID):
            raise InvalidRequest(f"{r.request_id}: {name} must be an int in [0, 2**31), got {value!r}")
    if r.kv_slice is not None and not isinstance(r.kv_slice, KVSlice):  # (else an AttributeError left submit)
        raise InvalidRequest(f"{r.request_id}: kv_slice must be a KVSlice or None, not {type(r.kv_slice).__name__}")
    if not isinstance(r.kv_sources, (tuple, list)) or not all(isinstance(s, KVSource) for s in r.kv_sources):
        raise InvalidRequest(f"{r.request_id}: kv_sources must be a tuple of KVSource, got {r.kv_sources!r:.80}")
    if r.sampling is not None:  # it crosses a tensor-parallel step in its wire form: what that form refuses
        # broke the group's step (every live request failed), so it is refused here, at every size
        if not isinstance(r.sampling, SamplingParams):
            raise InvalidRequest(f"{r.request_id}: sampling must be a SamplingParams or None, "
                                 f"not {type(r.sampling).__name__}")
        try:
            SamplingParams.from_wire(r.sampling.to_wire())
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"{r.request_id}: {exc}") from None
    if r.prompt_len + r.max_tokens > cfg.max_model_len:
        raise ContextTooLong(f"{r.request_id}: prompt_len + max_tokens exceeds max_model_len {cfg.max_model_len}")
    if world_size > 1 and (r.kv_slice is not None or r.local_kv is not None):
        raise InvalidRequest(f"{r.request_id}: a tensor-parallel rank pulls its own heads; give no kv_slice or local_kv")
    need = kv_blocks_needed(layout, r.prompt_len, r.max_tokens)
    if need > cfg.num_blocks:
        raise ContextTooLong(f"{r.request_id}: needs {need} KV blocks, the pool has {cfg.num_blocks}")
    kv_slice = r.kv_slice or cfg.kv_slice
    try:
        layout.check_slice(shift_heads(kv_slice, -cfg.kv_head_offset))
        plan_chunks(layout, layout.blocks_for(r.prompt_len), kv_slice, cfg.transfer_budget_bytes)
    except ValueError as exc:
        raise InvalidRequest(f"{r.request_id}: {exc}") from None
    if r.local_kv is not None:  # copied into its blocks when it is admitted: checked here, not there
        want = tuple(layout.wire_shape(layout.blocks_for(r.prompt_len), kv_slice))
        got = (tuple(getattr(r.local_kv, "shape", ())), getattr(r.local_kv, "dtype", None))
        if got != (want, layout.dtype):
            raise InvalidRequest(f"{r.request_id}: local_kv is {got[1]}{list(got[0])}, the prompt's KV here is "
                                 f"{layout.dtype}{list(want)}")
    if cfg.mode is Mode.IDEAL:
        return
    sources = r.sources()
    if not sources:
        raise InvalidRequest(f"{r.request_id}: a peer (the CTX node's address) is required")
    try:
        prompt_blocks = layout.blocks_for(r.prompt_len)
        _check_blocks(r.kv_blocks, prompt_blocks, "kv_blocks")
        _check_epoch(r.kv_epoch, "kv_epoch")
        peers = [src.peer for src in r.kv_sources]
        if len(set(peers)) != len(peers):  # one peer, one copy, one head numbering: named twice, its first
            # part's release freed what the second pulls, or the second read other heads than it said
            twice = sorted({p for p in peers if peers.count(p) > 1})
            raise ValueError(f"KV source {twice[0]!r} is named more than once (one source per peer)")
        for src in r.kv_sources:
            if type(src.peer) is not str:
                raise ValueError(f"a KV source's peer must be a str (a CTX rank's address), not {type(src.peer).__name__}")
            if type(src.head_start) is not int or (src.head_end is not None and type(src.head_end) is not int):
                raise ValueError(f"KV source {src.peer!r}: head_start and head_end must be ints, got "
                                 f"{src.head_start!r}:{src.head_end!r}")
            if not src.peer or src.head_start < 0 or (src.head_end is not None and src.head_end <= src.head_start):
                raise ValueError(f"bad KV source {src.peer!r} heads {src.head_start}:{src.head_end}")
            if src.kv_handle is not None:
                check_handle(src.kv_handle)
            _check_blocks(src.kv_blocks, prompt_blocks, f"kv_blocks of {src.peer!r}")
            _check_epoch(src.kv_epoch, f"kv_epoch of {src.peer!r}")
        plan_sources(sources, kv_slice.head_start, kv_slice.head_end)  # this rank's heads are all held
        if cfg.total_kv_heads is not None:  # and every other rank's: else the request fails after admission
            plan_sources(sources, 0, cfg.total_kv_heads)
    except (ValueError, InvalidRequestId) as exc:
        raise InvalidRequest(f"{r.request_id}: {exc}") from None
    if requires_handle and (missing := [s.peer for s in sources if s.kv_handle is None]):
        # refused here, not at the pull: the request failed as a protocol error after taking budget and blocks
        raise InvalidRequest(f"{r.request_id}: kv_handle is required (the handle the CTX issued with the prefill; "
                             f"KVStore.put returns it): none for {', '.join(map(repr, missing))}")


def _check_blocks(blocks: object, prompt_blocks: int, what: str) -> None:
    """A CTX block list given with the request: a tuple of one non-negative int per prompt block."""
    if blocks is None:
        return
    if (not isinstance(blocks, tuple) or len(blocks) != prompt_blocks
            or not all(type(b) is int and 0 <= b < 1 << 31 for b in blocks)):
        n = len(blocks) if isinstance(blocks, (tuple, list)) else type(blocks).__name__
        raise ValueError(f"{what} must be a tuple of {prompt_blocks} block ids (one per prompt block), got {n}")


def _check_epoch(epoch: object, what: str) -> None:
    """A CTX store's epoch given with the request: None or a non-negative int."""
    if epoch is not None and (type(epoch) is not int or not 0 <= epoch < 1 << 63):
        raise ValueError(f"{what} must be a non-negative integer, got {epoch!r}")
