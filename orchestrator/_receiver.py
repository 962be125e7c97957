"""The receive task group: one task per receive, on the event-loop thread.

    execution thread                     event-loop thread (anyio task group)
    submit(job) ──call_soon──────────>  _receive(job):
                                           connect(peer) (endpoint reused)
                                           for each chunk: pull into staging (or straight into the
                                           KV blocks), scatter into the KV blocks
                                           under fail_after(kv_transfer_timeout_ms), in its own cancel scope
                                         then: publish the result (on_result) at once, and only then
                                           talk to the peer again: RELEASE after any failure, in its own task
    cancel(request_id) ──call_soon───>  scope.cancel()  -> Failed(ABORTED), peer told to release

``submit``, ``cancel``, ``release_soon`` and ``hold_soon`` never block and never raise because the
event loop is gone: every job produces exactly one ``ReceiveResult`` whatever happens (success,
failure, timeout, abort, shutdown, the group dying). Its grant is released before the result is
published, so a drained result means the budget is back, with one exception: a receive that the
transport could not withdraw (``Landing`` busy: UCX may still write into the blocks) is published
with its ``landing``; its grant and staging come back, and its KV blocks may be reused, only once
the transport reports that receive over.

Staging is allocated per chunk and chunks never exceed the budget's capacity, so staging memory
stays within the budget (an oversized request is pulled in layer/head chunks). A full-slice chunk
whose KV blocks form one run needs no staging at all: it lands in the blocks directly (the budget
still counts its bytes, as the network window). On CUDA, scatters run on a dedicated transfer
stream and a receive is published once its own event has completed (no device-wide synchronize);
staging buffers stay referenced until then.

Supervision: a task that fails unexpectedly is logged and ends only its own receive. If the group
itself stops without ``close()`` (its event loop cancelled it, or a bug escaped), it records why in
``failure``, logs it once, and every job still in flight or submitted later ends with
``FailureReason.INTERNAL``; the engine then reports itself unhealthy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.abc
import structlog
import torch

from transports import (
    AuthenticationFailed,
    KVLayout,
    KVSlice,
    Landing,
    PeerBusy,
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
from ._clock import REAL_CLOCK, Clock
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
# after these the peer holds nothing we could free (or will not listen): no RELEASE
_NO_RELEASE = (None, FailureReason.UNKNOWN_REQUEST, FailureReason.AUTH_ERROR)
_BUSY_BACKOFF_S = (0.002, 0.1)  # first and largest wait before retrying a pull the peer refused as busy


class StrayCancellation(TransportError):
    """A transport call ended with the backend's cancellation that no scope of its receive caused
    (e.g. it awaited a future its connection layer cancelled): a failure of that receive alone."""


def _stray_cancellation(exc: BaseException) -> bool:
    """Is ``exc`` an asyncio cancellation nobody asked of the current task? (asyncio 3.11+: every
    anyio scope, deadline and task-group cancel counts in ``Task.cancelling()``; trio raises
    ``Cancelled`` only for a scope of its own.)"""
    import asyncio

    if not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop: trio
        return False
    return task is not None and task.cancelling() == 0


def failure_reason(exc: TransportError) -> FailureReason:
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason
    return FailureReason.PEER_ERROR


def shift_heads(kv_slice: KVSlice, by: int) -> KVSlice:
    """``kv_slice`` with its head range moved by ``by`` (model numbering <-> a rank's pool numbering)."""
    if not by:
        return kv_slice
    return KVSlice(kv_slice.layer_start, kv_slice.layer_end, kv_slice.head_start + by, kv_slice.head_end + by)


def _distinct_peers(parts: Sequence[ReceivePart]) -> list[ReceivePart]:
    seen: set[str] = set()
    return [p for p in parts if not (p.peer in seen or seen.add(p.peer))]  # type: ignore[func-returns-value]


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
class ReceivePart:
    """One source's share of a receive (fan-in from a tensor-parallel CTX): its peer and handle, the
    chunks it serves (model head numbering) and the model-wide index of its first KV head (the wire
    names heads in the peer's own numbering)."""

    peer: str
    handle: str | None
    chunks: tuple[KVSlice, ...]
    peer_head_start: int = 0
    blocks: tuple[int, ...] | None = None
    """The peer's block ids of the request, when its prefill reply named them (one-sided reads)."""
    epoch: int | None = None
    """The peer store's epoch before it put the request, when named (unpinned READs)."""


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
    handle: str | None = None
    """The KV handle the CTX node issued with the prefill."""
    head_offset: int = 0
    """Model-wide index of the pool's first KV head: chunks name model heads, the pool holds
    ``head_offset`` onwards (tensor parallelism)."""
    release: bool = True
    """With the last chunk, let the peer free its copy (tensor-parallel ranks pull slices of one
    copy and leave the release to the engine, once every rank has its slice)."""
    parts: tuple[ReceivePart, ...] = ()
    """Several sources (fan-in); empty: ``peer`` serves ``chunks`` with ``handle``."""
    parts_at_once: bool = False
    """Pull the parts concurrently (set when their staging together fits the budget), else in turn."""
    kv_blocks: tuple[int, ...] | None = None
    """``peer``'s block ids of the request, when known (see ``ReceivePart.blocks``)."""
    kv_epoch: int | None = None
    """``peer``'s store epoch before it put the request, when known (``ReceivePart.epoch``)."""

    def all_parts(self) -> tuple[ReceivePart, ...]:
        return self.parts or (ReceivePart(self.peer, self.handle, self.chunks, 0, self.kv_blocks, self.kv_epoch),)


class _Scatter:
    """Scatters staged chunks into the pool. CPU: at once. CUDA: on a dedicated transfer stream; the
    staged buffers are kept referenced until ``wait`` has seen the receive's own event complete."""

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self._stream = torch.cuda.Stream(device=pool.device) if pool.is_cuda else None

    def block_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The job's block ids where the scatter reads them: moved to the device once, from pinned memory."""
        if self._stream is None:
            return block_ids
        with torch.cuda.stream(self._stream):
            return block_ids.pin_memory().to(self._pool.device, non_blocking=True)

    def scatter(self, ids: torch.Tensor, staged: torch.Tensor, chunk: KVSlice, keep: list[torch.Tensor]) -> None:
        if self._stream is None:
            scatter(self._pool, ids, staged, chunk)
            return
        with torch.cuda.stream(self._stream):
            scatter(self._pool, ids, staged, chunk)
        keep.append(staged)  # the caching allocator must not hand it out while the stream reads it

    async def wait(self, keep: list[torch.Tensor]) -> None:
        """Until every scatter this receive queued has run (its own event; nothing device-wide)."""
        if self._stream is None or not keep:
            return
        event = torch.cuda.Event()
        event.record(self._stream)
        delay = 50e-6
        while not event.query():
            await anyio.sleep(delay)
            delay = min(delay * 2, 2e-3)
        keep.clear()


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
        release_backstop_s: float = 30.0,
    ) -> None:
        self._transport = transport
        self._pool = pool
        self._layout = layout
        self._timeout_s = timeout_s
        # A release or hold is bounded by the transport's own timeouts (its connect, its answer):
        # a bound of the group's own, tighter than those, cut the releases that waited on a slow first
        # connect to a peer, silently, and left their copies held until the peer's lease ended. The
        # group's bounds are a backstop while it runs, and the grace a release gets once it stops.
        self._release_timeout_s = release_timeout_s
        self._release_backstop_s = release_backstop_s
        self._on_result = on_result
        self._on_received = on_received
        self._scatter = _Scatter(pool)
        self._lock = threading.Lock()
        # -- under _lock --
        self._call: Callable[[Callable[[], object]], None] | None = None
        self._state = "new"  # new -> running -> stopped
        self._pending: list[ReceiveJob] = []  # submitted before run() started
        self._cancel_early: set[str] = set()  # cancelled before their task ran
        self._jobs: dict[str, ReceiveJob] = {}  # submitted and not yet finished: in flight
        self._staging_bytes = 0
        self._peak_staging_bytes = 0
        self._quarantined = 0  # jobs finished while their landing was still busy
        self._closing = False  # close() was called: a stop now is a shutdown, not a death
        self.failure: str | None = None
        """Why the group stopped serving, when it died (not set by a normal ``close()``)."""
        self.cancelled = False
        """It stopped because its owner's scope was cancelled (a node shutting down), not on an error."""
        # -- event-loop thread only --
        self._tg: anyio.abc.TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._release_scopes: set[anyio.CancelScope] = set()  # releases in flight (shielded)
        self._winding_down = False  # run() is stopping: releases in flight get the grace

    # -- any thread ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        with self._lock:
            return self._call is not None

    def submit(self, job: ReceiveJob) -> None:
        """Start receiving ``job`` (never blocks; never raises for a stopped group: the job then
        ends at once with a failure result)."""
        with self._lock:
            if job.request_id in self._jobs:
                raise ValueError(f"a receive for {job.request_id!r} is already in flight")
            self._jobs[job.request_id] = job
            call, state = self._call, self._state
            if call is None and state == "new":
                self._pending.append(job)
                return
        if call is None:  # stopped: nobody will run it
            self._finish(job, self._result(job, 0, 0.0, *self._stopped_reason()))
            return
        call(lambda: self._start(job))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            call = self._call
            if call is None:
                self._cancel_early.add(request_id)  # pending jobs see it when they start
                return
        call(lambda: self._cancel(request_id))

    def release_soon(self, peer: str, request_id: str, handle: str | None = None) -> None:
        """Tell ``peer`` to free its copy of ``request_id`` (best effort, bounded, never blocks)."""
        self._spawn_soon(self._release, peer, request_id, handle)

    def hold_soon(self, peer: str, items: Sequence[tuple[str, str | None]]) -> None:
        """Ask ``peer`` to renew the leases of requests waiting here (best effort, never blocks)."""
        self._spawn_soon(self._hold, peer, list(items))

    def call_soon(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on the event loop; False (and nothing runs) when the group is not running."""
        with self._lock:
            call = self._call
        if call is None:
            return False
        call(fn)
        return True

    def connect_blocking(self, peer: str, timeout: float, *, clock: Clock = REAL_CLOCK) -> None:
        """Connect from a non-loop thread and wait for it, up to ``timeout`` s of ``clock`` (only the
        ``inline`` baseline does this). A failed connect is not raised: the receive itself fails and reports.
        A peer already connected costs no turn of the event loop (the waits the public case names
        are the staging reservations', not connections): only a new peer is waited for."""
        connected = getattr(self._transport, "connected", None)  # a transport that predates it: always asked
        if connected is not None and connected(peer):
            return
        done = clock.event()

        async def connect() -> None:
            try:
                with anyio.fail_after(timeout):
                    await self._transport.connect(peer)
            except Exception:
                pass  # the receive itself will fail and report
            finally:
                done.set()

        if not self.call_soon(lambda: self._spawn(connect)):
            return
        done.wait(timeout + 1.0)

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

    @property
    def quarantined(self) -> int:
        """Receives that ended while the transport could still write into their buffers."""
        with self._lock:
            return self._quarantined

    def close(self) -> None:
        """Stop ``run``: in-flight receives end as ABORTED. Safe to call from any thread."""
        with self._lock:
            call, stop = self._call, self._stop
            self._closing = True
            if self._state == "new":
                self._state = "stopped"
        if call is not None and stop is not None:
            call(stop.set)

    def _stopped_reason(self) -> tuple[FailureReason, str]:
        if self.failure is not None:
            return FailureReason.INTERNAL, f"receive group stopped: {self.failure}"
        if not self._closing:  # stopping, but nobody asked it to: it is dying
            return FailureReason.INTERNAL, "receive group stopped: cancelled from outside"
        return FailureReason.ABORTED, "shutting down"

    def _spawn_soon(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        if not self.call_soon(lambda: self._spawn(fn, *args)):
            log.debug("receive_group_not_running", dropped=getattr(fn, "__name__", str(fn)))

    # -- event-loop thread ----------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the group until ``close()`` (or cancellation). Every receive ends before this returns."""
        self._stop = anyio.Event()
        with self._lock:
            if self._state != "new":
                raise RuntimeError("a ReceiveGroup runs once")
            self._state = "running"
        closed = False
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                with self._lock:
                    self._call = loop_caller()
                    pending, self._pending = self._pending, []
                for job in pending:
                    self._start(job)
                task_status.started()
                try:
                    await self._stop.wait()
                    closed = True
                finally:  # closed or cancelled: a release in flight gets its grace, no longer
                    self._winding_down = True
                    grace = anyio.current_time() + self._release_timeout_s
                    for scope in self._release_scopes:
                        scope.deadline = min(scope.deadline, grace)
                tg.cancel_scope.cancel()
        except BaseException as exc:
            self._died(exc)
            if not isinstance(exc, Exception):
                raise  # cancellation and interpreter exits propagate
        finally:
            if not closed and self.failure is None:
                self._died(None)
            with self._lock:
                self._call = None
                self._state = "stopped"
                self._tg = None
                leftover = list(self._jobs.values())
            reason, message = self._stopped_reason()
            for job in leftover:  # submitted, but the loop stopped before their task ended
                self._finish(job, self._result(job, 0, 0.0, reason, message))

    def _died(self, exc: BaseException | None) -> None:
        if self.failure is not None:
            return
        if not isinstance(exc, Exception):  # cancelled (or the interpreter exiting): its owner is stopping
            self.cancelled = True
            self.failure = "cancelled from outside"
            log.info("receive_group_stopped", reason=self.failure)
            return
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error("receive_group_failed", reason=self.failure, exc_info=exc)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        if self._tg is not None:
            self._tg.start_soon(self._guarded, fn, *args, name=getattr(fn, "__name__", None))

    async def _guarded(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """A helper task's unexpected exception is logged; it never takes the group down."""
        try:
            await fn(*args)
        except Exception:
            log.exception("receive_task_crashed", task=getattr(fn, "__name__", str(fn)))

    def _start(self, job: ReceiveJob) -> None:
        if self._tg is None:  # closing: the job still reports, and its grant comes back
            self._finish(job, self._result(job, 0, 0.0, *self._stopped_reason()))
            return
        self._tg.start_soon(self._receive, job, name=f"receive:{job.request_id}")

    def _cancel(self, request_id: str) -> None:
        scope = self._scopes.get(request_id)
        if scope is not None:
            scope.cancel()
        else:
            with self._lock:
                if request_id in self._jobs:
                    self._cancel_early.add(request_id)

    async def _release(self, peer: str, request_id: str, handle: str | None) -> None:
        bound = self._release_timeout_s if self._winding_down else self._release_backstop_s  # one spawned as it stops
        with anyio.move_on_after(bound, shield=True) as scope:
            self._release_scopes.add(scope)
            try:
                await self._transport.release(peer, request_id, handle=handle)
            except Exception as exc:  # best effort: a failed release is logged, never raised
                log.info("release_not_delivered", request_id=request_id, peer=peer, error=f"{type(exc).__name__}: {exc}")
            finally:
                self._release_scopes.discard(scope)
        if scope.cancelled_caught:  # the peer's lease frees the copy
            log.warning("release_not_delivered", request_id=request_id, peer=peer,
                        error="still unanswered when the receive group stopped" if self._winding_down
                        else f"still unanswered after {self._release_backstop_s:g} s")

    async def _hold(self, peer: str, items: list[tuple[str, str | None]]) -> None:
        with anyio.move_on_after(self._release_backstop_s) as scope:  # a stop cancels it at once
            try:
                await self._transport.hold(peer, items)
            except Exception as exc:
                log.info("hold_not_delivered", peer=peer, requests=len(items), error=f"{type(exc).__name__}: {exc}")
        if scope.cancelled_caught:
            log.warning("hold_not_delivered", peer=peer, requests=len(items),
                        error=f"still unanswered after {self._release_backstop_s:g} s")

    async def _receive(self, job: ReceiveJob) -> None:
        started = time.perf_counter()
        moved = 0
        result: ReceiveResult | None = None
        rid, peer = job.request_id, job.peer
        landing = Landing()
        box = [0]  # bytes moved by finished pulls (of every part)
        timed_out = False  # a transport's own timeout
        try:
            # one scope for both endings: its deadline (from the start of this receive) and a cancel
            deadline = anyio.current_time() + self._timeout_s
            with anyio.CancelScope(deadline=deadline) as scope:
                self._scopes[rid] = scope
                with self._lock:
                    if rid in self._cancel_early:
                        self._cancel_early.discard(rid)
                        scope.cancel()
                try:
                    ids = self._scatter.block_ids(job.block_ids)
                    keep: list[torch.Tensor] = []
                    parts = job.all_parts()
                    if len(parts) > 1 and job.parts_at_once:
                        await self._receive_parts(job, parts, ids, landing, keep, box)
                    else:
                        for part in parts:
                            await self._receive_part(job, part, ids, landing, keep, box)
                    await self._scatter.wait(keep)
                    if self._on_received is not None:  # e.g. checksums, before decode writes
                        self._on_received(rid, job.block_ids)
                    moved = box[0]
                    result = ReceiveResult(rid, peer, moved, time.perf_counter() - started)
                except TimeoutError:  # a transport's own timeout: told below, as the scope's deadline is
                    timed_out = True
                except StrayCancellation as exc:
                    if scope.cancel_called:  # our own cancel came at the same time: it decides
                        timed_out = anyio.current_time() >= deadline
                    else:
                        moved = box[0]  # (_failed logs the one warning)
                        result = self._failed(job, moved, started, FailureReason.PEER_ERROR, str(exc))
                except TransportError as exc:
                    moved = box[0]
                    result = self._failed(job, moved + exc.bytes_moved, started, failure_reason(exc), str(exc))
                except Exception as exc:
                    moved = box[0]
                    log.exception("receive_crashed", request_id=rid, peer=peer)
                    result = self._failed(job, moved, started, FailureReason.INTERNAL, repr(exc))
            if result is None and (timed_out or (scope.cancelled_caught and anyio.current_time() >= deadline)):
                moved = box[0]
                result = self._failed(job, moved, started, FailureReason.TIMEOUT, f"no KV within {self._timeout_s:.3f} s")
            elif result is None:
                result = self._failed(job, moved, started, FailureReason.ABORTED, "aborted")
        finally:
            self._scopes.pop(rid, None)
            if result is None:  # cancelled from outside (shutdown, or the group dying) before a result
                result = self._failed(job, moved, started, *self._stopped_reason())
            self._finish(job, result, landing)  # first: the execution thread learns of it now
            if job.release and result.failure not in _NO_RELEASE:  # then the peer may free its copy, also
                # when the cancellation goes on from here (the group closing): _release is shielded, bounded
                peers = _distinct_peers(job.all_parts())
                if len(peers) == 1:  # here: this task has published its result already (no task of its own)
                    await self._release(peers[0].peer, rid, peers[0].handle)
                else:  # side by side: a slow peer does not hold up the others' releases
                    for part in peers:
                        self._spawn(self._release, part.peer, rid, part.handle)

    async def _receive_part(self, job: ReceiveJob, part: ReceivePart, ids: torch.Tensor, landing: Landing,
                            keep: list[torch.Tensor], box: list[int]) -> None:
        try:
            await self._transport.connect(part.peer)
            for i, chunk in enumerate(part.chunks):
                box[0] += await self._pull_chunk(job, part, ids, chunk, landing, keep, last=i == len(part.chunks) - 1)
        except BaseException as exc:  # a cancellation no scope of ours caused would kill the whole group
            if _stray_cancellation(exc):
                raise StrayCancellation(f"the transport's call to {part.peer} was cancelled by something other "
                                        f"than this receive ({type(exc).__name__}: {exc})") from exc
            raise

    async def _receive_parts(self, job: ReceiveJob, parts: tuple[ReceivePart, ...], ids: torch.Tensor,
                             landing: Landing, keep: list[torch.Tensor], box: list[int]) -> None:
        """Fan-in: every source's part at once; the first failure cancels the others and is raised."""
        errors: list[Exception] = []
        async with anyio.create_task_group() as tg:

            async def one(part: ReceivePart) -> None:
                try:
                    await self._receive_part(job, part, ids, landing, keep, box)
                except Exception as exc:
                    if not errors:
                        errors.append(exc)
                    tg.cancel_scope.cancel()

            for part in parts:
                tg.start_soon(one, part)
        if errors:
            raise errors[0]

    async def _pull_chunk(
        self, job: ReceiveJob, part: ReceivePart, ids: torch.Tensor, chunk: KVSlice, landing: Landing,
        keep: list[torch.Tensor], *, last: bool,
    ) -> int:
        dest = shift_heads(chunk, -job.head_offset)  # where the chunk goes in this pool
        if job.staging is None:
            direct = whole_run_view(self._pool, job.block_ids, dest)
            if direct is not None:  # the blocks are one run: land in them, no staging, no scatter
                return await self._pull(job, part, chunk, direct, landing, last=last)
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
            moved = await self._pull(job, part, chunk, staging, landing, last=last)
            self._scatter.scatter(ids, staging, dest, keep)
            return moved
        finally:
            # a receive the transport could not withdraw keeps the buffer (and counts it) until it ends
            landing.when_idle(lambda: self._unstage(nbytes, staging))

    def _unstage(self, nbytes: int, _staging: torch.Tensor) -> None:
        with self._lock:
            self._staging_bytes -= nbytes

    async def _pull(self, job: ReceiveJob, part: ReceivePart, chunk: KVSlice, into: torch.Tensor, landing: Landing,
                    *, last: bool) -> int:
        # with release (the last chunk), the peer frees its copy once this pull succeeded.
        # A peer that is busy now refuses before sending anything: retry until the deadline.
        wire_slice = shift_heads(chunk, -part.peer_head_start)  # the heads as the peer numbers them
        # the peer's block ids only when known: a transport that predates them need not take the keyword
        named = {} if part.blocks is None else {"remote_blocks": part.blocks}
        if part.blocks is not None and part.epoch is not None:
            named["remote_epoch"] = part.epoch
        backoff = _BUSY_BACKOFF_S[0]
        while True:
            try:
                return await self._transport.pull(
                    part.peer, job.request_id, wire_slice, into, handle=part.handle, release=last and job.release,
                    landing=landing, **named)
            except PeerBusy:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _BUSY_BACKOFF_S[1])

    def _result(self, job: ReceiveJob, moved: int, elapsed: float, reason: FailureReason, message: str) -> ReceiveResult:
        return ReceiveResult(job.request_id, job.peer, moved, elapsed, reason, message)

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
        return self._result(job, moved, elapsed, reason, message)

    def _finish(self, job: ReceiveJob, result: ReceiveResult, landing: Landing | None = None) -> None:
        """Publish ``job``'s one result (later calls for the same job do nothing)."""
        with self._lock:
            if self._jobs.get(job.request_id) is not job:
                return
            del self._jobs[job.request_id]
            self._cancel_early.discard(job.request_id)
            quarantined = landing is not None and landing.busy
            if quarantined:
                self._quarantined += 1
        if quarantined:
            assert landing is not None
            log.warning("receive_quarantined", request_id=job.request_id, peer=job.peer)
            result = dataclasses.replace(result, landing=landing)
            landing.when_idle(lambda: self._unquarantine(job))
        elif job.grant is not None:
            job.grant.release()
        try:
            self._on_result(result)
        except Exception:  # the engine's queue put cannot fail; a user callback might
            log.exception("on_result_failed", request_id=job.request_id)

    def _unquarantine(self, job: ReceiveJob) -> None:
        with self._lock:
            self._quarantined -= 1
        if job.grant is not None:
            job.grant.release()
