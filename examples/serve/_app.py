"""The front's HTTP side: Starlette routes, admission, metrics, membership; one request's flight
through CTX then GEN lives in ``_flight``.

One request (``Front._generate``)::

    validate (400/413) ── admission: a slot, or wait in the queue (then 429) ── no CTX or GEN? 503
      streamed:      Flight.start ──> _FlightResponse (n > 1: _ChoicesResponse) ── SSE chunks
      not streamed:  n flights to their end while watching for the client's disconnect (gone: every
                     flight cancelled, GEN and CTX abort at once; a GEN that died: the flight again
                     on other nodes) ── one JSON answer
    /v1/models[/{id}], /version, /health, /metrics, POST /admin/drain; with etcd, a watch of the
    members (nodes join, drain and leave while the front serves)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import importlib.metadata
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples import metrics as node_metrics
from examples.serve import _api
from examples.serve._api import ApiError, Generation
from examples.serve._admission import Admission
from examples.serve._flight import Flight, _ChoicesResponse, _FlightResponse
from examples.serve.cluster import CONTROL_ERRORS, Cluster, Node, Supervisor, describe
from examples.serve.config import ClusterConfig
from examples.two_node import control, membership

log = structlog.get_logger("examples.serve")

try:
    VERSION = importlib.metadata.version("kv-orchestrator")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0.1.0"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class FrontMetrics:
    """The front's own series (a registry of its own), plus its nodes' re-exported with ``node``."""

    def __init__(self, cluster: Cluster) -> None:
        disable_created_metrics()  # no *_created series: the exposition lists what docs/serve.md documents
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvo_front_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("kvo_front_requests_running", "choices in flight through the front (admission slots held: n per request)", registry=r)
        self.finished = Counter("kvo_front_requests_finished", "generations that ended, by finish_reason "
                                "(stop, length, abort: client gone, error)", ["finish_reason"], registry=r)
        self.ttft = Histogram("kvo_front_time_to_first_token_seconds", "request arrival to its first token "
                              "(the CTX's prefill answer)", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvo_front_inter_token_latency_seconds", "gap between consecutive token messages "
                             "from GEN (one observation per message; the first one, after the KV transfer, excluded)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvo_front_e2e_request_latency_seconds", "request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvo_front_prompt_tokens", "prompt tokens of requests sent to CTX", registry=r)
        self.generation_tokens = Counter("kvo_front_generation_tokens", "output tokens returned", registry=r)
        self.retries = Counter("kvo_front_retries", "prefills (ctx) and GEN hand-offs (gen) tried again on another "
                               "node after a failure before any token", ["role"], registry=r)
        self.queued = Gauge("kvo_front_requests_queued", "requests waiting for a slot (max_concurrent_requests)",
                            registry=r)
        r.register(_ClusterCollector(cluster))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ClusterCollector(Collector):
    """The nodes' series from their last polled ``stats`` (no call to a node at scrape time)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def collect(self):  # type: ignore[override]
        up = GaugeMetricFamily("kvo_front_node_up", "1 while the front routes to the node", labels=["node", "role"])
        age = GaugeMetricFamily("kvo_front_node_stats_age_seconds", "age of the node figures re-exported here",
                                labels=["node", "role"])
        now = time.monotonic()
        for n in list(self.cluster.nodes):
            up.add_metric([n.addr, n.role], float(n.up))
            if n.stats is not None:
                age.add_metric([n.addr, n.role], now - n.stats_at)
        yield up
        yield age
        # a node that is down exports nothing but its up (0) and age series: its last figures would read
        # as current (kvo_gen_healthy 1 of a dead GEN), and an alert on them would never fire
        yield from node_metrics.node_families((n.role, {"node": n.addr}, n.stats if n.up else None)
                                              for n in list(self.cluster.nodes))


