"""Front overhead, side by side: ``python -m examples.serve.bench -c cluster.yaml``.

Starts the front (which starts its nodes), then runs the same prompts through the same nodes twice,
interleaved in rounds: once with the control-plane client (``examples.two_node.client.run_load``:
prefill then generate, no HTTP) and once through the front (``POST /v1/completions``, streaming SSE
as benchmark clients read it). Both record TTFT (request sent to first token) and TPOT (later
tokens); the difference is what the front costs. Every HTTP answer's tokens are checked against the
direct run's (greedy: they must be equal).

``--fronts 2``: the same through two fronts behind a real etcd (started here on a loopback port):
the first front starts the nodes from the file, which register in etcd; the second has no node of
its own and finds them there; the HTTP requests alternate between the fronts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import yaml

from examples.two_node import client, membership
from examples.two_node.launch import ROOT


async def http_load(urls: list[str], prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    """Stream every prompt through the front; per request: tokens, ttft_s, tpot_s, ok."""
    out: list[dict[str, Any]] = [{} for _ in prompts]
    indices = iter(range(len(prompts)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def one(i: int) -> dict[str, Any]:
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "return_token_ids": True}
            tokens: list[int] = []
            times: list[float] = []
            t0 = time.perf_counter()
            async with http.stream("POST", urls[i % len(urls)] + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return {"ok": False, "status": r.status_code, "tokens": []}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if ids:
                        tokens.extend(ids)
                        times.extend([time.perf_counter() - t0] * len(ids))
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            return {"ok": len(tokens) == max_tokens, "tokens": tokens, "ttft_s": times[0] if times else None,
                    "tpot_s": tpot, "e2e_s": time.perf_counter() - t0}

        async def worker() -> None:
            for i in indices:
                out[i] = await one(i)

        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(prompts))):
                tg.start_soon(worker)
    return out


def _ms(values: list[float]) -> dict[str, float]:
    a = np.asarray([v for v in values if v is not None]) * 1e3
    if a.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.serve.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "examples/serve/cluster.yaml"))
    p.add_argument("--requests", type=int, default=64, help="requests per round and path")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--fronts", type=int, choices=(1, 2), default=1,
                   help="2: two fronts behind a real etcd (the nodes register there)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    secret = os.environ.get("KVO_SHARED_SECRET") or secrets.token_hex(32)
    env = {**os.environ, "KVO_SHARED_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    with contextlib.ExitStack() as stack:
        configs = [a.config]
        if a.fronts == 2:
            url = stack.enter_context(membership.start_etcd())
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvo-bench-")))
            raw = yaml.safe_load(Path(a.config).read_text())
            raw["etcd"] = {"url": url, "prefix": "/kvo/bench/"}
            configs = [str(folder / "first.yaml"), str(folder / "second.yaml")]
            Path(configs[0]).write_text(yaml.safe_dump(raw))
            Path(configs[1]).write_text(yaml.safe_dump({**raw, "ctx": [], "gen": []}))
        fronts = [stack.enter_context(_front(c, env)) for c in configs]
        return _bench(a, secret, fronts)


@contextlib.contextmanager
def _front(config: str, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """``python -m examples.serve -c config`` until READY and every node is up (/health); stopped on exit."""
    front = subprocess.Popen([sys.executable, "-m", "examples.serve", "-c", config, "--port", "0", "--log-level",
                              "warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert front.stdout is not None
        line = front.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit("the front did not start")
        info = json.loads(line[6:])
        info["url"] = f"http://{info['http']}"
        deadline = time.monotonic() + 60
        while (health := httpx.get(info["url"] + "/health", timeout=10)).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the front's nodes did not come up: {health.text}")
            time.sleep(0.2)
        nodes = health.json()["nodes"]
        info["ctx"] = [n["addr"] for n in nodes if n["role"] == "ctx"]
        info["gen"] = [n["addr"] for n in nodes if n["role"] == "gen"]
        yield info
    finally:
        front.send_signal(signal.SIGTERM)
        try:
            front.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(front.pid, signal.SIGKILL)
            front.wait(10)


def _bench(a: argparse.Namespace, secret: str, fronts: list[dict[str, Any]]) -> int:
    info = fronts[0]
    urls = [f["url"] for f in fronts]
    prompts = client.make_prompts(a.requests, a.isl)
    direct: dict[str, list[Any]] = {"ttft": [], "tpot": [], "tokens": [], "dur": [], "n": []}
    http: dict[str, list[Any]] = {"ttft": [], "tpot": [], "tokens": [], "dur": [], "n": []}
    mismatches = failures = 0
    for r in range(a.rounds):
        t0 = time.perf_counter()
        res = anyio.run(lambda: client.run_load(ctx=info["ctx"], gen=info["gen"][0], secret=secret.encode(),
                                                prompts=prompts, max_tokens=a.osl, concurrency=a.concurrency,
                                                progress=False, id_prefix=f"direct{r}"), backend="asyncio")
        direct["dur"].append(time.perf_counter() - t0)
        failures += sum(not rec.ok for rec in res.records)
        direct["ttft"] += [rec.ttft_s for rec in res.records]
        direct["tpot"] += [rec.tpot_s() for rec in res.records]
        direct["n"].append(sum(len(rec.tokens) for rec in res.records if rec.ok))
        reference = [rec.tokens for rec in sorted(res.records, key=lambda rec: rec.index)]
        t0 = time.perf_counter()
        hres = anyio.run(lambda: http_load(urls, prompts, a.osl, a.concurrency), backend="asyncio")
        http["dur"].append(time.perf_counter() - t0)
        failures += sum(not h["ok"] for h in hres)
        mismatches += sum(h["tokens"] != ref for h, ref in zip(hres, reference))
        http["ttft"] += [h.get("ttft_s") for h in hres]
        http["tpot"] += [h.get("tpot_s") for h in hres]
        http["n"].append(sum(len(h["tokens"]) for h in hres if h["ok"]))
    report = {
        name: {"ttft_ms": _ms(d["ttft"]), "tpot_ms": _ms(d["tpot"]), "output_tok_s": sum(d["n"]) / sum(d["dur"])}
        for name, d in (("direct", direct), ("front", http))
    }
    report["failures"] = failures
    report["token_mismatches"] = mismatches
    report["front_vs_direct"] = {
        "throughput_ratio": report["front"]["output_tok_s"] / report["direct"]["output_tok_s"],
        "ttft_p99_added_ms": report["front"]["ttft_ms"]["p99"] - report["direct"]["ttft_ms"]["p99"]}
    report["config"] = vars(a)
    report["load_avg_at_end"] = os.getloadavg()  # 1, 5, 15 min: how quiet the machine was
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if failures == 0 and mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
