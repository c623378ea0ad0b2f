"""The skeleton every event-sourced service stands on: a state fold, pure rules, thin handlers, loops.

A service subclasses `EventSourcedService` and gives only what is its own:

- `fold(envelope)`: apply one of its own events to its state (replayed at start, then on every record);
- `upstreams()`: the streams it follows, each with a fold of the upstream message into its view and
  a pure `react` rule that returns the events to record in answer (or its own handler, when a
  reaction has to call out first);
- `handlers()`: responders and subscriptions; `loops()`: long-running tasks.

The base owns the wiring each service used to write by hand: rebuilding the state from the store at
start, recording new events at the versions folded so far (one version map for every aggregate of
the service), following upstream streams with tracking so a reaction is recorded exactly once, and
waking the loops after every fold. A service that gives how to save and load its state (`snapshot_code`,
`save_state`, `load_state`) is also snapshotted as it runs and started from its latest snapshot
(`libs.skeleton.snapshots`). An upstream message that cannot be applied (undecodable, not
consistent with its subject, a reaction in conflict, a fold or reaction that keeps failing) is set
aside by the follower: an `UpstreamMessageSetAside` is recorded in the service's own log with the
message's tracking position, and the monitor raises an alert for it. Those records are not folded
into the service's state. It mirrors eventsourcing's `ProcessApplication`: the upstream's
`react` is its `policy`, and the tracking position commits with the events it produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Tracer

from libs.contracts.events import EventEnvelope, UpstreamMessageSetAside
from libs.contracts.subjects import event_subject
from libs.eventstore import ConcurrencyConflict, NewEvent, Tracking
from libs.messaging.follower import Arrival, GroupBroken, GroupHandler, Handler, StreamFollower
from libs.messaging.reader import stream_sequence
from libs.outages import OUTAGES, is_outage
from libs.settings import Settings
from libs.skeleton import snapshots
from libs.skeleton.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import (
    EVENTS_RECORDED,
    FOLLOWER_LAG,
    OUTBOX_LAG,
    SAMPLE_SECONDS,
    SampledGauge,
    counter,
    metrics_enabled,
)
from libs.telemetry.tracing import context_from_headers, current_trace_headers, messaging_attributes, tracer

log = get_logger(__name__)
_events_recorded = counter(EVENTS_RECORDED)
_outbox_lag = SampledGauge(OUTBOX_LAG)
_follower_lag = SampledGauge(FOLLOWER_LAG)

# A start cut short by an outage is made again after the first pause, each pause twice the last, up to the second.
START_RETRY_SECONDS = (1.0, 30.0)

Fold = Callable[[Any], None]
FoldAt = Callable[[Any, int], None]
"""A fold also told the stream sequence the message is stored at (`Upstream.fold_at`)."""
Rule = Callable[[Any], Sequence[NewEvent]]
"""A pure reaction: the upstream message (already folded) in, the events to record out."""
RuleAfter = Callable[[Any, Sequence[NewEvent]], Sequence[NewEvent]]
"""A rule also given the reactions to earlier messages of the message's key that wait to be recorded in the
same append (`Upstream.react_after`)."""
Loop = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Restored:
    """A state put in place at a start instead of folding the log from its first event (`restore`)."""

    own_after: int = 0  # every event of the own log up to this position is folded, and none after
    events: int = 0  # how many events the state holds
    # Per subject filter followed, the stream sequence up to which its messages are folded (the followers begin
    # after it); a filter not named is followed from its first message.
    upstream_after: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Upstream:
    """A stream the service follows from its first message on every start.

    `fold` updates the service's view with every message (replayed ones too), or `fold_at`, which is also told
    the stream sequence the message is stored at (by which one job's history is read back, `subjects`); `react`
    answers each message past the tracked position with the events to record, committed with that position.
    `handle` replaces both when the reaction must do I/O outside the service lock (it is then the
    whole handler, see `libs.messaging.follower.Handler`). `reactions=False`: fold only. A reaction is
    recorded in a consumer span (`consumer_span`).

    `key`: what a message's reaction belongs to (the job it is about). With a key, the messages that arrive
    together are decided together and their reactions recorded in one append (`on_upstream_group`), each
    message still folded and reacted to in order; the run is cut before a message whose key has a reaction
    waiting, and before a reaction that writes an aggregate another one waiting writes, so a reaction sees
    everything recorded for its own key. A reaction must read of other keys only what a slightly earlier
    view would do as well with: it sees their messages folded and their reactions in the run not yet.

    `react_after`, with `key`: the rule once more, also given the reactions to the earlier messages of the
    message's key that wait in the run (in order), which it takes into account as if recorded (a pure fold of
    them onto its own view): the run is then not cut before a message whose key has a reaction waiting, and
    a job's start and end that arrive together are recorded in one append. `react` is still the rule for a
    message decided alone, and must answer as `react_after` with nothing waiting.

    `check`: why a message cannot have come from where it was published (an agent's report naming another node
    than the one NATS let publish it); such a message is set aside (`inconsistent`), neither folded nor reacted to.

    `subject` is what NATS delivers: of another service's events, name the aggregates the service reads
    (`subjects.events_of`), so that the server leaves out the others; a new kind of aggregate upstream then
    reaches no follower that did not ask for it, while new events of a kind it reads reach it.
    """

    stream: str
    subject: str | tuple[str, ...]
    consumer: str
    message_type: object
    fold: Fold | None = None
    fold_at: FoldAt | None = None
    react: Rule | None = None
    handle: Handler | None = None
    reactions: bool = True
    key: Callable[[Any], Hashable] | None = None
    react_after: RuleAfter | None = None
    # Why a message cannot have come from where it was published (its sender): it is then set aside.
    check: Callable[[Any, str], str | None] | None = None


def aggregate_of(envelope: EventEnvelope) -> str:
    """An upstream event's key (`Upstream.key`): its aggregate, for events each about one job."""
    return envelope.aggregate_id


