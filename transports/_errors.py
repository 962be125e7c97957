"""One flat hierarchy for everything a transport can report; backend errors are mapped here."""

from __future__ import annotations


class TransportError(Exception):
    """Base of every transport failure. ``peer`` names the remote end when known."""

    def __init__(self, message: str, *, peer: str | None = None, bytes_moved: int = 0) -> None:
        super().__init__(message)
        self.peer = peer
        self.bytes_moved = bytes_moved


class PeerUnreachable(TransportError):
    """Connecting to the peer failed or timed out."""


class PeerClosed(TransportError):
    """The connection to the peer broke or was closed while a transfer was using it."""


class UnknownRequest(TransportError):
    """The peer holds no KV for that request id (never had it, released it, or its lease expired)."""


class ProtocolViolation(TransportError):
    """A message broke the wire protocol: bad header, version, length, dtype, shape or range."""


class AuthenticationFailed(TransportError):
    """The peer did not prove it holds the shared secret (or we could not)."""


class PeerBusy(TransportError):
    """The peer refused for now (too many pulls in flight, or this request is being sent): retry."""


class IncompatiblePeer(ProtocolViolation):
    """The peer serves KV of another layout (model, block size, dtype or heads) than this node's."""
