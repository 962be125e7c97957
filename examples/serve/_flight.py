"""One request's flight through a CTX and a GEN node, and the SSE responses that carry flights.

    Flight.start:   prefill on a CTX (router.ctx) ──> first token, KV handle       (TTFT ends here)
                    generate {that handoff} ──> a GEN (router.gen)
                    (a failure here: another node of that role, up to max_retries: no token sent yet)
    Flight.pieces:  {"tokens"}... {"done"} from GEN ──TextStream──> (text, token ids) as they come
    Flight.aclose, exactly once, whatever happened (finished, client gone, error):
      close the generate connection (before "done" that aborts the request on GEN, which tells CTX
      to free its copy); tell CTX to release when GEN never pulled (no generate sent, an ``ideal``
      GEN, a request that did not finish); give back the node and admission counters; record metrics.
    _FlightResponse: one flight as SSE;  _ChoicesResponse: n flights (n choices) as one SSE stream.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from examples.serve import _api
from examples.serve._api import ApiError, Generation, TextStream
from examples.serve.cluster import CONTROL_ERRORS, Node, describe
from examples.two_node import control

if TYPE_CHECKING:
    from examples.serve._app import Front


REQUEST_REFUSALS = ("context_length_exceeded", "invalid_request")
"""The ``code`` of a CTX's or a GEN's ``{"ok": false}`` when the request itself cannot be served (prompt
+ max_tokens over the model's length or the node's pool, a malformed field): a 400 for the client; the
node is not marked down and no other node is tried (examples/two_node/gen.py's ``_refusal_code``)."""


def request_refused(who: str, code: str, why: object) -> ApiError:
    """The 400 for a refusal (code in ``REQUEST_REFUSALS``) about the request itself, by node ``who``."""
    return ApiError(400, f"{who} cannot serve this request: {why}",
                    code="context_length_exceeded" if code == "context_length_exceeded" else "invalid_value")


class Flight:
    """One request through a CTX and a GEN node; ``aclose`` gives everything back exactly once."""

    def __init__(self, front: Front, g: Generation, endpoint: str, t0: float, *, deadline: float | None = None) -> None:
        self.front = front
        self.g = g
        self.endpoint = endpoint
        self.t0 = t0
        self.text = TextStream(max_tokens=g.max_tokens, stop=g.stop, ignore_eos=g.ignore_eos,
                               stop_token_ids=g.stop_token_ids, include_stop_str=g.include_stop_str,
                               min_tokens=g.min_tokens)
        self.ctx: Node | None = None
        self.gen: Node | None = None
        self.handle: str | None = None
        self.prefill: dict[str, Any] | None = None
        self.stream: control.JsonStream | None = None
        self.gen_state: str | None = None
        self.sent = False
        """``generate`` reached GEN: from then on GEN pulls the KV, or tells CTX to free it."""
        self.error: ApiError | None = None
        self.deadline = time.monotonic() + front.cfg.routing.request_timeout_s if deadline is None else deadline
        """When ``request_timeout_s`` ends for the HTTP request (shared by its choices and retries): 504."""
        self.retries = 0
        """Prefills and hand-offs tried again on another node."""
        self.logprobs: list[Any] = []
        """Per token received (aligned with ``text.token_ids``): ``[logprob, top]`` or None."""
        self._last_error: ApiError | None = None
        """Why the last prefill or hand-off failed (what the client gets when no node is left to try)."""
        self.holds_slot = True
        """It holds an admission slot (given back by ``aclose``, or handed to a retry of it)."""
        self.counted = True
        """``aclose`` records it in the request metrics (finished, tokens returned, e2e); not a flight
        replaced by a retry of it: a request is counted once, by its last flight."""
        self.first_try = True
        """Not a retry of an earlier flight of the same request (only the first observes the TTFT)."""
        self._tried_gens: list[Node] = []
        """GENs that failed this flight's hand-off (unreachable, refused): not picked again for it."""
        self._held: list[Node] = []
        """The nodes whose ``inflight`` this flight raised (given back by ``aclose``, and only those)."""
        self._closed = False
        front.metrics.running.inc()

    def _hold(self, node: Node) -> Node:
        node.inflight += 1
        self._held.append(node)
        return node

    def _let_go(self, node: Node) -> None:
        if node in self._held:
            self._held.remove(node)
            node.inflight -= 1

    async def start(self) -> None:
        """Prefill on a CTX and send ``generate`` to a GEN: every failure here is still an HTTP status.
        A prefill or a hand-off that fails (the node refused or is unreachable) is tried again on
        another node of that role, up to ``max_retries`` times in all: no token has reached the
        client yet."""
        front, g = self.front, self.g
        cluster, retry = front.cluster, front.cfg.routing.retry_after_s
        if not cluster.ready():
            down = [f"{n.role} {n.addr}: {n.down or 'draining'}" for n in cluster.nodes if not n.routable]
            raise ApiError(503, "no CTX or no GEN node is up (" + ("; ".join(down) or "no node registered") + ")",
                           code="no_node_available", retry_after=retry)
        retries = front.cfg.max_retries
        tried: list[Node] = []
        while True:
            ctx = cluster.pick("ctx", exclude=tuple(tried))
            if ctx is None:
                raise self._last_error or ApiError(503, "no CTX node is up", code="no_node_available",
                                                   retry_after=retry)
            self.ctx = self._hold(ctx)
            try:
                self.prefill = await self._prefill(ctx)
                break
            except control.ControlError as exc:  # the node refused (no free KV blocks in time, ...)
                if exc.code in REQUEST_REFUSALS:  # about the request (too long for the model or its pool): every
                    # CTX would refuse it; a 503 with Retry-After had every client retry it for nothing
                    raise request_refused(f"CTX {ctx.addr}", exc.code, exc) from None
                self._last_error = ApiError(503, f"CTX {ctx.addr} refused the prefill: {exc}", code="ctx_refused",
                                            retry_after=retry)
                if exc.code == control.UNAVAILABLE:  # stopping (SIGTERM) or draining: no further prefill there
                    cluster.mark_down(ctx, f"prefill refused: {exc}"[:200])
            except CONTROL_ERRORS as exc:
                cluster.mark_down(ctx, f"prefill: {describe(exc)}")
                self._last_error = ApiError(503, f"CTX {ctx.addr} is unreachable: {describe(exc)}",
                                            code="ctx_unavailable", retry_after=retry)
            self._let_go(ctx)
            self.ctx = None
            tried.append(ctx)
            if self.retries >= retries:
                raise self._last_error  # (set just above)
            self.retries += 1
            front.metrics.retries.labels("ctx").inc()
        self._last_error = None  # a CTX answered: what fails from here on is the hand-off's
        self.handle = self.prefill["kv_handle"]
        if self.first_try:
            front.metrics.ttft.observe(time.perf_counter() - self.t0)
        front.metrics.prompt_tokens.inc(len(g.prompt_ids))
        self.text.feed([int(self.prefill["first_token"])])
        self.logprobs.append(self.prefill.get("first_logprobs"))
        self._first_piece = self.text.text
        if self.text.finish_reason is not None:
            return  # the first token ended it: no GEN needed (aclose releases the KV on CTX)
        await self._hand_off()

    async def _hand_off(self) -> None:
        """Send ``generate`` (the prefill's KV handle) to a GEN by its router; a GEN that cannot be
        reached is marked down and another one tried, within the flight's ``max_retries``."""
        front, g, cluster = self.front, self.g, self.front.cluster
        assert self.prefill is not None
        retry = front.cfg.routing.retry_after_s
        while True:
            gen = cluster.pick("gen", exclude=tuple(self._tried_gens))
            if gen is None:
                raise self._last_error or ApiError(503, "no GEN node is up", code="no_node_available",
                                                   retry_after=retry)
            self.gen = self._hold(gen)
            try:
                with anyio.fail_after(front.cfg.routing.connect_timeout_s):
                    self.stream = await control.connect(gen.addr, secret=front.secret)
                await self.stream.send({
                    "op": "generate", "request_id": g.request_id, "prompt_len": int(self.prefill["prompt_len"]),
                    "first_token": int(self.prefill["first_token"]), "max_tokens": g.max_tokens,
                    "kv_peer": self.prefill["kv_peer"], "kv_handle": self.handle,
                    **({"kv_sources": self.prefill["kv_sources"]} if self.prefill.get("kv_sources") else {}),
                    **({"sampling": g.sampling} if g.sampling else {}),
                    **({"logprobs": g.logprobs} if g.logprobs is not None else {}),
                })
                self.sent = True
                return
            except CONTROL_ERRORS as exc:
                self._last_error = ApiError(503, f"GEN {gen.addr} is unreachable: {describe(exc)}",
                                            code="gen_unavailable", retry_after=retry)
                await self._drop_gen(f"generate: {describe(exc)}")
            self._count_retry()

    async def _drop_gen(self, why: str) -> None:
        """The hand-off to ``self.gen`` failed before it took the request (unreachable, or it refused):
        it is marked down and excluded from this flight's next pick; the KV is still the CTX's."""
        gen = self.gen
        assert gen is not None
        self.front.cluster.mark_down(gen, why)
        if self.stream is not None:
            with contextlib.suppress(*CONTROL_ERRORS):
                await self.stream.aclose()
            self.stream = None
        self.sent = False
        self._let_go(gen)
        self.gen = None
        self._tried_gens.append(gen)

    def _count_retry(self) -> None:
        """One more try on another GEN, or ``_last_error`` when the flight has had ``max_retries``."""
        assert self._last_error is not None
        if self.retries >= self.front.cfg.max_retries:
            raise self._last_error
        self.retries += 1
        self.front.metrics.retries.labels("gen").inc()

    async def _prefill(self, ctx: Node) -> dict[str, Any]:
        """The prefill call on ``ctx``, made so that a cancellation (its client went away) loses
        nothing: the call runs on in the front's task group, and a prefill that answers after its
        caller left has its KV released on the CTX at once (not when the CTX's lease ends)."""
        front, g = self.front, self.g
        box: dict[str, Any] = {}
        done = anyio.Event()
        left = False

        async def call() -> None:
            try:  # its timeout is later than the request's deadline, which the caller keeps: a prefill
                # that answers after the deadline is still seen here, and released
                box["answer"] = await control.call(ctx.addr, {
                    "op": "prefill", "request_id": g.request_id, "prompt_ids": g.prompt_ids, "max_tokens": g.max_tokens,
                    **({"sampling": g.sampling} if g.sampling else {}),
                    **({"logprobs": g.logprobs} if g.logprobs is not None else {}),
                }, secret=front.secret, timeout=front.cfg.routing.request_timeout_s + front.cfg.routing.connect_timeout_s)
            except Exception as exc:
                box["error"] = exc
            finally:
                done.set()
            if left and "answer" in box:  # nobody waits for it any more (the caller saw no answer): give it back
                front.spawn_release(ctx, g.request_id, box["answer"]["kv_handle"])

        front.spawn(call)
        try:
            with anyio.fail_after(self._left_s()):
                try:
                    await done.wait()
                except anyio.get_cancelled_exc_class():  # the client went away, or the deadline passed
                    left = True
                    if "answer" in box:  # it answered as the caller was cancelled: released here, once
                        front.spawn_release(ctx, g.request_id, box["answer"]["kv_handle"])
                    raise
        except TimeoutError:  # the request's time is up, not the CTX's fault: nothing marked down
            raise self._timed_out() from None
        if "error" in box:
            raise box["error"]
        return box["answer"]  # type: ignore[no-any-return]

    def _left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @staticmethod
    def _timed_out() -> ApiError:
        return ApiError(504, "the request timed out", code="timeout", type="server_error")

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) as they come, the first token's first; ends with ``text.finish_reason`` set
        (or ``error`` set: a failure after the start)."""
        yield self._first_piece, list(self.text.token_ids)
        if self.stream is None:
            return
        last: float | None = None  # the first GEN message's wait is the KV transfer, not an inter-token gap
        got_gen = False  # a message from the GEN that took the request
        itl = self.front.metrics.itl
        while self.text.finish_reason is None:
            try:
                with anyio.fail_after(self._left_s()), self.front.stoppable() as stop:
                    msg = await self.stream.receive()
            except TimeoutError:
                self.error = self._timed_out()
                return
            except CONTROL_ERRORS as exc:
                assert self.gen is not None
                if self._closed:  # closed from another task (its client went away): not a GEN failure
                    return
                # the failure itself marks the GEN down: /health and routing see it now, not at the next poll
                self.front.cluster.mark_down(self.gen, f"generate stream: {describe(exc)}")
                self.error = ApiError(503, f"GEN {self.gen.addr} went away mid-request: {describe(exc)}",
                                      code="gen_unavailable", retry_after=self.front.cfg.routing.retry_after_s)
                return
            if stop.cancelled_caught:  # the front is stopping: aclose aborts it on GEN
                self.error = self.front.stopping
                return
            if msg.get("ok") is False:
                assert self.gen is not None
                if not got_gen and msg.get("code") in REQUEST_REFUSALS:  # about the request, not the node:
                    # every GEN would refuse it; nothing is marked down, nothing retried, the client is told
                    self.error = request_refused(f"GEN {self.gen.addr}", msg["code"], msg.get("error"))
                    return
                refused = ApiError(503, f"GEN {self.gen.addr} refused the request: {msg.get('error')}",
                                   code="gen_refused", retry_after=self.front.cfg.routing.retry_after_s)
                if got_gen:  # it had taken the request: its tokens may have gone out
                    self.error = refused
                    return
                # a refusal before any output is a hand-off that failed: GEN touched nothing, so the
                # CTX still holds the KV for another GEN (aclose releases it if none takes it)
                self._last_error = refused
                await self._drop_gen(f"refused generate: {str(msg.get('error'))[:200]}")
                try:
                    self._count_retry()
                    await self._hand_off()
                except ApiError as exc:
                    self.error = exc
                    return
                continue
            got_gen = True
            tokens = msg.get("tokens")
            if tokens:
                now = time.perf_counter()
                if last is not None:
                    itl.observe(now - last)
                last = now
                before = len(self.text.token_ids)
                lps = msg.get("logprobs") or []
                self.logprobs += [lps[i] if i < len(lps) else None for i in range(len(tokens))]
                piece = self.text.feed([int(t) for t in tokens])
                yield piece, self.text.token_ids[before:]
            if msg.get("done"):
                self.gen_state = str(msg.get("state"))
                if self.text.finish_reason is None:
                    if self.gen_state != "finished":
                        self.error = ApiError(503, f"GEN ended the request: {self.gen_state} "
                                              f"({msg.get('failure')}: {msg.get('message')})", code="generation_failed",
                                              retry_after=self.front.cfg.routing.retry_after_s)
                        return
                    yield self.text.end("length"), []  # GEN's own end (max_tokens): flush what is held back

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        front = self.front
        with anyio.CancelScope(shield=True):
            if self.stream is not None:
                with contextlib.suppress(*CONTROL_ERRORS):
                    await self.stream.aclose()  # before "done": GEN aborts it and tells CTX to free its copy
            # GEN frees the CTX's copy (its pull, or its abort when the front closes the stream before
            # "done") only while it is there to: with no generate sent, an ``ideal`` GEN (it pulls
            # nothing), a request GEN ended unfinished, or a GEN that failed (refused, died, timed
            # out: maybe before its pull) it is released here, harmless when GEN pulled it after all
            gen_frees = (self.sent and self.gen is not None and self.gen.mode != "ideal" and self.error is None
                         and self.gen_state in (None, "finished"))
            if self.handle is not None and self.ctx is not None and not gen_frees:
                front.spawn_release(self.ctx, self.g.request_id, self.handle)
        for node in list(self._held):
            self._let_go(node)
        if self.holds_slot:
            front.admission.leave()
        m = front.metrics
        m.running.dec()
        reason = self.text.finish_reason or ("error" if self.error else "abort")
        if self.prefill is not None and self.counted:
            m.finished.labels(reason).inc()
            m.generation_tokens.inc(len(self.text.token_ids))
            if reason in ("stop", "length"):
                m.e2e.observe(time.perf_counter() - self.t0)


class _FlightResponse(StreamingResponse):
    """The SSE stream of a flight; closes the flight however the response ends (even when the client
    went away before the first chunk was asked for)."""

    def __init__(self, flight: Flight) -> None:
        self.flight = flight
        super().__init__(self._events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        f, g = self.flight, self.flight.g
        first = True
        done = 0  # tokens already sent: their logprobs went with them
        try:
            async for piece, ids in f.pieces():
                if piece or first or (g.return_token_ids and ids) or (g.logprobs is not None and ids):
                    lp = _api.logprobs_obj(g, ids, f.logprobs[done:done + len(ids)], f.text.offsets[done:done + len(ids)])
                    yield _api.chunk(g, piece, role=first, token_ids=ids, logprobs=lp)
                done += len(ids)
                first = False
            if f.error is not None:
                yield _api.sse(f.error.body())
            else:
                yield _api.chunk(g, "", finish_reason=f.text.finish_reason)
                if g.include_usage:
                    yield _api.usage_chunk(g, len(f.text.token_ids))
            yield _api.DONE
        finally:
            await f.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = "200"
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            status = "499"  # the client went away (nginx's code for it)
            raise
        finally:
            await self.flight.aclose()
            if self.flight.text.finish_reason is None and status == "200":
                status = "499" if self.flight.error is None else str(self.flight.error.status)
            self.flight.front.metrics.requests.labels(self.flight.endpoint, status).inc()


class _ChoicesResponse(StreamingResponse):
    """The SSE stream of ``n`` > 1 flights (one per choice), their chunks interleaved as they come:
    the flights run in the front's task group and feed a memory stream this response sends from."""

    def __init__(self, front: Front, g: Generation, flights: list[Flight], endpoint: str) -> None:
        self.front, self.g, self.flights, self.endpoint = front, g, flights, endpoint
        self._send, receive = anyio.create_memory_object_stream[bytes](float("inf"))
        super().__init__(receive, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _one(self, i: int, f: Flight, send: Any) -> None:
        g, first, done = self.g, True, 0
        try:
            async with send:
                async for piece, ids in f.pieces():
                    if piece or first or (g.return_token_ids and ids) or (g.logprobs is not None and ids):
                        lp = _api.logprobs_obj(g, ids, f.logprobs[done:done + len(ids)],
                                               f.text.offsets[done:done + len(ids)])
                        await send.send(_api.chunk(g, piece, role=first, token_ids=ids, logprobs=lp, index=i))
                    done += len(ids)
                    first = False
                if f.error is None:
                    await send.send(_api.chunk(g, "", finish_reason=f.text.finish_reason, index=i))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the response stopped reading (the client went away): __call__ aborts every choice

    async def _produce(self) -> None:
        try:
            async with self._send as send:
                async with anyio.create_task_group() as tg:
                    for i, f in enumerate(self.flights):
                        tg.start_soon(self._one, i, f, send.clone())
                error = next((f.error for f in self.flights if f.error is not None), None)
                if error is not None:
                    await send.send(_api.sse(error.body()))
                elif self.g.include_usage:
                    await send.send(_api.usage_chunk(self.g, sum(len(f.text.token_ids) for f in self.flights)))
                await send.send(_api.DONE)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client went away: the response stopped reading
        finally:
            for f in self.flights:
                await f.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = "200"
        self.front.spawn(self._produce)
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            status = "499"
            raise
        finally:
            self.body_iterator.close()  # type: ignore[attr-defined]
            with anyio.CancelScope(shield=True):
                for f in self.flights:  # a client gone: GEN aborts each choice
                    await f.aclose()
            if status == "200" and any(f.text.finish_reason is None for f in self.flights):
                errors = [f.error for f in self.flights if f.error is not None]
                status = str(errors[0].status) if errors else "499"
            self.front.metrics.requests.labels(self.endpoint, status).inc()
