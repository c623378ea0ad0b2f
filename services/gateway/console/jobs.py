"""The jobs page (seed 001, 训练管理 → 任务式训练): the table, the search box with the seed's filters, paging,
batch delete, and each row's operations menu with its dialogs (priority, duration, stop, delete), each offered
only when the person's access allows it (J2). Every change is a form with the session's CSRF token; after it the
browser is sent to a page to show (303), so that a reload repeats nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from libs.contracts.jobspec import parse_duration
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.jobs import (
    CHANGE_DURATION,
    CHANGE_PRIORITY,
    DELETE_JOBS,
    GET_JOB,
    SEARCH_JOBS,
    STOP_JOBS,
    ChangeDuration,
    ChangePriority,
    DeleteJobs,
    GetJob,
    JobSummary,
    JobView,
    SearchJobs,
    StopJobs,
)
from services.gateway.calls import Refused
from services.gateway.console.base import STATUS_TEXT, Console, offered_actions, redirect
from services.gateway.console.i18n import N_
from services.gateway.problems import STATUS
from services.gateway.sessions import Session

PAGE_SIZE = 50
MOST_SELECTED = 500  # jobs one batch delete may name
# The seed's search fields (搜索任务式训练): the query parameter and its label.
FILTERS: dict[str, str] = {
    "name": N_("Name"), "status": N_("Status"), "creator": N_("Creator"), "algorithm": N_("My algorithms"),
    "favorite": N_("Algorithm favourites"), "flavor": N_("Flavor"), "output": N_("Output location"),
}
MOST_FILTER_CHARS = 256
NOTICES: dict[str, str] = {
    "stopped": N_("Stopping the job."), "deleted": N_("Deleted."), "priority": N_("The priority is changed."),
    "duration": N_("The duration is changed."),
}


@dataclass(frozen=True)
class Row:
    job: JobSummary
    actions: tuple[str, ...]


def filters_of(request: Request) -> dict[str, str]:
    chosen = {name: request.query_params.get(name, "").strip()[:MOST_FILTER_CHARS] for name in FILTERS}
    # The search box: one field chosen from its list, and the value typed beside it.
    field, value = request.query_params.get("field", ""), request.query_params.get("value", "").strip()
    if field in FILTERS and value:
        chosen[field] = value[:MOST_FILTER_CHARS]
    return {name: value for name, value in chosen.items() if value}


def search_request(filters: dict[str, str], page: int) -> SearchJobs:
    status = filters.get("status")
    return SearchJobs(
        name=filters.get("name"), statuses=[status] if status in STATUS_TEXT else [],  # type: ignore[list-item]
        creator=filters.get("creator"), algorithm=filters.get("algorithm"),
        favorite_algorithm=filters.get("favorite"), flavor=filters.get("flavor"), output=filters.get("output"),
        limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE,
    )


def row_actions(session: Session, job: JobSummary) -> tuple[str, ...]:
    """The row's menu (操作): what the person may do to the job in its state."""
    return offered_actions(session, project=job.project, creator=job.creator, access=job.access, status=job.status)


def page_number(text: str | None) -> int:
    return int(text) if text and text.isdigit() and 0 < int(text) <= 100_000 else 1


