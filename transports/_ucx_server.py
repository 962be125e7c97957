"""The CTX side of the UCX data plane: ``UCXKVServer`` serves a ``KVStore``'s KV to GEN nodes.

Per endpoint: mutual HMAC handshake first (nothing is served before it succeeds), then a reader
loop takes GEN's control frames (PULL, READY/ABORT, RELEASE) and serves each PULL in its own
task: validate against the limits and the layout, check the entry out of the store (pinned, so a
RELEASE or the lease cannot free it mid-send; zero-copy when its blocks form one run), reply
PULL_OK, wait for READY, send the KV on the pull's data tag, release the entry if asked.
Imported as ``transports.ucx.UCXKVServer``; the protocol is described in ``transports.ucx``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import anyio.abc
import structlog
import torch

from . import _auth, wire
from ._errors import ProtocolViolation, UnknownRequest
from ._layout import dtype_name
from ._store import KVStore
from .ucx import CONTROL_TAG, UCXConfig, _INLINE_GATHER_BYTES, _ucx_acquire, _ucx_buffer, _ucx_release, apply_ucx_defaults

log = structlog.get_logger("transports.ucx")


@dataclasses.dataclass(frozen=True)
class UCXKVServerStatistics:
    connections: int
    pulls_served: int
    pulls_refused: int
    bytes_sent: int
    auth_failures: int


class _Go:
    """The GEN's answer to a PULL_OK: READY (True) or ABORT (False)."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.ready = False


