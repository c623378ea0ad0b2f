"""The scheduler's queries: listings, details, history, search, prediction, explanation, resources.

Every query is answered for the authenticated caller: jobs they may not view (J2) do not appear in
listings and are "not found" when asked for by id.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import msgspec
from nats.js.client import JetStreamContext

from libs.contracts.identity import Identity
from libs.contracts.operations.arrays import GET_ARRAY, ArrayDetails, ArrayView, GetArray
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.cluster import (
    GET_RESOURCES,
    GET_SETTINGS,
    LIST_FLAVORS,
    LIST_NODES,
    LIST_STORAGE_ACCESS,
    WHOAMI,
    FlavorList,
    GetResources,
    GetSettings,
    IdentityView,
    ListFlavors,
    ListNodes,
    ListStorageAccess,
    NodeList,
    ResourceList,
    SettingsView,
    StorageAccessList,
    WhoAmI,
)
from libs.contracts.operations.jobs import (
    GET_DEV_ENV,
    GET_JOB,
    GET_QUEUE,
    JOB_HISTORY,
    LIST_JOBS,
    SEARCH_JOBS,
    DevEnvSpec,
    GetDevEnv,
    GetJob,
    GetJobHistory,
    GetQueue,
    JobDetails,
    JobHistory,
    JobList,
    JobSummary,
    JobView,
    ListJobs,
    SearchJobs,
    SearchResults,
    history_page,
)
from libs.contracts.operations.planning import (
    EXPLAIN_JOB,
    PREDICT_JOB,
    ExplainJob,
    PredictionReply,
    PredictJob,
    WhyReply,
)
from libs.contracts.scheduling import WhyReport
from libs.eventstore import EventStore
from libs.eventstore.published import PublishedIndex
from libs.messaging.responder import Handler, Route
from services.scheduler.domain import arrays
from services.scheduler.domain.access import access_error, can_view
from services.scheduler.domain.spec_checks import invalid_spec, spec_errors
from services.scheduler.domain.state import Job, SchedulerState
from services.scheduler.domain.views import dev_env, flavor_list, node_resources, node_views, status_sentence
from services.scheduler.domain.visibility import hide_applications, hide_jobs
from services.scheduler.handlers.shared_plans import SharedPlans, consumed, latest_expectation
from services.scheduler.history.archived import Archive, ArchivedScheduler, job_events
from services.scheduler.history.past import PastStates
from services.scheduler.interfaces import Reading, Scheduling
from services.scheduler.planning.decision_inputs import cluster_flavors, node_capacity, queued_jobs, running_jobs
from services.scheduler.planning.explain import explain
from services.scheduler.planning.prediction import Forecast

NOT_ENDED = frozenset({"queued", "running"})  # the statuses of the state's active jobs
NEWEST = operator.attrgetter("queue_order")  # listings show the newest jobs first
# How long a listing waits for the plan of its waiting jobs' expected starts, and the details of one job of a past
# state (the live scheduler's wait for none: shared_plans.py).
LISTING_WAIT, DETAILS_WAIT = 1.0, 5.0


def live_summary(state: SchedulerState, summary: JobSummary) -> JobSummary:
    """`summary` with its node count filled from the state when the read model has none, and the node of rank 0
    of a job running now; as it was when the state no longer holds the job."""
    job = state.jobs.get(summary.job_id)
    if job is None:
        return summary
    nodes = summary.nodes if summary.nodes is not None else job.spec.nodes
    running = job.status == "running"
    master = next((p.node for p in job.placement if p.rank == 0), None) if running else None
    return msgspec.structs.replace(summary, nodes=nodes, master=master)


def _waits(job: Job | None) -> bool:
    """Whether the job waits in the queue for its start (a job being pre-checked holds its nodes already)."""
    return job is not None and job.status == "queued" and not job.prechecking


class StateQueries:
    """The views of the scheduler's state: of the live one, or of the one it had at a past instant (past.py)."""

    def __init__(self, scheduler: Reading, *, own_planning: bool = True) -> None:
        self.scheduler = scheduler
        # Whether its planning thread plans for its views alone, as a past state's does; the live scheduler's plans
        # new jobs' predictions and `predict` too.
        self.own_planning = own_planning
        self._plans = SharedPlans(lambda job_ids: self.scheduler.forecast_queued(job_ids),
                                  lambda job_id: _waits(self.state.jobs.get(job_id)))

    @property
    def state(self) -> SchedulerState:
        return self.scheduler.state

    async def list_jobs(self, request: ListJobs, identity: Identity) -> JobList:
        statuses = request.statuses
        # Queued and running jobs are those not ended: a listing of them looks at those only, however many ended.
        candidates = self.state.active if statuses and set(statuses) <= NOT_ENDED else self.state.jobs
        matching = [j for j in candidates.values() if (not statuses or j.status in statuses)
                    and (request.project is None or j.spec.project == request.project)]
        shown: list[ArrayView] = []
        if request.group_arrays:  # an array is one object: its jobs stand for it
            jobs = [j for j in matching if can_view(self.state, identity, j)]
            listed = dict.fromkeys(j.array.array_id for j in jobs if j.array is not None)
            shown = [arrays.array_view(self.state, self.state.arrays[array_id]) for array_id in listed
                     if array_id in self.state.arrays]
            shown.sort(key=lambda view: view.submitted_at, reverse=True)
            jobs = [j for j in jobs if j.array is None]
            jobs.sort(key=NEWEST, reverse=True)
        else:  # newest first, and who may view a job is asked only until enough are found
            matching.sort(key=NEWEST, reverse=True)
            visible = (j for j in matching if can_view(self.state, identity, j))
            jobs = list(itertools.islice(visible, request.limit) if request.limit >= 0 else visible)
        return JobList(jobs=await self.expected([self.state.view(j) for j in jobs[: request.limit]]),
                       arrays=shown[: request.limit])

    async def expected(self, views: list[JobView], *, wait: float = LISTING_WAIT,
                       shared: bool = True) -> list[JobView]:
        """The views, each waiting job's with its start as expected now (one plan for all of them, as `why`
        and `predict` make it). A listing is not held up by a plan that takes longer than `wait` (a deep queue on a
        large cluster, or the predictions of new jobs planned first): then it goes without. Listings share their
        plans (`shared`, `SharedPlans`), so that a client polling `list` does not keep the planning thread busy."""
        waiting = [v.job_id for v in views if _waits(self.state.jobs[v.job_id])]
        if not waiting:
            return views
        planned: asyncio.Future[dict[str, Forecast]]
        if not shared:
            planned = asyncio.ensure_future(self.scheduler.forecast_queued(waiting))
            planned.add_done_callback(consumed)
        elif (latest := self._plans.shared(waiting)) is not None:
            planned = latest
        elif self._plans.resting():
            return views  # as when a plan takes longer than the wait
        else:
            planned = self._plans.start(waiting)
        try:
            forecasts = await asyncio.wait_for(asyncio.shield(planned), wait)
        except TimeoutError:
            return views
        return [msgspec.structs.replace(v, expected=forecast.prediction)
                if (forecast := forecasts.get(v.job_id)) is not None else v for v in views]

    async def get_array(self, request: GetArray, identity: Identity) -> ArrayDetails | CommandError:
        array = self.state.arrays.get(request.array_id)
        members = [self.state.jobs[j] for j in (array.jobs.values() if array is not None else ())]
        if array is None or not any(can_view(self.state, identity, job) for job in members):
            return CommandError(code="not-found", message=f"no such array: {request.array_id}",
                                hint="`trainyard list` shows the arrays you can see")
        return arrays.array_details(self.state, array, request.after, request.limit)

    async def get_job(self, request: GetJob, identity: Identity) -> JobDetails | CommandError:
        if error := access_error(self.state, [request.job_id], identity, "view"):
            return error
        job = self.state.jobs[request.job_id]
        view = self.state.view(job)
        if not _waits(job):
            return JobDetails(job=view, spec=job.spec)
        if self.own_planning:  # a past state's: nothing else waits on its planning thread
            view, = await self.expected([view], wait=DETAILS_WAIT, shared=False)
            return JobDetails(job=view, spec=job.spec)
        # Never held up by a plan of the whole queue (seconds deep, behind new jobs' predictions): what the latest
        # plan expected, and a new plan for the next look when none runs or rests (shared_plans.py).
        expected = latest_expectation(job, self._plans.kept.get(job.job_id))
        self._plans.refresh(job.job_id)
        return JobDetails(job=msgspec.structs.replace(view, expected=expected), spec=job.spec)

    async def list_nodes(self, _: ListNodes, identity: Identity) -> NodeList:
        return hide_jobs(NodeList(nodes=node_views(self.state)), self.state, identity)

    async def why(self, request: ExplainJob, identity: Identity) -> WhyReply | CommandError:
        if error := access_error(self.state, [request.job_id], identity, "view"):
            return error
        job = self.state.jobs[request.job_id]
        waiting = job.status == "queued" and not job.prechecking
        # Its start as `predict` tells it (likely and latest), worked out in the planning thread without the lock.
        forecast = (await self.scheduler.forecast_queued([job.job_id])).get(job.job_id) if waiting else None
        async with self.scheduler.lock:  # the job's status cannot change while it is explained
            if job.status == "queued" and not job.prechecking:
                all_nodes = [n.info for n in self.state.nodes.values()]
                unhealthy = [name for name, n in self.state.nodes.items() if n.unhealthy and not n.lost]
                now = self.scheduler.clock()
                report = explain(job.job_id, queued_jobs(self.state, now), node_capacity(self.state),
                                 cluster_flavors(self.state), running=running_jobs(self.state, now), now=now,
                                 all_nodes=all_nodes, unhealthy=unhealthy, forecast=forecast)
                if job.reason:  # why it came back to the queue, or why its last pre-check failed
                    back = f"It is back in the queue: {job.reason}."
                    report = msgspec.structs.replace(report, summary=[*report.summary, back])
                if news := self.state.provisioning.news.get(job.job_id):  # what the autoscaler did for it
                    report = msgspec.structs.replace(report, summary=[*report.summary, news])
                return hide_jobs(WhyReply(report=report), self.state, identity)
            return WhyReply(report=WhyReport(job_id=job.job_id, status=job.status, summary=[status_sentence(job)]))

    async def resources(self, request: GetResources, identity: Identity) -> ResourceList | CommandError:
        known = {f.name for f in self.state.cluster.flavors}
        unknown = [f for f in request.flavors if f not in known]
        if unknown or not request.flavors:
            return CommandError(code="invalid-request",
                                message=f"unknown flavor: {', '.join(unknown)}" if unknown else "name a flavor",
                                hint=f"choose from: {', '.join(sorted(known))}")
        resources = ResourceList(nodes=node_resources(self.state, list(request.flavors)))
        return hide_applications(resources, self.state, identity)

    async def queue(self, request: GetQueue, identity: Identity) -> JobList:
        """The first waiting jobs in the order the scheduler tries them, from position 1, and how many wait."""
        waiting = [job for job in self.state.queue() if can_view(self.state, identity, job)]
        shown = [self.state.view(job) for job in waiting[:request.limit]]
        return JobList(jobs=await self.expected(shown), waiting=len(waiting))


