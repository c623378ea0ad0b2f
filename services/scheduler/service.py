"""The scheduler service: owns jobs, queues them (S1), admits them all-or-nothing (S4).

It answers the job commands and queries, follows the monitor (nodes) and the launcher (process
outcomes), and runs scheduling cycles whenever something changed that could let a job start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.cluster import ClusterConfig, Resources
from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobFailed,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    LaunchStopped,
    LaunchSucceeded,
    NodeLost,
)
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import FieldError, validate_spec
from libs.contracts.messages import (
    CommandError,
    DeleteJobs,
    Done,
    GetJob,
    JobAccepted,
    JobDetails,
    JobList,
    ListJobs,
    ListNodes,
    NodeList,
    NodeView,
    StopJobs,
    SubmitJob,
)
from libs.eventstore import NewEvent, Tracking
from libs.messaging.follower import StreamFollower
from libs.messaging.rpc import register_responder
from libs.runtime import ServiceRuntime
from libs.storage import missing_inputs
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, tracer
from services.scheduler.placement import NodeCapacity, QueuedJob, schedule
from services.scheduler.state import SchedulerState

SERVICE = "scheduler"
log = get_logger(__name__)
span_tracer = tracer("trainyard.scheduler")


class Scheduler:
    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig, *, cycle_seconds: float = 5.0) -> None:
        self.rt = runtime
        self.state = SchedulerState(cluster)
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.cycle_seconds = cycle_seconds
        self.followers: list[StreamFollower] = []

    # --- start-up --------------------------------------------------------------------------------

    async def start(self) -> None:
        count = 0
        async for envelope in self.rt.store.read_all():
            self.state.apply(envelope)
            count += 1
        log.info("scheduler.rebuilt", events=count, jobs=len(self.state.jobs))
        for upstream in ("monitor", "launcher"):
            follower = StreamFollower(self.rt.js, self.rt.store, stream=subjects.EVENTS_STREAM,
                                      subject=subjects.events_of_service(upstream),
                                      consumer=f"{upstream}-events", message_type=EventEnvelope,
                                      handle=self.on_upstream)
            await follower.start()
            self.followers.append(follower)
        broker = self.rt.broker
        register_responder(broker, SERVICE, subjects.SUBMIT_JOB, SubmitJob, self.submit)
        register_responder(broker, SERVICE, subjects.STOP_JOBS, StopJobs, self.stop)
        register_responder(broker, SERVICE, subjects.DELETE_JOBS, DeleteJobs, self.delete)
        register_responder(broker, SERVICE, subjects.LIST_JOBS, ListJobs, self.list_jobs)
        register_responder(broker, SERVICE, subjects.GET_JOB, GetJob, self.get_job)
        register_responder(broker, SERVICE, subjects.LIST_NODES, ListNodes, self.list_nodes)
        self.rt.spawn(self.scheduling_loop(), "cycle")

    # --- appending -------------------------------------------------------------------------------

    async def _append(self, changes: Sequence[tuple[str, Event]], tracking: Tracking | None = None) -> None:
        """Append job events (several jobs at once if need be) and fold them into the state."""
        expected = {("job", job_id): self._version(job_id) for job_id, _ in changes}
        stored = await self.rt.store.append(
            [NewEvent("job", job_id, event) for job_id, event in changes],
            expected_versions=expected, tracking=tracking, trace=current_trace_headers(),
        )
        for envelope in stored:
            self.state.apply(envelope)
            log.info("job.event", job_id=envelope.aggregate_id, event_type=type(envelope.event).name())
        self.wake.set()

    def _version(self, job_id: str) -> int:
        job = self.state.jobs.get(job_id)
        return job.version if job else 0

    # --- following other services ------------------------------------------------------------------

    async def on_upstream(self, envelope: EventEnvelope, _: Msg, tracking: Tracking | None) -> bool:
        async with self.lock:
            self.state.apply(envelope)
            self.wake.set()
            if tracking is None:
                return False
            with span_tracer.start_as_current_span(
                f"scheduler react {type(envelope.event).name()}", context=context_from_headers(envelope.trace)
            ):
                changes = self.reactions(envelope)
                if not changes:
                    return False
                await self._append(changes, tracking)
                return True

    def reactions(self, envelope: EventEnvelope) -> list[tuple[str, Event]]:
        """What the scheduler records in answer to a launcher or monitor event."""
        event = envelope.event
        if isinstance(event, NodeLost):
            return [
                (job.job_id, JobFailed(job_id=job.job_id,
                                       reason=f"node {event.node_name} was lost: {event.reason}"))
                for job in self.state.jobs_on(event.node_name)
            ]
        if not isinstance(event, LaunchSucceeded | LaunchFailed | LaunchStopped):
            return []
        job = self.state.jobs.get(event.job_id)
        if job is None or job.status != "running" or job.attempt != event.attempt:
            return []
        if isinstance(event, LaunchSucceeded):
            return [(job.job_id, JobSucceeded(job_id=job.job_id))]
        if isinstance(event, LaunchFailed):
            return [(job.job_id, JobFailed(job_id=job.job_id, reason=event.reason, exit_code=event.exit_code))]
        if job.stop_requested_by is not None:
            return [(job.job_id, JobStopped(job_id=job.job_id, by=job.stop_requested_by))]
        return [(job.job_id, JobFailed(job_id=job.job_id, reason="its processes were stopped"))]

    # --- scheduling cycles -------------------------------------------------------------------------

    async def scheduling_loop(self) -> None:
        # Decide only on a complete view of nodes and launches.
        for follower in self.followers:
            await follower.caught_up.wait()
        log.info("scheduler.caught_up")
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.cycle_seconds)
            self.wake.clear()
            async with self.lock:
                await self.run_cycle()

    async def run_cycle(self) -> None:
        queue = self.state.queue()
        if not queue:
            return
        used = self.state.used()
        nodes = [
            NodeCapacity(info=n.info, free=Resources.of_node(n.info) - used.get(name, Resources()))
            for name, n in self.state.nodes.items() if not n.lost
        ]
        flavors = {f.name: f for f in self.state.cluster.flavors}
        admissions = schedule([QueuedJob(j.job_id, j.spec) for j in queue], nodes, flavors)
        for admission in admissions:
            job = self.state.jobs[admission.job_id]
            # Each admission continues the trace its job was submitted in.
            with span_tracer.start_as_current_span("scheduler admit", context=context_from_headers(job.trace)):
                await self._append([(job.job_id, JobAdmitted(
                    job_id=job.job_id, attempt=job.attempt + 1, flavor=admission.flavor,
                    placement=admission.placement))])

    # --- commands ----------------------------------------------------------------------------------

    async def submit(self, request: SubmitJob) -> JobAccepted | CommandError:
        if not is_job_id(request.job_id):
            return CommandError(code="invalid-request", message=f"{request.job_id!r} is not a job id",
                                hint="let the client choose it (job-<12 hex digits>)")
        if not request.user:
            return CommandError(code="invalid-request", message="the request names no user")
        errors = validate_spec(request.spec)
        known = [f.name for f in self.state.cluster.flavors]
        errors += [
            FieldError(field=f"flavors[{i}]", message=f"{name!r} is not a flavor of this cluster",
                       hint=f"choose from: {', '.join(known)}")
            for i, name in enumerate(request.spec.flavors) if name not in known
        ]
        # Only a well-formed spec names storage paths worth looking up, and a retried submit of a job
        # that exists is answered below whatever storage holds now.
        if not errors and request.job_id not in self.state.jobs:
            errors = missing_inputs(request.spec, self.rt.settings.storage_root)
        if errors:
            return CommandError(code="invalid-spec",
                                message="the job spec is invalid: " + "; ".join(map(str, errors)),
                                errors=errors)
        async with self.lock:
            existing = self.state.jobs.get(request.job_id)
            if existing is not None:
                if existing.spec != request.spec or existing.creator != request.user:
                    return CommandError(code="conflict", message=f"job {request.job_id} exists with "
                                        "another spec", hint="submit again without choosing the id")
                return JobAccepted(job_id=request.job_id, status=existing.status, created=False)
            await self._append([(request.job_id, JobSubmitted(job_id=request.job_id, spec=request.spec,
                                                              creator=request.user))])
            return JobAccepted(job_id=request.job_id, status=self.state.jobs[request.job_id].status,
                               created=True)

    def _missing(self, job_ids: list[str]) -> CommandError | None:
        missing = [j for j in job_ids if j not in self.state.jobs or self.state.jobs[j].deleted]
        if not missing:
            return None
        return CommandError(code="not-found", message=f"no such job: {', '.join(missing)}",
                            hint="`trainyard list` shows your jobs; nothing was changed")

    async def stop(self, request: StopJobs) -> Done | CommandError:
        async with self.lock:
            if error := self._missing(request.job_ids):
                return error
            changes: list[tuple[str, Event]] = []
            for job_id in dict.fromkeys(request.job_ids):
                job = self.state.jobs[job_id]
                if job.status == "queued":
                    changes.append((job_id, JobStopped(job_id=job_id, by=request.user)))
                elif job.status == "running" and job.stop_requested_by is None:
                    changes.append((job_id, JobStopRequested(job_id=job_id, by=request.user)))
            if changes:
                await self._append(changes)
        return Done(job_ids=list(dict.fromkeys(request.job_ids)), message=f"stopping {len(changes)} job(s)")

    async def delete(self, request: DeleteJobs) -> Done | CommandError:
        async with self.lock:
            if error := self._missing(request.job_ids):
                return error
            active = [j for j in request.job_ids if not self.state.jobs[j].terminal]
            if active:
                return CommandError(code="invalid-state",
                                    message=f"still queued or running: {', '.join(active)}",
                                    hint=f"stop first: trainyard stop {' '.join(active)}; nothing was deleted")
            job_ids = list(dict.fromkeys(request.job_ids))
            await self._append([(j, JobDeleted(job_id=j, by=request.user)) for j in job_ids])
        return Done(job_ids=job_ids, message=f"deleted {len(job_ids)} job(s)")

    # --- queries -----------------------------------------------------------------------------------

    async def list_jobs(self, request: ListJobs) -> JobList:
        jobs = [
            j for j in self.state.jobs.values()
            if not j.deleted and (not request.statuses or j.status in request.statuses)
            and (request.project is None or j.spec.project == request.project)
        ]
        jobs.sort(key=lambda j: j.queue_order, reverse=True)
        return JobList(jobs=[self.state.view(j) for j in jobs[: request.limit]])

    async def get_job(self, request: GetJob) -> JobDetails | CommandError:
        if error := self._missing([request.job_id]):
            return error
        job = self.state.jobs[request.job_id]
        return JobDetails(job=self.state.view(job), spec=job.spec)

    async def list_nodes(self, _: ListNodes) -> NodeList:
        used = self.state.used()
        return NodeList(nodes=[
            NodeView(info=n.info, status="lost" if n.lost else "ready", used=used.get(name, Resources()),
                     jobs=[j.job_id for j in self.state.jobs_on(name)])
            for name, n in sorted(self.state.nodes.items())
        ])
