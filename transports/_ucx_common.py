"""What both ends of the UCX data plane share (``transports.ucx`` GEN side, ``transports._ucx_server``
CTX side): settings, the ucxx context's ownership, and posting tag messages without a task each.

A posted operation is a ucxx request whose Python future (``UCXPY_ENABLE_PYTHON_FUTURE``) ends when
UCX ends it; ``post_send``/``post_recv`` hash the tag with the endpoint's own tag exactly as
``ucxx.Endpoint.send``/``recv`` do, so both APIs can be mixed on one endpoint.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import structlog
import torch

from . import _auth, wire

log = structlog.get_logger("transports.ucx")

CONTROL_TAG = 0
_INLINE_GATHER_BYTES = 1 << 20  # CTX: gathers up to this size run on the event loop

# Chosen from measurements on one host (docs/transport.md): put_zcopy rendezvous instead of the
# tcp default; shared memory and cma zero-copy stay enabled with peer-failure detection on; the
# `thread` progress mode with Python futures is the only one that leaves a core idle at rest.
UCX_DEFAULTS: dict[str, str] = {
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_CMA_SEG_SIZE": "4M",
    "UCX_TCP_CM_REUSEADDR": "y",  # a restarted CTX can listen on its old port at once
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 warns about
}


def apply_ucx_defaults(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``UCX_DEFAULTS`` (and ``extra``) where the environment does not; returns what is in effect.

    Must run before ucxx creates its context (the first endpoint or listener of the process).
    """
    for key, value in {**UCX_DEFAULTS, **(extra or {})}.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in {**UCX_DEFAULTS, **(extra or {})}}


# -- ucxx context ownership: the last owner in a process resets ucxx (stops its notifier thread) --

_owners = 0
_owners_lock = threading.Lock()


def _ucx_acquire() -> Any:
    global _owners
    import ucxx

    with _owners_lock:
        _owners += 1
    return ucxx


def _wake_notifier(ucxx: Any) -> None:
    """Let ucxx's notifier thread see its shutdown now. ``reset()`` queues "shutdown" and joins the
    thread, which reads its queue only when its wait for requests ends: 1 s at most, 0.5 s on
    average, on every node's stop (and every test's transport). The worker's own
    ``stop_request_notifier_thread()`` ends that wait at once."""
    ctx = getattr(getattr(ucxx, "core", None), "_ctx", None)  # ucxx keeps its context there
    if ctx is None or getattr(ctx, "notifier_thread", None) is None:
        return
    try:
        ctx.worker.stop_request_notifier_thread()
    except Exception as exc:  # an older ucxx: reset() still stops it, a second later
        log.debug("ucx_notifier_not_woken", reason=repr(exc))


def _ucx_release() -> None:
    global _owners
    with _owners_lock:
        _owners -= 1
        last = _owners == 0
    if last:
        import ucxx

        _wake_notifier(ucxx)
        try:
            ucxx.reset()
        except Exception as exc:  # references still alive somewhere; the context is freed later
            log.debug("ucx_reset_deferred", reason=repr(exc))


@dataclasses.dataclass(frozen=True)
class UCXConfig:
    """Settings of both ends. ``secret`` is required unless ``allow_insecure`` is set."""

    secret: bytes | None = dataclasses.field(default=None, repr=False)
    allow_insecure: bool = False
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    release_timeout_s: float = 2.0
    cancel_grace_s: float = 2.0  # GEN: a cancelled pull's receive may stay posted this long before the endpoint goes; a pull whose KV did not come waits this long for the PULL_ERR
    dead_peer_backoff_s: float = 1.0  # GEN: after a failed connect, pulls to that peer fail at once this long
    max_peers: int = 256  # GEN: distinct CTX peers with an endpoint (or a connect) at once
    expire_interval_s: float = 1.0  # CTX: lease expiry period
    max_pulls_per_endpoint: int = 256  # CTX: pulls GEN may have in flight on one endpoint (the CTX refuses above twice that)
    max_unauthenticated: int = 64  # CTX: endpoints still in their handshake; more are closed at once
    max_gathers_per_request: int = 4  # CTX: gathered copies of one request being sent at once (more wait)
    summary_interval_s: float = 60.0  # CTX: period of the kv_pulls_summary log line
    # CTX: a KV send not ended this long after it was posted (its GEN stopped, hung or cut off mid-pull,
    # which UCX does not notice) aborts its endpoint: the send ends and its blocks are unpinned (a
    # pinned entry outlives its lease). Keep it above the GEN's kv_transfer_timeout.
    send_timeout_s: float = 120.0
    limits: wire.WireLimits = dataclasses.field(default_factory=wire.WireLimits)
    ucx_env: tuple[tuple[str, str], ...] = ()  # extra UCX defaults, e.g. (("UCX_TLS", "tcp"),)

    def __post_init__(self) -> None:
        _auth.check_config_secret("UCXConfig", self.secret, self.allow_insecure)
        if not 0 < self.send_timeout_s < float("inf"):
            raise ValueError(f"UCXConfig.send_timeout_s must be a positive number of seconds, not {self.send_timeout_s!r}")

    def _warn_if_insecure(self, role: str) -> None:
        if self.secret is None:
            log.warning("ucx_auth_disabled", role=role, reason="allow_insecure=True and no secret")


def _ucx_buffer(t: torch.Tensor) -> Any:
    """A view of a contiguous tensor's bytes that ucxx accepts (buffer protocol or CUDA interface)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def ends_in(buf: Any, probe: int) -> bool:
    """Whether a byte view (``_ucx_buffer``) ends in the byte ``probe`` (CUDA: a one-byte device read)."""
    return len(buf) > 0 and int(buf[-1]) == probe


def _tag(ep: Any, tag: int, key: str) -> Any:
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    return Tag(hash64bits(ep._tags[key], hash(tag)))


def post_send(ep: Any, buf: Any, tag: int) -> Any:
    """Post a tagged send on a ``ucxx`` endpoint now; returns its request (``.future`` ends with it).

    Uses the endpoint's internals (``_ep``, ``_tags``) as ``ucxx.Endpoint.send`` does, minus the
    coroutine: several sends can be in flight from one task. The caller keeps ``buf`` (and the
    request) referenced until the request ends: ucxx does not."""
    from ucxx._lib.arr import Array

    return ep._ep.tag_send(Array(buf), _tag(ep, tag, "msg_send"))


def post_recv(ep: Any, buf: Any, tag: int) -> Any:
    """Post a tagged receive into ``buf`` now; returns its request (see ``post_send``)."""
    from ucxx._lib.arr import Array
    from ucxx.types import TagMaskFull

    return ep._ep.tag_recv(Array(buf), _tag(ep, tag, "msg_recv"), TagMaskFull)


def ucx_truncated() -> type[BaseException]:
    """ucxx's error for a message longer than the buffer posted for it (the endpoint stays usable)."""
    from ucxx.exceptions import UCXMessageTruncatedError

    return UCXMessageTruncatedError
