"""Transport micro-benchmark between two processes: ``python -m examples.bench_transport``.

For 1, 8 and 64 MiB it times, request to last byte:

- ``memcpy``: one-thread ``torch`` ``copy_`` in this process (the ceiling of any copy);
- ``sockets``: plain TCP over loopback, the client ``recv_into`` a preallocated buffer;
- ``ucx-raw``: bare ucxx, a small request then ``ep.send``/``ep.recv`` of the payload;
- ``ucx-pull``: ``UCXTransport.pull`` from a ``UCXKVServer`` (handshake done beforehand; includes
  the CTX-side gather of the blocks into wire form, as in production);
- ``gather``: that CTX-side ``KVStore.gather`` alone (one torch thread), for reference;

the UCX ones under each UCX configuration (``tcp``: UCX over TCP only; ``shm``: the one-host
defaults, shared memory and cma zero-copy). After the transfers each UCX client keeps its endpoint
open and idles; the CPU both processes burn meanwhile is reported (a spinning progress thread would
steal a core and the GIL from a GEN node's decode thread).

Every server and client is a fresh process, because UCX reads its environment once per process.
Prints a table (GB/s, ratio to sockets); ``--json PATH`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from transports.ucx import UCX_DEFAULTS

MiB = 1 << 20
SIZES_MIB = (1, 8, 64)
ROOT = Path(__file__).resolve().parent.parent

# Complete UCX environments, so that a user's UCX_* variables do not leak into a comparison.
_COMMON = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TCP_CM_REUSEADDR": "y"}
_OURS = {k: v for k, v in UCX_DEFAULTS.items() if k not in _COMMON}  # what the transport applies
_UCXX_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "0",
    "UCX_RNDV_SCHEME": "auto",
    "UCX_MM_ERROR_HANDLING": "n",
    "UCX_CMA_MEMORY_INVALIDATE": "n",
    "UCX_CMA_SEG_SIZE": "512K",
}
CONFIGS: dict[str, dict[str, str]] = {
    "tcp": {**_COMMON, **_OURS, "UCX_TLS": "tcp"},
    "shm": {**_COMMON, **_OURS},
}
VARIANTS: dict[str, dict[str, str]] = {  # --variants: what the defaults were chosen against
    "ucxx-default": {**_COMMON, **_UCXX_DEFAULTS},
    "tcp-blocking": {**CONFIGS["tcp"], "UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "shm-blocking": {**CONFIGS["shm"], "UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "shm-thread-nofuture": {**CONFIGS["shm"], "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "tcp-rndv-auto": {**CONFIGS["tcp"], "UCX_RNDV_SCHEME": "auto"},
    "no-mm-error-handling": {**CONFIGS["shm"], "UCX_MM_ERROR_HANDLING": "n", "UCX_CMA_MEMORY_INVALIDATE": "n",
                             "UCX_CMA_SEG_SIZE": "512K"},
    "shm-cma-seg-512k": {**CONFIGS["shm"], "UCX_CMA_SEG_SIZE": "512K"},
    "shm-no-delayed-submission": {**CONFIGS["shm"], "UCXPY_ENABLE_DELAYED_SUBMISSION": "0"},
}


def _env(ucx: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env.update(ucx or {})
    env["KVO_SHARED_SECRET"] = "bench-secret-0123456789abcdef"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _reps(nbytes: int, budget_s: float) -> int:
    return max(3, min(30, int(budget_s * 1.5e9 / nbytes)))


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"gbps": nbytes / med / 1e9, "median_ms": med * 1e3, "best_gbps": nbytes / min(times) / 1e9, "reps": len(times)}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- workers (each in its own process) ------------------------------------------------------------


def _sock_server() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    conn, _ = srv.accept()
    payload = memoryview(bytearray(max(SIZES_MIB) * MiB))
    head = bytearray(8)
    while True:
        view, got = memoryview(head), 0
        while got < 8:
            n = conn.recv_into(view[got:])
            if not n:
                return
            got += n
        (size,) = struct.unpack("!Q", head)
        conn.sendall(payload[:size])


def _sock_client(port: int, budget_s: float) -> dict[str, Any]:
    conn = socket.create_connection(("127.0.0.1", port))
    out: dict[str, Any] = {}
    for mib in SIZES_MIB:
        size = mib * MiB
        buf = memoryview(bytearray(size))
        times = []
        for i in range(_reps(size, budget_s) + 1):
            t0 = time.perf_counter()
            conn.sendall(struct.pack("!Q", size))
            got = 0
            while got < size:
                got += conn.recv_into(buf[got:])
            if i:
                times.append(time.perf_counter() - t0)
        out[str(mib)] = _summary(times, size)
    return out


async def _raw_server() -> None:
    import anyio
    import numpy as np
    import ucxx

    payload = np.ones(max(SIZES_MIB) * MiB, dtype=np.uint8)

    async def serve(ep: Any) -> None:
        head = np.empty(1, dtype=np.uint64)
        try:
            while True:
                await ep.recv(head, tag=0)
                await ep.send(payload[: int(head[0])], tag=1)
        except Exception:
            return

    listener = ucxx.create_listener(serve)
    print(json.dumps({"port": listener.port}), flush=True)
    await anyio.sleep_forever()


async def _raw_client(port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    import numpy as np
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    out: dict[str, Any] = {}
    for mib in SIZES_MIB:
        size = mib * MiB
        buf = np.empty(size, dtype=np.uint8)
        head = np.array([size], dtype=np.uint64)
        times = []
        for i in range(_reps(size, budget_s) + 1):
            t0 = time.perf_counter()
            await ep.send(head, tag=0)
            await ep.recv(buf, tag=1)
            if i:
                times.append(time.perf_counter() - t0)
        out[str(mib)] = _summary(times, size)
    out["idle_cpu_pct"] = await _idle(idle_s)
    ep.abort()
    return out


async def _idle(idle_s: float) -> float:
    import anyio

    print(json.dumps({"phase": "idle"}), flush=True)
    c0, t0 = _cpu_s(), time.perf_counter()
    await anyio.sleep(idle_s)
    return 100 * (_cpu_s() - c0) / (time.perf_counter() - t0)


def _bench_layout() -> Any:
    import torch

    from transports import KVLayout

    return KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=32, dtype=torch.float16)  # 1 MiB blocks


async def _pull_server() -> None:
    import anyio
    import structlog
    import torch

    from transports import KVStore
    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXKVServer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    # torch's 2-thread index_select is pathological on a 2-core VM (450 ms vs 28 ms for 64 MiB);
    # one intra-op thread keeps the CTX gather from dominating what this measures.
    torch.set_num_threads(1)
    layout = _bench_layout()
    store = KVStore(layout, layout.new_pool(max(SIZES_MIB)).uniform_())

    def hold(rid: str, blocks: int) -> None:  # re-held on every release, so it can be pulled again
        store.put(rid, torch.arange(blocks), num_tokens=blocks * layout.block_size, lease_s=3600,
                  on_release=lambda: hold(rid, blocks), handle=_BENCH_HANDLE)

    for mib in SIZES_MIB:
        hold(f"r{mib}", mib)
    async with UCXKVServer(store, UCXConfig(secret=load_secret())) as server:
        print(json.dumps({"port": server.port}), flush=True)
        await anyio.sleep_forever()


_BENCH_HANDLE = "b" * 32  # the one KV handle the benchmark's CTX issues (it re-holds each request after a pull)


async def _pull_client(port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    import structlog
    import torch

    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXTransport

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    layout = _bench_layout()
    peer = f"127.0.0.1:{port}"
    out: dict[str, Any] = {}
    async with UCXTransport(UCXConfig(secret=load_secret())) as t:
        await t.connect(peer)
        for mib in SIZES_MIB:
            into = torch.empty(layout.wire_shape(mib), dtype=layout.dtype)
            times = []
            for i in range(_reps(into.nbytes, budget_s) + 1):
                t0 = time.perf_counter()
                await t.pull(peer, f"r{mib}", layout.full_slice(), into, handle=_BENCH_HANDLE)
                if i:
                    times.append(time.perf_counter() - t0)
            out[str(mib)] = _summary(times, into.nbytes)
        out["idle_cpu_pct"] = await _idle(idle_s)
    return out


def _worker(argv: list[str]) -> int:
    role, kind = argv[0], argv[1]
    if role == "server":
        if kind == "sockets":
            _sock_server()
        else:
            import anyio

            anyio.run(_raw_server if kind == "ucx-raw" else _pull_server, backend="asyncio")
        return 0
    port, budget_s, idle_s = int(argv[2]), float(argv[3]), float(argv[4])
    if kind == "sockets":
        result = _sock_client(port, budget_s)
    else:
        import anyio

        fn = _raw_client if kind == "ucx-raw" else _pull_client
        result = anyio.run(fn, port, budget_s, idle_s, backend="asyncio")
    print(json.dumps({"result": result}), flush=True)
    return 0


# -- driver ---------------------------------------------------------------------------------------


def _json_lines(proc: subprocess.Popen[str]):
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)
    raise RuntimeError(f"worker exited with {proc.wait()}")


def _pair(kind: str, ucx: dict[str, str] | None, budget_s: float, idle_s: float) -> dict[str, Any]:
    env = _env(ucx)
    cmd = [sys.executable, "-m", "examples.bench_transport", "_worker"]
    server = subprocess.Popen([*cmd, "server", kind], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        port = next(_json_lines(server))["port"]
        client = subprocess.Popen([*cmd, "client", kind, str(port), str(budget_s), str(idle_s)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, text=True)
        server_idle = None
        for msg in _json_lines(client):
            if msg.get("phase") == "idle":
                c0, t0 = _proc_cpu_s(server.pid), time.perf_counter()
                time.sleep(max(0.5, idle_s - 0.3))
                server_idle = 100 * (_proc_cpu_s(server.pid) - c0) / (time.perf_counter() - t0)
            elif "result" in msg:
                result = msg["result"]
                if server_idle is not None:
                    result["server_idle_cpu_pct"] = server_idle
                return result
        raise RuntimeError("client gave no result")
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait(10)
                if p.stdout:
                    p.stdout.close()


def _memcpy(budget_s: float) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for mib in SIZES_MIB:
            src = torch.ones(mib * MiB, dtype=torch.uint8)
            dst = torch.empty_like(src)
            times = []
            for i in range(_reps(src.nbytes, budget_s) * 3 + 1):
                t0 = time.perf_counter()
                dst.copy_(src)
                if i:
                    times.append(time.perf_counter() - t0)
            out[str(mib)] = _summary(times, src.nbytes)
        return out
    finally:
        torch.set_num_threads(threads)


def _gather(budget_s: float) -> dict[str, Any]:
    """The CTX-side ``KVStore.gather`` of a request into wire form, which every pull includes."""
    import torch

    from transports import KVStore

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layout = _bench_layout()
        store = KVStore(layout, layout.new_pool(max(SIZES_MIB)).uniform_())
        out = {}
        for mib in SIZES_MIB:
            store.put(f"g{mib}", torch.arange(mib), num_tokens=1, lease_s=3600)
            times = []
            for i in range(_reps(mib * MiB, budget_s) + 1):
                t0 = time.perf_counter()
                store.gather(f"g{mib}", layout.full_slice())
                if i:
                    times.append(time.perf_counter() - t0)
            out[str(mib)] = _summary(times, mib * MiB)
        return out
    finally:
        torch.set_num_threads(threads)


def _table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("sockets", {})
    head = "".join(f"{f'{m} MiB GB/s (x sock)':>24}" for m in SIZES_MIB)
    lines = [f"{'mode':<28}{head}{'idle CPU % cli/srv':>22}"]
    for name, res in results.items():
        cells = ""
        for m in SIZES_MIB:
            g = res[str(m)]["gbps"]
            ratio = g / base[str(m)]["gbps"] if base else float("nan")
            cells += f"{f'{g:6.2f} ({ratio:4.2f}x)':>24}"
        idle = ""
        if "idle_cpu_pct" in res:
            idle = f"{res['idle_cpu_pct']:5.1f} / {res.get('server_idle_cpu_pct', float('nan')):5.1f}"
        lines.append(f"{name:<28}{cells}{idle:>22}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(prog="bench transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the raw results here")
    p.add_argument("--budget", type=float, default=0.4, help="seconds of transfers per size and mode (approx.)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU measurement per UCX client")
    p.add_argument("--configs", default="tcp,shm", help=f"UCX configs, of {sorted(CONFIGS) + sorted(VARIANTS)}")
    p.add_argument("--modes", default="sockets,ucx-raw,ucx-pull,memcpy,gather")
    p.add_argument("--variants", action="store_true", help="also run the configs the defaults were chosen against")
    args = p.parse_args(argv)
    configs = {**CONFIGS, **VARIANTS}
    names = args.configs.split(",") + (sorted(VARIANTS) if args.variants else [])
    modes = args.modes.split(",")
    results: dict[str, dict[str, Any]] = {}
    if "sockets" in modes:
        results["sockets"] = _pair("sockets", None, args.budget, args.idle)
    for kind in ("ucx-raw", "ucx-pull"):
        if kind in modes:
            for cfg in names:
                results[f"{kind} [{cfg}]"] = _pair(kind, configs[cfg], args.budget, args.idle)
                print(f"done: {kind} [{cfg}]", file=sys.stderr, flush=True)
    if "memcpy" in modes:
        results["memcpy (1 thread)"] = _memcpy(args.budget)
    if "gather" in modes:
        results["ctx gather (1 thread)"] = _gather(args.budget)
    print(_table(results))
    if args.json:
        meta = {"cpus": os.cpu_count(), "configs": {n: configs[n] for n in names}, "sizes_mib": SIZES_MIB}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
