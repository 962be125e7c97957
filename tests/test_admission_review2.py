"""Findings of a second outside review of admission, against the public API (each test fails on the
code before its fix): bad input is refused at the call that takes it, at every TP size."""

from __future__ import annotations

import pytest

from orchestrator import GenRequest, InvalidRequest, RequestState
from orchestrator._sampling import SamplingParams
from tests.group_harness import PEER


# -- 1. sampling parameters the step exchange cannot carry ------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(top_k=2.5), SamplingParams(temperature=True),
                                      SamplingParams(suppress=(1.5,)), {"temperature": 0.5}])
async def test_sampling_the_step_exchange_refuses_is_refused_at_submit_and_the_group_lives(
        make_group, world: int, sampling: object) -> None:
    # SamplingParams checks ranges, not types: a top_k of 2.5 reached the group's step, whose wire form
    # refused it, and the group broke: every live request failed INTERNAL, not only the bad one
    g = await make_group(world)
    g.submit("innocent", max_tokens=6)
    await g.step()
    with pytest.raises(InvalidRequest, match="sampling"):
        g.lead.submit(GenRequest("bad", prompt_len=8, first_token=7, max_tokens=4, peer=PEER,
                                 kv_handle=g.ctx.prefill("bad", 8), sampling=sampling))  # type: ignore[arg-type]
    g.lead.submit(GenRequest("good", prompt_len=8, first_token=7, max_tokens=4, peer=PEER,
                             kv_handle=g.ctx.prefill("good", 8), sampling=SamplingParams(temperature=0.7, seed=3)))
    await g.run_until_idle()
    assert g.lead.health() is None
    assert g.final("innocent").state is RequestState.FINISHED and g.final("good").state is RequestState.FINISHED
    g.ctx.store.release("bad", handle=g.ctx.handles["bad"])  # (never submitted: its CTX copy goes here)


# -- 2. a peer that is not a str ---------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["peer", "kv_sources"])
async def test_a_peer_that_is_not_a_str_is_refused_at_submit_and_the_group_lives(make_group, world: int,
                                                                                  where: str) -> None:
    # a peer of 123 was accepted: a lone GEN failed it at the pull, but a group's step, which carries
    # the peers as text, could not be encoded and the group broke (every live request failed INTERNAL)
    from orchestrator import KVSource

    g = await make_group(world)
    g.submit("innocent", max_tokens=6)
    await g.step()
    where_kw = {"peer": 123} if where == "peer" else {"peer": None, "kv_sources": (KVSource(123),)}  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="peer"):
        g.lead.submit(GenRequest("bad", prompt_len=8, first_token=7, max_tokens=4, kv_handle=g.ctx.prefill("bad", 8),
                                 **where_kw))  # type: ignore[arg-type]
    await g.run_until_idle()
    assert g.lead.health() is None and g.final("innocent").state is RequestState.FINISHED
    g.ctx.store.release("bad", handle=g.ctx.handles["bad"])
