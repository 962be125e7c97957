"""Prometheus metrics of the nodes (and, re-exported, of the front): every series is in docs/serve.md.

    a node's control ``stats`` dict ──> gen_families / ctx_families ──> metric families
        on a node:  NodeCollector(role, node.stats)      scrape: the node's ``--metrics-port``
        on the front: the cached ``stats`` of every node, with a ``node`` label (examples.serve)

Node figures are read when Prometheus scrapes (a custom collector: nothing is recorded on the hot
path) from the same dict the node's control ``stats`` answers, so the two views never disagree.
``engine.statistics()`` is cheap and thread-safe; the execution thread's timings come from
``DecodeLoop.statistics()`` (percentiles over its recent iterations, a few ms of numpy per scrape).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector

log = structlog.get_logger("examples.metrics")

Stats = dict[str, Any]
QUANTILES = (("0.5", "p50"), ("0.99", "p99"), ("1", "max"))
"""``quantile`` label values of the execution-thread timings, and the ``stats`` field of each."""


class _Families:
    """Metric families that share one set of constant labels (``node`` on the front, none on a node)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.names = list(labels)
        self.values = list(labels.values())
        self.out: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, value: float, **extra: str) -> None:
        self._add(GaugeMetricFamily, name, doc, value, extra)

    def counter(self, name: str, doc: str, value: float, **extra: str) -> None:
        self._add(CounterMetricFamily, name, doc, value, extra)

    def histogram(self, name: str, doc: str, snapshot: dict[str, Any]) -> None:
        """A histogram from ``orchestrator._engine.Histogram.snapshot()`` (cumulative counts)."""
        family = self.out.get(name)
        if family is None:
            family = self.out[name] = HistogramMetricFamily(name, doc, labels=self.names)
        bounds = [*(repr(float(b)) for b in snapshot["bounds"]), "+Inf"]
        family.add_metric(self.values, list(zip(bounds, snapshot["counts"])), snapshot["sum"])

    def summary(self, name: str, doc: str, window: dict[str, Any], count: int, **extra: str) -> None:
        """A summary over a window of recent observations (``Percentiles`` as a dict, ms): ``quantile``
        samples plus ``_count``/``_sum`` of the window (a Prometheus summary, the type that owns the
        ``quantile`` label; a windowed one, like the Go client's ``MaxAge``)."""
        family = self.out.get(name)
        if family is None:
            family = self.out[name] = SummaryMetricFamily(name, doc, labels=[*self.names, *extra])
        values = [*self.values, *extra.values()]
        for q, key in QUANTILES:
            family.samples.append(Sample(name, dict(zip([*self.names, *extra, "quantile"], [*values, q])),
                                         window[key] / 1e3))
        family.add_metric(values, count, window.get("mean", 0.0) * count / 1e3)

    def _add(self, kind: type, name: str, doc: str, value: float, extra: dict[str, str]) -> None:
        family = self.out.get(name)
        if family is None:
            family = self.out[name] = kind(name, doc, labels=[*self.names, *extra])
        family.add_metric([*self.values, *extra.values()], float(value))


