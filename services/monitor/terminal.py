"""The debug terminal (J15): open a session in a job's kept (or running) environment on a node.

Who may: J2's "terminal" operation (read-write); a job the caller may not view is not found, as in
the scheduler. Where: the requested node of the job's placement, else the master's (rank 0). The
node's agent starts the session and answers; the client then talks to it directly. `target` decides
(under the monitor's lock, with `now` given); `open_session` asks the agent. An archived job (`archive`) has no
environment left: `archived_refusal` says so, as for a retention that is over.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.client import Client

from libs.access import allowed
from libs.contracts import subjects
from libs.contracts.agent import OpenSession, SessionOpened
from libs.contracts.events import Placement
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import OpenTerminal, TerminalOpened
from libs.controlsign import ControlSigner
from libs.jobstatus import JobLifecycle, JobRecord
from libs.messaging.rpc import ServiceUnavailable, call
from libs.natsroles import user_nats_name
from libs.telemetry.logs import get_logger
from services.monitor.kept import KeptEnvironment
from services.monitor.runs.archive import PastJob
from services.monitor.state import MonitorState

log = get_logger(__name__)
IDLE_SECONDS = 60.0
AGENT_TIMEOUT_SECONDS = 10.0


def not_open(job: JobRecord, kept: KeptEnvironment | None, now: datetime) -> CommandError:
    """Why the job has no environment to open a terminal in, and what to do about it."""
    base = f"job {job.job_id} has no environment to open a terminal in"
    if job.status == "queued":
        return CommandError(code="invalid-state", message=f"{base}: it has not started yet",
                            hint="wait until it runs (`trainyard show` tells its state)")
    if not job.debug_terminal:
        return CommandError(code="invalid-state", message=f"{base}: it {job.status} and its environment was not kept",
                            hint="turn on debug_terminal in the job's spec to keep it after an abnormal end")
    if kept is not None and (kept.released or kept.until <= now):
        ended = f"{kept.until.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
        return CommandError(code="invalid-state", message=f"{base}: its kept environment was released at {ended}",
                            hint="the retention time is over; run the job again to debug it")
    if job.status in ("succeeded", "stopped"):
        return CommandError(code="invalid-state", message=f"{base}: it {job.status}, and environments are kept "
                                                          "only when a job fails or expires",
                            hint="clone the job to run it again")
    if job.archived and job.placement:  # whatever was kept went before the job was archived
        return CommandError(code="invalid-state", message=f"{base}: it {job.status} long ago and its environment "
                                                          "is released", hint="the retention time is over; run the "
                                                                              "job again to debug it")
    if job.placement:  # the monitor has not recorded the end yet
        return CommandError(code="invalid-state", message=f"{base}: it {job.status} and its environment is "
                                                          "not kept yet", hint="try again in a moment")
    return CommandError(code="invalid-state", message=f"{base}: it {job.status} before it ran on any node",
                        hint="clone the job to run it again")


def choose(placement: list[Placement], node: str | None, job_id: str) -> Placement | CommandError:
    ranks = sorted(placement, key=lambda p: p.rank)
    if node is None:
        return ranks[0]
    found = next((p for p in ranks if p.node == node), None)
    if found is None:
        nodes = ", ".join(dict.fromkeys(p.node for p in ranks))
        return CommandError(code="invalid-request", message=f"job {job_id} did not run on node {node}",
                            hint=f"its nodes: {nodes}")
    return found


@dataclass(frozen=True)
class Target:
    """Where a terminal opens: an attempt of a job, at one of its ranks."""

    job_id: str
    attempt: int
    place: Placement


def target(request: OpenTerminal, identity: Identity, jobs: JobLifecycle, state: MonitorState,
           now: datetime) -> Target | CommandError:
    """Where the caller's terminal opens, or why it does not (`jobs` and `state` are only read)."""
    job = jobs.viewable(request.job_id, identity)
    if job is None:
        return not_found(request.job_id)
    if (refusal := access_refusal(identity, job, jobs.settings.sharing_enabled)) is not None:
        return refusal
    kept = state.kept_environment(job.job_id, now)
    if kept is not None:
        attempt = kept.attempt
    elif job.status == "running" and job.placement:
        attempt = job.attempt
    else:
        return not_open(job, state.kept.get(job.job_id), now)
    place = choose(job.placement, request.node, job.job_id)
    if isinstance(place, CommandError):
        return place
    return Target(job_id=job.job_id, attempt=attempt, place=place)


def archived_refusal(request: OpenTerminal, identity: Identity, past: PastJob | None, jobs: JobLifecycle,
                     now: datetime) -> CommandError:
    """Why no terminal opens in a job the monitor no longer holds: not found (never existed, or hidden from the
    caller, as for a job held), else its environment is gone, as when a retention is over."""
    job = past.viewable(identity, jobs.settings) if past is not None else None
    if past is None or job is None:
        return not_found(request.job_id)
    return access_refusal(identity, job, jobs.settings.sharing_enabled) or not_open(job, past.kept, now)


def not_found(job_id: str) -> CommandError:
    return CommandError(code="not-found", message=f"no such job: {job_id}",
                        hint="`trainyard list` shows the jobs you can see")


def access_refusal(identity: Identity, job: JobRecord, sharing: bool) -> CommandError | None:
    """J2: a terminal needs read-write access to the job."""
    if allowed(identity, job.spec, job.creator, "terminal", sharing_enabled=sharing):
        return None
    return CommandError(code="forbidden", message=f"you have read-only access to {job.job_id}: terminal needs "
                                                  "read-write", hint="ask the job's creator or an administrator")


async def open_session(nc: Client, signer: ControlSigner, request: OpenTerminal, identity: Identity,
                       target: Target) -> TerminalOpened | CommandError:
    """Ask the agent of the target's node to start the session."""
    place, attempt = target.place, target.attempt
    session = OpenSession(session_id=request.session_id or secrets.token_hex(16), job_id=target.job_id,
                          attempt=attempt, rank=place.rank, command=request.command, columns=request.columns,
                          rows=request.rows, idle_seconds=IDLE_SECONDS, owner=user_nats_name(identity.user))
    try:
        reply = await call(nc, subjects.agent_open_session(place.node), session,
                           timeout=AGENT_TIMEOUT_SECONDS, reply_type=SessionOpened | CommandError, signer=signer)
    except ServiceUnavailable:
        return CommandError(code="unavailable", message=f"the agent of node {place.node} does not answer",
                            hint="try again shortly; `trainyard nodes` shows whether the node is lost")
    if isinstance(reply, CommandError):
        return reply
    log.info("terminal.opened", job_id=target.job_id, node=place.node, rank=place.rank, attempt=attempt,
             user=identity.user)
    return TerminalOpened(session_id=reply.session_id, node=place.node, rank=place.rank, attempt=attempt)
