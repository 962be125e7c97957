"""Running a callable on an event loop from any thread without blocking the caller.

``loop_caller()`` must be called on the event-loop thread; it returns ``call(fn)``: on the loop's
own thread it runs ``fn`` at once, from any other thread it schedules ``fn`` on the loop and returns
without waiting. Works on asyncio and trio. After the loop has closed, ``call`` does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import sniffio


def loop_caller() -> Callable[[Callable[[], object]], None]:
    library = sniffio.current_async_library()
    loop_thread = threading.get_ident()
    if library == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()

        def in_asyncio(fn: Callable[[], object]) -> None:
            # a bare loop callback has no current task, so anyio cannot tell which backend runs it
            token = sniffio.current_async_library_cvar.set("asyncio")
            try:
                fn()
            finally:
                sniffio.current_async_library_cvar.reset(token)

        def schedule(fn: Callable[[], object]) -> None:
            try:
                loop.call_soon_threadsafe(in_asyncio, fn)
            except RuntimeError:  # loop closed: nobody is left to wake
                pass

    elif library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def schedule(fn: Callable[[], object]) -> None:
            try:
                token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass

    else:
        raise RuntimeError(f"unsupported async library {library!r}")

    def call(fn: Callable[[], object]) -> None:
        if threading.get_ident() == loop_thread:
            fn()
        else:
            schedule(fn)

    return call
