"""The monitor service in the test's process, on real NATS and PostgreSQL, with the local cluster."""

from __future__ import annotations

from pathlib import Path

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