def gen_families(stats: Stats, fam: _Families) -> None:
    """A GEN node's series (its control ``stats`` answer)."""
    e, loop = stats["engine"], stats["loop"]
    fam.gauge("kvo_gen_healthy", "1 while the GEN engine can serve, 0 once it is unhealthy", bool(stats.get("healthy")))
    for state in ("waiting", "receiving", "ready", "running"):
        fam.gauge("kvo_gen_requests", "GEN requests by state (waiting for admission, receiving KV, KV received "
                  "ahead of the batch, decoding)", e[state], state=state)
    fam.counter("kvo_gen_requests_finished_total", "GEN requests that finished", e["finished"])
    fam.counter("kvo_gen_requests_aborted_total", "GEN requests aborted (client gone, node stopping)", e["aborted"])
    for reason, n in sorted(e["failed"].items()):
        fam.counter("kvo_gen_request_failures_total", "GEN requests failed, by reason", n, reason=reason)
    for reason, n in sorted(e["deferrals"].items()):
        fam.counter("kvo_gen_deferral_episodes_total", "episodes of a request deferred at admission, by reason "
                    "(backpressure: transfer budget; kv_exhausted: KV pool)", n, reason=reason)
    budget = e["budget"]
    fam.gauge("kvo_gen_transfer_budget_capacity_bytes", "the transfer budget (bytes of KV receives in flight)",
              budget["capacity"])
    fam.gauge("kvo_gen_transfer_budget_in_use_bytes", "transfer budget taken by receives in flight", budget["in_use"])
    fam.gauge("kvo_gen_transfer_budget_peak_bytes", "peak transfer budget in use since start", budget["peak_in_use"])
    if "receives_in_flight" in e:
        fam.gauge("kvo_gen_receives_in_flight", "KV receives posted and not yet over", e["receives_in_flight"])
    if "quarantined_blocks" in e:
        fam.gauge("kvo_gen_kv_quarantined_blocks", "KV blocks of failed receives UCX may still write into",
                  e["quarantined_blocks"])
    fam.gauge("kvo_gen_staging_peak_bytes", "peak bytes of staging (bounce) buffers", e["peak_staging_bytes"])
    if "receive_seconds" in e:
        fam.histogram("kvo_gen_kv_transfer_duration_seconds", "successful KV receives: from the receive's start "
                      "(after admission) to the KV in place", e["receive_seconds"])
        fam.histogram("kvo_gen_kv_transfer_bytes", "successful KV receives: bytes moved", e["receive_bytes"])
    pool = e["pool"]
    fam.gauge("kvo_gen_kv_used_blocks", "GEN KV blocks in use", pool["used_blocks"])
    fam.gauge("kvo_gen_kv_capacity_blocks", "GEN KV blocks in the pool", pool["num_blocks"])
    fam.counter("kvo_gen_exec_iterations_total", "execution-thread iterations recorded (since the last reset_stats; "
                "the timing window holds the newest 131072)", loop["iterations"])
    for field, label in (("orchestration_ms", "orchestration"), ("blocked_ms", "blocked"), ("stalled_ms", "stalled"),
                         ("model_ms", "model")):
        fam.summary(f"kvo_gen_exec_{label}_seconds", f"execution thread, {label} time per iteration: summary over "
                    "the recent iterations", loop[field],
                    loop["decode_iterations"] if field == "model_ms" else loop["iterations"])
    tp = stats.get("tp") or {}
    if tp.get("world_size", 1) > 1:  # a tensor-parallel GEN: rank 0 answers for the group
        fam.gauge("kvo_gen_tp_ranks", "ranks of this tensor-parallel GEN group (every rank holds the same requests "
                  "in the same states: rank consistency)", tp["world_size"])
        for rank, rloop in sorted((tp.get("rank_loop") or {}).items()):
            for field, label in (("orchestration_ms", "orchestration"), ("blocked_ms", "blocked"),
                                 ("stalled_ms", "stalled"), ("model_ms", "model")):
                fam.summary(f"kvo_gen_rank_exec_{label}_seconds", f"execution thread of each rank, {label} time "
                            "per iteration: summary over its recent iterations (reported to rank 0 every second)",
                            rloop[field], rloop["decode_iterations"] if field == "model_ms" else rloop["iterations"],
                            rank=str(rank))


def ctx_families(stats: Stats, fam: _Families) -> None:
    """A CTX node's series (its control ``stats`` answer)."""
    store, pool = stats["store"], stats["pool"]
    fam.counter("kvo_ctx_prefills_total", "prompts prefilled", stats["prefills"])
    fam.gauge("kvo_ctx_held_requests", "requests whose KV the CTX holds for a GEN to pull", store["held_requests"])
    fam.gauge("kvo_ctx_held_blocks", "KV blocks held for a GEN to pull", store["held_blocks"])
    fam.counter("kvo_ctx_kv_released_total", "held KV freed by a pull or a release", store["released"])
    fam.counter("kvo_ctx_kv_expired_total", "held KV freed because its lease ended", store["expired"])
    fam.gauge("kvo_ctx_kv_used_blocks", "CTX KV blocks in use", pool["used_blocks"])
    fam.gauge("kvo_ctx_kv_capacity_blocks", "CTX KV blocks in the pool", pool["num_blocks"])


_BY_ROLE: dict[str, Callable[[Stats, _Families], None]] = {"gen": gen_families, "ctx": ctx_families}


def node_families(nodes: Iterable[tuple[str, dict[str, str], Stats | None]]) -> list[Metric]:
    """Families of several nodes: ``(role, constant labels, stats or None when unknown)`` each.

    A node whose stats are unknown (down, not polled yet) contributes nothing but its ``up`` series
    (that one is the front's). Families of the same name from several nodes are merged."""
    merged: dict[str, Metric] = {}
    for role, labels, stats in nodes:
        if stats is None:
            continue
        fam = _Families(labels)
        try:
            _BY_ROLE[role](stats, fam)
        except (KeyError, TypeError, ValueError) as exc:  # a node of another version: skip, say why once
            log.warning("metrics_stats_unreadable", role=role, labels=labels, error=repr(exc))
            continue
        for name, family in fam.out.items():
            if name in merged:
                merged[name].samples.extend(family.samples)
            else:
                merged[name] = family
    return list(merged.values())


