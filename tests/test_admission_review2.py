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
