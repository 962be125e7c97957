"""The control plane: newline-delimited JSON over TCP, authenticated, one request per connection.

Addresses are ``host:port``. Every message is one JSON object on one line. Life cycle of one
connection, as the server (``ControlServer``) sees it::

    accept ── max_connections already open? ──> closed at once (counted: refused)
      │  deadline: handshake_timeout_s for everything down to the request (counted: timed_out)
      S -> {"kvo": 1, "nonce": hex | null, "insecure": bool}            lines here: <= 4 KiB
      C -> {"auth": {"nonce": hex, "mac": hex}}
      S -> {"ok": true, "mac": hex}     or {"ok": false, "error": ...} and close (counted: auth_failed)
      C -> the request                                                   lines from here: <= max_line
      │  end of the deadline
    handler(request, stream): one answer, or a stream of them (a generate stream has no deadline)

Authentication is mutual, with the data plane's shared secret (``KVO_SHARED_SECRET`` or
``--secret-file``) and nonces (``transports._auth``) but labels of its own, so a MAC seen on the data
plane cannot be replayed here (nor a client's MAC as a server's)::

    client mac = HMAC-SHA256(secret, b"kvo-ctl-v1-client" + server nonce + client nonce)
    server mac = HMAC-SHA256(secret, b"kvo-ctl-v1-server" + server nonce + client nonce)

A node started with ``--insecure`` says ``"insecure": true`` and takes a request without ``auth``
(its ``nonce`` is null when it has no secret at all; its line limit is ``max_line`` from the start);
a client that holds a secret insists on the node proving it, a client without one talks only to
insecure nodes.

A longer line, invalid JSON, a non-object or a missing/ill-typed field closes the connection with
``{"ok": false, "error": ...}``. Request ids follow the one rule of ``transports.check_request_id``.

CTX node (``ctx`` subcommand)::

    -> {"op": "prefill", "request_id": str, "prompt_ids": [int, ...], "max_tokens": int}
    <- {"ok": true, "request_id": str, "first_token": int, "prompt_len": int,
        "kv_peer": "host:port" (its UCX listener), "kv_handle": str, "block_checksums": [int, ...],
        "head_checksums": [[int, ...], ...], "kv_sources": [{"peer": "host:port", "head_start": int,
        "head_end": int, "kv_blocks": [int, ...], "kv_epoch": int}, ...]}
       kv_handle: the unguessable token that GEN must present to pull or release this KV
       kv_blocks: that rank's pool blocks holding the prompt's KV, in order (vLLM's
       remote_block_ids): a NIXL GEN READs them at once, without asking for them first
       kv_epoch: that rank's KV store epoch (its tag and revocation count) before it stored the prompt's KV: a NIXL
       GEN connected since then (it hears every later revocation) READs without pinning first
       kv_sources: where each KV head is held: one entry (kv_peer, every head) for a CTX TP1; one
       per rank for ``ctx --tp M`` (kv_peer is then rank 0's listener; block_checksums is empty and
       head_checksums [block][model head] is the parity check)
    -> {"op": "release", "request_id": str, "kv_handle": str}   <- {"ok": true, "released": bool}
       (a wrong handle releases nothing: "released": false)
    -> {"op": "stats"}                            <- {"ok": true, ...store/pool/control statistics...}

GEN node (``gen`` subcommand)::

    -> {"op": "generate", "request_id": str, "prompt_len": int, "first_token": int,
        "max_tokens": int, "kv_peer": "host:port", "kv_handle": str, "kv_sources": [...] (optional;
        each {"peer", "head_start", "head_end", "kv_blocks" (optional: that rank's block ids)})}
       kv_sources as the CTX's prefill reply gave it (needed when the CTX runs tensor-parallel);
       without it kv_peer holds every head
    <- {"tokens": [int, ...]}                     zero or more, as decode produces them
    <- {"done": true, "state": "finished"|"failed"|"aborted", "failure": str|null,
        "message": str, "kv_checksums": [int, ...]}   (checksums of the blocks GEN received)
       closing the connection before "done" aborts the request (blocks and budget come back,
       the CTX node is told to free its copy). A request id that is already live, or an unhealthy
       engine, is refused with {"ok": false, "error": ...}.
    -> {"op": "stats"}                            <- {"ok": true, "healthy": bool, "health": str|null, ...}
    -> {"op": "reset_stats"}                      <- {"ok": true}

Both nodes answer {"op": "ping"} with {"ok": true, "role": "ctx"|"gen", ...} (GEN adds its health).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import structlog

from transports import InvalidRequestId, check_handle, check_request_id, parse_peer
from transports._auth import SECRET_ENV, new_nonce, verify
from transports.wire import MAC_BYTES, NONCE_BYTES

log = structlog.get_logger("examples.control")

VERSION = 1
MAX_LINE = 1 << 20
"""The line limit of a client reading answers (answers come from an authenticated node)."""
PREAUTH_LINE = 4096
"""The line limit before a connection is authenticated."""

_CLIENT_LABEL = b"kvo-ctl-v1-client"
_SERVER_LABEL = b"kvo-ctl-v1-server"


UNAVAILABLE = "unavailable"
"""The ``code`` of a request a node refuses for itself (starting, stopping, draining, unhealthy):
another node of its role may take it."""


class ControlError(Exception):
    """A malformed control message, or a peer that answered with ``ok: false``.

    ``code``: what kind of refusal it is, sent along in the ``{"ok": false, "error", "code"}`` reply
    (a GEN's ``generate``: ``context_length_exceeded`` / ``invalid_request``: the request itself cannot
    be served here, another node would refuse it too; ``unavailable``: this node cannot take it now);
    None: not said (a peer of an older version, or an error of no kind in particular)."""

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class AuthError(ControlError):
    """The two ends of a control connection could not authenticate each other."""


class LineTooLong(ControlError):
    """A control line longer than the connection's limit: it cannot be read past."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``(host, port)`` of a control address (the same rule as the data plane's peers)."""
    return parse_peer(addr)


def max_line_for(max_ids: int, max_value: int) -> int:
    """A line limit that fits the largest legal request: ``max_ids`` ints of up to ``max_value``
    (a prefill of a whole context), with a separator and a space each, plus 4 KiB for the rest."""
    return PREAUTH_LINE + max_ids * (len(str(max_value)) + 2)


class JsonStream:
    """Line-delimited JSON over a byte stream; a line longer than ``max_line`` is refused before
    it is buffered, so one connection holds at most ``max_line`` bytes of input."""

    def __init__(self, stream: anyio.abc.ByteStream, max_line: int = MAX_LINE) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already known to hold no newline
        self.max_line = max_line

    async def send(self, obj: dict[str, Any]) -> None:
        await self._stream.send(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        """The next message; raises ``anyio.EndOfStream`` when the peer closed cleanly."""
        while True:
            nl = self._buf.find(b"\n", self._scanned)
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                self._scanned = 0
                return _decode(line, self.max_line)
            self._scanned = len(self._buf)
            if len(self._buf) > self.max_line:
                raise LineTooLong(f"control line longer than {self.max_line} bytes")
            chunk = await self._stream.receive(min(65536, self.max_line + 1 - len(self._buf)))
            self._buf += chunk

    def extra(self, attribute: Any, default: Any = None) -> Any:
        return self._stream.extra(attribute, default)

    async def aclose(self) -> None:
        await self._stream.aclose()


async def until_closed(stream: JsonStream) -> None:
    """Return once the peer closed ``stream`` (or it broke, or sent a line too long to read past),
    ignoring whatever it sends until then, a line that is not JSON (a blank one) too: how a server
    notices a client that gave up. (A malformed line ended the request as if its client had gone.)"""
    while True:
        try:
            await stream.receive()
        except LineTooLong:
            return
        except ControlError:
            continue
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            return


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _decode(line: bytes, max_line: int) -> dict[str, Any]:
    if len(line) > max_line:
        raise ControlError(f"control line longer than {max_line} bytes")
    try:  # NaN and Infinity are not JSON (Python's json takes them): refused as such
        obj = json.loads(line, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also an int of > 4,300 digits
        raise ControlError(f"invalid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ControlError("a control message must be a JSON object")
    return obj


# -- fields ---------------------------------------------------------------------------------------

def field(msg: dict[str, Any], name: str, kind: type, *, lo: int | None = None, hi: int | None = None) -> Any:
    """``msg[name]``, checked to be of ``kind`` (and within [lo, hi] for ints, 1..256 characters
    for strings); raises ControlError. Request ids and KV handles have their own rules:
    ``request_id``, ``kv_handle``."""
    value = msg.get(name)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"field {name!r} must be {kind.__name__}")
    if kind is int and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        raise ControlError(f"field {name!r}={value} outside [{lo}, {hi}]")
    if kind is str and not 0 < len(value) <= 256:
        raise ControlError(f"field {name!r} must be 1..256 characters")
    return value


def request_id(msg: dict[str, Any]) -> str:
    """``msg["request_id"]`` if it follows ``transports.check_request_id``; raises ControlError."""
    try:
        return check_request_id(msg.get("request_id"))
    except InvalidRequestId as exc:
        raise ControlError(str(exc)) from None


def kv_handle(msg: dict[str, Any]) -> str:
    """``msg["kv_handle"]`` if it is a well-formed KV handle; raises ControlError."""
    try:
        return check_handle(msg.get("kv_handle"))
    except InvalidRequestId as exc:
        raise ControlError(str(exc)) from None


MAX_KV_SOURCES = 64


def kv_sources(msg: dict[str, Any], max_blocks: int = 1 << 20) -> list[
        tuple[str, int, int, tuple[int, ...] | None, int | None, str | None]]:
    """``msg["kv_sources"]`` as ``(peer, head_start, head_end, kv_blocks, kv_epoch, kv_blocks_tag)``
    (``kv_blocks``: that rank's block ids of the prompt; ``kv_epoch``: its store's epoch before it
    stored them; ``kv_blocks_tag``: the CTX's tag of those (``transports._ids.blocks_tag``); each
    None when not named); [] when absent; raises ControlError."""
    value = msg.get("kv_sources")
    if value is None:
        return []
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KV_SOURCES:
        raise ControlError(f"field 'kv_sources' must be a list of 1..{MAX_KV_SOURCES} sources")
    out = []
    for src in value:
        if not isinstance(src, dict):
            raise ControlError("field 'kv_sources' must hold objects")
        peer = field(src, "peer", str)
        h0 = field(src, "head_start", int, lo=0, hi=1 << 16)
        h1 = field(src, "head_end", int, lo=h0 + 1, hi=1 << 16)
        blocks = (tuple(int_list(src, "kv_blocks", max_len=max_blocks, lo=0, hi=(1 << 31) - 1))
                  if src.get("kv_blocks") is not None else None)
        epoch = field(src, "kv_epoch", int, lo=0, hi=(1 << 63) - 1) if src.get("kv_epoch") is not None else None
        tag = field(src, "kv_blocks_tag", str) if src.get("kv_blocks_tag") is not None else None
        if tag is not None and len(tag) > 64:
            raise ControlError("field 'kv_blocks_tag' must be at most 64 characters")
        out.append((peer, h0, h1, blocks, epoch, tag))
    return out


def int_list(msg: dict[str, Any], name: str, *, max_len: int, lo: int, hi: int) -> list[int]:
    value = msg.get(name)
    if not isinstance(value, list) or not 0 < len(value) <= max_len:
        raise ControlError(f"field {name!r} must be a list of 1..{max_len} ints")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ControlError(f"field {name!r} holds a value outside [{lo}, {hi}]")
    return value


# -- authentication -------------------------------------------------------------------------------

def _mac(label: bytes, secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def _hex_field(obj: object, name: str, size: int) -> bytes:
    value = obj.get(name) if isinstance(obj, dict) else None
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise AuthError(f"authentication field {name!r} must be {size} bytes of hex")
    return raw


async def _authenticate(stream: JsonStream, secret: bytes | None, addr: str) -> None:
    """The client's side of the handshake (see the module docstring)."""
    hello = await stream.receive()
    if hello.get("kvo") != VERSION:
        raise ControlError(f"{addr} is not a kvo control port (version {VERSION}): it said {str(hello)[:80]}")
    if secret is None:
        if hello.get("insecure") is not True:
            raise AuthError(f"{addr} requires authentication: no shared secret given "
                            f"(set {SECRET_ENV} or --secret-file)")
        return
    if hello.get("nonce") is None:
        raise AuthError(f"{addr} cannot authenticate (an --insecure node without a secret): "
                        "refusing to talk to it with a secret")
    server_nonce = _hex_field(hello, "nonce", NONCE_BYTES)
    client_nonce = new_nonce()
    await stream.send({"auth": {"nonce": client_nonce.hex(),
                                "mac": _mac(_CLIENT_LABEL, secret, server_nonce, client_nonce).hex()}})
    reply = await stream.receive()
    if reply.get("ok") is not True:
        raise AuthError(f"{addr}: {reply.get('error') or 'authentication refused'}")
    if not verify(_mac(_SERVER_LABEL, secret, server_nonce, client_nonce), _hex_field(reply, "mac", MAC_BYTES)):
        raise AuthError(f"{addr} failed to prove it holds the shared secret (a different secret?)")


