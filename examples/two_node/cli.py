"""What the command lines here share (the nodes, the client, the demo, the benchmark).

* argparse types that refuse, at parse time and so before any node starts, a value that cannot
  work: a count below 1, a negative, infinite or NaN time, a port outside 0-65535, an address
  without a port, an output file that cannot be written. The error is argparse's one line (exit 2);
* the signals of a command that starts nodes: SIGTERM and SIGHUP unwind like Ctrl-C does, so the
  ``with``/``finally`` blocks that stop its nodes and remove their folders (and namespaces) run;
  once unwinding, further signals are ignored, so a second one cannot cut the cleanup short::

      with unwinding():               # around the work: Ctrl-C -> "interrupted (Ctrl-C)", exit 130
          ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from transports import parse_peer

__all__ = ["Interrupted", "address", "non_negative_float", "non_negative_int", "port", "positive_float", "positive_int",
           "unwinding", "writable_file"]


def _number(text: str, kind: type, what: str, ok: object) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value) or not ok(value):  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return int(_number(text, int, "an integer >= 1", lambda v: v >= 1))


def non_negative_int(text: str) -> int:
    return int(_number(text, int, "an integer >= 0", lambda v: v >= 0))


def positive_float(text: str) -> float:
    return float(_number(text, float, "a finite number > 0", lambda v: v > 0))


def non_negative_float(text: str) -> float:
    return float(_number(text, float, "a finite number >= 0", lambda v: v >= 0))


def port(text: str) -> int:
    """A TCP port to listen on: 0 (pick one) to 65535."""
    return int(_number(text, int, "a port 0-65535", lambda v: 0 <= v <= 65535))


def address(text: str) -> str:
    """A ``HOST:PORT`` address to connect to (port 1-65535)."""
    try:
        parse_peer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1-65535, got {text!r}") from None
    return text


def local_host(text: str) -> str:
    """An address (or name) of this host that a listener can bind: checked now, before a node starts
    anything (a CTX started its UCX listener, then found its --host was not this host's)."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(text, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(addr[:2] if family == socket.AF_INET else addr)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address of this host: {exc.strerror or exc}") from None
    return text


def writable_file(text: str) -> Path:
    """An output file this process can create or replace (its folder may not exist yet: the first
    folder on its way that does must be writable). Checked now, not after a run of minutes."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file" if text else "empty path")
    # tried, not asked (os.access): as root it says yes to everything, /proc and read-only mounts too
    if path.exists():
        try:
            with open(path, "ab"):  # append nothing: the file is left as it is
                pass
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror or exc}") from None
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    try:  # a file where a folder should be raises NotADirectoryError here too
        with tempfile.TemporaryFile(dir=parent):  # a file made there and gone at once
            pass
    except OSError:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a writable folder") from None
    return path


class Interrupted(SystemExit):
    """SIGTERM or SIGHUP, raised where the main thread was (exit status 128 + the signal)."""


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _unwind(signum: int, frame: FrameType | None) -> None:
    for sig in _SIGNALS:  # the first signal only: the cleanup it starts runs to its end
        signal.signal(sig, signal.SIG_IGN)
    exc: BaseException = KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(128 + signum)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise exc from None
    # an event loop runs: raised from a callback of its own, it leaves the loop (whose shutdown
    # cancels the tasks) instead of ending whatever task was running, unhandled, with it
    loop.call_soon_threadsafe(_raise, exc)


def _raise(exc: BaseException) -> None:
    raise exc


def _stop_of(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit in ``exc`` (a task group may have wrapped it)."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            if (found := _stop_of(e)) is not None:
                return found
    return None


@contextlib.contextmanager
def unwinding(what: str = "interrupted") -> Iterator[None]:
    """Inside, SIGTERM, SIGHUP and Ctrl-C raise in the main thread (``Interrupted``,
    ``KeyboardInterrupt``), so the block's ``with``/``finally`` cleanup runs; later signals are
    ignored while it does. Then one line on stderr and ``SystemExit`` (130 for Ctrl-C, 128 + the
    signal otherwise), not a traceback. The previous handlers come back on the way out."""
    old = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, _unwind)
    try:
        yield
    except BaseException as exc:
        stop = _stop_of(exc)
        if stop is None or (isinstance(stop, SystemExit) and not isinstance(stop, Interrupted)):
            if stop is not None and stop is not exc:
                raise stop from None  # a plain sys.exit() inside a task group: its own status
            raise
        code = 130 if isinstance(stop, KeyboardInterrupt) else int(stop.code)  # type: ignore[arg-type]
        print(f"{what} ({'Ctrl-C' if code == 130 else signal.Signals(code - 128).name})", file=sys.stderr)
        raise SystemExit(code) from None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
