"""The GEN node's generate path, in this process: a real engine stepped by hand, the event loop's
deliveries (``call_soon_threadsafe``) held back so that the windows between them can be tested."""

from __future__ import annotations

import argparse

import anyio
import pytest

from examples.two_node import control, gen
from orchestrator import DecodeLoop
from tests.test_control import gen_args

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _args(*extra: str) -> argparse.Namespace:
    return gen_args("--mode", "ideal", "--step", "device", "--device-step-ms", "0", *extra)


class _Stream:
    """A client's connection: what the node sent it; ``closed`` set = the client went away."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = anyio.Event()

    async def send(self, obj: dict) -> None:
        if self.closed.is_set():
            raise anyio.BrokenResourceError  # the client is gone
        self.sent.append(obj)

    async def receive(self) -> dict:
        await self.closed.wait()
        raise anyio.EndOfStream


def _node() -> tuple[gen.GenNode, list]:
    node = gen.GenNode(_args("--num-blocks", "64"))
    held: list = []
    node._call = held.append  # the execution thread's call_soon_threadsafe, run when the test says
    node.engine = node._new_engine()
    node.loop = DecodeLoop(node.engine)
    return node, held


async def _run_held(held: list) -> None:
    while held:
        held.pop(0)()
    await anyio.wait_all_tasks_blocked()


async def test_a_request_id_is_refused_until_its_previous_request_s_last_output_is_out() -> None:
    """The engine lets an id go before the event loop has delivered that request's last output; a
    generate that reused it then got the old request's tokens and its 'aborted' (and ran unheard).
    Now the id is refused until that output is out, then accepted, and each stream gets its own."""
    node, held = _node()
    engine = node.engine
    msg = {"op": "generate", "request_id": "r1", "prompt_len": 20, "first_token": 5, "max_tokens": 50}
    a, b, c = _Stream(), _Stream(), _Stream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(node._generate, msg, a)
        await anyio.wait_all_tasks_blocked()
        for _ in range(3):
            engine.step()
        a.closed.set()  # A's client goes away: its request is aborted
        await anyio.wait_all_tasks_blocked()
        for _ in range(2):
            engine.step()  # the abort applied, the id let go, the final output not delivered yet
        assert engine.live_requests == 0
        with anyio.fail_after(5), pytest.raises(control.ControlError, match="already live"):  # (taken: it would wait)
            await node._generate(dict(msg, max_tokens=5), b)
        await _run_held(held)  # the loop delivers A's last output: the id is free
        tg.start_soon(node._generate, dict(msg, max_tokens=5), c)
        await anyio.wait_all_tasks_blocked()
        for _ in range(10):
            engine.step()
            await _run_held(held)
    assert b.sent == [] and c.sent and c.sent[-1].get("state") == "finished"
    assert sum(len(m.get("tokens", ())) for m in c.sent) == 4  # its own 4 new tokens, none of A's
    assert engine.statistics().aborted == 1 and engine.statistics().finished == 1


async def test_a_client_that_leaves_after_its_request_ended_aborts_nothing() -> None:
    """A's request ends in the engine; its client leaves before reading 'done': nothing is aborted
    (before, A's cleanup aborted by id, which could kill a newer request that reused it)."""
    node, held = _node()
    engine = node.engine
    msg = {"op": "generate", "request_id": "r2", "prompt_len": 20, "first_token": 5, "max_tokens": 3}
    a = _Stream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(node._generate, msg, a)
        await anyio.wait_all_tasks_blocked()
        for _ in range(6):
            engine.step()
        aborts: list[str] = []
        real = engine.abort
        engine.abort = lambda rid: (aborts.append(rid), real(rid))[1]  # type: ignore[method-assign]
        while held:  # A's outputs reach its queue (its id is free again) ...
            held.pop(0)()
        a.closed.set()  # ... and its client leaves before they are sent
        with anyio.fail_after(10):
            while "r2" in node._streams:  # A's generate ended
                await anyio.sleep(0.01)
        assert aborts == [] and a.sent == []


@pytest.mark.parametrize("line", [b'{"op": "ping", "x": NaN}', b'{"op": "ping", "x": Infinity}',
                                  b'{"op": "ping", "x": ' + b"1" * 5000 + b"}"])
def test_control_lines_that_python_would_misread_are_refused_as_invalid_json(line: bytes) -> None:
    with pytest.raises(control.ControlError, match="invalid JSON"):
        control._decode(line, 1 << 20)


@pytest.mark.parametrize("bad", [{"kv_sources": 5}, {"sampling": {"top_k": float("inf")}},
                                 {"sampling": {"seed": float("inf")}},
                                 {"sampling": {"temperature": 1.0}, "logprobs": True},
                                 {"sampling": {"temperature": 1.0}, "logprobs": 21},
                                 {"sampling": {"temperature": 1.0}, "logprobs": "3"},
                                 {"logprobs": 3},  # ignored without a word before (no sampling object)
                                 {"sampling": {"suppress": "257"}},  # was taken as the ids (2, 5, 7)
                                 {"sampling": {"seed": 2.9}}, {"sampling": {"min_tokens": True}},
                                 {"sampling": {"temperature": "0.7"}}, {"sampling": {"top_k": "5"}},
                                 {"sampling": {"suppress": [257.9]}}])
async def test_a_malformed_generate_is_a_clear_error_not_a_crash(bad: dict) -> None:
    """Before, these raised TypeError or OverflowError out of the handler: the client got no answer
    and the node logged a traceback."""
    import dataclasses

    from orchestrator import Mode

    node, _ = _node()
    node.config = dataclasses.replace(node.config, mode=Mode.ORCHESTRATED)  # a pulling GEN's checks
    msg = {"op": "generate", "request_id": "bad", "prompt_len": 20, "first_token": 5, "max_tokens": 3,
           "kv_peer": "127.0.0.1:1", "kv_handle": "ab" * 16, **bad}
    with anyio.fail_after(5), pytest.raises(control.ControlError):
        await node._generate(msg, _Stream())
    assert node.engine.live_requests == 0


async def test_a_node_draining_for_a_while_refuses_new_requests() -> None:
    """A GEN registered in etcd took new requests for its whole drain (for fronts that had not seen
    the flag yet), so a client that kept sending could keep the drain from ending. It takes them
    for the first seconds only; then refuses (a front sends the request to another GEN)."""
    import time

    from examples.two_node import membership

    node, _ = _node()
    reg = membership.Registration.__new__(membership.Registration)
    reg.draining_since = None
    node.registration = reg  # type: ignore[assignment]
    msg = {"op": "generate", "request_id": "d1", "prompt_len": 20, "first_token": 5, "max_tokens": 3}
    reg.draining_since = time.monotonic()  # the drain just began: still served
    async with anyio.create_task_group() as tg:
        tg.start_soon(node._generate, msg, _Stream())
        await anyio.wait_all_tasks_blocked()
        assert node.engine.live_requests == 1
        tg.cancel_scope.cancel()
    reg.draining_since -= membership.ACCEPT_WHILE_DRAINING_S + 0.1
    with anyio.fail_after(5), pytest.raises(control.ControlError, match="draining"):  # (accepted: it would wait)
        await node._generate(dict(msg, request_id="d2"), _Stream())


@pytest.mark.parametrize("prompt_len", [17, 32])
async def test_a_prompt_len_other_than_the_ctx_s_prefill_is_refused(prompt_len: int) -> None:
    """A CTX's handle names the prompt's length (``transports._ids.handle_tokens``). Before, a generate
    whose prompt_len disagreed with the prefill but needed as many blocks (20 vs 17 or 32 tokens in
    blocks of 16) pulled the same KV and decoded from the wrong position: a wrong answer, finished
    and with matching KV checksums."""
    import dataclasses

    from orchestrator import Mode
    from transports._ids import handle_key, new_handle

    node, _ = _node()
    node.config = dataclasses.replace(node.config, mode=Mode.ORCHESTRATED)
    handle = new_handle("p1", handle_key(None), num_tokens=20)  # (--insecure: the fixed key)
    msg = {"op": "generate", "request_id": "p1", "prompt_len": prompt_len, "first_token": 5, "max_tokens": 3,
           "kv_peer": "127.0.0.1:1", "kv_handle": handle}
    with anyio.fail_after(5), pytest.raises(control.ControlError, match="disagrees with the CTX's prefill"):
        await node._generate(msg, _Stream())
    assert node.engine.live_requests == 0


async def test_a_refusal_says_whether_it_is_about_the_request_or_the_node() -> None:
    """A front retried a request that no GEN could take (prompt + max_tokens needs more KV blocks than
    the pool has) on every GEN and marked each down for all clients: the refusal now names its kind."""
    node, _ = _node()  # 64 blocks of 16 tokens
    too_big = {"op": "generate", "request_id": "big", "prompt_len": 20, "first_token": 5, "max_tokens": 1100}
    with anyio.fail_after(5), pytest.raises(control.ControlError, match="KV blocks") as caught:
        await node._generate(too_big, _Stream())
    assert caught.value.code == "context_length_exceeded"
    node.shutting_down = True
    with anyio.fail_after(5), pytest.raises(control.ControlError, match="shutting down") as caught:
        await node._generate(dict(too_big, request_id="s", max_tokens=3), _Stream())
    assert caught.value.code == control.UNAVAILABLE
    assert node.engine.live_requests == 0


async def test_a_refusal_s_code_reaches_the_caller() -> None:
    async def handler(msg: dict, stream: control.JsonStream) -> None:
        raise control.ControlError("no", code="context_length_exceeded")

    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: control.serve("127.0.0.1", 0, handler, secret=None, insecure=True,
                                                                task_status=task_status))
        with anyio.fail_after(5), pytest.raises(control.ControlError) as caught:
            await control.call(f"127.0.0.1:{port}", {"op": "x"}, secret=None)
        assert caught.value.code == "context_length_exceeded"
        tg.cancel_scope.cancel()
