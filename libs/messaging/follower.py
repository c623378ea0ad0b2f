"""Following a JetStream stream from its start, with exactly-once reactions.

A service's view of other services (nodes from the monitor, launches from the launcher) is a fold
over their public events. On every start a follower reads the stream from the first message, so the
view is rebuilt the same way it was built: replay is the normal path. Each message is also offered
as a *reaction* when its stream sequence is past the position the service has recorded; the
reaction appends its events together with that position (see `EventStore.append(tracking=...)`), so
a restart never reacts twice and never skips one.

Each event of a bundle (the events one append of the upstream recorded, published as one message,
`subjects.bundle_subject`) is taken as if it had come alone: folded, reacted to and tracked on its own, its position
the bundle's stream sequence and then its own upstream position (`Tracking.order`), so a service stopped in the middle
of a bundle reacts to the rest of it, and to nothing twice. The bundle counts as handled whole (`through`) with its
last event; one of its events that cannot be applied is set aside alone (`UpstreamMessageSetAside.part`).

A follower of one service's events also records the upstream log's position of what it reacted to,
which outlives the stream: when the stream was made anew (JetStream lost it; the upstream's relay then
publishes its log again, libs/eventstore/relay.py), the recorded sequence no longer names the same
message, and the follower goes by the upstream position instead. Where there is none (agent reports),
it reacts to the new stream's messages from its start: those reactions hold to what they decide on.

What the stream holds when a follower starts is fetched a batch at a time (`CATCH_UP_BATCH`), the next while one
is handled; from its end on, an ordered consumer delivers what comes, pushed by the server as it is stored.

A service that restored a state saved with some of a stream already folded (a snapshot) gives its
follower, per subject filter, the stream sequence up to which that filter's messages are in the state (`folded`):
delivery then begins after the lowest, and a message at or before its filter's is passed over, neither folded nor
reacted to. The service restores only a state folded no further than it had reacted, so nothing is left unanswered.
Such a follower still remembers the envelopes a replay from the first message would have shown it (see
`REMEMBERED_ENVELOPES`): delivery begins far enough before the lowest position for the latest of its filters'
envelopes up to it, which, as those passed over, it notes without folding them. So a copy of an envelope the state
holds, published again after its position, is passed over as it is after a replay, not folded and answered twice.
What a follower has handled whole (folded and reacted to, passed over or set aside) it tells per subject filter
(`positions`), in the same terms: what a snapshot of the live state saves of each stream.

A message that cannot be applied is *set aside*, never retried for ever (one poisoned message must
not stop every later one): the follower records an `UpstreamMessageSetAside` with its tracking
position, folds nothing of it and goes on. That happens when

- it does not decode as the expected type (`undecodable`);
- its envelope disagrees with where it was published (`inconsistent`): the subject must be exactly
  `event_subject(envelope.service, aggregate type, event name)` (or, for an event published before the aggregate
  id left the subjects, `earlier_event_subject` with its id), and the service must
  be the one this follower follows (read from the subject filter, `subjects.service_of_events`); or
  the follower's own `check` finds the message cannot have come from where it was published (an agent's
  report naming another node than its subject's, `subjects.sender_refusal`);
- the reaction raises `ConcurrencyConflict` (`conflict`): deciding again on the same view would give
  the same stale answer;
- folding or reacting raises an error that `classify` does not know as passing, `attempts` times
  in a row (`failed`).

A follower given `handle_group` decides runs of new messages together: the messages that arrived while it
handled the last ones (up to GROUP_MESSAGES) go to `handle_group` at once, which records their reactions in as
few appends as it can, each with the position of the last message it covers (`Upstream.key`). Should that
break part-way, the messages past the last position recorded are handled again one at a time, as any message
is; a run of one, a message replayed or set aside, and everything a follower without `handle_group` reads are
handled one at a time.

Passing outages (`classify(...) == "transient"`: PostgreSQL or NATS away, connection errors, timeouts)
are retried every `retry_seconds` until they pass, without a limit, so a service outlives its
database going away without skipping a message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy
from nats.js.errors import NotFoundError

from libs.contracts.bundles import bundle_parts, claimed_position, stored_envelopes
from libs.contracts.codec import decode_any
from libs.contracts.events import EventEnvelope, SetAsideCause, UpstreamMessageSetAside, set_aside_id
from libs.contracts.subjects import (
    SET_ASIDE_AGGREGATE,
    bundle_subject,
    earlier_event_subject,
    event_subject,
    is_bundle,
    service_of_events,
)
from libs.eventstore.store import AlreadyProcessed, ConcurrencyConflict, EventStore, NewEvent, Tracking
from libs.messaging.connection import wait_for_streams
from libs.messaging.reader import PULLED_IDLE_SECONDS, PulledReader, delivered
from libs.outages import is_outage
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import FOLLOWER_MESSAGES, attributes, counter, metrics_enabled

log = get_logger(__name__)
T = TypeVar("T")

Check = Callable[[Any, str], str | None]
"""check(decoded, subject): why the message cannot have come from where it was published (None: it can)."""

Handler = Callable[[Any, Msg, Tracking | None], Awaitable[bool]]
"""handle(decoded, message, tracking): fold the decoded message into the view; when `tracking` is
given, also react to it and return True if the reaction's append carried `tracking` (False: the
follower records it)."""


@dataclass(frozen=True)
class Arrival:
    """A new upstream message of a run decided together: decoded, as delivered, and its tracking position."""

    message: Any
    msg: Msg
    tracking: Tracking


GroupHandler = Callable[[Sequence[Arrival]], Awaitable[Tracking | None]]
"""handle_group(arrivals): fold every message of the run into the view, react to each and record the reactions
(each append carrying the position of the last message it covers); the last position an append carried (None:
no reaction recorded anything, the follower records the run's last position). Raises GroupBroken on any
failure."""


class GroupBroken(Exception):
    """Deciding a run failed part-way: the messages up to `recorded` have their reactions recorded, the rest
    are to be handled again one at a time."""

    def __init__(self, recorded: Tracking | None, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.recorded = recorded
        self.cause = cause


RecordSetAside = Callable[[NewEvent, Tracking | None], Awaitable[bool]]
"""record(change, tracking): append the set-aside record together with the message's tracking (None: an event of a
bundle that has no position to be tracked by, recorded once by its aggregate id alone); whether it was recorded now
(False: it was before)."""

_SET_ASIDE_TAG = UpstreamMessageSetAside.__struct_config__.tag

Verdict = Literal["transient", "conflict", "unknown"]


def classify(error: BaseException) -> Verdict:
    """How to treat an error from folding or reacting to one upstream message.

    `transient`: the database or NATS is away; retry until it passes. `conflict`: the aggregate the
    reaction writes moved on (ConcurrencyConflict); set the message aside at once. `unknown`:
    anything else (a bug, or a message the rules cannot take); retried a few times, in case it
    passes, then set aside.
    """
    if isinstance(error, ConcurrencyConflict):
        return "conflict"
    if is_outage(error):
        return "transient"
    return "unknown"


class _Claimed(msgspec.Struct):
    type: str | None = None


class _Claims(msgspec.Struct):
    """What an undecodable message says it is, when it says so."""

    service: str | None = None
    event: _Claimed | None = None
    type: str | None = None


def claims(data: bytes) -> tuple[str | None, str | None]:
    """The service and the type a raw message claims (envelope or plain message), if it reads as JSON."""
    try:
        found = msgspec.json.decode(data, type=_Claims)
    except msgspec.DecodeError:
        return None, None
    kind = found.event.type if found.event is not None else found.type
    return _short(found.service), _short(kind)


def _short(text: str | None) -> str | None:
    return text[:200] if text is not None else None


def inconsistency(envelope: EventEnvelope, subject: str, source: str | None) -> str | None:
    """Why an envelope cannot have come from where it was read, or None when it can."""
    if source is not None and envelope.service != source:
        return f"the envelope claims service {envelope.service!r} but this consumer follows {source!r}"
    name = type(envelope.event).name()
    expected = event_subject(envelope.service, envelope.aggregate_type, name)
    if subject not in (expected, bundle_subject(envelope.service, envelope.aggregate_type),
                       earlier_event_subject(envelope.service, envelope.aggregate_type, envelope.aggregate_id, name)):
        return f"published on {subject} but its envelope belongs on {expected}"
    return None


@dataclass(frozen=True)
class _Unit:
    """What the follower handles at a time: a message as delivered, or one event of a bundle (`subjects.is_bundle`)."""

    msg: Msg  # the message, or (of a bundle) a copy of it holding that event alone
    sequence: int
    pending: int | bool  # more of the stream behind it (a bundle's event before its last: True)
    part: int | None = None  # of a bundle, which event, from 0
    whole: bool = True  # the message is handled whole with it (a bundle's last event, or a message alone)


class _SetAside(Exception):
    def __init__(self, cause: SetAsideCause, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause
        self.reason = reason


def _units(msg: Msg, sequence: int, pending: int | bool) -> list[_Unit]:
    """What the follower handles of a message: the message, or each event of a bundle in a copy of its own (the same
    subject, reply and headers: its stream sequence and metadata are the bundle's). Raises _SetAside for a bundle whose
    body is not an array."""
    if not is_bundle(msg.subject):
        return [_Unit(msg, sequence, pending)]
    try:
        parts = bundle_parts(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise _SetAside("undecodable", f"a bundle that is not an array of events: {str(exc)[:400]}") from None
    if not parts:
        raise _SetAside("undecodable", "a bundle of no events")
    last = len(parts) - 1
    return [_Unit(Msg(msg._client, subject=msg.subject, reply=msg.reply, data=bytes(part), headers=msg.headers),
                  sequence, pending if index == last else True, index, index == last)
            for index, part in enumerate(parts)]


# An ordered consumer lives in the server's memory: a restarted NATS server has lost it, and the client
# makes it anew only after two missed heartbeats (nats-py's default heartbeat, 5 s, stalled every follower
# for ~10 s after a NATS restart).
HEARTBEAT_SECONDS = 1.0
# How many of the latest envelopes' ids a follower remembers to recognise one published again: the
# relay publishes again at most one batch after a crash, far fewer than this.
REMEMBERED_ENVELOPES = 10_000
_REPEATED = object()  # what an envelope published again decodes to: applied once already
# Most upstream messages need no reaction. Their positions are written a while later, the latest only, so
# that a burst of them costs one write rather than one each; a later reaction's append carries its own. A
# restart before the write reacts to them again, which the rules answer as they did (nothing, or what the
# state rebuilt since asks for), as after a crash between a fold and its record.
UNRECORDED_WRITE_SECONDS = 0.5
# At most this many messages are decided together (`handle_group`), and at most twice as many wait for it in
# the follower: beyond that the client's queue and JetStream's flow control hold the rest back.
GROUP_MESSAGES = 64
CONSUMER_INFO_TRIES = 50  # 0.1 s apart
# Messages fetched at a time while a follower catches up with what the stream held at its start; the next batch
# is fetched while one is handled, so about twice this waits in the process (some 1.5 KiB each, decoded).
CATCH_UP_BATCH = 256


async def _consumer_info(sub: Any) -> ConsumerInfo:
    """The ordered consumer's info. One that missed two heartbeats (a busy machine) is replaced by nats-py: the old
    consumer is gone at once and the new one made in the background, under another name: ask again meanwhile."""
    for attempt in range(CONSUMER_INFO_TRIES):
        try:
            info: ConsumerInfo = await sub.consumer_info()
            return info
        except NotFoundError:
            if attempt == CONSUMER_INFO_TRIES - 1:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


def starts_part_way(subject: str) -> bool:
    """Whether a follower of the subject filter can begin after what a restored state holds of it (`folded`): a plain
    filter, or `prefix.>`."""
    return "*" not in subject and (">" not in subject or subject.endswith(".>"))


async def still_holds(js: JetStreamContext, stream: str, sequence: int, upstream: int | None) -> bool:
    """Whether `stream` still has, at `sequence`, the message a tracking position was recorded for (with the
    upstream log position `upstream`, when known): False when the stream was made anew since. Raises when NATS
    cannot tell now."""
    return await handled_through(js, stream, sequence, upstream) is not None


async def handled_through(js: JetStreamContext, stream: str, sequence: int, upstream: int | None) -> int | None:
    """The stream sequence up to which a consumer that recorded the tracking position (`sequence`, `upstream`) has
    handled every message whole: `sequence`, or the one before it when the message there is a bundle and `upstream`
    not its last event. None when `stream` no longer holds, at `sequence`, the message it was recorded for (the
    stream was made anew since). Raises when NATS cannot tell now."""
    try:
        msg = await js.get_msg(stream, sequence)
    except NotFoundError:  # the stream is younger than the tracking
        return None
    if upstream is None:
        return sequence  # nothing to tell it by
    positions = [envelope.position for envelope in stored_envelopes(msg.subject or "", msg.data or b"")]
    if upstream not in positions:
        return None
    return sequence if upstream == positions[-1] else sequence - 1


class StreamFollower:
    def __init__(self, js: JetStreamContext, store: EventStore, *, stream: str, subject: str | Sequence[str],
                 consumer: str, message_type: object, handle: Handler, reactions: bool = True,
                 retry_seconds: float = 0.5, attempts: int = 3, source: str | None = None,
                 record_set_aside: RecordSetAside | None = None, folded: Mapping[str, int] | None = None,
                 handle_group: GroupHandler | None = None, check: Check | None = None) -> None:
        self.js = js
        self.store = store
        self.stream = stream
        # What NATS delivers to it: one subject filter, or several (`subjects.events_of`).
        self.subjects = [subject] if isinstance(subject, str) else list(subject)
        self.consumer = consumer
        self.message_type = message_type
        self.handle = handle
        self.handle_group = handle_group
        # Messages waiting for the run that decides them together (with `handle_group` only).
        self._inbox: asyncio.Queue[Msg] | None = asyncio.Queue(2 * GROUP_MESSAGES) if handle_group else None
        self._worker: asyncio.Task[None] | None = None
        # A follower without reactions only folds: it never writes a tracking position.
        self.reactions = reactions
        self.retry_seconds = retry_seconds
        self.attempts = attempts  # tries of an `unknown` failure before the message is set aside
        # The service whose envelopes this follower accepts (None: any, as long as subject and envelope agree).
        self.source = source if source is not None else service_of_events(subject)
        self.record_set_aside = record_set_aside or self._append_set_aside
        self.check = check  # a message it refuses is set aside as `inconsistent`
        # Per subject filter, the stream sequence up to which its messages are folded already (a restored state).
        self.folded = {subject: folded.get(subject, 0) for subject in self.subjects} if folded else {}
        for subject, through in self.folded.items():
            if through and not starts_part_way(subject):
                raise ValueError(f"a follower starts part-way only on plain filters or `prefix.>`: {subject}")
        self._folded_through = max(self.folded.values(), default=0)  # past it, nothing is passed over
        # The stream sequence of the last message handled whole: folded and reacted to, passed over or set aside.
        self.through = 0
        self.caught_up = asyncio.Event()
        # The position of the last message (or event of a bundle) reacted to: stream sequence, upstream position.
        self.tracked = (0, 0)
        # Set when the stream was made anew: the upstream position reacted to last before; a message is new
        # when its position is past it (one-service followers).
        self.anew_upstream: int | None = None
        self._sub: object | None = None
        # While it catches up with what the stream held at its start (`_catch_up`): the reader, and its task.
        self._reader: PulledReader | None = None
        self._catching_up: asyncio.Task[None] | None = None
        self._unrecorded: Tracking | None = None  # the latest position whose reaction recorded nothing, unwritten
        self._writer: asyncio.Task[None] | None = None
        self._stopped = False
        # The upstream log's positions seen, with their event ids (the latest REMEMBERED_ENVELOPES), those a restored
        # state holds included (`_held`).
        self._seen: OrderedDict[int, str] = OrderedDict()
        # Messages handled, counted for the metrics when they are exported.
        self._counted = counter(FOLLOWER_MESSAGES) if metrics_enabled() else None
        self._counted_as = attributes(FOLLOWER_MESSAGES, stream, consumer)

    async def start(self) -> None:
        await wait_for_streams(self.js, [self.stream])  # another service may own it and not be up yet
        if self.reactions:
            tracked, upstream = await self.store.tracked(self.consumer)
            self.tracked = (tracked, upstream or 0)
            if tracked and not await self._still_holds(tracked, upstream):
                log.warning("follower.stream_made_anew", consumer=self.consumer, stream=self.stream,
                            tracked=tracked, upstream=upstream)
                await self.store.forget_tracked_sequence(self.consumer)
                self.tracked, self.anew_upstream = (0, 0), upstream
        after = 0
        # A restored state: from before what it holds, for the envelopes a replay would remember there (`_held`).
        first = min(self.folded.values(), default=0)
        if first and (begin := await self._remembering_from(first)) > 1:
            after = begin - 1
        if self._inbox is not None:
            self._worker = asyncio.create_task(self._work(self._inbox), name=f"{self.consumer}.runs")
        reader = PulledReader(self.js, self.stream, self.subjects, after=after, batch=CATCH_UP_BATCH)
        if msgs := await reader.fetch():
            self._reader = reader
            self._catching_up = asyncio.create_task(self._catch_up(reader, msgs), name=f"{self.consumer}.catch_up")
            return
        await reader.close()
        # Nothing matched the filter yet (the stream sequence may already point past other services' messages):
        # the view is complete.
        self.caught_up.set()
        await self._subscribe(reader.after)

    async def _subscribe(self, after: int) -> None:
        """Follow what is stored after sequence `after` as it comes: an ordered consumer, which the server pushes
        to without a request each."""
        config = ConsumerConfig(filter_subjects=self.subjects if len(self.subjects) > 1 else None)
        policy = DeliverPolicy.ALL
        if after:
            policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, after + 1
        self._sub = await self.js.subscribe(self.subjects[0], stream=self.stream, config=config,
                                            ordered_consumer=True, idle_heartbeat=HEARTBEAT_SECONDS,
                                            deliver_policy=policy, cb=self._on_message)

    async def _catch_up(self, reader: PulledReader, msgs: list[Msg]) -> None:
        """Handle what the stream held when the follower started, a batch at a time, then follow the rest as it
        comes. An ordered consumer would be pushed the whole backlog ahead of its handling (the server's flow
        control lets some 64 MiB wait in the client): read on after a restart, that peak stayed in the process's
        memory (`bench/soak.py`: a service started again held 20-60 MiB more than before)."""
        while msgs:
            ahead = asyncio.create_task(self._fetched(reader))  # the next batch comes while this one is handled
            try:
                await self._hand_over(msgs)
            except BaseException:
                ahead.cancel()
                raise
            msgs = await ahead
        await reader.close()
        await self._until_nats_answers("follower.subscribe_failed", reader, lambda: self._subscribe(reader.after))
        self._reader = None

    async def _fetched(self, reader: PulledReader) -> list[Msg]:
        """The next batch; NATS away or slow: fetched again from the last message fetched, until it is back."""
        return await self._until_nats_answers("follower.catch_up_interrupted", reader, reader.fetch)

    async def _until_nats_answers(self, failed: str, reader: PulledReader, step: Callable[[], Awaitable[T]]) -> T:
        """`step` of the catch-up, tried again every `retry_seconds` while it fails (NATS away or slow), each failure
        logged as `failed` with where the catch-up is."""
        while True:
            try:
                return await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(failed, consumer=self.consumer, after=reader.after, error=repr(exc))
                await asyncio.sleep(self.retry_seconds)

    async def _hand_over(self, msgs: list[Msg]) -> None:
        """Messages fetched while catching up, handled as delivered ones are (`_on_message`)."""
        if self._inbox is not None:
            for msg in msgs:
                await self._inbox.put(msg)  # a full inbox holds the rest back
            return
        await self._take_run(msgs)

    async def stop(self) -> None:
        self._stopped = True  # a message still being handled must not start a writer that outlives the store
        if self._catching_up is not None:
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._catching_up
        if self._reader is not None:
            await self._reader.close()
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection closed already: so is the subscription
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._writer is not None:
            self._writer.cancel()
        if (unrecorded := self._unrecorded) is not None:
            with contextlib.suppress(Exception):  # best effort: a restart reacts again to what is not written
                await self.store.record_tracking(unrecorded)

    def _passed(self, tracking: Tracking) -> None:
        """The message at `tracking` needed no reaction: its position is written a while later."""
        self._unrecorded = tracking
        if not self._stopped and (self._writer is None or self._writer.done()):
            self._writer = asyncio.create_task(self._write_unrecorded(), name=f"{self.consumer}.tracking")

    def _recorded(self, tracking: Tracking) -> None:
        """A reaction's append carried `tracking`: any earlier position waiting to be written is covered."""
        if self._unrecorded is not None and self._unrecorded.order() <= tracking.order():
            self._unrecorded = None

    async def _write_unrecorded(self) -> None:
        await asyncio.sleep(UNRECORDED_WRITE_SECONDS)
        while (unrecorded := self._unrecorded) is not None and not self._stopped:
            try:
                await self.store.record_tracking(unrecorded)
            except Exception as exc:  # the database away, or the lease lost: try again later, or never need to
                log.warning("follower.tracking_unwritten", consumer=self.consumer, error=repr(exc))
                await asyncio.sleep(self.retry_seconds)
                continue
            if self._unrecorded is unrecorded:
                self._unrecorded = None

    async def _still_holds(self, sequence: int, upstream: int | None) -> bool:
        try:
            return await still_holds(self.js, self.stream, sequence, upstream)
        except Exception as exc:  # cannot tell now (NATS slow or away): go on as recorded
            log.warning("follower.stream_unchecked", consumer=self.consumer, stream=self.stream, error=repr(exc))
            return True

    def _tracking(self, unit: _Unit, decoded: Any) -> Tracking | None:
        """The position to record with a reaction to this message (or event of a bundle); None: it was reacted to
        before. An event of a bundle set aside (`decoded` None) goes by the position it claims."""
        if not self.reactions:
            return None
        upstream = decoded.position if self.source is not None and isinstance(decoded, EventEnvelope) else None
        if decoded is None and unit.part is not None:
            upstream = claimed_position(unit.msg.data)
        if upstream is not None and self.anew_upstream is not None:
            new = upstream > self.anew_upstream
            return Tracking(self.consumer, unit.sequence, upstream, by_upstream=True) if new else None
        tracking = Tracking(self.consumer, unit.sequence, upstream)
        return tracking if tracking.order() > self.tracked else None

    def _folded_already(self, subject: str, sequence: int) -> bool:
        """Whether the message is in the restored state already (`folded`)."""
        for pattern, through in self.folded.items():
            if subject == pattern or (pattern.endswith(">") and subject.startswith(pattern[:-1])):
                return sequence <= through
        return False

    def positions(self) -> dict[str, int]:
        """Per subject filter, the stream sequence up to which its messages are handled whole (`through`), or held by
        the restored state it started from (`folded`): what a state saved now holds of each (`Restored`)."""
        return {subject: max(self.folded.get(subject, 0), self.through) for subject in self.subjects}

    async def lag(self) -> int:
        """Messages of its filters not yet handled: those the server has not delivered yet, and those delivered and
        still waiting in the client or in the follower's inbox."""
        waiting = self._inbox.qsize() if self._inbox is not None else 0  # taken from the client, not yet decided
        if self._reader is not None:  # catching up: as the last batch fetched told
            return self._reader.left + waiting
        if self._sub is None:
            return waiting
        info = await _consumer_info(self._sub)
        return int(info.num_pending or 0) + int(self._sub.pending_msgs) + waiting  # type: ignore[attr-defined]

    async def _on_message(self, msg: Msg) -> None:
        if self._inbox is not None:
            await self._inbox.put(msg)  # a full inbox holds the client's delivery back
            return
        await self._take([msg])

    async def _work(self, inbox: asyncio.Queue[Msg]) -> None:
        """Take what waits in the inbox, GROUP_MESSAGES at most, and decide it: the messages that came while the
        last run was decided are decided together."""
        while True:
            run = [await inbox.get()]
            while len(run) < GROUP_MESSAGES and not inbox.empty():
                run.append(inbox.get_nowait())
            await self._take_run(run)

    async def _take_run(self, run: Sequence[Msg]) -> None:
        """`_take`, its failure logged as the client's own error callback would, and the follower goes on."""
        try:
            await self._take(run)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("follower.run_failed", consumer=self.consumer)

    async def _take(self, run: Sequence[Msg]) -> None:
        """Handle delivered messages in order, each event of a bundle as if it came alone: new ones together when the
        follower decides runs, the others (and every message of a follower that does not) one at a time."""
        together: list[tuple[Arrival, _Unit]] = []
        for msg in run:
            sequence, pending = delivered(msg)
            if self._counted is not None:
                self._counted.add(1, self._counted_as)
            if sequence <= self._folded_through and self._folded_already(msg.subject, sequence):
                await self._decide(together)  # those before it first: `through` never passes one not handled
                together = []
                self._held(msg)
                self.through = max(self.through, sequence)
                continue
            try:
                units = _units(msg, sequence, pending)
            except _SetAside as refused:  # a bundle that is not one: set aside whole
                await self._decide(together)
                together = []
                unit = _Unit(msg, sequence, pending)
                self._handled(unit, await self._refuse(unit, refused))
                continue
            for unit in units:
                try:
                    decoded = self._accepted(unit.msg)
                except _SetAside as refused:
                    await self._decide(together)
                    together = []
                    self._handled(unit, await self._refuse(unit, refused))
                    continue
                tracking = self._tracking(unit, decoded)
                decoded = self._unless_repeated(decoded)
                if self.handle_group is not None and tracking is not None and decoded is not _REPEATED:
                    together.append((Arrival(decoded, unit.msg, tracking), unit))
                    if len(together) == GROUP_MESSAGES:  # bundles of many events: a run decided stays as bounded
                        await self._decide(together)
                        together = []
                    continue
                await self._decide(together)
                together = []
                await self._one(decoded, unit, tracking)
                self._handled(unit, tracking)
        await self._decide(together)
        if run and not delivered(run[-1])[1]:
            self.caught_up.set()  # the stream's end when the last one came: the view is complete

    async def _one(self, decoded: Any, unit: _Unit, tracking: Tracking | None) -> None:
        """Fold (and react to) one message, or set it aside."""
        try:
            await self._apply(decoded, unit.msg, tracking)
        except _SetAside as refused:
            await self._refuse(unit, refused)

    async def _refuse(self, unit: _Unit, refused: _SetAside) -> Tracking | None:
        """Set the message aside; the tracking position recorded with it (None: it was handled before)."""
        tracking = self._tracking(unit, None)
        await self._set_aside(unit, claims(unit.msg.data), refused, tracking)
        return tracking

    def _handled(self, unit: _Unit, tracking: Tracking | None) -> None:
        if unit.whole:  # a bundle is handled whole with its last event
            self.through = max(self.through, unit.sequence)
        if tracking is not None:
            self.tracked = max(self.tracked, tracking.order())
            if tracking.by_upstream and tracking.upstream is not None:
                self.anew_upstream = tracking.upstream
        if not unit.pending:
            self.caught_up.set()

    async def _decide(self, together: Sequence[tuple[Arrival, _Unit]]) -> None:
        """Decide a run of new messages together; one alone, or what follows a run that broke part-way, one at a
        time."""
        if not together:
            return
        if len(together) == 1 or self.handle_group is None:
            for arrival, unit in together:
                await self._one(arrival.message, unit, arrival.tracking)
                self._handled(unit, arrival.tracking)
            return
        try:
            recorded = await self.handle_group([arrival for arrival, _ in together])
        except GroupBroken as broken:
            log.warning("follower.run_broken", consumer=self.consumer, messages=len(together),
                        recorded=broken.recorded.position if broken.recorded else None, error=str(broken))
            done = broken.recorded.order() if broken.recorded is not None else (0, 0)
            if broken.recorded is not None:
                self._recorded(broken.recorded)
            for arrival, unit in together:
                if arrival.tracking.order() > done:
                    await self._one(arrival.message, unit, arrival.tracking)
                self._handled(unit, arrival.tracking)
            return
        last = together[-1][0].tracking
        if recorded is not None:
            self._recorded(recorded)
        if recorded is None or recorded.order() < last.order():
            self._passed(last)
        for arrival, unit in together:
            self._handled(unit, arrival.tracking)

    def _accepted(self, msg: Msg) -> Any:
        """The message decoded, if it is what this follower reads and where it should come from."""
        try:
            decoded = decode_any(msg.data, self.message_type)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # garbage, or a newer writer's type
            raise _SetAside("undecodable", str(exc)[:500]) from None
        if isinstance(decoded, EventEnvelope) and (why := inconsistency(decoded, msg.subject, self.source)):
            raise _SetAside("inconsistent", why)
        if self.check is not None and (why := self.check(decoded, msg.subject)):
            raise _SetAside("inconsistent", why[:500])
        return decoded

    def _unless_repeated(self, decoded: Any) -> Any:
        """`_REPEATED` for an envelope already applied under a later stream sequence: the relay published
        it again (after a crash, past the duplicate window). Positions only grow in a service's log, so
        an envelope at a position seen before, with the same event id, is that; with another id the
        upstream's log began anew, and it is applied."""
        if isinstance(decoded, EventEnvelope) and self._repeated(decoded):
            log.info("follower.repeat_passed_over", consumer=self.consumer, position=decoded.position,
                     event_id=decoded.event_id)
            return _REPEATED
        return decoded

    def _repeated(self, envelope: EventEnvelope) -> bool:
        """Whether the envelope was seen before (`_unless_repeated`); noted as seen when it was not."""
        if self._seen and envelope.position <= next(reversed(self._seen)):
            if self._seen.get(envelope.position) == envelope.event_id:
                return True
            log.warning("follower.upstream_log_restarted", consumer=self.consumer, position=envelope.position)
            self._seen.clear()
        self._seen[envelope.position] = envelope.event_id
        if len(self._seen) > REMEMBERED_ENVELOPES:
            self._seen.popitem(last=False)
        return False

    def _held(self, msg: Msg) -> None:
        """Note a message the restored state holds (`folded`) as seen, as a replay that folded it would have, so
        that a copy of it published again later is known; it is neither folded nor reacted to."""
        try:
            units = _units(msg, 0, 0)
        except _SetAside:
            return  # a replay would have set it aside, seen nothing of it
        for unit in units:
            try:
                decoded = self._accepted(unit.msg)
            except _SetAside:
                continue
            if isinstance(decoded, EventEnvelope):
                self._repeated(decoded)

    async def _remembering_from(self, first: int) -> int:
        """The stream sequence to begin at, for a restored state holding the filters' messages up to `first` at
        least, so that the latest REMEMBERED_ENVELOPES of them up to it are delivered too (`_held`), as many as a
        replay from the first message remembers there: stepping back twice as far each time. 1: from the start."""
        span = REMEMBERED_ENVELOPES
        try:
            while (begin := first + 1 - span) > 1:
                # Counted first from `begin`: a message stored meanwhile makes it one more from there, never less.
                if await self._pending_from(begin) - await self._pending_from(first + 1) >= REMEMBERED_ENVELOPES:
                    return begin
                span *= 2
        except Exception as exc:  # cannot tell now (NATS slow or away): the whole stream has them
            log.warning("follower.remembered_uncounted", consumer=self.consumer, stream=self.stream,
                        error=repr(exc))
        return 1

    async def _pending_from(self, sequence: int) -> int:
        """How many messages of the filters the stream holds from `sequence` on, told by a consumer made to ask and
        removed at once (the server removes it too, should this process vanish first): none is delivered."""
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=sequence,
                                ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
                                inactive_threshold=PULLED_IDLE_SECONDS)
        if len(self.subjects) > 1:
            config.filter_subjects = self.subjects
        else:
            config.filter_subject = self.subjects[0]
        info = await self.js.add_consumer(self.stream, config)
        with contextlib.suppress(Exception):
            await self.js.delete_consumer(self.stream, info.name)
        return int(info.num_pending or 0)

    async def _apply(self, decoded: Any, msg: Msg, tracking: Tracking | None) -> None:
        """Fold (and react to) the message: passing outages are retried until they pass, a conflict
        or a repeated unknown failure sets it aside."""
        failures = 0
        while True:
            try:
                recorded = False if decoded is _REPEATED else await self.handle(decoded, msg, tracking)
                if tracking is not None:
                    (self._recorded if recorded else self._passed)(tracking)
                return
            except asyncio.CancelledError:
                raise
            except AlreadyProcessed:
                return  # its reaction was recorded before
            except Exception as exc:
                verdict = classify(exc)
                if verdict == "conflict":
                    raise _SetAside("conflict", str(exc)) from None
                if verdict == "unknown":
                    failures += 1
                    if failures >= self.attempts:
                        log.exception("follower.handler_failed", consumer=self.consumer,
                                      sequence=msg.metadata.sequence.stream, failures=failures)
                        raise _SetAside("failed", f"{type(exc).__name__}: {exc}"[:500]) from None
                log.warning("follower.retrying", consumer=self.consumer, sequence=msg.metadata.sequence.stream,
                            verdict=verdict, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.retry_seconds)

    async def _set_aside(self, unit: _Unit, claimed: tuple[str | None, str | None], refused: _SetAside,
                         tracking: Tracking | None) -> None:
        """Pass over a message (or an event of a bundle) for good: recorded (with its tracking) the first time it is
        seen."""
        sequence, subject = unit.sequence, unit.msg.subject
        # An event of a bundle without a position of its own cannot be told new by one: its record, kept once by its
        # id, is asked for every time, and made the first.
        untracked = self.reactions and unit.part is not None and claimed_position(unit.msg.data) is None
        if tracking is None and not untracked:
            # Replayed (set aside when it was new) or a fold-only follower: nothing to record.
            log.warning("follower.passed_over", consumer=self.consumer, sequence=sequence, part=unit.part,
                        cause=refused.cause, reason=refused.reason)
            return
        service, kind = claimed
        record = UpstreamMessageSetAside(consumer=self.consumer, stream=self.stream, sequence=sequence,
                                         subject=subject, cause=refused.cause, reason=refused.reason,
                                         claimed_service=service, claimed_type=kind, part=unit.part)
        fields = {"consumer": self.consumer, "stream": self.stream, "sequence": sequence, "part": unit.part,
                  "subject": subject, "cause": refused.cause, "reason": refused.reason, "claimed_service": service,
                  "claimed_type": kind}
        if tracking is not None:
            log.error("follower.set_aside", **fields)
        # A set-aside record that cannot be applied is not recorded again: no chain of records.
        change = None if kind == _SET_ASIDE_TAG else NewEvent(SET_ASIDE_AGGREGATE,
                                                              set_aside_id(self.consumer, sequence, unit.part), record)
        failures = 0
        while True:
            try:
                if change is None:
                    if tracking is not None:
                        await self.store.record_tracking(tracking)
                elif await self.record_set_aside(change, tracking) and tracking is None:
                    log.error("follower.set_aside", **fields)
                return
            except asyncio.CancelledError:
                raise
            except (AlreadyProcessed, ConcurrencyConflict):
                return  # recorded before
            except Exception as exc:
                if classify(exc) != "transient" and change is not None:
                    failures += 1
                    if failures >= self.attempts:
                        log.exception("follower.set_aside_unrecorded", consumer=self.consumer, sequence=sequence)
                        change = None  # the position alone, so the follower goes on
                        continue
                log.warning("follower.retrying", consumer=self.consumer, sequence=sequence,
                            error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.retry_seconds)

    async def _append_set_aside(self, change: NewEvent, tracking: Tracking | None) -> bool:
        await self.store.append([change], expected_versions={(change.aggregate_type, change.aggregate_id): 0},
                                tracking=tracking)
        return True