class EventSourcedService:
    """The shared base: state rebuilt from the log, records at folded versions, followed upstreams."""

    name: ClassVar[str]
    # The code a snapshot of the state depends on (globs from the project's root: its state and folds, the contracts
    # it holds), digested into its format; empty: the service takes no snapshots (`save_state`, `load_state`).
    snapshot_code: ClassVar[tuple[str, ...]] = ()

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.rt = runtime
        self.lock = asyncio.Lock()  # one decision at a time: folds, reactions, cycles, commands
        self.wake = asyncio.Event()  # set after every fold, so loops look again
        self.followers: list[StreamFollower] = []
        self._upstream_after: Mapping[str, int] = {}  # what a restored state holds of each upstream (`Restored`)
        # The version of every aggregate of this service, as folded so far: records append there.
        self.versions: dict[tuple[str, str], int] = {}
        self._tracer = tracer(f"trainyard.{self.name}")
        # Where the state stands, for its snapshots (libs.skeleton.snapshots): the last own event folded, how many
        # it holds, the events and messages folded since the last snapshot, per consumer the stream sequence of
        # the last message whose fold began, the appends under way, and when each followed stream was made.
        self._own_after = 0
        self._events = 0
        self._since_snapshot = 0
        self._folding: dict[str, int] = {}
        self._appending = 0
        self._streams: dict[str, str] = {}
        self._unsnapshotted: str | None = None  # why no snapshot of this state may be taken any more
        self._stateless: set[str] = set()  # the consumers whose messages change nothing the state holds

    # --- what a service gives -------------------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        """Apply one of the service's own events to its state."""
        raise NotImplementedError

    def upstreams(self) -> Sequence[Upstream]:
        return ()

    def handlers(self) -> None:
        """Register responders and subscriptions on `self.rt.broker` (answered once `listen` runs)."""

    def loops(self) -> Mapping[str, Loop]:
        return {}

    async def prepare(self) -> None:
        """Work between the rebuild and following upstreams (read models, caches)."""

    def sample_metrics(self) -> None:
        """Set the service's own gauges from its state (`libs.telemetry.metrics.SampledGauge`); called on the event
        loop every SAMPLE_SECONDS while metrics are exported."""

    def recorded(self, envelope: EventEnvelope) -> None:
        """Called after each newly recorded event is folded (logging, waking helpers)."""

    def save_state(self) -> bytes:
        """The state as a snapshot holds it (with `snapshot_code`), taken under the lock: quick, and a copy of
        nothing that changes afterwards (encoded bytes). The versions and positions are the base's."""
        raise NotImplementedError

    def load_state(self, data: bytes) -> None:
        """Put in place the state `save_state` saved; raise, having changed nothing, when it cannot be read. `data` is
        handed over alone: deleted once decoded, it is freed before the state is made of it."""
        raise NotImplementedError

    # --- start-up -------------------------------------------------------------------------------------

    @classmethod
    def create(cls, runtime: ServiceRuntime) -> Self:
        """The service on `runtime`; a service that needs more (the cluster config) reads it here."""
        return cls(runtime)

    @classmethod
    async def started(cls, settings: Settings | None = None) -> ServiceRuntime:
        """Connect, rebuild, follow and answer: the factory `libs.skeleton.entrypoint.run` runs. A start that NATS or
        PostgreSQL cut short (JetStream not answering while it makes the streams or a follower's consumer, say) is
        undone and made again once they are back, as often as it takes: an outage never ends the process."""
        pause = START_RETRY_SECONDS[0]
        while True:
            runtime = ServiceRuntime(cls.name, settings)
            try:
                await runtime.start()
                await cls.create(runtime).start()
                await runtime.listen()
                return runtime
            except BaseException as exc:
                await runtime.close()
                if not is_outage(exc):
                    raise
                log.warning("service.start_interrupted", error=repr(exc) or type(exc).__name__, again_in=pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, START_RETRY_SECONDS[1])

    async def restore(self) -> Restored:
        """Put in place a state saved with the service's own log (and maybe its upstreams) folded up to a position,
        so that the rebuild and the followers fold only what came after. Nothing restored: from the first event.
        With `snapshot_code`: the latest snapshot of the live state this code can read, of the streams followed as
        they are (`libs.skeleton.snapshots`)."""
        if not self.snapshot_code:
            return Restored()
        table = self._snapshots()
        await table.migrate()
        streams = await self._stream_births()
        for candidate in await table.recent():
            if not snapshots.streams_unchanged(candidate.streams, streams):
                log.info(f"{self.name}.snapshot_passed_over", at=candidate.at.isoformat(),
                         reason="a stream it follows was made anew since")
                continue
            snapshot = await table.read(candidate)
            if snapshot is None:
                continue
            began = time.monotonic()
            try:
                # On this thread (some 50 ms at 20,000 jobs held): a worker thread's buffer stays in that thread's
                # malloc arena once freed, some 20 MiB more resident for the life of the process.
                decompressed = list(_decompressed(snapshot))
                folded = snapshots.decode_versions(decompressed.pop())
                # Handed over as its only reference: a service may let it go once read, before it makes its state.
                self.load_state(decompressed.pop())
            except Exception:  # the log has it all: an older snapshot, or the first event
                log.exception(f"{self.name}.snapshot_unreadable", at=snapshot.at.isoformat())
                continue
            self.versions = folded
            log.info(f"{self.name}.restored", at=snapshot.at.isoformat(), own_after=snapshot.own_after,
                     events=snapshot.events, upstream_after=snapshot.upstream_after,
                     seconds=round(time.monotonic() - began, 3))
            return Restored(own_after=snapshot.own_after, events=snapshot.events,
                            upstream_after=snapshot.upstream_after)
        return Restored()

    async def rebuild(self) -> int:
        """Fold every event of the service's own log (after a restored state's); returns how many the state holds."""
        with collector_paused():
            restored = await self.restore()
            self._upstream_after = restored.upstream_after
            self._own_after, self._events = restored.own_after, restored.events
            async for envelope in self.rt.store.read_all(after=restored.own_after):
                self.apply(envelope)
            count = self._events
            if count >= LONG_LIVED_EVENTS:
                # The state lives as long as the process: left out of every later collection, whose first scanned
                # all of it, a seventh of the rebuild. Frozen objects are still freed when nothing refers to them;
                # only cycles among them never are, so a small state, which costs the collector little, is not.
                gc.freeze()
        return count

    async def start(self) -> None:
        count = await self.rebuild()
        log.info(f"{self.name}.rebuilt", events=count, aggregates=len(self.versions))
        await self.prepare()
        for upstream in self.upstreams():
            follower = self.follower(upstream)
            await follower.start()
            self.followers.append(follower)
            self.rt.on_close(follower.stop, f"following {follower.consumer}")
        if self.snapshot_code:
            self._streams = await self._stream_births()  # the streams the followers read: each exists by now
        self.handlers()
        for name, loop in self.loops().items():
            self.rt.spawn(weathering(name, loop), name)
        if self.snapshot_code:
            self.rt.spawn(weathering("snapshots", self.snapshot_loop), "snapshots")
        if metrics_enabled():
            self.rt.spawn(weathering("metrics", self._sample_metrics), "metrics")

    async def _sample_metrics(self) -> None:
        """The gauges every service exports (its relay's and followers' lag), then its own."""
        while True:
            _outbox_lag.set(await self.rt.relay.lag())
            lags: dict[tuple[str, ...], float] = {}
            for follower in self.followers:
                with contextlib.suppress(Exception):  # NATS away for a moment: that follower is left out
                    lags[(follower.stream, follower.consumer)] = await follower.lag()
            _follower_lag.set(lags)
            self.sample_metrics()
            await asyncio.sleep(SAMPLE_SECONDS)

    def follower(self, upstream: Upstream) -> StreamFollower:
        """What follows `upstream` for this service (not started): from its first message, or after what a restored
        state holds of it."""
        handle = self._calling_out(upstream, upstream.handle) if upstream.handle else self._handler(upstream)
        if upstream.fold is None and upstream.fold_at is None and upstream.handle is None:
            self._stateless.add(upstream.consumer)
        return StreamFollower(self.rt.js, self.rt.store, stream=upstream.stream, subject=upstream.subject,
                              consumer=upstream.consumer, message_type=upstream.message_type,
                              handle=handle, reactions=upstream.reactions,
                              record_set_aside=self._record_set_aside, folded=self._upstream_after,
                              handle_group=self._group_handler(upstream), check=upstream.check)

    async def caught_up(self) -> None:
        """Decisions that need a complete view wait until every upstream is replayed."""
        for follower in self.followers:
            await follower.caught_up.wait()

    # --- snapshots of the live state (with `snapshot_code`) --------------------------------------------

    @classmethod
    def snapshot_format(cls) -> str:
        return snapshots.code_format(cls.snapshot_code)

    def _snapshots(self) -> snapshots.StartSnapshots:
        return snapshots.StartSnapshots(self.rt.store.pool, self.rt.store.schema, self.snapshot_format())

    async def _stream_births(self) -> dict[str, str]:
        """When each stream the service follows was made, as NATS tells it ("": not made yet, or NATS could not tell
        in STREAM_INFO_TRIES: no snapshot of it is taken as known)."""
        births: dict[str, str] = {}
        for stream in dict.fromkeys(upstream.stream for upstream in self.upstreams()):
            births[stream] = ""
            for attempt in range(1, STREAM_INFO_TRIES + 1):
                try:
                    births[stream] = snapshots.stream_born((await self.rt.js.stream_info(stream)).created)
                    break
                except Exception as exc:
                    log.warning(f"{self.name}.stream_unknown", stream=stream, error=repr(exc), attempt=attempt)
                    if not is_outage(exc):
                        break
        return births

    async def snapshot_loop(self) -> None:
        """Once every upstream is replayed, a snapshot every SNAPSHOT_EVENTS events folded (own and followed),
        put off while one cannot be taken (`take_snapshot`)."""
        await self.caught_up()
        while True:
            if self._since_snapshot >= snapshots.SNAPSHOT_EVENTS:
                await self.take_snapshot()
            await asyncio.sleep(snapshots.CHECK_SECONDS)

    async def take_snapshot(self) -> bool:
        """Save the state as it stands, unless a message folded still waits for its reaction or an append is under
        way (then False: tried again later). The state is encoded under the lock, compressed and written after."""
        async with self.lock:
            followed = [snapshots.FollowedNow(follower.consumer, follower.through, follower.positions(),
                                              stateless=follower.consumer in self._stateless)
                        for follower in self.followers]
            try:
                upstream = snapshots.upstream_positions(followed, self._folding)
            except snapshots.Unsaveable as exc:
                upstream, self._unsnapshotted = None, str(exc)
            if self._unsnapshotted is not None:
                log.warning(f"{self.name}.snapshot_not_taken", reason=self._unsnapshotted)
                self._since_snapshot = 0
                return False
            if upstream is None or self._appending:
                log.debug(f"{self.name}.snapshot_put_off", reason="a message folded awaits its reaction"
                          if upstream is None else "an append is under way")
                return False
            began = time.monotonic()
            taken = snapshots.Taken(own_after=self._own_after, events=self._events, upstream_after=upstream,
                                    streams=dict(self._streams), state=self.save_state(),
                                    versions=snapshots.encode_versions(self.versions))
            held = time.monotonic() - began
            self._since_snapshot = 0
        data, versions = await asyncio.to_thread(
            lambda: (snapshots.compress(taken.state), snapshots.compress(taken.versions)))
        await self._snapshots().save(taken, data, versions, self.rt.store.epoch)
        log.info(f"{self.name}.snapshot_saved", own_after=taken.own_after, events=taken.events,
                 upstream_after=upstream, bytes=len(data) + len(versions), lock_seconds=round(held, 3),
                 seconds=round(time.monotonic() - began, 3))
        return True

    # --- recording ------------------------------------------------------------------------------------

    def apply(self, envelope: EventEnvelope) -> None:
        """Fold one of the service's own events and note its aggregate's version."""
        self.versions[(envelope.aggregate_type, envelope.aggregate_id)] = envelope.version
        self._own_after = max(self._own_after, envelope.position)
        self._events += 1
        self._since_snapshot += 1
        if not isinstance(envelope.event, UpstreamMessageSetAside):  # history and alerts, not state
            self.fold(envelope)

    def version(self, aggregate_type: str, aggregate_id: str) -> int:
        return self.versions.get((aggregate_type, aggregate_id), 0)

    def forget(self, aggregate_type: str, aggregate_id: str) -> None:
        """Drop an aggregate's version along with what the state held of it (its job was archived): nothing is
        recorded to it again but by `record_to_archived`."""
        self.versions.pop((aggregate_type, aggregate_id), None)

    async def record_to_archived(self, changes: Sequence[NewEvent]) -> list[EventEnvelope]:
        """Append `changes` to aggregates the state no longer holds, at their versions in the log (read first), and
        forget those versions again: for a command on an archived job."""
        aggregates = dict.fromkeys((change.aggregate_type, change.aggregate_id) for change in changes)
        for aggregate_type, aggregate_id in aggregates:
            stored = await self.rt.store.read_aggregate(aggregate_type, aggregate_id)
            if stored:
                self.versions[(aggregate_type, aggregate_id)] = stored[-1].version
        try:
            return await self.record(changes)
        finally:
            for aggregate in aggregates:
                self.versions.pop(aggregate, None)

    async def record(self, changes: Sequence[NewEvent], tracking: Tracking | None = None) -> list[EventEnvelope]:
        """Append `changes` at the versions folded so far (with `tracking`, exactly once per upstream
        message), fold them and wake the loops. A stale version raises ConcurrencyConflict."""
        if not changes:
            return []
        expected: dict[tuple[str, str], int] = {}
        for change in changes:
            key = (change.aggregate_type, change.aggregate_id)
            expected.setdefault(key, self.version(*key))
        trace = current_trace_headers()
        self._appending += 1  # until what it stores is folded: no snapshot meanwhile
        try:
            stored = await self.rt.store.append(changes, expected_versions=expected, tracking=tracking, trace=trace)
        except ConcurrencyConflict:
            self._appending -= 1
            # Another writer moved an aggregate on: fold what it wrote, so the next decision sees it.
            await self._catch_up(expected)
            raise
        except BaseException:
            self._appending -= 1
            raise
        counting = metrics_enabled()
        folded = 0
        try:
            for envelope in stored:
                # An event of a batch that continues a trace of its own is folded (and logged) in that trace.
                own = envelope.trace if envelope.trace and envelope.trace != trace else None
                token = otel_context.attach(context_from_headers(own)) if own else None
                try:
                    self.apply(envelope)
                    folded += 1
                    self.recorded(envelope)
                finally:
                    if token is not None:
                        otel_context.detach(token)
                if counting:
                    _events_recorded.add(1, {"trainyard.event.type": _kind(envelope)})
        finally:
            self._appending -= 1
            if folded < len(stored):  # events of the log left unfolded before later ones: no snapshot holds it
                self._unsnapshotted = "an event recorded could not be folded"
        self.wake.set()
        return stored

    async def _catch_up(self, aggregates: Iterable[tuple[str, str]]) -> None:
        for aggregate_type, aggregate_id in aggregates:
            for envelope in await self.rt.store.read_aggregate(aggregate_type, aggregate_id):
                if envelope.version > self.version(aggregate_type, aggregate_id):
                    self.apply(envelope)

    # --- following other services ---------------------------------------------------------------------

    async def _record_set_aside(self, change: NewEvent, tracking: Tracking | None) -> bool:
        async with self.lock:
            if tracking is None and self.version(change.aggregate_type, change.aggregate_id):
                return False  # recorded before (an event of a bundle with no position: kept once by its id)
            await self.record([change], tracking)
            return True

    def _handler(self, upstream: Upstream) -> Handler:
        async def handle(message: Any, msg: Msg, tracking: Tracking | None) -> bool:
            return await self.on_upstream(upstream, message, msg, tracking)

        return handle

    def _calling_out(self, upstream: Upstream, inner: Handler) -> Handler:
        """A service's own handler (`Upstream.handle`), which may fold a message and answer it in two holds of the
        lock: its message counts as being folded from the moment it is handed over, until its follower has handled
        it whole (no snapshot meanwhile)."""
        async def handle(message: Any, msg: Msg, tracking: Tracking | None) -> bool:
            self._folding_begins(upstream.consumer, msg)
            return await inner(message, msg, tracking)

        return handle

    def _folding_begins(self, consumer: str, msg: Msg | None, messages: int = 1) -> None:
        """A message of `consumer` is about to be folded: no snapshot until its follower has handled it whole."""
        metadata = getattr(msg, "metadata", None)  # None: not delivered by a follower (tests)
        if metadata is not None:
            self._folding[consumer] = metadata.sequence.stream
        self._since_snapshot += messages

    def _group_handler(self, upstream: Upstream) -> GroupHandler | None:
        if upstream.key is None or upstream.react is None or upstream.handle is not None:
            return None

        async def handle_group(arrivals: Sequence[Arrival]) -> Tracking | None:
            return await self.on_upstream_group(upstream, arrivals)

        return handle_group

    async def on_upstream_group(self, upstream: Upstream, arrivals: Sequence[Arrival]) -> Tracking | None:
        """Fold and react to a run of new messages under one hold of the lock, recording their reactions in as
        few appends as `Upstream.key` allows, each with the position of the last message it covers. The last
        position recorded (None: no reaction recorded anything); GroupBroken on any failure."""
        assert upstream.react is not None and upstream.key is not None
        waiting: list[NewEvent] = []
        waiting_of: dict[Hashable, list[NewEvent]] = {}  # the reactions waiting, by the key of their message
        written: dict[tuple[str, str], Hashable] = {}  # the aggregates they write, and by which key
        decided: Tracking | None = None  # the last message decided so far
        recorded: Tracking | None = None

        async def record_waiting() -> None:
            nonlocal recorded
            if waiting:
                await self.record(list(waiting), decided)
                recorded = decided
            waiting.clear()
            waiting_of.clear()
            written.clear()

        def others_write(key: Hashable, changes: Sequence[NewEvent]) -> bool:
            return any(written.get((c.aggregate_type, c.aggregate_id), key) != key for c in changes)

        async with self.lock:
            self._folding_begins(upstream.consumer, arrivals[-1].msg, len(arrivals))
            try:
                for arrival in arrivals:
                    key = upstream.key(arrival.message)
                    if key in waiting_of and upstream.react_after is None:
                        await record_waiting()
                    _fold(upstream, arrival.message, arrival.msg)
                    changes = self._reaction(upstream, arrival, waiting_of.get(key, ()))
                    if changes and others_write(key, changes):
                        await record_waiting()
                        changes = self._reaction(upstream, arrival, ())  # on the state with those folded
                    if changes:
                        waiting.extend(changes)
                        waiting_of.setdefault(key, []).extend(changes)
                        written.update(((c.aggregate_type, c.aggregate_id), key) for c in changes)
                    decided = arrival.tracking
                await record_waiting()
            except Exception as exc:
                raise GroupBroken(recorded, exc) from exc
            finally:
                self.wake.set()
        return recorded

    def _reaction(self, upstream: Upstream, arrival: Arrival, waiting: Sequence[NewEvent]) -> list[NewEvent]:
        """What the upstream's rule answers to one message of a run, after the reactions `waiting` for its key,
        each event carrying the message's trace."""
        assert upstream.react is not None
        changes = (upstream.react_after(arrival.message, waiting) if upstream.react_after is not None
                   else upstream.react(arrival.message))
        if not changes:
            return []
        with consumer_span(self._tracer, arrival.message, arrival.msg, consumer=upstream.consumer,
                           subject=upstream.subject):
            headers = current_trace_headers()
        return [change if change.trace is not None else replace(change, trace=headers) for change in changes]

    async def on_upstream(self, upstream: Upstream, message: Any, msg: Msg | None,
                          tracking: Tracking | None) -> bool:
        """Fold the message; when it is new (tracked), record what the upstream's rule answers."""
        async with self.lock:
            self._folding_begins(upstream.consumer, msg)
            _fold(upstream, message, msg)
            self.wake.set()
            if tracking is None or upstream.react is None:
                return False
            changes = upstream.react(message)
            if not changes:
                return False  # the follower records the tracking position alone
            # Only a reaction that records something joins the message's trace: no empty spans.
            with consumer_span(self._tracer, message, msg, consumer=upstream.consumer, subject=upstream.subject):
                await self.record(changes, tracking)
            return True


