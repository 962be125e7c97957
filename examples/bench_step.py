"""``python -m examples.bench_step``: what one engine step costs the host, this tree against another.

    python -m examples.bench_step [--baseline REV] [--gen-tp 4] [--batches 16,67,256] [--steps 2000]
                                  [--rounds 3] [--json results/bench_step.json]

A GEN group of ``--gen-tp`` ranks (``TPGenEngine`` x N stepped by ``LocalGroup.step_all``, ideal mode:
no transfer, a model that returns its input token) at the public case's per-rank KV geometry on
torch's ``meta`` device, kept at each batch size (a finished request is replaced at once; prompts of
8,192 tokens, 129 output tokens: the replay's public case). It times the step only: the host's
per-step Python (the step message, scheduling, admission, the batch, the tokens), which is what
bounds the replay's speed and what a real GEN's execution thread spends besides the model.

Each round runs both trees in fresh processes, one after the other (``--baseline``, default the
commit before this benchmark's step changes, from ``git archive``), and prints the ratio per batch
size (median of the rounds): a change on a noisy machine shows as a ratio, not as a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "8ce462b"  # the last tree before the numpy pool and the batch-array step

_WORKER = r"""
import json, sys, time
import structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
import torch
from orchestrator import GenRequest, LocalGroup, Mode, OrchestratorConfig, TPGenEngine
from transports import KVLayout

gen_tp, batches, steps = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
layout = KVLayout(num_layers=36, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.bfloat16)
out = {}
for batch in batches:
    per = layout.blocks_for(8192 + 129)
    group = LocalGroup(gen_tp)
    sink = []
    engines = [TPGenEngine(OrchestratorConfig(layout=layout, num_blocks=per * (2 * batch + 8),
                                              transfer_budget_bytes=layout.wire_bytes(per), mode=Mode.IDEAL,
                                              max_num_seqs=batch, max_model_len=8192 + 129,
                                              kv_head_offset=2 * r, device="meta"),
                           None, lambda b: b.tokens, on_output=sink.append if r == 0 else None,
                           sync=group.sync(r))
               for r in range(gen_tp)]
    n = 0

    def step():
        global n
        while engines[0].live_requests < batch:
            engines[0].submit(GenRequest(f"r{n}", prompt_len=8192, first_token=1, max_tokens=129))
            n += 1
        LocalGroup.step_all(engines)
        sink.clear()

    for _ in range(300):  # warm-up: the batch full, every request at a different age
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    out[str(batch)] = (time.perf_counter() - t) / steps * 1e6
print(json.dumps(out))
"""


def _tree(rev: str, tmp: str) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "orchestrator", "transports"],
                             capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"cannot read {rev} from git: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
    return Path(tmp)


def _run(tree: Path, gen_tp: int, batches: str, steps: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _WORKER, str(gen_tp), batches, str(steps)], cwd=tree,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the step worker failed in {tree}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.bench_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help=f"the git revision to compare with (default {BASELINE})")
    ap.add_argument("--gen-tp", type=int, default=4)
    ap.add_argument("--batches", default="16,67,256", help="batch sizes (67: the public case's replay)")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per batch size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="kvo-step-") as tmp:
        base = _tree(args.baseline, tmp)
        for k in range(args.rounds):
            here = _run(ROOT, args.gen_tp, args.batches, args.steps)
            then = _run(base, args.gen_tp, args.batches, args.steps)
            rounds.append({"this": here, "baseline": then})
            print(f"round {k + 1}/{args.rounds}: " + ", ".join(
                f"batch {b}: {then[str(b)]:.0f} -> {here[str(b)]:.0f} us" for b in batches), file=sys.stderr, flush=True)
    print(f"\nGEN TP{args.gen_tp} step, host time per step (median of {args.rounds} rounds), "
          f"baseline {args.baseline} vs this tree:\n")
    print("| batch | baseline us | this tree us | this / baseline |")
    print("|---|---|---|---|")
    summary = {}
    for b in batches:
        then = statistics.median(r["baseline"][str(b)] for r in rounds)
        here = statistics.median(r["this"][str(b)] for r in rounds)
        ratio = statistics.median(r["this"][str(b)] / r["baseline"][str(b)] for r in rounds)
        summary[str(b)] = {"baseline_us": then, "this_us": here, "ratio": ratio}
        print(f"| {b} | {then:,.0f} | {here:,.0f} | {ratio:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"gen_tp": args.gen_tp, "baseline": args.baseline, "steps": args.steps,
                                               "summary": summary, "rounds": rounds}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
