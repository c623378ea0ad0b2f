"""An `asyncio.Event` that the cache's worker threads may set too.

asyncio's primitives belong to their event loop's thread: an Event set from a worker thread (a copy committed,
an entry pinned, touched or evicted in `asyncio.to_thread`) marks its waiters' futures done without waking the
loop, so the waiter (the cache's report) runs only when something else wakes the loop. Set from another thread,
this one is set in the loop's own thread (`call_soon_threadsafe`), which wakes it at once.
"""

from __future__ import annotations

import asyncio
import threading


class ThreadSafeEvent:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._bind()

    def _bind(self) -> None:
        """Know the loop once one runs here (the cache may be made before the agent's loop starts)."""
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._loop_thread = threading.get_ident()

    def set(self) -> None:
        self._bind()
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self._event.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> bool:
        self._bind()
        return await self._event.wait()
