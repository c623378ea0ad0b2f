"""Alerts (M7): one AlertRaised per incident, under an id derived from the incident itself.

The id is the alert's aggregate id and the alert is appended at version 0, so the same incident
can never be raised twice (a replay, a redelivery or a restart finds the id taken). Alerts about a
job go to its creator and to the operators (`TRAINYARD_ALERT_EMAILS`); alerts about a node go to
the operators. The relay publishes them on `trainyard.events.monitor.alert.<id>.AlertRaised` for the
services that follow the monitor; people read them with `ListAlerts` (`page`), each the alerts they may see.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from libs.access import allowed
from libs.contracts.codec import encode
from libs.contracts.events import (
    AlertRaised,
    EventEnvelope,
    InstanceReleased,
    JobFailed,
    JobResuming,
    ProvisionFailed,
    UpstreamMessageSetAside,
)
from libs.contracts.health import NodeCheck
from libs.contracts.identity import Identity
from libs.contracts.operations.alerts import MAX_ALERT_PAGE_BYTES, AlertPage, ListAlerts
from libs.contracts.scheduling import AdminSettings
from libs.jobstatus import JobLifecycle, JobRecord
from services.monitor.performance.detector import Incident


def node_unhealthy_id(node: str, version: int) -> str:
    return f"node-unhealthy-{node}-{version}"


def node_lost_id(node: str, version: int) -> str:
    return f"node-lost-{node}-{version}"


def job_resuming_id(job_id: str, attempt: int) -> str:
    return f"job-resuming-{job_id}-{attempt}"


def precheck_failed_id(job_id: str, attempt: int) -> str:
    return f"precheck-failed-{job_id}-{attempt}"


def performance_id(job_id: str, attempt: int, rank: int, number: int) -> str:
    return f"performance-{job_id}-{attempt}-{rank}-{number}"


def job_failed_id(job_id: str) -> str:
    return f"job-failed-{job_id}"


def set_aside_id(service: str, consumer: str, sequence: int, part: int | None = None) -> str:
    """One alert per message set aside, or per event of a bundle set aside."""
    return f"message-set-aside-{service}-{consumer}-{sequence}" + ("" if part is None else f".{part}")


def instance_boot_timeout(event: InstanceReleased, operators: Sequence[str]) -> AlertRaised:
    return AlertRaised(
        alert_id=f"instance-boot-timeout-{event.instance}", kind="instance-boot-timeout",
        title=f"Instance {event.instance} never joined the cluster",
        message=f"The autoscaler ended instance {event.instance}: {event.reason}. Check the instance type's "
                "image, init script and network: its agent must reach NATS with its node credential.",
        recipients=recipients(None, operators), node=event.instance)


def provisioning_failing(event: ProvisionFailed, operators: Sequence[str]) -> AlertRaised:
    return AlertRaised(
        alert_id=f"provisioning-failing-{event.instance_type}-{event.failures}", kind="provisioning-failing",
        title=f"Instances of type {event.instance_type} cannot be started",
        message=f"The last {event.failures} attempts to start an instance of type {event.instance_type} failed; "
                f"the last one: {event.reason}."
                + (" The provider has no capacity or quota for it: other types serving the same flavors are tried."
                   if event.capacity else ""),
        recipients=recipients(None, operators))


def recipients(creator_email: str | None, operators: Iterable[str]) -> list[str]:
    """The creator first, then the operators, each once."""
    return list(dict.fromkeys([*([creator_email] if creator_email else []), *operators]))


def _job_label(job: JobRecord) -> str:
    return f"{job.spec.name} ({job.job_id})"


JOBS_NOTE = "Jobs running there: "  # a node alert's list of jobs, which only administrators read


def _jobs_note(jobs: Sequence[JobRecord]) -> str:
    if not jobs:
        return "No job runs there."
    return JOBS_NOTE + ", ".join(_job_label(j) for j in jobs) + "."


def node_unhealthy(node: str, version: int, problems: Sequence[str], jobs: Sequence[JobRecord],
                   operators: Sequence[str]) -> AlertRaised:
    return AlertRaised(
        alert_id=node_unhealthy_id(node, version), kind="node-unhealthy", title=f"Node {node} is unhealthy",
        message=(f"Node {node}: {'; '.join(problems)}. No new work is placed there until it is healthy "
                 f"again; checkpoint-resume jobs on it are moved. {_jobs_note(jobs)}"),
        recipients=recipients(None, operators), node=node)


def node_lost(node: str, version: int, reason: str, jobs: Sequence[JobRecord],
              operators: Sequence[str]) -> AlertRaised:
    return AlertRaised(
        alert_id=node_lost_id(node, version), kind="node-lost", title=f"Node {node} was lost",
        message=f"Node {node} was lost ({reason}). {_jobs_note(jobs)}",
        recipients=recipients(None, operators), node=node)


def job_resuming(job: JobRecord, event: JobResuming, settings: AdminSettings,
                 operators: Sequence[str]) -> AlertRaised:
    nodes = sorted({*event.lost_nodes, *event.exclude_nodes, *event.fault_nodes})
    message = (f"Job {_job_label(job)} could not start there and waits for other nodes: {event.reason}."
               if event.before_start else
               f"Job {_job_label(job)} is saving a checkpoint and will resume on healthy nodes: {event.reason}. "
               f"This is resume {job.resumes + 1} of at most {job.max_resumes(settings)}.")
    return AlertRaised(
        alert_id=job_resuming_id(job.job_id, event.attempt), kind="job-resuming",
        title=f"Job {_job_label(job)} is being moved",
        message=message,
        recipients=recipients(job.creator_email, operators), job_id=job.job_id,
        node=nodes[0] if len(nodes) == 1 else None)


def precheck_failed(job: JobRecord | None, job_id: str, attempt: int, checks: Sequence[NodeCheck],
                    operators: Sequence[str]) -> AlertRaised:
    failed = [c for c in checks if not c.passed]
    label = _job_label(job) if job else job_id
    details = "; ".join(f"{c.node}: {', '.join(c.problems()) or 'failed'}" for c in failed)
    return AlertRaised(
        alert_id=precheck_failed_id(job_id, attempt), kind="precheck-failed",
        title=f"Job {label} failed its pre-check",
        message=f"The pre-check of job {label} (attempt {attempt}) failed on {details}. It waits in the queue.",
        recipients=recipients(job.creator_email if job else None, operators), job_id=job_id,
        node=failed[0].node if len(failed) == 1 else None)


def performance(job: JobRecord | None, incident: Incident, operators: Sequence[str]) -> AlertRaised:
    rule = incident.rule
    label = _job_label(job) if job else incident.job_id
    then = "the job is moved to other nodes" if rule.action == "reschedule" else "the job goes on"
    return AlertRaised(
        alert_id=performance_id(incident.job_id, incident.attempt, incident.rank, incident.number),
        kind="performance", title=f"Job {label} is running slowly on {incident.node}",
        message=(f"Rank {incident.rank} of job {label} (attempt {incident.attempt}) on {incident.node}: the mean "
                 f"hardware / e2e time over the last {rule.window} iterations is {incident.ratio:.3f}, "
                 f"{rule.direction} the threshold {rule.threshold:g}; {then}."),
        recipients=recipients(job.creator_email if job else None, operators), job_id=incident.job_id,
        node=incident.node)


def checkpoint_job_failed(job: JobRecord, event: JobFailed, settings: AdminSettings,
                          operators: Sequence[str]) -> AlertRaised:
    limit = job.max_resumes(settings)
    used = f"after {job.resumes} of at most {limit} resumes" if job.resumes else "without a resume"
    return AlertRaised(
        alert_id=job_failed_id(job.job_id), kind="resume-limit", title=f"Job {_job_label(job)} failed",
        message=f"Checkpoint-resume job {_job_label(job)} failed {used}: {event.reason}.",
        recipients=recipients(job.creator_email, operators), job_id=job.job_id)


def message_set_aside(service: str, record: UpstreamMessageSetAside, operators: Sequence[str]) -> AlertRaised:
    """A service passed over a message it follows (forged, garbled, or one it could not apply)."""
    claimed = ", ".join(part for part in (
        f"claimed service {record.claimed_service}" if record.claimed_service else "",
        f"claimed type {record.claimed_type}" if record.claimed_type else "") if part)
    what = "message" if record.part is None else f"event {record.part} (from 0) of the bundle"
    return AlertRaised(
        alert_id=set_aside_id(service, record.consumer, record.sequence, record.part), kind="message-set-aside",
        title=f"The {service} set aside {what} {record.sequence} of {record.stream}",
        message=(f"The {service} (consumer {record.consumer}) passed over the {what} at sequence {record.sequence} "
                 f"of {record.stream}, subject {record.subject}{f' ({claimed})' if claimed else ''}: "
                 f"{record.cause}: {record.reason}. Nothing of it was applied; check who published it."),
        recipients=recipients(None, operators))


def visible(alert: AlertRaised, identity: Identity, jobs: JobLifecycle,
            archived: Mapping[str, JobRecord] | None = None) -> bool:
    """Who reads an alert: administrators all; others node alerts, and alerts about jobs they may show
    (the scheduler's rule: not deleted, and viewable under J2), archived ones (`archived`, read back) too. A
    message set aside is about the platform itself (who published what, where): administrators only."""
    if identity.admin:
        return True
    if alert.job_id is None:
        return alert.kind != "message-set-aside"
    job = jobs.jobs.get(alert.job_id) or (archived or {}).get(alert.job_id)
    return job is not None and not job.deleted and allowed(identity, job.spec, job.creator, "view",
                                                           sharing_enabled=jobs.settings.sharing_enabled)


def as_seen_by(envelope: EventEnvelope, identity: Identity) -> EventEnvelope:
    """An alert as `identity` reads it: others than administrators read a node alert without the jobs on
    the node (other people's, by name) and no alert's recipients (the operators' and creators' addresses)."""
    alert = envelope.event
    if identity.admin or not isinstance(alert, AlertRaised):
        return envelope
    message = alert.message
    if alert.job_id is None and JOBS_NOTE in message:
        message = message[:message.index(JOBS_NOTE)] + "Which jobs run there, administrators see."
    return msgspec.structs.replace(envelope, event=msgspec.structs.replace(alert, message=message, recipients=[]))


def jobs_to_look_up(raised: Sequence[EventEnvelope], request: ListAlerts, identity: Identity,
                    jobs: JobLifecycle) -> list[str]:
    """The jobs a page needs read back to tell whether `identity` sees their alerts: those of the alerts it looks
    at that the monitor no longer holds (archived ones). An administrator sees every alert: none."""
    if identity.admin:
        return []
    looked_at = [e.event for e in raised if e.position > request.after and isinstance(e.event, AlertRaised)]
    return list(dict.fromkeys(alert.job_id for alert in looked_at[:request.limit]
                              if alert.job_id is not None and alert.job_id not in jobs.jobs))


def page(raised: Sequence[EventEnvelope], request: ListAlerts, identity: Identity, jobs: JobLifecycle,
         archived: Mapping[str, JobRecord] | None = None) -> AlertPage:
    """One page of the alerts `identity` may see among `raised` (alerts in position order), after
    position `request.after`, oldest first; `archived`: the records of the jobs no longer held that it may
    name (`jobs_to_look_up`).

    At most `request.limit` alerts are looked at, so a page costs the same whoever asks; the page stops
    early, before `MAX_ALERT_PAGE_BYTES`, so that the reply fits one NATS message (one alert always goes).
    """
    found: list[EventEnvelope] = []
    size = looked_at = 0
    next_after = request.after
    for envelope in raised:
        if envelope.position <= request.after or not isinstance(envelope.event, AlertRaised):
            continue
        if looked_at == request.limit:
            return AlertPage(alerts=found, next_after=next_after, more=True)
        if visible(envelope.event, identity, jobs, archived):
            shown = as_seen_by(envelope, identity)
            size += len(encode(shown))
            if found and size > MAX_ALERT_PAGE_BYTES:
                return AlertPage(alerts=found, next_after=next_after, more=True)
            found.append(shown)
        looked_at += 1
        next_after = envelope.position
    return AlertPage(alerts=found, next_after=next_after, more=False)
