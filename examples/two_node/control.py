"""The control plane: newline-delimited JSON over TCP (one request per connection).

Addresses are ``host:port``. Every message is one JSON object on one line, at most
``MAX_LINE`` bytes; a longer line, invalid JSON, a non-object or a missing/ill-typed field closes
the connection with ``{"ok": false, "error": ...}``.

CTX node (``ctx`` subcommand)::

    -> {"op": "prefill", "request_id": str, "prompt_ids": [int, ...], "max_tokens": int}
    <- {"ok": true, "request_id": str, "first_token": int, "prompt_len": int,
        "kv_peer": "host:port" (its UCX listener), "block_checksums": [int, ...]}
    -> {"op": "release", "request_id": str}      <- {"ok": true, "released": bool}
    -> {"op": "stats"}                            <- {"ok": true, ...store/pool statistics...}

GEN node (``gen`` subcommand)::

    -> {"op": "generate", "request_id": str, "prompt_len": int, "first_token": int,
        "max_tokens": int, "kv_peer": "host:port"}
    <- {"tokens": [int, ...]}                     zero or more, as decode produces them
    <- {"done": true, "state": "finished"|"failed"|"aborted", "failure": str|null,
        "message": str, "kv_checksums": [int, ...]}   (checksums of the blocks GEN received)
       closing the connection before "done" aborts the request (blocks and budget come back,
       the CTX node is told to free its copy)
    -> {"op": "stats"}                            <- {"ok": true, ...engine and loop statistics...}
    -> {"op": "reset_stats"}                      <- {"ok": true}

Both nodes answer {"op": "ping"} with {"ok": true, "role": "ctx"|"gen"}.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import structlog

log = structlog.get_logger("examples.control")

MAX_LINE = 1 << 20


class ControlError(Exception):
    """A malformed control message, or a peer that answered with ``ok: false``."""


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class JsonStream:
    """Line-delimited JSON over a byte stream."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def send(self, obj: dict[str, Any]) -> None:
        await self._stream.send(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        """The next message; raises ``anyio.EndOfStream`` when the peer closed cleanly."""
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                return _decode(line)
            if len(self._buf) > MAX_LINE:
                raise ControlError(f"control line longer than {MAX_LINE} bytes")
            chunk = await self._stream.receive(65536)
            self._buf += chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


def _decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ControlError(f"control line longer than {MAX_LINE} bytes")
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlError(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ControlError("a control message must be a JSON object")
    return obj


def field(msg: dict[str, Any], name: str, kind: type, *, lo: int | None = None, hi: int | None = None) -> Any:
    """``msg[name]``, checked to be of ``kind`` (and within [lo, hi] for ints); raises ControlError."""
    value = msg.get(name)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"field {name!r} must be {kind.__name__}")
    if kind is int and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        raise ControlError(f"field {name!r}={value} outside [{lo}, {hi}]")
    if kind is str and not 0 < len(value) <= 256:
        raise ControlError(f"field {name!r} must be 1..256 characters")
    return value


def int_list(msg: dict[str, Any], name: str, *, max_len: int, lo: int, hi: int) -> list[int]:
    value = msg.get(name)
    if not isinstance(value, list) or not 0 < len(value) <= max_len:
        raise ControlError(f"field {name!r} must be a list of 1..{max_len} ints")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ControlError(f"field {name!r} holds a value outside [{lo}, {hi}]")
    return value


Handler = Callable[[dict[str, Any], JsonStream], Awaitable[None]]


async def serve(host: str, port: int, handler: Handler, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve connections: read one message, call ``handler(msg, stream)``; report the bound port."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def on_connect(raw: anyio.abc.SocketStream) -> None:
        stream = JsonStream(raw)
        async with raw:
            try:
                msg = await stream.receive()
                await handler(msg, stream)
            except ControlError as exc:
                log.info("control_rejected", error=str(exc))
                try:
                    await stream.send({"ok": False, "error": str(exc)})
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                pass
            except Exception:  # one connection's failure must never take the node down
                log.exception("control_handler_failed")

    task_status.started(bound)
    async with listener:
        await listener.serve(on_connect)


async def connect(addr: str) -> JsonStream:
    host, port = parse_addr(addr)
    return JsonStream(await anyio.connect_tcp(host, port))


async def call(addr: str, msg: dict[str, Any], *, timeout: float = 30.0) -> dict[str, Any]:
    """One request, one answer; raises ControlError if the answer is ``ok: false``."""
    with anyio.fail_after(timeout):
        stream = await connect(addr)
        try:
            await stream.send(msg)
            reply = await stream.receive()
        finally:
            await stream.aclose()
    if reply.get("ok") is False:
        raise ControlError(str(reply.get("error")))
    return reply
