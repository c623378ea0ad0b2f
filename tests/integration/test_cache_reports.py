"""A node's cache reports at the monitor on real NATS and PostgreSQL (SPEC D1, D2, J10): a report cut short
(a cache of more entries than one report carries) records no eviction of the entries it leaves out, and the
images a node keeps unpacked are kept with its listing for `trainyard cache`.

The node's agent is played by publishing its reports on its cache subject, as the agent's reporting does."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TypeVar

import pytest
from nats.aio.client import Client

from client.api import TrainyardClient
from libs.auth import issue_node_token
from libs.contracts import subjects
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.datacache import CachedImage, CacheEntry, CacheEviction, CacheReport
from libs.contracts.events import DatasetCached, DatasetEvicted
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.cache import NodeCache
from libs.eventstore import EventStore
from libs.messaging.rpc import call
from tests.support.schedulers import SECRET, token
from tests.support.stores import StoreFactory
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


async def registered_node(nc: Client) -> str:
    """A node of its own for the test (the cache reports' stream outlives a test), registered with the monitor."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    info = NodeInfo(name=name, address="127.0.0.1", cpus=8, memory_mib=16384, os="Linux", kernel="6.1")
    reply = await call(nc, REGISTER_NODE.subject, RegisterNode(node=info), reply_type=NodeAccepted | CommandError,
                       token=issue_node_token(SECRET, name))
    assert isinstance(reply, NodeAccepted), reply
    return name


def entry(i: int) -> CacheEntry:
    return CacheEntry(key=f"{i:024x}", source=f"datasets/d{i}", bytes=10, files=1, staged_at=NOW, last_used=NOW)


async def of(store: EventStore, kind: type[T]) -> list[T]:
    return [e.event async for e in store.read_all() if isinstance(e.event, kind)]


async def at_least(store: EventStore, kind: type[T], count: int) -> list[T]:
    found = await of(store, kind)
    return found if len(found) >= count else []


async def listed(nats_url: str, node: str, *, reported: datetime) -> NodeCache | None:
    """The node's listing once it shows the report sent at `reported`."""
    async with TrainyardClient.connect(nats_url, token=token("alice")) as client:
        nodes = await client.cache(node)
    return nodes[0] if nodes and nodes[0].reported_at == reported else None


async def test_a_cut_short_report_evicts_only_what_it_tells_and_the_listing_says_it_is_cut_short(
        lone_monitor: None, nc: Client, nats_url: str, make_store: StoreFactory) -> None:
    node = await registered_node(nc)
    store = await make_store("monitor")
    js = nc.jetstream()
    a, b, c = entry(1), entry(2), entry(3)
    await js.publish(subjects.agent_cache(node), encode(CacheReport(node=node, sent_at=NOW, entries=[a, b, c],
                                                                    total_entries=3)))
    await eventually(lambda: at_least(store, DatasetCached, 3))

    # The node holds more than a report carries: b was evicted (and says so), c is merely left out.
    cut_at = datetime.now(UTC)
    told = CacheEviction(key=b.key, source=b.source, bytes=10, cause="watermark", evicted_at=NOW)
    image = CachedImage(key="5a2e07c4bd31" + "0" * 12, digest="sha256:5a2e07c4bd31" + "0" * 52, ref="team/torch:2.13",
                        format="oci-archive", bytes=3 * 2**30, unpacked_at=NOW, last_used=NOW, pins=["job-1/1/0/0"])
    await js.publish(subjects.agent_cache(node), encode(CacheReport(
        node=node, sent_at=cut_at, entries=[a], evicted=[told], total_entries=7000, images=[image])))
    shown = await eventually(lambda: listed(nats_url, node, reported=cut_at))
    assert (shown.complete, shown.total_entries, shown.entries, shown.images) == (False, 7000, [a], [image])
    [evicted] = await eventually(lambda: at_least(store, DatasetEvicted, 1))
    assert (evicted.eviction.key, evicted.eviction.cause) == (b.key, "watermark")

    # A whole report: c is gone after all.
    whole_at = datetime.now(UTC)
    await js.publish(subjects.agent_cache(node), encode(CacheReport(node=node, sent_at=whole_at, entries=[a],
                                                                    total_entries=1)))
    shown = await eventually(lambda: listed(nats_url, node, reported=whole_at))
    assert shown.complete and shown.images == []
    found = await eventually(lambda: at_least(store, DatasetEvicted, 2))
    assert [(e.eviction.key, e.eviction.cause) for e in found] == [(b.key, "watermark"), (c.key, "unreadable")]
