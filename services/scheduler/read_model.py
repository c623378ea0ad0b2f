"""O2 job search: a PostgreSQL read model kept by a projection of the scheduler's own events.

The scheduler's in-memory state answers commands; searching over every job ever submitted, with
filters and visibility rules (J2), is better served by SQL with indexes. The table lives in the
scheduler's schema beside its event log and is derived from it alone, so it can always be dropped
and rebuilt from the first event.

Each batch of events is applied in one transaction together with the projection's checkpoint (the
global position of the last applied event): a crash loses the whole batch or none of it, and an
event at or below the checkpoint is never applied again. The checkpoint row is locked
(`SELECT ... FOR UPDATE`) while a batch is applied, so concurrent `catch_up` calls take turns.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg

from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobExpired,
    JobFailed,
    JobPriorityChanged,
    JobRequeued,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
)
from libs.contracts.identity import Identity
from libs.contracts.operations.jobs import JobSummary, SearchJobs, SearchResults
from libs.eventstore import EventStore

PROJECTION = "job_search"
MAX_LIMIT = 1000
"""The most rows one search returns, whatever the request asks for."""

_ENDED: dict[type, str] = {JobSucceeded: "succeeded", JobFailed: "failed", JobStopped: "stopped",
                           JobExpired: "expired"}


def _schema_sql(schema: str) -> str:
    return f"""
    CREATE SCHEMA IF NOT EXISTS {schema};
    CREATE TABLE IF NOT EXISTS {schema}.projection_checkpoints (
        name     text   PRIMARY KEY,
        position bigint NOT NULL DEFAULT 0
    );
    INSERT INTO {schema}.projection_checkpoints (name) VALUES ('{PROJECTION}') ON CONFLICT DO NOTHING;
    CREATE TABLE IF NOT EXISTS {schema}.job_search (
        job_id              text        PRIMARY KEY,
        name                text        NOT NULL,
        project             text        NOT NULL,
        creator             text        NOT NULL,
        access              text        NOT NULL,
        status              text        NOT NULL,
        priority            text        NOT NULL,
        mode                text        NOT NULL,
        flavors             text[]      NOT NULL,
        flavor              text,
        algorithm           text,
        algorithm_source    text,
        algorithms          text[]      NOT NULL,
        favorite_algorithms text[]      NOT NULL,
        output              text,
        submitted_at        timestamptz NOT NULL,
        ended_at            timestamptz,
        deleted             boolean     NOT NULL DEFAULT false,
        position            bigint      NOT NULL
    );
    -- Added after the first release: rows projected before it keep NULL until a rebuild.
    ALTER TABLE {schema}.job_search ADD COLUMN IF NOT EXISTS nodes integer;
    CREATE INDEX IF NOT EXISTS job_search_newest ON {schema}.job_search (submitted_at DESC, job_id);
    CREATE INDEX IF NOT EXISTS job_search_creator ON {schema}.job_search (creator);
    CREATE INDEX IF NOT EXISTS job_search_project ON {schema}.job_search (project);
    CREATE INDEX IF NOT EXISTS job_search_status ON {schema}.job_search (status);
    CREATE INDEX IF NOT EXISTS job_search_output ON {schema}.job_search (output);
    CREATE INDEX IF NOT EXISTS job_search_flavors ON {schema}.job_search USING gin (flavors);
    CREATE INDEX IF NOT EXISTS job_search_algorithms ON {schema}.job_search USING gin (algorithms);
    CREATE INDEX IF NOT EXISTS job_search_favorite_algorithms
        ON {schema}.job_search USING gin (favorite_algorithms);
    """


def escape_like(text: str) -> str:
    """Make `text` match itself literally inside a LIKE pattern that uses `ESCAPE '\\'`."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class JobSearchProjection:
    """Keeps `<scheduler schema>.job_search` in step with the scheduler's event log and searches it."""

    def __init__(self, store: EventStore, *, batch_size: int = 500) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.store = store
        self.pool = store.pool
        self.schema = store.schema
        self.batch_size = batch_size
        # Stable across processes, distinct per schema: serialises concurrent migrations.
        self._migrate_lock = zlib.crc32(f"trainyard.{self.schema}.{PROJECTION}.migrate".encode())

    async def migrate(self) -> None:
        """Create the table, indexes and checkpoint row; safe to run again or from two processes."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", self._migrate_lock)
            await conn.execute(_schema_sql(self.schema))

    async def checkpoint(self) -> int:
        """The global position of the last event applied."""
        return int(await self.pool.fetchval(
            f"SELECT position FROM {self.schema}.projection_checkpoints WHERE name = $1", PROJECTION,
        ))

    async def catch_up(self) -> int:
        """Apply every stored event after the checkpoint, batch by batch; return how many (ignored kinds too)."""
        applied = 0
        while True:
            seen = await self.checkpoint()
            batch = await self._read_batch(after=seen)
            if not batch:
                return applied
            async with self.pool.acquire() as conn, conn.transaction():
                checkpoint = await self._lock_checkpoint(conn)
                if checkpoint < seen:
                    continue  # rebuilt meanwhile: this batch does not start at the checkpoint; read again
                # Another caller may have applied part of the batch while this one was reading it.
                pending = [envelope for envelope in batch if envelope.position > checkpoint]
                if not pending:
                    continue
                statements = [found for envelope in pending if (found := self._statement(envelope)) is not None]
                for sql, rows in in_runs(statements):
                    await conn.executemany(sql, rows)
                await conn.execute(
                    f"UPDATE {self.schema}.projection_checkpoints SET position = $2 WHERE name = $1",
                    PROJECTION, pending[-1].position,
                )
            applied += len(pending)

    async def rebuild(self) -> None:
        """Forget every row and the checkpoint, then catch up from the first event.

        Use after a change to how events are projected. Searches made before it finishes see only
        the jobs replayed so far.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            await self._lock_checkpoint(conn)
            await conn.execute(f"DELETE FROM {self.schema}.job_search")
            await conn.execute(
                f"UPDATE {self.schema}.projection_checkpoints SET position = 0 WHERE name = $1", PROJECTION,
            )
        await self.catch_up()

    async def search(self, query: SearchJobs, identity: Identity, *, sharing_enabled: bool) -> SearchResults:
        """O2: a page of the jobs `identity` may see (J2) matching every filter given, newest first, and how
        many match in all."""
        conditions = ["NOT deleted"]
        args: list[Any] = []

        def param(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if not identity.admin:
            mine = f"creator = {param(identity.user)}"
            if sharing_enabled:
                shared = f"(project = ANY({param(list(identity.projects))}::text[]) AND access <> 'none')"
                conditions.append(f"({mine} OR {shared})")
            else:
                conditions.append(mine)
        if query.name is not None:
            conditions.append(f"lower(name) LIKE '%' || lower({param(escape_like(query.name))}) || '%' ESCAPE '\\'")
        if query.statuses:
            conditions.append(f"status = ANY({param(list(query.statuses))}::text[])")
        if query.creator is not None:
            conditions.append(f"creator = {param(query.creator)}")
        # `@>` rather than `= ANY(column)`, so that the GIN indexes on the arrays can serve it.
        if query.algorithm is not None:
            conditions.append(f"algorithms @> ARRAY[{param(query.algorithm)}::text]")
        if query.favorite_algorithm is not None:
            conditions.append(f"favorite_algorithms @> ARRAY[{param(query.favorite_algorithm)}::text]")
        if query.flavor is not None:
            conditions.append(f"flavors @> ARRAY[{param(query.flavor)}::text]")
        if query.output is not None:
            conditions.append(f"output = {param(query.output)}")
        if query.project is not None:
            conditions.append(f"project = {param(query.project)}")
        where = " AND ".join(conditions)
        counted = len(args)  # the count takes the filters' values only, not the page's
        limit, offset = param(max(0, min(query.limit, MAX_LIMIT))), param(max(0, query.offset))
        # One snapshot for both, so that the total and the page agree while events are being applied.
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            rows = await conn.fetch(
                f"""SELECT job_id, name, project, creator, status, priority, mode, flavors, flavor, algorithm,
                           algorithm_source, output, submitted_at, ended_at, nodes, access
                    FROM {self.schema}.job_search
                    WHERE {where}
                    ORDER BY submitted_at DESC, job_id
                    LIMIT {limit} OFFSET {offset}""",
                *args,
            )
            total = await conn.fetchval(f"SELECT count(*) FROM {self.schema}.job_search WHERE {where}",
                                        *args[:counted])
        jobs = [
            JobSummary(
                job_id=row["job_id"], name=row["name"], project=row["project"], creator=row["creator"],
                status=row["status"], priority=row["priority"], mode=row["mode"], flavors=list(row["flavors"]),
                flavor=row["flavor"], algorithm=row["algorithm"], algorithm_source=row["algorithm_source"],
                output=row["output"], submitted_at=row["submitted_at"], ended_at=row["ended_at"], nodes=row["nodes"],
                access=row["access"] if sharing_enabled else "none",
            )
            for row in rows
        ]
        return SearchResults(jobs=jobs, total=int(total))

    # --- applying events ---------------------------------------------------------------------------

    async def _read_batch(self, after: int) -> list[EventEnvelope]:
        batch: list[EventEnvelope] = []
        async for envelope in self.store.read_all(after=after, batch=self.batch_size):
            batch.append(envelope)
            if len(batch) >= self.batch_size:
                break
        return batch

    async def _lock_checkpoint(self, conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record]) -> int:
        """Lock the checkpoint row for this transaction and return its position."""
        position = await conn.fetchval(
            f"SELECT position FROM {self.schema}.projection_checkpoints WHERE name = $1 FOR UPDATE", PROJECTION,
        )
        if position is None:
            raise RuntimeError(f"{self.schema}.{PROJECTION} has no checkpoint: run migrate() first")
        return int(position)

    def _statement(self, envelope: EventEnvelope) -> tuple[str, tuple[Any, ...]] | None:
        """The statement (and its values) that applies one event to the table; None for events it ignores."""
        event = envelope.event
        table = f"{self.schema}.job_search"
        if isinstance(event, JobSubmitted):
            spec = event.spec
            refs = [spec.algorithm] if spec.algorithm is not None else []
            refs += [task.algorithm for task in spec.tasks]
            first = refs[0] if refs else None
            # An upsert, so that a job id seen again replaces its row rather than failing the batch.
            return (
                f"""INSERT INTO {table} (job_id, name, project, creator, access, status, priority, mode, flavors,
                        flavor, algorithm, algorithm_source, algorithms, favorite_algorithms, output,
                        submitted_at, ended_at, deleted, position, nodes)
                    VALUES ($1, $2, $3, $4, $5, 'queued', $6, $7, $8, NULL, $9, $10, $11, $12, $13, $14, NULL,
                            false, $15, $16)
                    ON CONFLICT (job_id) DO UPDATE SET
                        name = EXCLUDED.name, project = EXCLUDED.project, creator = EXCLUDED.creator,
                        access = EXCLUDED.access, status = EXCLUDED.status, priority = EXCLUDED.priority,
                        mode = EXCLUDED.mode, flavors = EXCLUDED.flavors, flavor = EXCLUDED.flavor,
                        algorithm = EXCLUDED.algorithm, algorithm_source = EXCLUDED.algorithm_source,
                        algorithms = EXCLUDED.algorithms, favorite_algorithms = EXCLUDED.favorite_algorithms,
                        output = EXCLUDED.output, submitted_at = EXCLUDED.submitted_at,
                        ended_at = EXCLUDED.ended_at, deleted = EXCLUDED.deleted, position = EXCLUDED.position,
                        nodes = EXCLUDED.nodes""",
                (event.job_id, spec.name, spec.project, event.creator, spec.access, spec.priority, spec.mode,
                 list(spec.flavors), first.name if first else None, first.source if first else None,
                 _unique(ref.name for ref in refs if ref.source == "private"),
                 _unique(ref.name for ref in refs if ref.source == "favorite"),
                 spec.output.name if spec.output else None, envelope.recorded_at, envelope.position, spec.nodes))
        if isinstance(event, JobAdmitted):
            return (f"UPDATE {table} SET status = 'running', flavor = $2, position = $3 WHERE job_id = $1",
                    (event.job_id, event.flavor, envelope.position))
        if isinstance(event, JobRequeued):  # moved after a fault (J12) or waiting to restart (J13)
            return (f"UPDATE {table} SET status = 'queued', position = $2 WHERE job_id = $1",
                    (event.job_id, envelope.position))
        if isinstance(event, JobSucceeded | JobFailed | JobStopped | JobExpired):
            return (f"UPDATE {table} SET status = $2, ended_at = $3, position = $4 WHERE job_id = $1",
                    (event.job_id, _ENDED[type(event)], envelope.recorded_at, envelope.position))
        if isinstance(event, JobPriorityChanged):
            return (f"UPDATE {table} SET priority = $2, position = $3 WHERE job_id = $1",
                    (event.job_id, event.priority, envelope.position))
        if isinstance(event, JobDeleted):
            return (f"UPDATE {table} SET deleted = true, position = $2 WHERE job_id = $1",
                    (event.job_id, envelope.position))
        return None


def in_runs(statements: Sequence[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The statements of a batch as runs of one kind, each run one `executemany` for all its rows. Every
    statement writes only the row of its job (its first value), so those of different jobs may go in any order:
    the first statement of each job comes first, in runs by kind, then the second of each, and so on. A job's
    row still sees its events as they came, and a batch of interleaved jobs (submitted, admitted, ended) is a
    few runs instead of one for nearly every event."""
    layers: list[dict[str, list[tuple[Any, ...]]]] = []
    seen: collections.Counter[Any] = collections.Counter()
    for sql, values in statements:
        layer = seen[values[0]]
        seen[values[0]] += 1
        if layer == len(layers):
            layers.append({})
        layers[layer].setdefault(sql, []).append(values)
    return [(sql, rows) for layer in layers for sql, rows in layer.items()]


def _unique(names: Iterable[str]) -> list[str]:
    """Names in first-seen order without repeats (a batch job may use one algorithm in many tasks)."""
    return list(dict.fromkeys(names))
