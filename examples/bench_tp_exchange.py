"""The step exchange of a tensor-parallel GEN group, measured: ``python -m examples.bench tp-exchange``.

Side by side in one run, at TP2 and TP4 (gloo over loopback, one process per rank), for 0 / 16 / 64 /
256 events per step (each event: one arrival at rank 0 and one receive outcome on every rank):

- ``pickle``: the exchange the engine used before (``all_gather_object`` of a dataclass carrying
  whole ``GenRequest``s and request-id outcomes), rebuilt here as the baseline;
- ``pickle+notes``: the same with the per-head KV checksum notes every rank attached when checksums
  were on (the GEN node's default then);
- ``binary``: today's (``TorchStepSync``: the fixed wire form of ``orchestrator._step``, one
  all-gather of a slot, a second only for an overflow).

Prints bytes per rank message and per event, and µs per step (median and p90 over the measured
steps), and the targets' verdicts: <= 32 bytes per event plus a fixed header per rank; at 64
events the binary exchange takes <= 0.3x the pickle exchange's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pickle
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

EVENTS = (0, 16, 64, 256)


@dataclasses.dataclass
class PickleStepMessage:
    """The pre-rewrite step message (the baseline): what ``all_gather_object`` pickled every step."""

    arrivals: list[Any] = dataclasses.field(default_factory=list)
    aborts: list[str] = dataclasses.field(default_factory=list)
    outcomes: list[tuple[str, str | None, str]] = dataclasses.field(default_factory=list)
    quiet: list[str] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    commands: list[Any] = dataclasses.field(default_factory=list)
    stop: bool = False
    admitted: tuple[int, int] = (0, 0)


def _requests(n: int, step: int) -> list[Any]:
    from orchestrator import GenRequest

    return [GenRequest(f"chatcmpl-{step:06d}-{i:04d}", prompt_len=1000 + i, first_token=42, max_tokens=128,
                       peer="127.0.0.1:13337", kv_handle=f"{step * 1000 + i:032x}", eos_token=2) for i in range(n)]


NOTE_BLOCKS = 64
"""Blocks per request in the checksum notes of the ``pickle+notes`` baseline (a 1,000-token prompt
in 16-token blocks, one KV head per rank): what every rank sent every step with checksums on, the
GEN node's default before."""


def _messages(rank: int, n: int, step: int, notes: bool = False) -> tuple[Any, Any]:
    from orchestrator._step import Outcome, StepMessage, Submit

    reqs = _requests(n, step) if rank == 0 else []
    old = PickleStepMessage(arrivals=reqs, admitted=(step, 12345),
                            outcomes=[(f"chatcmpl-{step - 1:06d}-{i:04d}", None, "") for i in range(n)],
                            quiet=[f"chatcmpl-{step - 1:06d}-{i:04d}" for i in range(n)])
    if notes:
        old.notes = [(f"chatcmpl-{step - 1:06d}-{i:04d}", {"h0": rank, "crcs": [[(b * 7919 + i) & 0xFFFFFFFF]
                                                                              for b in range(NOTE_BLOCKS)]})
                     for i in range(n)]
    new = StepMessage(events=[Submit(step * 1000 + i, r) for i, r in enumerate(reqs)], admitted=(step, 12345),
                      outcomes=[Outcome((step - 1) * 1000 + i) for i in range(n)])
    return old, new


