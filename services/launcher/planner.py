"""Launch planning as pure functions: (job spec, placement) -> what every node runs (SPEC L1–L7).

`plan_shape` records once per attempt what every node's launch follows from: where each rank runs (with
its rendezvous port) and what all ranks share (env, each task's command and mounts, image, user). `NodeLaunches`
derives one node's launch from it when the node is started: the argv, the environment the distributed
mode expects, the files it expects (hostfiles) and the storage mounts that make up its /workspace; a
checkpoint-resume job (J12) also its checkpoint signal, folder and resume count. What all nodes share
(hostfiles, TF_CONFIG's cluster) is worked out once per attempt, so starting n nodes costs O(n) each and
nothing is ever held n times. The formats follow the platform document to the character; tests compare
them with its examples.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from functools import cached_property

from libs.contracts.cluster import Flavor
from libs.contracts.events import (
    LaunchHost,
    LaunchPlanned,
    LaunchShape,
    LaunchTask,
    NodeLaunch,
    Placement,
    Role,
    launched_role,
)
from libs.contracts.health import (
    CHECKPOINT_DIR,
    CHECKPOINT_DIR_VARIABLE,
    CHECKPOINT_SIGNAL,
    CHECKPOINT_SIGNAL_VARIABLE,
    RESUME_COUNT_VARIABLE,
)
from libs.contracts.images import ImageUse
from libs.contracts.jobspec import JobSpec
from libs.storage import workspace_mounts

MPI_HOSTFILE = "/etc/mpi/hostfile"
MPICH_HOSTFILE = "/etc/mpi/mpich_hostfile"
DEEPSPEED_HOSTFILE = "/job/hostfile"
# mpirun reaches the other nodes through their agents, not ssh (see agent/rsh.py).
MPI_REMOTE_SHELL = "python3 -m agent.rsh"
STANDBY = ("sleep", "infinity")
MPIRUN_PREFIX = ("mpirun --allow-run-as-root -np {np} -bind-to none -map-by slot -x NCCL_DEBUG=INFO "
                 "-x LD_LIBRARY_PATH -x PATH -mca pml ob1 -mca btl ^openib")
# "Contains mpirun" (L2): as a word, also as a path (/usr/bin/mpirun) or inside `bash -c "..."`.
_MPIRUN = re.compile(r"(?<![\w.-])mpirun(?![\w-])")


def hostfile_openmpi(hosts: Sequence[Placement | LaunchHost]) -> str:
    return "".join(f"{p.node} slots={p.slots}\n" for p in hosts)


def hostfile_mpich(hosts: Sequence[Placement | LaunchHost]) -> str:
    return "".join(f"{p.node}:{p.slots}\n" for p in hosts)


def listening_ranks(spec: JobSpec, placement: list[Placement]) -> list[int]:
    """The ranks that listen on a rendezvous port of their own node: PyTorch's and DeepSpeed's master
    (MASTER_PORT), every TensorFlow task (TF_CONFIG). mpirun chooses its own ports; a single node needs none."""
    if spec.mode in ("pytorch", "pytorch-deepspeed"):
        return [placement[0].rank]
    if spec.mode == "tensorflow":
        return [place.rank for place in placement]
    return []


def ports_wanted(spec: JobSpec, placement: list[Placement]) -> dict[str, int]:
    """How many rendezvous ports each node of the placement must choose."""
    listening = set(listening_ranks(spec, placement))
    wanted: dict[str, int] = {}
    for place in placement:
        if place.rank in listening:
            wanted[place.node] = wanted.get(place.node, 0) + 1
    return wanted


def tf_config(hosts: Sequence[Placement | LaunchHost], rank: int, ports: Mapping[int, int]) -> str:
    """L3: the cluster (workers, and parameter servers when there are any) and this node's task.

    Every task listens on the port its node chose for it (`ports`, by rank).
    """
    return TfCluster(hosts, ports).config(rank)


class TfCluster:
    """L3's TF_CONFIG of every rank of one placement: the cluster part, the same for all, encoded once."""

    def __init__(self, hosts: Sequence[Placement | LaunchHost], ports: Mapping[int, int]) -> None:
        by_role: dict[str, list[str]] = {"ps": [], "worker": []}
        self.tasks: list[tuple[str, int]] = []  # per rank: its task type and index within the type
        for rank, place in enumerate(hosts):
            self.tasks.append((place.role, len(by_role[place.role])))
            by_role[place.role].append(f"{place.address}:{ports[rank]}")
        self.cluster = json.dumps({role: by_role[role] for role in ("ps", "worker") if by_role[role]})

    def config(self, rank: int) -> str:
        # What json.dumps of {"cluster", "task", "environment"} writes, the cluster's text made once for all ranks.
        kind, index = self.tasks[rank]
        task = json.dumps({"type": kind, "index": index})
        return f'{{"cluster": {self.cluster}, "task": {task}, "environment": "cloud"}}'


