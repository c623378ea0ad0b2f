"""Snapshots of past states, so that a view of a past instant need not replay the log from its first event.

While a past state is made (past.py), every `SNAPSHOT_EVENTS` events folded it is saved: the state and the
prediction cache, pickled and compressed, with where it stands in each source. A later past instant starts from
the latest snapshot at or before it and folds only the events after, and a start of the scheduler from the latest
(start_snapshots.py). They are a cache: made from the log, and dropped when the code that made them changes
(`FORMAT`).

Pickle takes the state whole: the scheduler's own dataclasses (the jobs, the indexes over them that refer to the same
objects, the runtime model's samples), not a message. Only the jobs, nearly all of a large state, are each written
by msgspec inside it: pickle spent some 60 µs on a job (its datetimes, its spec's many small structs, every object
memoized), msgspec 8 to write it and 13 to read it back (typed, with its spec and events), and pickle still keeps
one object for a job the indexes share. The table is in the scheduler's own schema, written only by the scheduler.
"""

from __future__ import annotations

import copy
import copyreg
import hashlib
import io
import json
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import msgspec

from libs.skeleton.eventsourced import collector_paused
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.planning.prediction_cache import PredictionCache

# Events folded between two snapshots, so that a view or a start folds at most that many after restoring one: a
# state of 250,000 jobs took some 4.5 s to save and 4 s to restore, and 100,000 of its own events and 100,000
# followed messages some 5 s to fold, on the slower of the machines measured (benchmarks.md); 50,000 keeps the worst
# case within 10 s there, for a snapshot made in the background every 50,000 events (some 10 s of a worker thread).
SNAPSHOT_EVENTS = 50_000
_ROOT = Path(__file__).resolve().parents[3]
# The code whose objects a snapshot holds: the scheduler (every package of it), the contracts and libs.
_CODE = ("services/scheduler/**/*.py", "libs/contracts/*.py", "libs/*.py")


def _format() -> str:
    """A digest of the code whose objects a snapshot holds: a snapshot made by other code is not read."""
    digest = hashlib.sha256()
    for pattern in _CODE:
        for path in sorted(_ROOT.glob(pattern)):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


FORMAT = _format()


@dataclass(frozen=True)
class Snapshot:
    at: datetime  # every event recorded up to it is folded (and some recorded at it)
    events: int  # folded in all
    own_after: int  # the position in the own log of the last event folded
    upstream_after: dict[str, int]  # per subject followed, the stream sequence of the last message folded
    data: bytes


_JOB_ENCODER = msgspec.msgpack.Encoder()
_JOB_DECODER = msgspec.msgpack.Decoder(Job)


def _job(data: bytes) -> Job:
    """A job as `_job_written` wrote it (named in the pickle: keep its name)."""
    job = _JOB_DECODER.decode(data)
    if job.queued_as is not None or job.running_as is not None:
        job.changed()  # how the decision logic saw it: worked out again from the job when next asked
    return job


def _job_written(job: Job) -> tuple[Callable[[bytes], Job], tuple[bytes]]:
    return _job, (_JOB_ENCODER.encode(job),)


_REDUCERS: dict[type, Callable[[Any], Any]] = {**copyreg.dispatch_table, Job: _job_written}


Versions = dict[tuple[str, str], int]
"""The version of every aggregate of the scheduler's own log folded (what its next records append at)."""


def dump(state: SchedulerState, predictions: PredictionCache, versions: Versions) -> bytes:
    kept = copy.copy(predictions)
    kept._snapshot = None  # a plan of that moment: made again when asked for
    written = io.BytesIO()
    pickler = pickle.Pickler(written, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REDUCERS  # for jobs only: every other object is pickled as ever
    with collector_paused():
        pickler.dump((state, kept, versions))
    return zlib.compress(written.getbuffer(), 1)


def load(data: bytes) -> tuple[SchedulerState, PredictionCache, Versions]:
    with collector_paused():  # it would scan the objects made again and again, as in a rebuild
        state, predictions, versions = pickle.loads(zlib.decompress(data))  # written by this scheduler only
    if not isinstance(state, SchedulerState) or not isinstance(predictions, PredictionCache) or \
            not isinstance(versions, dict):
        raise TypeError("not a snapshot of the scheduler's state")
    return state, predictions, versions


class PastSnapshots:
    """The snapshots of past states in the scheduler's schema; a start restores one too (start_snapshots.py)."""

    def __init__(self, pool: asyncpg.Pool, schema: str = "scheduler") -> None:
        self.pool, self.table = pool, f"{schema}.past_snapshots"

    async def migrate(self) -> None:
        await self.pool.execute(f"""
            CREATE TABLE IF NOT EXISTS {self.table} (
                format text NOT NULL, at timestamptz NOT NULL, events bigint NOT NULL, own_after bigint NOT NULL,
                upstream_after jsonb NOT NULL, data bytea NOT NULL, PRIMARY KEY (format, at))""")
        await self.pool.execute(f"DELETE FROM {self.table} WHERE format <> $1", FORMAT)  # made by other code

    async def latest(self, at: datetime | None = None) -> Snapshot | None:
        """The latest snapshot at or before `at` (None: of all)."""
        row = await self.pool.fetchrow(
            f"""SELECT at, events, own_after, upstream_after, data FROM {self.table}
                WHERE format = $1 AND ($2::timestamptz IS NULL OR at <= $2) ORDER BY at DESC LIMIT 1""", FORMAT, at)
        if row is None:
            return None
        return Snapshot(at=row["at"], events=row["events"], own_after=row["own_after"],
                        upstream_after=json.loads(row["upstream_after"]), data=bytes(row["data"]))

    async def recent(self, limit: int) -> list[Snapshot]:
        """The latest `limit` snapshots, latest first, without their data (`latest(at)` reads one whole)."""
        rows = await self.pool.fetch(
            f"""SELECT at, events, own_after, upstream_after FROM {self.table} WHERE format = $1
                ORDER BY at DESC LIMIT $2""", FORMAT, limit)
        return [Snapshot(at=row["at"], events=row["events"], own_after=row["own_after"],
                         upstream_after=json.loads(row["upstream_after"]), data=b"") for row in rows]

    async def latest_own_after(self) -> int:
        """Where the latest snapshot stands in the own log (0: none), without reading its data."""
        return int(await self.pool.fetchval(
            f"SELECT coalesce(max(own_after), 0) FROM {self.table} WHERE format = $1", FORMAT))

    async def save(self, snapshot: Snapshot) -> None:
        await self.pool.execute(
            f"""INSERT INTO {self.table} (format, at, events, own_after, upstream_after, data)
                VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING""",
            FORMAT, snapshot.at, snapshot.events, snapshot.own_after, json.dumps(snapshot.upstream_after),
            snapshot.data)
