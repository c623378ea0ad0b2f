"""`trainyard simulate` (administrators): a window of the recorded history replayed in virtual time (whatif.py), its
start and end rebuilt from the log (past.py), the caller told how far it has come while it runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec

from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.planning import SIMULATE, SimulateHistory, SimulationProgress, SimulationReport
from libs.messaging.responder import Route, progress_reporter
from services.scheduler.history import whatif
from services.scheduler.history.past import PastStates
from services.scheduler.interfaces import Scheduling

PROGRESS_SECONDS = 0.5  # at most this often, the caller is told how far the replay has come


class Progress:
    """Sends progress updates to the caller at most every `PROGRESS_SECONDS`, from the event loop or a worker
    thread."""

    def __init__(self, send: Callable[[msgspec.Struct], Awaitable[None]] | None) -> None:
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._last = float("-inf")
        self._sending: set[asyncio.Future[None]] = set()

    def __call__(self, update: SimulationProgress) -> None:
        now = time.monotonic()
        if self._send is None or now - self._last < PROGRESS_SECONDS:
            return
        self._last = now
        self._loop.call_soon_threadsafe(self._start, update)

    def _start(self, update: SimulationProgress) -> None:
        assert self._send is not None
        sending = asyncio.ensure_future(self._send(update))
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    async def sent(self) -> None:
        """Every update sent, before the reply."""
        await asyncio.gather(*self._sending, return_exceptions=True)


class WhatIfQueries:
    def __init__(self, scheduler: Scheduling, past: PastStates) -> None:
        self.scheduler, self.past = scheduler, past

    def routes(self) -> list[Route]:
        return [(SIMULATE, self.simulate)]

    async def simulate(self, request: SimulateHistory, identity: Identity) -> SimulationReport | CommandError:
        """The window's history replayed in virtual time from the log, beside what really happened. Rebuilt and
        played apart from the live state, the play in a worker thread."""
        if not identity.admin:
            return CommandError(code="forbidden", message="only administrators replay the cluster's history",
                                hint="ask an administrator; `trainyard at TIME …` shows you the past as it was")
        now = self.scheduler.clock()
        end = request.end or now
        if end > now or request.start >= end:
            return CommandError(code="invalid-request",
                                message=f"the window {request.start.isoformat()} to {end.isoformat()} is not in the "
                                        f"past, or ends before it starts",
                                hint="give a start before its end, and an end no later than now")
        progress = Progress(progress_reporter())

        def rebuilding(events: int) -> None:
            progress(SimulationProgress(stage="rebuilding", events=events))

        try:
            async with self.past.at(request.start, progress=rebuilding) as then:
                begin = whatif.Start.of(then.state, request.start)
            async with self.past.at(end, progress=rebuilding) as later:
                history = whatif.recorded(later.state.jobs, later.state.flavors, begin, end)
                nodes_at_end = [n.info for n in later.state.nodes.values() if n.schedulable]

            def played(share: float) -> None:
                progress(SimulationProgress(stage="playing", played=share))

            return await asyncio.to_thread(whatif.what_if, request, begin, end, history, nodes_at_end,
                                           progress=played)
        except whatif.WhatIfError as exc:
            return CommandError(code="invalid-request", message=str(exc),
                                hint="`trainyard flavors` lists the flavors; `trainyard at TIME nodes` the nodes then")
        finally:
            await progress.sent()
