"""The gateway's web application: the HTTP API, its follow streams, the console's pages and terminal, and
their static files, behind the security headers every response carries."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from libs.contracts.operations.base import CommandError
from services.gateway.api import HttpApi
from services.gateway.calls import UserCalls
from services.gateway.connections import UserConnections
from services.gateway.console.base import Console
from services.gateway.console.cluster import ClusterPages
from services.gateway.console.create import CreatePage
from services.gateway.console.job_page import JobPage
from services.gateway.console.jobs import JobsPages
from services.gateway.console.signin import SignIn
from services.gateway.console.tensorboard import TensorBoardPage
from services.gateway.follow import FollowStreams
from services.gateway.openapi import API_PREFIX
from services.gateway.problems import TYPE_BASE, problem_body_response, problem_response
from services.gateway.security import SecurityHeaders
from services.gateway.sessions import Sessions
from services.gateway.telemetry import RequestTelemetry
from services.gateway.terminal import TerminalBridge

STATIC = Path(__file__).resolve().parent / "static"


async def http_refusal(request: Request, exc: Exception) -> Response:
    """A path or method nothing serves: under the API a problem (RFC 9457) as every refusal there, elsewhere
    the plain answer."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if not request.url.path.startswith(API_PREFIX + "/"):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=headers)
    if exc.status_code == 405:
        body = {"type": TYPE_BASE + "method-not-allowed", "title": "Not served with this method", "status": 405,
                "detail": f"{request.method} is not served here", "code": "invalid-request",
                "hint": f"every operation is POST {API_PREFIX}/<operation>; the follow streams are GET",
                "instance": request.url.path}
        return problem_body_response(body, 405, headers)
    error = CommandError(code="not-found", message=f"there is nothing at {request.url.path}",
                         hint=f"{API_PREFIX}/openapi.json lists every operation and stream")
    return problem_response(error, request.url.path, headers)


async def healthz(_: Request) -> Response:
    """Alive and serving: the probes of deploy/k8s ask it, without a token."""
    return PlainTextResponse("ok")


def build_app(connections: UserConnections, sessions: Sessions | None = None,
              open_now: Counter[str] | None = None) -> Starlette:
    """The application; `open_now` counts the follow streams and terminals open (telemetry.py)."""
    calls = UserCalls(connections)
    sessions = sessions if sessions is not None else Sessions()
    console = Console(calls, sessions)
    routes: list[BaseRoute] = [
        Route("/healthz", healthz, methods=["GET"]),
        *HttpApi(calls, sessions).routes(),
        *FollowStreams(calls, sessions).routes(),
        *TerminalBridge(calls, sessions).routes(),
        *SignIn(console).routes(),
        *CreatePage(console).routes(),  # /jobs/new… and the next before /jobs/{job_id}/{action}
        *TensorBoardPage(console).routes(),
        *JobsPages(console).routes(),
        *JobPage(console).routes(),
        *ClusterPages(console).routes(),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    telemetry = Middleware(RequestTelemetry, open_now=open_now if open_now is not None else Counter())
    app = Starlette(routes=routes, middleware=[telemetry, Middleware(SecurityHeaders)],
                    exception_handlers={HTTPException: http_refusal})
    app.router.redirect_slashes = False  # a path is served as written, or refused: never redirected
    return app
