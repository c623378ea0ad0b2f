"""Signing in and out, and the language switch.

Signing in checks the pasted token the only way that counts: NATS logs in with it and the scheduler says whom
it names (`whoami`). The session then holds the token server-side; the browser gets the session's id in an
HttpOnly, SameSite=Strict cookie (Secure when the page came over HTTPS).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from libs.contracts.operations.cluster import WHOAMI, WhoAmI
from services.gateway.bodies import bounded_body, bounded_form
from services.gateway.calls import Refused
from services.gateway.console import links
from services.gateway.console.base import Console, redirect, safe_next
from services.gateway.console.i18n import LANGUAGE_COOKIE, LANGUAGES, N_
from services.gateway.sessions import SESSION_COOKIE, not_a_persons_token, own_origin

MOST_TOKEN_CHARS = 8192
LINKS_FOLDER_VARIABLE = "TRAINYARD_SIGNIN_LINKS"  # where `make up` leaves its one-time links (links.py)
YEAR_SECONDS = 365 * 24 * 3600


def links_folder() -> Path | None:
    folder = os.environ.get(LINKS_FOLDER_VARIABLE)
    return Path(folder) if folder else None


def secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


def with_session(response: Response, request: Request, session_id: str) -> Response:
    response.set_cookie(SESSION_COOKIE, session_id, httponly=True, samesite="strict", secure=secure(request),
                        path="/")
    return response


class SignIn:
    def __init__(self, console: Console, links_at: Path | None = None) -> None:
        self.console = console
        self.links_at = links_at if links_at is not None else links_folder()

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.home, methods=["GET"]),
            Route("/signin", self.page, methods=["GET"]),
            Route("/signin", self.sign_in, methods=["POST"]),
            Route("/signin/link", self.redeem_link, methods=["POST"]),
            Route("/signout", self.sign_out, methods=["POST"]),
            Route("/language/{code}", self.choose_language, methods=["GET"]),
        ]

    async def home(self, request: Request) -> Response:
        return redirect("/jobs" if self.console.session(request) else "/signin")

    async def page(self, request: Request, error: str | None = None, status_code: int = 200) -> Response:
        return self.console.render(request, "signin.html", session=None, error=error,
                                   next=safe_next(request.query_params.get("next")), status_code=status_code)

    async def sign_in(self, request: Request) -> Response:
        if not own_origin(request):
            return await self.page(request, self.console.text(request, N_("Sign in from the console's own page.")),
                                   403)
        try:
            form = await bounded_form(request, max_fields=4)
        except Refused as refused:  # a body over the limit: no form a sign-in page sends
            return await self.page(request, refused.error.message, 400)
        token = str(form.get("token") or "").strip()
        target = safe_next(str(form.get("next") or ""))
        refusal, session_id = await self._open_session(request, token)
        if session_id is None:
            return await self.page(request, refusal, 401)
        return with_session(redirect(target), request, session_id)

    async def redeem_link(self, request: Request) -> Response:
        """The sign-in page's script posts a one-time link's code here (JSON `{"code": …}`)."""
        refused = JSONResponse({"error": self.console.text(request, N_(
            "This sign-in link is used up or too old. Ask for a new one, or paste your token."))}, status_code=401)
        if not own_origin(request):
            return refused
        try:
            body = await bounded_body(request, 1024)
            code = msgspec.json.decode(body, type=dict[str, str]).get("code", "")
        except (Refused, msgspec.DecodeError, msgspec.ValidationError):
            return refused
        token = links.redeem(self.links_at, code)
        if token is None:
            return refused
        _, session_id = await self._open_session(request, token)
        if session_id is None:
            return refused
        return with_session(JSONResponse({"next": "/jobs"}), request, session_id)

    async def _open_session(self, request: Request, token: str) -> tuple[str, str | None]:
        """A new session's id for a token the platform knows, or why it was refused."""
        not_ours = self.console.text(request, N_("That is not a Trainyard token. `trainyard admin token` issues one."))
        if not token or len(token) > MOST_TOKEN_CHARS:
            return not_ours, None
        problem = not_a_persons_token(token)
        if problem is not None:
            return (not_ours if problem == "the token is not a Trainyard token" else problem), None
        try:
            reply = await self.console.calls.ask(WHOAMI, WhoAmI(), token)
        except Refused as refused:
            return (refused.error.message if refused.error.code != "unauthenticated" else not_ours), None
        session_id, _ = self.console.sessions.open(token, reply.identity)
        return "", session_id

    async def sign_out(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is not None:
            try:
                await self.console.checked_form(request, session, max_fields=4,
                                                refusal=N_("Sign out from the console's own page."))
            except Refused as refused:
                return self.console.refused_page(request, session, refused.error)
            self.console.sessions.close(request.cookies.get(SESSION_COOKIE, ""))
        response = redirect("/signin")
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    async def choose_language(self, request: Request) -> Response:
        code = request.path_params["code"]
        response = redirect(safe_next(request.query_params.get("next")))
        if code in LANGUAGES:
            response.set_cookie(LANGUAGE_COOKIE, code, max_age=YEAR_SECONDS, samesite="strict", path="/",
                                secure=secure(request))
        return response
