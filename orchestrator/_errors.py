"""The orchestrator's exceptions, in one flat hierarchy."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class."""


class WouldBlock(OrchestratorError):
    """A non-blocking acquire could not be granted now (or a blocking one timed out)."""


class KVExhausted(OrchestratorError):
    """The KV block pool has too few free blocks for the allocation."""


class InvalidRequest(OrchestratorError, ValueError):
    """A submitted request is malformed or exceeds the configured limits."""


class ContextTooLong(InvalidRequest):
    """A submitted request's prompt + ``max_tokens`` exceeds ``max_model_len`` or needs more KV blocks
    than the pool has: no engine of this configuration can serve it (a front answers 400, tries none other)."""


class NotRunning(OrchestratorError, RuntimeError):
    """The receive group is not running on an event loop (not started, or stopped)."""


class Unavailable(OrchestratorError, RuntimeError):
    """The engine cannot take requests: its receive group or decode loop has died (see ``health()``)."""
