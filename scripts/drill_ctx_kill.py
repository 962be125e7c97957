"""Fault drill against the node CLIs: SIGKILL the CTX while the GEN pulls, restart it, again.

    .venv/bin/python scripts/drill_ctx_kill.py [--kv-transport nixl|ucx] [--rounds 6] [--requests 48]
                                               [--isl 320] [--concurrency 8] [--seed 0] [--json PATH]

Starts a CTX and a GEN node (``python -m examples.two_node ctx|gen``, one shared secret, a model
whose KV is 16 KiB a token, so a 320-token prompt is a 5 MiB pull: over NIXL, above its 4 MiB
``inline_copy_bytes``, such a READ is posted by the GEN's poller thread, not the event loop, until the GEN
has learnt that the CTX copies inline, then in pieces on the loop). Each round drives ``--requests`` requests at
``--concurrency`` through them and SIGKILLs the CTX's process group at a random moment of the load
(uniform in 0.3-2.0 s, from ``--seed``), lets the client finish (the killed CTX's requests fail),
then waits (bounded, 40 s) until the GEN is at rest: budget full, no receive in flight, no KV block
held or quarantined (the GEN's own ``rest_problems``). Then a new CTX starts on the same control
port and the next round begins.

Prints one line per round; exits 1 if the GEN was not at rest after any round (or a node did not
start), 0 otherwise. ``tests/test_faults.py -k drill`` runs two short rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.two_node import client, control  # noqa: E402
from examples.two_node.launch import NodeProcess, env_secret, node_env  # noqa: E402

MODEL = ["--layers", "8", "--kv-heads", "4", "--heads", "4", "--head-dim", "64"]  # 16 KiB of KV a token (fp32)
REST_WAIT_S = 40.0


def _ctx(transport: str, env: dict[str, str], port: int = 0) -> NodeProcess:
    return NodeProcess.start(["ctx", "--port", str(port), "--kv-transport", transport, *MODEL], env=env)


async def _round(ctx: NodeProcess, gen: NodeProcess, secret: bytes | None, prompts: list[list[int]],
                 concurrency: int) -> tuple[client.LoadResult, list[str], float]:
    result = await client.run_load(ctx=[ctx.info["ctrl"]], gen=gen.info["ctrl"], secret=secret, prompts=prompts,
                                   max_tokens=16, concurrency=concurrency, progress=False, label="drill",
                                   timeout_s=60)
    t0 = time.monotonic()
    while True:
        problems = (await control.call(gen.info["ctrl"], {"op": "stats"}, secret=secret))["rest_problems"]
        if not problems or time.monotonic() - t0 > REST_WAIT_S:
            return result, problems, time.monotonic() - t0
        await anyio.sleep(0.2)


def run_drill(*, kv_transport: str = "nixl", rounds: int = 6, requests: int = 48, isl: int = 320,
              concurrency: int = 8, seed: int = 0, out: Any = sys.stdout) -> dict[str, Any]:
    """The drill; returns ``{"rounds": [...], "ok": bool}`` (ok: the GEN at rest after every round)."""
    rng = random.Random(seed)
    env = node_env()
    secret = env_secret(env)
    report: dict[str, Any] = {"kv_transport": kv_transport, "rounds": []}
    ctx = _ctx(kv_transport, env)
    port = int(ctx.info["ctrl"].rsplit(":", 1)[1])
    try:
        gen = NodeProcess.start(["gen", "--kv-transport", kv_transport, "--step", "device", "--max-tokens-in-buffer",
                                 str(isl * 4), "--kv-transfer-timeout-ms", "20000", *MODEL, "--ctx", ctx.info["ctrl"]],
                                env=env)
    except BaseException:
        ctx.stop()
        raise
    try:
        for r in range(rounds):
            delay = rng.uniform(0.3, 2.0)
            killer = threading.Timer(delay, ctx.kill)
            killer.start()
            try:
                result, problems, waited = anyio.run(_round, ctx, gen, secret,
                                                     client.make_prompts(requests, isl, seed=seed + r), concurrency,
                                                     backend="asyncio")
            finally:
                killer.cancel()
                killer.join()
            ok = sum(1 for x in result.records if x.ok)
            report["rounds"].append({"kill_at_s": round(delay, 3), "ok": ok, "failed": len(result.records) - ok,
                                     "rest_wait_s": round(waited, 2), "rest_problems": problems})
            print(f"round {r + 1}/{rounds}: CTX killed at {delay:.2f} s, {ok}/{len(result.records)} requests ok, "
                  f"GEN {'at rest' if not problems else 'NOT at rest: ' + '; '.join(problems)} "
                  f"({waited:.1f} s after the load)", file=out, flush=True)
            ctx.stop()
            ctx = _ctx(kv_transport, env, port)  # same control port: a restarted CTX
    finally:
        gen.stop()
        ctx.stop()
    report["ok"] = all(not r["rest_problems"] for r in report["rounds"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/drill_ctx_kill.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-transport", choices=["nixl", "ucx"], default="nixl")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=48, help="requests per round")
    p.add_argument("--isl", type=int, default=320, help="prompt tokens (16 KiB of KV each)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="kill moments and prompts")
    p.add_argument("--json", type=Path, help="write the per-round report here")
    a = p.parse_args(argv)
    for name in ("rounds", "requests", "isl", "concurrency"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    report = run_drill(kv_transport=a.kv_transport, rounds=a.rounds, requests=a.requests, isl=a.isl,
                       concurrency=a.concurrency, seed=a.seed)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    print("GEN at rest after every round" if report["ok"] else "FAILED: GEN not at rest after a round")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
