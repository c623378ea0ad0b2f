"""`round_trip` on real NATS: the PONG that ends it answers a PING sent after every command queued
before the call, so a subscription just made is held by the server when it returns. The bytes the
client writes are recorded by a relay between it and the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import nats
import pytest
import pytest_asyncio

from libs.messaging.connection import round_trip

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Relay:
    """A TCP relay to the NATS server that keeps what the client sent."""

    def __init__(self, upstream: str) -> None:
        address = urlparse(upstream)
        self.host, self.port = address.hostname or "127.0.0.1", address.port or 4222
        self.sent = bytearray()
        self._pipes: list[asyncio.Task[None]] = []

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if keep:
                    self.sent += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(self.host, self.port)
        self._pipes += [asyncio.create_task(self._pipe(client_reader, server_writer, keep=True)),
                        asyncio.create_task(self._pipe(server_reader, client_writer, keep=False))]

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


@pytest_asyncio.fixture(loop_scope="session")
async def relay(nats_url: str) -> AsyncIterator[tuple[Relay, str]]:
    relay = Relay(nats_url)
    url = await relay.start()
    yield relay, url
    await relay.close()


async def test_a_round_trip_ends_with_a_ping_sent_after_the_subscription(relay: tuple[Relay, str]) -> None:
    recorder, url = relay
    nc = await nats.connect(url)
    try:
        await nc.subscribe("trainyard.test.round-trip")
        await round_trip(nc)
        sent = bytes(recorder.sent)
        assert b"SUB trainyard.test.round-trip" in sent
        assert sent.rindex(b"PING") > sent.index(b"SUB trainyard.test.round-trip")
    finally:
        await nc.close()


async def test_a_subscription_hears_the_first_message_another_connection_sends_after_a_round_trip(
        nats_url: str) -> None:
    listener, speaker = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        for attempt in range(20):
            subject = f"trainyard.test.round-trip.{attempt}"
            sub = await listener.subscribe(subject)
            await round_trip(listener)
            await speaker.publish(subject, b"first")
            # One sent before the subscription took hold is never delivered: no wait, however long, hides that.
            assert (await sub.next_msg(timeout=30)).data == b"first"
    finally:
        await listener.close()
        await speaker.close()
