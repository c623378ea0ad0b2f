"""The Python client: everything a user does with Trainyard, over NATS alone (SPEC X6).

    async with TrainyardClient.connect("nats://127.0.0.1:4222", token=my_token) as client:
        accepted = await client.submit(spec)
        job = await client.wait(accepted.job_id)

Refused requests raise `TrainyardError` carrying the service's code, message and hint. Every request
carries the caller's signed token (libs.auth): given, or found by `client.config.default_token`.

Opening fails fast when NATS cannot be reached; once open, the client reconnects for as long as it is open, however
long NATS is away, and sends again what may have been lost with the server where that is safe (`sent_again`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from nats.aio.client import Client

from client.config import default_nats_url, default_token
from client.preload import NodePreload, preload_states
from client.terminal import DebugSession, command_line, open_session
from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.arrays import SweepParameter, new_array_id
from libs.contracts.events import EventEnvelope
from libs.contracts.identity import Identity
from libs.contracts.ids import new_job_id
from libs.contracts.images import MAX_CHUNK_BYTES, ImageRecord, parse_image_ref
from libs.contracts.jobspec import Access, JobSpec, Priority
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.arrays import (
    GET_ARRAY,
    MAX_ARRAY_PAGE,
    SUBMIT_ARRAY,
    ArrayAccepted,
    ArrayDetails,
    ArrayMemberView,
    ArraySelection,
    GetArray,
    SubmitArray,
)
from libs.contracts.operations.autoscaler import (
    AUTOSCALER_LOG,
    QUEUE_STATUS,
    AutoscalerLog,
    GetAutoscalerLog,
    GetQueueStatus,
    QueueStatus,
)
from libs.contracts.operations.base import TERMINAL_STATUSES, CommandError, Done, JobStatus, Operation, ReplyT, RequestT
from libs.contracts.operations.cache import (
    LIST_CACHE,
    PRELOAD_DATASET,
    CacheListing,
    ListCache,
    NodeCache,
    PreloadAccepted,
    PreloadDataset,
)
from libs.contracts.operations.cluster import (
    CHANGE_SETTINGS,
    GET_RESOURCES,
    GET_SETTINGS,
    LIST_FLAVORS,
    LIST_NODES,
    LIST_STORAGE_ACCESS,
    MARK_COMPONENT,
    SET_STORAGE_ACCESS,
    WHOAMI,
    ChangeSettings,
    FlavorList,
    GetResources,
    GetSettings,
    IdentityView,
    ListFlavors,
    ListNodes,
    ListStorageAccess,
    MarkComponent,
    NodeList,
    NodeView,
    ResourceList,
    SetStorageAccess,
    SettingsView,
    StorageAccessList,
    WhoAmI,
)
from libs.contracts.operations.images import (
    DELETE_IMAGE,
    LIST_IMAGES,
    MARK_IMAGE,
    REGISTER_IMAGE,
    UPLOAD_IMAGE,
    DeleteImage,
    ImageList,
    ListImages,
    MarkImage,
    RegisterImage,
    UploadImageChunk,
    UploadReceived,
)
from libs.contracts.operations.jobs import (
    CHANGE_DURATION,
    CHANGE_PRIORITY,
    CLONE_JOB,
    DELETE_JOBS,
    GET_DEV_ENV,
    GET_JOB,
    GET_QUEUE,
    JOB_HISTORY,
    JOB_LOGS,
    JOB_USAGE,
    LIST_JOBS,
    SEARCH_JOBS,
    STOP_JOBS,
    SUBMIT_JOB,
    ChangeDuration,
    ChangePriority,
    ChunksOnce,
    CloneJob,
    DeleteJobs,
    DevEnvSpec,
    GetDevEnv,
    GetJob,
    GetJobHistory,
    GetJobLogs,
    GetJobUsage,
    GetQueue,
    JobAccepted,
    JobDetails,
    JobHistory,
    JobList,
    JobSummary,
    JobUsage,
    JobView,
    ListJobs,
    LogPage,
    SearchJobs,
    SearchResults,
    StopJobs,
    SubmitJob,
)
from libs.contracts.operations.planning import (
    EXPLAIN_JOB,
    PREDICT_JOB,
    SIMULATE,
    ExplainJob,
    PredictionReply,
    PredictJob,
    SimulateHistory,
    SimulationProgress,
    SimulationReport,
    WhyReply,
)
from libs.contracts.operations.runs import (
    GET_RUN,
    GET_SERIES,
    OPEN_TERMINAL,
    GetRun,
    GetSeries,
    OpenTerminal,
    PointsOnce,
    RunView,
    SeriesPage,
    SeriesPoint,
    TerminalOpened,
)
from libs.contracts.scheduling import AdminSettings, NodeResources, Prediction, StoredAccess, StoredKind, WhyReport
from libs.imagefiles import file_digest
from libs.messaging.connection import LoginRefused, NatsLogin, close_connection, connect_once
from libs.messaging.rpc import ServiceUnavailable, call_operation
from libs.natsroles import nats_user_for

# How long a followed log is still read after the job ended: chunks shipped at its end may lag its status.
LOG_DRAIN_SECONDS = 1.0
# A request creating a job (submit, clone) that nothing answers, or that the scheduler answers with
# `unavailable` (an outage of its own: nothing was done), is sent again with the same job id, this many
# times in all: the scheduler creates one job per id, so a lost reply never makes two jobs. Waiting
# 1, 2 and 4 s between attempts outlasts a scheduler that the local stack's supervisor restarts.
CREATE_ATTEMPTS = 4
CREATE_RETRY_SECONDS = 1.0  # the wait before the second attempt, doubled before each later one

# A request out when the client's connection to NATS is made anew may have been lost with the server, or its reply
# may have been. One whose second delivery can do nothing the first did not is sent again at once (`sent_again`):
# - every query (an operation whose `changes_state` is false): it changes nothing. A what-if (`simulate`) is the
#   exception: sent once, as a second replay would double the scheduler's work; its progress and reply still
#   come on the connection made anew;
# - the commands that create by an id the client chose: submit-job, clone-job, submit-array (`_create`, which also
#   sends them again when nothing answers); preload-dataset, by its preload id; upload-image, by the chunk's offset
#   (a chunk taken before is not appended again);
# - the commands that set something to what the request names and record nothing when it is so already:
#   stop-jobs, change-priority, change-duration, change-settings, set-storage-access, mark-image, mark-component.
#   The reply to a second delivery tells what that one found ("already urgent", "stopping 0 job(s)").
# The others (`SENT_ONCE`) are sent once and wait for their reply until the timeout: sent again, a deletion or a
# registration done by the first would be refused, and a second terminal would be opened.
SENT_AGAIN_COMMANDS: frozenset[str] = frozenset({
    SUBMIT_JOB.name, CLONE_JOB.name, SUBMIT_ARRAY.name, PRELOAD_DATASET.name, UPLOAD_IMAGE.name, STOP_JOBS.name,
    CHANGE_PRIORITY.name, CHANGE_DURATION.name, CHANGE_SETTINGS.name, SET_STORAGE_ACCESS.name, MARK_IMAGE.name,
    MARK_COMPONENT.name,
})
SENT_ONCE: frozenset[str] = frozenset({DELETE_JOBS.name, DELETE_IMAGE.name, REGISTER_IMAGE.name, OPEN_TERMINAL.name})
# How many times in all a request is sent while the connection keeps being made anew under it; the last attempt
# waits for its reply until the timeout, whatever the connection does.
SEND_ATTEMPTS = 5
# After a reconnection the services reconnect too, each at its own pace: for this long after it, such a request that
# nothing answers is sent again after a pause.
RECONNECTED_GRACE_SECONDS = 5.0
RESEND_PAUSE_SECONDS = 0.5


def sent_again(operation: Operation[Any, Any]) -> bool:
    """Whether a request of `operation` is sent again when the connection is made anew while it is out."""
    return not operation.changes_state or operation.name in SENT_AGAIN_COMMANDS


class TrainyardError(Exception):
    """A request the platform refused."""

    def __init__(self, error: CommandError) -> None:
        self.error = error
        super().__init__(error.message)


class NoAnswer(ServiceUnavailable):
    """NATS is reachable, but nothing answered the request on `subject`: the service that answers it
    is not running, or is stuck."""

    def __init__(self, subject: str, message: str) -> None:
        super().__init__(message)
        self.subject = subject


class CreationUnanswered(NoAnswer):
    """A request creating job `job_id` went unanswered at every attempt: the job may exist all the same
    (a reply can be lost after the job was recorded), and asking for `job_id` tells."""

    def __init__(self, subject: str, job_id: str, attempts: int, last: ServiceUnavailable) -> None:
        super().__init__(subject, f"nothing answered creating job {job_id} ({attempts} attempts; the last: {last})")
        self.job_id = job_id


class Reconnected(NoAnswer):
    """The connection to NATS was made anew while the request was out: the request or its reply may have been
    lost with the server."""


class Reconnections:
    """Tells a request that was out when the client's connection to NATS was made anew: its request or its
    reply may have been lost with the server it was connected to (a server restarted, or one of a cluster killed)."""

    def __init__(self) -> None:
        self._next = asyncio.Event()
        self.last: float | None = None  # the event loop's time of the latest reconnection

    async def happened(self) -> None:
        """nats-py's callback after a reconnection."""
        self.last = asyncio.get_running_loop().time()
        self._next.set()
        self._next = asyncio.Event()

    def next(self) -> asyncio.Event:
        """Set at the next reconnection."""
        return self._next

    def within(self, seconds: float) -> bool:
        """Whether the connection was made anew less than `seconds` ago."""
        return self.last is not None and asyncio.get_running_loop().time() - self.last < seconds