class UCXKVServer:
    """CTX side: serves PULL/RELEASE from a ``KVStore`` on ``port`` (0 picks a free one, see ``.port``).

    Use as ``async with UCXKVServer(store, config) as server: ...``; the listener accepts on all
    interfaces (ucxx listeners do not bind to one address).
    """

    def __init__(self, store: KVStore, config: UCXConfig, *, port: int = 0) -> None:
        self.store = store
        self.config = config
        apply_ucx_defaults(dict(config.ucx_env))
        config._warn_if_insecure("ctx")
        self._requested_port = port
        self._listener: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._busy: set[str] = set()
        self._eps: set[Any] = set()
        self._served = self._refused = self._bytes = self._auth_failures = 0
        limits = config.limits
        layout = store.layout
        self._limits = dataclasses.replace(
            limits, max_layers=min(limits.max_layers, layout.num_layers), max_heads=min(limits.max_heads, layout.num_kv_heads)
        )

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return int(self._listener.port)

    def statistics(self) -> UCXKVServerStatistics:
        return UCXKVServerStatistics(len(self._eps), self._served, self._refused, self._bytes, self._auth_failures)

    def __repr__(self) -> str:
        s = self.statistics()
        where = f"port {self.port}" if self._listener is not None else "not listening"
        return (f"<UCXKVServer [{where}, {s.connections} connections, {s.pulls_served} served, "
                f"{s.pulls_refused} refused, {s.bytes_sent} bytes, {s.auth_failures} auth failures]>")

    async def __aenter__(self) -> UCXKVServer:
        ucxx = _ucx_acquire()
        try:
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._listener = ucxx.create_listener(self._on_connect, port=self._requested_port, endpoint_error_handling=True)
            self._tg.start_soon(self._expire_loop)
        except BaseException:
            _ucx_release()
            raise
        log.info("ucx_server_listening", port=self.port)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        try:
            if self._listener is not None:
                self._listener.close()
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            return await self._tg.__aexit__(*exc)
        finally:
            for ep in list(self._eps):
                ep.abort(period=10**8)
            self._eps.clear()
            self._listener = None
            self._tg = None
            _ucx_release()

    async def serve_forever(self) -> None:
        await anyio.sleep_forever()

    async def _before_send(self, msg: wire.Pull) -> None:
        """Test seam: runs after READY, before the KV is sent."""

    async def _expire_loop(self) -> None:
        while True:
            await anyio.sleep(self.config.expire_interval_s)
            for request_id in self.store.expire():
                log.info("kv_lease_expired", request_id=request_id)

    async def _on_connect(self, ep: Any) -> None:
        if self._tg is None:
            ep.abort()
            return
        self._tg.start_soon(self._serve_endpoint, ep)

    async def _send(self, ep: Any, msg: wire.Message, tag: int) -> None:
        await ep.send(wire.encode_frame(msg), tag=tag)

    async def _recv(self, ep: Any) -> wire.Message:
        frame = bytearray(wire.FRAME_BYTES)
        await ep.recv(frame, tag=CONTROL_TAG)
        return wire.decode_frame(frame, self._limits)

    async def _handshake(self, ep: Any) -> bool:
        secret = self.config.secret
        nonce = _auth.new_nonce()
        await self._send(ep, wire.AuthChallenge(nonce, secret is not None), CONTROL_TAG)
        with anyio.fail_after(self.config.handshake_timeout_s):
            msg = await self._recv(ep)
        if not isinstance(msg, wire.AuthResponse):
            reason = f"expected AUTH_RESPONSE, got {type(msg).__name__}"
        elif secret is not None and not _auth.verify(_auth.client_mac(secret, nonce, msg.nonce), msg.mac):
            reason = "bad credentials"
        else:
            mac = _auth.server_mac(secret, nonce, msg.nonce) if secret is not None else bytes(wire.MAC_BYTES)
            await self._send(ep, wire.AuthOk(mac), CONTROL_TAG)
            return True
        self._auth_failures += 1
        log.warning("ucx_auth_failed", reason=reason)
        with anyio.move_on_after(1):
            await self._send(ep, wire.AuthFail(wire.Status.AUTH_FAILED, reason), CONTROL_TAG)
        return False

    async def _serve_endpoint(self, ep: Any) -> None:
        self._eps.add(ep)
        transfers: dict[int, _Go] = {}
        try:
            try:
                if not await self._handshake(ep):
                    return
            except TimeoutError:
                log.warning("ucx_handshake_timeout")
                return
            async with anyio.create_task_group() as tg:
                try:
                    await self._read_loop(ep, tg, transfers)
                finally:
                    tg.cancel_scope.cancel()
        except ProtocolViolation as exc:
            log.warning("ucx_protocol_violation", reason=str(exc))
        except Exception as exc:  # ucxx: the peer went away
            log.info("ucx_peer_gone", reason=f"{type(exc).__name__}: {exc}")
        finally:
            self._eps.discard(ep)
            try:
                ep.abort(period=10**8)
            except Exception:
                pass

    async def _read_loop(self, ep: Any, tg: anyio.abc.TaskGroup, transfers: dict[int, _Go]) -> None:
        try:
            while True:
                msg = await self._recv(ep)
                if isinstance(msg, wire.Pull):
                    if msg.txid in transfers or msg.tag != 2 * msg.txid + 1:
                        raise ProtocolViolation(f"PULL {msg.txid}: reused txid or foreign tag {msg.tag}")
                    transfers[msg.txid] = _Go()
                    if len(transfers) > self.config.max_pulls_per_endpoint:
                        tg.start_soon(self._refuse, ep, msg, wire.Status.BUSY, "too many pulls in flight", transfers)
                        continue
                    tg.start_soon(self._serve_pull, ep, msg, transfers)
                elif isinstance(msg, (wire.Ready, wire.Abort)):
                    go = transfers.get(msg.txid)
                    if go is not None:
                        go.ready = isinstance(msg, wire.Ready)
                        go.event.set()
                elif isinstance(msg, wire.Release):
                    released = self.store.release(msg.request_id)
                    log.info("kv_released", request_id=msg.request_id, held=released)
                    tg.start_soon(self._send_quietly, ep, wire.ReleaseOk(msg.txid, released), 2 * msg.txid)
                else:
                    raise ProtocolViolation(f"unexpected {type(msg).__name__} from a client")
        except ProtocolViolation as exc:
            log.warning("ucx_protocol_violation", reason=str(exc))
        except Exception as exc:  # ucxx: the peer went away
            log.info("ucx_peer_gone", reason=f"{type(exc).__name__}: {exc}")

    async def _send_quietly(self, ep: Any, msg: wire.Message, tag: int) -> None:
        try:
            await self._send(ep, msg, tag)
        except Exception as exc:
            log.info("ucx_send_failed", reason=f"{type(exc).__name__}: {exc}")

    async def _serve_pull(self, ep: Any, msg: wire.Pull, transfers: dict[int, _Go]) -> None:
        rid = msg.request_id
        if rid in self._busy:
            await self._refuse(ep, msg, wire.Status.BUSY, "a pull of this request is already in flight", transfers)
            return
        self._busy.add(rid)
        try:
            await self._serve_pull_locked(ep, msg, transfers)
        except Exception as exc:  # ucxx: the endpoint broke mid-pull; the reader sees it too
            log.info("kv_pull_failed", request_id=rid, reason=f"{type(exc).__name__}: {exc}")
            try:
                ep.abort(period=10**8)
            except Exception:
                pass
        finally:
            self._busy.discard(rid)
            transfers.pop(msg.txid, None)

    async def _refuse(self, ep: Any, msg: wire.Pull, status: wire.Status, reason: str, transfers: dict[int, _Go]) -> None:
        self._refused += 1
        transfers.pop(msg.txid, None)
        log.info("kv_pull_refused", request_id=msg.request_id, reason=status.name)
        await self._send_quietly(ep, wire.PullErr(msg.txid, status, reason), 2 * msg.txid)

    async def _serve_pull_locked(self, ep: Any, msg: wire.Pull, transfers: dict[int, _Go]) -> None:
        layout = self.store.layout
        try:
            num_blocks = self.store.num_blocks(msg.request_id)
        except UnknownRequest:
            await self._refuse(ep, msg, wire.Status.UNKNOWN_REQUEST, "no KV held for this request", transfers)
            return
        try:
            layout.check_slice(msg.kv_slice)
        except ValueError as exc:
            await self._refuse(ep, msg, wire.Status.BAD_REQUEST, str(exc), transfers)
            return
        want = (dtype_name(layout.dtype), layout.wire_shape(num_blocks, msg.kv_slice))
        if (msg.dtype, msg.shape) != want:
            reason = f"have {want[0]}{list(want[1])}, asked {msg.dtype}{list(msg.shape)}"
            await self._refuse(ep, msg, wire.Status.SHAPE_MISMATCH, reason, transfers)
            return
        try:  # pinned: neither a RELEASE nor the lease can free the blocks while they are sent
            if msg.nbytes <= _INLINE_GATHER_BYTES:  # cheaper than a hop to a worker thread
                checkout = self.store.checkout(msg.request_id, msg.kv_slice)
            else:
                checkout = await anyio.to_thread.run_sync(self.store.checkout, msg.request_id, msg.kv_slice)
        except UnknownRequest:
            await self._refuse(ep, msg, wire.Status.UNKNOWN_REQUEST, "released while preparing", transfers)
            return
        with checkout:
            await self._send_checked_out(ep, msg, transfers, checkout.tensor)

    async def _send_checked_out(self, ep: Any, msg: wire.Pull, transfers: dict[int, _Go], staged: torch.Tensor) -> None:
        await self._send(ep, wire.PullOk(msg.txid, msg.tag, msg.dtype, msg.shape, msg.nbytes), 2 * msg.txid)
        go = transfers[msg.txid]
        with anyio.move_on_after(self.config.ready_timeout_s):
            await go.event.wait()
        if not go.ready:
            log.info("kv_pull_aborted", request_id=msg.request_id, reason="abort" if go.event.is_set() else "ready_timeout")
            return
        await self._before_send(msg)
        await ep.send(_ucx_buffer(staged), tag=msg.tag)
        self._served += 1
        self._bytes += msg.nbytes
        if msg.release:
            self.store.release(msg.request_id)
        log.info("kv_pull_served", request_id=msg.request_id, bytes=msg.nbytes, released=msg.release)
