"""The load client: summary math, prompts, run_load against fake nodes; and (integration) a real
CTX + GEN pair with the tiny model, whose tokens must equal the single-process reference."""

from __future__ import annotations

import array
import functools
import math
import socket
import struct

import anyio
import anyio.abc
import numpy as np
import pytest

from examples.two_node import control
from examples.two_node.client import LoadResult, RequestRecord, make_prompts, prompts_from_text, run_load, summarize

SECRET = b"test-control-secret-0123456789"
serve = functools.partial(control.serve, secret=SECRET)  # fake nodes, authenticated like real ones


def _rec(i: int, times: list[float], *, state: str = "finished", failure: str | None = None, ttft: float = 0.1,
         ctx_sums: list[int] | None = None, gen_sums: list[int] | None = None) -> RequestRecord:
    r = RequestRecord(f"r-{i}", i, "c", 8, len(times))
    r.tokens = list(range(len(times)))
    r.token_times = array.array("d", times)
    r.t_start = times[0] - ttft if times else 0.0
    r.t_end = times[-1] if times else 0.0
    r.ttft_s = ttft
    r.state, r.failure = state, failure
    r.ctx_checksums, r.gen_checksums = ctx_sums, gen_sums
    return r


def test_summarize_math() -> None:
    recs = [
        _rec(0, [1.0, 1.1, 1.2, 1.3], ttft=0.1, ctx_sums=[1, 2], gen_sums=[1, 2]),  # tpot 100 ms
        _rec(1, [2.0, 2.5], ttft=0.3, ctx_sums=[1], gen_sums=[9]),  # tpot 500 ms, checksum mismatch
        _rec(2, [3.0], ttft=0.2, ctx_sums=[1], gen_sums=[]),  # one token: no TPOT; not compared
        _rec(3, [4.0, 4.2], state="error", failure="timeout"),  # failure: excluded
        _rec(4, [5.0, 5.1], state="failed", failure="peer_error"),
    ]
    s = summarize(LoadResult(recs, duration_s=2.0, concurrency=4))
    assert s["requests"] == 5 and s["succeeded"] == 3 and s["failures"] == 2
    assert s["failure_reasons"] == {"timeout": 1, "peer_error": 1}
    assert s["output_tokens"] == 4 + 2 + 1
    assert s["output_tok_s"] == pytest.approx(7 / 2.0)
    # TPOT: per request (t_last - t_first) / (n - 1), then over requests
    assert s["tpot_ms"]["n"] == 2
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(100 + 0.99 * 400)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p95"] == pytest.approx(float(np.percentile([100, 300, 200], 95)))
    # ITL: gaps between streamed tokens after the first streamed one (request 0 only: 2 gaps)
    assert s["itl_ms"]["n"] == 2 and s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["kv_checksum_compared"] == 2 and s["kv_checksum_mismatches"] == 1


def test_summarize_empty_has_no_figures_rather_than_zeros() -> None:
    s = summarize(LoadResult([], duration_s=0.0, concurrency=1))
    assert s["requests"] == 0 and s["output_tok_s"] is None and s["tpot_ms"]["mean"] is None
    assert s["tpot_ms"]["n"] == 0 and s["itl_ms"]["p99"] is None
    # every request failed: nothing was measured either (not 0 tok/s, not a 0.00 ms TPOT)
    failed = summarize(LoadResult([_rec(0, [1.0, 1.1], state="error", failure="timeout")], 2.0, 1))
    assert failed["output_tok_s"] is None and failed["ttft_ms"]["mean"] is None


