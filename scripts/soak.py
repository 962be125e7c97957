"""Soak the two-node example: many requests at high concurrency, then look for failures and leaks.

    .venv/bin/python scripts/soak.py [--requests 10240] [--concurrency 1024] [--isl 128] [--osl 16]
                                     [--json PATH] [--png PATH] [--sample-s 1.0]

Starts a CTX and a GEN node (``examples.two_node.launch.NodeProcess``, one shared secret), drives
``--requests`` requests at ``--concurrency`` through them with ``examples.two_node.client.run_load``
while a background thread samples both nodes' RSS (``VmRSS`` of the node's own Python process) every
``--sample-s`` seconds, then waits (bounded) until GEN is at rest and reports:

* client failures (target 0) and their reasons, KV checksum mismatches;
* leaks: GEN ``rest_problems``, GEN pool used blocks and budget in use, CTX held requests and pool
  used blocks (all must be 0 at the end);
* RSS of both nodes: at the end of the warm-up, peak, at the end of the load, at rest, and the slope of
  a least-squares line over the second half of the load (MiB/min). RSS is **flat** when the fitted
  growth over the second half (slope x its duration) is under ``--flat-mib`` (default 16 MiB);
* RSS per request: the least-squares slope of each node's RSS against the number of requests
  completed, over the samples after half of the requests had completed; it must not exceed
  ``--max-bytes-per-request`` (default 64 B/request);
* output tok/s, TTFT/TPOT, GEN deferrals (backpressure / KV exhausted) and peak staging.

Exits 1 on any failure, leak, non-flat RSS or RSS growing faster per request than the bound, 0
otherwise. Not a CI test: ``tests/test_soak.py`` runs a small version of the same code
(``run_soak``). Scaling and measured results: docs/soak.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the examples package lives at the root
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from examples import _proc, _report  # noqa: E402
from examples.two_node import client, control  # noqa: E402
from examples.two_node.launch import NodeProcess, node_env  # noqa: E402

BLOCK_SIZE = 16  # the nodes' default --block-size (tokens per KV block)
# GEN's DecodeLoop keeps its per-iteration statistics in arrays allocated once (5 x 131,072 float64,
# 5 MiB). Allocated with np.zeros, their pages become resident only as the ring fills (~40 B per
# iteration, ~20-70 B/request, until 131,072 iterations) unless touched at construction (docs/soak.md).


@dataclasses.dataclass
class SoakConfig:
    requests: int = 10_240
    concurrency: int = 1024
    isl: int = 128
    osl: int = 16
    sample_s: float = 1.0
    max_tokens_in_buffer: int = 2048
    """GEN staging budget in tokens of KV: 16 prompts of 128 tokens, far below the concurrency, so
    admission backpressures during the whole soak."""
    max_num_seqs: int = 256
    """GEN requests decoding at once, the decode batch (the node's default)."""
    gen_num_blocks: int = 0
    """GEN KV pool; 0: enough for ``max_num_seqs`` requests of ``isl + osl`` tokens (+ 1/8)."""
    ctx_num_blocks: int = 0
    """CTX KV pool; 0: enough for ``concurrency`` prompts of ``isl`` tokens (+ 1/8), so a prefill
    never waits for CTX blocks (see docs/soak.md: that wait path loses wake-ups)."""
    seed: int = 0
    warmup_requests: int = 0
    """RSS 'start' is taken when this many requests have ended; 0: ``concurrency``."""
    flat_mib: float = 16.0
    max_bytes_per_request: float = 64.0
    """Per node: the least-squares slope of RSS against requests completed, over the second half of
    the load, must not exceed this (bytes per request; docs/soak.md says why 64)."""
    rest_timeout_s: float = 15.0
    """How long to wait for GEN/CTX to come to rest after the load (shorter than CTX's 30 s lease,
    so an expiring lease cannot hide a leak)."""
    request_timeout_s: float = 300.0
    progress: bool = True
    log_dir: Path | None = None


# -- process limits and RSS --------------------------------------------------------------------------

def raise_nofile() -> dict[str, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (the nodes, started later, inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return {"before": soft, "after": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "hard": hard if hard != resource.RLIM_INFINITY else -1}


def needed_fds(concurrency: int) -> int:
    """A rough need: the client holds up to 2 sockets per request (prefill, then generate), each
    node one per live control connection, plus UCX endpoints, logs, libraries."""
    return 3 * concurrency + 512


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_node(pid: int) -> bool:
    """A process running a node: ``python -m examples.two_node ...``, or a child of a fork server
    (which shows the server's command line; the server itself runs no node)."""
    cmd = _cmdline(pid)
    if "examples.two_node.forkserver" in cmd:
        ppid = _proc.ppid(pid)
        return ppid is not None and "examples.two_node.forkserver" in _cmdline(ppid)
    return "examples.two_node" in cmd


def node_pid(pid: int) -> int:
    """The node's own Python process: ``pid`` itself, or (``ip netns exec`` or another wrapper that
    forks) the first descendant whose command line runs ``examples.two_node``."""
    todo, seen = [pid], set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        if _is_node(p):
            return p
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return pid


def read_status(pid: int) -> dict[str, int] | None:
    """``{"rss_kib", "hwm_kib", "threads", "fds"}`` of ``pid``, None when it is gone."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                fields[key] = int(value.split()[0])
        fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    except (OSError, ValueError, IndexError):
        return None
    return {"rss_kib": fields.get("VmRSS", 0), "hwm_kib": fields.get("VmHWM", 0),
            "threads": fields.get("Threads", 0), "fds": fds}


class RssSampler:
    """Samples each named pid's /proc status every ``interval`` seconds on a daemon thread.

    ``series[name]`` is a list of ``{"t": unix time, "rss_mib", "hwm_mib", "threads", "fds"}``."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        self.pids = dict(pids)
        self.interval = interval
        self.series: dict[str, list[dict[str, float]]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> None:
        now = time.time()
        for name, pid in self.pids.items():
            st = read_status(pid)
            if st is not None:
                self.series[name].append({"t": now, "rss_mib": st["rss_kib"] / 1024, "hwm_mib": st["hwm_kib"] / 1024,
                                          "threads": st["threads"], "fds": st["fds"]})

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # one last point, at rest


def per_request_fit(t: np.ndarray, rss_mib: np.ndarray, ends: Any, t_end: float) -> dict[str, Any]:
    """Bytes of RSS per request completed: the least-squares slope of RSS (bytes) against the number
    of requests completed at each sample, over the samples of the second half of the load, i.e.
    from the moment half of the requests had completed to ``t_end``. ``ends``: the unix time each
    request completed. Also its standard error and the span of requests the fit covers."""
    out: dict[str, Any] = {"bytes_per_request": float("nan"), "bytes_per_request_se": float("nan"),
                           "fit_samples": 0, "fit_requests": 0}
    ends = np.sort(np.asarray(ends if ends is not None else [], dtype=np.float64))
    if ends.size < 2:
        return out
    done = np.searchsorted(ends, t, side="right")  # requests completed when each sample was taken
    t_half = ends[(ends.size + 1) // 2 - 1]
    sel = (t >= t_half) & (t <= t_end + 1e-9)
    x, y = done[sel].astype(np.float64), rss_mib[sel] * float(1 << 20)
    out["fit_samples"] = int(sel.sum())
    out["fit_requests"] = int(np.ptp(x)) if x.size else 0
    if x.size >= 3 and np.ptp(x) > 0:
        slope, icpt = np.polyfit(x, y, 1)
        sxx = float(((x - x.mean()) ** 2).sum())
        resid = y - (slope * x + icpt)
        out["bytes_per_request"] = float(slope)
        out["bytes_per_request_se"] = float(np.sqrt((resid ** 2).sum() / (x.size - 2) / sxx)) if x.size > 2 else float("nan")
    return out


def rss_figures(samples: list[dict[str, float]], *, t0: float, t_warm: float, t_end: float,
                flat_mib: float, ends: Any = None, max_bytes_per_request: float = float("inf")) -> dict[str, Any]:
    """RSS figures of one node. ``t0``: load start, ``t_warm``: end of the warm-up, ``t_end``: end of
    the load (unix times). The MiB/min fit is over the samples of the second half of ``[t0, t_end]``;
    the bytes/request fit (``per_request_fit``, needs ``ends``: each request's completion time) over
    the samples after half of the requests had completed."""
    if not samples:
        return {"samples": 0, "flat": False, "why": "no samples", "bytes_per_request": float("nan"),
                "per_request_ok": False, "max_bytes_per_request": max_bytes_per_request}
    t = np.array([s["t"] for s in samples])
    rss = np.array([s["rss_mib"] for s in samples])
    load = (t >= t0) & (t <= t_end + 1e-9)
    warm = t >= t_warm
    i_start = int(np.argmax(warm)) if warm.any() else 0
    before_end = np.nonzero(t <= t_end + 1e-9)[0]
    i_end = int(before_end[-1]) if before_end.size else len(t) - 1
    t_mid = t0 + (t_end - t0) / 2
    half = (t >= t_mid) & (t <= t_end + 1e-9)
    slope = float("nan")
    if half.sum() >= 3 and np.ptp(t[half]) > 0:
        slope = float(np.polyfit((t[half] - t_mid) / 60.0, rss[half], 1)[0])  # MiB per minute
    half_min = (t_end - t_mid) / 60.0
    growth = slope * half_min if np.isfinite(slope) else float("nan")
    flat = bool(np.isfinite(growth) and growth < flat_mib)
    per_req = per_request_fit(t, rss, ends, t_end)
    per_request_ok = bool(np.isfinite(per_req["bytes_per_request"]) and per_req["bytes_per_request"] <= max_bytes_per_request)
    fds = np.array([s["fds"] for s in samples])
    step_mib, step_t = 0.0, float("nan")
    idx = np.nonzero(half)[0]
    if idx.size >= 2:  # the largest rise between two consecutive samples of the second half
        d = np.diff(rss[idx])
        j = int(np.argmax(d))
        step_mib, step_t = float(d[j]), float(t[idx[j + 1]] - t0)
    return {
        "samples": int(len(t)),
        "samples_in_load": int(load.sum()),
        "samples_in_second_half": int(half.sum()),
        "start_mib": float(rss[i_start]),
        "start_t_s": float(t[i_start] - t0),
        "peak_mib": float(rss[load].max()) if load.any() else float(rss.max()),
        "end_mib": float(rss[i_end]),
        "rest_mib": float(rss[-1]),
        "hwm_mib": float(samples[-1]["hwm_mib"]),
        "slope_mib_per_min": slope,
        "second_half_growth_mib": growth,
        "flat": flat,
        "flat_threshold_mib": flat_mib,
        "threads_end": int(samples[-1]["threads"]),
        "largest_step_mib": step_mib,
        "largest_step_t_s": step_t,
        "fds_peak": int(fds[load].max()) if load.any() else int(fds.max()),
        "fds_start": int(samples[i_start]["fds"]),
        "fds_rest": int(samples[-1]["fds"]),
        **per_req,
        "per_request_ok": per_request_ok,
        "max_bytes_per_request": max_bytes_per_request,
    }


def git_state() -> dict[str, Any]:
    """The commit the nodes ran, and the paths that differed from it (the tree others edit)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "modified": dirty}


# -- the soak ----------------------------------------------------------------------------------------

def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def node_args(cfg: SoakConfig) -> tuple[list[str], list[str]]:
    """(CTX args, GEN args without --ctx)."""
    ctx_blocks = cfg.ctx_num_blocks or blocks_for(cfg.isl) * cfg.concurrency * 9 // 8 + 64
    gen_blocks = cfg.gen_num_blocks or blocks_for(cfg.isl + cfg.osl) * cfg.max_num_seqs * 9 // 8 + 64
    ctx = ["ctx", "--host", "127.0.0.1", "--num-blocks", str(ctx_blocks)]
    gen = ["gen", "--host", "127.0.0.1", "--num-blocks", str(gen_blocks), "--kv-checksums",  # the soak compares them
           "--max-tokens-in-buffer", str(cfg.max_tokens_in_buffer), "--max-num-seqs", str(cfg.max_num_seqs)]
    return ctx, gen


async def _wait_rest(gen: str, ctx: str, timeout_s: float, secret: bytes | None) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Poll GEN until ``rest_problems`` is empty and CTX until it holds nothing, at most ``timeout_s``
    in all; returns the last stats of both and the seconds it took."""
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while True:
        g = await control.call(gen, {"op": "stats"}, secret=secret, timeout=10)
        c = await control.call(ctx, {"op": "stats"}, secret=secret, timeout=10)
        rest = not g["rest_problems"] and not c["store"]["held_requests"] and not c["pool"]["used_blocks"]
        if rest or time.perf_counter() >= deadline:
            return g, c, time.perf_counter() - t0
        await anyio.sleep(0.1)


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run one soak and return the report (see ``problems`` for the verdict)."""
    nofile = raise_nofile()
    if nofile["after"] < needed_fds(cfg.concurrency):
        raise RuntimeError(f"RLIMIT_NOFILE {nofile['after']} (hard {nofile['hard']}) is below the ~{needed_fds(cfg.concurrency)} "
                           f"descriptors concurrency {cfg.concurrency} needs; raise the hard limit (ulimit -Hn)")
    ctx_args, gen_args = node_args(cfg)
    env = node_env()
    prompts = client.make_prompts(cfg.requests, cfg.isl, seed=cfg.seed)
    t_wall = time.perf_counter()
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(NodeProcess.start(ctx_args, env=env, log_dir=cfg.log_dir))
        gen = stack.enter_context(NodeProcess.start([*gen_args, "--ctx", ctx.info["ctrl"]], env=env, log_dir=cfg.log_dir))
        pids = {"ctx": node_pid(ctx.proc.pid), "gen": node_pid(gen.proc.pid)}
        sampler = RssSampler(pids, cfg.sample_s)

        async def drive() -> tuple[client.LoadResult, float, dict[str, Any], dict[str, Any], float]:
            result = await client.run_load(ctx=[ctx.info["ctrl"]], gen=gen.info["ctrl"], secret=gen.secret, prompts=prompts,
                                           max_tokens=cfg.osl, concurrency=cfg.concurrency, progress=cfg.progress,
                                           timeout_s=cfg.request_timeout_s, label="soak")
            t_load_end = time.time()
            g, c, rest_s = await _wait_rest(gen.info["ctrl"], ctx.info["ctrl"], cfg.rest_timeout_s, gen.secret)
            return result, t_load_end, g, c, rest_s

        with sampler:
            result, t_load_end, gen_stats, ctx_stats, rest_wait_s = anyio.run(drive, backend="asyncio")
            time.sleep(min(2.0, 2 * cfg.sample_s))  # a few samples at rest
        alive = {"ctx": ctx.alive(), "gen": gen.alive()}
        logs = {"ctx": str(ctx.log_path), "gen": str(gen.log_path)}
    wall_s = time.perf_counter() - t_wall

    summary = client.summarize(result)
    t0 = result.started_at
    ends = sorted(r.t_end for r in result.records)
    k = min(len(ends), cfg.warmup_requests or cfg.concurrency)
    t_warm = t0 + (ends[k - 1] if k else 0.0)
    done_at = [t0 + e for e in ends]  # unix time each request ended: the x axis of the bytes/request fit
    rss = {name: rss_figures(series, t0=t0, t_warm=t_warm, t_end=t_load_end, flat_mib=cfg.flat_mib, ends=done_at,
                             max_bytes_per_request=cfg.max_bytes_per_request)
           for name, series in sampler.series.items()}
    eng = gen_stats["engine"]
    failed_records = [r.to_json() for r in result.records if not r.ok][:50]
    report: dict[str, Any] = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
                   "ctx_args": ctx_args, "gen_args": gen_args},
        "nofile": nofile,
        "git": git_state(),
        "requests": summary["requests"],
        "failures": summary["failures"],
        "failure_reasons": summary["failure_reasons"],
        "failed_records": failed_records,
        "kv_checksum_compared": summary["kv_checksum_compared"],
        "kv_checksum_mismatches": summary["kv_checksum_mismatches"],
        "output_tok_s": summary["output_tok_s"],
        "request_s": summary["request_s"],
        "duration_s": summary["duration_s"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "itl_ms": summary["itl_ms"],
        "e2e_ms": summary["e2e_ms"],
        "leaks": {
            "gen_rest_problems": gen_stats["rest_problems"],
            "gen_pool_used_blocks": eng["pool"]["used_blocks"],
            "gen_budget_in_use": eng["budget"]["in_use"],
            "gen_budget_capacity": eng["budget"]["capacity"],
            "gen_budget_holders": eng["budget"]["holders"],
            "gen_budget_waiters": eng["budget"]["waiters"],
            "ctx_held_requests": ctx_stats["store"]["held_requests"],
            "ctx_held_blocks": ctx_stats["store"]["held_blocks"],
            "ctx_pool_used_blocks": ctx_stats["pool"]["used_blocks"],
            "rest_wait_s": rest_wait_s,
        },
        "gen": {
            "finished": eng["finished"], "aborted": eng["aborted"], "failed": eng["failed"],
            "deferrals": eng["deferrals"],
            "peak_staging_bytes": eng["peak_staging_bytes"], "transfer_budget_bytes": eng["transfer_budget_bytes"],
            "budget_grants": eng["budget"]["grants"], "budget_peak_in_use": eng["budget"]["peak_in_use"],
            "pool_peak_used_blocks": eng["pool"]["peak_used_blocks"], "pool_num_blocks": eng["pool"]["num_blocks"],
            "pool_exhaustions": eng["pool"]["exhaustions"],
            "mean_batch": gen_stats["loop"]["mean_batch"], "decode_iterations": gen_stats["loop"]["decode_iterations"],
            "loop_reports": gen_stats["loop"]["iterations"],
            "exec_blocked_ms": gen_stats["loop"]["blocked_ms"], "model_ms": gen_stats["loop"]["model_ms"],
        },
        "ctx": {"prefills": ctx_stats["prefills"], "store": ctx_stats["store"],
                "pool_peak_used_blocks": ctx_stats["pool"]["peak_used_blocks"],
                "pool_num_blocks": ctx_stats["pool"]["num_blocks"]},
        "rss": rss,
        "rss_series": {name: [{**s, "t": s["t"] - t0} for s in series] for name, series in sampler.series.items()},
        "times": {"warmup_end_s": t_warm - t0, "load_end_s": t_load_end - t0, "second_half_from_s": (t_load_end - t0) / 2},
        "nodes_alive_at_end": alive,
        "node_pids": pids,
        "node_logs": logs,
        "wall_s": wall_s,
    }
    report["problems"] = problems(report)
    return report


def problems(report: dict[str, Any]) -> list[str]:
    """Why the soak failed (empty when it passed)."""
    out = []
    if report["failures"]:
        out.append(f"{report['failures']} client failures: {report['failure_reasons']}")
    if report["kv_checksum_mismatches"]:
        out.append(f"{report['kv_checksum_mismatches']} KV checksum mismatches")
    lk = report["leaks"]
    if lk["gen_rest_problems"]:
        out.append(f"GEN not at rest: {lk['gen_rest_problems']}")
    if lk["gen_pool_used_blocks"]:
        out.append(f"GEN pool: {lk['gen_pool_used_blocks']} blocks used")
    if lk["gen_budget_in_use"] or lk["gen_budget_holders"] or lk["gen_budget_waiters"]:
        out.append(f"GEN budget not full: {lk['gen_budget_in_use']} in use")
    if lk["ctx_held_requests"] or lk["ctx_pool_used_blocks"]:
        out.append(f"CTX holds {lk['ctx_held_requests']} requests, {lk['ctx_pool_used_blocks']} blocks used")
    for name, r in report["rss"].items():
        if not r.get("flat"):
            out.append(f"{name.upper()} RSS not flat: {r.get('second_half_growth_mib', float('nan')):.1f} MiB over the "
                       f"second half (threshold {r.get('flat_threshold_mib')} MiB)" if r.get("samples") else
                       f"{name.upper()} RSS not sampled")
        if r.get("samples") and not r.get("per_request_ok"):
            bpr = r.get("bytes_per_request", float("nan"))
            out.append(f"{name.upper()} RSS grows {bpr:,.0f} B/request over the second half (bound "
                       f"{r.get('max_bytes_per_request'):g} B/request)" if np.isfinite(bpr) else
                       f"{name.upper()} RSS bytes/request not computed ({r.get('fit_samples', 0)} samples in the second half)")
    if not all(report["nodes_alive_at_end"].values()):
        out.append(f"a node died: {report['nodes_alive_at_end']}")
    return out


# -- output ------------------------------------------------------------------------------------------

def report_rows(report: dict[str, Any]) -> list[list[Any]]:
    r, lk, g = report, report["leaks"], report["gen"]
    d = lambda x: " / ".join(_report.fmt(x[k]) for k in ("mean", "p50", "p99"))  # noqa: E731
    rows: list[list[Any]] = [
        ["requests / concurrency / ISL / OSL",
         f"{r['requests']:,} / {r['config']['concurrency']:,} / {r['config']['isl']} / {r['config']['osl']}"],
        ["client failures (target 0)", f"{r['failures']:,}" + (f"  {r['failure_reasons']}" if r["failures"] else "")],
        ["KV checksums compared / mismatched", f"{r['kv_checksum_compared']:,} / {r['kv_checksum_mismatches']:,}"],
        ["output tok/s", r["output_tok_s"]],
        ["requests/s", r["request_s"]],
        ["load duration s", r["duration_s"]],
        ["TTFT ms mean / p50 / p99", d(r["ttft_ms"])],
        ["TPOT ms mean / p50 / p99", d(r["tpot_ms"])],
        ["GEN deferrals (episodes)", ", ".join(f"{k} {v:,}" for k, v in g["deferrals"].items()) or "none"],
        ["GEN budget peak in use / capacity bytes", f"{g['budget_peak_in_use']:,} / {g['transfer_budget_bytes']:,}"],
        ["GEN peak staging-buffer bytes (0: KV landed in the pool directly)", f"{g['peak_staging_bytes']:,}"],
        ["GEN mean decode batch", g["mean_batch"]],
        ["GEN loop statistics: iterations recorded (fixed 5 MiB ring)", f"{g['loop_reports']:,}"],
        ["GEN rest_problems", "none" if not lk["gen_rest_problems"] else "; ".join(lk["gen_rest_problems"])],
        ["GEN pool used blocks (end)", f"{lk['gen_pool_used_blocks']:,} of {g['pool_num_blocks']:,}"],
        ["GEN budget in use (end)", f"{lk['gen_budget_in_use']:,} of {lk['gen_budget_capacity']:,}"],
        ["CTX held requests / pool used blocks (end)", f"{lk['ctx_held_requests']:,} / {lk['ctx_pool_used_blocks']:,}"],
        ["CTX leases expired", f"{r['ctx']['store']['expired']:,}"],
        ["at rest after s", lk["rest_wait_s"]],
    ]
    for name in ("ctx", "gen"):
        x = r["rss"].get(name, {})
        if not x.get("samples"):
            rows.append([f"{name.upper()} RSS", "no samples"])
            continue
        rows.append([f"{name.upper()} RSS MiB start / peak / end / rest",
                     " / ".join(_report.fmt(x[k], 1) for k in ("start_mib", "peak_mib", "end_mib", "rest_mib"))])
        rows.append([f"{name.upper()} RSS 2nd-half slope MiB/min (growth MiB)",
                     f"{_report.fmt(x['slope_mib_per_min'])} ({_report.fmt(x['second_half_growth_mib'], 1)}) "
                     f"-> {'flat' if x['flat'] else 'NOT FLAT'} (< {x['flat_threshold_mib']:g} MiB)"])
        ok = x.get("per_request_ok")
        rows.append([f"{name.upper()} RSS bytes/request, 2nd half (+- s.e.; over N requests)",
                     f"{_report.fmt(x['bytes_per_request'], 1)} (+- {_report.fmt(x['bytes_per_request_se'], 1)}; "
                     f"{x['fit_requests']:,} requests, {x['fit_samples']} samples) -> "
                     f"{'ok' if ok else 'TOO HIGH' if np.isfinite(x['bytes_per_request']) else 'NOT COMPUTED'} "
                     f"(<= {x['max_bytes_per_request']:g} B/request)"])
        rows.append([f"{name.upper()} largest 1-sample RSS rise in 2nd half",
                     f"{_report.fmt(x['largest_step_mib'], 1)} MiB at {_report.fmt(x['largest_step_t_s'], 0)} s"])
    rows.append(["open fds (~live connections) CTX / GEN: after warm-up, peak, at rest",
                 " / ".join(", ".join(str(r["rss"][n].get(k, "-")) for k in ("fds_start", "fds_peak", "fds_rest"))
                            for n in ("ctx", "gen"))])
    rows.append(["verdict", "PASS" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])])
    return rows


def print_report(report: dict[str, Any]) -> None:
    c = report["config"]
    _report.print_table(f"soak: {c['requests']:,} requests at concurrency {c['concurrency']:,}", ["metric", "value"],
                        report_rows(report))


def plot_rss(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 4.8))
    tm = report["times"]
    for name, color in (("ctx", "tab:blue"), ("gen", "tab:orange")):
        series = report["rss_series"].get(name) or []
        if not series:
            continue
        t = np.array([s["t"] for s in series])
        y = np.array([s["rss_mib"] for s in series])
        x = report["rss"][name]
        ax.plot(t, y, color=color, label=f"{name.upper()} VmRSS")
        dax.plot(t, y - x["start_mib"], color=color, label=f"{name.upper()}")
        if np.isfinite(x.get("slope_mib_per_min", float("nan"))):
            half = (t >= tm["second_half_from_s"]) & (t <= tm["load_end_s"])
            if half.any():
                b = np.polyfit(t[half] / 60.0, y[half], 1)
                th = t[half]
                dax.plot(th, np.polyval(b, th / 60.0) - x["start_mib"], "--", color=color, lw=1.2,
                         label=f"{name.upper()} fit, 2nd half: {x['slope_mib_per_min']:+.2f} MiB/min "
                               f"({x['second_half_growth_mib']:+.1f} MiB)")
    for a in (ax, dax):
        a.axvline(tm["warmup_end_s"], color="grey", ls=":", lw=1, label="warm-up end")
        a.axvspan(tm["second_half_from_s"], tm["load_end_s"], color="grey", alpha=0.1, label="second half (fit)")
        a.axvline(tm["load_end_s"], color="black", ls=":", lw=1, label="load end")
        a.set_xlabel("seconds since the load started")
        a.grid(alpha=0.3)
    c = report["config"]
    fig.suptitle(f"RSS of the two nodes: {c['requests']:,} requests, concurrency {c['concurrency']:,}, "
                 f"ISL {c['isl']}, OSL {c['osl']}")
    ax.set_title("VmRSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    dax.set_title("VmRSS minus its value at the end of the warm-up (MiB)")
    dax.set_ylim(bottom=-10)
    dax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--isl", type=int, default=d.isl, help="input tokens per request (public case 8192, scaled / 64; docs/soak.md)")
    p.add_argument("--osl", type=int, default=d.osl, help="output tokens per request (public case 1024, scaled / 64)")
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="RSS sampling period, seconds")
    p.add_argument("--max-tokens-in-buffer", type=int, default=d.max_tokens_in_buffer, help="GEN staging budget, tokens")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="GEN requests decoding at once (the decode batch)")
    p.add_argument("--gen-num-blocks", type=int, default=0, help="GEN KV pool (0: fits max-num-seqs requests)")
    p.add_argument("--ctx-num-blocks", type=int, default=0, help="CTX KV pool (0: fits concurrency prompts)")
    p.add_argument("--warmup-requests", type=int, default=0, help="RSS start after this many requests ended (0: concurrency)")
    p.add_argument("--flat-mib", type=float, default=d.flat_mib, help="RSS is flat when its fitted growth over the second half is below this")
    p.add_argument("--max-bytes-per-request", type=float, default=d.max_bytes_per_request,
                   help="fail when a node's RSS grows by more than this per request completed (2nd-half fit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the full report (with the RSS series) here")
    p.add_argument("--png", type=Path, help="plot RSS over time here")
    p.add_argument("--log-dir", type=Path, help="node logs here (default: a temporary folder)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(list(sys.argv[1:] if argv is None else argv))
    cfg = SoakConfig(requests=a.requests, concurrency=a.concurrency, isl=a.isl, osl=a.osl, sample_s=a.sample_s,
                     max_tokens_in_buffer=a.max_tokens_in_buffer, max_num_seqs=a.max_num_seqs,
                     gen_num_blocks=a.gen_num_blocks, ctx_num_blocks=a.ctx_num_blocks, seed=a.seed,
                     warmup_requests=a.warmup_requests, flat_mib=a.flat_mib,
                     max_bytes_per_request=a.max_bytes_per_request, progress=not a.no_progress,
                     log_dir=a.log_dir)
    if a.log_dir:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    report = run_soak(cfg)
    print_report(report)
    if a.json:
        _report.write_json(a.json, report)
    if a.png:
        plot_rss(report, a.png)
    if report["problems"]:
        print("SOAK FAILED: " + "; ".join(report["problems"]), file=sys.stderr)
        print(f"node logs: {report['node_logs']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
