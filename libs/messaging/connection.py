"""Connecting to NATS and declaring the JetStream streams every process relies on."""

from __future__ import annotations

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from libs.contracts import subjects

DAY = 86400.0

# Every stream drops messages re-published within two minutes with the same Nats-Msg-Id.
STREAMS: tuple[StreamConfig, ...] = (
    StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0),
    StreamConfig(name=subjects.AGENT_REPORTS_STREAM, subjects=[subjects.AGENT_REPORTS_ALL],
                 storage=StorageType.FILE, duplicate_window=120.0),
    StreamConfig(name=subjects.LOGS_STREAM, subjects=[subjects.LOGS_ALL], storage=StorageType.FILE,
                 duplicate_window=120.0, max_age=7 * DAY, max_bytes=8 * 1024**3, discard=DiscardPolicy.OLD),
)


async def connect(url: str, name: str) -> Client:
    """A connection that keeps reconnecting for as long as the process lives (services, agents)."""
    return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                              connect_timeout=5)


async def _quiet(_: Exception) -> None:
    """Connection errors surface as the exception connect_once raises, not as logged tracebacks."""


async def connect_once(url: str, name: str) -> Client:
    """A client's connection: fails fast when the server is not there, reconnects a while after."""
    return await nats.connect(url, name=name, allow_reconnect=True, max_reconnect_attempts=3,
                              reconnect_time_wait=0.5, connect_timeout=3, error_cb=_quiet)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create or update the streams and buckets; safe to call from every process at start-up."""
    for config in STREAMS:
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    # Usage is a current value, not history: one entry per key, gone a day after the last sample.
    await js.create_key_value(KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1, ttl=DAY))
