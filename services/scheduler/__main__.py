"""Run the scheduler service: `python -m services.scheduler`."""

from __future__ import annotations

import asyncio

from libs.contracts.cluster import ClusterConfig
from libs.runtime import ServiceRuntime
from services.scheduler.service import SERVICE, Scheduler


async def main() -> None:
    runtime = ServiceRuntime(SERVICE)
    await runtime.start()
    await Scheduler(runtime, ClusterConfig.load(runtime.settings.cluster_config)).start()
    await runtime.serve()


if __name__ == "__main__":
    asyncio.run(main())
