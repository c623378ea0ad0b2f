"""The scheduler as it was at a past instant (`trainyard at TIME …`), rebuilt from the events recorded up to then.

A past state is made as the live one is at start: the scheduler's own log (PostgreSQL) and the upstream events
it follows (the monitor's nodes, pre-checks and caches, the launcher's launches, the autoscaler's instances,
from `TRAINYARD_EVENTS`), each folded into a fresh `SchedulerState`, but only those recorded up to the instant
and in the order they were recorded (an upstream event before the scheduler's answer to it). The prediction
cache learns from the same events, so `why` then plays the same forecast it would have played then. The views
read that state with the clock stopped at the instant: the same code answers them now and then.

The last state made is kept for a while: a later instant folds only the events in between, so an operator
stepping forward through a night pays for each step, not for the whole history again. An earlier instant
starts afresh, from the latest snapshot before it (past_snapshots.py). The live scheduler keeps those snapshots
ahead of any view (`snapshot_if_due`, from its snapshot loop): once its log has grown by `SNAPSHOT_EVENTS` since the
latest, it makes the state of the present in the background, saving snapshots on the way, so that no instant asked
for is more than that many events past one; in a process of its own (snapshot_process.py), so that the memory that
state takes while it is made is given back whole. A start restores the latest of them too (start_snapshots.py).

Nothing here touches the live state: the replay has its own state, folded in a worker thread in windows of the own
log (bounded memory), and answers one view at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
from collections.abc import AsyncIterator, Callable, Collection
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from libs.contracts import subjects
from libs.contracts.bundles import placed_envelopes
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import EventEnvelope, UpstreamMessageSetAside
from libs.eventstore import EventStore
from libs.messaging.reader import PulledReader, delivered
from libs.skeleton.eventsourced import LONG_LIVED_EVENTS, collector_paused
from libs.telemetry.logs import get_logger
from services.scheduler.domain.names import SERVICE, UPSTREAM_AGGREGATES, upstream_consumer
from services.scheduler.domain.state import SchedulerState
from services.scheduler.history.past_snapshots import SNAPSHOT_EVENTS as SNAPSHOT_EVENTS
from services.scheduler.history.past_snapshots import PastSnapshots, Snapshot, Versions, dump, load
from services.scheduler.planning.decision_inputs import plan_inputs
from services.scheduler.planning.prediction import Forecast
from services.scheduler.planning.prediction_cache import PredictionCache
from services.scheduler.planning.thread import PlanningThread

log = get_logger(__name__)

# Own events folded at a time, with the upstream events recorded meanwhile: what a past state costs beyond itself
# while it is made. Upstream events are fetched `UPSTREAM_BATCH` at a time, only as they are folded: a reader the
# server pushed ahead to would hold a followed stream whole (some 100 MiB after 16,000 jobs) until the state is made,
# and a process keeps the memory of that peak. A source's reader stays open from window to window.
WINDOW = 5_000
UPSTREAM_BATCH = 1_000
KEEP_SECONDS = 600.0  # a past state unused this long is dropped (it may be as large as the live one)
SET_ASIDE_PAGE = 1_000
EPOCH = datetime.min.replace(tzinfo=UTC)
KEEP_AHEAD_SECONDS = 60.0  # how often the live scheduler looks whether a new snapshot is due

Positioned = AsyncIterator[tuple[int, list[EventEnvelope]]]
"""A source's events after a position, with their position: one event, or those of a bundle (`subjects.bundle_subject`)
at its stream sequence, less what the live service passed over (none at all: the message passed over). A bundle is
taken whole, at the instant its last event was recorded: the events one append recorded together are folded together,
whether an instant falls between them or not. A source that stays open yields the position `FOR_NOW` at its end, and
goes on with what came since when read again."""
FOR_NOW = -1


class PastScheduler:
    """The scheduler's state at `at`, with what its state queries read (`interfaces.Reading`): a lock, a clock
    stopped at `at`, and forecasts of its queued jobs as they would have been made then."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.state = SchedulerState(cluster)
        self.predictions = PredictionCache()
        self.planning = PlanningThread(self.predictions)
        self.lock = asyncio.Lock()
        self.at = EPOCH
        self.events = 0  # folded so far
        self.versions: Versions = {}  # of its own aggregates, as the live scheduler notes them

    def clock(self) -> datetime:
        return self.at

    def fold(self, envelope: EventEnvelope) -> None:
        """As the live scheduler folds an event (its own or a followed one), set-aside records left out."""
        if envelope.service == SERVICE:
            self.versions[(envelope.aggregate_type, envelope.aggregate_id)] = envelope.version
        if isinstance(envelope.event, UpstreamMessageSetAside):
            return
        self.state.apply(envelope)
        for aggregate in self.state.take_left():  # as the live scheduler forgets an archived job's version
            self.versions.pop(aggregate, None)
        self.predictions.applied(envelope, self.state.jobs)
        self.events += 1

    def fold_all(self, envelopes: list[EventEnvelope]) -> None:
        for envelope in envelopes:
            self.fold(envelope)

    async def forecast_queued(self, job_ids: Collection[str]) -> dict[str, Forecast]:
        return await self.planning.forecast_queued(job_ids, clock=self.clock,
                                                   inputs=lambda: plan_inputs(self.state, self.at))


