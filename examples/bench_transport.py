"""Transport micro-benchmark between two processes: ``python -m examples.bench transport``.

For 1, 8 and 64 MiB it times, request to last byte, in one run so that the paths compare side by
side on a noisy machine:

- ``sockets``: plain TCP, the client ``recv_into`` a preallocated buffer (the baseline of the ratios);
- ``ucx-raw``: bare ucxx, a small request then ``ep.send``/``ep.recv`` of the payload: the raw
  library path our UCX pull is built on;
- ``ucx-pull``: ``UCXTransport.pull`` from a ``UCXKVServer`` (wire version 3: one message before the
  data, its length checked; handshake done beforehand; includes the CTX-side checkout of the blocks,
  as in production);
- ``ucx-pull-v1``: the same from the tree of commit ``V1_COMMIT`` (wire version 1: PULL, PULL_OK,
  READY, then the data), extracted with ``git archive``; the baseline of the CPU-per-pull target;
- ``nixl-read``: raw NIXL: both processes register a tensor, the client learns the server's agent
  metadata and address over TCP once, then each transfer is ``initialize_xfer("READ")``,
  ``transfer`` and a poll of ``check_xfer_state`` until DONE (the raw path of a NIXL backend);
- ``nixl-pull``: ``NIXLTransport.pull`` from a ``NIXLKVServer`` with the CTX's block ids and epoch
  given (as a prefill reply names them): one READ posted at once, no pin (the CTX's revocations keep
  the blocks), its notification; the GEN's memory registered once; the lookup alone timed too
  (``lookup_us``);
- ``nixl-pull-pinned``: the same with the block ids only: the READ's pin travels beside it on the
  control connection and the pull waits for its answer (the path before unpinned READs);
- ``nixl-pull-lookup``: the same without the block ids: a lookup round trip, then the READ;
- ``memcpy`` and ``gather`` (the CTX-side ``KVStore.gather``), one torch thread, for reference;

the two-process ones under each network configuration: ``shm`` (our UCX defaults, one host: shared
memory and cma), ``tcp`` (``UCX_TLS=tcp,self`` over loopback), ``netns`` (``UCX_TLS=tcp,self``
between two network namespaces joined by a veth pair; root only, the sockets baseline runs there
too). Every server and client is a fresh process, because UCX reads its environment once per
process.

Every mode runs ``--rounds`` times (3), the modes interleaved, and each figure is the median over
the rounds (load on a shared machine moves between runs). Per size it reports GB/s (median), and the client's CPU (all its threads, from ``getrusage``)
divided by the number of transfers: the CPU a GEN spends per pull. After the transfers each client
keeps its connection open and idles; the CPU both processes burn meanwhile is the idle CPU of a
node. ``--json PATH`` writes the raw numbers and the checks against the targets of issue 17 (each
printed with its verdict).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from examples import _proc
from transports.ucx import UCX_DEFAULTS

MiB = 1 << 20
SIZES_MIB = (1, 8, 64)
ROOT = Path(__file__).resolve().parent.parent
V1_COMMIT = "1cf2ff9"  # the last tree with the three-hop pull (wire version 1)

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
_TCP = {"UCX_TLS": "tcp,self"}
CONFIGS: dict[str, dict[str, str]] = {
    "shm": {**_COMMON, **_OURS},
    "tcp": {**_COMMON, **_OURS, **_TCP},
    "netns": {**_COMMON, **_OURS, **_TCP},  # run across two namespaces (root)
}
VARIANTS: dict[str, dict[str, str]] = {  # --variants: what the UCX defaults were chosen against
    "ucxx-default": {**_COMMON, **_UCXX_DEFAULTS},
    "tcp-blocking": {**CONFIGS["tcp"], "UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "shm-blocking": {**CONFIGS["shm"], "UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "shm-thread-nofuture": {**CONFIGS["shm"], "UCXPY_ENABLE_PYTHON_FUTURE": "0"},
    "tcp-rndv-auto": {**CONFIGS["tcp"], "UCX_RNDV_SCHEME": "auto"},
    "no-mm-error-handling": {**CONFIGS["shm"], "UCX_MM_ERROR_HANDLING": "n", "UCX_CMA_MEMORY_INVALIDATE": "n",
                             "UCX_CMA_SEG_SIZE": "512K"},
    "shm-cma-seg-512k": {**CONFIGS["shm"], "UCX_CMA_SEG_SIZE": "512K"},
}
# NIXL settings, read by the nixl workers (KVO_NIXL_*; the UCX_* ones reach NIXL's own bundled UCX):
#   KVO_NIXL_PTHREAD   1: the UCX backend's progress thread (nixl_agent_config.enable_prog_thread)
#   KVO_NIXL_DELAY_US  its poll() timeout; the Python API hard-codes 0, which makes the thread spin
#   KVO_NIXL_POLL      how the initiator waits for DONE: spin | sleep (0.1 ms naps)
#   KVO_NIXL_OP        READ (the client reads the server's tensor) | WRITE (it writes into it)
NIXL_DEFAULTS = {"KVO_NIXL_PTHREAD": "1", "KVO_NIXL_DELAY_US": "1000", "KVO_NIXL_POLL": "spin"}
NIXL_VARIANTS: dict[str, dict[str, str]] = {  # --nixl-variants: the knobs probed for READ over TCP
    "shm-pthr-spin": {**CONFIGS["shm"], "KVO_NIXL_DELAY_US": "0"},  # what nixl_agent() gives
    "tcp-pthr-spin": {**CONFIGS["tcp"], "KVO_NIXL_DELAY_US": "0"},
    "tcp-no-pthr": {**CONFIGS["tcp"], "KVO_NIXL_PTHREAD": "0"},
    "tcp-poll-sleep": {**CONFIGS["tcp"], "KVO_NIXL_POLL": "sleep"},
    "tcp-seg-64k": {**CONFIGS["tcp"], "UCX_TCP_SEG_SIZE": "64k"},
    "tcp-rndv-auto": {**CONFIGS["tcp"], "UCX_RNDV_SCHEME": "auto"},
    "tcp-write": {**CONFIGS["tcp"], "KVO_NIXL_OP": "WRITE"},  # the client WRITEs into the server instead
    "shm-write": {**CONFIGS["shm"], "KVO_NIXL_OP": "WRITE"},
}
PAIR_MODES = ("sockets", "ucx-raw", "ucx-pull", "ucx-pull-v1", "nixl-read", "nixl-pull", "nixl-pull-pinned",
              "nixl-pull-lookup")


def _env(ucx: dict[str, str] | None, extra_path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_", "KVO_NIXL_"))}
    env.update(NIXL_DEFAULTS)
    env.update(ucx or {})
    env["KVO_SHARED_SECRET"] = "bench-secret-0123456789abcdef"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


def _reps(nbytes: int, budget_s: float) -> int:
    return max(3, min(400, int(budget_s * 1.5e9 / nbytes)))


def _combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one result: the median of every figure (per size, and the idle CPU);
    the rounds themselves are kept under ``rounds``."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = {}
    for key, first in rounds[0].items():
        if isinstance(first, dict):
            out[key] = {k: statistics.median(r[key][k] for r in rounds) for k in first}
        elif isinstance(first, (int, float)):
            out[key] = statistics.median(r[key] for r in rounds if key in r)
    out["rounds"] = rounds
    return out


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _summary(times: list[float], nbytes: int, cpu_s: float | None = None) -> dict[str, float]:
    med = statistics.median(times)
    out = {"gbps": nbytes / med / 1e9, "median_ms": med * 1e3, "best_gbps": nbytes / min(times) / 1e9,
           "reps": len(times)}
    if cpu_s is not None:
        out["cpu_us_per_op"] = cpu_s / len(times) * 1e6
    return out


def _thread_cpu_ns() -> dict[int, int]:
    """CPU nanoseconds of each thread of this process (``/proc/self/task/*/schedstat``), by thread id."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


class _Timer:
    """Times ``reps`` transfers after one warm-up, with this process's CPU over the timed ones
    (``cpu_us_per_op``) and its split: the main (event-loop) thread against all other threads
    (UCX/NIXL progress, notifier, workers)."""

    def __init__(self, nbytes: int, budget_s: float) -> None:
        self.nbytes, self.n = nbytes, _reps(nbytes, budget_s)
        self.times: list[float] = []
        self.cpu0 = 0.0
        self.threads0: dict[int, int] = {}

    def __iter__(self):
        for i in range(self.n + 1):
            if i == 1:
                self.cpu0, self.threads0 = _cpu_s(), _thread_cpu_ns()
            t0 = time.perf_counter()
            yield i
            if i:
                self.times.append(time.perf_counter() - t0)

    def result(self) -> dict[str, float]:
        out = _summary(self.times, self.nbytes, _cpu_s() - self.cpu0)
        now, main = _thread_cpu_ns(), os.getpid()
        used = {tid: ns - self.threads0.get(tid, 0) for tid, ns in now.items()}
        n = len(self.times)
        out["cpu_us_per_op_main_thread"] = used.get(main, 0) / n / 1e3
        out["cpu_us_per_op_other_threads"] = sum(v for t, v in used.items() if t != main) / n / 1e3
        return out


# -- workers (each in its own process) ------------------------------------------------------------


def _sock_server() -> None:
    srv = socket.create_server(("0.0.0.0", 0))
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


def _sock_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    conn = socket.create_connection((host, port))
    out: dict[str, Any] = {}
    for mib in SIZES_MIB:
        size = mib * MiB
        buf = memoryview(bytearray(size))
        timer = _Timer(size, budget_s)
        for _ in timer:
            conn.sendall(struct.pack("!Q", size))
            got = 0
            while got < size:
                got += conn.recv_into(buf[got:])
        out[str(mib)] = timer.result()
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


async def _raw_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    import numpy as np
    import ucxx

    ep = await ucxx.create_endpoint(host, port)
    out: dict[str, Any] = {}
    for mib in SIZES_MIB:
        size = mib * MiB
        buf = np.empty(size, dtype=np.uint8)
        head = np.array([size], dtype=np.uint64)
        timer = _Timer(size, budget_s)
        for _ in timer:
            await ep.send(head, tag=0)
            await ep.recv(buf, tag=1)
        out[str(mib)] = timer.result()
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


_BENCH_HANDLE = "b" * 32  # the one KV handle the benchmark's CTX issues (it re-holds each request after a pull)


def _takes(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


async def _pull_server() -> None:
    import anyio
    import structlog
    import torch

    from transports import KVStore
    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXKVServer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    # torch's 2-thread index_select is pathological on a 2-core VM (450 ms vs 28 ms for 64 MiB);
    # one intra-op thread keeps a CTX gather from dominating what this measures.
    torch.set_num_threads(1)
    layout = _bench_layout()
    store = KVStore(layout, layout.new_pool(max(SIZES_MIB)).uniform_())
    extra = {"handle": _BENCH_HANDLE} if _takes(store.put, "handle") else {}  # the v1 tree had no handles

    def hold(rid: str, blocks: int) -> None:  # re-held on every release, so it can be pulled again
        store.put(rid, torch.arange(blocks), num_tokens=blocks * layout.block_size, lease_s=3600,
                  on_release=lambda: hold(rid, blocks), **extra)

    for mib in SIZES_MIB:
        hold(f"r{mib}", mib)
    async with UCXKVServer(store, UCXConfig(secret=load_secret())) as server:
        print(json.dumps({"port": server.port}), flush=True)
        await anyio.sleep_forever()


async def _pull_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    import structlog

    from transports._auth import load_secret
    from transports.ucx import UCXConfig, UCXTransport

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    layout = _bench_layout()
    peer = f"{host}:{port}"
    out: dict[str, Any] = {}
    async with UCXTransport(UCXConfig(secret=load_secret())) as t:
        # keep: the CTX holds the entry (a GEN's pull ends when the KV lands, a moment before the CTX
        # sees its send end and could re-hold a released entry for the next pull)
        extra = {"handle": _BENCH_HANDLE, "release": False} if _takes(t.pull, "handle") else {}
        await t.connect(peer)
        arena = layout.new_pool(max(SIZES_MIB))  # a GEN pool: a full-slice pull lands in its blocks
        for mib in SIZES_MIB:
            into = arena[:mib]
            timer = _Timer(into.nbytes, budget_s)
            for _ in timer:
                await t.pull(peer, f"r{mib}", layout.full_slice(), into, **extra)
            out[str(mib)] = timer.result()
        out["idle_cpu_pct"] = await _idle(idle_s)
    return out


# -- raw NIXL -------------------------------------------------------------------------------------


def nixl_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, set from ``KVO_NIXL_PTHREAD`` / ``KVO_NIXL_DELAY_US``.

    ``nixl_agent`` (the Python API) hard-codes the progress thread's ``pthrDelay`` to 0; the thread
    passes it to ``poll()`` as its timeout, so it never sleeps. Setting it needs the binding's config,
    which this does by wrapping the binding's constructor for the one call."""
    from nixl_cu12 import _api

    pthread = os.environ.get("KVO_NIXL_PTHREAD", "1") == "1"
    delay_us = int(os.environ.get("KVO_NIXL_DELAY_US", "0"))
    real = _api.nixlBind.nixlAgent

    def make(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay_us
        return real(agent_name, cfg)

    _api.nixlBind.nixlAgent = make
    try:
        return _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=pthread, backends=["UCX"]))
    finally:
        _api.nixlBind.nixlAgent = real


def _send_blob(conn: socket.socket, blob: bytes) -> None:
    conn.sendall(struct.pack("!Q", len(blob)) + blob)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _recv_blob(conn: socket.socket) -> bytes:
    (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
    return _recv_exact(conn, n)


def _nixl_server() -> None:
    from transports._layout import host_memory

    agent = nixl_agent("ctx")
    pool = host_memory(max(SIZES_MIB) * MiB).fill_(1)  # huge pages, as our pools (and numpy's arrays)
    agent.register_memory(pool)
    srv = socket.create_server(("0.0.0.0", 0))
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    conn, _ = srv.accept()
    _send_blob(conn, json.dumps({"addr": pool.data_ptr(), "nbytes": pool.nbytes}).encode())
    _send_blob(conn, agent.get_agent_metadata())
    agent.add_remote_agent(_recv_blob(conn))  # the client's metadata (a CTX would learn its GEN's)
    conn.recv(1)  # blocks (no CPU) until the client goes


def _nixl_wait(agent: Any, handle: Any, poll: str) -> None:
    nap = 1e-4 if poll == "sleep" else 0.0
    deadline = time.monotonic() + 20
    while (state := agent.check_xfer_state(handle)) == "PROC":
        if nap:
            time.sleep(nap)
        if time.monotonic() > deadline:
            raise RuntimeError("NIXL READ not done within 20 s")
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended {state}")


def _nixl_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    from transports._layout import host_memory

    poll = os.environ.get("KVO_NIXL_POLL", "spin")
    op = os.environ.get("KVO_NIXL_OP", "READ")
    agent = nixl_agent("gen")
    dst = host_memory(max(SIZES_MIB) * MiB)
    agent.register_memory(dst)
    conn = socket.create_connection((host, port))
    info = json.loads(_recv_blob(conn))
    peer = agent.add_remote_agent(_recv_blob(conn))
    _send_blob(conn, agent.get_agent_metadata())
    out: dict[str, Any] = {}
    for mib in SIZES_MIB:
        size = mib * MiB
        timer = _Timer(size, budget_s)
        for i in timer:
            local = agent.get_xfer_descs([(dst.data_ptr(), size, 0)], "DRAM")
            remote = agent.get_xfer_descs([(info["addr"], size, 0)], "DRAM")
            handle = agent.initialize_xfer(op, local, remote, peer, f"done-{mib}-{i}".encode())
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer failed to post")
            _nixl_wait(agent, handle, poll)
            agent.release_xfer_handle(handle)
        out[str(mib)] = timer.result()
    if op == "READ":
        assert bool((dst == 1).all()), "NIXL READ moved the wrong bytes"
    print(json.dumps({"phase": "idle"}), flush=True)
    c0, t0 = _cpu_s(), time.perf_counter()
    time.sleep(idle_s)
    out["idle_cpu_pct"] = 100 * (_cpu_s() - c0) / (time.perf_counter() - t0)
    conn.close()
    return out


async def _nixl_pull_server() -> None:
    import anyio
    import structlog
    import torch

    from transports import KVStore
    from transports._auth import load_secret
    from transports.nixl import NIXLConfig, NIXLKVServer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    layout = _bench_layout()
    store = KVStore(layout, layout.new_pool(max(SIZES_MIB)).uniform_())
    for mib in SIZES_MIB:  # pulled with keep (release=False), so they stay
        store.put(f"r{mib}", torch.arange(mib), num_tokens=mib * layout.block_size, lease_s=3600,
                  handle=_named_handle(f"r{mib}"))
    async with NIXLKVServer(store, _nixl_config(NIXLConfig, load_secret())) as server:
        print(json.dumps({"port": server.port}), flush=True)
        await anyio.sleep_forever()


def _named_handle(request_id: str) -> str:
    """The NIXL benchmark's handle of ``request_id``: one that names it under the shared secret (as
    a NIXL CTX issues them; a GEN READs unpinned only with such a handle), the same in both processes."""
    from transports._auth import load_secret
    from transports._ids import handle_key, new_handle

    return new_handle(request_id, handle_key(load_secret()), nonce=b"kvobench")


def _nixl_config(cls: Any, secret: bytes | None) -> Any:
    return cls(secret=secret, progress_thread=os.environ.get("KVO_NIXL_PTHREAD", "1") == "1",
               progress_delay_us=int(os.environ.get("KVO_NIXL_DELAY_US", "1000")))


async def _nixl_pull_lookup_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    return await _nixl_pull_client(host, port, budget_s, idle_s, name_blocks=False, name_epoch=False)


async def _nixl_pull_pinned_client(host: str, port: int, budget_s: float, idle_s: float) -> dict[str, Any]:
    return await _nixl_pull_client(host, port, budget_s, idle_s, name_epoch=False)


async def _nixl_pull_client(host: str, port: int, budget_s: float, idle_s: float, *,
                            name_blocks: bool = True, name_epoch: bool = True) -> dict[str, Any]:
    import structlog

    from transports._auth import load_secret
    from transports.nixl import NIXLConfig, NIXLTransport

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    layout = _bench_layout()
    peer = f"{host}:{port}"
    out: dict[str, Any] = {}
    async with NIXLTransport(_nixl_config(NIXLConfig, load_secret()), layout=layout) as t:
        arena = layout.new_pool(max(SIZES_MIB))  # a GEN pool: a full-slice pull lands in its blocks
        t.register(arena)  # the GEN registers its memory once
        await t.connect(peer)
        epoch = (await t._conn(peer)).epoch  # the server put every entry before it revoked anything
        for mib in SIZES_MIB:
            into = arena[:mib]
            handle = _named_handle(f"r{mib}")  # from the prefill reply, as a GEN has it: not the pull's cost
            timer = _Timer(into.nbytes, budget_s)
            for _ in timer:
                await t.pull(peer, f"r{mib}", layout.full_slice(), into, handle=handle, release=False,
                             **({"remote_blocks": list(range(mib))} if name_blocks else {}),
                             **({"remote_epoch": epoch} if name_epoch else {}))
            out[str(mib)] = timer.result()
        conn = await t._conn(peer)  # the lookup alone: what the GEN pays to learn the block ids
        lookups = []
        for _ in range(20):
            t0 = time.perf_counter()
            answer = await conn.request({"t": "lookup", "rid": "r1", "handle": _named_handle("r1"), "slice": [0, 8, 0, 8],
                                         "dtype": "float16", "shape": list(layout.wire_shape(1)), "keep": True}, 5.0)
            lookups.append(time.perf_counter() - t0)
            conn.send({"t": "unpin", "token": answer["token"]})
        out["lookup_us"] = statistics.median(lookups) * 1e6
        out["adhoc_registrations"] = t.statistics().adhoc_registrations
        out["unpinned_reads"] = t.statistics().unpinned_reads
        out["idle_cpu_pct"] = await _idle(idle_s)
    return out


def _worker(argv: list[str]) -> int:
    role, kind = argv[0], argv[1]
    if role == "server":
        if kind == "sockets":
            _sock_server()
        elif kind == "nixl-read":
            _nixl_server()
        else:
            import anyio

            fn = {"ucx-raw": _raw_server, "nixl-pull": _nixl_pull_server, "nixl-pull-pinned": _nixl_pull_server,
                  "nixl-pull-lookup": _nixl_pull_server}.get(kind, _pull_server)
            anyio.run(fn, backend="asyncio")
        return 0
    host, port, budget_s, idle_s = argv[2], int(argv[3]), float(argv[4]), float(argv[5])
    if kind == "sockets":
        result = _sock_client(host, port, budget_s, idle_s)
    elif kind == "nixl-read":
        result = _nixl_client(host, port, budget_s, idle_s)
    else:
        import anyio

        fn = {"ucx-raw": _raw_client, "nixl-pull": _nixl_pull_client, "nixl-pull-pinned": _nixl_pull_pinned_client,
              "nixl-pull-lookup": _nixl_pull_lookup_client}.get(kind, _pull_client)
        result = anyio.run(fn, host, port, budget_s, idle_s, backend="asyncio")
    print(json.dumps({"result": result}), flush=True)
    return 0


# -- driver ---------------------------------------------------------------------------------------


def _json_lines(proc: subprocess.Popen[str]):
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)
    raise RuntimeError(f"worker exited with {proc.wait()}")


@contextlib.contextmanager
def _v1_tree():
    """The ``transports`` package of ``V1_COMMIT`` in a temporary directory (None without git history)."""
    with tempfile.TemporaryDirectory(prefix="kvo-v1-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", V1_COMMIT, "transports"], capture_output=True)
        if archive.returncode != 0:
            yield None
            return
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield tmp


class Net:
    """Where a pair runs: loopback, or server in namespace ``a`` and client in ``b``."""

    def __init__(self, ns: Any | None = None) -> None:
        self.ns = ns

    @property
    def host(self) -> str:
        return self.ns.addr_a if self.ns else "127.0.0.1"

    def wrap(self, cmd: list[str], side: str) -> list[str]:
        if not self.ns:
            return cmd
        return ["ip", "netns", "exec", self.ns.a if side == "server" else self.ns.b, *cmd]

    def env(self, env: dict[str, str], side: str) -> dict[str, str]:
        if self.ns and "UCX_TLS" in env:  # UCX in a namespace: name the veth that reaches the peer
            env = {**env, "UCX_NET_DEVICES": self.ns._veth_a if side == "server" else self.ns._veth_b}
        return env


def _pair(kind: str, ucx: dict[str, str] | None, budget_s: float, idle_s: float, *, net: Net | None = None,
          cwd: str | None = None) -> dict[str, Any]:
    net = net or Net()
    env = _env(ucx)
    cmd = [sys.executable, "-m", "examples.bench_transport", "_worker"]
    # cwd: python -m puts it first on sys.path, so ucx-pull-v1 runs with the old `transports`
    server = subprocess.Popen(net.wrap([*cmd, "server", kind], "server"), cwd=cwd or ROOT, env=net.env(env, "server"),
                              stdout=subprocess.PIPE, text=True)
    client = None
    try:
        port = next(_json_lines(server))["port"]
        client = subprocess.Popen(
            net.wrap([*cmd, "client", kind, net.host, str(port), str(budget_s), str(idle_s)], "client"),
            cwd=cwd or ROOT, env=net.env(env, "client"), stdout=subprocess.PIPE, text=True)
        server_idle = None
        for msg in _json_lines(client):
            if msg.get("phase") == "idle":
                c0, t0 = _proc.cpu_s(server.pid), time.perf_counter()
                time.sleep(max(0.5, idle_s - 0.3))
                server_idle = 100 * (_proc.cpu_s(server.pid) - c0) / (time.perf_counter() - t0)
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
            timer = _Timer(src.nbytes, budget_s * 3)
            for _ in timer:
                dst.copy_(src)
            out[str(mib)] = timer.result()
        return out
    finally:
        torch.set_num_threads(threads)


def _gather(budget_s: float) -> dict[str, Any]:
    """The CTX-side ``KVStore.gather`` of a request into wire form (a pull of scattered blocks)."""
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
            timer = _Timer(mib * MiB, budget_s)
            for _ in timer:
                store.gather(f"g{mib}", layout.full_slice())
            out[str(mib)] = timer.result()
        return out
    finally:
        torch.set_num_threads(threads)


def _sockets_for(name: str, results: dict[str, Any]) -> dict[str, Any] | None:
    return results.get("sockets [netns]" if name.endswith("[netns]") else "sockets")


def _raw_for(name: str, results: dict[str, Any]) -> dict[str, Any] | None:
    mode, _, cfg = name.partition(" ")
    raw = {"ucx-pull": "ucx-raw", "ucx-pull-v1": "ucx-raw", "nixl-pull": "nixl-read", "nixl-pull-pinned": "nixl-read",
           "nixl-pull-lookup": "nixl-read"}.get(mode)
    return results.get(f"{raw} {cfg}") if raw else None


def _table(results: dict[str, dict[str, Any]]) -> str:
    head = "".join(f"{f'{m} MiB GB/s (x sock, x raw) CPU':>38}" for m in SIZES_MIB)
    lines = [f"{'mode':<30}{head}{'idle CPU % cli/srv':>20}",
             f"{'':<30}" + "".join(f"{'CPU = client µs per transfer':>38}" for _ in SIZES_MIB)]
    for name, res in results.items():
        cells = ""
        for m in SIZES_MIB:
            r = res[str(m)]
            base, raw = _sockets_for(name, results), _raw_for(name, results)
            xs = f"{r['gbps'] / base[str(m)]['gbps']:4.2f}" if base and base is not res else "  - "
            xr = f"{r['gbps'] / raw[str(m)]['gbps']:4.2f}" if raw else "  - "
            cpu = f"{r['cpu_us_per_op']:6.0f}" if "cpu_us_per_op" in r else "     -"
            cell = f"{r['gbps']:6.2f} ({xs}, {xr}) {cpu}"
            cells += f"{cell:>38}"
        idle = ""
        if "idle_cpu_pct" in res:
            idle = f"{res['idle_cpu_pct']:5.1f} / {res.get('server_idle_cpu_pct', float('nan')):5.1f}"
        lines.append(f"{name:<30}{cells}{idle:>20}")
    return "\n".join(lines)


# Issue 17's targets: (mode, size MiB) -> least ratio to the raw library path of the same config
RAW_RATIO = {("nixl-pull", 1): 0.8, ("nixl-pull", 8): 0.8, ("ucx-pull", 1): 0.6, ("ucx-pull", 8): 0.8, ("ucx-pull", 64): 0.8}
NIXL_CPU_US = 250.0  # GEN CPU per 1 MiB NIXL pull
UCX_CPU_VS_V1 = 0.6  # GEN CPU per 1 MiB ucxx pull / the three-hop pull's


def targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 17's targets, each with the measured value (ratios from this one run)."""
    checks: list[dict[str, Any]] = []

    def check(what: str, value: float, op: str, bound: float) -> None:
        ok = value >= bound if op == ">=" else value <= bound
        checks.append({"target": what, "value": round(value, 3), "op": op, "bound": bound, "ok": ok})

    for name, res in results.items():
        mode, _, cfg = name.partition(" ")
        if mode not in ("ucx-pull", "nixl-pull"):
            continue
        raw = _raw_for(name, results)
        for m in SIZES_MIB:
            if raw and (mode, m) in RAW_RATIO:
                check(f"{name} / raw at {m} MiB", res[str(m)]["gbps"] / raw[str(m)]["gbps"], ">=", RAW_RATIO[mode, m])
        if mode == "nixl-pull" and "cpu_us_per_op" in res["1"]:
            check(f"{name} GEN CPU µs per 1 MiB pull", res["1"]["cpu_us_per_op"], "<=", NIXL_CPU_US)
        old = results.get(f"ucx-pull-v1 {cfg}")
        if mode == "ucx-pull" and old and "cpu_us_per_op" in res["1"]:
            check(f"{name} GEN CPU per 1 MiB pull / ucx-pull-v1's", res["1"]["cpu_us_per_op"] / old["1"]["cpu_us_per_op"],
                  "<=", UCX_CPU_VS_V1)
        for side, key in (("GEN", "idle_cpu_pct"), ("CTX", "server_idle_cpu_pct")):
            if key in res:
                check(f"{name} idle {side} CPU %", res[key], "<=", 5.0)
    return checks


def _nixl_available() -> str | None:
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as exc:  # ImportError, or a broken bundled library
        return f"nixl_cu12 cannot be imported: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(prog="bench transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the raw results here")
    p.add_argument("--budget", type=float, default=0.4, help="seconds of transfers per size and mode (approx.)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU measurement per client")
    p.add_argument("--configs", default="shm,tcp,netns",
                   help=f"network configs, of {sorted(CONFIGS) + sorted(VARIANTS) + sorted(NIXL_VARIANTS)} "
                        "(netns is skipped without root)")
    p.add_argument("--modes", default="sockets,ucx-raw,ucx-pull,ucx-pull-v1,nixl-read,nixl-pull,nixl-pull-pinned,memcpy,gather")
    p.add_argument("--variants", action="store_true", help="also run the UCX configs the defaults were chosen against")
    p.add_argument("--nixl-variants", action="store_true", help="also run nixl-read under the NIXL knobs probed")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every mode this many times, interleaved, and report medians (load moves between runs)")
    p.add_argument("--quick", action="store_true", help="tiny budget and idle time, one round (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.budget, args.idle, args.rounds = 0.02, 0.5, 1
    configs = {**CONFIGS, **VARIANTS, **NIXL_VARIANTS}
    names = [n for n in args.configs.split(",") if n] + (sorted(VARIANTS) if args.variants else [])
    modes = args.modes.split(",")
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        netns = None
        if "netns" in names:
            from examples.two_node.launch import Netns

            why = Netns.unavailable()
            if why:
                names.remove("netns")
                notes.append(f"netns skipped: {why}")
            else:
                netns = stack.enter_context(Netns())
        if (why := _nixl_available()):
            for kind in ("nixl-read", "nixl-pull", "nixl-pull-pinned", "nixl-pull-lookup"):
                if kind in modes:
                    modes.remove(kind)
                    notes.append(f"{kind} skipped: {why}")
        v1 = stack.enter_context(_v1_tree()) if "ucx-pull-v1" in modes else None
        if "ucx-pull-v1" in modes and v1 is None:
            modes.remove("ucx-pull-v1")
            notes.append(f"ucx-pull-v1 skipped: no git history with {V1_COMMIT}")
        per_round: dict[str, list[dict[str, Any]]] = {}

        def run(label: str, kind: str, cfg: dict[str, str] | None, **kw: Any) -> None:
            t0 = time.perf_counter()
            try:
                per_round.setdefault(label, []).append(_pair(kind, cfg, args.budget, args.idle, **kw))
            except Exception as exc:  # one broken path must not lose the others' figures
                notes.append(f"{label} failed: {exc}")
            print(f"done: {label} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            if "sockets" in modes:
                run("sockets", "sockets", None)
                if netns:
                    run("sockets [netns]", "sockets", None, net=Net(netns))
            for kind in PAIR_MODES[1:]:
                if kind not in modes:
                    continue
                for cfg in names + (sorted(NIXL_VARIANTS) if kind == "nixl-read" and args.nixl_variants else []):
                    if cfg in NIXL_VARIANTS and kind != "nixl-read":
                        continue
                    net = Net(netns) if cfg == "netns" else None
                    run(f"{kind} [{cfg}]", kind, configs[cfg], net=net, cwd=v1 if kind == "ucx-pull-v1" else None)
        results: dict[str, dict[str, Any]] = {label: _combine(r) for label, r in per_round.items()}
    if "memcpy" in modes:
        results["memcpy (1 thread)"] = _memcpy(args.budget)
    if "gather" in modes:
        results["ctx gather (1 thread)"] = _gather(args.budget)
    print(_table(results))
    checks = targets(results)
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'MISS'} {c['target']}: {c['value']} (target {c['op']} {c['bound']})")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        meta = {"cpus": os.cpu_count(), "configs": {n: configs[n] for n in names}, "sizes_mib": SIZES_MIB,
                "nixl": NIXL_DEFAULTS, "v1_commit": V1_COMMIT, "budget_s": args.budget, "rounds": args.rounds,
                "notes": notes,
                "loadavg": os.getloadavg()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "targets": checks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
