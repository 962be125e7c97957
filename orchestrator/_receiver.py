"""The receive task group: one task per receive, on the event-loop thread.

    execution thread                     event-loop thread (anyio task group)
    submit(job) ──call_soon──────────>  _receive(job):
                                           connect(peer) (endpoint reused)
                                           for each chunk: pull into staging, scatter into KV blocks
                                           under fail_after(kv_transfer_timeout_ms), in its own cancel scope
                                         finally: grant.release(); on_result(ReceiveResult)
    cancel(request_id) ──call_soon───>  scope.cancel()  -> Failed(ABORTED), peer told to release

``submit`` and ``cancel`` never block and may be called from any thread. Every job produces
exactly one ``ReceiveResult``, whatever happens (success, failure, timeout, abort, shutdown), and
its grant is released before the result is published, so a drained result means the budget is back.
Staging is allocated per chunk and chunks never exceed the budget's capacity, so staging memory
stays within the budget (an oversized request is pulled in layer/head chunks). A full-slice chunk
whose KV blocks form one run needs no staging at all: it lands in the blocks directly (the budget
still counts its bytes, as the network window).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

import anyio
import structlog
import torch

from transports import (
    AuthenticationFailed,
    KVLayout,
    KVSlice,
    PeerClosed,
    PeerUnreachable,
    ProtocolViolation,
    Transport,
    TransportError,
    UnknownRequest,
    scatter,
    whole_run_view,
)

from ._budget import Grant
from ._errors import NotRunning
from ._requests import FailureReason, ReceiveResult
from ._threads import loop_caller

log = structlog.get_logger("orchestrator.receiver")

_REASONS: list[tuple[type[TransportError], FailureReason]] = [
    (UnknownRequest, FailureReason.UNKNOWN_REQUEST),
    (ProtocolViolation, FailureReason.PROTOCOL_ERROR),
    (AuthenticationFailed, FailureReason.AUTH_ERROR),
    (PeerClosed, FailureReason.PEER_ERROR),
    (PeerUnreachable, FailureReason.PEER_ERROR),
]


def failure_reason(exc: TransportError) -> FailureReason:
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason
    return FailureReason.PEER_ERROR


def plan_chunks(layout: KVLayout, num_blocks: int, kv_slice: KVSlice, capacity: int) -> tuple[KVSlice, ...]:
    """Split a pull so that no chunk's staging exceeds ``capacity`` bytes (layers first, then heads).

    Raises ValueError when even one layer of one head does not fit.
    """
    if layout.wire_bytes(num_blocks, kv_slice) <= capacity:
        return (kv_slice,)
    one_layer = KVSlice(0, 1, kv_slice.head_start, kv_slice.head_end)
    per_layer = layout.wire_bytes(num_blocks, one_layer)
    if per_layer <= capacity:
        step = capacity // per_layer
        return tuple(
            KVSlice(lo, min(lo + step, kv_slice.layer_end), kv_slice.head_start, kv_slice.head_end)
            for lo in range(kv_slice.layer_start, kv_slice.layer_end, step)
        )
    per_head = layout.wire_bytes(num_blocks, KVSlice(0, 1, 0, 1))
    if per_head > capacity:
        raise ValueError(
            f"one layer of one head of this request needs {per_head} staging bytes, budget is {capacity}"
        )
    step = capacity // per_head
    return tuple(
        KVSlice(layer, layer + 1, lo, min(lo + step, kv_slice.head_end))
        for layer in range(kv_slice.layer_start, kv_slice.layer_end)
        for lo in range(kv_slice.head_start, kv_slice.head_end, step)
    )


@dataclasses.dataclass(frozen=True)
class ReceiveJob:
    request_id: str
    peer: str
    block_ids: torch.Tensor
    """The prompt's blocks in the GEN pool, in order."""
    chunks: tuple[KVSlice, ...]
    grant: Grant | None
    staging: torch.Tensor | None = None
    """A buffer set up by the caller (the inline fallback); otherwise staging is allocated per chunk."""


