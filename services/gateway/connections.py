"""One NATS connection per token in use, logged in as that token's user.

The gateway holds no power of its own: each request goes to NATS on a connection that logged in with the
caller's own token (through the auth callout, libs/natsauth.py), so NATS enforces the same permissions and
inbox as for that person's CLI, and the services check the same token. A connection unused for a while is
closed; so is the least recently used one when there are too many, but never one held by a long-lived use (a
terminal's session lives on its connection's subjects).

Once made, a connection reconnects for as long as it is open (`connect_once`), however long NATS is away: a
console page or a follow stream open for hours outlives a restart of the NATS server, its subscriptions made again
on the new connection, and a request sent meanwhile goes once the server is back (or ends at its timeout). Only a
first connection fails fast, when NATS cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator

from nats.aio.client import Client

from libs.messaging.connection import NatsLogin, close_connection, connect_once

IDLE_SECONDS = 300.0
MOST_CONNECTIONS = 500


class UserConnections:
    def __init__(self, nats_url: str, *, idle_seconds: float = IDLE_SECONDS, most: int = MOST_CONNECTIONS) -> None:
        self.nats_url = nats_url
        self.idle_seconds = idle_seconds
        self.most = most
        self._open: OrderedDict[str, tuple[Client, float]] = OrderedDict()  # token digest -> connection, last use
        self._connecting: dict[str, asyncio.Lock] = {}
        self._held: Counter[str] = Counter()  # token digest -> uses that keep it open

    async def for_token(self, token: str) -> Client:
        """The connection of `token`'s user, made now if there is none or NATS closed it (raises `LoginRefused` when
        NATS refuses the token, and what nats-py raises when the server cannot be reached). One that is reconnecting
        is handed out as it is: what is sent on it goes once the server is back."""
        key = _key(token)
        async with self._connecting.setdefault(key, asyncio.Lock()):
            found = self._open.get(key)
            if found is not None and not found[0].is_closed:
                self._open[key] = (found[0], time.monotonic())
                self._open.move_to_end(key)
                return found[0]
            try:
                nc = await connect_once(self.nats_url, "trainyard-gateway", NatsLogin.for_token(token))
            except BaseException:
                self._connecting.pop(key, None)  # a refused token leaves nothing behind
                raise
            self._open[key] = (nc, time.monotonic())
        await self._trim()
        return nc

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.asynccontextmanager
    async def held(self, token: str) -> AsyncIterator[Client]:
        """The token's connection, kept open for as long as the block runs, however long it is idle."""
        nc = await self.for_token(token)
        key = _key(token)
        self._held[key] += 1
        try:
            yield nc
        finally:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    async def close_idle(self) -> None:
        """Close the connections unused for `idle_seconds` and not held."""
        now = time.monotonic()
        for key, (nc, used) in list(self._open.items()):
            if now - used > self.idle_seconds and key not in self._held:
                await self._close(key, nc)

    async def _trim(self) -> None:
        """Close the least recently used connections not held, while there are too many."""
        for key, (nc, _) in list(self._open.items()):
            if len(self._open) <= self.most:
                return
            if key not in self._held:
                await self._close(key, nc)

    async def _close(self, key: str, nc: Client) -> None:
        self._open.pop(key, None)
        self._connecting.pop(key, None)
        await close_connection(nc)  # while NATS is away too: it would otherwise reconnect for ever

    async def close(self) -> None:
        for key, (nc, _) in list(self._open.items()):
            await self._close(key, nc)


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
