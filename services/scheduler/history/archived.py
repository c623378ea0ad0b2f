"""Jobs archived: ended longer ago than the administrator's `job_retention`, no longer in the state in memory
(rules/archive.py), but still shown, explained, cloned and deleted as before.

Such a job is read back from the log when it is asked for: its own events from the scheduler's log, the other services'
(its launches' processes, kept environments) as published, found where the scheduler noted they are stored, written
beside its log when the job was archived (libs/eventstore/published.py), folded in time order into a state of its own
that holds that job alone, as the live state held it before it left (its JobArchived left out). The queries and commands
read that state with the same code as the live one. A job that never existed reads back as nothing, which is answered as
before: not found.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime

from nats.js.client import JetStreamContext

from libs.contracts.arrays import is_array_id, parse_indices
from libs.contracts.events import ArraySubmitted, EventEnvelope, JobArchived
from libs.contracts.ids import is_job_id
from libs.eventstore import EventStore
from libs.eventstore.published import PublishedIndex
from libs.messaging.history import stored_events
from services.scheduler.domain.arrays import member_id
from services.scheduler.domain.names import ARRAY, JOB, SERVICE
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.prediction import Forecast


async def job_events(store: EventStore, js: JetStreamContext, index: PublishedIndex, job_id: str,
                     published: Sequence[int] | None = None) -> list[EventEnvelope]:
    """Every service's events about the job, in time order: its own from the log (complete at once), the others' as
    published, at the stream sequences `published` (a job held: `Job.published`; None: an archived job's, which the
    index tells). The life of its run (the monitor's aggregate "run") is not among them: `trainyard metrics` tells
    it."""
    own = await store.read_aggregate(JOB, job_id)
    if not own:
        return []
    if published is None:
        published = await index.of(job_id)
    others = [e for e in await stored_events(js, published, job_id) if e.service != SERVICE]
    return sorted(own + others, key=lambda e: e.recorded_at)


class ArchivedScheduler:
    """A state of archived jobs, read as the live scheduler's is (`interfaces.Reading`): its clock is the live one,
    and none of its jobs waits for a start."""

    def __init__(self, state: SchedulerState, clock: Callable[[], datetime]) -> None:
        self.state = state
        self.clock = clock
        self.lock = asyncio.Lock()

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        return {}


class Archive:
    """Reads archived jobs back from the log for the live scheduler's handlers."""

    def __init__(self, store: EventStore, js: JetStreamContext, index: PublishedIndex,
                 live: Callable[[], SchedulerState]) -> None:
        self.store, self.js, self.index, self.live = store, js, index, live  # live(): the live state (a restore
        # replaces it)

    def archived(self, job_ids: Iterable[str]) -> list[str]:
        """The ids the live state does not hold (archived, or never known)."""
        return [job_id for job_id in dict.fromkeys(job_ids) if job_id not in self.live().jobs]

    def _readable(self, job_ids: Iterable[str]) -> list[str]:
        """Those of the ids not held that could name a job (every job's id is one): any other, a NUL in it say, is
        never looked for in the log, where it could not be stored; it is not found, as ever."""
        return [job_id for job_id in self.archived(job_ids) if is_job_id(job_id)]

    async def state_of(self, job_ids: Iterable[str]) -> SchedulerState | None:
        """A state holding those of `job_ids` that left the live state, as it held them before (with the live
        settings, so that access is decided as for the others); None when the live state holds all of them."""
        missing = self._readable(job_ids)
        if not missing:
            return None
        state = self._empty()
        for job_id in missing:
            self._fold(state, await job_events(self.store, self.js, self.index, job_id))
        return state

    async def read_back(self, job_id: str) -> tuple[SchedulerState, list[EventEnvelope]] | None:
        """For a job the live state does not hold and the log may: a state of it alone, and the events it was folded
        from (its history); None for an id that could name no job."""
        if not self._readable([job_id]):
            return None
        events = await job_events(self.store, self.js, self.index, job_id)
        state = self._empty()
        self._fold(state, events)
        return state, events

    def _empty(self) -> SchedulerState:
        """A state of no job, with the live settings, so that access is decided as for the jobs held."""
        live = self.live()
        return SchedulerState(live.cluster, settings=live.settings)

    @staticmethod
    def _fold(state: SchedulerState, events: list[EventEnvelope]) -> None:
        for envelope in events:
            if not isinstance(envelope.event, JobArchived):  # as the live state held it before it left
                state.apply(envelope)

    async def holding_array(self, array_id: str) -> SchedulerState:
        """The state that holds the array: the live one, or one read back from the log when its jobs were archived
        (they leave together): its ArraySubmitted and its jobs' own events, enough for its page (statuses, starts,
        ends, exit codes); the live one for an array never known, which is answered as not found."""
        live = self.live()
        if array_id in live.arrays or not is_array_id(array_id):
            return live
        submitted = await self.store.read_aggregate(ARRAY, array_id)
        if not submitted or not isinstance(first := submitted[0].event, ArraySubmitted):
            return live
        members = [member_id(array_id, index) for index in parse_indices(first.indices).indices]
        state = self._empty()
        self._fold(state, submitted + await self.store.read_aggregates(JOB, members))
        return state

    async def holding(self, job_id: str) -> SchedulerState:
        """The state that holds the job: the live one, or one read back from the log when it was archived (the live
        one for a job never known, which is answered as not found)."""
        archived = await self.state_of([job_id])
        return archived if archived is not None and job_id in archived.jobs else self.live()