class _Source:
    """One ordered source of events (the own log, or one upstream subject), read up to an instant and no
    further: the first event recorded after it waits for a later instant."""

    def __init__(self, name: str, open_after: Callable[[int], Positioned]) -> None:
        self.name = name
        self._open_after = open_after
        self.after = 0  # the position of the last event (or bundle) taken or passed over (not the one waiting)
        self._pending: tuple[int, list[EventEnvelope]] | None = None  # read, recorded after the last instant asked for
        self._reading: Positioned | None = None

    async def until(self, when: datetime, limit: int | None = None) -> list[EventEnvelope]:
        """The next events recorded up to `when`, at most `limit` (and a bundle's whole)."""
        taken: list[EventEnvelope] = []
        if self._pending is not None:
            position, envelopes = self._pending
            if envelopes[-1].recorded_at > when:
                return taken
            taken.extend(envelopes)
            self.after, self._pending = position, None
        if self._reading is None:
            self._reading = self._open_after(self.after)
        while limit is None or len(taken) < limit:
            try:
                position, found = await anext(self._reading)
            except StopAsyncIteration:
                self._reading = None  # at the end for now: opened again, after `after`, next time
                break
            if position == FOR_NOW:  # at the end for now: read on from here next time
                break
            if found and found[-1].recorded_at > when:
                self._pending = (position, found)
                break
            self.after = position
            taken.extend(found)
        return taken

    async def close(self) -> None:
        """Stop reading (opened again when next asked): the event waiting is read again then."""
        if self._reading is not None:
            with contextlib.suppress(Exception):
                await self._reading.aclose()  # type: ignore[attr-defined]
            self._reading = None
        self._pending = None


