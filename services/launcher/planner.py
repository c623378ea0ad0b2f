"""Launch planning as a pure function: (job spec, placement) -> what every node runs (SPEC L1–L7).

For each rank the plan gives the argv, the environment the distributed mode expects, the files it
expects (hostfiles), and the storage mounts that make up its /workspace; a checkpoint-resume job
(J12) also its checkpoint signal, folder and resume count. The formats follow the
platform document to the character; tests compare them with its examples.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping

import msgspec

from libs.contracts.cluster import Flavor
from libs.contracts.events import Mount, NodeLaunch, Placement, Role
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


def hostfile_openmpi(placement: list[Placement]) -> str:
    return "".join(f"{p.node} slots={p.slots}\n" for p in placement)


def hostfile_mpich(placement: list[Placement]) -> str:
    return "".join(f"{p.node}:{p.slots}\n" for p in placement)


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


def tf_config(placement: list[Placement], rank: int, ports: Mapping[int, int]) -> str:
    """L3: the cluster (workers, and parameter servers when there are any) and this node's task.

    Every task listens on the port its node chose for it (`ports`, by rank).
    """
    hosts: dict[str, list[str]] = {"ps": [], "worker": []}
    for place in placement:
        hosts[place.role].append(f"{place.address}:{ports[place.rank]}")
    cluster = {role: hosts[role] for role in ("ps", "worker") if hosts[role]}
    me = placement[rank]
    index = sum(1 for p in placement[:rank] if p.role == me.role)
    return json.dumps({"cluster": cluster, "task": {"type": me.role, "index": index}, "environment": "cloud"})


def pytorch_argv(argv: list[str], command: str, *, slots: int, nodes: int, rank: int,
                 master_addr: str, master_port: int) -> list[str]:
    """L4: wrap `python[3] script ...` in torch.distributed.launch; leave anything else alone."""
    if argv[0] not in ("python", "python3") or "torch.distributed.launch" in command:
        return argv
    # The seed's master uses localhost: the rendezvous store runs on the master itself.
    address = "localhost" if rank == 0 else master_addr
    return [argv[0], "-m", "torch.distributed.launch", f"--nproc_per_node={slots}", f"--nnodes={nodes}",
            f"--node_rank={rank}", f"--master_addr={address}", f"--master_port={master_port}", *argv[1:]]


def with_lifecycle(spec: JobSpec, argv: list[str]) -> list[str]:
    """J18: run the command between the job's lifecycle scripts (see agent/ranks/lifecycle_scripts.py)."""
    scripts = spec.lifecycle
    if scripts is None or not (scripts.before_start or scripts.after_end):
        return argv
    wrapper = ["python3", "-m", "agent.lifecycle"]
    if scripts.before_start:
        wrapper += ["--before-start", scripts.before_start]
    if scripts.after_end:
        wrapper += ["--after-end", scripts.after_end]
    return [*wrapper, "--", *argv]


def checkpoint_env(resumes: int) -> dict[str, str]:
    """J12: how a checkpoint-resume job learns its signal, its checkpoint folder and how often it resumed."""
    return {CHECKPOINT_SIGNAL_VARIABLE: CHECKPOINT_SIGNAL, CHECKPOINT_DIR_VARIABLE: CHECKPOINT_DIR,
            RESUME_COUNT_VARIABLE: str(resumes)}


def plan_launch(spec: JobSpec, flavor: Flavor, placement: list[Placement], *, ports: Mapping[int, int],
                job_id: str | None = None, attempt: int = 1, resumes: int = 0,
                image: ImageUse | None = None, run_as: int | None = None) -> list[NodeLaunch]:
    """Every node's launch: for a regular job one per rank; for a batch job (J3) one per rank and
    task, the tasks to run one after another on the same nodes (sharing the ranks' `ports`, one for each
    of `listening_ranks`). A checkpoint-resume job (J12) also gets its checkpoint folder, which needs its
    `job_id` and `attempt`, and `resumes`, its resumes so far. Every node runs in `image`, when given (J10), as
    the user `run_as` (L1)."""
    if spec.checkpoint_resume is not None and job_id is None:
        raise ValueError("a checkpoint-resume job's launch needs its job id (for its checkpoint folder)")
    missing = [rank for rank in listening_ranks(spec, placement) if rank not in ports]
    if missing:
        raise ValueError(f"ranks {missing} listen for the rendezvous and need a port")
    launches = _plan_all(spec, flavor, placement, ports, job_id=job_id, attempt=attempt, resumes=resumes)
    if image is None and run_as is None:
        return launches
    return [msgspec.structs.replace(launch, image=image, run_as=run_as) for launch in launches]


