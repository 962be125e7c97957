"""The front's view of its nodes: live statistics, health, least-loaded choice; starting nodes.

    every stats_interval_s, per node: control {"op": "stats"} ──> Node.stats, up / down
    a request: Cluster.pick("ctx") / pick("gen") ──> the up node with the least load
        load = requests this front has on the node + what the node reports
               (GEN: waiting + receiving + ready + running; CTX: requests whose KV it holds)
    a node that refuses a connection is marked down at once (the next poll may bring it back)

``launch_nodes`` starts the ``launch`` entries of the cluster file as child processes
(``examples.two_node.launch.NodeProcess``, each waits for its READY line) and stops them on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.abc
import structlog

from examples.serve.config import ClusterConfig, NodeSpec
from examples.two_node import control
from examples.two_node.launch import NodeProcess, node_env

log = structlog.get_logger("examples.serve")

CONTROL_ERRORS = (OSError, TimeoutError, control.ControlError, anyio.EndOfStream, anyio.BrokenResourceError,
                  anyio.ClosedResourceError)
"""What talking to a node over the control plane may raise when the node is gone or refuses."""


@dataclasses.dataclass
class Node:
    role: str
    addr: str
    stats: dict[str, Any] | None = None
    """Its last ``stats`` answer (None until the first poll succeeds)."""
    stats_at: float = 0.0
    down: str | None = "not polled yet"
    """Why the node is not used (None: up)."""
    inflight: int = 0
    """Requests this front has on the node now."""

    @property
    def up(self) -> bool:
        return self.down is None

    @property
    def mode(self) -> str | None:
        return self.stats.get("mode") if self.stats else None

    def load(self) -> int:
        reported = 0
        if self.stats is not None:
            if self.role == "gen":
                e = self.stats["engine"]
                reported = e["waiting"] + e["receiving"] + e["ready"] + e["running"]
            else:
                reported = self.stats["store"]["held_requests"]
        return self.inflight + reported


class Cluster:
    def __init__(self, ctx: list[str], gen: list[str], *, secret: bytes | None, interval_s: float = 0.5,
                 timeout_s: float = 10.0) -> None:
        self.nodes = [Node("ctx", a) for a in ctx] + [Node("gen", a) for a in gen]
        self.secret = secret
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._rr = itertools.count()  # ties between equally loaded nodes go round-robin

    def __repr__(self) -> str:
        return "<Cluster " + ", ".join(f"{n.role} {n.addr} {'up' if n.up else 'down'} load {n.load()}"
                                        for n in self.nodes) + ">"

    def of(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    def pick(self, role: str) -> Node | None:
        """The up node of ``role`` with the least load (None when every one is down)."""
        up = [n for n in self.of(role) if n.up]
        if not up:
            return None
        least = min(n.load() for n in up)
        ties = [n for n in up if n.load() == least]
        return ties[next(self._rr) % len(ties)]

    def ready(self) -> bool:
        return all(any(n.up for n in self.of(role)) for role in ("ctx", "gen"))

    def mark_down(self, node: Node, why: str) -> None:
        if node.up:
            log.warning("node_down", role=node.role, node=node.addr, why=why)
        node.down = why

    async def poll(self, node: Node) -> None:
        try:
            stats = await control.call(node.addr, {"op": "stats"}, secret=self.secret, timeout=self.timeout_s)
        except CONTROL_ERRORS as exc:
            self.mark_down(node, f"{type(exc).__name__}: {exc}"[:200])
            return
        node.stats, node.stats_at = stats, time.monotonic()
        why = None if stats.get("healthy", True) else f"unhealthy: {stats.get('health')}"
        if why is not None:
            self.mark_down(node, why)
        else:
            if not node.up:
                log.info("node_up", role=node.role, node=node.addr)
            node.down = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll every node every ``interval_s``; reports started after the first round."""
        async with anyio.create_task_group() as tg:
            for node in self.nodes:
                tg.start_soon(self.poll, node)
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            async with anyio.create_task_group() as tg:
                for node in self.nodes:
                    tg.start_soon(self.poll, node)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.ready() else "unavailable",
            "nodes": [{"role": n.role, "addr": n.addr, "up": n.up, "down": n.down, "load": n.load(),
                       "mode": n.mode, **_group_health(n.stats)} for n in self.nodes],
        }


def _group_health(stats: dict[str, Any] | None) -> dict[str, Any]:
    """A tensor-parallel node's healing: how often its group was re-formed, and why the last time."""
    tp = (stats or {}).get("tp") or {}
    return {"restarts": tp["restarts"], "last_cause": tp.get("last_cause")} if "restarts" in tp else {}


# -- starting nodes -------------------------------------------------------------------------------

def node_args(spec: NodeSpec, cfg: ClusterConfig) -> list[str]:
    """The ``python -m examples.two_node`` arguments of a node the front starts. KV checksums are off
    (the front does not compare them; ``args: ["--kv-checksums"]`` turns them back on)."""
    args = [spec.role, "--host", spec.host, "--no-kv-checksums", "--kv-transport", cfg.transfer.backend]
    if spec.role == "ctx" and spec.tensor_parallel_size > 1:
        args += ["--tp", str(spec.tensor_parallel_size)]
    if spec.role == "gen":
        t = cfg.transfer
        args += ["--mode", spec.mode, "--step", spec.step, "--kv-transfer-timeout-ms", str(t.kv_transfer_timeout_ms)]
        if spec.tensor_parallel_size > 1:
            args += ["--tp", str(spec.tensor_parallel_size)]
        if t.transfer_budget_bytes is not None:
            args += ["--transfer-budget-bytes", str(t.transfer_budget_bytes)]
        elif t.max_tokens_in_buffer is not None:
            args += ["--max-tokens-in-buffer", str(t.max_tokens_in_buffer)]
    if spec.metrics_port is not None:
        args += ["--metrics-port", str(spec.metrics_port)]
    if cfg.insecure:
        args.append("--insecure")
    return [*args, *spec.args]


@contextlib.contextmanager
def launch_nodes(cfg: ClusterConfig, secret: bytes | None):
    """Start every ``launch`` node at once (each waits for its READY line); yields
    ``(ctx addresses, gen addresses, processes)`` in the file's order; stops them all on exit."""
    env = node_env(secret.decode() if secret else None)
    if secret is None:
        env.pop("KVO_SHARED_SECRET", None)  # insecure: the nodes get --insecure
    specs = [s for s in cfg.nodes if s.launched]
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(max(1, len(specs))) as pool:
            futures = {id(s): pool.submit(NodeProcess.start, node_args(s, cfg), env=env) for s in specs}
            procs: dict[int, NodeProcess] = {}
            errors = []
            for s in specs:
                try:
                    procs[id(s)] = stack.enter_context(futures[id(s)].result())
                except Exception as exc:  # stop the others (the stack), then say which one failed
                    errors.append(f"{s.role} {' '.join(node_args(s, cfg))}: {exc}")
        if errors:
            raise RuntimeError("a node did not start:\n" + "\n".join(errors))
        addrs = {role: [s.addr or procs[id(s)].info["ctrl"] for s in cfg.nodes if s.role == role] for role in ("ctx", "gen")}
        for s in specs:
            log.info("node_started", role=s.role, node=procs[id(s)].info["ctrl"], pid=procs[id(s)].proc.pid)
        yield addrs["ctx"], addrs["gen"], list(procs.values())