def _fold(upstream: Upstream, message: Any, msg: Msg | None) -> None:
    if upstream.fold is not None:
        upstream.fold(message)
    elif upstream.fold_at is not None:
        upstream.fold_at(message, stream_sequence(msg))


def _decompressed(snapshot: snapshots.Snapshot) -> tuple[bytes, bytes]:
    return snapshots.decompress(snapshot.data), snapshots.decompress(snapshot.versions)


# How often the time a followed stream was made is asked for at a start before it is taken as unknown (a NATS busy
# for a moment then costs a fold of the whole log, not a wrong snapshot).
STREAM_INFO_TRIES = 3
# A rebuild of at least this many events makes a state worth keeping out of the cycle collector's sight.
LONG_LIVED_EVENTS = 100_000


class _CollectorPauses:
    """Who has Python's cycle collector paused: it is one switch for the whole process, and a rebuild, a past
    state and a prediction's plan may each pause it from their own thread. The first to pause turns it off, the
    last to resume turns it back on, if it was on when the first paused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.was_on = False

    def pause(self) -> None:
        with self.lock:
            if self.holders == 0:
                self.was_on = gc.isenabled()
                gc.disable()
            self.holders += 1

    def resume(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0 and self.was_on:
                gc.enable()


_PAUSES = _CollectorPauses()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a state is rebuilt or a plan made, as it was before afterwards. These
    make many objects that live on (the whole state, a plan's kept cycles) and little cyclic garbage; the
    collector would scan the growing state again and again: a third of the time of a rebuild from 1,000,000
    events (bench/replay.py), and of a prediction planned afresh at 10,000 jobs on 1,000 nodes
    (bench/scheduling.py)."""
    _PAUSES.pause()
    try:
        yield
    finally:
        _PAUSES.resume()


