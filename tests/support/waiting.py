"""Waiting for what a test expects to happen a moment later."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T | None]], timeout: float = 30) -> T:
    """The first truthy value `check()` gives, asked again every 50 ms; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not (value := await check()):
            await asyncio.sleep(0.05)
    return value
