"""A runtime model that can hold a prediction half-way through its plan, to test what happens meanwhile."""

from __future__ import annotations

import asyncio
import threading

from services.scheduler.planning.runtime_model import RuntimeModel, Traits


class GatedModel(RuntimeModel):
    """A runtime model whose next estimate, once armed, waits until released: a plan made in a worker
    thread stops half-way there."""

    def __init__(self) -> None:
        super().__init__(min_samples=1)
        self.armed = False
        self.entered, self.released = threading.Event(), threading.Event()

    def runtime(self, traits: Traits, limit: int | None, elapsed: float = 0.0) -> float | None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released.wait(timeout=60)
        return super().runtime(traits, limit, elapsed)

    async def planning(self) -> None:
        """Until a plan has stopped at the gate."""
        assert await asyncio.to_thread(self.entered.wait, 60)