def _worker(rank: int, world: int, init: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    from orchestrator._step import TorchStepSync, encode

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(list(range(world)), backend="gloo")
    sync = TorchStepSync(group)
    results = []
    for n in EVENTS:
        row: dict[str, Any] = {"world": world, "events": n}
        for kind in ("pickle", "pickle+notes", "binary"):
            times = []
            for step in range(steps + 10):
                old, new = _messages(rank, n, step + 1, notes=kind == "pickle+notes")
                dist.barrier(group)
                t0 = time.perf_counter()
                if kind != "binary":
                    got: list[Any] = [None] * world
                    dist.all_gather_object(got, old, group=group)
                else:
                    got = sync.agree(new)
                dt = time.perf_counter() - t0
                if step >= 10:
                    times.append(dt)
            row[kind] = {
                "us_median": round(statistics.median(times) * 1e6, 1),
                "us_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e6, 1),
            }
            if rank == 0:
                o0, n0 = _messages(0, n, 1, notes=kind == "pickle+notes")
                o1, n1 = _messages(1, n, 1, notes=kind == "pickle+notes")
                row[kind]["bytes_rank0"] = len(pickle.dumps(o0)) if kind != "binary" else len(encode(n0))
                row[kind]["bytes_rank1"] = len(pickle.dumps(o1)) if kind != "binary" else len(encode(n1))
        results.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, steps: int, tmp: Path) -> list[dict[str, Any]]:
    import subprocess

    init = f"tcp://127.0.0.1:{_free_port()}"
    out = tmp / f"tp{world}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "examples.bench_tp_exchange", "--worker", str(r), str(world), init,
                               str(steps), str(out)], env=env, cwd=Path(__file__).resolve().parent.parent)
             for r in range(world)]
    try:
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"a TP{world} worker exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return json.loads(out.read_text())


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from orchestrator._step import StepMessage, encode

    header = len(encode(StepMessage()))
    verdicts = {}
    print(f"{'TP':>3} {'events':>6} | {'pickle B r0/r1':>15} {'µs med':>7} {'p90':>7} | {'+notes µs med':>13} | "
          f"{'binary B r0/r1':>15} {'µs med':>7} {'p90':>7} | {'B/outcome':>9} {'B/arrival':>9} | {'÷pickle':>7} {'÷+notes':>7}")
    for r in rows:
        p, pn, b, n = r["pickle"], r["pickle+notes"], r["binary"], r["events"]
        per_outcome = (b["bytes_rank1"] - header) / n if n else 0.0
        per_arrival = (b["bytes_rank0"] - b["bytes_rank1"]) / n if n else 0.0
        ratio, ratio_notes = b["us_median"] / p["us_median"], b["us_median"] / pn["us_median"]
        r["binary"]["bytes_per_outcome"] = round(per_outcome, 1)
        r["binary"]["bytes_per_arrival"] = round(per_arrival, 1)
        r["time_ratio"], r["time_ratio_vs_notes"] = round(ratio, 3), round(ratio_notes, 3)
        print(f"{r['world']:>3} {n:>6} | {p['bytes_rank0']:>7}/{p['bytes_rank1']:<7} {p['us_median']:>7.0f} {p['us_p90']:>7.0f} | "
              f"{pn['us_median']:>13.0f} | {b['bytes_rank0']:>7}/{b['bytes_rank1']:<7} {b['us_median']:>7.0f} {b['us_p90']:>7.0f} | "
              f"{per_outcome:>9.1f} {per_arrival:>9.1f} | {ratio:>7.3f} {ratio_notes:>7.3f}")
        if n == 64:
            verdicts[f"TP{r['world']} at 64 events: binary <= 0.3x pickle (no notes)"] = ratio <= 0.3
            verdicts[f"TP{r['world']} at 64 events: binary <= 0.3x pickle with checksum notes (the old default)"] = ratio_notes <= 0.3
        if n:
            verdicts.setdefault("<= 32 bytes per outcome event", True)
            verdicts["<= 32 bytes per outcome event"] &= per_outcome <= 32
    print(f"fixed header per rank: {header} bytes; an arrival carries its request once (id, peer, handle)")
    for name, ok in verdicts.items():
        print(f"  {'MET   ' if ok else 'MISSED'} {name}")
    return {"header_bytes": header, "rows": rows, "verdicts": verdicts}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(int(argv[1]), int(argv[2]), argv[3], int(argv[4]), argv[5])
        return 0
    p = argparse.ArgumentParser(prog="python -m examples.bench tp-exchange", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="measured steps per configuration")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--json", default="results/bench_tp_exchange.json")
    a = p.parse_args(argv)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvo-tpx-") as tmp:
        for world in (int(w) for w in a.worlds.split(",")):
            rows += run(world, a.steps, Path(tmp))
    res = report(rows)
    res["load_avg"] = os.getloadavg()
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
