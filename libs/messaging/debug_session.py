"""Debug sessions (J15), the caller's side: a command or a shell in a job's kept (or running) node environment.

The monitor opens a session (OpenTerminal → TerminalOpened); the caller then talks to the node agent
directly on `subjects.session(node, owner, session_id, channel)` (owner: its own NATS user, the only one
NATS lets in): raw bytes on `in` and `out`, `SessionControl` on `control`, one `SessionExited` on `exit`
(see libs.contracts.agent.OpenSession). The CLI (client/terminal.py) and the gateway's web terminal both
speak it through here.

The agent may write before the monitor's reply reaches the caller (the reply is the first place the
node is known). So the caller chooses the session id itself, subscribes to that session's channels
on any node before it asks, and keeps what arrives; it never listens to other sessions. One
subscription carries both `out` and `exit`, so the server's per-subject order holds between them:
output written before the exit is always read before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.agent import SessionControl, SessionExited
from libs.contracts.codec import decode, encode
from libs.contracts.operations.runs import OpenTerminal, TerminalOpened

KEEPALIVE_SECONDS = 10.0  # the agent ends a session silent on `control` for its idle time (60 s)
CHUNK = 64 * 1024  # input is sent in pieces well under NATS's maximum payload
# trainyard.agent.<node>.session.<owner>.<session id>.<channel>: the id and the channel are tokens 5 and 6.
_SESSION_TOKENS, _ID, _CHANNEL = 7, 5, 6
_OWN_CHANNELS = ("out", "exit")


class DebugSession:
    """An open session: read its output, send it input, resize its terminal, learn its exit code.

    Obtained from `open_session` (the client's `TrainyardClient.session(...)`); keep-alives are sent while
    it is open.
    """

    def __init__(self, nc: Client, owner: str, opened: TerminalOpened, inbox: asyncio.Queue[Msg | None],
                 release: Callable[[], Awaitable[None]]) -> None:
        self.nc = nc
        self.owner = owner
        self.session_id = opened.session_id
        self.node = opened.node
        self.rank = opened.rank
        self.attempt = opened.attempt
        self.exit_code: int | None = None
        self._inbox = inbox
        self._release = release
        self._keep_alive = asyncio.create_task(self._send_keep_alives())

    def _subject(self, channel: str) -> str:
        return subjects.session(self.node, self.owner, self.session_id, channel)

    async def output(self) -> AsyncIterator[bytes]:
        """The session's output as it arrives, from its first byte, until it exits (`exit_code`) or is closed."""
        while self.exit_code is None:
            msg = await self._inbox.get()
            if msg is None:  # closed
                return
            tokens = msg.subject.split(".")
            if tokens[_ID] != self.session_id:
                continue  # another session's, kept while this one's id was not known yet
            if tokens[_CHANNEL] == "out":
                yield msg.data
            elif tokens[_CHANNEL] == "exit":
                self.exit_code = decode(msg.data, SessionExited).exit_code

    async def read_all(self) -> bytes:
        """All output until the session exits."""
        output = bytearray()
        async for chunk in self.output():
            output += chunk
        return bytes(output)

    async def send(self, data: bytes) -> None:
        """Input for the session (keystrokes, or a file piped to its command)."""
        for start in range(0, len(data), CHUNK):
            await self.nc.publish(self._subject("in"), data[start:start + CHUNK])

    async def resize(self, columns: int, rows: int) -> None:
        await self._control(SessionControl(columns=columns, rows=rows))

    async def close_input(self) -> None:
        """The end of input: the command reads end-of-file (a shell on a terminal, an end-of-file character)."""
        await self._control(SessionControl(close=True))

    async def _control(self, message: SessionControl) -> None:
        await self.nc.publish(self._subject("control"), encode(message))

    async def _send_keep_alives(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(KEEPALIVE_SECONDS)
                await self._control(SessionControl())

    async def close(self) -> None:
        """Stop the keep-alives and listening; a session still running then ends after its idle time."""
        self._keep_alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keep_alive
        await self._release()


async def open_session(nc: Client, owner: str, ask: Callable[[OpenTerminal], Awaitable[TerminalOpened]],
                       request: OpenTerminal) -> DebugSession:
    """Listen to the `out` and `exit` of a session id of our choosing (of `owner`, the NATS user `nc` is logged
    in as), then ask the monitor (`ask`) to open it; nothing the agent writes before the reply is lost."""
    inbox: asyncio.Queue[Msg | None] = asyncio.Queue()
    session_id = request.session_id or secrets.token_hex(16)
    request = msgspec.structs.replace(request, session_id=session_id)
    own: list[str] = [session_id]

    async def on_message(msg: Msg) -> None:
        tokens = msg.subject.split(".")
        if len(tokens) != _SESSION_TOKENS or tokens[_CHANNEL] not in _OWN_CHANNELS:
            return  # input and control messages (also this caller's own)
        if own and tokens[_ID] != own[0]:
            return
        inbox.put_nowait(msg)

    # Only this session's output channels: a user may read `out` and `exit`, never others' input.
    subs = [await nc.subscribe(subjects.session("*", owner, session_id, channel), cb=on_message)
            for channel in _OWN_CHANNELS]

    async def release() -> None:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        inbox.put_nowait(None)

    try:
        await nc.flush()  # the server holds the subscription before the agent can write
        opened = await ask(request)
    except BaseException:
        await release()
        raise
    if opened.session_id != session_id:  # a monitor that made its own id: listen to that one
        own[0] = opened.session_id
    return DebugSession(nc, owner, opened, inbox, release)
