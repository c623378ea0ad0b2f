"""A scheduler starts from a snapshot of a past state, rather than folding its whole log and every stream it follows
from their first message.

The snapshots of past states (past_snapshots.py, made ahead of any view by the snapshot loop) hold the own log and
the followed streams folded in the order they were recorded, each up to a position: the state the scheduler held
then. A start restores the latest one, folds its own log after it, and its followers begin after what it holds of
each stream (`libs.skeleton.eventsourced.Restored`).

A start may only take a snapshot that holds no upstream message the scheduler had not reacted to yet: a follower
beginning after it would never react to that message. So a snapshot is taken only when, for every subject followed,
what it folded is at or before the stream position the scheduler recorded as handled (before it, when that is a
bundle answered in part: a snapshot folds bundles whole), and the stream still holds the message at that position
(a stream made anew numbers its messages afresh: the start then folds everything, as ever). A snapshot made with
another cluster config, or that cannot be read, is passed over too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from nats.js.client import JetStreamContext

from libs.contracts import subjects
from libs.contracts.cluster import ClusterConfig
from libs.eventstore import EventStore
from libs.messaging.follower import handled_through
from libs.skeleton.eventsourced import Restored
from libs.telemetry.logs import get_logger
from services.scheduler.domain.names import UPSTREAM_AGGREGATES, upstream_consumer
from services.scheduler.domain.state import SchedulerState
from services.scheduler.history.past_snapshots import PastSnapshots, Versions, load
from services.scheduler.planning.prediction_cache import PredictionCache

log = get_logger(__name__)

# The latest snapshots looked at. A snapshot is made at least a minute after the events it holds, by when the
# followers have long handled them: the latest is refused only while one lags far behind (an outage).
CANDIDATES = 3

Start = tuple[SchedulerState, PredictionCache, Versions, Restored]


async def restored(store: EventStore, js: JetStreamContext, cluster: ClusterConfig) -> Start | None:
    """The state of the latest snapshot a start may take, with where it stands; None: from the first event."""
    table = PastSnapshots(store.pool, store.schema)
    await table.migrate()
    await store.pool.execute(f"DROP TABLE IF EXISTS {store.schema}.start_snapshots")  # left by earlier versions
    handled = await _handled(store, js)
    for candidate in await table.recent(CANDIDATES):
        if ahead := [subject for subject, after in candidate.upstream_after.items() if after > handled.get(subject, 0)]:
            log.info("scheduler.snapshot_passed_over", at=candidate.at.isoformat(),
                     reason="holds upstream messages not yet reacted to", subjects=ahead)
            continue
        snapshot = await table.latest(candidate.at)
        if snapshot is None:  # made by other code since, or dropped
            continue
        try:
            state, predictions, versions = await asyncio.to_thread(load, snapshot.data)
        except Exception:  # the log has it all
            log.exception("scheduler.snapshot_unreadable", at=snapshot.at.isoformat())
            return None
        if state.cluster != cluster:
            log.info("scheduler.snapshot_passed_over", at=snapshot.at.isoformat(),
                     reason="made with another cluster config")
            return None
        return state, predictions, versions, Restored(own_after=snapshot.own_after, events=snapshot.events,
                                                      upstream_after=snapshot.upstream_after)
    return None


async def _handled(store: EventStore, js: JetStreamContext) -> Mapping[str, int]:
    """Per subject followed, the stream position up to which the scheduler has handled its messages (0: none, or
    not known to hold in the stream as it is now)."""
    handled: dict[str, int] = {}
    for upstream, aggregates in UPSTREAM_AGGREGATES.items():
        sequence, upstream_position = await store.tracked(upstream_consumer(upstream))
        if sequence:
            try:  # a bundle answered in part counts as not handled: a snapshot folds bundles whole
                sequence = await handled_through(js, subjects.EVENTS_STREAM, sequence, upstream_position) or 0
            except Exception as exc:  # cannot tell (NATS slow or away): no snapshot is worth a reaction missed
                log.warning("scheduler.snapshot_unchecked", consumer=upstream_consumer(upstream), error=repr(exc))
                sequence = 0
        handled.update(dict.fromkeys(subjects.events_of(upstream, *aggregates), sequence))
    return handled