class _Replay:
    """A past state and where it stands in each source; moves forward only."""

    def __init__(self, store: EventStore, js: JetStreamContext, cluster: ClusterConfig,
                 snapshots: PastSnapshots) -> None:
        self.store, self.js, self.snapshots = store, js, snapshots
        self.past = PastScheduler(cluster)
        self._snapshotted = 0  # events folded when the last snapshot was made or restored
        self.own = _Source("own", self._own_after)
        self.upstream = [_Source(subject, self._upstream_after(name, subject))
                         for name, aggregates in UPSTREAM_AGGREGATES.items()
                         for subject in subjects.events_of(name, *aggregates)]
        # Per consumer: what the live service passed over, by stream sequence and event of a bundle (None: the message).
        self._set_aside: dict[str, set[tuple[int, int | None]]] = {}
        self._set_aside_after = 0

    async def restore(self, snapshot: Snapshot) -> None:
        """Start from `snapshot` rather than from the first event."""
        state, predictions, versions = await asyncio.to_thread(load, snapshot.data)
        self.past.state, self.past.predictions, self.past.versions = state, predictions, versions
        self.past.planning = PlanningThread(predictions)
        self.past.at, self.past.events = snapshot.at, snapshot.events
        self.own.after = snapshot.own_after
        for source in self.upstream:
            source.after = snapshot.upstream_after.get(source.name, 0)
        self._snapshotted = snapshot.events

    async def advance(self, when: datetime, progress: Callable[[int], None] = lambda _: None) -> None:
        """Fold every event recorded after the last instant and up to `when`, in the order recorded; `progress` is
        told how many events are folded in all, after each window."""
        await self._learn_set_aside()
        await self._advance(when, progress)
        self.past.at = when

    async def _advance(self, when: datetime, progress: Callable[[int], None]) -> None:
        try:
            while True:
                own = await self.own.until(when, WINDOW)
                edge = own[-1].recorded_at if len(own) == WINDOW else when
                others = [await source.until(edge) for source in self.upstream]
                merged = list(heapq.merge(own, *others, key=lambda envelope: envelope.recorded_at))
                if merged:
                    await asyncio.to_thread(self.past.fold_all, merged)
                    progress(self.past.events)
                if self.past.events - self._snapshotted >= SNAPSHOT_EVENTS:
                    await self._snapshot(edge)
                if len(own) < WINDOW:
                    break
        finally:
            for source in (self.own, *self.upstream):
                await source.close()

    async def _snapshot(self, at: datetime) -> None:
        """Save the state as it stands: every event up to `at` folded (a later instant starts from it). Not where a
        later snapshot stands already (a view of an instant before the latest): its caller would only wait for it."""
        self._snapshotted = self.past.events
        if await self.snapshots.latest_own_after() >= self.own.after:
            return
        data = await asyncio.to_thread(dump, self.past.state, self.past.predictions, self.past.versions)
        await self.snapshots.save(Snapshot(at=at, events=self.past.events, own_after=self.own.after,
                                           upstream_after={s.name: s.after for s in self.upstream}, data=data))
        log.info("scheduler.snapshot_made", table=self.snapshots.table, at=at.isoformat(), events=self.past.events,
                 bytes=len(data))

    async def _own_after(self, position: int) -> Positioned:
        async for envelope in self.store.read_all(after=position, batch=WINDOW // 4):
            yield envelope.position, [envelope]

    def _upstream_after(self, upstream: str, subject: str) -> Callable[[int], Positioned]:
        consumer = upstream_consumer(upstream)

        async def read(after: int) -> Positioned:
            reader = PulledReader(self.js, subjects.EVENTS_STREAM, subject, after=after, batch=UPSTREAM_BATCH)
            try:
                while True:
                    if not (msgs := await reader.fetch()):
                        yield FOR_NOW, []
                    for msg in msgs:
                        sequence, _ = delivered(msg)
                        yield sequence, self._folded(consumer, sequence, msg)
            finally:
                await reader.close()

        return read

    def _folded(self, consumer: str, sequence: int, msg: Msg) -> list[EventEnvelope]:
        """The upstream events of a message as the live follower folded them, less those it set aside."""
        passed = self._set_aside.get(consumer, set())
        if (sequence, None) in passed:
            return []
        # One that does not decode was set aside by the follower too, and its record may be later than the instant.
        return [envelope for part, envelope in placed_envelopes(msg.subject, msg.data)
                if (sequence, part) not in passed]

    async def _learn_set_aside(self) -> None:
        while True:
            page = await self.store.read_type(subjects.SET_ASIDE_AGGREGATE, UpstreamMessageSetAside,
                                              after=self._set_aside_after, limit=SET_ASIDE_PAGE)
            for envelope in page:
                event = envelope.event
                assert isinstance(event, UpstreamMessageSetAside)
                self._set_aside.setdefault(event.consumer, set()).add((event.sequence, event.part))
                self._set_aside_after = envelope.position
            if len(page) < SET_ASIDE_PAGE:
                return


class PastStates:
    """The scheduler at past instants, one view at a time; the last state made is kept for `KEEP_SECONDS`."""

    def __init__(self, store: EventStore, js: JetStreamContext, cluster: Callable[[], ClusterConfig]) -> None:
        self.store, self.js, self.cluster = store, js, cluster
        self._snapshots: PastSnapshots | None = None  # made when a past state is first asked for
        self._lock = asyncio.Lock()
        self._kept: _Replay | None = None
        self._forget: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def at(self, when: datetime, *, progress: Callable[[int], None] = lambda _: None,
                 ) -> AsyncIterator[PastScheduler]:
        """The scheduler as it was at `when`, for as long as the caller reads it; `progress` is told how many events
        are folded while it is made."""
        async with self._lock:
            if self._forget is not None:
                self._forget.cancel()
            replay = self._kept
            try:
                # The collector off while the state is restored and folded, as for a rebuild at start: it would scan
                # the growing state again and again (the reading too makes many objects, so for the whole of it).
                with collector_paused():
                    afresh = replay is None or replay.past.at > when
                    if replay is None or afresh:
                        replay = self._kept = await self._made_afresh(when)
                    folded = replay.past.events
                    await replay.advance(when, progress)
                    if (replay.past.events if afresh else replay.past.events - folded) >= LONG_LIVED_EVENTS:
                        # Out of later collections too, whose first would scan it all on the event loop (a fifth of
                        # a restore's time): a past state holds no cycles, so it is still freed once let go.
                        gc.freeze()
                log.info("scheduler.past_state", at=when.isoformat(), events=replay.past.events,
                         folded=replay.past.events - folded)
            except BaseException:
                self._kept = None  # half advanced: start afresh next time
                raise
            try:
                yield replay.past
            finally:
                self._forget = asyncio.get_running_loop().call_later(KEEP_SECONDS, self._forgotten)

    async def snapshot_due(self) -> int:
        """How far the log has grown since the latest snapshot, if by `SNAPSHOT_EVENTS` or more (else 0)."""
        behind = await self.store.last_position() - await (await self._snapshot_table()).latest_own_after()
        return behind if behind >= SNAPSHOT_EVENTS else 0

    async def snapshot_if_due(self, now: datetime) -> bool:
        """If the log has grown by `SNAPSHOT_EVENTS` since the latest snapshot, make the state of `now` (snapshots
        saved on the way) and let it go: a later view starts from the snapshot. Whether it did. The live scheduler
        has it done in a process of its own (snapshot_process.py)."""
        if not (behind := await self.snapshot_due()):
            return False
        log.info("scheduler.snapshot_due", events_since=behind)
        async with self.at(now) as made:
            events = made.events
        async with self._lock:
            if self._kept is not None and self._kept.past.at == now:  # as large as the live state: not kept
                self._drop()
        log.info("scheduler.past_snapshots_made", at=now.isoformat(), events=events)
        return True

    async def _snapshot_table(self) -> PastSnapshots:
        if self._snapshots is None:
            self._snapshots = PastSnapshots(self.store.pool, self.store.schema)
            await self._snapshots.migrate()
        return self._snapshots

    async def _made_afresh(self, when: datetime) -> _Replay:
        """A replay to go on to `when` with: from the latest snapshot before it, else from the first event."""
        snapshots = await self._snapshot_table()
        replay = _Replay(self.store, self.js, self.cluster(), snapshots)
        snapshot = await snapshots.latest(when)
        if snapshot is not None:
            try:
                await replay.restore(snapshot)
            except Exception:  # a snapshot that cannot be read is passed over: the log has it all
                log.exception("scheduler.past_snapshot_unreadable", at=snapshot.at.isoformat())
                replay = _Replay(self.store, self.js, self.cluster(), snapshots)
        return replay

    def _drop(self) -> None:
        if self._forget is not None:
            self._forget.cancel()
        self._kept = None

    def _forgotten(self) -> None:
        if not self._lock.locked():
            self._drop()
