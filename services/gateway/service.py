"""The gateway process: the HTTP API served by uvicorn, and the users' NATS connections behind it.

It keeps no state and no event log: every request is a user's, carried to the service that answers it. Its
address is `TRAINYARD_HTTP_ADDRESS` (default 127.0.0.1:8080).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import Generator
from typing import Self

import uvicorn

from libs.settings import Settings
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import GATEWAY_OPEN, SAMPLE_SECONDS, SampledGauge
from services.gateway.app import build_app
from services.gateway.connections import UserConnections
from services.gateway.sessions import Sessions
from services.gateway.terminal import MAX_FRAME_BYTES

log = get_logger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:8080"
IDLE_CHECK_SECONDS = 60.0


def http_address() -> tuple[str, int]:
    host, _, port = os.environ.get("TRAINYARD_HTTP_ADDRESS", DEFAULT_ADDRESS).rpartition(":")
    return host or "127.0.0.1", int(port)


class EmbeddedServer(uvicorn.Server):
    """uvicorn without signal handlers of its own: the process's entry point (libs/skeleton/entrypoint.py) takes
    SIGTERM and SIGINT and closes the gateway, as it does every service."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Gateway:
    name = "gateway"

    def __init__(self, settings: Settings, host: str, port: int) -> None:
        self.connections = UserConnections(settings.nats_url)
        self.sessions = Sessions()
        self.open_now: Counter[str] = Counter()
        app = build_app(self.connections, self.sessions, self.open_now)
        # ws_max_size: a terminal's frame past this is refused by uvicorn before it is buffered; at shutdown, open
        # follow streams are cut after timeout_graceful_shutdown rather than waited for (alerts never end).
        config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off",
                                log_level="warning", ws_max_size=2 * MAX_FRAME_BYTES, timeout_graceful_shutdown=5)
        self.server = EmbeddedServer(config)
        self.serving: asyncio.Task[None] | None = None
        self.idle: asyncio.Task[None] | None = None
        self.sampling: asyncio.Task[None] | None = None

    @classmethod
    async def started(cls) -> Self:
        host, port = http_address()
        gateway = cls(Settings(), host, port)
        await gateway.start()
        return gateway

    async def start(self) -> None:
        self.serving = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.serving.done():  # the address is taken, say
                await self.serving
                raise SystemExit(f"the gateway could not serve on {self.server.config.host}:{self.server.config.port}")
            await asyncio.sleep(0.05)
        self.idle = asyncio.create_task(self._close_idle())
        self.sampling = asyncio.create_task(self._sample())
        log.info("gateway.serving", url=f"http://{self.server.config.host}:{self.server.config.port}")

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_SECONDS)
            await self.connections.close_idle()

    async def _sample(self) -> None:
        gauge = SampledGauge(GATEWAY_OPEN)
        while True:
            gauge.set({("sessions",): len(self.sessions), ("streams",): self.open_now["streams"],
                       ("terminals",): self.open_now["terminals"], ("connections",): len(self.connections)})
            await asyncio.sleep(SAMPLE_SECONDS)

    async def stopped(self) -> None:
        assert self.serving is not None
        await asyncio.shield(self.serving)

    async def close(self) -> None:
        self.server.should_exit = True
        if self.serving is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.serving), timeout=10)
        for task in (self.idle, self.sampling):
            if task is not None:
                task.cancel()
        await self.connections.close()
