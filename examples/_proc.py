"""What the kernel says of a process in ``/proc/PID/stat``: its state, parent, CPU time and CPU.

One parser for the examples, the benchmarks and the scripts (six copies read the same line). The
line is ``pid (comm) state ppid ...``; ``comm`` may hold spaces and parentheses, so the fields are
read after the last ``)``. ``fields(pid)[0]`` is field 3 of proc(5), ``state``.
"""

from __future__ import annotations

import os


def fields(pid: int | str) -> list[str] | None:
    """The fields after ``comm`` of ``/proc/<pid>/stat`` (``pid`` may be ``"self"`` or
    ``"thread-self"``); None when the process is gone or the line cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
        return line[line.rindex(b")") + 2:].decode().split()
    except (OSError, ValueError):
        return None


def state(pid: int) -> str | None:
    """The one-letter state (``R``, ``S``, ``T``: stopped, ``Z``: dead, not reaped), None if gone."""
    f = fields(pid)
    return f[0] if f else None


def ppid(pid: int) -> int | None:
    """The parent's pid, None if gone."""
    f = fields(pid)
    return int(f[1]) if f else None


def cpu_s(pid: int | str) -> float:
    """User + system CPU seconds (fields 14 and 15), 0 when the process is gone."""
    f = fields(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") if f else 0.0


def processor(pid: int | str = "thread-self") -> int | None:
    """The CPU it last ran on (field 39), None if unknown."""
    f = fields(pid)
    try:
        return int(f[36]) if f else None
    except (IndexError, ValueError):
        return None
