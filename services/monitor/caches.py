"""The nodes' dataset caches (SPEC D1, D2) and image caches (J10): `trainyard cache`, and preloads carried out.

Reports come whole (a cache of more entries than one report carries sends its most recently used ones, and
says so), so the latest one per node is the view; a node retired since is left out. A preload the scheduler
recorded is carried out by asking each of its nodes' agents to copy the dataset (signed by the monitor); the
copies then show in the nodes' reports. A job with data preparation that has to wait is warmed up the same
way: its datasets are copied onto the nodes it is predicted to start on, so it starts with them in the cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.agent import StageAccepted, StageDataset
from libs.contracts.datacache import CacheReport
from libs.contracts.events import JobPredicted
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.cache import CacheListing, NodeCache
from libs.controlsign import ControlSigner
from libs.messaging.rpc import ServiceUnavailable, call
from libs.storage import staged_sources
from libs.telemetry.logs import get_logger
from services.monitor.state import MonitoredNode

log = get_logger(__name__)
AGENT_TIMEOUT_SECONDS = 10.0


def listing(reports: Mapping[str, CacheReport], nodes: Mapping[str, MonitoredNode],
            node: str | None = None) -> CacheListing:
    """Each node's latest report: its dataset cache (said to be cut short when it is) and its unpacked images."""
    shown = [report for name, report in sorted(reports.items()) if name in nodes and node in (None, name)]
    return CacheListing(nodes=[NodeCache(node=r.node, reported_at=r.sent_at, entries=list(r.entries),
                                         disk_bytes=r.disk_bytes, used_bytes=r.used_bytes, copying=list(r.copying),
                                         failures=list(r.failures), complete=r.complete,
                                         total_entries=r.total_entries, images=list(r.images)) for r in shown])


def warm_ups(event: JobPredicted, spec: JobSpec | None) -> list[tuple[str, str]]:
    """D1: (node, dataset folder) to copy for a job predicted to wait: its staged datasets, onto the nodes
    it is predicted to start on."""
    if spec is None or not spec.data_preparation or event.prediction.starts_now:
        return []
    sources = staged_sources(spec)
    return [(node, source) for node in dict.fromkeys(event.prediction.nodes) for source in sources]


async def stage_on(nc: Client, signer: ControlSigner, preload_id: str, copies: list[tuple[str, str]]) -> None:
    """Ask each node's agent to copy its dataset; a node that does not take it is logged (its cache report
    never shows the copy, which `trainyard cache preload` tells the user)."""
    async def one(node: str, source: str) -> None:
        try:
            reply = await call(nc, subjects.agent_stage(node), StageDataset(preload_id=preload_id, source=source),
                               timeout=AGENT_TIMEOUT_SECONDS, reply_type=StageAccepted | CommandError, signer=signer)
        except (ServiceUnavailable, OSError, nats.errors.Error) as exc:  # NATS away: the node is left out
            log.warning("cache.preload_unanswered", node=node, source=source, preload_id=preload_id, error=str(exc))
            return
        if isinstance(reply, CommandError):
            log.warning("cache.preload_refused", node=node, source=source, preload_id=preload_id,
                        error=reply.message)
    await asyncio.gather(*(one(node, source) for node, source in copies))
