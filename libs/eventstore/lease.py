"""One active instance per service: a lease in the service's own schema, and a fencing epoch.

Several instances of a service may run (a standby beside the active one). Only the holder of the lease
acts: it rebuilds its state, follows its upstreams, answers requests and appends. The others wait in
`acquire` and answer nothing. The lease is a row, `<schema>.leadership`, holding the current `epoch`,
its holder and when it was last renewed, all in PostgreSQL's clock:

- the holder renews it every `ttl / 4`; a lease not renewed for `ttl` may be taken by another
  instance, which increments the epoch (a dead, paused or cut-off holder loses it that way);
- a graceful shutdown gives it up at once, so a standby takes over without waiting for `ttl`;
- every append checks, in its transaction, that the epoch is still the appender's (and holds the row
  against a takeover until it commits): a holder that lost the lease, paused for a while say, can
  never append again (`LeaseLost`), even before it learns that it lost it;
- a holder that cannot renew because the database is away keeps acting as far as it can (nothing can
  be appended meanwhile, nor taken over); once the database is back it renews, or learns it lost the
  lease and stops.

A session advisory lock would not do: a paused process keeps its connection, and with it the lock.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable

import asyncpg

from libs.outages import OUTAGES
from libs.telemetry.logs import get_logger

log = get_logger(__name__)

LEASE_TTL_SECONDS = float(os.environ.get("TRAINYARD_LEASE_SECONDS", "5"))


class LeaseLost(Exception):
    """Another instance holds the service's lease now: this one must not act any more."""


def leadership_sql(schema: str) -> str:
    return f"""
    CREATE TABLE IF NOT EXISTS {schema}.leadership (
        id         integer     PRIMARY KEY DEFAULT 1 CHECK (id = 1),
        epoch      bigint      NOT NULL DEFAULT 0,
        holder     text        NOT NULL DEFAULT '',
        renewed_at timestamptz NOT NULL DEFAULT '-infinity'
    );
    INSERT INTO {schema}.leadership (id) VALUES (1) ON CONFLICT DO NOTHING;
    """


def instance_name() -> str:
    """Who holds a lease, for the logs and `leadership.holder`: host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    """The lease of one service's schema, as one instance sees it."""

    def __init__(self, pool: asyncpg.Pool, schema: str, *, holder: str | None = None,
                 ttl_seconds: float = LEASE_TTL_SECONDS) -> None:
        self.pool = pool
        self.schema = schema
        self.holder = holder or instance_name()
        self.ttl_seconds = ttl_seconds
        self.epoch: int | None = None

    async def try_acquire(self) -> int | None:
        """Take the lease if it is free (never held, given up, or not renewed for `ttl`); its new epoch."""
        epoch = await self.pool.fetchval(
            f"""UPDATE {self.schema}.leadership
                SET epoch = epoch + 1, holder = $1, renewed_at = clock_timestamp()
                WHERE renewed_at < clock_timestamp() - make_interval(secs => $2)
                RETURNING epoch""",
            self.holder, self.ttl_seconds)
        if epoch is None:
            return None
        self.epoch = int(epoch)
        return self.epoch

    async def acquire(self, poll_seconds: float = 0.5, waiting: Callable[[str], None] | None = None) -> int:
        """Wait until this instance holds the lease (riding out database outages); its epoch."""
        told = False
        while True:
            try:
                epoch = await self.try_acquire()
            except OUTAGES:
                epoch = None
            if epoch is not None:
                return epoch
            if not told and waiting is not None:
                holder = await self._holder()
                waiting(holder)
                told = True
            await asyncio.sleep(poll_seconds)

    async def _holder(self) -> str:
        try:
            return str(await self.pool.fetchval(f"SELECT holder FROM {self.schema}.leadership"))
        except Exception:
            return "unknown"

    async def renew(self) -> None:
        """Renew the lease; LeaseLost when another instance took it meanwhile."""
        renewed = await self.pool.fetchval(
            f"""UPDATE {self.schema}.leadership SET renewed_at = clock_timestamp()
                WHERE epoch = $1 AND holder = $2 RETURNING epoch""",
            self.epoch, self.holder)
        if renewed is None:
            raise LeaseLost(f"the {self.schema} lease of epoch {self.epoch} was taken over by another instance")

    async def keep(self, lost: Callable[[LeaseLost], Awaitable[None]] | None = None) -> None:
        """Renew for as long as the lease is held; return (after `lost`) once it is not."""
        while True:
            await asyncio.sleep(self.ttl_seconds / 4)
            try:
                await self.renew()
            except LeaseLost as exc:
                log.error("lease.lost", schema=self.schema, epoch=self.epoch, error=str(exc))
                if lost is not None:
                    await lost(exc)
                return
            except OUTAGES as exc:
                log.warning("lease.not_renewed", schema=self.schema, epoch=self.epoch, error=repr(exc))

    async def give_up(self) -> None:
        """Let a standby take over at once (a graceful shutdown)."""
        if self.epoch is None:
            return
        await self.pool.execute(
            f"""UPDATE {self.schema}.leadership SET renewed_at = '-infinity'
                WHERE epoch = $1 AND holder = $2""", self.epoch, self.holder)
