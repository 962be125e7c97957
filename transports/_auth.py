"""Shared-secret mutual authentication (HMAC-SHA256 challenge/response) for a UCX endpoint.

Handshake, before any other message is served on an endpoint::

    CTX (server)                                GEN (client)
    AUTH_CHALLENGE(ns, auth_required) ->
                                             <- AUTH_RESPONSE(nc, client_mac(secret, ns, nc))
    checks client_mac; AUTH_OK(server_mac(secret, ns, nc, info), info) ->  (or AUTH_FAIL, then closes)
                                                checks server_mac (the server knows it too)

Both MACs cover both nonces and a role label, so neither can be replayed as the other; the
server's also covers what it tells about itself (its KV layout and limits), so that cannot be
altered on the way. The secret
comes from the environment (``KVO_SHARED_SECRET``) or a file, never from a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from .wire import MAC_BYTES, NONCE_BYTES

SECRET_ENV = "KVO_SHARED_SECRET"
MIN_SECRET_BYTES = 16

_CLIENT_LABEL = b"kvo-v1-client"
_SERVER_LABEL = b"kvo-v1-server"


def load_secret(env: str | None = SECRET_ENV, path: str | os.PathLike[str] | None = None) -> bytes | None:
    """The shared secret from file ``path`` if given, else from environment variable ``env``.

    Returns None when neither is set. Raises ``ValueError`` for a secret shorter than 16 bytes
    (surrounding whitespace is stripped) and ``OSError`` when ``path`` cannot be read.
    """
    raw: bytes | None = None
    if path is not None:
        raw = Path(path).read_bytes().strip()
    elif env is not None and os.environ.get(env):
        raw = os.environ[env].strip().encode()
    if raw is None:
        return None
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"shared secret must be at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
    return raw


def check_config_secret(what: str, secret: bytes | None, allow_insecure: bool) -> None:
    """A transport config needs a secret of at least ``MIN_SECRET_BYTES``, or ``allow_insecure``."""
    if secret is None and not allow_insecure:
        raise ValueError(f"{what} needs a shared secret (transports._auth.load_secret(), env {SECRET_ENV}) "
                         "or allow_insecure=True")
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"shared secret must be at least {MIN_SECRET_BYTES} bytes")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, _CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def server_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes, info: bytes = b"") -> bytes:
    return hmac.new(secret, _SERVER_LABEL + server_nonce + client_nonce + info, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return len(got) == MAC_BYTES and hmac.compare_digest(expected, got)