def test_itl_counts_one_gap_per_message_not_per_token() -> None:
    """GEN coalesces the tokens of one decode pass into one message: its tokens share one arrival
    time, and ITL (gaps between messages) must not count the 0-ms gaps between them."""
    # first token (CTX) at 1.0; messages at 1.1 (3 tokens), 1.3 (2 tokens), 1.6 (1 token)
    r = _rec(0, [1.0, 1.1, 1.1, 1.1, 1.3, 1.3, 1.6])
    s = summarize(LoadResult([r], duration_s=1.0, concurrency=1))
    assert s["itl_ms"]["n"] == 2 and s["itl_ms"]["mean"] == pytest.approx(250.0)
    assert s["itl_ms"]["p50"] == pytest.approx(250.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # TPOT stays per token: 0.6 s / 6


def test_summary_names_the_first_message_of_each_failure_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.two_node.client import print_summary

    recs = [_rec(0, [1.0, 1.1]), _rec(1, [2.0], state="error", failure="prefill_rejected"),
            _rec(2, [2.0], state="error", failure="prefill_rejected"), _rec(3, [2.0], state="failed", failure="timeout")]
    recs[1].message = "authentication failed: wrong shared secret"
    recs[2].message = "something else"
    recs[3].message = "x" * 500
    s = summarize(LoadResult(recs, duration_s=1.0, concurrency=1))
    assert s["failure_messages"] == {"prefill_rejected": "authentication failed: wrong shared secret", "timeout": "x" * 500}
    print_summary(s, "t")
    out = capsys.readouterr().out
    assert "prefill_rejected x2" in out and "authentication failed: wrong shared secret" in out
    assert "x" * 157 + "..." in out and "x" * 158 not in out  # a long message is cut, the table is not


def test_make_prompts_deterministic() -> None:
    a = make_prompts(5, 33, seed=7)
    assert a == make_prompts(5, 33, seed=7)
    assert a[:3] == make_prompts(3, 33, seed=7)  # prompt i does not depend on n
    assert a != make_prompts(5, 33, seed=8)
    assert all(len(p) == 33 and p[0] == 256 and all(32 <= t < 127 for t in p[1:]) for p in a)
    assert len({tuple(p) for p in a}) == 5
    small = make_prompts(2, 10, seed=1, vocab_size=20, bos=False)
    assert all(0 <= t < 20 for p in small for t in p)
    assert prompts_from_text(["hi"]) == [[256, 104, 105]]
    with pytest.raises(ValueError):
        make_prompts(1, 0)


# -- run_load against fake nodes (in this process) ----------------------------------------------

async def _fake_ctx(msg: dict, stream: control.JsonStream) -> None:
    ids = msg["prompt_ids"]
    if ids[1] == 33:  # a prompt the fake CTX refuses
        raise control.ControlError("refused")
    await stream.send({"ok": True, "request_id": msg["request_id"], "first_token": sum(ids) % 256,
                       "prompt_len": len(ids), "kv_peer": "127.0.0.1:9", "block_checksums": [len(ids), ids[1]]})


async def _fake_gen(msg: dict, stream: control.JsonStream) -> None:
    n, first = msg["max_tokens"], msg["first_token"]
    if first % 7 == 0:  # a request the fake GEN fails
        await stream.send({"done": True, "state": "failed", "failure": "timeout", "message": "x", "kv_checksums": []})
        return
    for k in range(1, n):
        await anyio.sleep(0.001)
        await stream.send({"tokens": [(first + k) % 256]})
    await stream.send({"done": True, "state": "finished", "failure": None, "message": "",
                       "kv_checksums": [msg["prompt_len"], 0]})


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_load_fake_nodes(anyio_backend: str) -> None:
    prompts = make_prompts(40, 12, seed=3)
    async with anyio.create_task_group() as tg:
        ctx_port = await tg.start(serve, "127.0.0.1", 0, _fake_ctx)
        gen_port = await tg.start(serve, "127.0.0.1", 0, _fake_gen)
        res = await run_load(ctx=[f"127.0.0.1:{ctx_port}"], gen=f"127.0.0.1:{gen_port}", secret=SECRET, prompts=prompts,
                             max_tokens=5, concurrency=8, progress=False, timeout_s=10)
        tg.cancel_scope.cancel()
    assert len(res.records) == 40 and [r.index for r in res.records] == list(range(40))
    for r, p in zip(res.records, prompts):
        if p[1] == 33:
            assert r.failure == "prefill_rejected" and r.state == "error"
        elif sum(p) % 256 % 7 == 0:
            assert r.state == "failed" and r.failure == "timeout"
        else:
            assert r.ok
            first = sum(p) % 256
            assert r.tokens == [(first + k) % 256 for k in range(5)]
            assert len(r.token_times) == 5 and list(r.token_times) == sorted(r.token_times)
            assert r.checksum_ok is (p[1] == 0)  # fake GEN's checksums differ unless ids[1] == 0
    s = summarize(res)
    assert s["succeeded"] + s["failures"] == 40 and s["succeeded"] > 20
    assert s["tpot_ms"]["mean"] > 0 and math.isfinite(s["ttft_ms"]["p99"])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_load_unreachable_gen_and_timeout(anyio_backend: str) -> None:
    async def slow_ctx(msg: dict, stream: control.JsonStream) -> None:
        if msg["prompt_ids"][1] % 2:
            await anyio.sleep(5)
        await _fake_ctx(msg, stream)

    prompts = [p for p in make_prompts(30, 6, seed=5) if p[1] != 33][:6]
    async with anyio.create_task_group() as tg:
        ctx_port = await tg.start(serve, "127.0.0.1", 0, slow_ctx)
        res = await run_load(ctx=[f"127.0.0.1:{ctx_port}"], gen="127.0.0.1:1", secret=SECRET, prompts=prompts,
                             max_tokens=3, concurrency=6, progress=False, timeout_s=0.5)
        tg.cancel_scope.cancel()
    for r, p in zip(res.records, prompts):
        assert not r.ok
        assert r.failure == ("timeout" if p[1] % 2 else "generate_error"), (r.failure, r.message)
        if r.failure == "generate_error":  # which node: "OSError: All connection attempts failed" said nothing
            assert r.message.startswith("127.0.0.1:1: OSError"), r.message
    assert summarize(res)["failures"] == len(prompts)
    nobody = await run_load(ctx=["127.0.0.1:1"], gen="127.0.0.1:2", secret=SECRET, prompts=prompts[:1],
                            max_tokens=3, concurrency=1, progress=False, timeout_s=5)
    assert nobody.records[0].failure == "prefill_error" and nobody.records[0].message.startswith("127.0.0.1:1: ")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("reset", "failure", "said"), [
    (True, "prefill_error", "the connection broke (ConnectionResetError"),
    (False, "prefill_closed", "the node closed the connection"),
], ids=["reset", "closed"])
async def test_a_connection_lost_mid_request_names_the_node_and_why(anyio_backend: str, reset: bool, failure: str,
                                                                    said: str) -> None:
    """A CTX killed while a client talks to it resets the connection (or, exiting, closes it: an
    end of stream): the record said only "BrokenResourceError: " (anyio's exception has no text) or
    "the node closed the connection", never which node."""
    async def lost_after_hello(conn: anyio.abc.SocketStream) -> None:  # hello, read the auth, then RST or FIN
        await conn.send(b'{"kvo": 1, "nonce": "' + b"00" * 32 + b'", "insecure": false}\n')
        await conn.receive()
        if reset:
            conn.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                        struct.pack("ii", 1, 0))
        await conn.aclose()

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, lost_after_hello)
        ctx = f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        res = await run_load(ctx=[ctx], gen="127.0.0.1:1", secret=SECRET, prompts=make_prompts(2, 6, seed=1),
                             max_tokens=3, concurrency=2, progress=False, timeout_s=5)
        tg.cancel_scope.cancel()
    for r in res.records:
        assert r.failure == failure, (r.failure, r.message)
        assert r.message.startswith(f"{ctx}: {said}"), r.message


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_that_fails_after_its_prefill_releases_the_ctx_kv(anyio_backend: str) -> None:
    """Without --release too: a GEN that failed (or could not be reached) after the prefill leaves
    the CTX holding the KV until its lease, unless the client releases it with the handle."""
    released: list[tuple[str, str]] = []

    async def ctx(msg: dict, stream: control.JsonStream) -> None:
        if msg["op"] == "release":
            released.append((msg["request_id"], msg["kv_handle"]))
            await stream.send({"ok": True})
            return
        await stream.send({"ok": True, "first_token": 65, "prompt_len": len(msg["prompt_ids"]), "kv_peer": "127.0.0.1:9",
                           "kv_handle": "h-" + msg["request_id"]})

    async def gen(msg: dict, stream: control.JsonStream) -> None:
        if msg["request_id"].endswith("-0"):  # one request fails at GEN, the other finishes
            await stream.send({"done": True, "state": "failed", "failure": "peer_error", "message": "no KV"})
        else:
            await stream.send({"done": True, "state": "finished", "tokens": [66]})

    async with anyio.create_task_group() as tg:
        ctx_port = await tg.start(serve, "127.0.0.1", 0, ctx)
        gen_port = await tg.start(serve, "127.0.0.1", 0, gen)
        res = await run_load(ctx=[f"127.0.0.1:{ctx_port}"], gen=f"127.0.0.1:{gen_port}", secret=SECRET,
                             prompts=make_prompts(2, 6), max_tokens=2, concurrency=2, progress=False, timeout_s=5,
                             id_prefix="rel")
        unreachable = await run_load(ctx=[f"127.0.0.1:{ctx_port}"], gen="127.0.0.1:1", secret=SECRET,
                                     prompts=make_prompts(1, 6), max_tokens=2, concurrency=1, progress=False,
                                     timeout_s=5, id_prefix="gone")
        tg.cancel_scope.cancel()
    assert [r.ok for r in res.records] == [False, True] and not unreachable.records[0].ok
    assert sorted(released) == [("gone-0", "h-gone-0"), ("rel-0", "h-rel-0")]  # the failed ones only


