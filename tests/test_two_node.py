"""The two-node example end to end: real processes, real UCX, parity and KV checksums.

Greedy tokens of the disaggregated run must equal a single-process unpaged run; the CRC of every
KV block GEN received must equal CTX's; both nodes must be at rest afterwards. The tests that move
KV run with each KV transport (``backend``: ucx, nixl; nixl skips only when ``nixl_cu12`` cannot be
imported); the GEN's log must show that it connected with the chosen one.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.two_node import demo
from examples.two_node.launch import Netns, NodeProcess
from tests.test_ucx_transport import BACKENDS

pytestmark = pytest.mark.integration


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def run_demo(*extra: str) -> tuple[dict, dict]:
    args = demo.parse(["--no-progress", *extra])
    return demo.run(args)


def check(report: dict, requests: int, backend: str | None = None) -> None:
    if backend is not None:
        assert report["transport"]["backend"] == backend and report["transport"]["backend_connected"], report["transport"]
        assert ("ucx_defaults" in report["transport"]) == (backend == "ucx")  # only what applies
    if backend == "nixl":  # every prefill reply named its block ids and epoch: no pull asked or pinned
        assert report["ctx"]["kv_lookups"] == 0, report["ctx"]
        assert report["ctx"]["kv_unpinned_reads"] > 0, report["ctx"]
    assert report["requests"] == requests
    assert report["failures"] == 0, report["failure_reasons"]
    assert report["parity"], report["parity_detail"]
    assert report["parity_detail"]["kv_checksum_mismatches"] == 0
    assert report["parity_detail"]["kv_blocks_compared"] > 0
    assert report["gen"]["rest_problems"] == []
    assert report["ctx"]["held_requests_after"] == 0


def test_disaggregated_tokens_and_kv_equal_single_process_over_loopback(backend: str) -> None:
    _, report = run_demo("--requests", "24", "--concurrency", "8", "--isl", "100", "--osl", "12", "--kv-transport", backend)
    check(report, 24, backend)


@pytest.mark.parametrize("backend", ["ucx"], indirect=True)
def test_many_concurrent_requests_with_a_small_budget_really_backpressure(backend: str) -> None:
    # the budget holds 2 prompts' KV; 32 requests at concurrency 32 must queue on it. UCX only: the
    # CTX prefills one request at a time and a NIXL READ of one prompt's KV (a few hundred µs here)
    # ends before the next prefill does, so over NIXL the receives never overlap enough to fill the
    # budget (measured: 0 deferrals) and the test could not show backpressure
    _, report = run_demo("--requests", "32", "--concurrency", "32", "--isl", "128", "--osl", "8",
                         "--max-tokens-in-buffer", "256", "--kv-transport", backend)
    check(report, 32, backend)
    assert report["gen"]["deferrals"]["backpressure"] > 0
    assert report["gen"]["peak_staging_bytes"] <= report["gen"]["transfer_budget_bytes"]


def test_gen_pulls_from_two_ctx_nodes(backend: str) -> None:
    _, report = run_demo("--ctx-nodes", "2", "--requests", "16", "--concurrency", "8", "--isl", "60", "--osl", "6",
                         "--kv-transport", backend)
    check(report, 16, backend)
    assert report["ctx"]["prefills"] == [8, 8]  # both CTX nodes served half the requests


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values == ("nixl",)], indirect=True)
def test_nixl_head_slices_and_fan_in_between_tensor_parallel_nodes(backend: str) -> None:
    """CTX TP2 -> GEN TP2 over NIXL: each GEN rank READs its heads from the CTX rank that holds them
    (in that rank's head numbering). The UCX path runs the same in test_tp_two_node.py."""
    _, report = run_demo("--ctx-tp", "2", "--gen-tp", "2", "--requests", "8", "--concurrency", "4", "--isl", "60",
                         "--osl", "6", "--kv-transport", backend)
    check(report, 8, backend)
    assert report["ctx"]["tp"] == [2] and report["gen"]["tp"]["world_size"] == 2


@pytest.mark.netns
@pytest.mark.skipif(Netns.unavailable() is not None, reason=f"{Netns.unavailable()}")
def test_disaggregated_parity_across_two_network_namespaces(backend: str) -> None:
    _, report = run_demo("--netns", "--requests", "16", "--concurrency", "8", "--isl", "80", "--osl", "10",
                         "--kv-transport", backend)
    check(report, 16, backend)
    assert report["transport"]["netns"] is True


def test_kv_transport_is_chosen_by_configuration() -> None:
    """``--kv-transport`` on both nodes and the demo, ``OrchestratorConfig.kv_transport``, and the
    serving front's ``transfer.backend``, which reaches every node it starts."""
    from examples.serve.cluster import node_args
    from examples.serve.config import ConfigError, parse
    from examples.two_node import common
    from orchestrator import OrchestratorConfig
    from transports import KVLayout
    from transports.ucx import UCXKVServer, UCXTransport

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    assert OrchestratorConfig(layout=layout, num_blocks=4, transfer_budget_bytes=1).kv_transport == "ucx"
    assert OrchestratorConfig(layout=layout, num_blocks=4, transfer_budget_bytes=1, kv_transport="nixl").kv_transport == "nixl"
    with pytest.raises(ValueError, match="kv_transport"):
        OrchestratorConfig(layout=layout, num_blocks=4, transfer_budget_bytes=1, kv_transport="tcp")
    assert demo.parse([]).kv_transport == "ucx" and demo.parse(["--kv-transport", "nixl"]).kv_transport == "nixl"
    with pytest.raises(SystemExit):
        demo.parse(["--kv-transport", "tcp"])
    args = argparse.Namespace(kv_transport="ucx", insecure=True, secret_file=None, host="127.0.0.1")
    assert isinstance(common.kv_transport(args, layout), UCXTransport)
    from transports import KVStore

    assert isinstance(common.kv_server(args, KVStore(layout, layout.new_pool(4)), port=0, lease_s=1), UCXKVServer)
    with pytest.raises(SystemExit):
        common.backend(argparse.Namespace(kv_transport="tcp"))
    cfg = parse({"ctx": [{"launch": {}}], "gen": [{"launch": {}}], "transfer": {"backend": "nixl"}})
    for spec in cfg.nodes:  # both roles get the backend
        a = node_args(spec, cfg)
        assert a[a.index("--kv-transport") + 1] == "nixl"
    default = parse({"ctx": [{"launch": {}}], "gen": [{"launch": {}}]})
    assert all(node_args(s, default)[node_args(s, default).index("--kv-transport") + 1] == "ucx" for s in default.nodes)
    with pytest.raises(ConfigError, match="backend"):
        parse({"ctx": [{"launch": {}}], "gen": [{"launch": {}}], "transfer": {"backend": "tcp"}})


def test_demo_exits_nonzero_when_it_cannot_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Netns, "unavailable", staticmethod(lambda: "no namespaces in this test"))
    assert demo.main(["--netns"]) == 2
    assert isinstance(demo.parse([]), argparse.Namespace)