class NodeCollector(Collector):
    """A node's own series, read from ``stats()`` at each scrape."""

    def __init__(self, role: str, stats: Callable[[], Stats]) -> None:
        if role not in _BY_ROLE:
            raise ValueError(f"unknown role {role!r}")
        self.role = role
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        for attempt in range(2):  # a dict another thread grew while we copied it: read again
            try:
                snapshot = self.stats()
                break
            except RuntimeError:
                if attempt:
                    raise
        yield from node_families([(self.role, {}, snapshot)])


METRICS_IDLE_TIMEOUT_S = 10.0
"""A scrape connection that sends nothing this long is closed (its thread ends)."""
METRICS_MAX_CONNECTIONS = 64
"""Scrape connections served at once; one more is closed as soon as it is accepted."""
METRICS_CONNECTION_DEADLINE_S = 30.0
"""A scrape connection still open this long after it was accepted is shut (one request a
connection: a client that trickles a byte every few seconds would keep its thread for good)."""


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_TIMEOUT_S  # the socket's timeout: prometheus_client's handler has none

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class _BoundedServer(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection server, with a bound on the threads: its own
    started a thread for every connection and kept it while the client sent nothing, for good
    (the port takes no secret: anyone who reached it could grow the node by a thread a connection)."""

    max_connections = METRICS_MAX_CONNECTIONS
    connection_deadline_s = METRICS_CONNECTION_DEADLINE_S

    def server_activate(self) -> None:
        self._open = 0
        self._open_lock = threading.Lock()
        self._accepted: dict[Any, float] = {}  # a served connection's socket -> when it was accepted
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing will count it out
            with self._open_lock:
                self._open -= 1
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._accepted[request] = time.monotonic()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1
                self._accepted.pop(request, None)

    def service_actions(self) -> None:
        """Every poll of ``serve_forever`` (0.5 s): shut connections past their deadline, which
        ends their threads' reads and writes (the idle timeout alone let a trickle through)."""
        now = time.monotonic()
        with self._open_lock:
            late = [r for r, t in self._accepted.items() if now - t > self.connection_deadline_s]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:  # its thread closed it meanwhile
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went quiet (timed out) or away: nothing to print on the node's stderr


def start_metrics_server(role: str, stats: Callable[[], Stats], *, host: str, port: int,
                         idle_timeout_s: float = METRICS_IDLE_TIMEOUT_S,
                         max_connections: int = METRICS_MAX_CONNECTIONS,
                         connection_deadline_s: float = METRICS_CONNECTION_DEADLINE_S) -> ThreadingWSGIServer:
    """A started metrics server (a daemon thread serves it); ``server.shutdown()`` stops it."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(role, stats))
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    handler = type("_Handler", (_QuietHandler,), {"timeout": idle_timeout_s})
    server_cls = type("_Server", (_BoundedServer,), {"address_family": family, "max_connections": max_connections,
                                                      "connection_deadline_s": connection_deadline_s})
    try:
        server = make_server(host, port, make_wsgi_app(registry), server_cls, handler_class=handler)
    except OSError as exc:  # which port: a node binds two or three ("Address already in use" alone said none)
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def serve_node_metrics(role: str, stats: Callable[[], Stats], *, host: str, port: int) -> int:
    """Serve a node's series over HTTP (a daemon thread; a thread per scrape connection, at most
    ``METRICS_MAX_CONNECTIONS``, each closed after ``METRICS_IDLE_TIMEOUT_S`` of silence or
    ``METRICS_CONNECTION_DEADLINE_S`` in all); returns the port."""
    server = start_metrics_server(role, stats, host=host, port=port)
    bound = int(server.server_address[1])
    log.info("metrics_serving", role=role, host=host, port=bound)
    return bound



def ctx_node_stats(node: Any) -> Stats:
    """The part of a CTX node's control ``stats`` answer that ``ctx_families`` reads, from any thread
    (``KVStore.statistics`` takes its lock; the pool's counters are plain ints)."""
    s, p = node.store.statistics(), node.pool.statistics()
    return {"role": "ctx", "prefills": node._prefills,
            "store": {"held_requests": s.held_requests, "held_blocks": s.held_blocks, "released": s.released,
                      "expired": s.expired},
            "pool": {"num_blocks": p.num_blocks, "used_blocks": p.used_blocks, "peak_used_blocks": p.peak_used_blocks}}
