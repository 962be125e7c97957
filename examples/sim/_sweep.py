"""``--sweep``: where the design wins and where it stops winning.

Grid: arrivals (``ctx_prefill_slots``: 1 = the public case's CTX-bound load, one first token every
63.7 ms; 4 = four times that, so GEN is the bottleneck and a queue waits at it) x transfer budget
(``max_tokens_in_buffer``) x link bandwidth per GEN rank (the CTX's one NIC as fast, unless
``ctx_nic_gbyte_s`` is set) x GEN TP (those that split the KV heads), for inline and orchestrated,
each against ideal at the same arrivals and TP (ideal moves no KV). Concurrency is capped at the
requests it runs (192). Exits 1 when a replay broke an invariant (``ModeResult.problems``).
Plus the layer-wise pipelined what-if (orchestrated, the first budget, the public case's, GEN TP4) at each
bandwidth. Writes the JSON and a PNG of throughput / ideal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from ._model import SimParams
from ._parallel import run_all
from ._replay import ModeResult, check_requests, check_transfers

BUDGETS = (8192, 32768)  # tokens: one request (the public case), four
BANDWIDTHS = (50.0, 12.5, 3.125)  # GB/s per GEN rank
TPS = (1, 4, 8)
CTX_SLOTS = (1, 4)
SWEPT = ("gen_tp", "iterations_per_step", "link_gbyte_s", "max_tokens_in_buffer", "pipelined")
"""Parameters the sweep sets itself at every point (``--set`` of one is refused: it would be ignored,
or, ``pipelined``, turn the plain runs into pipelined ones)."""


def sweep(base: SimParams, *, json_path: str, png_path: str, budgets: tuple[int, ...] = BUDGETS,
          bandwidths: tuple[float, ...] = BANDWIDTHS, tps: tuple[int, ...] = TPS, warmup: int = 32,
          requests: int = 192, ctx_slots: tuple[int, ...] = CTX_SLOTS, jobs: int | None = None) -> int:
    """Replays every point (``jobs`` side by side, see ``_parallel``), then writes the JSON and the PNG."""
    # exact steps (iterations_per_step 1): with long transfers, a coarser step changes inline's outcome
    # (results/sim_iterations_per_step.json); fewer requests instead, so the grid runs in minutes
    base = dataclasses.replace(base, warmup=min(base.warmup, warmup), requests=min(base.requests, requests),
                               iterations_per_step=1)
    base = dataclasses.replace(base, concurrency=min(base.concurrency, base.requests))  # what can be in flight
    base.check()
    skipped = [tp for tp in tps if base.num_kv_heads % tp]
    if skipped:
        print(f"sweep: GEN TP {', '.join(map(str, skipped))} left out: {base.num_kv_heads} KV heads do not split over it",
              file=sys.stderr)
        tps = tuple(tp for tp in tps if tp not in skipped)
    if not tps:
        raise ValueError(f"no GEN TP of the sweep splits {base.num_kv_heads} KV heads")
    t0 = time.perf_counter()
    work: list[tuple[SimParams, str]] = []
    refs: dict[str, int] = {}  # "slots/tp" -> index in work of its ideal
    grid: list[int] = []  # indices in work of the inline and orchestrated points
    for slots in ctx_slots:
        for tp in tps:
            p = dataclasses.replace(base, gen_tp=tp, ctx_prefill_slots=slots, max_tokens_in_buffer=budgets[0])
            refs[f"{slots}/{tp}"] = len(work)
            work.append((p, "ideal"))
            for budget in (budgets if tp == 4 or len(tps) == 1 else budgets[:1]):  # the budget axis at TP4 only
                for bw in bandwidths:
                    q = dataclasses.replace(p, max_tokens_in_buffer=budget, link_gbyte_s=bw)
                    for mode in ("inline", "orchestrated"):
                        grid.append(len(work))
                        work.append((q, mode))
    tp = 4 if 4 in tps else tps[0]
    key = f"{base.ctx_prefill_slots}/{tp}"
    if key not in refs:
        refs[key] = len(work)
        work.append((dataclasses.replace(base, gen_tp=tp, max_tokens_in_buffer=budgets[0]), "ideal"))
    piped_at: list[int] = []  # index in work of each bandwidth's plain run (its pipelined twin: the next)
    for bw in bandwidths:
        q = dataclasses.replace(base, gen_tp=tp, link_gbyte_s=bw, max_tokens_in_buffer=budgets[0])
        piped_at.append(len(work))
        work += [(q, "orchestrated"), (dataclasses.replace(q, pipelined=True), "orchestrated")]

    for q, mode in work:
        q.check()
        check_requests(q)
        if mode != "ideal":
            check_transfers(q)

    def done(i: int, r: ModeResult) -> None:
        q, mode = work[i]
        print(f"  [{time.perf_counter() - t0:4.0f} s] ctx={q.ctx_prefill_slots} tp={q.gen_tp} "
              f"budget={q.max_tokens_in_buffer} bw={q.link_gbyte_s} {mode}{' pipelined' if q.pipelined else ''}: "
              f"{r.output_tok_s:,.0f} tok/s ({r.wall_s:.1f} s)", file=sys.stderr)

    results = run_all(work, jobs=jobs, on_done=done)
    ideal = {k: results[i].output_tok_s for k, i in refs.items()}
    points: list[dict[str, Any]] = []
    for i in grid:
        (q, mode), r = work[i], results[i]
        points.append({"ctx_slots": q.ctx_prefill_slots, "gen_tp": q.gen_tp, "budget_tokens": q.max_tokens_in_buffer,
                       "link_gbyte_s": q.link_gbyte_s, "mode": mode,
                       "vs_ideal": r.output_tok_s / ideal[f"{q.ctx_prefill_slots}/{q.gen_tp}"], **r.summary()})
    pipelined = []
    for i in piped_at:
        q, (plain, piped) = work[i][0], results[i : i + 2]
        pipelined.append({"gen_tp": tp, "link_gbyte_s": q.link_gbyte_s, "budget_tokens": q.max_tokens_in_buffer,
                          "kv_wait_ms": [plain.kv_wait_ms_mean, piped.kv_wait_ms_mean],
                          "tpot_ms": [plain.tpot_ms_mean, piped.tpot_ms_mean],
                          "ttft_ms": [plain.ttft_ms_mean, piped.ttft_ms_mean],
                          "vs_ideal": [plain.output_tok_s / ideal[key], piped.output_tok_s / ideal[key]]})
    problems = [f"ctx={q.ctx_prefill_slots} tp={q.gen_tp} budget={q.max_tokens_in_buffer} bw={q.link_gbyte_s}"
                f"{' pipelined' if q.pipelined else ''} {problem}"
                for (q, _), r in zip(work, results) for problem in r.problems()]
    payload = {"base": base.describe(), "ideal_output_tok_s": ideal, "points": points, "pipelined": pipelined,
               "tps_left_out": skipped, "problems": problems, "wall_s": time.perf_counter() - t0}
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    plot(payload, png_path)
    print(summary(payload))
    print(f"wrote {json_path} and {png_path} in {payload['wall_s']:.0f} s", file=sys.stderr)
    if problems:
        print("INVARIANTS BROKEN:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


def summary(payload: dict[str, Any]) -> str:
    lines = ["| CTX slots | GEN TP | budget (tokens) | link GB/s | inline / ideal | orchestrated / ideal | "
             "inline blocked s | orchestrated blocked s |", "|---|---|---|---|---|---|---|---|"]
    by = {(p["ctx_slots"], p["gen_tp"], p["budget_tokens"], p["link_gbyte_s"], p["mode"]): p for p in payload["points"]}
    for (slots, tp, budget, bw, mode), p in by.items():
        if mode != "inline":
            continue
        o = by[(slots, tp, budget, bw, "orchestrated")]
        lines.append(f"| {slots} | {tp} | {budget} | {bw} | {p['vs_ideal']:.3f} | {o['vs_ideal']:.3f} | "
                     f"{p['exec_blocked_ms']['sum_s']:.1f} | {o['exec_blocked_ms']['sum_s']:.1f} |")
    lines += ["", "| pipelined what-if (orchestrated, GEN TP%s): link GB/s | CTX token -> first GEN token ms | TPOT ms | vs ideal |"
              % (payload["pipelined"][0]["gen_tp"] if payload["pipelined"] else "-"), "|---|---|---|---|"]
    for w in payload["pipelined"]:
        lines.append(f"| {w['link_gbyte_s']} | {w['kv_wait_ms'][0]:.1f} -> {w['kv_wait_ms'][1]:.1f} | "
                     f"{w['tpot_ms'][0]:.3f} -> {w['tpot_ms'][1]:.3f} | {w['vs_ideal'][0]:.3f} -> {w['vs_ideal'][1]:.3f} |")
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({p["gen_tp"] for p in payload["points"]})
    budgets = sorted({p["budget_tokens"] for p in payload["points"]})
    slots_all = sorted({p["ctx_slots"] for p in payload["points"]})
    fig, axes = plt.subplots(len(slots_all), len(tps), figsize=(4.5 * len(tps), 3.6 * len(slots_all)), sharey=True,
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, slots in zip(axes, slots_all):
        for ax, tp in zip(row, tps):
            for k, budget in enumerate(budgets):
                for mode, style in (("inline", "--"), ("orchestrated", "-")):
                    pts = sorted((p["link_gbyte_s"], p["vs_ideal"]) for p in payload["points"]
                                 if p["ctx_slots"] == slots and p["gen_tp"] == tp and p["budget_tokens"] == budget
                                 and p["mode"] == mode)
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", color=colors[k % len(colors)],
                            label=f"{mode}, budget {budget} tok")
            ax.set_xscale("log")
            bws = sorted({p["link_gbyte_s"] for p in payload["points"]})
            ax.set_xticks(bws, [f"{b:g}" for b in bws])
            ax.minorticks_off()
            ax.set_title(f"GEN TP{tp}, {'CTX-bound (public case)' if slots == 1 else f'{slots}x arrivals (GEN-bound)'}",
                         fontsize=9)
            nic = payload["base"]["ctx_nic_gbyte_s"]
            ax.set_xlabel("link bandwidth per GEN rank (GB/s)" + ("; CTX NIC the same" if nic is None else f"; CTX NIC {nic:g}"),
                          fontsize=8)
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("output throughput / ideal")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    b = payload["base"]
    fig.suptitle(f"Replay: {b['num_layers']} layers x {b['num_kv_heads']} KV heads, ISL {b['isl']} / OSL {b['osl']}, "
                 f"{b['warmup']} + {b['requests']} requests at concurrency {b['concurrency']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