class Front:
    def __init__(self, cfg: ClusterConfig, cluster: Cluster, *, on_ready: Callable[[], None] | None = None,
                 supervisor: Supervisor | None = None) -> None:
        self.cfg = cfg
        self.on_ready = on_ready
        """Called once the first round of node statistics is in (the front prints READY then)."""
        self.cluster = cluster
        self.supervisor = supervisor
        """Restarts the nodes this front launched (None: it launched none)."""
        self.secret = cluster.secret
        self.max_model_len = cfg.limits.max_model_len
        self.metrics = FrontMetrics(cluster)
        limits = cfg.limits
        self.admission = Admission(limits.max_concurrent_requests, cfg.queue.size, cfg.queue.timeout_s,
                                   retry_after_s=cfg.routing.retry_after_s)
        self.metrics.queued.set_function(lambda: self.admission.statistics().waiting)
        self.created = int(time.time())
        self._tg: anyio.abc.TaskGroup | None = None
        self.closing = False
        """Set by ``begin_shutdown``."""
        self.stopping: ApiError | None = None
        """Set by ``stop_requests``: what every request still in flight, and every later one, is answered."""
        self._stop_scopes: set[anyio.CancelScope] = set()
        self._background = 0
        """Tasks ``spawn`` started that are still running (a release to a CTX: waited for at shutdown)."""
        self.etcd_error: str | None = None
        """Why the last listing or watch of etcd failed (None: it works, or no etcd)."""
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/admin/drain", self.admin_drain, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error,
                                Exception: self._internal_error},
            lifespan=self.lifespan,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self.cfg.etcd is not None:  # the nodes registered in etcd, then as they come and go; etcd
                await tg.start(self._watch_members)  # unreachable: serve the fixed nodes, retry meanwhile
            await tg.start(self.cluster.run)
            if self.supervisor is not None:
                tg.start_soon(self.supervisor.run)
            if self.on_ready is not None:
                self.on_ready()
            yield
            with anyio.move_on_after(2):  # the releases of the requests just answered reach their CTX
                while self._background:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()

    def begin_shutdown(self) -> None:
        """The server stopped taking connections: requests in flight may finish within the grace,
        and queued ones may still be admitted; one whose queue wait ends meanwhile is answered 503
        ``shutting_down`` (retry elsewhere), not 429 (retry later: here, where nothing will serve it)."""
        self.closing = True

    def stop_requests(self, message: str = "the front is shutting down") -> None:
        """The server is stopping and its grace is nearly over: every request still in flight (queued,
        prefilling, handed off, streaming) ends now with a 503 (a stream: an error event, then
        [DONE]), and its nodes are told as on any cancellation (GEN aborts, CTX releases). Without
        this the server cancelled them: a plain-text 500 and a traceback, streams cut short."""
        self.stopping = ApiError(503, message, code="shutting_down", retry_after=self.cfg.routing.retry_after_s)
        for scope in list(self._stop_scopes):
            scope.cancel()

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that ``stop_requests`` cancels (at once when it already has); the caller
        checks ``cancelled_caught`` and answers ``stopping``."""
        scope = anyio.CancelScope()
        if self.stopping is not None:
            scope.cancel()
        self._stop_scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._stop_scopes.discard(scope)

    # -- endpoints -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", _api.parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", _api.parse_chat)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model, "object": "model", "created": self.created, "owned_by": "kv-orchestrator",
                "root": self.cfg.model, "parent": None, "max_model_len": self.max_model_len}

    async def models(self, request: Request) -> Response:
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != self.cfg.model:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.cfg.model!r}",
                           param="model", code="model_not_found")
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse(self._model_card())

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def health(self, request: Request) -> Response:
        body = self.cluster.health()
        if self.cfg.etcd is not None:  # membership: whether the last look at etcd worked, else why not
            body["etcd"] = {"url": self.cfg.etcd.url, "ok": self.etcd_error is None, "error": self.etcd_error}
        ok = body["status"] == "ok"
        if not ok:  # /health is counted when it fails
            self.metrics.requests.labels("/health", "503").inc()
        headers = {} if ok else {"Retry-After": str(self.cfg.routing.retry_after_s)}
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    async def _watch_members(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self.cfg.etcd is not None and self._tg is not None
        tg, listed, started = self._tg, False, False

        def start() -> None:  # after the first attempt, whatever its outcome: the front serves meanwhile
            nonlocal started
            if not started:
                started = True
                task_status.started()

        async def on_put(role: str, meta: dict[str, Any]) -> None:
            known = self.cluster.find(meta["ctrl"]) is not None
            node = self.cluster.add(role, meta["ctrl"], meta)
            if not known:  # polled now: it takes traffic as soon as it answers, not at the next round
                if listed:
                    tg.start_soon(self.cluster.poll, node)
                else:
                    await self.cluster.poll(node)

        def on_listed() -> None:
            nonlocal listed
            listed = True
            self.etcd_error = None
            start()

        def on_error(exc: membership.EtcdError) -> None:
            self.etcd_error = str(exc)[:300]
            start()

        await membership.watch_members(self.cfg.etcd.url, self.cfg.etcd.prefix, on_put=on_put,
                                       on_delete=lambda role, ctrl: self.cluster.remove(ctrl, "left etcd"),
                                       on_listed=on_listed, on_error=on_error)

    async def admin_drain(self, request: Request) -> Response:
        """``POST /admin/drain {"node": "host:port"}``: the node takes nothing new from any front, finishes
        what it has, deregisters from etcd and stops (as on SIGTERM). With a shared secret, the request
        must carry ``Authorization: Bearer <secret>``."""
        if self.secret is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), b"Bearer " + self.secret):
            raise ApiError(401, "POST /admin/drain needs Authorization: Bearer <the cluster's shared secret>",
                           code="unauthorized", type="authentication_error")
        body = await self._read_json(request)
        if not isinstance(body.get("node"), str) or not body["node"]:
            code = "missing_required_parameter" if body.get("node") is None else "invalid_value"
            raise ApiError(400, 'POST /admin/drain takes {"node": "host:port"}: the control address of a node '
                           "of this cluster (GET /health lists them)", param="node", code=code)
        node = self.cluster.find(body["node"])
        if node is None:
            raise ApiError(404, f"no node {body.get('node')!r} in this cluster", param="node", code="node_not_found")
        try:
            answer = await control.call(node.addr, {"op": "drain"}, secret=self.secret,
                                        timeout=self.cfg.routing.connect_timeout_s)
        except CONTROL_ERRORS as exc:  # refused (no --etcd) or unreachable: it serves on as before
            raise ApiError(503, f"{node.role} {node.addr} did not take the drain: {describe(exc)}",
                           code="node_unavailable") from None
        node.draining = True  # it took it: this front at once; every front once the node says so in etcd
        log.info("node_drain_requested", node=node.addr, answer=answer)
        return JSONResponse({"node": node.addr, "role": node.role, **answer})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        answer = await self._api_error(request, ApiError(exc.status_code, str(exc.detail), code=None))
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.error("request_failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
        return await self._api_error(request, ApiError(500, "internal error", type="server_error", code="internal_error"))

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        path = request.url.path
        endpoint = path if path in _ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    # -- one request -----------------------------------------------------------------------------
    async def _generate(self, request: Request, endpoint: str, parse: Any) -> Response:
        t0 = time.perf_counter()
        body = await self._read_json(request)
        limits = self.cfg.limits
        g: Generation = parse(body, model=self.cfg.model, limits=limits, max_model_len=self.max_model_len)
        # while it waits for admission and (streamed) its prefill and hand-off, a client that goes
        # away is seen at once: its place in the queue is freed, nothing more reaches a node
        flights: list[Flight] = []
        if g.stream:
            async def admit_and_start() -> None:
                await self.admission.enter(g.n)  # every choice's slot at once (one by one, two requests could deadlock)
                if g.n == 1:
                    flights.append(Flight(self, g, endpoint, t0))  # request_timeout_s from here
                else:  # one deadline for the request: every choice, every retry
                    deadline = time.monotonic() + self.cfg.routing.request_timeout_s
                    flights.extend(Flight(self, g.choice(i), endpoint, t0, deadline=deadline) for i in range(g.n))
                for f in flights:  # each gives its slot back
                    await f.start()

            try:
                here = await self._unless_gone(request, endpoint, g, admit_and_start)
            except BaseException:
                for f in flights:
                    await f.aclose()
                raise
            if not here:
                for f in flights:  # an unfinished prefill's KV is released once it comes; a handed-off
                    await f.aclose()  # request is aborted on its GEN
                return Response(status_code=499)
            if g.n == 1:
                return _FlightResponse(flights[0])
            return _ChoicesResponse(self, g, flights, endpoint)  # n choices in one stream, chunks name their index
        entered = False

        async def admit() -> None:
            nonlocal entered
            await self.admission.enter(g.n)
            entered = True

        if not await self._unless_gone(request, endpoint, g, admit):
            if entered:
                self.admission.leave(g.n)
            return Response(status_code=499)
        deadline = time.monotonic() + self.cfg.routing.request_timeout_s  # one for the request: every choice, every retry
        flights = [Flight(self, g.choice(i), endpoint, t0, deadline=deadline) for i in range(g.n)]  # each gives its slot back
        async def run_all() -> None:  # n choices: n flights, each its own request on the nodes
            async with anyio.create_task_group() as runs:
                for i in range(len(flights)):
                    runs.start_soon(self._run_to_end, flights, i)

        try:  # not streamed: a client that goes away is seen at once, not when the answer is written:
            # the flights are cancelled, so GEN and CTX abort within ms
            here = await self._unless_gone(request, endpoint, g, run_all, during="its answer")
        finally:
            for f in flights:
                await f.aclose()
        if not here:
            return Response(status_code=499)
        for f in flights:
            if f.error is not None:
                raise f.error
        self.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(_api.response(g, [f.text for f in flights], [f.logprobs for f in flights]))

    async def _unless_gone(self, request: Request, endpoint: str, g: Generation, step: Any, *,
                           during: str = "admission or hand-off") -> bool:
        """Run ``step()`` unless the client goes away first (its ``http.disconnect``): then ``step`` is
        cancelled, the request is counted as 499 and False returned; the caller undoes what ``step``
        took. An error ``step`` raises is raised as it is (not in an exception group), unless the
        client went away."""
        gone = False
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal gone
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                with self.stoppable() as stop:
                    await step()
                if stop.cancelled_caught:  # the front is stopping: the undoing is the caller's, as when gone
                    assert self.stopping is not None
                    error = self.stopping
            except Exception as exc:  # an ApiError (a 429, a 503): raised below, unwrapped
                error = exc
                if self.closing and isinstance(exc, ApiError) and exc.status == 429:  # the queue's "retry later"
                    error = ApiError(503, "the front is shutting down; retry on another front", code="shutting_down",
                                     retry_after=self.cfg.routing.retry_after_s)
            tg.cancel_scope.cancel()
        if gone:
            log.info("client_gone", request_id=g.request_id, during=during)
            self.metrics.requests.labels(endpoint, "499").inc()
            return False
        if error is not None:
            raise error
        return True

    async def _run_to_end(self, flights: list[Flight], i: int) -> None:
        """A non-streamed flight, start to last token; a failure is kept in ``flight.error`` (raised in a
        task group it would come out wrapped in an ExceptionGroup). Nothing has reached the client
        before the answer, so a GEN that dies mid-request (or ends it unfinished) costs a retry of
        the whole flight on other nodes, up to ``max_retries``, not the request."""
        while True:
            flight = flights[i]
            try:
                await flight.start()
                async for _ in flight.pieces():
                    pass
            except ApiError as exc:
                flight.error = exc
            err = flight.error
            if err is None or err.code not in ("gen_unavailable", "generation_failed") or \
                    flight.retries >= self.cfg.max_retries:
                return
            again = Flight(self, dataclasses.replace(flight.g, request_id=f"{flight.g.request_id}-r{flight.retries + 1}"),
                           flight.endpoint, flight.t0, deadline=flight.deadline)
            again.retries, again.first_try = flight.retries + 1, False
            flights[i] = again  # first: a cancellation from here on closes the new one (the caller's finally)
            flight.holds_slot = False  # its admission slot goes to the new flight
            flight.counted = False  # and the request is counted once, by the new flight
            await flight.aclose()
            self.metrics.retries.labels("gen").inc()
            log.info("flight_retried", request_id=flight.g.request_id, error=err.message)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        raw = bytearray()
        with anyio.move_on_after(self.cfg.limits.body_timeout_s) as scope:
            async for part in request.stream():
                raw += part
                if len(raw) > limit:
                    raise too_big
        if scope.cancelled_caught:
            raise ApiError(408, f"the request body did not arrive within {self.cfg.limits.body_timeout_s:g} s "
                           f"(limits.body_timeout_s; {len(raw)} bytes came)", code="request_timeout")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
        except ValueError as exc:  # an integer longer than Python converts (sys.get_int_max_str_digits)
            raise ApiError(400, f"the body's JSON holds a value this server cannot read: {exc}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a request's background work in the front's task group, which also runs the node
        poller and the supervisor: an exception is logged here and goes no further, so no request
        can take those down (a client gone mid-stream, a bug in one response)."""
        if self._tg is None:
            raise RuntimeError("the front is not running")
        self._tg.start_soon(self._guarded, fn, args)

    async def _guarded(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._background += 1
        try:
            await fn(*args)
        except Exception as exc:
            log.error("background_task_failed", task=getattr(fn, "__qualname__", repr(fn)),
                      error=f"{type(exc).__name__}: {exc}", exc_info=True)
        finally:
            self._background -= 1

    def spawn_release(self, node: Node, request_id: str, handle: str) -> None:
        if self._tg is not None:  # (not running: the CTX's lease frees it)
            self.spawn(self._release, node, request_id, handle)

    async def _release(self, node: Node, request_id: str, handle: str) -> None:
        try:
            await control.call(node.addr, {"op": "release", "request_id": request_id, "kv_handle": handle},
                               secret=self.secret, timeout=self.cfg.routing.connect_timeout_s)
        except CONTROL_ERRORS as exc:  # the lease frees it in the end
            log.info("release_failed", node=node.addr, request_id=request_id, error=str(exc))


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version")