def pytorch_argv(argv: list[str], command: str, *, slots: int, nodes: int, rank: int,
                 master_addr: str, master_port: int) -> list[str]:
    """L4: wrap `python[3] script ...` in torch.distributed.launch; leave anything else alone."""
    if argv[0] not in ("python", "python3") or "torch.distributed.launch" in command:
        return argv
    # The seed's master uses localhost: the rendezvous store runs on the master itself.
    address = "localhost" if rank == 0 else master_addr
    return [argv[0], "-m", "torch.distributed.launch", f"--nproc_per_node={slots}", f"--nnodes={nodes}",
            f"--node_rank={rank}", f"--master_addr={address}", f"--master_port={master_port}", *argv[1:]]


def lifecycle_wrapper(spec: JobSpec) -> list[str]:
    """J18: what runs the command between the job's lifecycle scripts, before its argv (see
    agent/ranks/lifecycle_scripts.py); none without scripts."""
    scripts = spec.lifecycle
    if scripts is None or not (scripts.before_start or scripts.after_end):
        return []
    wrapper = ["python3", "-m", "agent.lifecycle"]
    if scripts.before_start:
        wrapper += ["--before-start", scripts.before_start]
    if scripts.after_end:
        wrapper += ["--after-end", scripts.after_end]
    return [*wrapper, "--"]


def checkpoint_env(resumes: int) -> dict[str, str]:
    """J12: how a checkpoint-resume job learns its signal, its checkpoint folder and how often it resumed."""
    return {CHECKPOINT_SIGNAL_VARIABLE: CHECKPOINT_SIGNAL, CHECKPOINT_DIR_VARIABLE: CHECKPOINT_DIR,
            RESUME_COUNT_VARIABLE: str(resumes)}


Unit = tuple[int, int]
"""(task, rank): one process group of a launch. A regular job has task 0 only."""


def plan_shape(spec: JobSpec, flavor: Flavor, placement: list[Placement], *, ports: Mapping[int, int],
               job_id: str | None = None, attempt: int = 1, resumes: int = 0, image: ImageUse | None = None,
               run_as: int | None = None) -> LaunchShape:
    """What every node's launch follows from: for a regular job one task, for a batch job (J3) one per task, run
    one after another on the same nodes (sharing the ranks' `ports`, one for each of `listening_ranks`). A
    checkpoint-resume job (J12) also gets its checkpoint folder, which needs its `job_id` and `attempt`, and
    `resumes`, its resumes so far. Every node runs in `image`, when given (J10), as the user `run_as` (L1)."""
    if spec.checkpoint_resume is not None and job_id is None:
        raise ValueError("a checkpoint-resume job's launch needs its job id (for its checkpoint folder)")
    listening = listening_ranks(spec, placement)
    missing = [rank for rank in listening if rank not in ports]
    if missing:
        raise ValueError(f"ranks {missing} listen for the rendezvous and need a port")
    if spec.type == "batch":
        tasks = [LaunchTask(command=task.command, mounts=workspace_mounts(spec, task_index=index, job_id=job_id,
                                                                          attempt=attempt))
                 for index, task in enumerate(spec.tasks)]
    else:
        assert spec.command is not None
        tasks = [LaunchTask(command=spec.command, mounts=workspace_mounts(spec, job_id=job_id, attempt=attempt))]
    env = dict(spec.env)
    if spec.checkpoint_resume is not None:
        env.update(checkpoint_env(resumes))
    hosts = [LaunchHost(place.node, place.address, place.slots, place.role,
                        ports[place.rank] if place.rank in listening else 0) for place in placement]
    return LaunchShape(hosts=hosts, slots=flavor.slots, env=env, tasks=tasks, wrapper=lifecycle_wrapper(spec),
                       # J15: an abnormal end leaves the environment for the debug terminal.
                       keep_workspace=spec.debug_terminal is not None and spec.debug_terminal.enabled,
                       image=image, run_as=run_as)


def plan_launch(spec: JobSpec, flavor: Flavor, placement: list[Placement], *, ports: Mapping[int, int],
                job_id: str | None = None, attempt: int = 1, resumes: int = 0,
                image: ImageUse | None = None, run_as: int | None = None) -> list[NodeLaunch]:
    """Every node's launch, task by task (see `plan_shape`): what the nodes are started with, all at once."""
    shape = plan_shape(spec, flavor, placement, ports=ports, job_id=job_id, attempt=attempt, resumes=resumes,
                       image=image, run_as=run_as)
    return NodeLaunches(spec.mode, shape).every()


