"""Connecting to NATS as a role, and declaring the JetStream streams a service owns.

Every process connects with a `NatsLogin`: a service with its NATS user and password, everyone else
(node agents, people, jobs) with a Trainyard token that the auth callout turns into the permissions
of its role (libs/natsroles.py, libs/natsauth.py). Replies arrive under the login's own inbox
prefix, the only inbox its role may read. A server without authorization ignores the credentials,
so the same code runs against a development server that has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from libs.contracts import subjects
from libs.natsroles import STREAM_OWNERS, inbox_prefix, job_user, nats_user_for


def _log() -> Any:
    """The logger, loaded when a long-lived process first logs: a CLI command never loads structlog."""
    import structlog

    return structlog.get_logger()


DAY = 86400.0
DEFAULT_INBOX = "_INBOX"
# A service's NATS password: a file (preferred) or the password itself.
NATS_PASSWORD_FILE_VARIABLE = "TRAINYARD_NATS_PASSWORD_FILE"
NATS_PASSWORD_VARIABLE = "TRAINYARD_NATS_PASSWORD"

# How many servers of a NATS cluster keep each stream (and the usage bucket): 1 on one server; 3 on a cluster of
# three, so that any one may be lost (its leader included) without losing an acknowledged message.
STREAM_REPLICAS_VARIABLE = "TRAINYARD_STREAM_REPLICAS"


def stream_replicas() -> int:
    value = os.environ.get(STREAM_REPLICAS_VARIABLE, "1").strip() or "1"
    if not value.isdigit() or not 1 <= int(value) <= 5:
        raise ValueError(f"{STREAM_REPLICAS_VARIABLE}={value!r}: give the number of servers that keep each stream, "
                         "1 to 5 (JetStream's limit), at most the servers of the cluster")
    return int(value)


def server_urls(url: str) -> list[str]:
    """`NATS_URL` as the servers to try: one URL, or several separated by commas (the servers of a cluster; a
    client learns the rest of a cluster from the one it reaches, but needs another to start from when that one is
    down)."""
    return [part.strip() for part in url.split(",") if part.strip()]


# Every stream drops messages re-published within two minutes with the same Nats-Msg-Id.
STREAMS: tuple[StreamConfig, ...] = (
    StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0),
    StreamConfig(name=subjects.AGENT_REPORTS_STREAM, subjects=[subjects.AGENT_REPORTS_ALL],
                 storage=StorageType.FILE, duplicate_window=120.0),
    # D1, D2: nodes' whole-cache reports; the monitor needs only the latest of each node, and a few more.
    StreamConfig(name=subjects.CACHE_REPORTS_STREAM, subjects=[subjects.CACHE_REPORTS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0, max_msgs_per_subject=20, max_age=30 * DAY, discard=DiscardPolicy.OLD),
    # R2: every job's run, kept as its logs are.
    StreamConfig(name=subjects.METRICS_STREAM, subjects=[subjects.METRICS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0, max_age=30 * DAY, max_bytes=16 * 1024**3, discard=DiscardPolicy.OLD),
    StreamConfig(name=subjects.LOGS_STREAM, subjects=[subjects.LOGS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0, max_age=7 * DAY, max_bytes=8 * 1024**3, discard=DiscardPolicy.OLD),
)
# Usage is a current value, not history: one entry per key, gone a day after the last sample.
USAGE_BUCKET_CONFIG = KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1, ttl=DAY)


@dataclass(frozen=True)
class NatsLogin:
    """Who a process is on NATS: a static user and password (services) or a token for the auth callout."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    inbox: str = DEFAULT_INBOX

    def options(self) -> dict[str, Any]:
        found: dict[str, Any] = {"inbox_prefix": self.inbox}
        if self.user is not None:
            found |= {"user": self.user, "password": self.password or ""}
        elif self.token:
            found["token"] = self.token
        return found

    def expired(self) -> bool:
        """Whether the login's token has run out, by its own `exp` (read, not verified: the auth callout verifies
        it); a login without a token never does."""
        if not self.token:
            return False
        import jwt  # here, not at the top: only a connection whose login was refused asks

        try:
            expires = jwt.decode(self.token, options={"verify_signature": False}).get("exp")
        except jwt.InvalidTokenError:
            return False
        return isinstance(expires, int | float) and time.time() >= expires

    @classmethod
    def for_service(cls, service: str) -> NatsLogin:
        """A service's login from TRAINYARD_NATS_PASSWORD(_FILE); none configured: no credentials."""
        password = os.environ.get(NATS_PASSWORD_VARIABLE)
        if path := os.environ.get(NATS_PASSWORD_FILE_VARIABLE):
            password = Path(path).read_text().strip()
        if password is None:
            return cls(inbox=inbox_prefix(service))
        return cls(user=service, password=password, inbox=inbox_prefix(service))

    @classmethod
    def for_token(cls, token: str | None) -> NatsLogin:
        """A user's or node agent's login: its token, and the inbox its role reads (from the token's subject)."""
        if not token:
            return cls()
        user = nats_user_for(token)
        return cls(token=token, inbox=inbox_prefix(user) if user else DEFAULT_INBOX)

    @classmethod
    def for_job(cls, job_id: str, token: str) -> NatsLogin:
        """A job's login (MPI's remote shell): its job-scoped token and the job's inbox."""
        return cls(token=token, inbox=inbox_prefix(job_user(job_id)))


