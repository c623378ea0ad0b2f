"""Snapshots a scheduler starts from, rather than folding its whole log.

A start folds the scheduler's own log first, in order, and only then follows the other services' streams (from
their first message, as ever). So the state it holds when its own log is folded up to a position depends on that
log alone: a snapshot of it (the state, the prediction cache and the version of every aggregate, with the position)
lets a later start fold only the events after, and come to the same state as a start from the first event.

They are made as the snapshots of past states are (past.py), by a replay of the own log alone, in the background
of the active scheduler, once its log has grown by `SNAPSHOT_EVENTS` since the latest; saved in the table
`start_snapshots`. A cache of the log: made by the same code only (`FORMAT`), for the same cluster config (another
one folds differently: the snapshot is passed over), and one that cannot be read is passed over too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime

from libs.contracts.cluster import ClusterConfig
from libs.eventsourced import collector_paused
from libs.eventstore import EventStore
from libs.telemetry.logs import get_logger
from services.scheduler import past
from services.scheduler.past_snapshots import PastSnapshots, Snapshot, Versions, load
from services.scheduler.prediction_cache import PredictionCache
from services.scheduler.state import SchedulerState

log = get_logger(__name__)


@dataclass
class Restored:
    state: SchedulerState
    predictions: PredictionCache
    versions: Versions
    own_after: int  # every event of the own log up to this position is folded, and none after
    events: int


class StartSnapshots:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.table = PastSnapshots(store.pool, store.schema, table="start_snapshots")
        self._migrated = False

    async def latest(self) -> Snapshot | None:
        return await (await self._table()).latest()

    async def _table(self) -> PastSnapshots:
        if not self._migrated:
            await self.table.migrate()
            self._migrated = True
        return self.table

    def _replay(self, cluster: ClusterConfig) -> past._Replay:
        return past._Replay(self.store, None, cluster, self.table, upstream=False)

    async def restored(self, cluster: ClusterConfig) -> Restored | None:
        """The state of the latest snapshot, for a start to fold the rest of its log into; None: from the first
        event."""
        snapshot = await self.latest()
        if snapshot is None:
            return None
        try:
            state, predictions, versions = await asyncio.to_thread(load, snapshot.data)
        except Exception:  # the log has it all
            log.exception("scheduler.start_snapshot_unreadable", own_after=snapshot.own_after)
            return None
        if state.cluster != cluster:
            log.info("scheduler.start_snapshot_passed_over", own_after=snapshot.own_after,
                     reason="made with another cluster config")
            return None
        return Restored(state, predictions, versions, snapshot.own_after, snapshot.events)

    async def make_if_due(self, cluster: ClusterConfig, now: datetime) -> bool:
        """If the own log has grown by `SNAPSHOT_EVENTS` since the latest snapshot, fold it on from there (saving
        snapshots on the way) up to `now`, and let the state go. Whether it did."""
        if not await past.snapshot_due(await self._table(), self.store):
            return False
        latest = await self.latest()
        with collector_paused():  # and the state let go before it is switched back on: nothing left to scan
            replay = self._replay(cluster)
            if latest is not None:
                try:
                    await replay.restore(latest)
                except Exception:
                    log.exception("scheduler.start_snapshot_unreadable", own_after=latest.own_after)
                    replay = self._replay(cluster)
                if replay.past.state.cluster != cluster:  # made with another cluster config: from the first event
                    replay = self._replay(cluster)
            await replay.advance(now)
            events = replay.past.events
            del replay
        log.info("scheduler.start_snapshots_made", at=now.isoformat(), events=events)
        return True
