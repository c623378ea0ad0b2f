"""Run the monitor service: `python -m services.monitor`."""

from __future__ import annotations

import asyncio

from libs.contracts.cluster import ClusterConfig
from libs.runtime import ServiceRuntime
from services.monitor.service import SERVICE, Monitor


async def main() -> None:
    runtime = ServiceRuntime(SERVICE)
    await runtime.start()
    await Monitor(runtime, ClusterConfig.load(runtime.settings.cluster_config)).start()
    await runtime.serve()


if __name__ == "__main__":
    asyncio.run(main())
