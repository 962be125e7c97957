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
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from examples import _report
from examples.tiny_model import ModelConfig, TinyModel
from examples.two_node import cli, client, control
from examples.two_node.launch import Netns, NodeProcess, env_secret, node_env
from transports.ucx import UCX_DEFAULTS


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.two_node demo", description=__doc__.split("\n", 2)[2].split("\nPrints")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=cli.positive_int, default=256)
    p.add_argument("--concurrency", type=cli.positive_int, default=64)
    p.add_argument("--isl", type=cli.positive_int, default=256, help="input (prompt) tokens per request")
    p.add_argument("--osl", type=cli.positive_int, default=32, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--mode", default="orchestrated", choices=["orchestrated", "inline"])
    p.add_argument("--max-tokens-in-buffer", type=cli.positive_int, default=2048,
                   help="GEN transfer budget in tokens of KV (small enough that backpressure happens)")
    p.add_argument("--num-blocks", type=cli.positive_int, default=4096, help="KV blocks per node")
    p.add_argument("--kv-transfer-timeout-ms", type=cli.positive_int, default=60_000)
    p.add_argument("--ctx-nodes", type=cli.positive_int, default=1,
                   help="CTX processes; the client spreads requests over them")
    p.add_argument("--gen-tp", type=int, default=1, choices=[1, 2, 4, 8],
                   help="GEN tensor-parallel ranks (each pulls its KV heads; one process per rank)")
    p.add_argument("--ctx-tp", type=int, default=1, choices=[1, 2, 4, 8],
                   help="CTX tensor-parallel ranks (each holds its KV heads and serves them; GEN ranks fan in)")
    p.add_argument("--netns", action="store_true", help="run CTX and GEN in two network namespaces (root)")
    p.add_argument("--kv-transport", default="ucx", choices=["ucx", "nixl"],
                   help="the KV data plane both nodes use (docs/transport.md: ucx is the default, fastest over TCP)")
    p.add_argument("--json", type=cli.writable_file, help="write the report here (checked before anything starts)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def reference_tokens(prompts: list[list[int]], osl: int, *, progress: bool = False) -> list[list[int]]:
    """The single-process run: prefill + decode with an unpaged cache, one prompt at a time (up
    to a minute for the default load: a progress bar, or a plain line every few seconds)."""
    model = TinyModel(ModelConfig())
    out = []
    with client.Progress(len(prompts), progress, "single-process reference") as bar:
        for prompt in prompts:
            out.append(model.generate_reference(prompt, osl))
            bar.update()
    return out


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
    if not args.no_progress:
        print(f"checking {len(prompts):,} answers against a single-process run of the model ...", file=sys.stderr)
    reference = reference_tokens(prompts, args.osl, progress=not args.no_progress)
    detail = parity_detail(result.records, reference)
    return summary, {
        "requests": summary["requests"],
        "failures": summary["failures"],
        "failure_reasons": summary["failure_reasons"],
        "failure_messages": summary["failure_messages"],
        # every request compared, its tokens and its KV CRCs equal (parity_detail says which part not)
        "parity": detail["tokens"] == detail["kv"] == "ok" and detail["not_checked"] == 0,
        "parity_detail": detail,
        "output_tok_s": summary["output_tok_s"],
        "tpot_ms": summary["tpot_ms"],
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": summary["itl_ms"],
        "duration_s": summary["duration_s"],
        "transport": {
            "backend": args.kv_transport,
            "backend_connected": connected,
            # every control call above proved the node holds the shared secret (mutual MAC); a
            # node without one would have been refused (control._authenticate)
            "control_authenticated": secret is not None,
            "netns": bool(args.netns),
            **({"ucx_defaults": dict(UCX_DEFAULTS)} if args.kv_transport == "ucx" else {}),
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


def parity_detail(records: list[client.RequestRecord], reference: list[list[int]]) -> dict[str, Any]:
    """The two exactness checks, apart: ``tokens`` and ``kv`` are ``"ok"``, ``"mismatch"`` or
    ``"not checked"`` (no succeeded request to compare); ``not_checked`` counts the requests that
    failed (their tokens and KV are not compared: a failure, not a mismatch)."""
    compared = [r for r in records if r.ok]
    tokens = [r.request_id for r in compared if r.tokens != reference[r.index]]
    first_off = None
    if tokens:
        r = next(r for r in compared if r.request_id == tokens[0])
        ref = reference[r.index]
        at = next((i for i, (a, b) in enumerate(zip(r.tokens, ref)) if a != b), min(len(r.tokens), len(ref)))
        first_off = {"request_id": r.request_id, "index": r.index, "token": at,
                     "got": r.tokens[at:at + 4], "expected": ref[at:at + 4]}
    kv_bad = [r.request_id for r in compared if r.checksum_ok is False]
    kv_missing = [r.request_id for r in compared
                  if r.checksum_ok is None or not (r.ctx_checksums or r.ctx_head_checksums)]

    def status(bad: list[str]) -> str:
        return "not checked" if not compared else "mismatch" if bad else "ok"

    return {
        "compared": len(compared),
        "not_checked": len(records) - len(compared),
        "tokens": status(tokens),
        "token_mismatches": tokens[:20],
        "first_token_mismatch": first_off,
        "kv": "not checked" if not compared else "mismatch" if kv_bad else "missing" if kv_missing else "ok",
        "kv_checksum_mismatches": len(kv_bad),
        "kv_mismatched_requests": kv_bad[:20],
        "kv_unchecked_requests": kv_missing[:20],
        "kv_blocks_compared": sum(len(r.gen_head_checksums or r.gen_checksums or []) for r in compared),
    }


def parity_lines(detail: dict[str, Any]) -> list[str]:
    """The console's account of the checks: tokens, KV CRCs, and what was not checked."""
    n = detail["compared"]
    off = detail["first_token_mismatch"]
    tokens = {"ok": f"OK ({n:,} requests equal the single-process run)",
              "mismatch": f"MISMATCH in {len(detail['token_mismatches']):,}{'+' if len(detail['token_mismatches']) == 20 else ''}"
                          f" of {n:,} requests" + (f"; first: {off['request_id']} (prompt {off['index']}) at output token "
                                                   f"{off['token']}: got {off['got']}, expected {off['expected']}"
                                                   if off else ""),
              "not checked": "not checked (no request succeeded)"}[detail["tokens"]]
    kv = {"ok": f"OK ({detail['kv_blocks_compared']:,} KV blocks of {n:,} requests equal on CTX and GEN)",
          "mismatch": f"MISMATCH in {detail['kv_checksum_mismatches']:,} of {n:,} requests; first: "
                      + (detail["kv_mismatched_requests"] or ["?"])[0],
          "missing": f"MISSING for {len(detail['kv_unchecked_requests']):,} requests (a node sent no CRCs); first: "
                     + (detail["kv_unchecked_requests"] or ["?"])[0],
          "not checked": "not checked (no request succeeded)"}[detail["kv"]]
    lines = [f"parity: tokens {tokens}", f"parity: KV CRCs {kv}"]
    if detail["not_checked"]:
        lines.append(f"parity: not checked: {detail['not_checked']:,} requests failed")
    return lines


async def _ctx_at_rest(addr: str, secret: bytes | None, wait_s: float = 10.0) -> dict[str, Any]:
    """A CTX node's statistics once it holds nothing and no send pins a block (a pull ends on the GEN
    when its KV lands, a moment before the CTX sees its send end), or as they are after ``wait_s``
    (10 s, a third of the default lease, so a copy only its lease would free still shows: the
    release of a replicated copy nobody pulls first connects to its CTX rank, which took over 2 s,
    the bound before, once in a full suite run on this 2-core machine)."""
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
    with cli.unwinding():  # SIGTERM, SIGHUP, Ctrl-C: the nodes, their folders, the namespaces go first
        summary, report = run(args)
    client.print_summary(summary, title=f"two-node demo ({report['gen']['mode']}, {'netns' if args.netns else 'loopback'}, "
                                        f"KV over {report['transport']['backend']})")
    g = report["gen"]
    detail = report["parity_detail"]
    for line in parity_lines(detail):
        print(line)
    print(f"GEN: deferrals {g['deferrals']}, transfer budget peak {g['peak_in_flight_bytes']:,} of "
          f"{g['transfer_budget_bytes']:,} bytes in flight, staging buffers peak {g['peak_staging_bytes']:,} bytes, "
          f"execution thread blocked p99 {g['exec_blocked_ms']['p99']:.3f} ms, at rest: {not g['rest_problems']}")
    wrote = True
    if args.json:
        try:
            _report.write_json(args.json, report)
        except OSError as exc:
            print(f"error: cannot write --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            wrote = False
    c = report["ctx"]
    why = [m for m, bad in [
        (f"{report['failures']:,} of {report['requests']:,} requests failed", report["failures"]),
        (f"token mismatch (first: {(detail['token_mismatches'] or ['-'])[0]})", detail["tokens"] == "mismatch"),
        (f"KV CRC mismatch (first: {(detail['kv_mismatched_requests'] or ['-'])[0]})", detail["kv"] == "mismatch"),
        ("KV CRCs missing", detail["kv"] == "missing"),
        ("GEN not at rest: " + "; ".join(map(str, g["rest_problems"]))[:200], g["rest_problems"]),
        ("CTX still holds KV", c["held_requests_after"]), ("CTX blocks still pinned", c["open_pins_after"]),
        ("the report was not written", not wrote)] if bad]
    if why:
        print("FAILED: " + ", ".join(why), file=sys.stderr)
    return 1 if why else 0