def test_parity_check_reports_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = demo.reference_tokens

    def off_by_one(prompts, osl, **kw):
        ref = real(prompts, osl, **kw)
        ref[0] = ref[0][:-1] + [(ref[0][-1] + 1) % 256]
        return ref

    monkeypatch.setattr(demo, "reference_tokens", off_by_one)
    _, report = run_demo("--requests", "4", "--concurrency", "4", "--isl", "40", "--osl", "6")
    assert report["failures"] == 0
    assert report["parity"] is False
    assert len(report["parity_detail"]["token_mismatches"]) == 1
    assert report["parity_detail"]["tokens"] == "mismatch" and report["parity_detail"]["kv"] == "ok"
    first = report["parity_detail"]["first_token_mismatch"]
    assert first["index"] == 0 and first["token"] == 5  # the last of 6 output tokens
    lines = demo.parity_lines(report["parity_detail"])
    assert lines[0].startswith("parity: tokens MISMATCH in 1 of 4 requests; first: ") and first["request_id"] in lines[0]
    assert lines[1].startswith("parity: KV CRCs OK")


def test_ctx_prefills_wait_for_kv_blocks_instead_of_failing() -> None:
    # the CTX pool holds 4 prompts, 16 requests arrive at once: prefills must queue for freed
    # blocks (every waiter woken), not fail. Regression: only the newest waiter was ever woken.
    _, report = run_demo("--requests", "16", "--concurrency", "16", "--isl", "256", "--osl", "4",
                         "--num-blocks", "64")
    check(report, 16)


# -- parity: tokens, KV CRCs and what was not checked, apart (no nodes) ----------------------------

def _rec(i: int, tokens: list[int], *, ok: bool = True, ctx: list[int] | None = None, gen: list[int] | None = None):
    from examples.two_node.client import RequestRecord

    r = RequestRecord(f"demo-{i}", i, "c", 8, len(tokens))
    r.tokens = list(tokens)
    r.state, r.failure = ("finished", None) if ok else ("error", "timeout")
    r.ctx_checksums, r.gen_checksums = [7, 8] if ctx is None else ctx, [7, 8] if gen is None else gen
    return r


