"""``python -m examples.two_node {ctx,gen,client,demo} ...`` — see README.md."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

import structlog


def _configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,  # log.exception: the traceback, as one string field
            structlog.processors.JSONRenderer(),
        ],
    )


def _tame_malloc(trim_every_s: float = 10.0) -> None:
    """glibc: keep serving blocks of >= 128 KiB from mmap (its default, but fixed: glibc otherwise
    raises the threshold at run time), and give freed heap pages back every ``trim_every_s``.

    Measured (docs/soak.md): asyncio reads each socket with recv(256 KiB) and shrinks the result;
    once glibc has raised its mmap threshold those buffers come from the heap, between the small
    long-lived blocks of ~1,000 open control connections, and a CTX's heap kept growing (~390 bytes
    per request) while the bytes in use stayed flat."""
    import ctypes
    import threading
    import time

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return

    def trimmer() -> None:
        while True:
            time.sleep(trim_every_s)
            trim(0)

    threading.Thread(target=trimmer, name="malloc-trim", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        from examples.two_node import client

        return client.main(argv[1:])
    if argv[:1] == ["demo"]:
        from examples.two_node import demo

        return demo.main(argv[1:])
    from examples.two_node import common, ctx, gen

    parser = argparse.ArgumentParser(prog="python -m examples.two_node")
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="role", required=True)
    for name, module, help_ in [("ctx", ctx, "run a CTX (prefill) node"), ("gen", gen, "run a GEN (decode) node")]:
        p = sub.add_parser(name, help=help_)
        module.add_args(p)
        common.add_model_args(p)
        common.add_security_args(p)
        common.add_control_args(p)
        common.add_transport_args(p)
    sub.add_parser("client", help="drive a load (see: client --help)")
    sub.add_parser("demo", help="start CTX and GEN, drive a load, check parity (see: demo --help)")
    args = parser.parse_args(argv)
    if args.role == "ctx" and args.ucx_port:  # rank r listens on --ucx-port + r (past 65535: READY, then a
        last = args.ucx_port + args.tp - 1    # rank 1 that failed to listen, forever: a drill)
        if last > 65535:
            parser.error(f"--ucx-port {args.ucx_port} with --tp {args.tp}: rank r listens on --ucx-port + r, and "
                         f"{last} is not a port (at most {65536 - args.tp})")
    args.argv = argv  # a GEN with --tp starts its other ranks with the same flags
    _tame_malloc()
    # SIGTERM unwinds like an exception, so that a node cleans up on the way out: a GEN rank 0
    # reaps its other ranks (which get the signal too), every node closes its UCX endpoints
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    common.node_secret(args)  # a missing or bad secret: one line on stderr, before anything starts
    _configure_logging(args.log_level)
    return run_role({"ctx": ctx.main, "gen": gen.main}[args.role], args)


def run_role(role_main: Any, args: argparse.Namespace) -> int:
    """A node's main; the SIGTERM exit (``sys.exit(143)`` raised wherever the main thread was)
    comes out as that exit status even when a task group wrapped it in an exception group (a
    SIGTERM that lands inside a task group, e.g. while a generate stream sends): exit status 1 and
    a traceback would tell a supervisor the node crashed."""
    from examples.two_node.tp_group import GaveUp

    try:
        return int(role_main(args) or 0)
    except GaveUp as exc:
        return _gave_up(args, exc)
    except OSError as exc:
        if not _bind_error(exc):
            raise
        return _in_use(args, exc)
    except BaseExceptionGroup as group:
        in_use = group.subgroup(_bind_error)
        if in_use is not None:  # a port taken, an address not here: one line, not the task groups' traceback
            return _in_use(args, next(iter(_leaves(in_use))))
        gave_up = group.subgroup(GaveUp)
        if gave_up is not None:  # --tp-reform-attempts spent: one line for the supervisor
            return _gave_up(args, next(iter(_leaves(gave_up))))
        exits = group.subgroup(SystemExit)
        if exits is None:
            raise
        first = next(iter(_leaves(exits)))
        others = group.subgroup(lambda e: not isinstance(e, (SystemExit, BaseExceptionGroup))
                                and type(e).__name__ not in ("CancelledError", "Cancelled"))
        if others is not None:  # what the unwinding also raised: named, not a traceback
            print(f"exiting ({first.code}); also raised on the way out: "
                  + ", ".join(f"{type(e).__name__}: {e}" for e in _leaves(others)), file=sys.stderr)
        return int(first.code) if isinstance(first.code, int) else 1


def _bind_error(exc: BaseException) -> bool:
    """A listener that could not bind: a port taken, an address this host does not have (errno
    99), a name that does not resolve (the listeners say "cannot listen ..." with the address)."""
    return isinstance(exc, OSError) and (exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
                                         or "cannot listen" in str(exc))


def _in_use(args: Any, exc: OSError) -> int:
    print(f"{getattr(args, 'role', 'node')}: cannot start: {exc}", file=sys.stderr)
    return 1


def _gave_up(args: Any, exc: BaseException) -> int:
    print(f"{getattr(args, 'role', 'node')}: stopped: {exc}", file=sys.stderr)
    return 1


def _leaves(group: BaseExceptionGroup[Any]) -> Iterator[Any]:
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


if __name__ == "__main__":
    sys.exit(main())
