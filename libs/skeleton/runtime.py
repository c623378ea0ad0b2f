"""The process shell every service shares: connections, its event store, relay and lifecycle.

A service (libs.skeleton.eventsourced) builds on a `ServiceRuntime`: it rebuilds its state from `runtime.store`,
adds followers and responders, then `listen()` starts answering. `libs.skeleton.entrypoint.run` keeps the
process up until SIGTERM/SIGINT or until `stopped()` returns (a background task crashed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import asyncpg
from faststream.nats import NatsBroker, NatsUserPassword
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.eventstore import EventStore, OutboxRelay
from libs.eventstore.lease import Lease, LeaseLost
from libs.messaging.connection import NatsLogin, connect, ensure_streams, round_trip, server_urls
from libs.natsauth import read_issuer_seed
from libs.natsauth import serve as serve_logins
from libs.settings import Settings
from libs.telemetry.logs import configure_logging, get_logger
from libs.telemetry.metrics import ACTIVE, SampledGauge
from libs.telemetry.tracing import configure_tracing

log = get_logger(__name__)
# 1 once this process holds its service's lease, 0 while it stands by: an operator's "is anyone leading?"
_active = SampledGauge(ACTIVE)


async def keep_session(_: asyncpg.Connection) -> None:
    """A connection back in the pool keeps its session as it is. asyncpg would send a reset (UNLISTEN,
    RESET ALL, advisory unlocks) on every release, a round trip per query; the services set nothing on a
    pooled session, and the relay undoes its LISTEN and advisory lock itself. asyncpg still rolls back an
    open transaction and forgets the listeners on its own."""


class ServiceRuntime:
    """Connections and background tasks of one service process."""

    pool: asyncpg.Pool
    store: EventStore
    nc: Client
    js: JetStreamContext
    broker: NatsBroker
    relay: OutboxRelay

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        self.name = name
        self.settings = settings or Settings()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closers: list[tuple[str, Callable[[], Awaitable[None]]]] = []  # named steps of a shutdown
        self._stopping = asyncio.Event()
        # Whether the connection that carries requests and subscriptions is up, and since when: what
        # could not arrive while it was down (heartbeats) counts from then, not from before.
        self.hearing = True
        self.hearing_since = time.monotonic()

    async def start(self) -> None:
        configure_logging(self.name)
        configure_tracing(self.name)
        self.pool = await self._connect_database()
        self.store = EventStore(self.pool, self.name)
        await self.store.migrate()
        # One instance acts at a time: a standby waits here, answering nothing, until the lease is its own.
        self.lease = Lease(self.pool, self.store.schema)
        _active.set(0)
        self.store.epoch = await self.lease.acquire(
            waiting=lambda holder: log.info("service.standby", active=holder, lease_seconds=self.lease.ttl_seconds))
        log.info("service.active", epoch=self.store.epoch, instance=self.lease.holder)
        _active.set(1)
        login = NatsLogin.for_service(self.name)
        self.nc = await connect(self.settings.nats_url, f"trainyard-{self.name}", login)
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, owner=self.name)
        await self._serve_nats_logins()
        security = NatsUserPassword(login.user, login.password or "") if login.user is not None else None
        # Reconnecting for as long as the process lives: an outage of NATS must not end its subscriptions.
        # Without FastDepends (apply_types): every subscriber takes the message whole and decodes it as its
        # contract type itself (libs.messaging.rpc), so injection would only add work to every request.
        self.broker = NatsBroker(server_urls(self.settings.nats_url), logger=None, security=security,
                                 apply_types=False, inbox_prefix=login.inbox, max_reconnect_attempts=-1,
                                 reconnect_time_wait=1, disconnected_cb=self.stopped_hearing,
                                 reconnected_cb=self.heard_again)
        self.relay = OutboxRelay(self.store, self.js)
        self.spawn(self.relay.run(), "relay")
        self.spawn(self.lease.keep(self._lease_lost), "lease")

    async def _connect_database(self) -> asyncpg.Pool:
        """The service's pool, logged in as its own role when it has one (`make up`: DATABASE_URL names the role,
        TRAINYARD_DATABASE_PASSWORD_FILE holds its password)."""
        try:
            return await asyncpg.create_pool(self.settings.database_url, password=self.settings.database_password,
                                             min_size=2, max_size=8, reset=keep_session)
        except asyncpg.InvalidAuthorizationSpecificationError as exc:  # a wrong password, an unknown role
            raise SystemExit(f"PostgreSQL refused the {self.name} service's login: {exc}; check DATABASE_URL and "
                             "TRAINYARD_DATABASE_PASSWORD_FILE (`make up` provisions them; deploy/k8s/README.md "
                             "says how in Kubernetes)") from None

    async def _lease_lost(self, _: LeaseLost) -> None:
        """Another instance took over (this one was paused or cut off too long): stop, so that it restarts
        as a standby; its state may be behind what the other one recorded."""
        _active.set(0)
        self._stopping.set()

    async def _serve_nats_logins(self) -> None:
        """Answer NATS's auth callout when this service was given the issuer key (libs/natsauth.py)."""
        seed = read_issuer_seed()
        if seed is None:
            return
        await serve_logins(self.nc, seed=seed, secret=self.settings.require_auth_secret(), service=self.name)
        log.info("service.serving_nats_logins")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` for the life of the service; a crash in it stops the service loudly."""
        task = asyncio.create_task(coro, name=f"{self.name}.{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    def on_close(self, stop: Callable[[], Awaitable[None]], name: str | None = None) -> None:
        """Run `stop` when the service closes, while its connections are still open: a part with tasks of its
        own (a stream follower) ends them there, or they would outlive the service in a process that goes on.
        `name`: what the shutdown's logs call the step (`stop`'s own name if none)."""
        self._closers.append((name or str(getattr(stop, "__qualname__", stop)), stop))

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("service.task_crashed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self._stopping.set()

    async def stopped_hearing(self) -> None:
        if self.hearing:
            log.warning("service.nats_disconnected")
        self.hearing = False

    async def heard_again(self) -> None:
        log.info("service.nats_reconnected")
        self.hearing, self.hearing_since = True, time.monotonic()

    async def listen(self) -> None:
        """Start answering requests (after the service registered its responders)."""
        await self.broker.start()
        self.hearing, self.hearing_since = True, time.monotonic()
        # A round trip makes the server hold every subscription before anyone is told we are ready.
        connection = self.broker.connection
        if isinstance(connection, Client):
            await round_trip(connection)
        log.info("service.ready")

    async def stopped(self) -> None:
        """Return when a background task crashed and the service must stop."""
        await self._stopping.wait()

    async def close(self, timeout: float = 10.0) -> None:
        """Stop answering, end the background tasks, then close connections; every step is bounded,
        so a stuck query or subscription can delay a shutdown but never hang it. A start cut short is closed as
        far as it got."""
        log.info("service.stopping")
        # Stop answering first, so no request reaches a service that is half shut down.
        # A start cut short has not made some of what the steps close: those are passed over.
        if (broker := getattr(self, "broker", None)) is not None:
            await _bounded("answering", broker.stop, timeout)
        for name, stop in self._closers:
            await _bounded(name, stop, timeout)
        for task in self._tasks:
            task.cancel()
        await _bounded("background tasks", lambda: asyncio.gather(*self._tasks, return_exceptions=True), timeout)
        for task in self._tasks:
            if not task.done():  # where it waits, for whoever looks into why a stop was slow
                log.warning("service.task_not_ended", task=task.get_name(),
                            at=[f"{frame.f_code.co_filename}:{frame.f_lineno}" for frame in task.get_stack()])
        if (nc := getattr(self, "nc", None)) is not None:
            await _bounded("nats", nc.close, timeout)
        if (lease := getattr(self, "lease", None)) is not None:  # a standby takes over at once, not after its ttl
            await _bounded("lease", lease.give_up, timeout)
        pool: asyncpg.Pool | None = getattr(self, "pool", None)
        if pool is None:  # (a start cut short before it connected)
            return
        try:
            await asyncio.wait_for(pool.close(), timeout)
        except (TimeoutError, Exception):
            pool.terminate()


SLOW_STOP_SECONDS = 1.0


async def _bounded(step: str, do: Callable[[], Awaitable[object]], timeout: float) -> None:
    """One step of a shutdown, at most `timeout` seconds: one still going then is cancelled and not waited for (a
    task that goes on after its cancellation holds nothing up). Its failure is passed over, and a slow one told
    (which step held the stop up)."""
    began = time.monotonic()
    try:
        work = asyncio.ensure_future(do())
    except Exception as exc:
        log.warning("service.stop_step_failed", step=step, error=repr(exc) or type(exc).__name__, seconds=0.0)
        return
    done, _ = await asyncio.wait({work}, timeout=timeout)
    seconds = round(time.monotonic() - began, 3)
    if not done:
        work.cancel()
        work.add_done_callback(_retrieved)  # however it ends later, nothing is reported of it then
        log.warning("service.stop_step_failed", step=step, error=f"not done within {timeout} s", seconds=seconds)
        return
    error = "cancelled" if work.cancelled() else repr(work.exception()) if work.exception() is not None else None
    if error is not None:
        log.warning("service.stop_step_failed", step=step, error=error, seconds=seconds)
    elif seconds >= SLOW_STOP_SECONDS:
        log.warning("service.stop_step_slow", step=step, seconds=seconds)


def _retrieved(work: asyncio.Future[object]) -> None:
    if not work.cancelled():
        work.exception()
