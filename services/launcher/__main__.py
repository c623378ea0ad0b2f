"""Run the launcher service: `python -m services.launcher`."""

from __future__ import annotations

import asyncio

from libs.contracts.cluster import ClusterConfig
from libs.runtime import ServiceRuntime
from services.launcher.service import SERVICE, Launcher


async def main() -> None:
    runtime = ServiceRuntime(SERVICE)
    await runtime.start()
    await Launcher(runtime, ClusterConfig.load(runtime.settings.cluster_config)).start()
    await runtime.serve()


if __name__ == "__main__":
    asyncio.run(main())
