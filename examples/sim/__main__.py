"""``python -m examples.sim``: the public case's table, the sweep, the pipelined what-if, the check.

    python -m examples.sim [--preset public-case|tiny] [--modes ideal,inline,orchestrated] [--set k=v ...]
    python -m examples.sim --sweep      [--json results/sim_sweep.json --png results/sim_sweep.png]
    python -m examples.sim --pipelined  (the layer-wise pipelined transfer what-if, beside the baseline)
    python -m examples.sim --check      (this machine's measurements -> replay vs the real benchmark)

Every parameter is printed with its value and source before the results (``docs/sim.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from . import quiet_logs
from ._model import PRESETS, SEED, SOURCES, SimParams, sources_of
from ._parallel import run_all
from ._replay import ModeResult, check_requests, check_transfers

MODES = ("ideal", "inline", "orchestrated")


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _parse_value(key: str, value: str, current: Any) -> Any:
    """``value`` as the type ``key`` takes; ``ValueError`` saying what it takes."""
    if isinstance(current, bool):
        if value.lower() not in _BOOLS:
            raise ValueError("true or false (1/0, yes/no, on/off)")
        return _BOOLS[value.lower()]
    if isinstance(current, tuple):
        try:
            return tuple(int(v) for v in value.split(",") if v)
        except ValueError:
            raise ValueError("a comma-separated list of integers (empty: none)") from None
    kind = _OPTIONAL.get(key) or type(current)
    if key in _OPTIONAL and value.lower() == "none":
        return None
    try:
        return kind(value)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ValueError(what + (" or none" if key in _OPTIONAL else "")) from None


def _parse_set(params: SimParams, items: list[str]) -> SimParams:
    """``params`` with the ``--set name=value`` items applied; ``ValueError`` naming a malformed one."""
    fields = {f.name: f for f in dataclasses.fields(SimParams)}
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"--set {item!r}: expected name=value with a name of {sorted(fields)}")
        try:
            changes[key] = _parse_value(key, value, getattr(params, key))
        except ValueError as exc:
            raise ValueError(f"--set {item!r}: {key} takes {exc}") from None
    return dataclasses.replace(params, **changes)


_OPTIONAL = {"max_prefetch_seqs": int, "kv_pool_requests": int, "ctx_nic_gbyte_s": float}
"""Parameters whose default is None, with the type of any other value."""


def print_params(p: SimParams, out: Any = None, sources: dict[str, str] | None = None) -> None:
    """Each parameter with its value and source (``sources``: ``sources_of``; default: ``SOURCES``)
    to ``out`` (default: ``sys.stdout`` as it is at the call)."""
    out = sys.stdout if out is None else out
    sources = SOURCES if sources is None else sources
    print("parameters (value; source):", file=out)
    for f in dataclasses.fields(SimParams):
        v = getattr(p, f.name)
        src = sources.get(f.name, "")
        print(f"  {f.name:26s} {v!s:>12s}  {src}", file=out)
    for k, v in p.describe()["derived"].items():  # type: ignore[union-attr]
        print(f"  {k:26s} {v!s:>12s}  (derived)", file=out)


def run_modes(p: SimParams, modes: tuple[str, ...], *, progress: bool = True, jobs: int | None = 1) -> dict[str, ModeResult]:
    """Each mode of ``p`` replayed (``jobs`` at a time, see ``_parallel``; None: one per CPU)."""
    t0 = time.perf_counter()

    def done(i: int, r: ModeResult) -> None:
        if progress:
            print(f"  {modes[i]}: {r.wall_s:.1f} s real for {r.virtual_s:.1f} s virtual, {r.engine_steps} engine steps "
                  f"({time.perf_counter() - t0:.0f} s since start)", file=sys.stderr)

    results = run_all([(p, m) for m in modes], jobs=jobs, on_done=done, progress=progress)
    return dict(zip(modes, results))


def table(results: dict[str, ModeResult]) -> str:
    ideal = results.get("ideal")
    lines = ["| mode | output tok/s | vs ideal | mean TPOT ms | p99 TPOT ms | mean batch | exec blocked (sum s, max ms) "
             "| fallbacks | deferrals (backpressure) | KV wait ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in results.items():
        ratio = f"{r.output_tok_s / ideal.output_tok_s:.3f}" if ideal and ideal.output_tok_s else "-"
        lines.append(f"| {m} | {r.output_tok_s:,.0f} | {ratio} | {r.tpot_ms_mean:.3f} | {r.tpot_ms_p99:.3f} | "
                     f"{r.mean_batch:.1f} | {r.exec_blocked_ms['sum_s']:.2f}, {r.exec_blocked_ms['max']:.1f} | "
                     f"{r.inline_fallbacks} | {r.deferral_episodes.get('backpressure', 0)} | {r.kv_wait_ms_mean:.1f} | "
                     f"{r.failed} |")
    return "\n".join(lines)


def seed_table() -> str:
    """The seed's table: each build's V2 beside that build's own V1 (what its "vs V1" is relative to)."""
    s = SEED
    return "\n".join([
        "| public case (seed) | output tok/s | vs V1 of the same build | mean TPOT ms |",
        "|---|---|---|---|",
        f"| V1, original build (baseline) | {s['v1_output_tok_s']:,.2f} | - | {s['v1_tpot_ms']} |",
        f"| V2, original build (inline receive setup) | {s['orig_v2_output_tok_s']:,.2f} | {s['orig_v2_vs_v1']:+.2%} | {s['orig_v2_tpot_ms']} |",
        f"| V1, patched build | {s['patched_v1_output_tok_s']:,.2f} | - | {s['patched_v1_tpot_ms']} |",
        f"| V2, patched build (early budget) | {s['patched_v2_output_tok_s']:,.2f} | {s['patched_v2_vs_v1']:+.2%} | {s['patched_v2_tpot_ms']} |",
    ])