class NodeLaunches:
    """Every node's launch of one attempt, each derived when asked for from the attempt's shape, or looked up in
    a plan recorded before shapes (every node's launch in full)."""

    def __init__(self, mode: str, shape: LaunchShape | None, recorded: Sequence[NodeLaunch] = ()) -> None:
        self.mode = mode
        self.shape = shape
        self._recorded = {(n.task, n.rank): n for n in recorded}
        if shape is not None:
            self.units: list[Unit] = [(task, rank) for task in range(len(shape.tasks))
                                      for rank in range(len(shape.hosts))]
            self.placed: dict[Unit, tuple[str, Role]] = {
                unit: (shape.hosts[unit[1]].node, launched_role(mode, unit[1], shape.hosts[unit[1]].role))
                for unit in self.units}
        else:
            self.units = list(self._recorded)
            self.placed = {unit: (n.node, n.role) for unit, n in self._recorded.items()}

    @classmethod
    def of(cls, planned: LaunchPlanned) -> NodeLaunches:
        return cls(planned.mode, planned.shape, planned.nodes)

    def every(self) -> list[NodeLaunch]:
        """Every unit's launch, task by task (what the nodes of a small job are started with, for a look)."""
        return [self.launch(unit) for unit in self.units]

    def launch(self, unit: Unit) -> NodeLaunch:
        """What the node of `unit` (task, rank) is started with."""
        if self.shape is None:
            return self._recorded[unit]
        task, rank = unit
        shape, host = self.shape, self.shape.hosts[rank]
        argv, command = self._argv[task]
        env = dict(shape.env)
        files: dict[str, str] = {}
        nodes = len(shape.hosts)
        if self.mode in ("pytorch", "pytorch-deepspeed"):
            master = shape.hosts[0]
            env.update(MASTER_ADDR=master.address, MASTER_PORT=str(master.port), WORLD_SIZE=str(nodes),
                       RANK=str(rank), SLOTS=str(shape.slots))
            if self.mode == "pytorch":
                argv = pytorch_argv(argv, command, slots=shape.slots, nodes=nodes, rank=rank,
                                    master_addr=master.address, master_port=master.port)
            else:
                files[DEEPSPEED_HOSTFILE] = self._openmpi_hostfile
        elif self.mode == "horovod":
            env.update(OMPI_MCA_orte_default_hostfile=MPI_HOSTFILE, HYDRA_HOST_FILE=MPICH_HOSTFILE,
                       HYDRA_IFACE="eth0", OMPI_MCA_plm_rsh_agent=MPI_REMOTE_SHELL,
                       # Daemons started through agents talk to mpirun directly, not along a tree.
                       OMPI_MCA_routed="direct")
            files[MPI_HOSTFILE] = self._openmpi_hostfile
            files[MPICH_HOSTFILE] = self._mpich_hostfile
            if not _MPIRUN.search(command):
                argv = [*shlex.split(MPIRUN_PREFIX.format(np=nodes * shape.slots)), *argv]
            if rank > 0:
                argv = list(STANDBY)  # the master's mpirun starts the processes of every node
        elif self.mode == "tensorflow":
            env["TF_CONFIG"] = self._tf_cluster.config(rank)
        return NodeLaunch(rank=rank, node=host.node, address=host.address, argv=[*shape.wrapper, *argv], env=env,
                          mounts=shape.tasks[task].mounts, files=files, master=rank == 0,
                          role=launched_role(self.mode, rank, host.role), task=task,
                          keep_workspace=shape.keep_workspace, port=host.port, image=shape.image,
                          run_as=shape.run_as)

    # What every node of the attempt shares, worked out once.

    @cached_property
    def _argv(self) -> list[tuple[list[str], str]]:
        """Each task's argv and command; a backslash-newline continues the line, as in the platform document's
        multi-line examples."""
        assert self.shape is not None
        commands = [re.sub(r"\\\r?\n", "", task.command) for task in self.shape.tasks]
        return [(shlex.split(command), command) for command in commands]

    @cached_property
    def _openmpi_hostfile(self) -> str:
        assert self.shape is not None
        return hostfile_openmpi(self.shape.hosts)

    @cached_property
    def _mpich_hostfile(self) -> str:
        assert self.shape is not None
        return hostfile_mpich(self.shape.hosts)

    @cached_property
    def _tf_cluster(self) -> TfCluster:
        assert self.shape is not None
        return TfCluster(self.shape.hosts, {rank: host.port for rank, host in enumerate(self.shape.hosts)})
