"""An append-only event log in PostgreSQL, one schema per service (SPEC X1).

Each event belongs to an aggregate (a job, a launch, a node) and carries that aggregate's version;
appending at a stale version raises `ConcurrencyConflict`. A global `position` orders all events of
the store. Appends take a transaction-scoped advisory lock, so positions become visible in the order
they were taken: without it a relay tailing by position could pass a lower position that commits
later and skip it for good.

A consumer that reacts to messages from elsewhere passes a `Tracking` record with its append; the
record and the events commit together, so a redelivered or replayed message has its effect once.
"""

from __future__ import annotations

import contextlib
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import msgspec

from libs.contracts.codec import decode_any, encode
from libs.contracts.events import Event, EventEnvelope
from libs.eventstore.lease import LeaseLost, leadership_sql


class ConcurrencyConflict(Exception):
    """An aggregate changed since its version was read; reload and decide again."""


class AlreadyProcessed(Exception):
    """The tracked message was processed before; nothing was written."""


# The relay publishes every event as one NATS message, whose payload (1 MiB by default) also holds
# the headers (message id, trace). An event larger than this could never be published and would
# hold up every later one, so it is refused before it is stored. Input limits (libs.contracts.jobspec)
# keep real events far below it; this is the last guard.
MAX_EVENT_BYTES = 896 * 1024


# What an envelope adds to its event, its trace and its names when published: its keys, an event id, the
# largest position and version, a full timestamp (about 200 bytes), with room to spare.
ENVELOPE_BYTES = 512


class EventTooLarge(ValueError):
    """An event would be too large to publish; nothing was written."""


@dataclass(frozen=True)
class NewEvent:
    """An event to append to `aggregate_type`/`aggregate_id`."""

    aggregate_type: str
    aggregate_id: str
    event: Event
    trace: dict[str, str] | None = None  # the trace it continues, when not the append's


@dataclass(frozen=True)
class Tracking:
    """`consumer` has processed its upstream message at `position` (e.g. a JetStream sequence).

    `upstream`: for a message from one other service's log, its position there. Unlike a stream
    sequence it stays true when the stream is made anew and the upstream's relay publishes it all
    again; `by_upstream` then says to tell what was processed by it rather than by `position`.
    """

    consumer: str
    position: int
    upstream: int | None = None
    by_upstream: bool = False

    def order(self) -> tuple[int, int]:
        """Where it stands among the consumer's positions: by stream sequence, then by upstream position (the
        events of a bundle share a sequence, `subjects.bundle_subject`)."""
        return self.position, self.upstream or 0


def _schema_sql(schema: str) -> str:
    return f"""
    CREATE SCHEMA IF NOT EXISTS {schema};
    CREATE TABLE IF NOT EXISTS {schema}.events (
        position       bigserial PRIMARY KEY,
        event_id       uuid        NOT NULL UNIQUE,
        aggregate_type text        NOT NULL,
        aggregate_id   text        NOT NULL,
        version        integer     NOT NULL,
        type           text        NOT NULL,
        data           jsonb       NOT NULL,
        trace          jsonb       NOT NULL DEFAULT '{{}}',
        recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
        UNIQUE (aggregate_type, aggregate_id, version)
    );
    CREATE TABLE IF NOT EXISTS {schema}.tracking (
        consumer text   PRIMARY KEY,
        position bigint NOT NULL
    );
    ALTER TABLE {schema}.tracking ADD COLUMN IF NOT EXISTS upstream bigint;
    CREATE TABLE IF NOT EXISTS {schema}.relay (
        id                 integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
        published_position bigint  NOT NULL DEFAULT 0
    );
    INSERT INTO {schema}.relay (id) VALUES (1) ON CONFLICT DO NOTHING;
    """ + leadership_sql(schema) + _append_sql(schema)


# Raised by the append function (below) and told apart by their SQLSTATE.
LEASE_LOST_STATE = "TYL01"
ALREADY_PROCESSED_STATE = "TYA01"