def _writable(text: str) -> str:
    """An output path this process can create or replace (``cli.writable_file``), as given."""
    from examples.two_node.cli import writable_file

    return str(writable_file(text))


def _write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)


def _refuse_ignored(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options a command would not use are refused, not silently dropped."""
    given = {"--preset": args.preset is not None, "--set": bool(args.set), "--modes": args.modes is not None,
             "--json": args.json is not None, "--png": args.png is not None, "--pipelined": args.pipelined,
             "--sweep": args.sweep}
    if args.check:  # configured from this machine's measurements, its own options after --check (--out, ...)
        unused = [k for k, v in given.items() if v]
        if unused:
            ap.error(f"--check takes none of {', '.join(unused)} (see python -m examples.sim --check --help)")
    elif args.sweep:  # its own grid of modes, and its own pipelined what-if
        unused = [k for k in ("--modes", "--pipelined") if given[k]]
        if unused:
            ap.error(f"--sweep takes none of {', '.join(unused)} (it runs every mode and its own pipelined what-if)")
        from ._sweep import SWEPT

        swept = sorted({item.partition("=")[0].replace("-", "_") for item in args.set} & set(SWEPT))
        if swept:
            ap.error(f"--sweep sets {', '.join(swept)} itself at every point (its grid: {', '.join(SWEPT)}); "
                     f"--set it for a table instead")
    elif args.png is not None:
        ap.error("--png is written by --sweep only")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: public-case")
    ap.add_argument("--modes", default=None, help=f"default: {','.join(MODES)}")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a parameter")
    ap.add_argument("--sweep", action="store_true", help="budget x link bandwidth x GEN TP -> JSON + PNG")
    ap.add_argument("--pipelined", action="store_true", help="the layer-wise pipelined transfer what-if")
    ap.add_argument("--check", action="store_true", help="replay vs the real quick benchmark on this machine")
    ap.add_argument("--jobs", type=int, default=None,
                    help="replays side by side on worker processes, one CPU each (default: one per CPU; 1: in order, here)")
    # checked now (a folder, an unwritable place), not after a replay of minutes
    ap.add_argument("--json", default=None, type=_writable)
    ap.add_argument("--png", default=None, type=_writable)
    given = sys.argv[1:] if argv is None else argv
    if "--check" in given and {"-h", "--help"} & set(given):  # the check's own options, not these
        from ._check import main as check_main

        return check_main(["--help"])
    args, rest = ap.parse_known_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    _refuse_ignored(ap, args)
    args.preset = args.preset or "public-case"
    args.modes = args.modes or ",".join(MODES)
    quiet_logs()
    try:
        params = _parse_set(PRESETS[args.preset](), args.set)
    except ValueError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        params.check()
        check_requests(params)
    except ValueError as exc:
        ap.error(f"--preset {args.preset} --set ...: {exc}")
    if args.check:
        from ._check import main as check_main

        return check_main(rest, jobs=args.jobs)
    if rest:
        ap.error(f"unknown arguments {rest}")
    if args.sweep:
        from ._sweep import sweep

        try:
            return sweep(params, json_path=args.json or "results/sim_sweep.json",
                         png_path=args.png or "results/sim_sweep.png", jobs=args.jobs)
        except ValueError as exc:  # a point the sweep's grid cannot run (checked before any runs)
            ap.error(f"--sweep: {exc}")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes {args.modes!r}: expected a comma-separated list of {', '.join(MODES)}")
    if len(set(modes)) < len(modes):  # each would be replayed again for one row of the table
        ap.error(f"--modes {args.modes!r}: {next(m for m in modes if modes.count(m) > 1)!r} given twice")
    if set(modes) - {"ideal"}:
        try:
            check_transfers(params)
        except ValueError as exc:
            ap.error(f"--preset {args.preset} --set ...: {exc}")
    sources = sources_of(params, args.preset, {item.partition("=")[0].replace("-", "_") for item in args.set})
    print_params(params, sources=sources)
    results = run_modes(params, modes, jobs=args.jobs)
    payload: dict[str, Any] = {"preset": args.preset, "params": params.describe(), "sources": sources,
                               "modes": {m: r.summary() for m, r in results.items()}, "seed": SEED}
    print()
    print(table(results))
    warning = params.coarse_step_warning(max(r.mean_batch for r in results.values()))
    if warning:
        print(warning)
        payload["warnings"] = [warning]
    if args.preset == "public-case":
        print()
        print(seed_table())
    if args.pipelined:
        piped = run_modes(dataclasses.replace(params, pipelined=True), tuple(m for m in modes if m != "ideal"),
                          jobs=args.jobs)
        print("\nlayer-wise pipelined transfer (GEN pulls layer i while CTX prefills layer i+1):")
        print(table({**({"ideal": results["ideal"]} if "ideal" in results else {}), **piped}))
        for m, r in piped.items():
            if m in results:
                print(f"  {m}: KV wait {results[m].kv_wait_ms_mean:.2f} -> {r.kv_wait_ms_mean:.2f} ms, "
                      f"CTX-token-to-first-GEN-token; throughput {results[m].output_tok_s:,.0f} -> {r.output_tok_s:,.0f}")
        payload["pipelined"] = {m: r.summary() for m, r in piped.items()}
    bad = [problem for r in results.values() for problem in r.problems()]
    if args.pipelined:
        bad += [f"pipelined {problem}" for r in piped.values() for problem in r.problems()]
    _write_json(args.json, payload)
    if bad:
        print("INVARIANTS BROKEN:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
