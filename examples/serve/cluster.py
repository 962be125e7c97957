"""The front's view of its nodes: live statistics, health, routing per role; starting nodes.

    every stats_interval_s, per node: control {"op": "stats"} ──> Node.stats, up / down
    a request: Cluster.pick("ctx") / pick("gen") ──> an up node chosen by that role's Router:
        round_robin    the next up node in turn (a counter per role)
        least_loaded   the least (requests in flight, live KV blocks); ties go round-robin (per role)
        power_of_two   two up nodes at random, the less loaded of the two
        load = requests this front has on the node + what the node reports
               (GEN: waiting + receiving + ready + running; CTX: requests whose KV it holds)
    a failure talking to a node marks it down at once (/health says so at once); a later poll
    brings it back; a node that is down exports no series but kvo_front_node_up 0
    membership: a fixed list from the cluster file, or etcd (``examples.two_node.membership``):
    ``add`` / ``remove`` as nodes register and leave; a draining node takes nothing new

``launch_nodes`` starts the ``launch`` entries of the cluster file as child processes
(``examples.two_node.launch.NodeProcess``, each waits for its READY line) and stops them on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.abc
import structlog

from examples.serve.config import POLICIES, ClusterConfig, NodeSpec
from examples.two_node import control
from examples.two_node.launch import NodeProcess, node_env

log = structlog.get_logger("examples.serve")

CONTROL_ERRORS = (OSError, TimeoutError, control.ControlError, anyio.EndOfStream, anyio.BrokenResourceError,
                  anyio.ClosedResourceError)
"""What talking to a node over the control plane may raise when the node is gone or refuses."""

def describe(exc: BaseException) -> str:
    """A failure as a person reads it: never an empty reason (``EndOfStream`` has no message)."""
    if isinstance(exc, anyio.EndOfStream):
        return "the node closed the connection (EndOfStream)"
    if isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError)):
        return f"the connection broke ({type(exc).__name__})"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    draining: bool = False
    """Takes nothing new (SIGTERM on the node, or POST /admin/drain): finishes what it has."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the node registered (etcd): tp size, backend, model, capacity."""

    @property
    def up(self) -> bool:
        return self.down is None

    @property
    def routable(self) -> bool:
        return self.down is None and not self.draining

    @property
    def mode(self) -> str | None:
        return self.stats.get("mode") if self.stats else None

    def load(self) -> int:
        """This front's requests on the node, plus what the node last reported while it is up (a
        down node's last figures are not current: a node that exited would show them forever)."""
        return self.inflight + (_live_requests(self.role, self.stats) if self.stats is not None and self.up else 0)

    def live_blocks(self) -> int:
        """KV blocks in use on the node (the live bytes, in blocks), from its last stats."""
        return _used_blocks(self.role, self.stats) if self.stats is not None else 0


# What routing reads of a node's ``stats`` answer; ``KeyError`` / ``TypeError`` / ``ValueError`` when it
# lacks it (the poll checks each answer before it keeps it: ``_load_fields``).

def _live_requests(role: str, stats: dict[str, Any]) -> int:
    if role == "gen":
        e = stats["engine"]
        return int(e["waiting"]) + int(e["receiving"]) + int(e["ready"]) + int(e["running"])
    return int(stats["store"]["held_requests"])


def _used_blocks(role: str, stats: dict[str, Any]) -> int:
    return int((stats["engine"]["pool"] if role == "gen" else stats["pool"])["used_blocks"])


def _load_fields(role: str, stats: dict[str, Any]) -> tuple[int, int]:
    return _live_requests(role, stats), _used_blocks(role, stats)


class Router:
    """One role's choice among its routable nodes (a counter of its own: CTX and GEN picks never
    share one, so ties go round-robin within each role)."""

    def __init__(self, policy: str = "least_loaded", *, rng: random.Random | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(POLICIES)})")
        self.policy = policy
        self._rr = itertools.count()
        self._rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node | None:
        if not nodes:
            return None
        if self.policy == "round_robin":
            return nodes[next(self._rr) % len(nodes)]
        if self.policy == "power_of_two":
            if len(nodes) == 1:
                return nodes[0]
            a, b = self._rng.sample(nodes, 2)
            return a if _key(a) <= _key(b) else b
        least = min(_key(n) for n in nodes)
        ties = [n for n in nodes if _key(n) == least]
        return ties[next(self._rr) % len(ties)]


