"""``python -m examples.two_node demo``: the main job.

Starts a CTX node and a GEN node as two processes on this machine (or in two network namespaces
with ``--netns``), drives a load through them over UCX, then checks exactness:

* parity: every request's tokens equal a single-process, unpaged run of the same model
  (``TinyModel.generate_reference``) on the same prompt;
* KV: the CRC32 of every KV block GEN received equals the one CTX computed after prefill;
* rest: after the load, GEN's budget is full, nothing is in flight, every KV block is free.

Prints a report, optionally writes it with ``--json``, and exits non-zero on any failure,
mismatch or leak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from examples.tiny_model import ModelConfig, TinyModel
from examples.two_node import client, control
from examples.two_node.launch import Netns, NodeProcess, env_secret, node_env
from transports.ucx import UCX_DEFAULTS


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.two_node demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--isl", type=int, default=256, help="input (prompt) tokens per request")
    p.add_argument("--osl", type=int, default=32, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--mode", default="orchestrated", choices=["orchestrated", "inline"])
    p.add_argument("--max-tokens-in-buffer", type=int, default=2048,
                   help="GEN transfer budget in tokens of KV (small enough that backpressure happens)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per node")
    p.add_argument("--kv-transfer-timeout-ms", type=int, default=60_000)
    p.add_argument("--ctx-nodes", type=int, default=1, help="CTX processes; the client spreads requests over them")
    p.add_argument("--gen-tp", type=int, default=1, choices=[1, 2, 4, 8],
                   help="GEN tensor-parallel ranks (each pulls its KV heads; one process per rank)")
    p.add_argument("--ctx-tp", type=int, default=1, choices=[1, 2, 4, 8],
                   help="CTX tensor-parallel ranks (each holds its KV heads and serves them; GEN ranks fan in)")
    p.add_argument("--netns", action="store_true", help="run CTX and GEN in two network namespaces (root)")
    p.add_argument("--kv-transport", default="ucx", choices=["ucx", "nixl"],
                   help="the KV data plane both nodes use (docs/transport.md: ucx is the default, fastest over TCP)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def reference_tokens(prompts: list[list[int]], osl: int) -> list[list[int]]:
    """The single-process run: prefill + decode with an unpaged cache, one prompt at a time."""
    model = TinyModel(ModelConfig())
    return [model.generate_reference(prompt, osl) for prompt in prompts]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the client's summary, the report)."""
    env = node_env()
    secret = env_secret(env)
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(Netns()) if args.netns else None
        ctx_host = ns.addr_a if ns else "127.0.0.1"
        gen_host = ns.addr_b if ns else "127.0.0.1"
        ctxs = [
            stack.enter_context(NodeProcess.start(
                ["ctx", "--host", ctx_host, "--num-blocks", str(args.num_blocks), "--tp", str(args.ctx_tp),
                 "--kv-transport", args.kv_transport],
                env=env, netns=ns.a if ns else None))
            for _ in range(args.ctx_nodes)
        ]
        ctx_addrs = [c.info["ctrl"] for c in ctxs]
        gen = stack.enter_context(NodeProcess.start(
            ["gen", "--host", gen_host, *[a for addr in ctx_addrs for a in ("--ctx", addr)], "--mode", args.mode,
             "--tp", str(args.gen_tp), "--kv-transport", args.kv_transport, "--kv-checksums",
             "--num-blocks", str(args.num_blocks), "--max-tokens-in-buffer", str(args.max_tokens_in_buffer),
             "--kv-transfer-timeout-ms", str(args.kv_transfer_timeout_ms)],
            env=env, netns=ns.b if ns else None))
        if ns:  # the client lives with GEN: it reaches CTX across the veth pair
            stack.enter_context(ns.entered(ns.b))
        prompts = client.make_prompts(args.requests, args.isl, seed=args.seed)

        async def drive() -> tuple[client.LoadResult, dict[str, Any]]:
            result = await client.run_load(ctx=ctx_addrs, gen=gen.info["ctrl"], secret=secret, prompts=prompts,
                                           max_tokens=args.osl, concurrency=args.concurrency,
                                           progress=not args.no_progress, label="demo")
            with anyio.fail_after(30):  # the last completions reach GEN's engine asynchronously
                while (stats := await control.call(gen.info["ctrl"], {"op": "stats"}, secret=secret))["rest_problems"]:
                    await anyio.sleep(0.05)
            return result, stats

        t0 = time.perf_counter()
        result, gen_stats = anyio.run(drive, backend="asyncio")
        connected = f'"{args.kv_transport}_connected"' in gen.log_tail(10_000)  # the GEN really used it
        ctx_stats = [anyio.run(_ctx_at_rest, a, secret, backend="asyncio") for a in ctx_addrs]
        load_s = time.perf_counter() - t0
    summary = client.summarize(result)
    reference = reference_tokens(prompts, args.osl)
    mismatched = [r.request_id for r in result.records if r.ok and r.tokens != reference[r.index]]
    compared = [r for r in result.records if r.ok]
    checksums_ok = all(r.checksum_ok for r in compared) and all(r.ctx_checksums or r.ctx_head_checksums for r in compared)
    parity = bool(compared) and not mismatched and len(compared) == len(result.records) and checksums_ok
    return summary, {
        "requests": summary["requests"],
        "failures": summary["failures"],
        "failure_reasons": summary["failure_reasons"],
        "parity": parity,
        "parity_detail": {
            "compared": len(compared),
            "token_mismatches": mismatched[:20],
            "kv_checksum_mismatches": summary["kv_checksum_mismatches"],
            "kv_blocks_compared": sum(len(r.gen_head_checksums or r.gen_checksums or []) for r in compared),
        },
        "output_tok_s": summary["output_tok_s"],
        "tpot_ms": summary["tpot_ms"],
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": summary["itl_ms"],
        "duration_s": summary["duration_s"],
        "transport": {
            "backend": args.kv_transport,
            "backend_connected": connected,
            "authenticated": True,
            "netns": bool(args.netns),
            "ucx_defaults": dict(UCX_DEFAULTS),
        },
        "gen": {
            "mode": gen_stats["mode"],
            "deferrals": gen_stats["engine"]["deferrals"],
            "peak_in_flight_bytes": gen_stats["engine"]["budget"]["peak_in_use"],
            "peak_staging_bytes": gen_stats["engine"]["peak_staging_bytes"],
            "transfer_budget_bytes": gen_stats["engine"]["transfer_budget_bytes"],
            "exec_blocked_ms": gen_stats["loop"]["blocked_ms"],
            "exec_stalled_ms": gen_stats["loop"]["stalled_ms"],
            "rest_problems": gen_stats["rest_problems"],
            "tp": gen_stats.get("tp", {"world_size": 1}),
        },
        "ctx": {"nodes": len(ctx_stats), "prefills": [c["prefills"] for c in ctx_stats],
                "tp": [c.get("tp", {}).get("world_size", 1) for c in ctx_stats],
                "held_requests_after": sum(c["store"]["held_requests"] for c in ctx_stats),
                # checkouts still open: a released request's blocks are freed when its last one closes
                "open_pins_after": sum(c["store"]["open_pins"] for c in ctx_stats),
                # NIXL: pulls that had to ask for the block ids first (the prefill reply names them)
                "kv_lookups": sum(r.get("kv_server", {}).get("lookups", 0) for c in ctx_stats for r in c["tp"]["ranks"]),
                # NIXL: READs no pin covered (the CTX's revocations kept their blocks)
                "kv_unpinned_reads": sum(r.get("kv_server", {}).get("unpinned_reads", 0)
                                         for c in ctx_stats for r in c["tp"]["ranks"])},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": load_s,
    }