# -- integration: a real CTX + GEN pair (tiny model, UCX), tokens against the reference -----------

@pytest.mark.integration
@pytest.mark.parametrize("staging_blocks", [
    16,  # every prompt fits the window: one pull per request
    4,  # most prompts exceed the window: each is received in chunks (pull with release=False, then the last)
], ids=["window", "chunked"])
def test_two_nodes_match_reference(tmp_path, staging_blocks: int) -> None:
    pytest.importorskip("ucxx")
    from examples.bench import Node, node_env
    from examples.tiny_model import ModelConfig, TinyModel

    env = node_env()
    ctx = Node("ctx", ["--host", "127.0.0.1", "--port", "0", "--ucx-port", "0", "--num-blocks", "512"], env, tmp_path)
    try:
        gen = Node("gen", ["--ctx", ctx.info["ctrl"], "--host", "127.0.0.1", "--port", "0", "--mode", "orchestrated",
                           "--step", "model", "--num-blocks", "256", "--transfer-budget-bytes", str(staging_blocks * 16 * 1024),
                           "--max-num-seqs", "8", "--kv-transfer-timeout-ms", "20000", "--kv-checksums"], env, tmp_path)
        try:
            # varied prompt lengths (partial last blocks): 1..8 blocks each
            prompts = [p[: 9 + 7 * i] for i, p in enumerate(make_prompts(16, 120, seed=11))]
            res = anyio.run(lambda: run_load(ctx=[ctx.info["ctrl"]], gen=gen.info["ctrl"], secret=gen.secret, prompts=prompts,
                                             max_tokens=6, concurrency=8, progress=False, timeout_s=60),
                            backend="asyncio")
            stats = anyio.run(lambda: control.call(gen.info["ctrl"], {"op": "stats"}, secret=gen.secret), backend="asyncio")
        finally:
            gen.stop()
    finally:
        ctx.stop()
    s = summarize(res)
    assert s["failures"] == 0, [(r.failure, r.message) for r in res.records if not r.ok]
    assert s["kv_checksum_compared"] == 16 and s["kv_checksum_mismatches"] == 0
    model = TinyModel(ModelConfig())
    for r, p in zip(res.records, prompts):
        assert r.tokens == model.generate_reference(p, 6), r.request_id
    assert stats["rest_problems"] == [] and stats["engine"]["finished"] == 16
    assert ctx.proc.poll() is not None and gen.proc.poll() is not None


