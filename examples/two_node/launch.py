"""Starting nodes as child processes (optionally inside a network namespace) and stopping them.

    with NodeProcess.start(["ctx", ...], env=...) as ctx:    # waits for its READY line
        ctx.info["ctrl"], ctx.info["ucx"]
        control.call(ctx.info["ctrl"], ..., secret=ctx.secret)  # the secret it was started with
    # on exit: SIGTERM, then SIGKILL after a grace period; never leaves a stray process, nor the
    # temporary folder of its log (made when no log_dir is given): log_tail() still answers

``Netns`` builds two network namespaces joined by a veth pair (root only), each with its own
address and loopback: real separate network stacks on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from examples.two_node import forkserver
from transports._auth import SECRET_ENV

ROOT = Path(__file__).resolve().parents[2]


def env_secret(env: Mapping[str, str]) -> bytes | None:
    """The shared secret of nodes started with ``env``: what a client needs to talk to them."""
    raw = env.get(SECRET_ENV, "").strip()
    return raw.encode() if raw else None


def node_env(secret: str | None = None, **extra: str) -> dict[str, str]:
    """The environment for child nodes: this one, plus a shared secret (fresh unless given)."""
    env = dict(os.environ)
    env[SECRET_ENV] = secret or secrets.token_hex(32)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


class NodeProcess:
    def __init__(self, proc: subprocess.Popen[str], info: dict[str, Any], log_path: Path, *,
                 secret: bytes | None, owned_dir: Path | None = None) -> None:
        self.proc = proc
        self.info = info
        self.log_path = log_path
        self.secret = secret
        """The shared secret the node holds (from its environment), for ``control.call``."""
        self._owned_dir = owned_dir
        self._last_log: str | None = None  # the log's end, kept when the folder is removed

    @classmethod
    def start(
        cls,
        args: list[str],
        *,
        env: dict[str, str],
        netns: str | None = None,
        timeout: float = 60.0,
        log_dir: Path | None = None,
    ) -> NodeProcess:
        cmd = [sys.executable, "-m", "examples.two_node", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        owned_dir: Path | None = None  # a folder made here is removed when the node stops
        if log_dir is None:
            log_dir = owned_dir = Path(tempfile.mkdtemp(prefix="kvo-"))
        log_path = log_dir / f"{args[0]}-{secrets.token_hex(3)}.log"
        try:
            with open(log_path, "w") as stderr:
                proc = None if netns else _forked(args, env, stderr)
                if proc is None:
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                            start_new_session=True)
        except BaseException:
            _remove(owned_dir)
            raise
        try:
            info = wait_ready(proc, timeout)
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # it exited: its status, which may come a moment after EOF
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2)
            why = f"{exc}" + (f", exit status {proc.poll()}" if proc.poll() is not None else "")
            _stop(proc)
            tail = _tail(log_path)
            _remove(owned_dir)
            where = "the end of its log" if owned_dir else f"its log {log_path}"
            raise RuntimeError(f"{args[0]} node did not start ({why}); {where}:\n{tail}") from None
        return cls(proc, info, log_path, secret=env_secret(env), owned_dir=owned_dir)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(10)

    def stop(self) -> None:
        _stop(self.proc)
        if self._owned_dir is not None:
            self._last_log = _tail(self.log_path, 200)
            _remove(self._owned_dir)
            self._owned_dir = None

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        if self._last_log is not None:
            return "\n".join(self._last_log.splitlines()[-lines:])
        return _tail(self.log_path, lines)


def _forked(args: list[str], env: dict[str, str], stderr: IO[str]) -> Any:
    """The node forked by this process's fork server (``forkserver``, with ``KVO_FORK_SERVER=1``),
    or None: no server, or one that cannot start this node (then it is started cold)."""
    server = forkserver.server()
    if server is None or not server.fits(env):
        return None
    out_r, out_w = os.pipe()
    stdout = os.fdopen(out_r, "r")
    try:
        return server.spawn(args, env, ROOT, out_w, stderr.fileno(), stdout)
    except OSError:
        stdout.close()
        return None
    finally:
        os.close(out_w)


def wait_ready(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The JSON of the node's ``READY {...}`` line on its stdout. Read from the pipe unbuffered: a
    buffered ``readline()`` takes every line already in the pipe into Python's buffer and returns
    the first, so a READY line that came in one write with a library's log line before it (NIXL
    prints two just before it) sat in that buffer while ``select`` waited for the pipe in vain."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    pending = b""  # the last line, not ended yet (READY may follow a library's partial line in it)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            for line in pending.split(b"\n")[:-1]:
                at = line.find(b"READY {")  # not only at the line's start: a C library's log (UCX, NIXL)
                if at >= 0:                 # shares this stdout, and a partial line of it may come first
                    return json.loads(line[at + 6:])
            pending = pending[pending.rfind(b"\n") + 1:][-(1 << 20):]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no READY line within {timeout:.0f} s")
            if not sel.select(timeout=min(0.5, left)):
                if proc.poll() is not None:
                    raise RuntimeError("exited before READY")
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("exited before READY")
            pending += chunk


def _stop(proc: subprocess.Popen[str], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` (a node's graceful stop, ``--graceful-shutdown-timeout-s``,
    5 s by default on a GEN and a CTX, comes first)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Netns:
    """Two network namespaces joined by a veth pair: ``a`` at ``addr_a``, ``b`` at ``addr_b``."""

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or secrets.token_hex(2)
        self.a, self.b = f"kvo-a-{tag}", f"kvo-b-{tag}"
        self._veth_a, self._veth_b = f"kva{tag}", f"kvb{tag}"
        self.addr_a, self.addr_b = "10.231.0.1", "10.231.0.2"

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None when they can)."""
        if os.geteuid() != 0:
            return "creating network namespaces needs root"
        if shutil.which("ip") is None:
            return "iproute2 ('ip') is not installed"
        return None

    def __enter__(self) -> Netns:
        try:
            for cmd in (
                f"ip netns add {self.a}",
                f"ip netns add {self.b}",
                f"ip link add {self._veth_a} type veth peer name {self._veth_b}",
                f"ip link set {self._veth_a} netns {self.a}",
                f"ip link set {self._veth_b} netns {self.b}",
                f"ip -n {self.a} addr add {self.addr_a}/24 dev {self._veth_a}",
                f"ip -n {self.b} addr add {self.addr_b}/24 dev {self._veth_b}",
                f"ip -n {self.a} link set {self._veth_a} up",
                f"ip -n {self.b} link set {self._veth_b} up",
                f"ip -n {self.a} link set lo up",
                f"ip -n {self.b} link set lo up",
            ):
                subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"{' '.join(exc.cmd)} failed: {exc.stderr.strip()}") from None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)

    @contextlib.contextmanager
    def entered(self, ns: str) -> Iterator[None]:
        """Run this process's own sockets inside ``ns`` for the duration (setns), then come back."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(target, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            yield
        finally:
            libc.setns(home, 0x40000000)
            os.close(target)
            os.close(home)