def test_parity_reports_tokens_kv_and_failures_apart() -> None:
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    # a failed request is "not checked", not a mismatch; the others match
    d = demo.parity_detail([_rec(0, [1, 2, 3]), _rec(1, [], ok=False), _rec(2, [7, 8, 9])], ref)
    assert (d["tokens"], d["kv"], d["not_checked"], d["compared"]) == ("ok", "ok", 1, 2)
    lines = demo.parity_lines(d)
    assert not any("MISMATCH" in line for line in lines) and lines[-1] == "parity: not checked: 1 requests failed"
    # nothing succeeded: nothing was compared, nothing mismatched
    d = demo.parity_detail([_rec(0, [], ok=False)], ref)
    assert (d["tokens"], d["kv"], d["not_checked"]) == ("not checked", "not checked", 1)
    assert not any("MISMATCH" in line for line in demo.parity_lines(d))
    # a KV CRC mismatch alone is named as one, with its request; the tokens are fine
    d = demo.parity_detail([_rec(0, [1, 2, 3]), _rec(1, [4, 5, 6], gen=[7, 9])], ref)
    assert (d["tokens"], d["kv"], d["kv_mismatched_requests"]) == ("ok", "mismatch", ["demo-1"])
    assert demo.parity_lines(d)[1] == "parity: KV CRCs MISMATCH in 1 of 2 requests; first: demo-1"
    # a token mismatch alone: the first request, the token, what came and what was expected
    d = demo.parity_detail([_rec(0, [1, 2, 3]), _rec(1, [4, 0, 6])], ref)
    assert (d["tokens"], d["kv"]) == ("mismatch", "ok")
    assert d["first_token_mismatch"] == {"request_id": "demo-1", "index": 1, "token": 1, "got": [0, 6], "expected": [5, 6]}
    # CRCs that never came (a GEN without --kv-checksums) are not "OK"
    d = demo.parity_detail([_rec(0, [1, 2, 3], gen=[])], ref)
    assert d["kv"] == "missing"


# -- the command line: bad input refused before any node starts; signals clean up ------------------

ROOT = Path(__file__).resolve().parents[1]


def _no_node(*args: object, **kwargs: object) -> None:
    raise AssertionError("a node was started")


@pytest.mark.parametrize("argv, message", [
    (["--requests", "-1"], "argument --requests: expected an integer >= 1, got '-1'"),
    (["--requests", "0"], "argument --requests"),
    (["--concurrency", "0"], "argument --concurrency"),
    (["--isl", "0"], "argument --isl"),
    (["--osl", "nan"], "argument --osl"),
    (["--ctx-nodes", "0"], "argument --ctx-nodes"),
    (["--max-tokens-in-buffer", "0"], "argument --max-tokens-in-buffer"),
    (["--num-blocks", "0"], "argument --num-blocks"),
    (["--kv-transfer-timeout-ms", "-5"], "argument --kv-transfer-timeout-ms"),
    (["--json", "{file}/report.json"], "is not a writable folder"),
    (["--json", "{dir}"], "is a folder, not a file"),
    # tried, not asked: os.access says yes to root for both
    (["--json", "/proc/kvo-no-such/report.json"], "/proc is not a writable folder"),
    (["--json", "/proc/version"], "cannot write /proc/version"),
])
def test_demo_refuses_bad_arguments_before_starting_a_node(argv: list[str], message: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", dir=tmp_path) for a in argv]
    monkeypatch.setattr(NodeProcess, "start", _no_node)
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_an_output_path_that_can_be_written_is_left_as_it_was(tmp_path: Path) -> None:
    """The check writes nothing: an existing file keeps its bytes, a missing folder is not made and
    the probe leaves no file behind."""
    from examples.two_node import cli

    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    assert cli.writable_file(str(kept)) == kept and kept.read_text() == "{}"
    assert cli.writable_file(str(tmp_path / "new" / "report.json")) == tmp_path / "new" / "report.json"
    assert list(tmp_path.iterdir()) == [kept]


def test_demo_bad_argument_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "examples.two_node", "demo", "--requests", "-1"], cwd=ROOT, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("argument --requests: expected an integer >= 1, got '-1'")
    assert not list(tmp_path.iterdir())  # no node's log folder


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _gone(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z"
    except OSError:
        return True


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["TERM", "HUP", "INT"])
def test_a_signal_to_the_demo_stops_its_nodes_and_removes_their_folders(tmp_path: Path, sig: int) -> None:
    """``kill <demo pid>`` (or a hang-up, or Ctrl-C) while the load runs: the nodes (in sessions of
    their own, so the signal does not reach them) are stopped and their log folders removed before
    the demo exits, with one line, not a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "examples.two_node", "demo", "--requests", "100000", "--isl", "16",
                             "--osl", "4", "--concurrency", "2", "--num-blocks", "256"], cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    nodes: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the load starts once the GEN is ready
            nodes = sorted(set(nodes) | set(_children(proc.pid)))
            logs = list(tmp_path.glob("kvo-*/gen-*.log"))
            if len(nodes) == 2 and logs and "\"gen_ready\"" in logs[0].read_text(errors="replace"):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert len(nodes) == 2 and len(list(tmp_path.glob("kvo-*"))) == 2, nodes
        time.sleep(1.0)
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted"), err
        assert all(_gone(pid) for pid in nodes), nodes
        assert not list(tmp_path.glob("kvo-*"))
    finally:
        for pid in [proc.pid, *nodes]:
            if not _gone(pid):
                os.killpg(pid, signal.SIGKILL)
        proc.wait(10)