class TrainyardClient:
    def __init__(self, nc: Client, *, token: str | None = None, timeout: float = 10.0,
                 reconnections: Reconnections | None = None) -> None:
        self.nc = nc
        self.reconnections = reconnections
        self.token = token if token is not None else default_token()
        self.timeout = timeout
        # The instant the views of the state (jobs, arrays, nodes, resources, queue, why) are asked about: None
        # for now, else the scheduler rebuilds its state from the events up to it (`trainyard at`).
        self.at: datetime | None = None

    @classmethod
    async def open(cls, nats_url: str | None = None, *, token: str | None = None) -> TrainyardClient:
        """A client connected to NATS at `nats_url` (default: `NATS_URL`, else the local stack's). Raises at once
        when NATS cannot be reached (`ServiceUnavailable`, `cannot connect to NATS at …`) or refuses the token
        (`TrainyardError`, code `unauthenticated`); once connected, it reconnects for as long as it is open."""
        url = nats_url or default_nats_url()
        token = token if token is not None else default_token()
        reconnections = Reconnections()
        try:
            nc = await connect_once(url, "trainyard-client", NatsLogin.for_token(token),
                                    reconnected=reconnections.happened)
        except LoginRefused as exc:  # the stack runs, and does not take this token
            raise TrainyardError(CommandError(code="unauthenticated", message=str(exc))) from None
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            raise ServiceUnavailable(f"cannot connect to NATS at {url} ({reason})") from None
        return cls(nc, token=token, reconnections=reconnections)

    @classmethod
    def connect(cls, nats_url: str | None = None, *, token: str | None = None) -> _ClientContext:
        return _ClientContext(nats_url, token)

    @property
    def closed(self) -> bool:
        """The connection is closed: by `close`, or by NATS once the token ran out (its reconnections are refused
        then). A client reconnects for as long as it is open, however long NATS is away."""
        return bool(self.nc.is_closed)

    async def close(self) -> None:
        await close_connection(self.nc)  # at once while NATS is away: it would otherwise reconnect for ever

    async def ask(self, operation: Operation[RequestT, ReplyT], request: RequestT) -> ReplyT:
        """Send `request` as `operation` (libs/contracts/operations) and return its reply; a refusal raises
        `TrainyardError`, no answer `NoAnswer`.

        A request that may be delivered twice (`sent_again`: every query, and the commands listed in
        SENT_AGAIN_COMMANDS) is sent again at once when the connection to NATS is made anew while it is out, and
        again after a short pause when nothing answers it within RECONNECTED_GRACE_SECONDS of a reconnection (the
        services reconnect too), SEND_ATTEMPTS times in all. Any other is sent once, and waits for its reply (which
        may still come after a reconnection) until the timeout.
        """
        if self.reconnections is None or not sent_again(operation):
            return await self._ask_once(operation, request)
        reconnections = self.reconnections
        for _ in range(SEND_ATTEMPTS - 1):
            try:
                reply: ReplyT = await self._until_reconnected(operation, request)
                return reply
            except Reconnected:
                continue
            except NoAnswer:
                if not reconnections.within(RECONNECTED_GRACE_SECONDS):
                    raise
                await asyncio.sleep(RESEND_PAUSE_SECONDS)
        return await self._ask_once(operation, request)

    async def _ask_once(self, operation: Operation[RequestT, ReplyT], request: RequestT) -> ReplyT:
        reply: ReplyT = await self._answered(
            operation.subject, call_operation(self.nc, operation, request, timeout=self.timeout, token=self.token),
            operation.reply)
        return reply

    async def _answered(self, subject: str, calling: Awaitable[Any], expected: type[Any]) -> Any:
        """The reply `calling` gets, as `expected`: none is `NoAnswer`, a refusal `TrainyardError`."""
        try:
            reply = await calling
        except ServiceUnavailable as exc:
            raise NoAnswer(subject, str(exc)) from None
        if isinstance(reply, CommandError):
            raise TrainyardError(reply)
        if not isinstance(reply, expected):
            raise TypeError(f"unexpected reply {type(reply).__name__} on {subject}")
        return reply

    # --- commands ---------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, *, job_id: str | None = None, predict: bool = False,
                     on_retry: Callable[[int, Exception], None] | None = None) -> JobAccepted:
        """Create a job; passing the same `job_id` again is safe (it is created once). `predict`: the answer
        carries the job's prediction (S6), planned before it was queued; otherwise it is recorded a moment
        later (`get_job`), so that a burst of submissions is not held up planning each.

        The id is chosen here unless given. A request nothing answers, or answered `unavailable`, is sent
        again with the same id (CREATE_ATTEMPTS in all; `on_retry(attempt, error)` is told before each
        new attempt); when the last goes unanswered too, `CreationUnanswered` names the id.
        """
        request = SubmitJob(job_id=job_id or new_job_id(), spec=spec, predict=predict)
        accepted: JobAccepted = await self._create(SUBMIT_JOB, request, request.job_id, on_retry)
        return accepted

    async def submit_array(self, spec: JobSpec, *, indices: str = "", sweep: Sequence[SweepParameter] = (),
                           max_running: int | None = None, array_id: str | None = None,
                           on_retry: Callable[[int, Exception], None] | None = None) -> ArrayAccepted:
        """Create an array of jobs from one spec in one request: a job per index of `indices` (`0-999`,
        `1-10:2`, `0,6,16-32`, optionally `%N`), or per point of the cross product of `sweep`
        (libs/contracts/arrays.py). Each job has its index in TRAINYARD_ARRAY_INDEX and `{index}` filled in its
        name and command; a bad spec refuses the whole array. Sent again with the same id while unanswered."""
        request = SubmitArray(array_id=array_id or new_array_id(), spec=spec, indices=indices, sweep=list(sweep),
                              max_running=max_running)
        accepted: ArrayAccepted = await self._create(SUBMIT_ARRAY, request, request.array_id, on_retry)
        return accepted

    async def _create(self, operation: Operation[Any, Any], request: SubmitJob | CloneJob | SubmitArray, job_id: str,
                      on_retry: Callable[[int, Exception], None] | None) -> Any:
        """Send a job-creating request until it is answered, at most CREATE_ATTEMPTS times, always with
        the same id."""
        wait = CREATE_RETRY_SECONDS
        for next_attempt in range(2, CREATE_ATTEMPTS + 1):
            try:
                return await self._until_reconnected(operation, request)
            except (NoAnswer, TrainyardError) as exc:
                if isinstance(exc, TrainyardError) and exc.error.code != "unavailable":
                    raise
                if on_retry is not None:
                    on_retry(next_attempt, exc)
                await asyncio.sleep(wait)
                wait *= 2
        try:
            return await self._until_reconnected(operation, request)
        except NoAnswer as exc:
            raise CreationUnanswered(operation.subject, job_id, CREATE_ATTEMPTS, exc) from None

    async def _until_reconnected(self, operation: Operation[Any, Any], request: Any) -> Any:
        """One attempt, given up with `Reconnected` as soon as the connection is made anew while it is out (the
        request or its reply may be lost with the server): sent again then, rather than after the whole timeout."""
        if self.reconnections is None:
            return await self._ask_once(operation, request)
        reconnected = self.reconnections.next()
        calling = asyncio.ensure_future(self._ask_once(operation, request))
        waiting = asyncio.ensure_future(reconnected.wait())
        try:
            await asyncio.wait({calling, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            if not calling.done():
                calling.cancel()
                with contextlib.suppress(BaseException):  # its outcome no longer matters
                    await calling
        if calling.cancelled():
            raise Reconnected(operation.subject, "the connection to NATS was made anew while the request was out")
        return calling.result()

    async def stop(self, job_ids: Sequence[str], arrays: Sequence[ArraySelection] = ()) -> Done:
        """Stop jobs, and the jobs of arrays (all, or the indices an `ArraySelection` names)."""
        result: Done = await self.ask(STOP_JOBS, StopJobs(job_ids=list(job_ids), arrays=list(arrays)))
        return result

    async def delete(self, job_ids: Sequence[str], arrays: Sequence[ArraySelection] = ()) -> Done:
        """Delete ended jobs, and the jobs of arrays (all of them, or some; every one ended)."""
        result: Done = await self.ask(DELETE_JOBS, DeleteJobs(job_ids=list(job_ids), arrays=list(arrays)))
        return result

    async def change_priority(self, job_id: str, priority: Priority) -> Done:
        """S3: reorder a queued job (very-urgent is for administrators; urgent counts against the cap, S2)."""
        request = ChangePriority(job_id=job_id, priority=priority)
        result: Done = await self.ask(CHANGE_PRIORITY, request)
        return result

    async def change_duration(self, job_id: str, duration: str | None) -> Done:
        """S11: set (`4h`) or remove (None) a job's duration limit, also while it runs."""
        request = ChangeDuration(job_id=job_id, duration=duration)
        result: Done = await self.ask(CHANGE_DURATION, request)
        return result

    async def clone(self, source_job_id: str, overrides: dict[str, Any] | None = None, *,
                    job_id: str | None = None, on_retry: Callable[[int, Exception], None] | None = None,
                    ) -> JobAccepted:
        """O1: a new job from another's spec with `overrides` applied in order: a top-level field replaced whole
        (`{"nodes": 4}`), or one entry of a field set by a dotted path, its other entries kept (`{"env.SEED": "7"}`).

        The new job's id is chosen here unless given, and an unanswered request is sent again with it,
        as `submit` does: the job is created once.
        """
        request = CloneJob(source_job_id=source_job_id, job_id=job_id or new_job_id(), overrides=overrides or {})
        accepted: JobAccepted = await self._create(CLONE_JOB, request, request.job_id, on_retry)
        return accepted

    async def change_settings(self, *, urgent_cap: int | None = None, sharing_enabled: bool | None = None,
                              max_resumes_cap: int | None = None, max_graceful_shutdown_seconds: int | None = None,
                              debug_retention: str | None = None, cache_retention: str | None = None,
                              cache_high_percent: float | None = None, cache_low_percent: float | None = None,
                              disk_high_percent: float | None = None,
                              disk_low_percent: float | None = None, max_queued_jobs_per_user: int | None = None,
                              submit_rate: int | None = None, submit_burst: int | None = None,
                              job_retention: str | None = None) -> AdminSettings:
        """Administrators only: change the given settings (None keeps one) and return all of them.
        `max_queued_jobs_per_user` and `submit_rate` take 0 for no limit."""
        request = ChangeSettings(urgent_cap=urgent_cap, sharing_enabled=sharing_enabled,
                                 max_resumes_cap=max_resumes_cap,
                                 max_graceful_shutdown_seconds=max_graceful_shutdown_seconds,
                                 debug_retention=debug_retention, cache_retention=cache_retention,
                                 cache_high_percent=cache_high_percent, cache_low_percent=cache_low_percent,
                                 disk_high_percent=disk_high_percent, disk_low_percent=disk_low_percent,
                                 max_queued_jobs_per_user=max_queued_jobs_per_user, submit_rate=submit_rate,
                                 submit_burst=submit_burst, job_retention=job_retention)
        reply: SettingsView = await self.ask(CHANGE_SETTINGS, request)
        return reply.settings

    async def run(self, job_id: str) -> RunView:
        """R2: the job's run: each series with its last, least and greatest values; its configuration and
        summary."""
        reply: RunView = await self.ask(GET_RUN, GetRun(job_id=job_id))
        return reply

    async def series(self, job_id: str, name: str, rank: int | None = 0, *, follow: bool = False,
                     poll_seconds: float = 1.0) -> AsyncIterator[SeriesPoint]:
        """R2: every point of series `name` of the job's run, of `rank` (None: every rank), in logged order;
        with `follow`, then the points logged after, as they come, until the job has ended and its last
        points are read. A point its agent published twice (after a restart) comes once."""
        after = 0
        once = PointsOnce()
        while True:
            page: SeriesPage = await self.ask(GET_SERIES, GetSeries(job_id=job_id, name=name, rank=rank,
                                                                               after=after))
            for point in once.fresh(page.points):
                yield point
            after = page.next_after
            if page.more:
                continue
            if not follow:
                return
            if (await self.get_job(job_id)).job.status in TERMINAL_STATUSES:
                follow = False  # one more page: what was logged before the end
                continue
            await asyncio.sleep(poll_seconds)

    async def cache(self, node: str | None = None) -> list[NodeCache]:
        """D1, D2: the dataset caches of every node (or of `node`), as their agents last reported them."""
        reply: CacheListing = await self.ask(LIST_CACHE, ListCache(node=node))
        return reply.nodes

    async def preload(self, name: str, version: str | None = None, *, nodes: Sequence[str] = (),
                      flavor: str | None = None, preload_id: str | None = None) -> PreloadAccepted:
        """D2: copy dataset `name` (at `version`) into the caches of `nodes`, or of every node a rank of
        `flavor` fits on; `preload_progress` follows it."""
        request = PreloadDataset(preload_id=preload_id or f"preload-{secrets.token_hex(6)}", name=name,
                                 version=version, nodes=list(nodes), flavor=flavor)
        reply: PreloadAccepted = await self.ask(PRELOAD_DATASET, request)
        return reply

    async def preload_progress(self, accepted: PreloadAccepted, since: datetime, *,
                               poll_seconds: float = 0.5) -> AsyncIterator[list[NodePreload]]:
        """How the preload is getting on, node by node, as it changes, until every node is done or failed."""
        last: list[NodePreload] | None = None
        while True:
            states = preload_states(await self.cache(), accepted.nodes, accepted.source, since)
            if states != last:
                yield states
                last = states
            if all(state.settled for state in states):
                return
            await asyncio.sleep(poll_seconds)

    async def mark_component(self, node: str, component: str, *, faulty: bool = True, reason: str = "") -> Done:
        """M2 drills, administrators only: mark a node's component (`board:0`, `nic:eth0`,
        `runtime:storage`) faulty, or clear the mark (`faulty=False`)."""
        request = MarkComponent(node=node, component=component, faulty=faulty, reason=reason)
        result: Done = await self.ask(MARK_COMPONENT, request)
        return result

    # --- queries ----------------------------------------------------------------------------------

    async def list_jobs(self, statuses: list[JobStatus] | None = None, project: str | None = None,
                        limit: int = 200) -> list[JobView]:
        request = ListJobs(statuses=statuses or [], project=project, limit=limit, at=self.at)
        reply: JobList = await self.ask(LIST_JOBS, request)
        return reply.jobs

    async def listing(self, statuses: list[JobStatus] | None = None, project: str | None = None,
                      limit: int = 200) -> JobList:
        """Jobs and arrays, newest first, each array as one object (its jobs are not among `jobs`)."""
        reply: JobList = await self.ask(LIST_JOBS, ListJobs(statuses=statuses or [], project=project,
                                                                       limit=limit, group_arrays=True, at=self.at))
        return reply

    async def get_array(self, array_id: str, *, after: int = -1, limit: int = MAX_ARRAY_PAGE) -> ArrayDetails:
        """An array and a page of its jobs, in index order, from the first index after `after`."""
        result: ArrayDetails = await self.ask(GET_ARRAY, GetArray(array_id=array_id, after=after,
                                                                             limit=limit, at=self.at))
        return result

    async def array_jobs(self, array_id: str) -> AsyncIterator[ArrayMemberView]:
        """Every job of an array, in index order, a page at a time."""
        after = -1
        while True:
            page = await self.get_array(array_id, after=after)
            for job in page.jobs:
                yield job
            if not page.more or not page.jobs:
                return
            after = page.jobs[-1].index

    async def get_job(self, job_id: str) -> JobDetails:
        result: JobDetails = await self.ask(GET_JOB, GetJob(job_id=job_id, at=self.at))
        return result

    async def nodes(self) -> list[NodeView]:
        reply: NodeList = await self.ask(LIST_NODES, ListNodes(at=self.at))
        return reply.nodes

    async def simulate(self, start: datetime, end: datetime | None = None, *, add_nodes: dict[str, int] | None = None,
                       remove_nodes: dict[str, int] | None = None, depth: int | None = None,
                       on_progress: Callable[[SimulationProgress], None] | None = None) -> SimulationReport:
        """What if (administrators): the submissions recorded from `start` to `end` (None: now) replayed through the
        scheduler in virtual time on a changed cluster, beside what really happened. `on_progress` is told how far
        the replay has come while it runs."""
        request = SimulateHistory(start=start, end=end, add_nodes=add_nodes or {}, remove_nodes=remove_nodes or {},
                                  depth=depth)
        calling = call_operation(self.nc, SIMULATE, request, token=self.token, timeout=self.timeout,
                                 on_progress=on_progress)
        report: SimulationReport = await self._answered(SIMULATE.subject, calling, SIMULATE.reply)
        return report

    async def queue(self, limit: int = 200) -> list[JobView]:
        """The first `limit` waiting jobs in the order the scheduler tries them (`queue_position` from 1)."""
        return (await self.waiting(limit)).jobs

    async def waiting(self, limit: int = 200) -> JobList:
        """The first `limit` waiting jobs, in order, and (`waiting`) how many you may see wait in all."""
        reply: JobList = await self.ask(GET_QUEUE, GetQueue(at=self.at, limit=limit))
        return reply

    async def queue_status(self) -> QueueStatus:
        result: QueueStatus = await self.ask(QUEUE_STATUS, GetQueueStatus())
        return result

    async def predict(self, spec: JobSpec) -> Prediction:
        """S6: whether `spec` would start now, or where it would queue and until when; creates nothing."""
        reply: PredictionReply = await self.ask(PREDICT_JOB, PredictJob(spec=spec))
        return reply.prediction

    async def why(self, job_id: str) -> WhyReport:
        """What a queued job waits for: jobs ahead, and per flavor the nodes and resources it lacks."""
        reply: WhyReply = await self.ask(EXPLAIN_JOB, ExplainJob(job_id=job_id, at=self.at))
        return reply.report

    async def devenv(self, job_id: str) -> DevEnvSpec:
        """O4: what a development environment needs to look like one node of the job."""
        result: DevEnvSpec = await self.ask(GET_DEV_ENV, GetDevEnv(job_id=job_id))
        return result

    async def history(self, job_id: str) -> list[EventEnvelope]:
        """O6: every service's events about the job, in order.

        Served by the scheduler rather than read from JetStream so that the job's access rules (J2)
        apply to its history as to its details.
        """
        events: list[EventEnvelope] = []
        start = 0
        while True:  # page by page: the history of a job of many nodes is larger than one reply may be
            reply: JobHistory = await self.ask(JOB_HISTORY, GetJobHistory(job_id=job_id, start=start))
            events += reply.events
            if reply.next is None or reply.next <= start:
                return events
            start = reply.next

    async def events(self, job_id: str) -> list[EventEnvelope]:
        """The same as `history` (kept for existing callers)."""
        return await self.history(job_id)

    async def search(self, *, name: str | None = None, statuses: list[JobStatus] | None = None,
                     creator: str | None = None, algorithm: str | None = None, favorite_algorithm: str | None = None,
                     flavor: str | None = None, output: str | None = None, project: str | None = None,
                     limit: int = 200, offset: int = 0) -> list[JobSummary]:
        """O2: the jobs the caller may see that match every given filter (`name`: a case-insensitive part), newest
        first: at most `limit` (1 to 1000) after skipping the first `offset`."""
        request = SearchJobs(name=name, statuses=statuses or [], creator=creator, algorithm=algorithm,
                             favorite_algorithm=favorite_algorithm, flavor=flavor, output=output, project=project,
                             limit=limit, offset=offset)
        reply: SearchResults = await self.ask(SEARCH_JOBS, request)
        return reply.jobs

    async def resources(self, flavors: list[str]) -> list[NodeResources]:
        """S7: the schedulable nodes for these flavors, with what is used and free on each."""
        reply: ResourceList = await self.ask(GET_RESOURCES, GetResources(flavors=flavors, at=self.at))
        return reply.nodes

    async def flavors(self, board: str | None = None) -> FlavorList:
        """S8: the flavors (of one board model, if given) and the boards queued jobs need per model."""
        result: FlavorList = await self.ask(LIST_FLAVORS, ListFlavors(board=board))
        return result

    async def set_storage_access(self, kind: StoredKind, name: str, *, project: str, others: Access,
                                 owner: str | None = None) -> StoredAccess:
        """J2: register a resource of shared storage to yourself (administrators: to `owner`), or change
        what the other members of `project` may do with it; returns the registration."""
        request = SetStorageAccess(kind=kind, name=name, project=project, others=others, owner=owner)
        reply: StorageAccessList = await self.ask(SET_STORAGE_ACCESS, request)
        return reply.entries[0]

    async def storage_access(self, kind: StoredKind | None = None) -> list[StoredAccess]:
        """Registered resources of your projects and your own; resources not listed are open to all."""
        reply: StorageAccessList = await self.ask(LIST_STORAGE_ACCESS, ListStorageAccess(kind=kind))
        return reply.entries

    # --- J10: training images ------------------------------------------------------------------------

    async def register_image(self, ref: str, archive: Path, *, boards: list[str], training: bool = True,
                             description: str = "", replace: bool = False,
                             progress: Callable[[int, int], None] | None = None) -> ImageRecord:
        """Upload the image archive `archive` (administrators) in chunks, then register it as `ref` (NAME[:TAG])
        for `boards`; `progress(sent, total)` after each chunk. Raises ImageRefError for a bad reference and
        OSError for an unreadable file, before anything is sent.

        The upload is named by the archive's digest: when an earlier upload of it was cut off (the process
        killed, the connection lost), the scheduler still holds its start, and only the rest is sent
        (`progress` is told first how much that start is)."""
        name, tag = parse_image_ref(ref)
        total = archive.stat().st_size
        digest = await asyncio.to_thread(file_digest, archive)
        upload_id = digest.removeprefix("sha256:")[:32]
        held: UploadReceived = await self.ask(UPLOAD_IMAGE, UploadImageChunk(upload_id=upload_id, offset=0, data=b""))
        sent = held.received_bytes
        if sent and progress is not None:
            progress(sent, total)
        with archive.open("rb") as source:
            source.seek(sent)
            while chunk := await asyncio.to_thread(source.read, MAX_CHUNK_BYTES):
                chunk_request = UploadImageChunk(upload_id=upload_id, offset=sent, data=chunk)
                received: UploadReceived = await self.ask(UPLOAD_IMAGE, chunk_request)
                sent = received.received_bytes
                source.seek(sent)
                if progress is not None:
                    progress(sent, total)
        request = RegisterImage(name=name, tag=tag, upload_id=upload_id, digest=digest, boards=boards,
                                training=training, description=description, replace=replace)
        reply: ImageList = await self.ask(REGISTER_IMAGE, request)
        return reply.images[0]

    async def images(self, ref: str | None = None) -> list[ImageRecord]:
        """The catalogue of images (or the one `ref` names)."""
        reply: ImageList = await self.ask(LIST_IMAGES, ListImages(ref=ref))
        return reply.images

    async def mark_image(self, ref: str, *, training: bool) -> ImageRecord:
        """Mark an image for training jobs, or take the mark away (administrators)."""
        reply: ImageList = await self.ask(MARK_IMAGE, MarkImage(ref=ref, training=training))
        return reply.images[0]

    async def delete_image(self, ref: str) -> str:
        """Take an image out of the catalogue (administrators); what was done."""
        reply: Done = await self.ask(DELETE_IMAGE, DeleteImage(ref=ref))
        return reply.message

    async def settings(self) -> AdminSettings:
        reply: SettingsView = await self.ask(GET_SETTINGS, GetSettings())
        return reply.settings

    async def whoami(self) -> Identity:
        """The identity the services see in this client's token."""
        reply: IdentityView = await self.ask(WHOAMI, WhoAmI())
        return reply.identity

    async def wait(self, job_id: str, *, poll_seconds: float = 0.5,
                   on_change: Callable[[JobView], None] | None = None, timeout: float | None = None) -> JobView:
        """Wait until the job ends; `on_change` sees every status it passes through."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        last: tuple[str, int] | None = None
        while True:
            job = (await self.get_job(job_id)).job
            state = (job.status, sum(1 for i in job.instances if i.state == "running"))
            if on_change and state != last:
                on_change(job)
            last = state
            if job.status in TERMINAL_STATUSES:
                return job
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout:g}s")
            await asyncio.sleep(poll_seconds)

    async def usage(self, job_id: str) -> list[UsageSample]:
        """The latest resource usage of each node of the job that reported any (L9), by rank, served by
        the scheduler under the job's access rules (J2)."""
        reply: JobUsage = await self.ask(JOB_USAGE, GetJobUsage(job_id=job_id))
        return reply.samples

    # --- logs --------------------------------------------------------------------------------------

    async def logs(self, job_id: str, rank: int | None = None, *, follow: bool = False,
                   poll_seconds: float = 0.5) -> AsyncIterator[LogChunk]:
        """Log chunks of every node (or one rank), in the order they were stored; with `follow`, until
        the job has ended. Read page by page from the scheduler, under the job's access rules (J2)."""
        loop = asyncio.get_running_loop()
        after = 0
        drain_until: float | None = None
        once = ChunksOnce()  # a chunk its agent shipped again long after (a node down for minutes) is shown once
        while True:
            request = GetJobLogs(job_id=job_id, rank=rank, after=after)
            page: LogPage = await self.ask(JOB_LOGS, request)
            for chunk in once.fresh(page.chunks):
                yield chunk
            after = page.next_after
            if page.more:
                continue
            if not follow:
                return
            if page.ended:
                # A short drain after the end lets chunks still in flight arrive.
                if drain_until is None:
                    drain_until = loop.time() + LOG_DRAIN_SECONDS
                elif loop.time() >= drain_until:
                    return
            await asyncio.sleep(poll_seconds)

    # --- streams: alerts -----------------------------------------------------------------------------

    async def alerts(self, *, follow: bool = False, poll_seconds: float = 1.0) -> AsyncIterator[EventEnvelope]:
        """M7: every alert raised so far that this user may see, oldest first, as envelopes whose `event`
        is an AlertRaised; with `follow`, then each new one as it is raised, until the caller stops.
        The monitor answers (ListAlerts) from its own log: people never read the event stream themselves."""
        try:
            async for envelope in self._envelope_pages(LIST_ALERTS, lambda after: ListAlerts(after=after),
                                                       follow=follow, poll_seconds=poll_seconds):
                yield envelope
        except ServiceUnavailable as exc:
            raise ServiceUnavailable(f"the monitor answers alerts, and it did not: {exc}") from None

    async def autoscaler_log(self, *, follow: bool = False, poll_seconds: float = 1.0) -> AsyncIterator[EventEnvelope]:
        """A6: the autoscaler's own log, oldest first (InstanceRequested, InstanceReady, ...); with `follow`, then
        each new entry as it is recorded, until the caller stops."""
        async for envelope in self._envelope_pages(AUTOSCALER_LOG,
                                                   lambda after: GetAutoscalerLog(after=after),
                                                   follow=follow, poll_seconds=poll_seconds):
            yield envelope

    async def _envelope_pages(self, operation: Operation[Any, Any],
                              request: Callable[[int], Any], *, follow: bool,
                              poll_seconds: float) -> AsyncIterator[EventEnvelope]:
        """The envelopes of a service's own log, page after page from position 0 (`request(after)` asks for the
        next); with `follow`, then polled for new ones until the caller stops."""
        after = 0
        while True:
            page: AlertPage | AutoscalerLog = await self.ask(operation, request(after))
            for envelope in page.alerts if isinstance(page, AlertPage) else page.entries:
                yield envelope
            after = page.next_after
            if page.more:
                continue
            if not follow:
                return
            await asyncio.sleep(poll_seconds)

    # --- debug sessions (J15) ----------------------------------------------------------------------

    def _nats_user(self) -> str:
        """Whom NATS knows this client as: a session's subjects name it, and only it may use them."""
        user = nats_user_for(self.token) if self.token else None
        return user or "anonymous"  # no token: the monitor refuses the session anyway

    @contextlib.asynccontextmanager
    async def session(self, job_id: str, command: str | None = None, *, node: str | None = None,
                      columns: int = 80, rows: int = 24) -> AsyncIterator[DebugSession]:
        """A session in the job's kept (or running) environment on `node` (default: the master's):
        `command` run by a shell, or without one an interactive shell on a terminal of that size.

            async with client.session(job_id, "tail -f /workspace/outputs/train.log") as session:
                async for chunk in session.output():
                    sys.stdout.buffer.write(chunk)

        `run_in_job` runs a command to its end; `client.terminal.attach` connects a session to a terminal.
        """
        async def ask(request: OpenTerminal) -> TerminalOpened:
            opened: TerminalOpened = await self.ask(OPEN_TERMINAL, request)
            return opened

        request = OpenTerminal(job_id=job_id, node=node, command=command, columns=columns, rows=rows)
        opened = await open_session(self.nc, self._nats_user(), ask, request)
        try:
            yield opened
        finally:
            await opened.close()

    async def run_in_job(self, job_id: str, command: str | Sequence[str], node: str | None = None, *,
                         input: bytes = b"", timeout: float | None = None) -> tuple[int, bytes]:
        """Run `command` in the job's kept (or running) environment and return its exit code and
        output (stdout and stderr as the agent merged them). `command` is a shell line, or words
        quoted as given; `input` is its stdin. Raises TimeoutError after `timeout` seconds (the
        command then ends on the node when its session's idle time passes)."""
        line = command if isinstance(command, str) else command_line(command)
        if not line or not line.strip():
            raise ValueError("give a command to run; for an interactive shell use session()")
        async with self.session(job_id, line, node=node) as session:
            await session.send(input)
            await session.close_input()
            async with asyncio.timeout(timeout):
                output = await session.read_all()
            if session.exit_code is None:
                raise ConnectionError(f"session {session.session_id} on {session.node} ended without an exit code")
            return session.exit_code, output


class _ClientContext:
    def __init__(self, nats_url: str | None, token: str | None) -> None:
        self.nats_url = nats_url
        self.token = token
        self.client: TrainyardClient | None = None

    async def __aenter__(self) -> TrainyardClient:
        self.client = await TrainyardClient.open(self.nats_url, token=self.token)
        return self.client

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.client is not None:
            await self.client.close()

