"""Snapshots of a service's live state, saved with its own log, so that a start folds only what came after the latest.

Without them a start folds the service's whole log and replays every stream it follows from the first message: the
time and the memory of a start grow with the history for ever, and the jobs archived long ago are held again until
their JobArchived is replayed. A service that opts in (`EventSourcedService.snapshot_code`, `save_state`,
`load_state`) saves its state every SNAPSHOT_EVENTS events folded (its own and the messages it follows), with where
it stands in each: the last position of its own log folded, and per subject filter followed the stream sequence up
to which its messages are handled (`StreamFollower.positions`). A start restores the latest it can read, folds its
own log after it and follows each stream after what it holds (`Restored`), so that it costs the state held (the
jobs not yet archived) and the events since that snapshot.

A snapshot is taken from the live state under the service's lock, and only when nothing folded waits for its
reaction (`upstream_positions`): a follower beginning after a message the state holds never reacts to it, so the
state must hold none whose reaction is not recorded. A reaction that calls out first (`Upstream.handle`: the
monitor's pre-check), a fold or a reaction that failed and waits to be tried again, and a run of messages that broke
part-way leave a message folded and not yet answered: the snapshot waits until its follower has handled it whole.
Likewise it waits while an append made outside the lock is under way, so that every event of the log up to the
position saved is folded.

Snapshots are a cache of the log, kept in the service's own schema (`<schema>.start_snapshots`, the latest
KEPT_SNAPSHOTS): one made by other code (`code_format`) or that cannot be read is passed over, and so is one taken
while a stream it follows was another (made anew since, its messages numbered afresh): the log has it all.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path

import asyncpg
import msgspec

from libs.contracts.scheduling import AdminSettings
from libs.eventstore.lease import LeaseLost
from libs.jobstatus import JobLifecycle, JobRecord
from libs.messaging.follower import starts_part_way

# Events folded (the own log's and the followed streams' messages) between two snapshots: a start folds at most
# about that many after restoring the latest, as the scheduler's snapshots of past states do.
SNAPSHOT_EVENTS = 50_000
KEPT_SNAPSHOTS = 3  # the latest kept; older ones are deleted as a new one is saved
CHECK_SECONDS = 1.0  # how often the snapshot loop looks whether one is due, or tries again one put off
_ROOT = Path(__file__).resolve().parents[2]

Versions = dict[tuple[str, str], int]


@cache
def code_format(patterns: tuple[str, ...]) -> str:
    """A digest of the code a service's snapshot depends on (its state, its folds, the contracts it holds): a
    snapshot made by other code is not read. `patterns`: globs from the project's root."""
    digest = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(_ROOT.glob(pattern)):
            digest.update(path.relative_to(_ROOT).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class FollowedNow:
    """What the snapshot rule needs of one follower: what it has handled whole, and up to where."""

    consumer: str
    through: int  # the stream sequence of the last message handled whole
    positions: Mapping[str, int]  # per subject filter, what a state saved now holds
    stateless: bool = False  # its messages change nothing the state holds (reactions only)


class Unsaveable(Exception):
    """A state that no snapshot can hold: a follower that folds into it reads a filter it cannot begin part-way."""


def upstream_positions(followers: Iterable[FollowedNow], folding: Mapping[str, int]) -> dict[str, int] | None:
    """Per subject filter followed, the stream sequence up to which the state holds its messages, every one of them
    answered; None while a follower has a message folded (or being folded: `folding`, per consumer the sequence of
    the last message whose fold began) that it has not handled whole, whose reaction may not be recorded yet.

    A filter with wildcards inside (`a.*.b`) cannot be followed part-way (`starts_part_way`): a follower that only
    reacts to its messages (the monitor's of every service's set-aside records) is left out, and replays them from
    the first after a restore, reacting to none it answered; one whose messages change the state cannot be."""
    found: dict[str, int] = {}
    for follower in followers:
        if folding.get(follower.consumer, 0) > follower.through:
            return None
        for subject, through in follower.positions.items():
            if starts_part_way(subject):
                found[subject] = through
            elif not follower.stateless:
                raise Unsaveable(f"{follower.consumer} folds {subject}, which a follower cannot begin part-way")
    return found


@dataclass(frozen=True)
class Taken:
    """A snapshot as taken under the lock, before it is compressed and saved."""

    own_after: int  # the position of the last own event folded; every one up to it is
    events: int  # own events the state holds (folded in all, counting those of the snapshots it began from)
    upstream_after: dict[str, int]  # per subject filter followed, the stream sequence up to which it is folded
    streams: dict[str, str]  # per stream followed, when it was made (a stream made anew numbers afresh)
    state: bytes  # `save_state()`
    versions: bytes  # `encode_versions`


@dataclass(frozen=True)
class Snapshot:
    """A snapshot as stored (`data` and `versions` compressed; empty when only its description was read)."""

    id: int
    at: datetime
    own_after: int
    events: int
    upstream_after: dict[str, int]
    streams: dict[str, str]
    data: bytes = b""
    versions: bytes = b""


_VERSIONS = msgspec.msgpack.Decoder(list[tuple[str, str, int]])


def encode_versions(versions: Versions) -> bytes:
    return msgspec.msgpack.encode([(kind, key, version) for (kind, key), version in versions.items()])


def decode_versions(data: bytes) -> Versions:
    return {(kind, key): version for kind, key, version in _VERSIONS.decode(data)}


def compress(data: bytes) -> bytes:
    """zlib's fastest level: a state is highly repetitive (the same spec fields, names, traces), and compressing
    happens in a worker thread while the service goes on (zlib lets the other threads run)."""
    return zlib.compress(data, 1)


def decompress(data: bytes) -> bytes:
    return zlib.decompress(data)


def stream_born(created: datetime | None) -> str:
    """How a stream's creation time is kept in a snapshot ("" when the server did not tell)."""
    return created.isoformat() if created is not None else ""


def streams_unchanged(saved: Mapping[str, str], now: Mapping[str, str]) -> bool:
    """Whether every stream a snapshot follows is the one it followed then (made at the same time, as told)."""
    return all(born and now.get(stream) == born for stream, born in saved.items())


class StartSnapshots:
    """The snapshots of one service's state in its own schema, written only by the instance holding its lease."""

    def __init__(self, pool: asyncpg.Pool, schema: str, format: str) -> None:
        self.pool, self.schema, self.format = pool, schema, format
        self.table = f"{schema}.start_snapshots"

    async def migrate(self) -> None:
        await self.pool.execute(f"""
            CREATE TABLE IF NOT EXISTS {self.table} (
                id bigserial PRIMARY KEY, format text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
                own_after bigint NOT NULL, events bigint NOT NULL, upstream_after jsonb NOT NULL,
                streams jsonb NOT NULL, versions bytea NOT NULL, data bytea NOT NULL)""")

    async def recent(self, limit: int = KEPT_SNAPSHOTS) -> list[Snapshot]:
        """The latest `limit` snapshots this code can read, latest first, without their data."""
        rows = await self.pool.fetch(
            f"""SELECT id, at, own_after, events, upstream_after, streams FROM {self.table} WHERE format = $1
                ORDER BY id DESC LIMIT $2""", self.format, limit)
        return [Snapshot(id=row["id"], at=row["at"], own_after=row["own_after"], events=row["events"],
                         upstream_after=json.loads(row["upstream_after"]), streams=json.loads(row["streams"]))
                for row in rows]

    async def read(self, snapshot: Snapshot) -> Snapshot | None:
        """The snapshot with its data (None: deleted since)."""
        row = await self.pool.fetchrow(f"SELECT data, versions FROM {self.table} WHERE id = $1", snapshot.id)
        if row is None:
            return None
        return Snapshot(id=snapshot.id, at=snapshot.at, own_after=snapshot.own_after, events=snapshot.events,
                        upstream_after=snapshot.upstream_after, streams=snapshot.streams, data=bytes(row["data"]),
                        versions=bytes(row["versions"]))

    async def save(self, taken: Taken, data: bytes, versions: bytes, epoch: int | None) -> None:
        """Save a snapshot (`data` and `versions` compressed) and delete all but the latest KEPT_SNAPSHOTS, and those
        made by other code; refused (LeaseLost) once another instance holds the lease, as every write is."""
        async with self.pool.acquire() as conn, conn.transaction():
            if epoch is not None:
                current = await conn.fetchval(f"SELECT epoch FROM {self.schema}.leadership FOR SHARE")
                if current != epoch:
                    raise LeaseLost(f"the {self.schema} lease passed from epoch {epoch} to {current}: another "
                                    "instance acts now; no snapshot was saved")
            await conn.execute(
                f"""INSERT INTO {self.table} (format, own_after, events, upstream_after, streams, versions, data)
                    VALUES ($1, $2, $3, $4, $5, $6, $7)""",
                self.format, taken.own_after, taken.events, json.dumps(taken.upstream_after),
                json.dumps(taken.streams), versions, data)
            await conn.execute(
                f"""DELETE FROM {self.table} WHERE format <> $1 OR id NOT IN (
                        SELECT id FROM {self.table} WHERE format = $1 ORDER BY id DESC LIMIT $2)""",
                self.format, KEPT_SNAPSHOTS)


# --- the job lifecycle every service embeds (libs.jobstatus), saved the same way by each ---------------------------


class SavedLifecycle(msgspec.Struct, array_like=True):
    """`JobLifecycle` as a snapshot holds it: its jobs in the order they were submitted, and the settings."""

    jobs: list[JobRecord]
    settings: AdminSettings


def save_lifecycle(lifecycle: JobLifecycle) -> SavedLifecycle:
    return SavedLifecycle(jobs=list(lifecycle.jobs.values()), settings=lifecycle.settings)


def load_lifecycle(saved: SavedLifecycle, into: JobLifecycle | None = None) -> JobLifecycle:
    """The lifecycle saved, put in place in `into` (whose readers keep it) or in a new one."""
    lifecycle = into if into is not None else JobLifecycle()
    lifecycle.jobs.clear()
    lifecycle.jobs.update((job.job_id, job) for job in saved.jobs)
    lifecycle.settings = saved.settings
    return lifecycle


def sorted_list(items: Iterable[str]) -> list[str]:
    """A set saved in one order whatever the order it was filled in: two equal states save the same bytes."""
    return sorted(items)