# -- the command line's plumbing (examples/two_node/cli.py) and the report's output ---------------

def test_ctrl_c_or_a_signal_is_one_line_and_its_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    from examples.two_node import cli

    before = signal.getsignal(signal.SIGTERM)
    for raised, code, line in [(KeyboardInterrupt(), 130, "interrupted (Ctrl-C)"),
                               (BaseExceptionGroup("a task group", [KeyboardInterrupt()]), 130, "interrupted (Ctrl-C)"),
                               (cli.Interrupted(143), 143, "interrupted (SIGTERM)")]:
        with pytest.raises(SystemExit) as exc, cli.unwinding():
            assert signal.getsignal(signal.SIGTERM) is not before  # SIGTERM unwinds inside
            raise raised
        assert exc.value.code == code and capsys.readouterr().err.strip() == line
    assert signal.getsignal(signal.SIGTERM) is before  # and is what it was afterwards
    with pytest.raises(ValueError), cli.unwinding():  # anything else passes through
        raise ValueError("x")


def test_progress_off_a_terminal_is_a_plain_line_every_few_seconds(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.two_node import client

    monkeypatch.setattr(client._report, "interactive", lambda: False)
    with client.Progress(3, True, "demo", every_s=0.0) as bar:
        bar.update(_rec(0, [1.0, 1.1]))
        bar.update(_rec(1, [1.0], state="error", failure="timeout"))
        bar.update()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == ["demo: 1/3 done", "demo: 2/3 done", "demo: 3/3 done"]
    assert "failures 1" in lines[1]
    with client.Progress(3, False, "quiet", every_s=0.0) as bar:  # --no-progress: nothing
        bar.update()
    assert capsys.readouterr().err == ""


def test_a_table_written_to_a_file_is_not_cut(capsys: pytest.CaptureFixture[str]) -> None:
    from examples import _report

    _report.print_table("t", ["metric", "value"], [["failed: prefill_rejected x4", "authentication " * 12 + "END"]])
    out = capsys.readouterr().out
    assert "authentication " * 11 + "authenticationEND" in out.replace(" END", "END"), out
