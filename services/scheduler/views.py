"""Read-only views the scheduler answers from its state (SPEC S7, S8, O4)."""

from __future__ import annotations

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.messages import DevEnvSpec, FlavorList
from libs.contracts.scheduling import BoardDemand, BoardUsage, FlavorFit, FlavorInfo, NodeResources
from libs.storage import workspace_layout
from services.scheduler.state import Job, SchedulerState


def applies_to(flavor: Flavor, node: NodeInfo) -> bool:
    """A flavor applies to a node when one rank of it fits in the node's totals and the boards match."""
    if flavor.accelerators and flavor.board is not None and node.board != flavor.board:
        return False
    return Resources.of_flavor(flavor).fits_in(Resources.of_node(node))


def node_resources(state: SchedulerState, flavor_names: list[str]) -> list[NodeResources]:
    """S7: every schedulable node that one of `flavor_names` applies to, with usage per application."""
    flavors = [f for f in state.cluster.flavors if f.name in flavor_names]
    used = state.used()
    usage: dict[str, list[BoardUsage]] = {}
    for job in state.running():
        for node_name, held in state.holdings(job).items():
            usage.setdefault(node_name, []).append(BoardUsage(physical=held.accelerators, virtual=held.accelerators,
                                                              application=job.spec.name, job_id=job.job_id))
    rows: list[NodeResources] = []
    for name, node in sorted(state.nodes.items()):
        if node.lost:
            continue
        fitting = [f for f in flavors if applies_to(f, node.info)]
        if not fitting:
            continue
        total = Resources.of_node(node.info)
        held = used.get(name, Resources())
        free = total - held
        status: dict[str, FlavorFit] = {
            f.name: "idle" if Resources.of_flavor(f).fits_in(free) else "tight" for f in fitting}
        rows.append(NodeResources(
            name=name, status=status, os=node.info.os, kernel=node.info.kernel,
            cpus_used=held.cpus, cpus_total=total.cpus, memory_mib_used=held.memory_mib,
            memory_mib_total=total.memory_mib, accelerators_used=held.accelerators,
            accelerators_total=total.accelerators, board=node.info.board, driver_version=node.info.driver_version,
            flavors=[f.name for f in state.cluster.flavors if applies_to(f, node.info)],
            usage=usage.get(name, []),
        ))
    return rows


def flavor_list(state: SchedulerState, board: str | None) -> FlavorList:
    """S8: flavors (of one board model, if given) and the boards of each model queued jobs need.

    A queued job counts for the first of its flavors that has boards: that is the one it would take
    if every flavor were free (S5 tries them in order).
    """
    nodes = [n.info for n in state.nodes.values() if not n.lost]
    flavors = [f for f in state.cluster.flavors if board is None or f.board == board]
    infos = [FlavorInfo(flavor=f, schedulable_nodes=sum(applies_to(f, n) for n in nodes)) for f in flavors]
    needed: dict[str, int] = {}
    jobs: dict[str, int] = {}
    for job in state.queue():
        flavor = next((f for name in job.spec.flavors if (f := state.flavor(name)) and f.accelerators and f.board),
                      None)
        if flavor is None or flavor.board is None or (board is not None and flavor.board != board):
            continue
        needed[flavor.board] = needed.get(flavor.board, 0) + flavor.accelerators * job.spec.nodes
        jobs[flavor.board] = jobs.get(flavor.board, 0) + 1
    demand = [BoardDemand(board=b, boards_needed=needed[b], queued_jobs=jobs[b]) for b in sorted(needed)]
    return FlavorList(flavors=infos, demand=demand)


def dev_env(job: Job) -> DevEnvSpec:
    """O4: a development environment that looks like one node of the job (rank 0, first task)."""
    spec = job.spec
    task = 0 if spec.type == "batch" else None
    mounts = [ref.mount for ref in workspace_layout(spec, task_index=task)]
    command = spec.command if spec.type == "regular" else spec.tasks[0].command
    flavor = job.flavor or spec.flavors[0]
    return DevEnvSpec(name=f"{spec.name}-dev", project=spec.project, source_job_id=job.job_id, image=spec.image,
                      flavor=flavor, mode=spec.mode, mounts=mounts, env=dict(spec.env),
                      node_names=list(spec.node_names), pool=spec.pool, driver_version=spec.driver_version,
                      command=command)

