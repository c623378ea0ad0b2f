"""Pre-checks (M1): before a checkpoint-resume job is admitted, every node it was placed on is checked.

A node passes when the monitor knows it, it is not lost, nothing on it is faulty (probed or marked),
and its agent, asked now, finds enough free resources for the job's ranks there and its boards and
runtime environment healthy. What the monitor already knows decides first (`plan`, under the
service lock); only the remaining nodes' agents are asked (`check_nodes`), all at once and outside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nats.aio.client import Client

from libs.contracts import subjects
from libs.contracts.agent import PrecheckNode, PrecheckReport
from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Flavor, Resources
from libs.contracts.events import ComponentMarked, JobPrechecking, Placement
from libs.contracts.health import ComponentHealth, NodeCheck
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlSigner
from libs.messaging.rpc import ServiceUnavailable, call
from services.monitor.health import faulty_components, marked_component
from services.monitor.state import MonitoredNode

AGENT_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class PrecheckPlan:
    """What each node needs (in rank order), the verdicts the monitor gives itself, the nodes' marks."""

    needed: dict[str, Resources]
    known: dict[str, NodeCheck | None]
    marks: dict[str, dict[str, ComponentMarked]]


def failed(node: str, name: str, detail: str) -> NodeCheck:
    return NodeCheck(node=node, passed=False,
                     checks=[ComponentHealth(kind="runtime", name=name, healthy=False, detail=detail)])


def demands(placement: Sequence[Placement], flavor: Flavor) -> dict[str, Resources]:
    """What the job's ranks need on each of its nodes, in placement order."""
    needed: dict[str, Resources] = {}
    for rank in sorted(placement, key=lambda p: p.rank):
        size = PARAMETER_SERVER_FLAVOR if rank.role == "ps" else flavor
        needed[rank.node] = needed.get(rank.node, Resources()) + Resources.of_flavor(size)
    return needed


def known_verdict(name: str, node: MonitoredNode | None) -> NodeCheck | None:
    """A failed check from what the monitor knows, or None when the agent must be asked."""
    if node is None:
        return failed(name, "agent", "the monitor does not know this node")
    if node.lost:
        return failed(name, "agent", "the node is lost (no heartbeats)")
    faulty = faulty_components(node.probed, node.marks, node.problems)
    return NodeCheck(node=name, passed=False, checks=faulty) if faulty else None


def plan(event: JobPrechecking, flavor: Flavor | None, nodes: Mapping[str, MonitoredNode]) -> PrecheckPlan:
    """The pre-check of a placement: `flavor` is the job's (None when the monitor does not know it)."""
    names = list(dict.fromkeys(p.node for p in sorted(event.placement, key=lambda p: p.rank)))
    if flavor is None:
        unknown = f"the monitor does not know flavor {event.flavor}"
        return PrecheckPlan(needed={n: Resources() for n in names},
                            known={n: failed(n, "flavor", unknown) for n in names}, marks={})
    return PrecheckPlan(needed=demands(event.placement, flavor),
                        known={n: known_verdict(n, nodes.get(n)) for n in names},
                        marks={n: dict(node.marks) for n in names if (node := nodes.get(n)) is not None})


def with_marks(report: PrecheckReport, name: str, marks: Mapping[str, ComponentMarked]) -> NodeCheck:
    """The agent's fresh probe, with marked components faulty whatever the probe says."""
    checks = {c.key: c for c in report.checks}
    for key, mark in marks.items():
        if mark.faulty:
            checks[key] = marked_component(mark)
    found = list(checks.values())
    return NodeCheck(node=name, passed=all(c.healthy for c in found), checks=found)


async def ask_agent(nc: Client, signer: ControlSigner, job_id: str, name: str, needed: Resources,
                    marks: Mapping[str, ComponentMarked]) -> NodeCheck:
    request = PrecheckNode(job_id=job_id, cpus=needed.cpus, memory_mib=needed.memory_mib,
                           accelerators=needed.accelerators)
    try:
        reply = await call(nc, subjects.agent_precheck(name), request, timeout=AGENT_TIMEOUT_SECONDS,
                           reply_type=PrecheckReport | CommandError, signer=signer)
    except ServiceUnavailable:
        return failed(name, "agent", f"the node agent did not answer within {AGENT_TIMEOUT_SECONDS:g}s")
    if isinstance(reply, CommandError):
        return failed(name, "agent", f"the node agent refused the pre-check: {reply.message}")
    return with_marks(reply, name, marks)


async def check_nodes(nc: Client, signer: ControlSigner, job_id: str, plan: PrecheckPlan) -> list[NodeCheck]:
    """One check per node, in the order of `plan.needed`: the known verdict, else the agent's answer."""
    async def one(name: str) -> NodeCheck:
        verdict = plan.known.get(name)
        return verdict if verdict is not None else await ask_agent(nc, signer, job_id, name, plan.needed[name],
                                                                   plan.marks.get(name, {}))
    return list(await asyncio.gather(*(one(name) for name in plan.needed)))
