"""One `run(name, factory)` for every long-running process: the services' `__main__` and the node agent's.

It sets up logs and traces, starts what the factory builds, and keeps it running until SIGTERM or
SIGINT, or until the process stops on its own (a crashed background task); then closes it, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

from libs.telemetry.logs import configure_logging
from libs.telemetry.metrics import configure_metrics, shutdown_metrics
from libs.telemetry.tracing import configure_tracing, shutdown_tracing

# Python's cycle collector looks at the young objects every 700 allocations by default. A service or agent
# makes and drops many short-lived objects for every message (decoded events, envelopes, log lines, futures),
# nearly none of them in cycles: a young collection every this many allocations costs a fraction of that,
# each scanning a few thousand objects at most, with cyclic garbage kept a little longer.
YOUNG_COLLECTION_ALLOCATIONS = 20_000


# glibc's mallopt parameter for how many malloc arenas a process may have (M_ARENA_MAX in <malloc.h>).
M_ARENA_MAX = -8


def one_malloc_arena() -> bool:
    """Have every thread allocate from glibc's main malloc arena. A thread otherwise gets an arena of its own, and
    what it frees there serves no allocation of the event loop's thread: a scheduler that restored its snapshot in a
    worker thread held 13 MiB more for the rest of its life than one that restored it on the event loop. Python's
    threads allocate under the GIL, so one arena costs them little waiting. False where the C library has no such
    setting (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


class Process(Protocol):
    async def stopped(self) -> None:
        """Return when the process must stop on its own."""

    async def close(self) -> None: ...


def run(name: str, factory: Callable[[], Awaitable[Process]], *, trace_as: str | None = None,
        node: str | None = None) -> None:
    """Run the process `factory` starts until it is asked to stop (`python -m ...`); it logs as `name`, traces and
    exports metrics as `trace_as` (default `name`), its metrics labelled with `node` (an agent's)."""
    one_malloc_arena()  # before any thread is made
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])
    asyncio.run(serve(name, factory, trace_as=trace_as, node=node))


async def serve(name: str, factory: Callable[[], Awaitable[Process]], *, trace_as: str | None = None,
                node: str | None = None) -> None:
    configure_logging(name)
    configure_tracing(trace_as or name)
    # Before the factory: a standby, which waits inside it for its lease, is seen standing by.
    configure_metrics(trace_as or name, service=name, node=node)
    # Taken before the factory runs: a SIGTERM while it starts (or while a standby waits for its lease) ends the
    # process in order rather than by the signal's default action.
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, interrupted.set)
    asked = asyncio.ensure_future(interrupted.wait())
    starting = asyncio.ensure_future(factory())
    await asyncio.wait([asked, starting], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        shutdown_tracing()
        shutdown_metrics()
        return
    process = starting.result()
    failed = asyncio.ensure_future(process.stopped())
    try:
        await asyncio.wait([asked, failed], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in (asked, failed):
            wait.cancel()
        await process.close()
        shutdown_tracing()
        shutdown_metrics()
    if interrupted.is_set():
        return
    # It stopped on its own: a non-zero exit lets a supervisor (systemd, Kubernetes) restart it.
    raise SystemExit(1)