async def _ctx_at_rest(addr: str, secret: bytes | None, wait_s: float = 2.0) -> dict[str, Any]:
    """A CTX node's statistics once it holds nothing and no send pins a block (a pull ends on the GEN
    when its KV lands, a moment before the CTX sees its send end), or as they are after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        stats = await control.call(addr, {"op": "stats"}, secret=secret)
        store = stats["store"]
        if (store["held_requests"] == 0 and store["open_pins"] == 0) or time.monotonic() > deadline:
            return stats
        await anyio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    if args.netns and (why := Netns.unavailable()):
        print(f"--netns: {why}", file=sys.stderr)
        return 2
    summary, report = run(args)
    client.print_summary(summary, title=f"two-node demo ({report['gen']['mode']}, {'netns' if args.netns else 'loopback'}, "
                                        f"KV over {report['transport']['backend']})")
    g = report["gen"]
    print(f"parity: {'OK' if report['parity'] else 'MISMATCH'}  "
          f"({report['parity_detail']['compared']} requests, {report['parity_detail']['kv_blocks_compared']} KV blocks "
          f"checksummed)")
    print(f"GEN: deferrals {g['deferrals']}, transfer budget peak {g['peak_in_flight_bytes']:,} of "
          f"{g['transfer_budget_bytes']:,} bytes in flight, staging buffers peak {g['peak_staging_bytes']:,} bytes, "
          f"execution thread blocked p99 {g['exec_blocked_ms']['p99']:.3f} ms, at rest: {not g['rest_problems']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    c = report["ctx"]
    ok = (report["failures"] == 0 and report["parity"] and not g["rest_problems"] and c["held_requests_after"] == 0
          and c["open_pins_after"] == 0)
    if not ok:
        print("FAILED: " + ", ".join(
            m for m, bad in [("failures", report["failures"]), ("parity", not report["parity"]),
                             ("GEN not at rest", g["rest_problems"]), ("CTX still holds KV", c["held_requests_after"]),
                             ("CTX blocks still pinned", c["open_pins_after"])]
            if bad), file=sys.stderr)
    return 0 if ok else 1
