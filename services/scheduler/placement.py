"""One scheduling cycle as a pure function: a snapshot in, admissions out (SPEC S1, S4, S5, S9).

The cycle walks the queue in start order. For each job it tries its flavors in the order given
(S5: the first that fits wins) and places every node of the job at once or none (S4). A job that
cannot start blocks the jobs behind it, so a big job at the head is never starved by small ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from libs.contracts.cluster import PARAMETER_SERVER_FLAVOR, Flavor, NodeInfo, Resources
from libs.contracts.events import Placement, Role
from libs.contracts.jobspec import JobSpec


@dataclass(frozen=True)
class NodeCapacity:
    """A schedulable node and what is free on it now."""

    info: NodeInfo
    free: Resources


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    spec: JobSpec


@dataclass(frozen=True)
class Admission:
    job_id: str
    flavor: str
    placement: list[Placement]


def eligible(node: NodeInfo, spec: JobSpec, flavor: Flavor) -> bool:
    """S9: pinning, driver version and dedicated pools decide which nodes a job may use."""
    if spec.node_names and node.name not in spec.node_names:
        return False
    # Nodes of a dedicated pool serve only jobs that ask for that pool.
    if spec.pool is not None:
        if spec.pool not in node.pools:
            return False
    elif node.pools:
        return False
    if flavor.accelerators:
        if flavor.board is not None and node.board != flavor.board:
            return False
        if spec.driver_version is not None and node.driver_version != spec.driver_version:
            return False
    return True


def role_flavor(role: str, flavor: Flavor) -> Flavor:
    """What one rank of `role` holds: the job's flavor, or the fixed parameter-server flavor (J8)."""
    return PARAMETER_SERVER_FLAVOR if role == "ps" else flavor


def place_gang(spec: JobSpec, flavor: Flavor, nodes: Iterable[NodeCapacity]) -> list[Placement] | None:
    """Place all ranks of a job, or return None: `spec.nodes` workers of `flavor`, then (TensorFlow)
    `spec.parameter_servers` parameter servers.

    Each rank goes to the eligible node holding the fewest ranks of this job so far, then with the
    most free CPU left (ties by name), which spreads a job across hosts when it can and packs it when
    it must.
    """
    nodes = list(nodes)
    infos = {n.info.name: n.info for n in nodes}
    free = {n.info.name: n.free for n in nodes}
    ranks_on = dict.fromkeys(free, 0)
    parameter_servers = spec.parameter_servers if spec.mode == "tensorflow" else 0
    workers: list[Role] = ["worker"] * spec.nodes
    servers: list[Role] = ["ps"] * parameter_servers
    roles = workers + servers
    placement: list[Placement] = []
    for rank, role in enumerate(roles):
        rank_flavor = role_flavor(role, flavor)
        need = Resources.of_flavor(rank_flavor)
        candidates = [name for name, left in free.items()
                      if eligible(infos[name], spec, rank_flavor) and need.fits_in(left)]
        if not candidates:
            return None
        best = min(candidates, key=lambda name: (ranks_on[name], -free[name].cpus, -free[name].memory_mib, name))
        free[best] = free[best] - need
        ranks_on[best] += 1
        placement.append(Placement(rank=rank, node=best, address=infos[best].address, slots=rank_flavor.slots,
                                   role=role))
    return placement


def schedule(queue: list[QueuedJob], nodes: list[NodeCapacity],
             flavors: dict[str, Flavor]) -> list[Admission]:
    """Admit queued jobs, head first, until one does not fit (strict order, no backfill yet)."""
    capacity = {n.info.name: n for n in nodes}
    admissions: list[Admission] = []
    for job in queue:
        admitted = None
        for flavor_name in job.spec.flavors:
            flavor = flavors.get(flavor_name)
            if flavor is None:
                continue
            placement = place_gang(job.spec, flavor, capacity.values())
            if placement is not None:
                admitted = Admission(job_id=job.job_id, flavor=flavor_name, placement=placement)
                break
        if admitted is None:
            break
        admissions.append(admitted)
        for placed in admitted.placement:
            node = capacity[placed.node]
            need = Resources.of_flavor(role_flavor(placed.role, flavors[admitted.flavor]))
            capacity[placed.node] = NodeCapacity(info=node.info, free=node.free - need)
    return admissions
