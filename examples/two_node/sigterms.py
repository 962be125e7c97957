"""A node's SIGTERMs (and SIGINTs: a Ctrl-C is the same stop), caught from before its READY line (``Sigterms``)."""

from __future__ import annotations

import signal
import sys

import anyio
import anyio.abc

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a node gracefully (a second one: at once), rank 0 (``Sigterms``) and ranks 1..N-1
(``tp_group.wait_for_rank0_on_sigterm``) alike: a supervisor's SIGTERM, an operator's Ctrl-C."""


class Sigterms:
    """The node's SIGTERMs, caught from before its READY line: ``await tg.start(sigterms.run)``
    before ``announce_ready``, then ``await sigterms.next()`` where a stop waits for one. The
    graceful stop's own receiver used to be opened in a task started after READY (its first use
    imports anyio's signal module, ~0.1-1 s on a loaded machine), so a supervisor's SIGTERM sent
    when READY came met the crude handler: exit 143 with a traceback, no graceful stop.

    SIGINT counts as a SIGTERM: an operator's Ctrl-C (to the node, or to its whole process group,
    every rank's too) is the same graceful stop, a second one the same immediate exit. Before, it
    was Python's KeyboardInterrupt: exit 130, a traceback per rank, every live request failed, and
    in a tensor-parallel node rank 1's death read as the group's cause."""

    def __init__(self) -> None:
        self._got = anyio.Event()
        self._count = 0
        self._taken = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if sys.platform == "win32":  # pragma: no cover
            task_status.started()
            return
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            task_status.started()
            async for _ in signals:
                self._count += 1
                got, self._got = self._got, anyio.Event()
                got.set()

    async def next(self) -> None:
        """Until a SIGTERM not taken yet by a call of ``next`` (each one is taken once)."""
        while self._taken >= self._count:
            await self._got.wait()
        self._taken += 1
