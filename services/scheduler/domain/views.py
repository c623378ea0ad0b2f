"""Read-only views the scheduler answers from its state (SPEC S7, S8, O4, M2)."""

from __future__ import annotations

from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.operations.cluster import FlavorList, NodeView
from libs.contracts.operations.jobs import DevEnvSpec
from libs.contracts.scheduling import BoardDemand, BoardUsage, FlavorFit, FlavorInfo, NodeResources
from libs.storage import workspace_layout
from services.scheduler.domain.state import Job, SchedulerState


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
    for job in state.holding():
        for node_name, held in state.holdings(job).items():
            usage.setdefault(node_name, []).append(BoardUsage(physical=held.accelerators, virtual=held.accelerators,
                                                              application=job.spec.name, job_id=job.job_id))
    rows: list[NodeResources] = []
    for name, node in sorted(state.nodes.items()):
        if not node.schedulable:
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
    nodes = [n.info for n in state.nodes.values() if n.schedulable]
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
    mounts = [ref.mount for ref in workspace_layout(spec, task_index=task, job_id=job.job_id,
                                                    attempt=max(job.attempt, 1))]
    command = spec.command if spec.type == "regular" else spec.tasks[0].command
    flavor = job.flavor or spec.flavors[0]
    return DevEnvSpec(name=f"{spec.name}-dev", project=spec.project, source_job_id=job.job_id, image=spec.image,
                      flavor=flavor, mode=spec.mode, mounts=mounts, env=dict(spec.env),
                      node_names=list(spec.node_names), pool=spec.pool, driver_version=spec.driver_version,
                      command=command)


def node_views(state: SchedulerState) -> list[NodeView]:
    """Every known node: ready, lost or unhealthy (M2, with its problems), and the jobs holding it."""
    used = state.used()
    holders: dict[str, list[str]] = {}
    for job in state.holding():
        for node_name in state.holdings(job):
            holders.setdefault(node_name, []).append(job.job_id)
    return [NodeView(info=n.info, status=n.status, used=used.get(name, Resources()),
                     jobs=holders.get(name, []), problems=n.reasons)
            for name, n in sorted(state.nodes.items())]


def status_sentence(job: Job) -> str:
    """`trainyard why` for a job that is not waiting in the queue."""
    if job.prechecking and job.precheck is not None:
        nodes = ", ".join(dict.fromkeys(p.node for p in job.precheck.placement))
        return f"Its nodes {nodes} are being pre-checked (attempt {job.precheck.attempt}); it starts when they pass."
    if job.status != "running":
        return f"It has ended: {job.status}" + (f" ({job.reason})." if job.reason else ".")
    nodes = ", ".join(sorted({p.node for p in job.placement}))
    if job.resuming is not None:
        return f"It is being stopped to resume on healthy nodes (attempt {job.attempt}): {job.resuming.reason}."
    if job.restarting is not None:
        return (f"Its attempt {job.attempt} failed and is being stopped to restart on {nodes} "
                f"(restart {job.restarting.restarts}): {job.restarting.reason}.")
    return f"It is running (attempt {job.attempt}) on {nodes}; it waits for nothing."
