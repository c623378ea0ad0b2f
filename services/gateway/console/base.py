"""What every page of the console stands on: its templates in the reader's language, the signed-in session,
asking the services as that person, and the names the pages show for the platform's values.

Templates are Jinja2 with autoescaping on for every page: whatever a user wrote (a job's name, a log line, an
environment value) is shown as text, never read as markup. The pages' scripts get their texts as data (a JSON
block, which a browser does not run), and write what they show with `textContent`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from libs.access import READ_ONLY_ACTIONS, Grant, JobAction
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError, Operation
from services.gateway.bodies import FORM_BYTES, bounded_form
from services.gateway.calls import Refused, UserCalls
from services.gateway.console.i18n import LANGUAGES, N_, language_of, script_texts, translations
from services.gateway.problems import STATUS
from services.gateway.sessions import CSRF_FIELD, Session, Sessions, from_console_page

TEMPLATES = Path(__file__).resolve().parent / "templates"
SIGN_IN = "/signin"

# The seed's names for the platform's values (seed 001: 排队中, 运行中, 错误, 停止, 过期, 成功).
STATUS_TEXT: dict[str, str] = {
    "queued": N_("Queued"), "running": N_("Running"), "succeeded": N_("Succeeded"),
    "failed": N_("Failed"), "stopped": N_("Stopped"), "expired": N_("Expired"),
}
PRIORITY_TEXT: dict[str, str] = {"normal": N_("Normal"), "urgent": N_("Urgent"), "very-urgent": N_("Very urgent")}
MODE_TEXT: dict[str, str] = {
    "single-node": N_("Single node"), "pytorch": "PyTorch", "pytorch-deepspeed": "PyTorch-DeepSpeed",
    "horovod": "Horovod", "tensorflow": "TensorFlow",
}
ACCESS_TEXT: dict[str, str] = {"read-write": N_("Read and write"), "read-only": N_("Read only"),
                               "none": N_("No access")}
TYPE_TEXT: dict[str, str] = {"regular": N_("Regular job"), "batch": N_("Batch job")}


def moment(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else ""


def environment(language: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             extensions=["jinja2.ext.i18n"], undefined=jinja2.StrictUndefined)
    texts = translations(language)
    env.install_gettext_translations(texts, newstyle=True)  # type: ignore[attr-defined]
    translate = texts.gettext

    def named(table: Mapping[str, str]) -> Callable[[str], str]:
        return lambda value: translate(table.get(value, value))

    env.filters["status"] = named(STATUS_TEXT)
    env.filters["priority"] = named(PRIORITY_TEXT)
    env.filters["mode"] = named(MODE_TEXT)
    env.filters["access"] = named(ACCESS_TEXT)
    env.filters["jobtype"] = named(TYPE_TEXT)
    env.filters["moment"] = moment
    env.globals["languages"] = LANGUAGES
    env.globals["language"] = language
    env.globals["csrf_field"] = CSRF_FIELD
    env.globals["script_texts"] = dict(script_texts(language))
    return env


def job_grant(identity: Identity, *, project: str, creator: str, access: str) -> Grant:
    """J2 for a listed job: `access` is what others in the project may do, as the scheduler reports it (after
    the sharing switch). The services decide again on every action; this only hides what would be refused."""
    if identity.admin or identity.user == creator:
        return "owner"
    if project not in identity.projects or access not in ("read-only", "read-write"):
        return "none"
    return "read-only" if access == "read-only" else "read-write"


def may(grant: Grant, action: JobAction) -> bool:
    return grant in ("owner", "read-write") or (grant == "read-only" and action in READ_ONLY_ACTIONS)


def offered_actions(session: Session, *, project: str, creator: str, access: str, status: str) -> tuple[str, ...]:
    """A job's operations menu (操作), on its row and its page: what the person may do to it in its state."""
    grant = job_grant(session.identity, project=project, creator=creator, access=access)
    wanted: list[JobAction] = ["clone", "devenv", "tensorboard"]
    if status == "queued":
        wanted.append("priority")
    if status == "running":
        wanted.append("duration")
    wanted.append("stop" if status in ("queued", "running") else "delete")
    return tuple(action for action in wanted if may(grant, action))


class Console:
    def __init__(self, calls: UserCalls, sessions: Sessions) -> None:
        self.calls = calls
        self.sessions = sessions
        self.environments = {language: environment(language) for language in LANGUAGES}

    def session(self, request: Request) -> Session | None:
        return self.sessions.of(request)

    def render(self, request: Request, template: str, *, session: Session | None, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        language = language_of(request)
        page = self.environments[language].get_template(template)
        html = page.render(session=session, request_path=request.url.path, query=request.url.query,
                           csrf=session.csrf if session else "", **context)
        return HTMLResponse(html, status_code=status_code)

    def text(self, request: Request, text: str) -> str:
        return translations(language_of(request)).gettext(text)

    async def checked_form(self, request: Request, session: Session, *, limit: int = FORM_BYTES,
                           max_fields: int = 100, max_files: int = 0,
                           refusal: str = N_("The form did not come from the console's own page. Reload the page "
                                             "and try again.")) -> FormData:
        """A form of one of the console's pages: read within its bound, then refused (`forbidden`, with `refusal`)
        unless it came from the console's own origin with the session's CSRF token."""
        form = await bounded_form(request, limit=limit, max_fields=max_fields, max_files=max_files)
        if not from_console_page(request, session, form.get(CSRF_FIELD)):
            await form.close()
            raise Refused(CommandError(code="forbidden", message=self.text(request, refusal)))
        return form

    async def ask(self, session: Session, operation: Operation[Any, Any], request: msgspec.Struct) -> Any:
        return await self.calls.ask(operation, request, session.token)

    @staticmethod
    def to_sign_in(request: Request) -> Response:
        return redirect(f"{SIGN_IN}?next={request.url.path}")

    def refused_page(self, request: Request, session: Session, error: CommandError) -> HTMLResponse:
        return self.render(request, "refused.html", session=session, error=error,
                           status_code=STATUS.get(error.code, 500))


def redirect(url: str) -> RedirectResponse:
    """After a change, the page to show (303: the browser asks it with GET, so a reload repeats nothing)."""
    return RedirectResponse(url, status_code=303)


def safe_next(target: str | None, default: str = "/jobs") -> str:
    """Where to go after signing in: a path of this site only, never another site's address."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target