def _key(n: Node) -> tuple[int, int]:
    return n.load(), n.live_blocks()


class Cluster:
    def __init__(self, ctx: list[str], gen: list[str], *, secret: bytes | None, interval_s: float = 0.5,
                 timeout_s: float = 10.0, policies: dict[str, str] | None = None) -> None:
        self.nodes = [Node("ctx", a) for a in ctx] + [Node("gen", a) for a in gen]
        self.secret = secret
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        policies = policies or {}
        self.routers = {role: Router(policies.get(role, "least_loaded")) for role in ("ctx", "gen")}

    def __repr__(self) -> str:
        return "<Cluster " + ", ".join(f"{n.role} {n.addr} {'up' if n.up else 'down'}"
                                        f"{' draining' if n.draining else ''} load {n.load()}"
                                        for n in self.nodes) + ">"

    def of(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    def find(self, addr: str) -> Node | None:
        return next((n for n in self.nodes if n.addr == addr), None)

    def pick(self, role: str, *, exclude: tuple[Node, ...] = ()) -> Node | None:
        """A routable node of ``role`` by its router's policy (None when none is)."""
        return self.routers[role].choose([n for n in self.of(role) if n.routable and n not in exclude])

    def ready(self) -> bool:
        return all(any(n.routable for n in self.of(role)) for role in ("ctx", "gen"))

    def mark_down(self, node: Node, why: str) -> None:
        if node.up:
            log.warning("node_down", role=node.role, node=node.addr, why=why)
        node.down = why

    def add(self, role: str, addr: str, meta: dict[str, Any] | None = None) -> Node:
        """A node joined (etcd): polled at once by ``run``'s next round, routable once it answers."""
        node = self.find(addr)
        if node is None:
            node = Node(role, addr, meta=dict(meta or {}))
            self.nodes.append(node)
            log.info("node_joined", role=role, node=addr)
        else:
            node.meta = dict(meta or {})
        node.draining = bool(node.meta.get("draining", False))
        return node

    def remove(self, addr: str, why: str) -> None:
        """A node left (its etcd key went away: deregistered or lease expired): no new request goes to
        it; requests in flight on it end as they end."""
        node = self.find(addr)
        if node is not None:
            self.nodes.remove(node)
            log.info("node_left", role=node.role, node=addr, why=why)

    async def poll(self, node: Node) -> None:
        try:
            stats = await control.call(node.addr, {"op": "stats"}, secret=self.secret, timeout=self.timeout_s)
        except CONTROL_ERRORS as exc:
            self.mark_down(node, describe(exc)[:200])
            return
        try:  # what routing reads of it (a node that answers something else is not routed to)
            _load_fields(node.role, stats)
        except (KeyError, TypeError, ValueError) as exc:
            node.stats = None
            self.mark_down(node, f"its stats answer lacks {exc!s:.80} (another program, or another version?)")
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
        """Poll every node every ``interval_s``, each on its own: a node whose poll hangs (stopped, or a
        port that accepts and never answers, up to ``timeout_s``) delays only its own next poll, not the
        others' (a round that waited for its slowest poll left every node's stats that old, and a node
        marked down by a failed request down that long). Reports started after the first round."""
        polling: set[int] = set()  # id() of the nodes whose poll is under way
        first = {id(n) for n in self.nodes}  # READY once each has had its first poll
        first_done = anyio.Event()

        async def poll_one(node: Node) -> None:
            try:
                await self.poll(node)
            finally:
                polling.discard(id(node))
                first.discard(id(node))
                if not first:
                    first_done.set()

        async with anyio.create_task_group() as tg:
            for node in list(self.nodes):
                polling.add(id(node))
                tg.start_soon(poll_one, node)

            async def every_interval() -> None:
                while True:
                    await anyio.sleep(self.interval_s)
                    for node in list(self.nodes):
                        if id(node) not in polling:
                            polling.add(id(node))
                            tg.start_soon(poll_one, node)

            tg.start_soon(every_interval)
            if first:  # READY once every node's first poll is over (the others polled on meanwhile)
                await first_done.wait()
            task_status.started()

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.ready() else "unavailable",
            "nodes": [{"role": n.role, "addr": n.addr, "up": n.up, "down": n.down, "draining": n.draining,
                       "load": n.load(), "mode": n.mode, **_group_health(n.stats)} for n in self.nodes],
        }