def _plan_all(spec: JobSpec, flavor: Flavor, placement: list[Placement], ports: Mapping[int, int], *,
              job_id: str | None, attempt: int, resumes: int) -> list[NodeLaunch]:
    if spec.type == "batch":
        return [launch for index, task in enumerate(spec.tasks)
                for launch in _plan_command(spec, task.command, flavor, placement, ports, task=index,
                                            mounts=workspace_mounts(spec, task_index=index, job_id=job_id,
                                                                    attempt=attempt),
                                            resumes=resumes)]
    assert spec.command is not None
    return _plan_command(spec, spec.command, flavor, placement, ports, task=0,
                         mounts=workspace_mounts(spec, job_id=job_id, attempt=attempt), resumes=resumes)


def _plan_command(spec: JobSpec, command: str, flavor: Flavor, placement: list[Placement], ports: Mapping[int, int],
                  *, task: int, mounts: list[Mount], resumes: int) -> list[NodeLaunch]:
    # A backslash-newline continues the line, as in the platform document's multi-line examples.
    command = re.sub(r"\\\r?\n", "", command)
    argv = shlex.split(command)
    nodes = len(placement)
    master = placement[0]
    # J15: an abnormal end leaves the environment for the debug terminal.
    keep_workspace = spec.debug_terminal is not None and spec.debug_terminal.enabled
    listening = listening_ranks(spec, placement)
    launches: list[NodeLaunch] = []
    for place in placement:
        env = dict(spec.env)
        if spec.checkpoint_resume is not None:
            env.update(checkpoint_env(resumes))
        files: dict[str, str] = {}
        node_argv = argv
        role: Role = place.role
        if spec.mode in ("pytorch", "pytorch-deepspeed"):
            master_port = ports[master.rank]
            env.update(MASTER_ADDR=master.address, MASTER_PORT=str(master_port), WORLD_SIZE=str(nodes),
                       RANK=str(place.rank), SLOTS=str(flavor.slots))
            if spec.mode == "pytorch":
                node_argv = pytorch_argv(argv, command, slots=flavor.slots, nodes=nodes, rank=place.rank,
                                         master_addr=master.address, master_port=master_port)
            else:
                files[DEEPSPEED_HOSTFILE] = hostfile_openmpi(placement)
        elif spec.mode == "horovod":
            env.update(OMPI_MCA_orte_default_hostfile=MPI_HOSTFILE, HYDRA_HOST_FILE=MPICH_HOSTFILE,
                       HYDRA_IFACE="eth0", OMPI_MCA_plm_rsh_agent=MPI_REMOTE_SHELL,
                       # Daemons started through agents talk to mpirun directly, not along a tree.
                       OMPI_MCA_routed="direct")
            files[MPI_HOSTFILE] = hostfile_openmpi(placement)
            files[MPICH_HOSTFILE] = hostfile_mpich(placement)
            if not _MPIRUN.search(command):
                node_argv = [*shlex.split(MPIRUN_PREFIX.format(np=nodes * flavor.slots)), *argv]
            if place.rank > 0:
                # The master's mpirun starts the processes of every node; the others hold their node.
                node_argv, role = list(STANDBY), "standby"
        elif spec.mode == "tensorflow":
            env["TF_CONFIG"] = tf_config(placement, place.rank, ports)
        node_argv = with_lifecycle(spec, node_argv)
        launches.append(NodeLaunch(rank=place.rank, node=place.node, address=place.address, argv=node_argv,
                                   env=env, mounts=mounts, files=files, master=place.rank == 0, role=role,
                                   task=task, keep_workspace=keep_workspace,
                                   port=ports[place.rank] if place.rank in listening else 0))
    return launches
