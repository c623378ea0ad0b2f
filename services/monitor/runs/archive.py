"""Archived jobs (JobArchived): how the monitor still answers for a job it no longer holds.

The scheduler archives a job once it ended more than the administrator's `job_retention` ago, and the monitor then drops
all it held of it (`Monitor.archived`). The job's history stays: the scheduler's events about it on TRAINYARD_EVENTS,
the monitor's own (its run's life, its kept environment) in its log. Event subjects name no job, so the monitor notes
the stream sequence of each of the scheduler's events about a job it holds, and writes them down when the job is
archived (libs/eventstore/published.py, a table beside its log; those of a command on the archived job too). A question
about a job the monitor does not hold (`trainyard metrics`, a watch, the debug terminal, the alerts about it) reads them
back by those sequences (libs/messaging/history.py), with its own from its log, and folds them as the monitor once did:
the job's record as it was before its JobArchived, for the access check (J2) and the nodes it ran on; its run's life;
its kept environment, released by then. Only an archived job is answered so: a job not folded yet (the monitor just
started) is not known, as before, and a job that never existed has no events: both stay "not found".

The jobs asked about lately are kept (at most KEPT), until one of their events comes (an administrator's command on an
archived job records one), so that the pages of a long series cost one read of their events.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from nats.js.client import JetStreamContext

from libs.contracts.events import DebugEnvironmentKept, EventEnvelope, JobArchived
from libs.contracts.identity import Identity
from libs.contracts.ids import is_job_id
from libs.contracts.operations.base import CommandError
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import EventStore
from libs.eventstore.published import PublishedIndex
from libs.jobstatus import SCHEDULER, JobLifecycle, JobRecord
from libs.messaging.history import stored_events
from services.monitor.kept import KeptEnvironment
from services.monitor.runs import runlife
from services.monitor.runs.runlife import RunLife

MONITOR = "monitor"
KEPT = 256  # archived jobs kept after a question about them: a few KiB each
LOOKUPS_AT_ONCE = 16  # of a page of alerts about archived jobs


@dataclass
class PastJob:
    """An archived job as the monitor held it before: its record (`archived`), its run's life, its kept
    environment (released)."""

    job: JobRecord
    life: RunLife | None = None
    kept: KeptEnvironment | None = None

    def viewable(self, identity: Identity, settings: AdminSettings) -> JobRecord | None:
        """The job, if `identity` may view it under the current settings (J2), as for a job still held."""
        return JobLifecycle(jobs={self.job.job_id: self.job}, settings=settings).viewable(self.job.job_id, identity)


def fold_past(job_id: str, envelopes: Iterable[EventEnvelope]) -> PastJob | None:
    """The job as it was before its JobArchived, from its events in the order each service recorded them; None
    when it was not archived (or never existed)."""
    lifecycle = JobLifecycle()
    runs: dict[str, RunLife] = {}
    kept: KeptEnvironment | None = None
    archived = False
    for envelope in envelopes:
        event = envelope.event
        if envelope.aggregate_id != job_id:
            continue
        if envelope.service == SCHEDULER and envelope.aggregate_type == "job":
            if isinstance(event, JobArchived):
                archived = True  # what follows it (a command on the archived job) still counts
            else:
                lifecycle.apply(envelope)
        elif envelope.service == MONITOR and envelope.aggregate_type == "run":
            runlife.fold(runs, envelope)
        elif envelope.service == MONITOR and isinstance(event, DebugEnvironmentKept):
            # A job is archived only once its kept environment is released.
            kept = KeptEnvironment(job_id=job_id, attempt=event.attempt, nodes=list(event.nodes), until=event.until,
                                   released=True)
    job = lifecycle.jobs.get(job_id)
    if job is None or not archived:
        return None
    job.archived = True
    return PastJob(job=job, life=runs.get(job_id), kept=kept)


class PastJobs:
    """Archived jobs, read back when asked about (the scheduler's events from TRAINYARD_EVENTS, the monitor's own
    from its log); the latest few kept."""

    def __init__(self, js: JetStreamContext, store: EventStore, index: PublishedIndex, kept: int = KEPT) -> None:
        self.js, self.store, self.index = js, store, index
        self.most = kept
        self._kept: OrderedDict[str, PastJob] = OrderedDict()
        self._reading: dict[str, object] = {}  # job -> the latest read under way: kept if nothing came meanwhile

    async def find(self, job_id: str) -> PastJob | None:
        """The archived job, or None for one not archived (or that never existed). JetStream or PostgreSQL away
        raises."""
        if not is_job_id(job_id):  # no job's id: never looked for
            return None
        if (past := self._kept.get(job_id)) is not None:
            self._kept.move_to_end(job_id)
            return past
        reading = self._reading[job_id] = object()
        try:
            past = fold_past(job_id, await self.history(job_id))
            if past is not None and self._reading.get(job_id) is reading:
                self._keep(job_id, past)
        finally:
            if self._reading.get(job_id) is reading:
                del self._reading[job_id]
        return past

    async def history(self, job_id: str) -> list[EventEnvelope]:
        """The scheduler's events about the job where the index says they are, then the monitor's own from its log
        (each service's in the order it recorded them)."""
        scheduler = [e for e in await stored_events(self.js, await self.index.of(job_id), job_id)
                     if e.service == SCHEDULER and e.aggregate_type == "job"]
        own = [*await self.store.read_aggregate("job", job_id), *await self.store.read_aggregate("run", job_id)]
        return scheduler + own

    async def records(self, job_ids: Iterable[str]) -> dict[str, JobRecord]:
        """The records of those of `job_ids` that are archived, looked up a few at a time."""
        limit = asyncio.Semaphore(LOOKUPS_AT_ONCE)

        async def one(job_id: str) -> PastJob | None:
            async with limit:
                return await self.find(job_id)

        wanted = list(dict.fromkeys(job_ids))
        found = await asyncio.gather(*(one(job_id) for job_id in wanted))
        return {job_id: past.job for job_id, past in zip(wanted, found, strict=True) if past is not None}

    def changed(self, job_id: str) -> None:
        """One of the job's events came: what was read of it before is out of date."""
        self._kept.pop(job_id, None)
        self._reading.pop(job_id, None)

    def _keep(self, job_id: str, past: PastJob) -> None:
        self._kept[job_id] = past
        while len(self._kept) > self.most:
            self._kept.popitem(last=False)


async def job_to_answer(jobs: JobLifecycle, past: PastJobs | None, job_id: str,
                        identity: Identity) -> tuple[JobRecord, PastJob | None] | None:
    """The job `identity` asks about, if it may view it (J2): one the monitor holds (a hidden or deleted one is
    None, as before), else an archived one read back (with what the monitor held of it). JetStream away raises."""
    if job_id in jobs.jobs or past is None:
        job = jobs.viewable(job_id, identity)
        return (job, None) if job is not None else None
    archived = await past.find(job_id)
    job = archived.viewable(identity, jobs.settings) if archived is not None else None
    return (job, archived) if job is not None and archived is not None else None


def events_unavailable(exc: Exception) -> CommandError:
    """The answer when the events stream or the monitor's log, where an archived job is read back from, does not
    answer."""
    return CommandError(code="unavailable", message=f"the job's history could not be read ({type(exc).__name__})",
                        hint="JetStream or the database may be restarting; try again")
