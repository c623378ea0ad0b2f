"""The job page (seed 001, 查看任务式训练详情): one job's status and operations, its nodes (L8) with their resource
use, its logs, its run's metrics, its event history, its array, its development environment and its debug terminal
(J15).

What the page knows when it is asked is rendered here, as the signed-in person (a job they may not see is not found,
and nothing of it is shown); what changes while it is open (status, resource use, logs, metrics) the page's script
follows through the HTTP API and its follow streams (static/console/job.js).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from libs.contracts.events import EventEnvelope
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.arrays import GET_ARRAY, ArrayDetails, GetArray
from libs.contracts.operations.jobs import (
    GET_DEV_ENV,
    GET_JOB,
    JOB_HISTORY,
    DevEnvSpec,
    GetDevEnv,
    GetJob,
    GetJobHistory,
    JobDetails,
    JobHistory,
    JobView,
)
from libs.contracts.operations.planning import EXPLAIN_JOB, ExplainJob, WhyReply
from libs.contracts.scheduling import WhyReport
from services.gateway.calls import Refused
from services.gateway.console.base import STATUS_TEXT, Console, job_grant, may, moment, offered_actions
from services.gateway.console.i18n import N_
from services.gateway.sessions import Session

SHOWN_ARRAY_JOBS = 200  # an array's jobs on one page; the rest a link away
MOST_SUMMARY_CHARS = 240  # an event's summary in the history table
LIVE = ("queued", "running")
# Fields an event's summary leaves out: the job's id (the page's own), whole specs and launch plans.
LEFT_OUT = frozenset({"job_id", "spec", "nodes", "trace"})

INSTANCE_STATE_TEXT: dict[str, str] = {
    "pending": N_("Starting"), "running": N_("Running"), "exited": N_("Exited"), "lost": N_("Lost"),
}
ROLE_TEXT: dict[str, str] = {
    "master": N_("Master"), "worker": N_("Worker"), "ps": N_("Parameter server"), "standby": N_("Standby"),
}

T = TypeVar("T")


class JobIdConvertor(Convertor[str]):
    """A job id (`job-` and 12 hex digits), so that /jobs/new and the like are left to their own pages."""

    regex = "job-[0-9a-f]{12}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("jobid", JobIdConvertor())


@dataclass(frozen=True)
class EventRow:
    at: datetime
    service: str
    kind: str
    summary: str


def _value_text(value: Any) -> str:
    if isinstance(value, datetime):
        return moment(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_value_text(item) for item in value)
    if isinstance(value, msgspec.Struct):
        fields = msgspec.structs.asdict(value)
        if {"rank", "node"} <= fields.keys():  # a placement: where a rank runs
            return f"{fields['rank']}@{fields['node']}"
        return "{" + ", ".join(f"{k}={_value_text(v)}" for k, v in fields.items() if v not in (None, [], {})) + "}"
    if isinstance(value, dict):
        return ", ".join(f"{k}:{_value_text(v)}" for k, v in value.items())
    return str(value)


def event_summary(envelope: EventEnvelope) -> str:
    """An event's fields in a line (`key=value`), without what the page shows elsewhere; a submission names its
    job."""
    event = envelope.event
    fields = msgspec.structs.asdict(event)
    parts = [f"name={spec.name}"] if isinstance(spec := fields.get("spec"), JobSpec) else []
    parts += [f"{key}={_value_text(value)}" for key, value in fields.items()
              if key not in LEFT_OUT and value not in (None, [], {}, "")]
    text = " ".join(parts)
    return text if len(text) <= MOST_SUMMARY_CHARS else text[:MOST_SUMMARY_CHARS - 1] + "…"


def event_rows(history: JobHistory) -> list[EventRow]:
    return [EventRow(at=e.recorded_at, service=e.service, kind=type(e.event).name(), summary=event_summary(e))
            for e in history.events]


def elapsed(job: JobView, now: datetime) -> str:
    """How long the job ran (or runs so far), as `1h 02m 03s`; empty before it started."""
    if job.started_at is None:
        return ""
    seconds = max(0, int(((job.ended_at or now) - job.started_at).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"


def job_actions(session: Session, job: JobView) -> tuple[str, ...]:
    """The job's operations, by the same rules as its row in the jobs table."""
    return offered_actions(session, project=job.project, creator=job.creator, access=job.access, status=job.status)