class JobQueries(StateQueries):
    """Every query the scheduler answers. Views of the state asked `at` a past instant are answered from the
    state rebuilt from the events up to it, by the same code."""

    def __init__(self, scheduler: Scheduling, *, store: EventStore, js: JetStreamContext,
                 past: PastStates | None = None, archive: Archive | None = None) -> None:
        super().__init__(scheduler, own_planning=False)
        self.live = scheduler
        self.store, self.js = store, js  # for a job's history: its own log, the others' published events
        self.past = past or PastStates(store, js, lambda: scheduler.state.cluster)
        self.archive = archive or Archive(store, js, PublishedIndex(store), lambda: scheduler.state)

    def routes(self) -> list[Route]:
        return [
            (LIST_JOBS, self.then_or_now(StateQueries.list_jobs)),
            (GET_JOB, self.then_or_now(StateQueries.get_job)),
            (GET_ARRAY, self.then_or_now(StateQueries.get_array)),
            (LIST_NODES, self.then_or_now(StateQueries.list_nodes)),
            (GET_QUEUE, self.then_or_now(StateQueries.queue)),
            (PREDICT_JOB, self.predict),
            (EXPLAIN_JOB, self.then_or_now(StateQueries.why)),
            (GET_DEV_ENV, self.devenv),
            (JOB_HISTORY, self.history),
            (SEARCH_JOBS, self.search),
            (GET_RESOURCES, self.then_or_now(StateQueries.resources)),
            (LIST_FLAVORS, self.flavors),
            (GET_SETTINGS, self.settings),
            (WHOAMI, self.whoami),
            (LIST_STORAGE_ACCESS, self.storage_access),
        ]

    def then_or_now(self, view: Callable[[StateQueries, Any, Identity], Awaitable[Any]]) -> Handler:
        """`view` of the live state, or of the state at the request's `at`."""

        async def answer(request: Any, identity: Identity) -> Any:
            at: datetime | None = request.at
            if at is None:
                job_id: str | None = getattr(request, "job_id", None)
                if job_id is not None and (state := await self.archive.holding(job_id)) is not self.state:
                    return await view(StateQueries(ArchivedScheduler(state, self.live.clock)), request, identity)
                array_id: str | None = getattr(request, "array_id", None)
                if array_id is not None and (state := await self.archive.holding_array(array_id)) is not self.state:
                    return await view(StateQueries(ArchivedScheduler(state, self.live.clock)), request, identity)
                return await view(self, request, identity)
            if at > (now := self.live.clock()):
                return CommandError(code="invalid-request",
                                    message=f"{at.isoformat()} is in the future (it is {now.isoformat()} now)",
                                    hint="name a past instant, or leave `at` out for the cluster as it is now")
            async with self.past.at(at) as past:
                return await view(StateQueries(past), request, identity)

        return answer

    async def predict(self, request: PredictJob, identity: Identity) -> PredictionReply | CommandError:
        """S6: answered before creation; nothing is recorded (a submitted job records its own). Planned
        off the event loop and without the scheduler's lock."""
        if errors := spec_errors(request.spec, self.state.cluster, self.state.images):
            return invalid_spec(errors)
        reply = PredictionReply(prediction=await self.live.predict(request.spec))
        return hide_jobs(reply, self.state, identity)

    async def devenv(self, request: GetDevEnv, identity: Identity) -> DevEnvSpec | CommandError:
        state = await self.archive.holding(request.job_id)
        if error := access_error(state, [request.job_id], identity, "devenv"):
            return error
        return dev_env(state.jobs[request.job_id])

    async def history(self, request: GetJobHistory, identity: Identity) -> JobHistory | CommandError:
        """O6: every service's events about the job, as published, in order: the page from `start`."""
        # An archived job's state is folded from the very events its history shows: they are read once.
        archived = None if request.job_id in self.state.jobs else await self.archive.read_back(request.job_id)
        state = archived[0] if archived is not None else self.state
        if error := access_error(state, [request.job_id], identity, "view"):
            return error
        # Its own events from its log, the other services' (the launcher's, the monitor's pre-checks, slowdowns and
        # kept environments) as published, in time order.
        held = self.state.jobs.get(request.job_id)  # None: archived meanwhile, its JobArchived tells
        events = archived[1] if archived is not None else await job_events(
            self.store, self.js, self.archive.index, request.job_id, list(held.published) if held else None)
        history = history_page(events, request.start)
        return hide_jobs(history, self.state, identity)

    async def search(self, request: SearchJobs, identity: Identity) -> SearchResults:
        """O2: a page from the read model, with what only the live state knows (where a running job's rank 0
        is; the node count of rows projected before the read model kept it)."""
        await self.live.search.catch_up()  # read what this caller just wrote
        page = await self.live.search.search(request, identity, sharing_enabled=self.state.settings.sharing_enabled)
        return msgspec.structs.replace(page, jobs=[live_summary(self.state, summary) for summary in page.jobs])

    async def flavors(self, request: ListFlavors, _: Identity) -> FlavorList:
        return flavor_list(self.state, request.board)

    async def settings(self, _: GetSettings, __: Identity) -> SettingsView:
        return SettingsView(settings=self.state.settings)

    async def whoami(self, _: WhoAmI, identity: Identity) -> IdentityView:
        return IdentityView(identity=identity)

    async def storage_access(self, request: ListStorageAccess, identity: Identity) -> StorageAccessList:
        """J2: registered resources of the caller's projects and their own (administrators: all)."""
        entries = [e for e in self.state.storage.values()
                   if (request.kind is None or e.kind == request.kind)
                   and (identity.admin or e.owner == identity.user or e.project in identity.projects)]
        return StorageAccessList(entries=sorted(entries, key=lambda e: (e.kind, e.name)))