class JobsPages:
    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/jobs", self.table, methods=["GET"]),
            Route("/jobs/delete", self.delete_many, methods=["POST"]),
            Route("/jobs/{job_id}/{action:str}", self.dialog, methods=["GET"]),
            Route("/jobs/{job_id}/{action:str}", self.act, methods=["POST"]),
        ]

    async def table(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        filters = filters_of(request)
        page = page_number(request.query_params.get("page"))
        try:
            results = await self.console.ask(session, SEARCH_JOBS, search_request(filters, page))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        total = results.total if results.total is not None else len(results.jobs)
        pages = max(1, -(-total // PAGE_SIZE))
        rows = [Row(job, row_actions(session, job)) for job in results.jobs]
        notice = NOTICES.get(request.query_params.get("done", ""))
        return self.console.render(
            request, "jobs.html", session=session, rows=rows, filters=filters, filter_names=FILTERS,
            statuses=STATUS_TEXT, page=page, pages=pages, total=total, notice=notice,
            page_link=lambda number: "/jobs?" + urlencode({**filters, "page": number}),
            chips=[(name, value, "/jobs?" + urlencode({k: v for k, v in filters.items() if k != name}))
                   for name, value in filters.items()],
        )

    async def delete_many(self, request: Request) -> Response:
        """Batch delete (批量删除): the checked jobs, after the confirmation page (确认删除)."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        try:
            form = await self.console.checked_form(request, session, max_fields=MOST_SELECTED + 8)
            job_ids = [str(v) for v in form.getlist("job_id") if isinstance(v, str) and v][:MOST_SELECTED]
            if not job_ids:
                return redirect("/jobs")
            if form.get("confirmed") != "yes":
                return self.console.render(request, "confirm_delete.html", session=session, job_ids=job_ids)
            await self.console.ask(session, DELETE_JOBS, DeleteJobs(job_ids=job_ids))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        return redirect("/jobs?done=deleted")

    async def _job(self, session: Session, job_id: str) -> JobView:
        details = await self.console.ask(session, GET_JOB, GetJob(job_id=job_id))
        job: JobView = details.job
        return job

    async def dialog(self, request: Request) -> Response:
        """The dialog of one operation of the row menu, asking to confirm (and for its value)."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        action = request.path_params["action"]
        if action not in ACTIONS:
            return self.console.refused_page(request, session, CommandError(
                code="not-found", message=self.console.text(request, N_("There is no such page."))))
        try:
            job = await self._job(session, request.path_params["job_id"])
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        return self.console.render(request, "job_action.html", session=session, job=job, action=action, error=None)

    async def act(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        job_id, action = request.path_params["job_id"], request.path_params["action"]
        perform = ACTIONS.get(action)
        if perform is None:
            return self.console.refused_page(request, session, CommandError(
                code="not-found", message=self.console.text(request, N_("There is no such page."))))
        try:
            form = await self.console.checked_form(request, session, max_fields=MOST_SELECTED + 8)
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        try:
            await perform(self.console, session, job_id, form)
        except Refused as refused:
            if action not in ("priority", "duration"):
                return self.console.refused_page(request, session, refused.error)
            try:  # the dialog again, with why, so that another value may be chosen
                job = await self._job(session, job_id)
            except Refused:
                return self.console.refused_page(request, session, refused.error)
            return self.console.render(request, "job_action.html", session=session, job=job, action=action,
                                       error=refused.error, status_code=STATUS.get(refused.error.code, 409))
        return redirect(f"/jobs?done={NOTICE_OF[action]}")


async def _stop(console: Console, session: Session, job_id: str, _: FormData) -> Done:
    done: Done = await console.ask(session, STOP_JOBS, StopJobs(job_ids=[job_id]))
    return done


async def _delete(console: Console, session: Session, job_id: str, _: FormData) -> Done:
    done: Done = await console.ask(session, DELETE_JOBS, DeleteJobs(job_ids=[job_id]))
    return done


async def _priority(console: Console, session: Session, job_id: str, form: FormData) -> Done:
    priority = str(form.get("priority") or "")
    if priority not in ("normal", "urgent", "very-urgent"):
        raise Refused(CommandError(code="invalid-request", message=f"priority: {priority!r} is not a priority",
                                   hint="choose normal or urgent (administrators: also very urgent)"))
    done: Done = await console.ask(session, CHANGE_PRIORITY, ChangePriority(job_id=job_id,
                                                                             priority=priority))  # type: ignore[arg-type]
    return done


async def _duration(console: Console, session: Session, job_id: str, form: FormData) -> Done:
    text = str(form.get("duration") or "").strip()[:32]
    duration: str | None = text or None
    if duration is not None:
        try:
            parse_duration(duration)
        except ValueError as exc:
            raise Refused(CommandError(code="invalid-request", message=f"duration: {exc}",
                                       hint="e.g. 30m, 4h, 2d; empty for no limit")) from None
    done: Done = await console.ask(session, CHANGE_DURATION, ChangeDuration(job_id=job_id, duration=duration))
    return done


ACTIONS: dict[str, Any] = {"stop": _stop, "delete": _delete, "priority": _priority, "duration": _duration}
NOTICE_OF = {"stop": "stopped", "delete": "deleted", "priority": "priority", "duration": "duration"}