def has_terminal(spec: JobSpec) -> bool:
    return spec.debug_terminal is not None and spec.debug_terminal.enabled


def terminal_shown(session: Session, job: JobView, spec: JobSpec, now: datetime) -> bool:
    """J15: the job keeps a debug terminal, the person may use it, and there is (or will be) an environment."""
    grant = job_grant(session.identity, project=job.project, creator=job.creator, access=job.access)
    alive = job.status in LIVE or (job.kept_until is not None and job.kept_until > now)
    return has_terminal(spec) and may(grant, "terminal") and alive


def page_texts(console: Console, request: Request) -> dict[str, dict[str, str]]:
    """What job.js shows, in the reader's language: the names of statuses, instance states and roles by their
    codes, and its other texts by their English."""
    def named(table: dict[str, str]) -> dict[str, str]:
        return {code: console.text(request, text) for code, text in table.items()}

    texts = [N_("Rank"), N_("Across ranks"), N_("Step"), N_("Time"), N_("No metrics yet"), N_("No log lines yet"),
             N_("The log has ended."), N_("Lines before these are not shown."), N_("Could not read:")]
    return {"status": named(STATUS_TEXT), "state": named(INSTANCE_STATE_TEXT), "role": named(ROLE_TEXT),
            "text": {text: console.text(request, text) for text in texts}}


async def _quietly(call: Awaitable[T]) -> T | None:
    """A part of the page that may be missing (its service refused or is away): the rest is shown anyway."""
    try:
        return await call
    except Refused:
        return None


class JobPage:
    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> list[BaseRoute]:
        return [Route("/jobs/{job_id:jobid}", self.page, methods=["GET"])]

    async def page(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        job_id = request.path_params["job_id"]
        try:
            details: JobDetails = await self.console.ask(session, GET_JOB, GetJob(job_id=job_id))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        job, spec = details.job, details.spec
        history, why, devenv, array = await asyncio.gather(
            self._history(session, job_id), self._why(session, job), self._devenv(session, job),
            self._array(session, job, request))
        now = datetime.now(UTC)
        grant = job_grant(session.identity, project=job.project, creator=job.creator, access=job.access)
        return self.console.render(
            request, "job.html", session=session, job=job, spec=spec, actions=job_actions(session, job),
            elapsed=elapsed(job, now), live=job.status in LIVE, why=why, devenv=devenv, array=array,
            devenv_json=msgspec.json.format(msgspec.json.encode(devenv)).decode() if devenv is not None else "",
            events=event_rows(history) if history is not None else None,
            terminal=terminal_shown(session, job, spec, now), may_devenv=may(grant, "devenv"),
            instance_states=INSTANCE_STATE_TEXT, roles=ROLE_TEXT, texts=page_texts(self.console, request),
            ranks=sorted({instance.rank for instance in job.instances} or set(range(job.nodes))),
        )

    async def _history(self, session: Session, job_id: str) -> JobHistory | None:
        history: JobHistory | None = await _quietly(self.console.ask(session, JOB_HISTORY,
                                                                      GetJobHistory(job_id=job_id)))
        return history

    async def _why(self, session: Session, job: JobView) -> WhyReport | None:
        if job.status != "queued":
            return None
        reply: WhyReply | None = await _quietly(self.console.ask(session, EXPLAIN_JOB, ExplainJob(job_id=job.job_id)))
        return reply.report if reply is not None else None

    async def _devenv(self, session: Session, job: JobView) -> DevEnvSpec | None:
        grant = job_grant(session.identity, project=job.project, creator=job.creator, access=job.access)
        if not may(grant, "devenv"):
            return None
        devenv: DevEnvSpec | None = await _quietly(self.console.ask(session, GET_DEV_ENV,
                                                                     GetDevEnv(job_id=job.job_id)))
        return devenv

    async def _array(self, session: Session, job: JobView, request: Request) -> ArrayDetails | None:
        if job.array is None:
            return None
        after = request.query_params.get("array_after", "")
        start = int(after) if after.isdigit() and len(after) < 9 else -1
        array: ArrayDetails | None = await _quietly(self.console.ask(session, GET_ARRAY, GetArray(
            array_id=job.array.array_id, after=start, limit=SHOWN_ARRAY_JOBS)))
        return array
