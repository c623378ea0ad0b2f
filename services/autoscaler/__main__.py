"""Run the autoscaler service: `python -m services.autoscaler`."""

from __future__ import annotations

import asyncio

from libs.runtime import ServiceRuntime
from services.autoscaler.service import SERVICE, Autoscaler


async def main() -> None:
    runtime = ServiceRuntime(SERVICE)
    await runtime.start()
    await Autoscaler(runtime).start()
    await runtime.serve()


if __name__ == "__main__":
    asyncio.run(main())
