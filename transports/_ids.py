"""The one request-id rule, and the per-request handles a CTX node issues.

A request id is 1..128 characters of ``[A-Za-z0-9._:-]`` (ASCII only). The rule is checked once at
every edge where an id enters the system (prefill, submit, the control plane) and again by the wire
decoder, so an id that a peer could not carry is refused before anything is allocated for it.

A KV handle is an unguessable token (128 random bits, 32 lowercase hex characters) that a CTX node
issues with each prefill; a GEN node must present it to pull or release that request's KV, so
knowing a request id is not enough to read or free someone else's KV.
"""

from __future__ import annotations

import re
import secrets

MAX_REQUEST_ID_LEN = 128
REQUEST_ID_CHARS = "A-Za-z0-9._:-"
HANDLE_LEN = 32

_REQUEST_ID_RE = re.compile(rf"[{REQUEST_ID_CHARS}]{{1,{MAX_REQUEST_ID_LEN}}}")
_HANDLE_RE = re.compile(rf"[0-9a-f]{{{HANDLE_LEN}}}")


class InvalidRequestId(ValueError):
    """A request id or KV handle that breaks the rule."""


def check_request_id(request_id: object) -> str:
    """``request_id`` if it follows the rule; raises ``InvalidRequestId`` with a clear reason."""
    if not isinstance(request_id, str):
        raise InvalidRequestId(f"request id must be a string, got {type(request_id).__name__}")
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestId(f"request id must be 1..{MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise InvalidRequestId(f"request id {request_id[:40]!r} has characters outside [{REQUEST_ID_CHARS}]")
    return request_id


def new_handle() -> str:
    return secrets.token_hex(HANDLE_LEN // 2)


def check_handle(handle: object) -> str:
    if not isinstance(handle, str) or not _HANDLE_RE.fullmatch(handle):
        raise InvalidRequestId(f"KV handle must be {HANDLE_LEN} lowercase hex characters")
    return handle
