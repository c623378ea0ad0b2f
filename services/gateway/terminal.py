"""The debug terminal (J15) in the browser: a WebSocket bridged to a debug session in a job's kept (or running)
environment, opened through the monitor and spoken on NATS as the signed-in user, as `trainyard exec` does.

`/console/jobs/{job_id}/terminal?node=&columns=&rows=`, one session per socket:

- browser → gateway: first a text frame `{"csrf": "<the page's token>"}` (a console session: the cookie says
  who, the token and the Origin that it is the console's own page; a program with an `Authorization: Bearer`
  header sends none); then binary frames, the keystrokes, and text frames `{"resize": [columns, rows]}`.
- gateway → browser: binary frames, the output; once the session ended, `{"exit": code}` and a normal close.
- a refusal (who is calling, what was asked, or the monitor's: not found, no kept environment, read-only) is
  `{"error": {"code", "message", "hint"}}` and a close with 4000 + its HTTP status (4401, 4403, 4404, 4409…).

Nothing is opened before the caller is known. When the browser goes away, the session's input is closed (a
shell at its prompt ends with it; anything else ends on the agent after its idle time, as keep-alives stop).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from nats.aio.client import Client
from starlette.datastructures import QueryParams
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import OPEN_TERMINAL, OpenTerminal, TerminalOpened
from libs.messaging.debug_session import DebugSession, open_session
from libs.natsroles import nats_user_for
from libs.telemetry.logs import get_logger
from services.gateway.calls import Refused, UserCalls
from services.gateway.problems import STATUS
from services.gateway.sessions import Caller, Sessions, caller_of

log = get_logger(__name__)

TERMINAL_PATH = "/console/jobs/{job_id}/terminal"
MAX_FRAME_BYTES = 64 * 1024  # keystrokes (a paste comes in several frames) and output alike
MAX_TEXT_BYTES = 1024  # the CSRF token and resizes are short
HELLO_SECONDS = 10.0  # how long a page has to send its CSRF token
MAX_COLUMNS, MAX_ROWS = 1000, 1000
DEFAULT_COLUMNS, DEFAULT_ROWS = 80, 24
MAX_NAME_CHARS = 200  # a node's name, in the query
NORMAL_CLOSE = 1000

Columns = Annotated[int, Meta(ge=1, le=MAX_COLUMNS)]
Rows = Annotated[int, Meta(ge=1, le=MAX_ROWS)]


class Hello(msgspec.Struct, forbid_unknown_fields=True):
    csrf: str


class Resize(msgspec.Struct, forbid_unknown_fields=True):
    resize: tuple[Columns, Rows]


def invalid(message: str) -> Refused:
    return Refused(CommandError(code="invalid-request", message=message))


def close_code(error: CommandError) -> int:
    """4000 + the HTTP status the same refusal has in the HTTP API: 4401, 4403, 4404, 4409…"""
    return 4000 + STATUS.get(error.code, 500)


def whole_number(params: QueryParams, name: str, default: int, most: int) -> int:
    given = params.get(name)
    if given is None or given == "":
        return default
    if not given.isdigit() or not 1 <= int(given) <= most:
        raise invalid(f"{name} must be a whole number from 1 to {most}, not {given[:20]!r}")
    return int(given)


def terminal_request(job_id: str, params: QueryParams) -> OpenTerminal:
    """The session the query asks for: an interactive shell of that size, on `node` (default the master's)."""
    node = params.get("node") or None
    if node is not None and len(node) > MAX_NAME_CHARS:
        raise invalid(f"node is a node's name, at most {MAX_NAME_CHARS} characters")
    return OpenTerminal(job_id=job_id, node=node, columns=whole_number(params, "columns", DEFAULT_COLUMNS, MAX_COLUMNS),
                        rows=whole_number(params, "rows", DEFAULT_ROWS, MAX_ROWS))


def text_of(message: Message) -> str | None:
    """A text frame's text, or None for anything else."""
    text = message.get("text")
    return text if isinstance(text, str) else None


class TerminalBridge:
    """The browser's terminal WebSocket, each one a debug session opened as its caller."""

    def __init__(self, calls: UserCalls, sessions: Sessions) -> None:
        self.calls = calls
        self.sessions = sessions

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute(TERMINAL_PATH, self.terminal)]

    async def terminal(self, websocket: WebSocket) -> None:
        await websocket.accept()
        job_id = websocket.path_params["job_id"]
        try:
            caller = await self._caller(websocket)
            request = terminal_request(job_id, websocket.query_params)
        except Refused as refused:
            await refuse(websocket, refused.error)
            return
        except WebSocketDisconnect:
            return  # gone before it said who it is
        try:
            # The session's subjects are on the caller's connection: held open while the terminal lives.
            async with self.calls.held(caller.token) as nc:
                session = await self._open(nc, caller.token, request)
                user = caller.session.user if caller.session is not None else nats_user_for(caller.token)
                log.info("gateway.terminal_opened", job_id=job_id, node=session.node, rank=session.rank, user=user)
                try:
                    await self._bridge(websocket, session)
                finally:
                    await session.close()
                log.info("gateway.terminal_closed", job_id=job_id, node=session.node, exit_code=session.exit_code,
                         user=user)
        except Refused as refused:
            await refuse(websocket, refused.error)

    async def _caller(self, websocket: WebSocket) -> Caller:
        """A program's bearer token at once; a console page's session once its first frame brings the CSRF token
        (any other first frame, or none in time, is refused as a request from another page would be)."""
        if "authorization" in websocket.headers:
            return caller_of(websocket, self.sessions)
        try:
            async with asyncio.timeout(HELLO_SECONDS):
                message = await websocket.receive()
        except TimeoutError:
            message = {"type": "websocket.receive"}  # as a first frame without the token
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", NORMAL_CLOSE))
        presented = ""  # never the X-CSRF-Token header: only the first frame counts here
        text = text_of(message)
        if text is not None and len(text) <= MAX_TEXT_BYTES:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                presented = msgspec.json.decode(text, type=Hello).csrf
        return caller_of(websocket, self.sessions, csrf=presented)

    async def _open(self, nc: Client, token: str, request: OpenTerminal) -> DebugSession:
        """Open the session on the caller's own connection: its subjects are that NATS user's."""
        owner = nats_user_for(token)
        if owner is None:
            raise Refused(CommandError(code="unauthenticated", message="the token is not a Trainyard token"))

        async def ask(request: OpenTerminal) -> TerminalOpened:
            opened: TerminalOpened = await self.calls.ask(OPEN_TERMINAL, request, token)
            return opened

        try:
            return await open_session(nc, owner, ask, request)
        except Refused:
            raise
        except Exception as exc:  # the connection failed while listening or asking
            log.warning("gateway.terminal_not_opened", job_id=request.job_id, error=repr(exc))
            raise Refused(CommandError(code="unavailable", message="the gateway could not open the session",
                                       hint="try again in a few seconds")) from None

    async def _bridge(self, websocket: WebSocket, session: DebugSession) -> None:
        """Carry both ways until the session exits, the browser leaves, or either side breaks the protocol."""
        output = asyncio.create_task(self._forward_output(websocket, session))
        typing = asyncio.create_task(self._forward_input(websocket, session))
        try:
            await asyncio.wait({output, typing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (output, typing):
                task.cancel()
            await asyncio.gather(output, typing, return_exceptions=True)
        if ended_well(output) and session.exit_code is not None:
            await say(websocket, {"exit": session.exit_code})
            await close(websocket, NORMAL_CLOSE)
            return
        # Nothing more will be typed: a shell at its prompt ends now, anything else after its idle time.
        with contextlib.suppress(Exception):
            await session.close_input()
        if ended_well(typing):
            return  # the browser left: no one to tell
        failure = next((task.exception() for task in (typing, output) if task.done() and not task.cancelled()
                        and task.exception() is not None), None)
        if isinstance(failure, Refused):
            await refuse(websocket, failure.error)
            return
        if failure is not None and not isinstance(failure, WebSocketDisconnect):
            log.warning("gateway.terminal_broken", node=session.node, session_id=session.session_id,
                        error=repr(failure))
        await refuse(websocket, CommandError(code="unavailable", message="the terminal's connection to the session "
                                             "broke", hint="open the terminal again"))

    async def _forward_output(self, websocket: WebSocket, session: DebugSession) -> None:
        async for chunk in session.output():
            for start in range(0, len(chunk), MAX_FRAME_BYTES):
                await websocket.send_bytes(chunk[start:start + MAX_FRAME_BYTES])

    async def _forward_input(self, websocket: WebSocket, session: DebugSession) -> None:
        """Keystrokes and resizes until the browser leaves (returns) or sends what is no part of the protocol
        (raises `Refused`)."""
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if isinstance(data, bytes):
                if len(data) > MAX_FRAME_BYTES:
                    raise invalid(f"a frame is over the limit of {MAX_FRAME_BYTES} bytes")
                await session.send(data)
                continue
            text = text_of(message) or ""
            if len(text) > MAX_TEXT_BYTES:
                raise invalid(f"a text frame is over the limit of {MAX_TEXT_BYTES} bytes")
            try:
                resize = msgspec.json.decode(text, type=Resize)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise invalid(f"a text frame is {{\"resize\": [columns, rows]}}: {exc}") from None
            await session.resize(*resize.resize)


def ended_well(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def say(websocket: WebSocket, message: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):  # the browser may be gone already
        await websocket.send_text(msgspec.json.encode(message).decode())


async def close(websocket: WebSocket, code: int, reason: str = "") -> None:
    with contextlib.suppress(Exception):
        await websocket.close(code, reason)


async def refuse(websocket: WebSocket, error: CommandError) -> None:
    """Say why, as the HTTP API would, and close."""
    said: dict[str, str | None] = {"code": error.code, "message": error.message, "hint": error.hint}
    await say(websocket, {"error": said})
    await close(websocket, close_code(error), error.code)