def _append_sql(schema: str) -> str:
    """One append as one statement, so that it costs one round trip to the server however many events and
    whatever tracking it carries: under the append lock, the fence, the tracking check and record, the
    events (in the order given) and the relay's wake-up, in the caller's transaction (or its own)."""
    return f"""
    CREATE OR REPLACE FUNCTION {schema}.append_events(
        lock_key bigint, fence_epoch bigint, tracked_by text, tracked_position bigint, tracked_upstream bigint,
        by_upstream boolean, event_ids uuid[], aggregate_types text[], aggregate_ids text[], versions integer[],
        types text[], data jsonb[], traces jsonb[], channel text
    ) RETURNS TABLE (event_id uuid, event_position bigint, event_recorded_at timestamptz)
    LANGUAGE plpgsql AS $body$
    DECLARE
        current_epoch bigint;
        done record;
    BEGIN
        PERFORM pg_advisory_xact_lock(lock_key);
        IF fence_epoch IS NOT NULL THEN
            SELECT l.epoch INTO current_epoch FROM {schema}.leadership l FOR SHARE;
            IF current_epoch IS DISTINCT FROM fence_epoch THEN
                RAISE EXCEPTION 'the {schema} lease passed from epoch % to %: another instance acts now; '
                                'nothing was written', fence_epoch, current_epoch USING ERRCODE = '{LEASE_LOST_STATE}';
            END IF;
        END IF;
        IF tracked_by IS NOT NULL THEN
            SELECT t.position, t.upstream INTO done FROM {schema}.tracking t WHERE t.consumer = tracked_by FOR UPDATE;
            IF FOUND AND (CASE WHEN by_upstream AND tracked_upstream IS NOT NULL AND done.upstream IS NOT NULL
                               THEN tracked_upstream <= done.upstream
                               ELSE (tracked_position, coalesce(tracked_upstream, 0))
                                    <= (done.position, coalesce(done.upstream, 0)) END) THEN
                RAISE EXCEPTION '% already processed %', tracked_by, tracked_position
                    USING ERRCODE = '{ALREADY_PROCESSED_STATE}';
            END IF;
            INSERT INTO {schema}.tracking AS t (consumer, position, upstream)
                VALUES (tracked_by, tracked_position, tracked_upstream)
                ON CONFLICT (consumer) DO UPDATE SET position = EXCLUDED.position, upstream = EXCLUDED.upstream;
        END IF;
        IF cardinality(event_ids) > 0 THEN
            RETURN QUERY
                INSERT INTO {schema}.events AS e (event_id, aggregate_type, aggregate_id, version, type, data, trace)
                SELECT u.i, u.at, u.ai, u.v, u.ty, u.d, u.tr
                FROM unnest(event_ids, aggregate_types, aggregate_ids, versions, types, data, traces)
                     WITH ORDINALITY AS u(i, at, ai, v, ty, d, tr, n)
                ORDER BY u.n
                RETURNING e.event_id, e.position, e.recorded_at;
            PERFORM pg_notify(channel, '');
        END IF;
    END;
    $body$;
    """


