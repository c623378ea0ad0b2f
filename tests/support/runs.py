"""Waiting for a job's run as the monitor records it: its life follows the launcher's and the scheduler's
events, which the monitor reads on its own, a moment after the job's end is known."""

from __future__ import annotations

import asyncio

from client.api import TrainyardClient
from libs.contracts.operations.runs import RunView


async def finished_run(api: TrainyardClient, job_id: str, timeout: float = 90) -> RunView:
    async with asyncio.timeout(timeout):
        while (run := await api.run(job_id)).state != "finished":
            await asyncio.sleep(0.2)
    return run