class Pacer:
    """Keeps a loop that decides after every fold from taking more than `share` of the service's time.

    Each run of such a loop looks at the whole state (the queue, every launch), while folds come one
    message at a time: run after each, a decision that takes 20 ms would let the service fold fifty
    messages a second. After a run that took T seconds, the next waits until T * (1 - share) / share has
    passed since it ended, so the messages that came meanwhile are folded first and decided on together.
    Cheap runs are not held back noticeably (a 1 ms decision waits at most 1 ms).
    """

    def __init__(self, share: float = 0.5) -> None:
        self.share = share
        self._cost = 0.0
        self._ended = 0.0

    async def turn(self) -> None:
        """Wait until the next run may begin."""
        ended_if_stopped()
        gap = self._cost * (1 - self.share) / self.share - (time.monotonic() - self._ended)
        if gap > 0:
            await asyncio.sleep(gap)

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Time one run."""
        began = time.monotonic()
        try:
            yield
        finally:
            self._ended = time.monotonic()
            self._cost = self._ended - began


class Period:
    """Lets a loop begin a run at most every `seconds`, beside its `Pacer`'s share: a run that costs little would
    otherwise follow nearly every event, when one run for all that came meanwhile does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._began = float("-inf")

    async def turn(self) -> None:
        """Wait until the next run may begin, and note that it begins."""
        ended_if_stopped()
        if (gap := self._began + self.seconds - time.monotonic()) > 0:
            await asyncio.sleep(gap)
        self._began = time.monotonic()