def _group_health(stats: dict[str, Any] | None) -> dict[str, Any]:
    """A tensor-parallel node's healing: how often its group was re-formed, and why the last time;
    while re-forming, whether it is and its failed attempts to (with the last one's error)."""
    tp = (stats or {}).get("tp") or {}
    if "restarts" not in tp:
        return {}
    out = {"restarts": tp["restarts"], "last_cause": tp.get("last_cause")}
    if tp.get("regrouping") or tp.get("form_failures"):
        out.update(regrouping=bool(tp.get("regrouping")), form_failures=tp.get("form_failures", 0),
                   last_form_error=tp.get("last_form_error"))
    return out


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
    if cfg.etcd is not None:  # it registers itself; every front watching the prefix routes to it
        args += ["--etcd", cfg.etcd.url, "--etcd-prefix", cfg.etcd.prefix]
    return [*args, *spec.args]


@contextlib.contextmanager
def launch_nodes(cfg: ClusterConfig, secret: bytes | None):
    """Start every ``launch`` node at once (each waits for its READY line); yields
    ``(ctx addresses, gen addresses, [(spec, process)])`` in the file's order; stops them all on exit."""
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
        yield addrs["ctx"], addrs["gen"], [(s, procs[id(s)]) for s in specs]


class Supervisor:
    """Restarts the nodes the front launched when they die (killed, crashed: any exit but a clean
    drain's 0), with backoff: 1 s, then doubling up to 30 s while a node keeps dying within a minute
    of its start. A node restarted on a new control address replaces the old one in a fixed
    cluster; with etcd it registers itself. ``stop_all`` stops the current processes."""

    def __init__(self, cfg: ClusterConfig, secret: bytes | None, procs: list[tuple[NodeSpec, NodeProcess]],
                 cluster: Cluster, *, first_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 check_every_s: float = 0.5) -> None:
        self.cfg = cfg
        self.env = node_env(secret.decode() if secret else None)
        if secret is None:
            self.env.pop("KVO_SHARED_SECRET", None)
        self.entries = list(procs)
        self.cluster = cluster
        self.first_backoff_s, self.max_backoff_s, self.check_every_s = first_backoff_s, max_backoff_s, check_every_s
        now = time.monotonic()
        self._started = [now] * len(self.entries)
        self._backoff = [first_backoff_s] * len(self.entries)
        self._next_try = [0.0] * len(self.entries)
        self.restarts = 0

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.check_every_s)
            for i, (spec, proc) in enumerate(self.entries):
                if proc.alive() or proc.proc.returncode == 0:  # up, or drained on purpose (scale-down)
                    continue
                now = time.monotonic()
                if now < self._next_try[i]:
                    continue
                if now - self._started[i] >= 60:  # it ran a while: start again from the first backoff
                    self._backoff[i] = self.first_backoff_s
                log.warning("node_exited_restarting", role=spec.role, node=proc.info.get("ctrl"),
                            code=proc.proc.returncode, tail=proc.log_tail(5))
                args = node_args(spec, self.cfg)
                try:
                    new = await anyio.to_thread.run_sync(lambda: NodeProcess.start(args, env=self.env),
                                                         abandon_on_cancel=False)
                except Exception as exc:
                    self._next_try[i] = time.monotonic() + self._backoff[i]
                    log.error("node_restart_failed", role=spec.role, error=str(exc)[:500], retry_in_s=self._backoff[i])
                    self._backoff[i] = min(self.max_backoff_s, self._backoff[i] * 2)
                    continue
                old = proc.info.get("ctrl")
                proc.stop()  # reap the dead one (and its log folder)
                self.entries[i] = (spec, new)
                self._started[i] = time.monotonic()
                self._next_try[i] = time.monotonic() + self._backoff[i]
                self._backoff[i] = min(self.max_backoff_s, self._backoff[i] * 2)
                self.restarts += 1
                log.info("node_restarted", role=spec.role, old=old, node=new.info["ctrl"], pid=new.proc.pid)
                if self.cfg.etcd is None:  # a fixed cluster: the new address replaces the old one
                    if old:
                        self.cluster.remove(old, "restarted")
                    node = self.cluster.add(spec.role, new.info["ctrl"])
                    await self.cluster.poll(node)

    def stop_all(self) -> None:
        """GENs first, then CTXs (the order ``launch_nodes`` stops them in): a GEN stopping may still
        talk to its CTX."""
        for _, proc in reversed(self.entries):
            proc.stop()
