"""A fork server for node processes: one interpreter that has imported a node's modules forks each
node, instead of a new interpreter importing them again.

A node process spends ~2-2.8 s of CPU starting, 1.8 s of it importing torch. The test suite starts
hundreds of nodes on a 2-core machine, where that CPU was most of its time. ``NodeProcess.start``
uses this server once ``enable()`` was called in the process (the test suite does, for the nodes
its tests start themselves; the demos, benchmarks and fronts those tests run start theirs cold, as
a user's do) or when started with ``KVO_FORK_SERVER=1``. Everything else starts nodes as ``python
-m examples.two_node`` processes, and so does ``NodeProcess.start`` whenever this server cannot
serve a start (a network namespace, an environment that differs in what the imports read, a
server that died): the node is the same program either way. In ``ps`` a forked node shows its
server's command line (``python -m examples.two_node.forkserver N``), as a child of the server.

The server is a child of the process that uses it, started with ``python -m
examples.two_node.forkserver`` and one end of a ``SOCK_SEQPACKET`` socket pair. It imports the
node's modules (not UCX or NIXL, which read their settings when imported, nor anything that starts
a thread but OpenBLAS's pool, which handles ``fork``), then waits. A start sends the node's argv,
environment and folder, with its stdout and stderr as file descriptors (``SCM_RIGHTS``); the
server forks, answers the child's pid, and reports its exit status when it ends. The child starts
a session of its own (as ``start_new_session``), takes the descriptors as fds 0-2, the environment
as ``os.environ``, then runs ``examples.two_node`` as ``__main__`` and exits through the
interpreter's own shutdown (threads joined, ``atexit`` run), like a node started by ``python -m``.
``ForkedProcess`` is the part of ``subprocess.Popen`` the launcher and its callers use: ``pid``,
``stdout``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``.

The server's children are not the caller's: their exit status comes from the server, and a
server whose caller went away (EOF on its socket) exits, leaving its nodes to whoever stops them
(``NodeProcess`` does, by process group, as with ``Popen``).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from examples import _proc

ENV = "KVO_FORK_SERVER"
"""``1`` when a process starts: its ``NodeProcess.start`` forks nodes from a server (see the module
docstring). Read once, and not passed on by ``enable()``: a process's children decide for themselves."""
_enabled = os.environ.get(ENV) == "1"

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ("examples.two_node.__main__", "examples.two_node.gen", "examples.two_node.ctx",
           "examples.two_node.gen_tp", "examples.two_node.ctx_tp")
# what the imports of torch and numpy read from the environment: a start whose environment differs
# from the server's in one of these is not forked (the server imported them under other settings)
_IMPORT_ENV = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "LD_",
               "MALLOC_", "GLIBC_", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONMALLOC",
               "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONDEVMODE")
_MAX_MESSAGE = 1 << 20


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_ENV)}


# -- the caller's side ---------------------------------------------------------------------------------
class ForkServer:
    """The caller's handle on one server process (see ``server()``)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "examples.two_node.forkserver", str(theirs.fileno())],
                cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._sock = mine
        self._lock = threading.Lock()  # one start at a time; exits are read by whoever holds it
        self._exits: dict[int, int] = {}
        self._dead = False

    @property
    def alive(self) -> bool:
        return not self._dead and self.proc.poll() is None

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a node with ``env`` may be forked from this server (what the imports read agrees)."""
        return _env_key(env) == _env_key(self.env)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, stdout_fd: int, stderr_fd: int,
              stdout: TextIO | None) -> ForkedProcess:
        """Fork a node running ``python -m examples.two_node *argv``; raises ``OSError`` when the
        server cannot (the caller then starts it cold)."""
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        if len(request) > _MAX_MESSAGE:
            raise OSError("the node's argv and environment are too large for the fork server")
        with self._lock:
            if not self.alive:
                raise OSError("the fork server is not running")
            try:
                socket.send_fds(self._sock, [request], [stdout_fd, stderr_fd])
                while True:
                    msg = self._read(timeout=30.0)
                    if msg is None:
                        raise OSError("the fork server did not answer within 30 s")
                    if "pid" in msg:
                        return ForkedProcess(self, int(msg["pid"]), stdout)
                    if "error" in msg:
                        raise OSError(f"the fork server could not fork: {msg['error']}")
            except OSError:
                self._dead = True
                raise

    def status(self, pid: int, timeout: float = 0.0) -> int | None:
        """``pid``'s exit code once the server reported it (waits up to ``timeout`` s for it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if self._read(timeout=max(0.0, left)) is None and left <= 0:
                    return None
            return self._exits[pid]

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """One message (exits are filed as they come); None when none came within ``timeout``."""
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            self._dead = True
            raise OSError("the fork server exited")
        msg = json.loads(data)
        if "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        return msg

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """What ``NodeProcess`` and its callers use of ``subprocess.Popen``, for a node the server forked."""

    def __init__(self, server: ForkServer, pid: int, stdout: TextIO | None) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stdin = None
        self.stderr = None
        self.returncode: int | None = None
        self.args = ["examples.two_node", "(forked)"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._server.status(self.pid)
            except OSError:  # the server died: its children were reparented; ask the kernel
                self.returncode = None if _exists(self.pid) else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            try:
                self.returncode = self._server.status(self.pid, timeout=min(left, 1.0))
            except OSError:
                time.sleep(min(left, 0.05))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc.state(pid) not in ("Z", None)  # a zombie is no running node


_server: ForkServer | None = None
_server_lock = threading.Lock()
_server_pid = -1  # the process that started it (a forked caller starts its own)


def enable(on: bool = True) -> None:
    """Fork this process's nodes from a server (``on``), or start them cold."""
    global _enabled
    _enabled = on


def server() -> ForkServer | None:
    """This process's fork server, started on first use (or again, when it died); None unless
    enabled (``enable()``, or ``KVO_FORK_SERVER=1`` when the process started)."""
    global _server, _server_pid
    if not _enabled:
        return None
    with _server_lock:
        if _server is None or _server_pid != os.getpid() or not _server.alive:
            if _server is not None and _server_pid == os.getpid():
                _server.close()
            _server, _server_pid = ForkServer(), os.getpid()
        return _server


def shutdown() -> None:
    """Stop this process's server (its nodes are not touched)."""
    global _server
    with _server_lock:
        if _server is not None and _server_pid == os.getpid():
            _server.close()
        _server = None


# -- the server's side ---------------------------------------------------------------------------------
def serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork a child per request until the caller goes away (then exit). Returns only in a child:
    its request and its descriptors."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)

    def send(msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            sock.send(json.dumps(msg).encode())

    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
                except OSError:
                    data, fds = b"", []
                if not data:  # the caller went away
                    os._exit(0)
                try:
                    request = json.loads(data)
                    pid = os.fork()
                except Exception as exc:  # noqa: BLE001 (reported, the server goes on)
                    for fd in fds:
                        os.close(fd)
                    send({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    sock.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                send({"pid": pid})
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
        while True:  # reap every child that ended, and report it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def become(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: take the node's descriptors, environment and folder, then run it."""
    import runpy

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        if fd > 2:
            os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    sys.argv = [str(ROOT / "examples" / "two_node" / "__main__.py"), *request["argv"]]
    runpy.run_module("examples.two_node", run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the caller; the server exits on its EOF
    request, fds = serve(sock)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become(request, fds)


if __name__ == "__main__":
    main(sys.argv[1:])
