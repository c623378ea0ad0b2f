"""Where another service's events about each job that left a service's state are stored in TRAINYARD_EVENTS.

Event subjects name no job (libs/contracts/subjects.py), so a job's history is read back by the stream sequences of
its events (libs/messaging/history.py). A service notes those of the events it follows about a job while it holds
the job; when the job leaves its state (archived) they are written to a table beside its log, `published_events`
(job id, stream sequence), and read from there. Until written they are held here (`note`), so that no reader finds
a job neither in the state nor in the table. What is written names messages read again from the stream, so a write
done twice (a message handled again after a restart) changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from libs.eventstore.store import EventStore


class PublishedIndex:
    def __init__(self, store: EventStore) -> None:
        self.store = store  # its pool and schema, the log's
        self._unwritten: dict[str, list[int]] = {}

    @property
    def table(self) -> str:
        return f"{self.store.schema}.published_events"

    async def migrate(self) -> None:
        await self.store.pool.execute(f"""CREATE TABLE IF NOT EXISTS {self.table} (
            job_id text NOT NULL, sequence bigint NOT NULL, PRIMARY KEY (job_id, sequence))""")

    def note(self, job_id: str, sequences: Iterable[int]) -> None:
        """The job left the state: these are where its events are, to be written (`write`)."""
        self._unwritten[job_id] = sorted({*self._unwritten.get(job_id, ()), *sequences})

    async def write(self, *job_ids: str) -> None:
        """Write what is noted of those jobs (all of them: none named); PostgreSQL away raises, and it stays noted."""
        written = {job_id: self._unwritten[job_id] for job_id in (job_ids or list(self._unwritten))
                   if job_id in self._unwritten}
        if not written:
            return
        rows = [(job_id, sequence) for job_id, sequences in written.items() for sequence in sequences]
        await self.store.pool.execute(
            f"""INSERT INTO {self.table} (job_id, sequence) SELECT * FROM unnest($1::text[], $2::bigint[])
                ON CONFLICT DO NOTHING""", [job_id for job_id, _ in rows], [sequence for _, sequence in rows])
        for job_id, sequences in written.items():
            if self._unwritten.get(job_id) is sequences:
                del self._unwritten[job_id]

    async def of(self, job_id: str) -> list[int]:
        """Where the job's events are, written or still noted, in stream order."""
        rows = await self.store.pool.fetch(f"SELECT sequence FROM {self.table} WHERE job_id = $1", job_id)
        return sorted({row["sequence"] for row in rows} | set(self._unwritten.get(job_id, ())))
