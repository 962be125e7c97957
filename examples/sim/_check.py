"""``--check``: the replay configured from this machine's measurements, beside real benchmark runs.

    1. the real quick benchmark (``python -m examples.bench --quick``), run now (or ``--bench-json``)
    2. the replay of the same load, its parameters from measurements, none tuned per mode:
         GEN step        the benchmark's device step (4.0 ms + 5 us x batch) plus this machine's
                         per-iteration overhead, FITTED on the ideal run: mean ITL - device step at
                         ideal's mean batch (ideal moves no KV, so no transfer effect enters it)
         pull time       latency + bytes / bandwidth fitted through the 1 and 8 MiB points of
                         ``results/transport.json`` (``ucx-pull [shm]`` on loopback, ``[netns]`` on the veth)
         pull host CPU   the GEN process's CPU per pull (every thread) from the same benchmark, at the
                         request's size, added to the decode step after the pull (``--no-host-cpu``: 0)
         CTX prefill     the tiny model's ~45 us/token (docs/bench.md); with ``--fit-ctx``, FITTED on the
                         ideal run instead: the per-token cost at which the replay's ideal throughput equals
                         the real one (bisection). Not the default: the real ideal run has costs of its own
                         (the client releases every CTX copy), so a CTX fitted on it is slower than the CTX
                         the other modes met, and arrivals from a fitted, steady CTX come without the bursts
                         a CPU-starved CTX produces
         shaped link     ``--link-mbit`` x 0.95 (Ethernet/IP/TCP framing), and its tbf bucket (``link_burst_bytes``)
    3. a real run on a shaped veth link (``--netns --link-mbit 20 --osl 56 --max-num-seqs 3 --concurrency 6
       --requests 1536``) where one request's transfer spans >= 10 decode steps, and the replay's
       prediction for it. Each round starts from an empty GEN, and the one-request budget fills the
       batch one transfer at a time: that ramp, and the drain it staggers, cost orchestrated about
       max_num_seqs x link utilisation / requests of a round (at batch 16, 512 requests a round: ~2 %,
       which kept it under 0.98), while inline's loss is per request (a decode slot idle for each
       transfer, the execution thread blocked behind the budget): a small batch separates the two
       (docs/sim.md, "A small batch on the shaped link")

Targets: throughput per mode within 10 %, ratio to ideal within 0.03; on the shaped link inline
>= 15 % below ideal, orchestrated >= 0.98x ideal with the execution thread never blocked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from examples.shaped_link import burst_bytes
from examples.two_node import cli

from ._model import SimParams
from ._parallel import run_all
from ._replay import ModeResult, replay

ROOT = Path(__file__).resolve().parents[2]
MODES = ("ideal", "inline", "orchestrated")
TINY_MODEL = dict(num_layers=2, num_kv_heads=2, head_dim=32, kv_dtype="float32", block_size=16)
CTX_US_PER_TOKEN = 45.0
FRAMING = 0.95


def fit_pull(transport_json: Path, key: str) -> tuple[float, float]:
    """(latency s, bandwidth B/s) through the 1 and 8 MiB medians of ``key`` in the transport benchmark."""
    r = json.loads(transport_json.read_text())["results"][key]
    t1, t8 = r["1"]["median_ms"] / 1e3, r["8"]["median_ms"] / 1e3
    bw = 7 * 2**20 / (t8 - t1)
    return max(0.0, t1 - 2**20 / bw), bw


def fit_pull_cpu(transport_json: Path, key: str, nbytes: int) -> float:
    """GEN CPU (us, every thread of the process) of one pull of ``nbytes``: the line through the 1 and
    8 MiB medians of ``key`` in the transport benchmark (a pull's fixed cost dominates it)."""
    r = json.loads(transport_json.read_text())["results"][key]
    c1, c8 = r["1"]["cpu_us_per_op"], r["8"]["cpu_us_per_op"]
    per_mib = (c8 - c1) / 7
    return round(max(0.0, c1 + per_mib * (nbytes / 2**20 - 1)), 1)


def params_from_bench(cfg: dict[str, Any], ideal: dict[str, Any], pull: tuple[float, float],
                      link_mbit: float | None = None, *, fit_ctx_on_ideal: bool = False,
                      host_us_per_pull: float = 0.0) -> tuple[SimParams, dict[str, str]]:
    latency, bw = pull
    burst = 0
    if link_mbit:
        bw = min(bw, link_mbit * 1e6 / 8 * FRAMING)
        if cfg.get("gen_tp", 1) == 1:  # one GEN rank's link is the shaped link (at TP > 1 the ranks share it)
            burst = int(burst_bytes(link_mbit) * FRAMING)
    device_ms = cfg["device_step_ms"]
    per_seq = cfg["device_step_us_per_seq"]
    overhead = ideal["itl_ms"]["mean"] - (device_ms + per_seq * ideal["mean_batch"] / 1e3)
    rounds = max(1, int(cfg.get("rounds", 1)))
    p = SimParams(**TINY_MODEL,  # type: ignore[arg-type]
                  isl=cfg["isl"], osl=cfg["osl"], concurrency=cfg["concurrency"], warmup=cfg["warmup"],
                  requests=cfg["requests"] // rounds, gen_tp=cfg.get("gen_tp", 1),
                  step_base_ms=round(device_ms + max(0.0, overhead), 4), step_per_seq_us=per_seq,
                  ctx_prefill_base_ms=0.0, ctx_prefill_ms_per_ktok=CTX_US_PER_TOKEN, ctx_prefill_slots=1,
                  link_gbyte_s=bw / 1e9, link_latency_us=latency * 1e6, link_concurrency=8, connect_ms=2.0,
                  max_tokens_in_buffer=cfg.get("max_tokens_in_buffer") or cfg.get("staging_tokens") or cfg["isl"],
                  max_num_seqs=cfg["max_num_seqs"], max_prefetch_seqs=cfg.get("max_prefetch_seqs"),
                  host_us_per_pull=host_us_per_pull, iterations_per_step=1, link_burst_bytes=burst)
    ctx_us = fit_ctx(p, ideal["output_tok_s"]) if fit_ctx_on_ideal else CTX_US_PER_TOKEN
    p = dataclasses.replace(p, ctx_prefill_ms_per_ktok=ctx_us)
    sources = {
        "step_base_ms": f"FITTED on the real ideal run: device {device_ms} ms + overhead {overhead:.3f} ms "
                        f"(ITL {ideal['itl_ms']['mean']:.3f} ms at mean batch {ideal['mean_batch']:.1f})",
        "link": f"transport benchmark fit: latency {latency * 1e3:.3f} ms, {bw / 1e9:.3f} GB/s"
                + (f" (capped at {link_mbit} Mbit/s x {FRAMING}; tbf's bucket "
                   + (f"{burst} bytes of KV)" if burst else "not modelled at GEN TP > 1)") if link_mbit else ""),
        "ctx_prefill": (f"FITTED on the real ideal run's throughput: {ctx_us} us/token" if fit_ctx_on_ideal
                        else f"{CTX_US_PER_TOKEN} us/token (docs/bench.md)"),
        "requests": f"one segment of the benchmark ({cfg['requests']} / {rounds} rounds), {cfg['warmup']} warm-up",
        "host_us_per_pull": (f"transport benchmark: GEN CPU of one {cfg['request_kv_bytes'] // 1024} KiB pull, "
                             f"{host_us_per_pull} us, taken from the next decode step" if host_us_per_pull
                             else "not modelled (0)"),
    }
    return p, sources


def fit_ctx(p: SimParams, real_ideal_tok_s: float, *, lo: float = CTX_US_PER_TOKEN, hi: float = 5000.0,
            rounds: int = 12) -> float:
    """The CTX prefill cost (us/token) at which the replay's ideal throughput matches ``real_ideal_tok_s``
    (ideal moves no KV: this fits the CTX and nothing else); ``lo`` when even that is too slow."""
    def tok_s(us: float) -> float:
        return replay(dataclasses.replace(p, ctx_prefill_ms_per_ktok=us), "ideal").output_tok_s

    if tok_s(lo) <= real_ideal_tok_s:
        return lo
    for _ in range(rounds):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if tok_s(mid) > real_ideal_tok_s else (lo, mid)
    return round((lo * hi) ** 0.5, 2)


def run_real(out: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "examples.bench", "--quick", "--no-progress", "--json", str(out), *extra]
    print(f"running: {' '.join(cmd[1:])}  (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=False)
    print(f"  {time.perf_counter() - t:.0f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return json.loads(out.read_text())


def compare(real: dict[str, Any], sim: dict[str, ModeResult]) -> tuple[str, list[dict[str, Any]], bool]:
    rows, ok = [], True
    lines = ["| mode | real tok/s | replay tok/s | diff | real / ideal | replay / ideal | diff | real blocked p99 ms "
             "| replay blocked max ms | within targets |", "|---|---|---|---|---|---|---|---|---|---|"]
    r_ideal, s_ideal = real["modes"]["ideal"]["output_tok_s"], sim["ideal"].output_tok_s
    for m in MODES:
        rm, sm = real["modes"][m], sim[m]
        diff = sm.output_tok_s / rm["output_tok_s"] - 1
        rr, sr = rm["output_tok_s"] / r_ideal, sm.output_tok_s / s_ideal
        good = abs(diff) <= 0.10 and abs(sr - rr) <= 0.03
        ok &= good
        rows.append({"mode": m, "real_tok_s": rm["output_tok_s"], "replay_tok_s": sm.output_tok_s, "diff": diff,
                     "real_ratio": rr, "replay_ratio": sr, "real_blocked_ms": rm.get("exec_blocked_ms"),
                     "replay_blocked_ms": sm.exec_blocked_ms, "within": good, "real_loadavg": rm.get("loadavg_1m")})
        lines.append(f"| {m} | {rm['output_tok_s']:,.0f} | {sm.output_tok_s:,.0f} | {diff:+.1%} | {rr:.3f} | {sr:.3f} | "
                     f"{sr - rr:+.3f} | {(rm.get('exec_blocked_ms') or {}).get('p99', 0):.1f} | "
                     f"{sm.exec_blocked_ms['max']:.1f} | {'yes' if good else 'NO'} |")
    return "\n".join(lines), rows, ok


def _json_of(*keys: str) -> Any:
    """An argparse type: a readable JSON object with ``keys`` (what the check reads of it), checked
    when the options are parsed, not after a real run or a replay of minutes."""
    def read(text: str) -> str:
        try:
            data = json.loads(Path(text).read_text())
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text} is not JSON ({exc})") from None
        missing = [k for k in keys if not isinstance(data, dict) or k not in data]
        if missing:
            raise argparse.ArgumentTypeError(f"{text} has no {', '.join(map(repr, missing))}: not the file this option takes")
        return text
    return read


def main(argv: list[str], *, jobs: int | None = None) -> int:
    """The check; its replays run ``jobs`` side by side (after the real runs: they never overlap them)."""
    ap = argparse.ArgumentParser(prog="python -m examples.sim --check")
    bench_json = _json_of("modes", "config")  # python -m examples.bench --json
    ap.add_argument("--bench-json", type=bench_json, help="a real quick benchmark's JSON to compare with (default: run it now)")
    ap.add_argument("--shaped-json", type=bench_json, help="a real shaped-link run's JSON (default: run it now, root only)")
    ap.add_argument("--link-mbit", type=cli.positive_float, default=20.0, help="the shaped run's link (default 20: one 128 KiB "
                    "request takes ~49 ms from an idle link, ~11 decode steps)")
    ap.add_argument("--shaped-osl", type=cli.positive_int, default=56)
    ap.add_argument("--shaped-max-num-seqs", type=cli.positive_int, default=3,
                    help="the shaped run's GEN batch cap: a small batch keeps each round's ramp (the one-request budget "
                         "fills the batch one transfer at a time) and drain small (docs/sim.md)")
    ap.add_argument("--shaped-concurrency", type=cli.positive_int, default=6)
    ap.add_argument("--shaped-requests", type=cli.positive_int, default=1536, help="requests of the shaped run (3 rounds)")
    ap.add_argument("--no-shaped", action="store_true")
    ap.add_argument("--fit-ctx", action="store_true", help="fit the CTX prefill cost on the real ideal run")
    ap.add_argument("--no-host-cpu", action="store_true",
                    help="leave the pulls' host CPU out of the replay (host_us_per_pull 0), as before it was modelled")
    ap.add_argument("--transport-json", type=_json_of("results"), default=str(ROOT / "results" / "transport.json"))
    ap.add_argument("--out", type=cli.writable_file, default=str(ROOT / "results" / "sim_check.json"))
    a = ap.parse_args(argv)
    transport = Path(a.transport_json)
    report: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    ok_all = True
    real = json.loads(Path(a.bench_json).read_text()) if a.bench_json else run_real(ROOT / "results" / "sim_check_bench.json", [])
    def host_us(cfg: dict[str, Any], key: str) -> float:
        return 0.0 if a.no_host_cpu else fit_pull_cpu(transport, key, int(cfg["request_kv_bytes"]))

    p, sources = params_from_bench(real["config"], real["modes"]["ideal"], fit_pull(transport, "ucx-pull [shm]"),
                                   fit_ctx_on_ideal=a.fit_ctx, host_us_per_pull=host_us(real["config"], "ucx-pull [shm]"))
    sim = dict(zip(MODES, run_all([(p, m) for m in MODES], jobs=jobs)))
    text, rows, ok = compare(real, sim)
    ok_all &= ok
    print("\nquick benchmark (loopback): real vs replay\n" + "\n".join(f"  {k}: {v}" for k, v in sources.items()))
    print(text)
    report["quick"] = {"params": p.describe(), "sources": sources, "rows": rows, "within_targets": ok}
    if not a.no_shaped:
        extra = ["--link-mbit", str(a.link_mbit), "--osl", str(a.shaped_osl), "--requests", str(a.shaped_requests),
                 "--max-num-seqs", str(a.shaped_max_num_seqs), "--concurrency", str(a.shaped_concurrency)]
        shaped = json.loads(Path(a.shaped_json).read_text()) if a.shaped_json else run_real(
            ROOT / "results" / "sim_check_shaped.json", extra)
        cfg = shaped["config"]
        q, qsources = params_from_bench(cfg, shaped["modes"]["ideal"], fit_pull(transport, "ucx-pull [netns]"),
                                        link_mbit=cfg.get("link_mbit") or a.link_mbit, fit_ctx_on_ideal=a.fit_ctx,
                                        host_us_per_pull=host_us(cfg, "ucx-pull [netns]"))
        q = dataclasses.replace(q, osl=cfg["osl"])
        sim_q = dict(zip(MODES, run_all([(q, m) for m in MODES], jobs=jobs)))
        text, rows, ok = compare(shaped, sim_q)
        step_ms = q.step_s(cfg["max_num_seqs"]) * 1e3
        # from an idle link (tbf's bucket sends its bytes at once): the shortest a transfer takes
        xfer_ms = (max(0, cfg["request_kv_bytes"] - q.link_burst_bytes) / (q.link_gbyte_s * 1e9) * 1e3
                   + q.link_latency_us / 1e3)
        modes = shaped["modes"]
        inline_r = modes["inline"]["output_tok_s"] / modes["ideal"]["output_tok_s"]
        orch_r = modes["orchestrated"]["output_tok_s"] / modes["ideal"]["output_tok_s"]
        orch_blocked = (modes["orchestrated"].get("exec_blocked_ms") or {}).get("max", 0.0)
        targets = {"transfer_steps": xfer_ms / step_ms, "transfer_spans_10_steps": xfer_ms / step_ms >= 10,
                   "inline_regress_15pct": inline_r <= 0.85,
                   "orchestrated_098": orch_r >= 0.98, "orchestrated_never_blocked": orch_blocked == 0.0}
        print(f"\nshaped veth link {cfg.get('link_mbit')} Mbit/s, OSL {cfg['osl']}: one request's transfer from an idle link ~{xfer_ms:.1f} ms "
              f"= {xfer_ms / step_ms:.1f} decode steps of {step_ms:.2f} ms\n" + "\n".join(f"  {k}: {v}" for k, v in qsources.items()))
        print(text)
        print(f"  targets: a transfer {xfer_ms / step_ms:.1f} decode steps (>= 10: {targets['transfer_spans_10_steps']}), "
              f"inline {inline_r:.3f}x ideal (<= 0.85: {targets['inline_regress_15pct']}), orchestrated "
              f"{orch_r:.3f}x (>= 0.98: {targets['orchestrated_098']}), orchestrated blocked max {orch_blocked} ms")
        ok_all &= ok and all(v for k, v in targets.items() if k != "transfer_steps")
        report["shaped"] = {"params": q.describe(), "sources": qsources, "rows": rows, "targets": targets,
                            "within_targets": ok}
    report["loadavg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return 0 if ok_all else 1
