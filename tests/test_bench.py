"""The end-to-end benchmark: report shape, ratios, figure; and (integration) a tiny run of all
three modes whose processes must all be gone afterwards."""

from __future__ import annotations

import json
import os

import pytest

from examples import _report, bench

MODE_KEYS = {"output_tok_s", "tpot_ms", "ttft_ms", "exec_blocked_ms", "exec_stalled_ms", "deferrals",
             "peak_staging_bytes", "failures", "requests"}


def _fake_mode(tok_s: float, tpot: float) -> dict:
    return {"output_tok_s": tok_s, "tpot_ms": {"mean": tpot, "p50": tpot, "p95": tpot * 1.2, "p99": tpot * 1.5, "max": tpot * 2},
            "ttft_ms": {"mean": 10.0, "p50": 9.0, "p99": 30.0}, "exec_blocked_ms": {"p50": 0, "p99": 0, "max": 0},
            "exec_stalled_ms": {"p50": 0, "p99": 0.1, "max": 1}, "deferrals": {"backpressure": 3, "kv_exhausted": 0},
            "peak_staging_bytes": 1024, "inline_fallbacks": 0, "failures": 0, "requests": 10, "mean_batch": 4.0,
            "tpot_samples_ms": [tpot, tpot * 1.1, tpot * 0.9]}


def test_ratios_and_plot(tmp_path) -> None:
    modes = {"ideal": _fake_mode(1000.0, 4.0), "inline": _fake_mode(780.0, 18.0), "orchestrated": _fake_mode(990.0, 4.4)}
    r = bench._ratios(modes)
    assert r["inline"]["throughput"] == pytest.approx(0.78) and r["inline"]["tpot_mean"] == pytest.approx(4.5)
    assert r["orchestrated"]["tpot_p99"] == pytest.approx(1.1)
    res = {"modes": modes, "ratios": r, "config": {"isl": 8, "osl": 4, "concurrency": 2, "requests": 10,
                                                   "transfer_budget_bytes": 4096, "max_num_seqs": 2}}
    bench.print_report(res, "fake")
    png = tmp_path / "b.png"
    bench.plot({"device": res}, str(png))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    _report.write_json(tmp_path / "b.json", {**res, "nan": float("nan")})
    assert json.loads((tmp_path / "b.json").read_text())["nan"] is None


def test_config_defaults_and_overrides() -> None:
    def cfg(*argv: str) -> dict:
        return bench.build_config(bench.make_parser().parse_args(list(argv)))

    full = cfg()
    assert full["isl"] == bench.FULL["isl"] and full["requests"] == bench.FULL["requests"]
    assert full["transfer_budget_bytes"] == -(-bench.FULL["max_tokens_in_buffer"] // 16) * 16384
    # the staging budget is far smaller than the prompt KV of the requests that can be in flight
    assert full["transfer_budget_bytes"] * 4 <= full["concurrency"] * full["request_kv_bytes"]
    quick = cfg("--quick")
    assert quick["requests"] < full["requests"] and quick["isl"] == bench.QUICK["isl"]
    over = cfg("--isl", "64", "--transfer-budget-bytes", "1000", "--device-step-ms", "2.5")
    assert over["isl"] == 64 and over["transfer_budget_bytes"] == 1000 and over["device_step_ms"] == 2.5
    assert cfg("--max-tokens-in-buffer", "40")["transfer_budget_bytes"] == 3 * 16384
    tp4 = cfg("--gen-tp", "4", "--kv-heads", "4")  # the public case's shape: one KV head per GEN rank
    assert (tp4["gen_tp"], tp4["ctx_tp"], tp4["kv_heads"]) == (4, 1, 4)
    assert tp4["transfer_budget_bytes"] == 2 * full["transfer_budget_bytes"]  # whole blocks, twice the heads
    assert bench.rank_share(4, 4) == 0.25 and bench.rank_share(8, 2) == 0.5 and bench.rank_share(2, 8) == 0.5  # (kv_heads, tp)
    assert bench.rank_share(2, 1) == 1.0


@pytest.mark.integration
@pytest.mark.parametrize("gen_tp", [1, 2])
def test_tiny_bench_run(tmp_path, gen_tp: int, monkeypatch) -> None:
    pytest.importorskip("ucxx")
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a run without --log-dir puts its logs
    cfg = {"gen_tp": gen_tp, "isl": 40, "osl": 6, "concurrency": 4, "requests": 12, "max_num_seqs": 4, "warmup": 2,
           "device_step_ms": 1.0, "device_step_us_per_seq": 5.0, "seed": 0, "transfer_budget_bytes": 3 * 16384,
           "request_kv_bytes": 3 * 16384, "budget_requests": 1.0, "gen_num_blocks": 64, "ctx_num_blocks": 64,
           "ctx_lease_s": 60.0, "kv_transfer_timeout_ms": 20000, "request_timeout_s": 60.0, "max_seq_len": 2048,
           "kv_checksums": True, "log_dir": str(tmp_path) if gen_tp > 1 else None, "quick": True}
    pids: list[int] = []
    res = bench.run_bench(cfg, "device", progress=False, pids=pids)
    assert set(res) == {"modes", "ratios", "config"}
    assert set(res["modes"]) == {"ideal", "inline", "orchestrated"}
    assert set(res["ratios"]) == {"inline", "orchestrated"}
    for name, m in res["modes"].items():
        assert MODE_KEYS <= set(m), name
        assert m["failures"] == 0 and m["requests"] == 12, (name, m["failure_reasons"])
        assert set(m["deferrals"]) == {"backpressure", "kv_exhausted"}
        assert set(m["tpot_ms"]) >= {"mean", "p50", "p95", "p99"}
        assert m["gen_rest_problems"] == []
    assert res["modes"]["orchestrated"]["exec_blocked_ms"]["max"] == 0.0
    assert res["modes"]["orchestrated"]["kv_checksum_compared"] == 12
    assert res["modes"]["orchestrated"]["kv_checksum_mismatches"] == 0
    assert set(res["ratios"]["inline"]) == {"throughput", "tpot_mean", "tpot_p99"}
    for name, m in res["modes"].items():  # every GEN rank's execution thread, over the whole segment
        ranks = m["exec_per_rank"]
        assert sorted(ranks) == [str(r) for r in range(gen_tp)], name
        assert all(v["rounds_reported"] == 1 for v in ranks.values()), name
        # ranks step in lockstep: the same decode iterations on each (statistics cleared and read at one step)
        assert len({v["decode_iterations"] for v in ranks.values()}) == 1 and ranks["0"]["decode_iterations"] > 0, ranks
    assert all(v["exec_blocked_ms"]["max"] == 0.0 for v in res["modes"]["orchestrated"]["exec_per_rank"].values())
    # a run without --log-dir that did not fail leaves no temporary folder behind
    assert (res["config"]["log_dir"] is None) == (gen_tp == 1) and not list(tmp_path.glob("kvo-bench-*"))
    # every node process (and GEN rank) is gone (reaped), none left behind
    assert len(pids) == 6 + 3 * (gen_tp - 1)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_step_benchmark_times_a_tensor_parallel_step_of_this_tree() -> None:
    """``python -m examples.bench_step`` (host time per engine step, this tree against a baseline):
    its worker steps a real group at the asked batch and reports a time per step for each."""
    from examples import bench_step

    out = bench_step._run(bench_step.ROOT, 2, "4,8", 30)
    assert set(out) == {"4", "8"} and all(0 < us < 1e6 for us in out.values())
    with pytest.raises(SystemExit, match="cannot read"):
        bench_step._tree("no-such-revision", "/nonexistent")
