"""The one request-id rule, and the per-request handles a CTX node issues.

A request id is 1..128 characters of ``[A-Za-z0-9._:-]`` (ASCII only). The rule is checked once at
every edge where an id enters the system (prefill, submit, the control plane) and again by the wire
decoder, so an id that a peer could not carry is refused before anything is allocated for it.

A KV handle is an unguessable token (128 bits, 32 lowercase hex characters) that a CTX node
issues with each prefill; a GEN node must present it to pull or release that request's KV, so
knowing a request id is not enough to read or free someone else's KV. A store that names its
handles (``KVStore.name_handles``: every CTX node) makes them 32 random bits, the prompt's length
in tokens (32 bits, in the clear) and a 64-bit HMAC of those and the request id under a key from
the nodes' shared secret (``handle_key``): a GEN holding that secret tells, without asking the
CTX, whether a handle is the one issued for that request id (``handle_names``: a NIXL GEN, before
it READs with no pin) and for how long a prompt (``handle_tokens``: a GEN node refuses a generate
whose ``prompt_len`` disagrees, which would otherwise decode from the wrong position silently
when the block count still matches).

The block ids and store epoch a CTX names with a prefill (so that a NIXL GEN can READ without
asking) carry a tag of their own (``blocks_tag``: an HMAC under the same key of the request id, its
handle, the source's address and heads, the blocks and the epoch): a GEN node uses them only when
the tag says the CTX named exactly those (a client holding a valid handle could otherwise point the
READ at another request's blocks and decode from them, "finished", over NIXL).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from typing import Any

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


def new_handle(request_id: str | None = None, key: bytes | None = None, *, num_tokens: int = 0,
               nonce: bytes | None = None) -> str:
    """A fresh handle; with ``request_id`` and ``key``, one that names that request and its prompt's
    ``num_tokens`` (``handle_names``, ``handle_tokens``). ``nonce``: its first 8 bytes given (a
    benchmark whose processes agree on a handle; its token count is then not meaningful)."""
    if request_id is None or key is None:
        return secrets.token_hex(HANDLE_LEN // 2)
    if nonce is None:
        if not 0 <= num_tokens < 1 << 32:
            raise ValueError(f"a handle names 0..2**32-1 tokens, not {num_tokens}")
        nonce = secrets.token_bytes(HANDLE_LEN // 8) + num_tokens.to_bytes(HANDLE_LEN // 8, "big")
    if len(nonce) != HANDLE_LEN // 4:
        raise ValueError(f"a handle's nonce is {HANDLE_LEN // 4} bytes")
    return (nonce + _tag(key, nonce, request_id)).hex()


def handle_key(secret: bytes | None) -> bytes:
    """The key that ties handles to request ids, from the nodes' shared secret. With none (an
    insecure setup) a fixed key: a handle given with another request's id is still told apart,
    but anyone can make one."""
    return hmac.new(secret or b"", b"kvo-kv-handle-v1", hashlib.sha256).digest()


def handle_names(handle: str, request_id: str, key: bytes) -> bool:
    """Whether ``handle`` is one issued (under ``key``) for ``request_id``."""
    try:
        check_handle(handle)
    except InvalidRequestId:
        return False
    return checked_handle_names(handle, request_id, key)


def checked_handle_names(handle: str, request_id: str, key: bytes) -> bool:
    """``handle_names`` of a handle that ``check_handle`` passed (a pull checks its handle first)."""
    raw = bytes.fromhex(handle)
    half = HANDLE_LEN // 4
    return hmac.compare_digest(raw[half:], _tag(key, raw[:half], request_id))


def handle_tokens(handle: str, request_id: str, key: bytes) -> int | None:
    """The prompt length (tokens) a handle issued under ``key`` for ``request_id`` names; None for
    a handle that is not one (a plain random handle, or one given with another request's id)."""
    if not handle_names(handle, request_id, key):
        return None
    return int(handle[HANDLE_LEN // 4:HANDLE_LEN // 2], 16)


def blocks_tag(key: bytes, request_id: str, handle: str, peer: str, heads: tuple[int, int],
               blocks: list[int] | tuple[int, ...], epoch: int | None) -> str:
    """The tag a CTX gives the block ids (and store epoch) it names for one source of a request."""
    text = f"kvo-blocks-v1|{request_id}|{handle}|{peer}|{heads[0]}:{heads[1]}|{','.join(map(str, blocks))}|{epoch}"
    return hmac.digest(key, text.encode(), "sha256").hex()[:32]


def blocks_tag_ok(tag: object, key: bytes, request_id: str, handle: str, peer: str, heads: tuple[int, int],
                  blocks: list[int] | tuple[int, ...], epoch: int | None) -> bool:
    """Whether ``tag`` is the one ``blocks_tag`` gives exactly these (compared in constant time)."""
    return isinstance(tag, str) and hmac.compare_digest(
        tag.encode(), blocks_tag(key, request_id, handle, peer, heads, blocks, epoch).encode())


def _tag(key: bytes, nonce: bytes, request_id: str) -> bytes:
    # a copy of the key's HMAC, made once per key (a handle is checked on every pull: 0.85 µs against
    # 1.5 µs for hmac.digest, which pads the key each time)
    h = _keyed(key).copy()
    h.update(nonce + request_id.encode())
    return h.digest()[:HANDLE_LEN // 4]


@functools.lru_cache(maxsize=16)
def _keyed(key: bytes) -> hmac.HMAC:
    """HMAC-SHA256 under ``key`` before any message (its padded inner and outer states)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def hold_items(items: Iterable[tuple[object, object]], peer: str, log: Any, event: str) -> list[tuple[str, str]]:
    """The ``(request id, handle)`` pairs of a HOLD worth sending: items without a handle are
    skipped; one with a bad id or handle is dropped (logged as ``event``): sent, it could not be
    encoded (failing the connection) or decoded by the CTX (costing every item sent with it)."""
    valid = []
    for rid, h in items:
        if h is None:
            continue
        try:
            valid.append((check_request_id(rid), check_handle(h)))
        except InvalidRequestId as exc:
            log.warning(event, peer=peer, request_id=str(rid)[:40], reason=str(exc))
    return valid


def check_handle(handle: object) -> str:
    if not isinstance(handle, str) or not _HANDLE_RE.fullmatch(handle):
        raise InvalidRequestId(f"KV handle must be {HANDLE_LEN} lowercase hex characters")
    return handle