class EventStore:
    """The event log of one service, kept in the PostgreSQL schema named after it."""

    def __init__(self, pool: asyncpg.Pool, service: str) -> None:
        if not service.isidentifier():
            raise ValueError(f"service name {service!r} is not a valid schema name")
        self.pool = pool
        self.service = service
        self.schema = service
        self.notify_channel = f"{service}_events"
        # Distinct per store, stable across processes: the key of the append lock.
        self.lock_key = zlib.crc32(f"trainyard.{service}.append".encode())
        # The fencing epoch of the lease this process holds (libs/eventstore/lease.py): set, every write
        # checks it is still current. None: no lease is taken (tools, tests of one process).
        self.epoch: int | None = None

    async def migrate(self) -> None:
        # Two processes of one service may start together; serialise DDL between them.
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", self.lock_key + 1)
            await conn.execute(_schema_sql(self.schema))

    async def append(
        self,
        events: Sequence[NewEvent],
        *,
        expected_versions: dict[tuple[str, str], int],
        tracking: Tracking | None = None,
        trace: dict[str, str] | None = None,
    ) -> list[EventEnvelope]:
        """Append `events` atomically and return them as stored.

        `expected_versions` gives, for every aggregate touched, the version the caller decided on
        (0 for a new aggregate). Raises ConcurrencyConflict when any moved on, AlreadyProcessed
        when `tracking` shows the upstream message was handled before. An event's own `trace` wins
        over `trace`, the append's.
        """
        versions = dict(expected_versions)
        rows: list[tuple[str, str, str, int, str, str, str]] = []  # id, aggregate, version, type, data, trace
        traces: list[dict[str, str]] = []
        for new in events:
            key = (new.aggregate_type, new.aggregate_id)
            if key not in versions:
                raise ValueError(f"no expected version given for {key}")
            versions[key] += 1
            event_trace = new.trace if new.trace is not None else (trace or {})
            data, trace_json = encode(new.event).decode(), encode(event_trace).decode()
            self._check_size(new, len(data) + len(trace_json))
            rows.append((str(uuid.uuid4()), new.aggregate_type, new.aggregate_id, versions[key],
                         str(type(new.event).__struct_config__.tag), data, trace_json))
            traces.append(event_trace)
        stored = await self._call_append(rows, tracking)
        return [EventEnvelope(event_id=event_id, service=self.service, aggregate_type=new.aggregate_type,
                              aggregate_id=new.aggregate_id, version=version, position=stored[event_id][0],
                              recorded_at=stored[event_id][1], event=new.event, trace=event_trace)
                for new, (event_id, _, _, version, _, _, _), event_trace in zip(events, rows, traces, strict=True)]

    async def _call_append(self, rows: list[tuple[str, str, str, int, str, str, str]],
                           tracking: Tracking | None) -> dict[str, tuple[int, datetime]]:
        """The append function (one round trip): each stored event's position and time, by its id."""
        columns = list(zip(*rows, strict=True)) if rows else [()] * 7
        try:
            found = await self.pool.fetch(
                f"SELECT * FROM {self.schema}.append_events($1, $2, $3, $4, $5, $6, $7::uuid[], $8, $9, $10, $11, "
                "$12::jsonb[], $13::jsonb[], $14)",
                self.lock_key, self.epoch,
                tracking.consumer if tracking else None, tracking.position if tracking else None,
                tracking.upstream if tracking else None, bool(tracking and tracking.by_upstream),
                *(list(column) for column in columns), self.notify_channel,
            )
        except asyncpg.UniqueViolationError as exc:
            raise ConcurrencyConflict(f"an aggregate moved on past the version decided on: {exc.detail}") from None
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == LEASE_LOST_STATE:
                raise LeaseLost(str(exc)) from None
            if exc.sqlstate == ALREADY_PROCESSED_STATE:
                raise AlreadyProcessed(str(exc)) from None
            raise
        return {str(row["event_id"]): (row["event_position"], row["event_recorded_at"]) for row in found}

    def _check_size(self, new: NewEvent, payload: int) -> None:
        """Raise EventTooLarge when `new`, as published (`payload`: its event's and its trace's JSON), would not
        fit MAX_EVENT_BYTES."""
        size = payload + len(new.aggregate_type) + len(new.aggregate_id) + len(self.service) + ENVELOPE_BYTES
        if size > MAX_EVENT_BYTES:
            raise EventTooLarge(f"{type(new.event).__name__} for {new.aggregate_type} {new.aggregate_id} would be "
                                f"{size} bytes, over the limit of {MAX_EVENT_BYTES} for one event")

    async def record_tracking(self, tracking: Tracking) -> None:
        """Mark an upstream message as processed when handling it appended nothing."""
        with contextlib.suppress(AlreadyProcessed):
            await self._call_append([], tracking)

    async def tracked(self, consumer: str) -> tuple[int, int | None]:
        """The stream sequence and the upstream position `consumer` recorded last ((0, None): none)."""
        row = await self.pool.fetchrow(
            f"SELECT position, upstream FROM {self.schema}.tracking WHERE consumer = $1", consumer)
        return (0, None) if row is None else (int(row["position"]), row["upstream"])

    async def forget_tracked_sequence(self, consumer: str) -> None:
        """The stream `consumer` reads was made anew: its recorded sequence means nothing there any more
        (the upstream position, if any, still holds)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await self._fence(conn)
            await conn.execute(f"UPDATE {self.schema}.tracking SET position = 0 WHERE consumer = $1", consumer)

    async def _fence(self, conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record]) -> None:
        """Refuse to write once another instance took the lease; hold the lease row (FOR SHARE) until the
        transaction ends, so a takeover waits for this write and then rebuilds with it."""
        if self.epoch is None:
            return
        current = await conn.fetchval(f"SELECT epoch FROM {self.schema}.leadership FOR SHARE")
        if current != self.epoch:
            raise LeaseLost(f"the {self.service} lease passed from epoch {self.epoch} to {current}: "
                            "another instance acts now; nothing was written")

    async def tracked_position(self, consumer: str) -> int:
        value = await self.pool.fetchval(
            f"SELECT position FROM {self.schema}.tracking WHERE consumer = $1", consumer
        )
        return int(value or 0)

    async def read_all(self, after: int = 0, batch: int = 1000) -> AsyncIterator[EventEnvelope]:
        """Every event after `position`, in order: the input of a rebuild."""
        position = after
        while True:
            rows = await self.pool.fetch(
                f"""SELECT * FROM {self.schema}.events WHERE position > $1
                    ORDER BY position LIMIT $2""",
                position, batch,
            )
            for row in rows:
                yield self.envelope(row)
            if len(rows) < batch:
                return
            position = rows[-1]["position"]

    async def read_aggregate(self, aggregate_type: str, aggregate_id: str) -> list[EventEnvelope]:
        rows = await self.pool.fetch(
            f"""SELECT * FROM {self.schema}.events WHERE aggregate_type = $1 AND aggregate_id = $2
                ORDER BY version""",
            aggregate_type, aggregate_id,
        )
        return [self.envelope(row) for row in rows]

    async def read_aggregates(self, aggregate_type: str, aggregate_ids: Sequence[str]) -> list[EventEnvelope]:
        """The events of several aggregates of one kind, in the order they were stored (an array's jobs)."""
        rows = await self.pool.fetch(
            f"""SELECT * FROM {self.schema}.events WHERE aggregate_type = $1 AND aggregate_id = ANY($2::text[])
                ORDER BY position""",
            aggregate_type, list(aggregate_ids),
        )
        return [self.envelope(row) for row in rows]

    async def read_type(self, aggregate_type: str, event_type: type[msgspec.Struct], *, after: int = 0,
                        limit: int = 100) -> list[EventEnvelope]:
        """Up to `limit` events of one type on one kind of aggregate, stored after position `after`, in
        position order: a page of a query that lists them (the monitor's alerts)."""
        rows = await self.pool.fetch(
            f"""SELECT * FROM {self.schema}.events
                WHERE aggregate_type = $1 AND type = $2 AND position > $3
                ORDER BY position LIMIT $4""",
            aggregate_type, event_type.__struct_config__.tag, after, limit,
        )
        return [self.envelope(row) for row in rows]

    async def last_position(self) -> int:
        return int(await self.pool.fetchval(f"SELECT coalesce(max(position), 0) FROM {self.schema}.events"))

    def envelope(self, row: asyncpg.Record) -> EventEnvelope:
        recorded_at: datetime = row["recorded_at"]
        return EventEnvelope(
            event_id=str(row["event_id"]), service=self.service, aggregate_type=row["aggregate_type"],
            aggregate_id=row["aggregate_id"], version=row["version"], position=row["position"],
            recorded_at=recorded_at, event=decode_any(row["data"], Event),
            trace=msgspec.json.decode(row["trace"]),
        )