async def connect(addr: str, *, secret: bytes | None) -> JsonStream:
    """An authenticated connection to a node, ready for one request. ``secret`` None talks only to
    an ``--insecure`` node. Raises ``AuthError`` (a ControlError) when authentication fails."""
    host, port = parse_addr(addr)
    stream = JsonStream(await anyio.connect_tcp(host, port))
    try:
        await _authenticate(stream, secret, addr)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return stream


async def call(addr: str, msg: dict[str, Any], *, secret: bytes | None, timeout: float = 30.0) -> dict[str, Any]:
    """One request, one answer; raises ControlError if the answer is ``ok: false``."""
    with anyio.fail_after(timeout):
        stream = await connect(addr, secret=secret)
        try:
            await stream.send(msg)
            reply = await stream.receive()
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
    if reply.get("ok") is False:
        code = reply.get("code")
        raise ControlError(str(reply.get("error")), code=code if isinstance(code, str) else None)
    return reply


# -- the server -----------------------------------------------------------------------------------

Handler = Callable[[dict[str, Any], JsonStream], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class ControlLimits:
    max_connections: int = 4096
    """Connections open at once; one more is closed as soon as it is accepted."""
    handshake_timeout_s: float = 10.0
    """From accept to the request read: hello, authentication and the request itself."""
    max_line: int = max_line_for(2048, 257)
    """Line limit once authenticated (``max_line_for`` the node's largest request)."""
    preauth_line: int = PREAUTH_LINE


@dataclasses.dataclass(frozen=True)
class ControlStatistics:
    active: int
    peak_active: int
    accepted: int
    refused: int
    """Closed at accept: ``max_connections`` were open."""
    timed_out: int
    """Closed because the request had not arrived within ``handshake_timeout_s``."""
    auth_failed: int
    rejected: int
    """Malformed or refused requests (``ok: false`` answers, authentication failures excluded)."""


class ControlServer:
    """Serves control connections for one node: ``port = await tg.start(server.serve, host, port)``."""

    def __init__(self, handler: Handler, *, secret: bytes | None, insecure: bool = False,
                 limits: ControlLimits = ControlLimits()) -> None:
        if secret is None and not insecure:
            raise ValueError("a control server needs the shared secret (or insecure=True)")
        self.handler = handler
        self.secret = secret
        self.insecure = insecure
        self.limits = limits
        self._active = self._peak = self._accepted = self._refused = 0
        self._timed_out = self._auth_failed = self._rejected = 0

    def statistics(self) -> ControlStatistics:
        return ControlStatistics(self._active, self._peak, self._accepted, self._refused, self._timed_out,
                                 self._auth_failed, self._rejected)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<ControlServer [{s.active} open (cap {self.limits.max_connections}), {s.refused} refused, "
                f"{s.timed_out} timed out, {s.auth_failed} failed authentication]>")

    async def serve(self, host: str, port: int, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the bound port, serve until cancelled."""
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
        except OSError as exc:  # the address in the message (the node's start says it in one line)
            raise OSError(exc.errno, f"cannot listen for control connections on {host}:{port}: "
                                     f"{exc.strerror or exc}") from exc
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        if self.insecure:
            log.warning("control_insecure", port=bound, detail="accepting unauthenticated control connections")
        async with listener, anyio.create_task_group() as tg:
            for one in listener.listeners:
                tg.start_soon(self._accept_loop, one, tg)
            task_status.started(bound)

    async def _accept_loop(self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup) -> None:
        sock = listener.extra(anyio.abc.SocketAttribute.raw_socket)
        while True:
            try:
                raw = await accept(sock)
            except OSError as exc:  # out of descriptors: back off, never stop serving
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED):
                    raise
                log.warning("control_accept_failed", error=str(exc))
                await anyio.sleep(0.1)
                continue
            self._accepted += 1
            if self._active >= self.limits.max_connections:
                self._refused += 1
                log.debug("control_refused", open=self._active)
                await raw.aclose()
                continue
            self._active += 1
            self._peak = max(self._peak, self._active)
            tg.start_soon(self._connection, raw)

    async def _connection(self, raw: anyio.abc.SocketStream) -> None:
        stream = JsonStream(raw, max_line=self.limits.max_line if self.insecure else self.limits.preauth_line)
        try:
            async with raw:
                try:
                    msg: dict[str, Any] | None = None
                    with anyio.move_on_after(self.limits.handshake_timeout_s):
                        msg = await self._open(stream)
                    if msg is None:
                        self._timed_out += 1
                        log.info("control_timed_out", timeout_s=self.limits.handshake_timeout_s)
                        return
                    await self.handler(msg, stream)  # past the deadline: a stream may last
                except ControlError as exc:
                    if isinstance(exc, AuthError):
                        self._auth_failed += 1
                        log.info("control_auth_failed", error=str(exc))
                    else:
                        self._rejected += 1
                        log.info("control_rejected", error=str(exc))
                    try:
                        await stream.send({"ok": False, "error": str(exc), **({"code": exc.code} if exc.code else {})})
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                        pass
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                    pass
                except Exception:  # one connection's failure must never take the node down
                    log.exception("control_handler_failed")
        finally:
            self._active -= 1

    async def _open(self, stream: JsonStream) -> dict[str, Any]:
        """Hello, authentication; returns the request. Raises AuthError."""
        server_nonce = new_nonce() if self.secret is not None else None
        await stream.send({"kvo": VERSION, "nonce": server_nonce.hex() if server_nonce else None,
                           "insecure": self.insecure})
        msg = await stream.receive()
        auth = msg.get("auth")
        if auth is None:
            if not self.insecure:
                raise AuthError("authentication required: this control port takes only clients holding "
                                "the shared secret")
            return msg
        if self.secret is None or server_nonce is None:
            raise AuthError("this node has no shared secret (--insecure): connect without one")
        client_nonce = _hex_field(auth, "nonce", NONCE_BYTES)
        if not verify(_mac(_CLIENT_LABEL, self.secret, server_nonce, client_nonce), _hex_field(auth, "mac", MAC_BYTES)):
            raise AuthError("authentication failed: wrong shared secret")
        await stream.send({"ok": True, "mac": _mac(_SERVER_LABEL, self.secret, server_nonce, client_nonce).hex()})
        stream.max_line = self.limits.max_line
        return await stream.receive()


async def accept(sock: socket.socket) -> anyio.abc.SocketStream:
    """The next connection on a listening socket, as a stream. Not the listener's ``accept()``: on
    asyncio that is ``loop.sock_accept``, which, when cancelled in the loop iteration in which a
    connection arrives, accepts it anyway and sets a result on its cancelled future (an
    ``InvalidStateError`` in a loop callback, and a socket nobody closes: CPython 3.11). Here a
    cancelled wait leaves the connection in the backlog."""
    while True:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            await anyio.wait_readable(sock)
            continue
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return await anyio.abc.SocketStream.from_socket(conn)
        except BaseException:
            conn.close()
            raise


async def serve(host: str, port: int, handler: Handler, *, secret: bytes | None, insecure: bool = False,
                limits: ControlLimits = ControlLimits(),
                task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """``ControlServer(handler, ...).serve(host, port)``: for servers whose statistics nobody reads."""
    await ControlServer(handler, secret=secret, insecure=insecure, limits=limits).serve(host, port, task_status=task_status)
