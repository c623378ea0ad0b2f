"""The monitor service in the test's process, on real NATS and PostgreSQL, with the local cluster."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from libs.contracts.cluster import ClusterConfig
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.monitor.service import Monitor

CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "local" / "cluster.yaml"


async def start_monitor(settings: Settings) -> tuple[ServiceRuntime, Monitor]:
    """A started monitor, answering and caught up with what it follows; close its runtime to stop it."""
    runtime = ServiceRuntime("monitor", settings)
    await runtime.start()
    monitor = Monitor(runtime, ClusterConfig.load(CLUSTER))
    await monitor.start()
    await runtime.listen()
    await monitor.caught_up()
    return runtime, monitor


def unstarted_monitor(*, smtp_url: str | None = "smtp://127.0.0.1:2525") -> Monitor:
    """A monitor not started (no connection): only what it folds and holds is looked at."""
    settings = Settings(nats_url="nats://127.0.0.1:4222", database_url="postgresql://unused",
                        auth_secret="unit-tests-signing-secret-0123456789abcdef", smtp_url=smtp_url,
                        alert_emails=("ops@example.com",))
    runtime: Any = types.SimpleNamespace(settings=settings, nc=None, js=None, store=None)
    return Monitor(runtime, ClusterConfig.load(CLUSTER))
