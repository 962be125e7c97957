"""``python -m examples.serve -c cluster.yaml``: start the nodes the file asks for, then serve HTTP.

Prints one ``READY {"http": "host:port", "ctx": [...], "gen": [...], "started": [...]}`` line once the
first statistics of every node are in (``started``: the nodes it started, with their pid and READY
fields); SIGINT/SIGTERM stop the server, then the nodes it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

import structlog

from examples.serve.cluster import Cluster, Supervisor, launch_nodes
from examples.serve.config import ClusterConfig, ConfigError, load
from examples.two_node import cli
from examples.two_node.__main__ import _configure_logging
from examples.two_node.common import load_secret_or_exit
from transports._auth import SECRET_ENV

log = structlog.get_logger("examples.serve")


def front_secret(cfg: ClusterConfig) -> tuple[bytes | None, bool]:
    """``secret_file`` or ``KVO_SHARED_SECRET``; a fresh one when the front starts every node itself
    (then True: it is written where a person can find it); None with ``insecure: true``. Raises
    SystemExit with one line when it cannot be had."""
    if cfg.insecure:
        return None, False
    secret = load_secret_or_exit(cfg.secret_file, "secret_file")
    if secret is None:
        if any(not s.launched for s in cfg.nodes) or cfg.etcd is not None:
            raise SystemExit(f"error: no shared secret for the running nodes: set {SECRET_ENV} or secret_file")
        return secrets.token_hex(32).encode(), True  # every node is ours: a fresh secret for this cluster
    return secret, False


@contextlib.contextmanager
def secret_written(secret: bytes):
    """The generated secret in a file of its own (mode 0600) under a run folder of this front, so that
    a person can reach the nodes (restart one by hand: ``--secret-file PATH``); removed on exit."""
    folder = Path(tempfile.mkdtemp(prefix="kvo-front-"))
    path = folder / "secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


GRACE_S = 5
"""On SIGTERM/SIGINT, requests in flight get this long to finish (the last second: answered 503)."""


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", required=True, help="the cluster file (YAML; see docs/serve.md)")
    p.add_argument("--host", help="override listen.host")
    p.add_argument("--port", type=cli.port, help="override listen.port (0: pick one)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        cfg = load(a.config)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    secret, generated = front_secret(cfg)
    _configure_logging(a.log_level)
    host = a.host or cfg.host
    port = cfg.port if a.port is None else a.port
    try:  # bound before the nodes start: fail early, in one line
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {host}:{port} (listen / --host --port): {exc.strerror or exc}") from None
    with contextlib.ExitStack() as stack:
        secret_file = stack.enter_context(secret_written(secret)) if generated and secret is not None else None
        if secret_file is not None:
            log.warning("secret_generated", path=str(secret_file),
                        note="the nodes' shared secret; pass --secret-file to a node started by hand")
        return _serve(cfg, a, sock, secret, secret_file)
    return 0


def _serve(cfg: ClusterConfig, a: argparse.Namespace, sock: socket.socket, secret: bytes | None,
           secret_file: Path | None) -> int:
    host = a.host or cfg.host
    with contextlib.closing(sock), launch_nodes(cfg, secret) as (ctx, gen, launched):
        import uvicorn

        from examples.serve._app import Front

        procs = [p for _, p in launched]
        # with etcd too, the nodes it started are in from the start (polled before READY): they register
        # in etcd only after their own READY, so a READY that waited for the watch to bring them in named
        # none of them and answered its first request 503 (the watch then finds them known)
        cluster = Cluster(ctx, gen, secret=secret, interval_s=cfg.routing.stats_interval_s,
                          timeout_s=cfg.routing.connect_timeout_s,
                          policies={"ctx": cfg.router.ctx, "gen": cfg.router.gen})
        supervisor = Supervisor(cfg, secret, launched, cluster) if launched else None
        bound = f"{host}:{sock.getsockname()[1]}"

        def ready() -> None:
            sys.stdout.write("READY " + json.dumps({"http": bound, "ctx": [n.addr for n in cluster.of("ctx")],
                                                    "gen": [n.addr for n in cluster.of("gen")],
                                                    "started": [{"pid": pr.proc.pid, **pr.info} for pr in procs],
                                                    **({"secret_file": str(secret_file)} if secret_file else {})})
                             + "\n")
            sys.stdout.flush()
            log.info("front_ready", http=bound, cluster=repr(cluster))

        front = Front(cfg, cluster, on_ready=ready, supervisor=supervisor)

        class Server(uvicorn.Server):
            async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
                """Requests still running 1 s before the grace ends are answered (503, a stream's error
                event and [DONE]) and aborted on their nodes, not cancelled by uvicorn (a plain 500)."""
                async def answer_the_rest() -> None:
                    await asyncio.sleep(max(0.0, GRACE_S - 1.0))
                    front.stop_requests()

                front.begin_shutdown()
                late = asyncio.ensure_future(answer_the_rest())
                try:
                    await super().shutdown(sockets)
                finally:
                    late.cancel()

        server = Server(uvicorn.Config(front.app, log_level="warning", access_log=False, lifespan="on",
                                       timeout_graceful_shutdown=GRACE_S))
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down: make that unwind this `with`, which
        # stops the nodes (the default SIGTERM action would kill the front and leave them running)
        signal.signal(signal.SIGTERM, _exit)
        try:
            server.run(sockets=[sock])
        finally:
            if supervisor is not None:  # the nodes it restarted (launch_nodes stops the first ones)
                supervisor.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
