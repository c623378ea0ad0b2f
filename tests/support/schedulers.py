"""Schedulers run in the test's process on real NATS and PostgreSQL (no nodes exist, so jobs stay
queued), with the tokens and specs the tests send them and a helper for refused calls."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from client.api import TrainyardClient, TrainyardError
from libs.auth import issue_token
from libs.contracts.cluster import ClusterConfig
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.scheduler.service import Scheduler
from tests.support.runtime_model import GatedModel

CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"
SECRET = "integration-tests-signing-secret-0123456789abcdef"


def token(user: str, *projects: str, admin: bool = False) -> str:
    return issue_token(SECRET, Identity(user=user, projects=list(projects or ["default"]), admin=admin))


class Schedulers:
    """Starts schedulers in this process; no nodes exist, so jobs stay queued."""

    def __init__(self, nats_url: str, database_url: str, storage: Path) -> None:
        (storage / "algorithms" / "algo").mkdir(parents=True)
        self.settings = Settings(nats_url=nats_url, database_url=database_url, storage_root=storage,
                                 auth_secret=SECRET)
        self.running: list[ServiceRuntime] = []
        self.started: list[Scheduler] = []

    async def start(self) -> None:
        runtime = ServiceRuntime("scheduler", self.settings)
        await runtime.start()
        scheduler = Scheduler(runtime, ClusterConfig.load(CLUSTER))
        await scheduler.start()
        await runtime.listen()
        self.running.append(runtime)
        self.started.append(scheduler)

    def gate_planning(self) -> GatedModel:
        """Make the latest scheduler's next prediction stop half-way through its plan until released."""
        gate = GatedModel()
        self.started[-1].predictions.runtimes = gate
        gate.armed = True
        return gate

    async def stop_all(self) -> None:
        while self.running:
            await self.running.pop().close()


def spec(name: str = "train", **changes: object) -> JobSpec:
    base = JobSpec(name=name, mode="single-node", flavors=["cpu-1"], algorithm=AlgorithmRef(name="algo"),
                   command="python3 train.py", output=OutputRef(name="out"))
    return msgspec.structs.replace(base, **changes)


# Opens a client as the named user, in the named projects (the `login` fixture).
Login = Callable[..., Awaitable[TrainyardClient]]


@contextlib.asynccontextmanager
async def logins(nats_url: str) -> AsyncIterator[Login]:
    """A `Login` on `nats_url`, whose clients are closed when the block ends."""
    clients: list[TrainyardClient] = []

    async def open_as(user: str, *projects: str, admin: bool = False) -> TrainyardClient:
        client = await TrainyardClient.open(nats_url, token=token(user, *projects, admin=admin))
        clients.append(client)
        return client

    try:
        yield open_as
    finally:
        for client in clients:
            await client.close()


async def refused(call: Awaitable[object]) -> TrainyardError:
    with pytest.raises(TrainyardError) as caught:
        await call
    return caught.value