def ended_if_stopped() -> None:
    """Raise CancelledError when the running task was asked to stop: nats-py swallows a cancellation that lands
    inside a publish, and a client library may turn one into an error of its own (an outage), after which a loop
    would go on until the shutdown gave up waiting for it and closed the connections under it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# How long a loop pauses after an outage: the first pause, the longest, and how long a loop must have
# run for its next outage to count as a new one (pauses start short again).
OUTAGE_PAUSE_SECONDS = (0.2, 5.0, 30.0)


async def weathering(name: str, loop: Loop, pauses: tuple[float, float, float] = OUTAGE_PAUSE_SECONDS) -> None:
    """Run `loop` for the life of the service. The database or NATS going away pauses it, and it starts
    again, for as long as the outage lasts; any other error still stops the service (a bug)."""
    first, longest, settled = pauses
    pause = first
    while True:
        began = time.monotonic()
        try:
            await loop()
            return
        except OUTAGES as exc:
            ended_if_stopped()  # the stop's cancellation, turned into an outage by a client library
            if time.monotonic() - began >= settled:
                pause = first
            log.warning("service.loop_outage", loop=name, error=repr(exc), retry_in=pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, longest)


def consumer_span(span_tracer: Tracer, message: Any, msg: Msg | None, *, consumer: str,
                  subject: str | Sequence[str] = ()) -> AbstractContextManager[Span]:
    """The span of a reaction to one upstream message, continuing its trace, named as OpenTelemetry's messaging
    conventions name a consumer's: `process` and the message's subject with the varying part as a placeholder, so
    that names stay few (`process trainyard.events.scheduler.job.JobSucceeded`,
    `process trainyard.agent-reports.{sender}`). `subject`: what the consumer follows (its filters)."""
    filters = (subject,) if isinstance(subject, str) else tuple(subject) or ("",)
    attributes = {"messaging.consumer.group.name": consumer}
    if isinstance(message, EventEnvelope):
        kind = _kind(message)
        destination = template = event_subject(message.service, message.aggregate_type, kind)
        headers: Mapping[str, str] | None = message.trace
        attributes["messaging.message.id"] = message.event_id
        job_id = getattr(message.event, "job_id", None) or (
            message.aggregate_id if message.aggregate_type in ("job", "launch") else None)
    else:
        destination = getattr(msg, "subject", None) or filters[0]
        template = re.sub(r"(^|\.)[*>]($|\.)", r"\1{sender}\2", filters[0])
        headers = getattr(msg, "headers", None)
        job_id = getattr(message, "job_id", None)
    if isinstance(job_id, str):
        attributes["trainyard.job.id"] = job_id
    return span_tracer.start_as_current_span(
        f"process {template}", context=context_from_headers(headers), kind=SpanKind.CONSUMER,
        attributes={**messaging_attributes(destination, "process"), "messaging.destination.template": template,
                    **attributes})


def _kind(message: Any) -> str:
    payload = message.event if isinstance(message, EventEnvelope) else message
    name: Callable[[], str] | None = getattr(type(payload), "name", None)
    return name() if callable(name) else type(payload).__name__