class ReceiveGroup:
    def __init__(
        self,
        transport: Transport,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        timeout_s: float,
        on_result: Callable[[ReceiveResult], None],
        on_received: Callable[[str, torch.Tensor], None] | None = None,
        release_timeout_s: float = 1.0,
    ) -> None:
        self._transport = transport
        self._pool = pool
        self._layout = layout
        self._timeout_s = timeout_s
        self._release_timeout_s = release_timeout_s
        self._on_result = on_result
        self._on_received = on_received
        self._call: Callable[[Callable[[], object]], None] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._not_started: set[str] = set()  # scheduled on the loop, task not yet running
        self._cancel_early: set[str] = set()  # of those, the ones already cancelled
        self._lock = threading.Lock()
        self._jobs: dict[str, ReceiveJob] = {}  # submitted and not yet finished: in flight
        self._staging_bytes = 0
        self._peak_staging_bytes = 0
        self.failure: str | None = None
        """Why the group stopped serving, when it died (not set by a normal ``close()``)."""

    # -- any thread ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._call is not None

    def submit(self, job: ReceiveJob) -> None:
        with self._lock:
            call = self._require_call()
            if job.request_id in self._jobs:
                raise ValueError(f"a receive for {job.request_id!r} is already in flight")
            self._jobs[job.request_id] = job
        call(lambda: self._start(job))

    def cancel(self, request_id: str) -> None:
        self._require_call()(lambda: self._cancel(request_id))

    def release_soon(self, peer: str, request_id: str) -> None:
        """Tell ``peer`` to free its copy of ``request_id`` (best effort, bounded, never blocks)."""
        self.call_soon(lambda: self._tg.start_soon(self._release, peer, request_id) if self._tg else None)  # type: ignore[func-returns-value]

    async def _release(self, peer: str, request_id: str) -> None:
        with anyio.move_on_after(self._release_timeout_s, shield=True):
            try:
                await self._transport.release(peer, request_id)
            except TransportError as exc:
                log.info("release_not_delivered", request_id=request_id, peer=peer, error=str(exc))

    def call_soon(self, fn: Callable[[], object]) -> None:
        self._require_call()(fn)

    def connect_blocking(self, peer: str, timeout: float) -> None:
        """Connect from a non-loop thread and wait for it (only the ``inline`` baseline does this)."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def connect() -> None:
            try:
                with anyio.fail_after(timeout):
                    await self._transport.connect(peer)
            except BaseException as exc:  # delivered to the waiting thread
                fut.set_exception(exc)
            else:
                fut.set_result(None)

        self.call_soon(lambda: self._tg.start_soon(connect) if self._tg else None)  # type: ignore[func-returns-value]
        try:
            fut.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            pass  # the receive itself will time out and report

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    @property
    def staging_bytes(self) -> int:
        with self._lock:
            return self._staging_bytes

    @property
    def peak_staging_bytes(self) -> int:
        with self._lock:
            return self._peak_staging_bytes

    def close(self) -> None:
        """Stop ``run``: in-flight receives end as ABORTED. Safe to call from any thread."""
        call, stop = self._call, self._stop
        if call is not None and stop is not None:
            call(stop.set)

    def _require_call(self) -> Callable[[Callable[[], object]], None]:
        if self._call is None:
            raise NotRunning("the receive group is not running on an event loop")
        return self._call

    # -- event-loop thread ----------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the group until ``close()`` (or cancellation). Every receive ends before this returns."""
        self._stop = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._call = loop_caller()
                task_status.started()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            with self._lock:
                self._call = None
                self._tg = None
                leftover = list(self._jobs.values())
            for job in leftover:  # submitted, but the loop stopped before their task ran
                self._finish(job, ReceiveResult(job.request_id, job.peer, 0, 0.0, FailureReason.ABORTED, "shutting down"))

    def _start(self, job: ReceiveJob) -> None:
        if self._tg is None:  # closing: the job still reports, and its grant comes back
            self._finish(job, ReceiveResult(job.request_id, job.peer, 0, 0.0, FailureReason.ABORTED, "shutting down"))
            return
        self._not_started.add(job.request_id)
        self._tg.start_soon(self._receive, job, name=f"receive:{job.request_id}")

    def _cancel(self, request_id: str) -> None:
        scope = self._scopes.get(request_id)
        if scope is not None:
            scope.cancel()
        elif request_id in self._not_started:
            self._cancel_early.add(request_id)

    async def _receive(self, job: ReceiveJob) -> None:
        started = time.perf_counter()
        moved = 0
        result: ReceiveResult | None = None
        rid, peer = job.request_id, job.peer
        try:
            with anyio.CancelScope() as scope:
                self._scopes[rid] = scope
                self._not_started.discard(rid)
                if rid in self._cancel_early:
                    self._cancel_early.discard(rid)
                    scope.cancel()
                try:
                    with anyio.fail_after(self._timeout_s):
                        await self._transport.connect(peer)
                        for i, chunk in enumerate(job.chunks):
                            moved += await self._pull_chunk(job, chunk, last=i == len(job.chunks) - 1)
                        if self._pool.is_cuda:
                            await anyio.to_thread.run_sync(torch.cuda.synchronize)
                        if self._on_received is not None:  # e.g. checksums, before decode writes
                            self._on_received(rid, job.block_ids)
                    result = ReceiveResult(rid, peer, moved, time.perf_counter() - started)
                except TimeoutError:
                    result = self._failed(job, moved, started, FailureReason.TIMEOUT, f"no KV within {self._timeout_s:.3f} s")
                except TransportError as exc:
                    result = self._failed(job, moved + exc.bytes_moved, started, failure_reason(exc), str(exc))
                except Exception as exc:
                    log.exception("receive_crashed", request_id=rid, peer=peer)
                    result = self._failed(job, moved, started, FailureReason.INTERNAL, repr(exc))
            if result is None:
                result = self._failed(job, moved, started, FailureReason.ABORTED, "aborted")
            if result.failure in (FailureReason.ABORTED, FailureReason.TIMEOUT):
                await self._release(peer, rid)
        finally:
            self._scopes.pop(rid, None)
            if result is None:  # cancelled from outside (shutdown) before a result was formed
                result = self._failed(job, moved, started, FailureReason.ABORTED, "shutting down")
            self._finish(job, result)

    async def _pull_chunk(self, job: ReceiveJob, chunk: KVSlice, *, last: bool) -> int:
        if job.staging is None:
            direct = whole_run_view(self._pool, job.block_ids, chunk)
            if direct is not None:  # the blocks are one run: land in them, no staging, no scatter
                return await self._pull(job, chunk, direct, last=last)
        shape = self._layout.wire_shape(int(job.block_ids.numel()), chunk)
        if job.staging is not None and len(job.chunks) == 1:
            staging = job.staging
        else:
            staging = torch.empty(shape, dtype=self._layout.dtype, device=self._pool.device)
        nbytes = staging.numel() * staging.element_size()
        with self._lock:
            self._staging_bytes += nbytes
            self._peak_staging_bytes = max(self._peak_staging_bytes, self._staging_bytes)
        try:
            moved = await self._pull(job, chunk, staging, last=last)
            scatter(self._pool, job.block_ids, staging, chunk)
            return moved
        finally:
            with self._lock:
                self._staging_bytes -= nbytes

    async def _pull(self, job: ReceiveJob, chunk: KVSlice, into: torch.Tensor, *, last: bool) -> int:
        # with release (the last chunk), the peer frees its copy once this pull succeeded
        return await self._transport.pull(job.peer, job.request_id, chunk, into, release=last)

    def _failed(
        self, job: ReceiveJob, moved: int, started: float, reason: FailureReason, message: str
    ) -> ReceiveResult:
        elapsed = time.perf_counter() - started
        log.warning(
            "receive_failed",
            request_id=job.request_id,
            peer=job.peer,
            reason=reason.value,
            bytes_moved=moved,
            elapsed_ms=round(elapsed * 1e3, 3),
            message=message,
        )
        return ReceiveResult(job.request_id, job.peer, moved, elapsed, reason, message)

    def _finish(self, job: ReceiveJob, result: ReceiveResult) -> None:
        """Publish ``job``'s one result (later calls for the same job do nothing)."""
        with self._lock:
            if self._jobs.get(job.request_id) is not job:
                return
            del self._jobs[job.request_id]
        if job.grant is not None:
            job.grant.release()
        self._on_result(result)