class _ErrorLog:
    """nats-py's error callback: log each new kind of connection error once, remember the last."""

    def __init__(self, connection: str) -> None:
        self.connection = connection
        self.last: str | None = None

    async def record(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        if text != self.last:
            _log().warning("nats.error", connection=self.connection, error=text)
        self.last = text


async def connect(url: str, name: str, login: NatsLogin | None = None, *, retry_seconds: float = 1.0) -> Client:
    """A connection that keeps reconnecting for as long as the process lives (services, agents).

    The first connection is retried too: the server may not be up yet, or may refuse the login until
    a service that answers its auth callout is.
    """
    errors = _ErrorLog(name)
    attempt = 0
    while True:
        try:
            return await _connected(await nats.connect(server_urls(url), name=name, max_reconnect_attempts=-1,
                                                       reconnect_time_wait=0.5, connect_timeout=5,
                                                       error_cb=errors.record, **(login or NatsLogin()).options()))
        except Exception as exc:
            if attempt % 10 == 0:
                _log().warning("nats.connect_failed", url=url, connection=name, attempt=attempt + 1,
                            error=errors.last or str(exc) or type(exc).__name__)
            attempt += 1
            await asyncio.sleep(min(retry_seconds, 0.1 * 2**attempt))  # soon at first: the callout is starting


async def _connected(nc: Client) -> Client:
    """`nc` once the server answered the handshake; raises when it hung up instead.

    nats-py returns from `connect` without a PONG when the server closes the socket at the handshake
    (as it does when an auth callout fails without a reply); such a client is closed for good after its
    reconnects are spent, so it is refused here rather than handed out.
    """
    if nc.is_connected:
        return nc
    await nc.close()
    raise ConnectionError("the NATS server hung up during the handshake (its login service may be starting)")


async def round_trip(nc: Client, timeout: int = 10) -> None:
    """Return once the server has read everything written on `nc` before the call, so a subscription
    made just now hears what another connection publishes next.

    nats-py's `flush()` writes its PING straight to the socket, ahead of the commands still waiting in
    its write buffer: its PONG can come back before a SUB queued earlier is read. The first flush moves
    that buffer to the socket behind its PING; the second PING follows it there.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


class LoginRefused(ConnectionError):
    """NATS refused the credentials (a missing, expired or forged token, a wrong password)."""


# A client's first connection fails fast when nothing answers: each server of NATS_URL is tried this many times more,
# RECONNECT_SECONDS apart (about two seconds in all), so that the CLI tells at once that the stack is not reachable.
FIRST_CONNECT_RETRIES = 3
RECONNECT_SECONDS = 0.5


async def connect_once(url: str, name: str, login: NatsLogin | None = None, *,
                       reconnected: Callable[[], Awaitable[None]] | None = None) -> Client:
    """A client's connection (the CLI, the Python client, the gateway's connection of one user): the first
    connection fails fast when the server is not there; once connected, it reconnects for as long as it is open,
    every RECONNECT_SECONDS however long the server is away, and calls `reconnected` after each reconnection (a
    request out meanwhile may have been lost with the server). Its subscriptions are made again on the new
    connection by nats-py.

    Raises `LoginRefused` when the server answered but refused the login, so the caller can say so. A login
    refused at a reconnection is tried again, for the server may be back before the service that answers its auth
    callout; but once the login's token has run out the connection is closed, as NATS closes a connected one
    whose token runs out: no later attempt could be admitted. Close it with `close_connection`.
    """
    login = login or NatsLogin()
    errors = _ClientErrors(login)
    try:
        nc = await _connected(await nats.connect(server_urls(url), name=name, allow_reconnect=True,
                                                 max_reconnect_attempts=FIRST_CONNECT_RETRIES,
                                                 reconnect_time_wait=RECONNECT_SECONDS, connect_timeout=3,
                                                 error_cb=errors.record, reconnected_cb=reconnected,
                                                 **login.options()))
    except Exception:
        if errors.refused_login():
            raise LoginRefused("NATS refused the login (authorization violation): the token is missing, expired or "
                               "not valid here") from None
        raise
    # nats-py reads this limit afresh at every attempt: the one that bounded the first connection ends here, and
    # the connection is made anew whenever the server comes back (-1: no limit).
    nc.options["max_reconnect_attempts"] = -1
    errors.connected(nc)
    return nc


class _ClientErrors:
    """nats-py's error callback for a client's connection. Until it is connected, the errors are kept, to be raised
    as one exception (not logged: the CLI prints it); after, a login refused with a token that has run out closes
    the connection rather than trying it again for ever."""

    def __init__(self, login: NatsLogin) -> None:
        self.login = login
        self.first: list[str] = []
        self.nc: Client | None = None
        self.closing: asyncio.Task[None] | None = None

    def connected(self, nc: Client) -> None:
        self.nc = nc
        self.first.clear()

    def refused_login(self) -> bool:
        return any("authorization" in error.lower() for error in self.first)

    async def record(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        if self.nc is None:
            self.first.append(text)
        elif "authorization" in text.lower() and self.closing is None and self.login.expired():
            # In a task of its own: nats-py calls this from its reconnection task, which closing cancels.
            self.closing = asyncio.get_running_loop().create_task(self.nc.close())


async def close_connection(nc: Client) -> None:
    """Close a client's connection: drained (what it still sends is delivered, its subscriptions end) while it is
    connected; at once while it is reconnecting, which nats-py cannot drain, and which would otherwise go on
    reconnecting after its owner let it go."""
    if nc.is_closed or nc.is_draining:  # closed, or being closed by another caller
        return
    if nc.is_connected:
        with contextlib.suppress(Exception):
            await nc.drain()
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()


def owned_streams(service: str | None) -> tuple[Sequence[StreamConfig], bool]:
    """The streams `service` declares and whether it declares the usage bucket; None: all of them (tests)."""
    if service is None:
        return STREAMS, True
    owned = [config for config in STREAMS if STREAM_OWNERS.get(config.name or "") == service]
    return owned, STREAM_OWNERS.get(subjects.USAGE_STREAM) == service


async def ensure_streams(js: JetStreamContext, owner: str | None = None) -> None:
    """Create or update the streams and buckets `owner` owns (all of them without an owner).

    Only the owning service may manage a stream (NATS refuses the others); the rest wait for it
    with `wait_for_streams`.
    """
    streams, usage = owned_streams(owner)
    replicas = stream_replicas()
    for config in streams:
        config = replace(config, num_replicas=replicas)
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    if usage:
        await js.create_key_value(replace(USAGE_BUCKET_CONFIG, replicas=replicas))


async def wait_for_streams(js: JetStreamContext, names: Sequence[str], *, poll: float = 0.5) -> None:
    """Wait until every stream in `names` exists (their owners create them when they start), through
    NATS outages too."""
    for name in names:
        waited = False
        while True:
            try:
                await js.stream_info(name)
                break
            except nats.errors.Error:  # not there yet, or NATS itself away for a moment: ask again
                if not waited:
                    _log().info("nats.waiting_for_stream", stream=name, owner=STREAM_OWNERS.get(name, "?"))
                    waited = True
                await asyncio.sleep(poll)
