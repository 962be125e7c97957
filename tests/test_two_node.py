"""The two-node example end to end: real processes, real UCX, parity and KV checksums.

Greedy tokens of the disaggregated run must equal a single-process unpaged run; the CRC of every
KV block GEN received must equal CTX's; both nodes must be at rest afterwards.
"""

from __future__ import annotations

import argparse

import pytest

from examples.two_node import demo
from examples.two_node.launch import Netns

pytestmark = pytest.mark.integration


def run_demo(*extra: str) -> tuple[dict, dict]:
    args = demo.parse(["--no-progress", *extra])
    return demo.run(args)


def check(report: dict, requests: int) -> None:
    assert report["requests"] == requests
    assert report["failures"] == 0, report["failure_reasons"]
    assert report["parity"], report["parity_detail"]
    assert report["parity_detail"]["kv_checksum_mismatches"] == 0
    assert report["parity_detail"]["kv_blocks_compared"] > 0
    assert report["gen"]["rest_problems"] == []
    assert report["ctx"]["held_requests_after"] == 0


def test_disaggregated_tokens_and_kv_equal_single_process_over_loopback() -> None:
    _, report = run_demo("--requests", "24", "--concurrency", "8", "--isl", "100", "--osl", "12")
    check(report, 24)


def test_many_concurrent_requests_with_a_small_budget_really_backpressure() -> None:
    # the budget holds 2 prompts' KV; 32 requests at concurrency 32 must queue on it
    _, report = run_demo("--requests", "32", "--concurrency", "32", "--isl", "128", "--osl", "8",
                         "--max-tokens-in-buffer", "256")
    check(report, 32)
    assert report["gen"]["deferrals"]["backpressure"] > 0
    assert report["gen"]["peak_staging_bytes"] <= report["gen"]["transfer_budget_bytes"]


def test_gen_pulls_from_two_ctx_nodes() -> None:
    _, report = run_demo("--ctx-nodes", "2", "--requests", "16", "--concurrency", "8", "--isl", "60", "--osl", "6")
    check(report, 16)
    assert report["ctx"]["prefills"] == [8, 8]  # both CTX nodes served half the requests


@pytest.mark.netns
@pytest.mark.skipif(Netns.unavailable() is not None, reason=f"{Netns.unavailable()}")
def test_disaggregated_parity_across_two_network_namespaces() -> None:
    _, report = run_demo("--netns", "--requests", "16", "--concurrency", "8", "--isl", "80", "--osl", "10")
    check(report, 16)
    assert report["transport"]["netns"] is True


def test_demo_exits_nonzero_when_it_cannot_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Netns, "unavailable", staticmethod(lambda: "no namespaces in this test"))
    assert demo.main(["--netns"]) == 2
    assert isinstance(demo.parse([]), argparse.Namespace)


def test_parity_check_reports_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = demo.reference_tokens

    def off_by_one(prompts, osl):
        ref = real(prompts, osl)
        ref[0] = ref[0][:-1] + [(ref[0][-1] + 1) % 256]
        return ref

    monkeypatch.setattr(demo, "reference_tokens", off_by_one)
    _, report = run_demo("--requests", "4", "--concurrency", "4", "--isl", "40", "--osl", "6")
    assert report["failures"] == 0
    assert report["parity"] is False
    assert len(report["parity_detail"]["token_mismatches"]) == 1


def test_ctx_prefills_wait_for_kv_blocks_instead_of_failing() -> None:
    # the CTX pool holds 4 prompts, 16 requests arrive at once: prefills must queue for freed
    # blocks (every waiter woken), not fail. Regression: only the newest waiter was ever woken.
    _, report = run_demo("--requests", "16", "--concurrency", "16", "--isl", "256", "--osl", "4",
                         "--num-blocks", "64")
    check(report, 16)
