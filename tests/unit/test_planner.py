"""Launch planning (SPEC L1–L7), checked against the examples of the platform document."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from libs.contracts.cluster import Flavor
from libs.contracts.events import Mount, NodeLaunch, Placement
from libs.contracts.jobspec import (
    AlgorithmRef,
    AnnotationDatasetRef,
    BatchTask,
    CheckpointResume,
    DatasetRef,
    DebugTerminal,
    JobSpec,
    ModelRef,
    OutputRef,
    VolumeRef,
)
from libs.storage import workspace_mounts
from services.launcher.planner import (
    DEEPSPEED_HOSTFILE,
    MPI_HOSTFILE,
    MPICH_HOSTFILE,
    hostfile_mpich,
    hostfile_openmpi,
    plan_launch,
    tf_config,
)

GPU4 = Flavor(name="gpu-4", cpus=16, memory_mib=65536, accelerators=4, board="A100")
CPU = Flavor(name="cpu-8", cpus=8, memory_mib=16384)
SEED_COMMAND = "python /workspace/algorithm/train.py"
MPIRUN_PREFIX = ("mpirun --allow-run-as-root -np {np} -bind-to none -map-by slot -x NCCL_DEBUG=INFO "
                 "-x LD_LIBRARY_PATH -x PATH -mca pml ob1 -mca btl ^openib")


def job(mode: str, nodes: int = 2, command: str = SEED_COMMAND, **extra: Any) -> JobSpec:
    return JobSpec(name="train", mode=mode, nodes=nodes, flavors=["gpu-4"], algorithm=AlgorithmRef(name="code"),  # type: ignore[arg-type]
                   command=command, output=OutputRef(name="out"), **extra)


def servers(count: int, slots: int = 4) -> list[Placement]:
    """`server1..serverN` as in the platform document, each with its own address."""
    return [Placement(rank=i, node=f"server{i + 1}", address=f"10.0.0.{i + 1}", slots=slots) for i in range(count)]


def plan(spec: JobSpec, flavor: Flavor = GPU4, placement: list[Placement] | None = None,
         port: int = 2222) -> list[NodeLaunch]:
    placement = placement if placement is not None else servers(spec.nodes)
    return plan_launch(spec, flavor, placement, ports=each_rank(placement, port))


def each_rank(placement: list[Placement], first: int = 2222) -> dict[int, int]:
    """A port for every rank, counting from `first` (the planner takes those of the ranks that listen)."""
    return {place.rank: first + place.rank for place in placement}


# --- L4: PyTorch ---------------------------------------------------------------------------------------


def test_pytorch_2x4_master_and_worker_commands_match_the_platform_document() -> None:
    master, worker = plan(job("pytorch"))
    assert master.argv == shlex.split(
        "python -m torch.distributed.launch --nproc_per_node=4 --nnodes=2 --node_rank=0 "
        "--master_addr=localhost --master_port=2222 /workspace/algorithm/train.py")
    assert worker.argv == shlex.split(
        "python -m torch.distributed.launch --nproc_per_node=4 --nnodes=2 --node_rank=1 "
        "--master_addr=10.0.0.1 --master_port=2222 /workspace/algorithm/train.py")


def test_pytorch_environment_on_every_node() -> None:
    launches = plan(job("pytorch", nodes=4), placement=servers(4))
    for rank, launch in enumerate(launches):
        assert launch.env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2222", "WORLD_SIZE": "4",
                              "RANK": str(rank), "SLOTS": "4"}
    assert [f"--node_rank={r}" in launch.argv for r, launch in enumerate(launches)] == [True] * 4


def test_pytorch_wrapping_keeps_the_interpreter_and_script_arguments() -> None:
    master, _ = plan(job("pytorch", command="python3 /workspace/algorithm/train.py --lr 0.1 --name 'a b'"))
    assert master.argv[:3] == ["python3", "-m", "torch.distributed.launch"]
    assert master.argv[-5:] == ["/workspace/algorithm/train.py", "--lr", "0.1", "--name", "a b"]


@pytest.mark.parametrize(
    "command",
    [
        "torchrun --nnodes 2 --nproc_per_node 4 /workspace/algorithm/train.py",
        "python -m torch.distributed.launch --nproc_per_node=8 /workspace/algorithm/train.py",
        "python3 -m torch.distributed.launch --use_env train.py",
        'bash -c "python3 /workspace/algorithm/train.py"',
        "/usr/bin/python3 train.py",
        "deepspeed train.py",
    ],
)
def test_pytorch_commands_that_are_already_distributed_are_left_as_written(command: str) -> None:
    for launch in plan(job("pytorch", command=command)):
        assert launch.argv == shlex.split(command)
        assert launch.env["RANK"] == str(launch.rank)  # the variables are still set for the user's launcher


def test_pytorch_slots_are_1_on_cpu_flavors() -> None:
    master, worker = plan(job("pytorch"), flavor=CPU, placement=servers(2, slots=1))
    assert master.env["SLOTS"] == "1"
    assert "--nproc_per_node=1" in master.argv and "--nproc_per_node=1" in worker.argv


def test_slots_follow_the_flavor_accelerator_count() -> None:
    eight = Flavor(name="gpu-8", cpus=32, memory_mib=1, accelerators=8)
    master, _ = plan(job("pytorch"), flavor=eight, placement=servers(2, slots=8))
    assert master.env["SLOTS"] == "8"
    assert "--nproc_per_node=8" in master.argv


def test_single_pytorch_node_is_its_own_master() -> None:
    (only,) = plan(job("pytorch", nodes=1), placement=servers(1))
    assert only.master
    assert "--master_addr=localhost" in only.argv and "--nnodes=1" in only.argv
    assert only.env["WORLD_SIZE"] == "1"


# --- L5: PyTorch-DeepSpeed ---------------------------------------------------------------------------------


def test_deepspeed_gets_the_pytorch_variables_and_a_job_hostfile() -> None:
    command = "deepspeed /workspace/algorithm/train.py --deepspeed --deepspeed_config ds_config.json"
    launches = plan(job("pytorch-deepspeed", command=command))
    for launch in launches:
        assert launch.argv == shlex.split(command)
        assert launch.files == {DEEPSPEED_HOSTFILE: "server1 slots=4\nserver2 slots=4\n"}
        assert launch.env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2222", "WORLD_SIZE": "2",
                              "RANK": str(launch.rank), "SLOTS": "4"}
    assert DEEPSPEED_HOSTFILE == "/job/hostfile"


def test_deepspeed_python_command_is_not_wrapped_in_torch_launch() -> None:
    master, _ = plan(job("pytorch-deepspeed"))
    assert master.argv == shlex.split(SEED_COMMAND)


# --- L2: Horovod -------------------------------------------------------------------------------------------


def test_horovod_hostfiles_for_2_nodes_x_4_slots() -> None:
    for launch in plan(job("horovod")):
        assert launch.files == {MPI_HOSTFILE: "server1 slots=4\nserver2 slots=4\n",
                                MPICH_HOSTFILE: "server1:4\nserver2:4\n"}
        assert launch.env == {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                              "HYDRA_HOST_FILE": "/etc/mpi/mpich_hostfile", "HYDRA_IFACE": "eth0",
                              "OMPI_MCA_plm_rsh_agent": "python3 -m agent.rsh", "OMPI_MCA_routed": "direct"}


def test_horovod_4x4_command_gets_the_mpirun_prefix_with_16_processes() -> None:
    master, *others = plan(job("horovod", nodes=4), placement=servers(4))
    expected = [*shlex.split(MPIRUN_PREFIX.format(np=16)), "python", "/workspace/algorithm/train.py"]
    assert master.argv == expected and master.role == "worker"
    assert expected[:4] == ["mpirun", "--allow-run-as-root", "-np", "16"]
    # mpirun on the master starts every process; the other nodes stand by for its daemons.
    assert all(launch.argv == ["sleep", "infinity"] and launch.role == "standby" for launch in others)


def test_horovod_on_cpu_flavors_runs_one_process_per_node() -> None:
    master = plan(job("horovod", nodes=3), flavor=CPU, placement=servers(3, slots=1))[0]
    assert master.argv[2:4] == ["-np", "3"]
    assert master.files[MPI_HOSTFILE] == "server1 slots=1\nserver2 slots=1\nserver3 slots=1\n"


def test_horovod_command_with_mpirun_is_left_as_written_even_across_lines() -> None:
    # The platform document's own example, typed with backslash line continuations.
    command = ("mpirun -np 16 \\\n-bind-to none -map-by slot \\\n-x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH \\\n"
               "-x NCCL_SOCKET_IFNAME=^lo,docker0 \\\n-mca pml ob1 -mca btl ^openib \\\n"
               "-mca btl_tcp_if_exclude lo,docker0 \\\npython /workspace/algorithm/train.py")
    master = plan(job("horovod", nodes=4, command=command), placement=servers(4))[0]
    assert master.argv == ["mpirun", "-np", "16", "-bind-to", "none", "-map-by", "slot", "-x", "NCCL_DEBUG=INFO",
                           "-x", "LD_LIBRARY_PATH", "-x", "PATH", "-x", "NCCL_SOCKET_IFNAME=^lo,docker0",
                           "-mca", "pml", "ob1", "-mca", "btl", "^openib", "-mca", "btl_tcp_if_exclude",
                           "lo,docker0", "python", "/workspace/algorithm/train.py"]


@pytest.mark.parametrize(
    "command",
    [
        "mpirun -np 8 python train.py",
        "/usr/local/bin/mpirun -np 8 python train.py",
        'bash -c "mpirun -np 8 python train.py"',
        "mpirun.openmpi -np 8 python train.py",
    ],
)
def test_horovod_commands_containing_mpirun_are_not_prefixed(command: str) -> None:
    master, _ = plan(job("horovod", command=command))
    assert master.argv == shlex.split(command)


def test_horovod_script_whose_name_merely_contains_mpirun_is_still_prefixed() -> None:
    master, _ = plan(job("horovod", command="python train_mpirun_free.py"))
    assert master.argv[0] == "mpirun" and master.argv[-2:] == ["python", "train_mpirun_free.py"]


def test_horovod_does_not_wrap_python_in_torch_launch() -> None:
    master, _ = plan(job("horovod"))
    assert "torch.distributed.launch" not in master.argv


# --- L3: TensorFlow ------------------------------------------------------------------------------------------


def test_tensorflow_allreduce_tf_config_on_every_node() -> None:
    launches = plan(job("tensorflow", nodes=3), placement=servers(3), port=2222)
    for launch in launches:
        config = json.loads(launch.env["TF_CONFIG"])
        # Each task has its own port (base + rank), so tasks sharing a host never collide.
        assert config == {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2223", "10.0.0.3:2224"]},
                          "task": {"type": "worker", "index": launch.rank}, "environment": "cloud"}
        assert launch.argv == shlex.split(SEED_COMMAND)
        assert set(launch.env) == {"TF_CONFIG"}


def test_tf_config_helper_has_no_parameter_servers_in_allreduce() -> None:
    config = json.loads(tf_config(servers(2), 1, {0: 5000, 1: 5001}))
    assert "ps" not in config["cluster"]
    assert config["task"] == {"type": "worker", "index": 1}


def test_tensorflow_ps_worker_tf_config_names_each_node_by_its_role() -> None:
    placement = [*servers(2), Placement(rank=2, node="server3", address="10.0.0.3", slots=1, role="ps")]
    launches = plan(job("tensorflow", nodes=2, parameter_servers=1), placement=placement, port=2222)
    cluster = {"ps": ["10.0.0.3:2224"], "worker": ["10.0.0.1:2222", "10.0.0.2:2223"]}
    assert [json.loads(launch.env["TF_CONFIG"]) for launch in launches] == [
        {"cluster": cluster, "task": {"type": "worker", "index": 0}, "environment": "cloud"},
        {"cluster": cluster, "task": {"type": "worker", "index": 1}, "environment": "cloud"},
        {"cluster": cluster, "task": {"type": "ps", "index": 0}, "environment": "cloud"},
    ]
    assert [launch.role for launch in launches] == ["worker", "worker", "ps"]


# --- L6: single node and general properties --------------------------------------------------------------


def test_single_node_runs_the_command_as_written_without_distributed_settings() -> None:
    spec = job("single-node", nodes=1, command="python3 train.py --epochs 3", env={"SEED": "7"})
    (only,) = plan(spec, placement=servers(1))
    assert only.argv == ["python3", "train.py", "--epochs", "3"]
    assert only.env == {"SEED": "7"}
    assert only.files == {}
    assert only.master and only.rank == 0


@pytest.mark.parametrize("mode", ["pytorch", "pytorch-deepspeed", "horovod", "tensorflow"])
def test_every_node_gets_its_own_rank_node_and_address_and_only_rank_0_is_master(mode: str) -> None:
    launches = plan(job(mode, nodes=3), placement=servers(3))
    assert [(n.rank, n.node, n.address, n.master) for n in launches] == [
        (0, "server1", "10.0.0.1", True), (1, "server2", "10.0.0.2", False), (2, "server3", "10.0.0.3", False)]


@pytest.mark.parametrize("mode", ["pytorch", "pytorch-deepspeed", "horovod", "tensorflow", "single-node"])
def test_user_environment_reaches_every_node(mode: str) -> None:
    nodes = 1 if mode == "single-node" else 2
    for launch in plan(job(mode, nodes=nodes, env={"NCCL_DEBUG": "WARN", "SEED": "1"}), placement=servers(nodes)):
        assert launch.env["NCCL_DEBUG"] == "WARN" and launch.env["SEED"] == "1"


def test_platform_variables_win_over_user_values() -> None:
    master, _ = plan(job("pytorch", env={"RANK": "99", "MASTER_PORT": "1"}))
    assert master.env["RANK"] == "0" and master.env["MASTER_PORT"] == "2222"


def test_line_continuations_do_not_become_arguments() -> None:
    (only,) = plan(job("single-node", nodes=1, command="python3 train.py \\\n  --lr 0.1 \\\n  --epochs 2"),
                   placement=servers(1))
    assert only.argv == ["python3", "train.py", "--lr", "0.1", "--epochs", "2"]


def test_a_batch_job_plans_every_task_on_every_node_with_its_own_command_and_workspace() -> None:
    spec = JobSpec(name="sweep", type="batch", mode="pytorch", nodes=2, flavors=["gpu-4"], output=OutputRef(name="o"),
                   tasks=[BatchTask(algorithm=AlgorithmRef(name="a"), command="python3 a.py --lr 0.1"),
                          BatchTask(algorithm=AlgorithmRef(name="b"), command="torchrun b.py")])
    launches = plan_launch(spec, GPU4, servers(2), ports=each_rank(servers(2)))
    assert [(launch.task, launch.rank) for launch in launches] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = launches[0], launches[2]
    assert first.argv[:3] == ["python3", "-m", "torch.distributed.launch"]
    assert first.argv[-3:] == ["a.py", "--lr", "0.1"]
    assert second.argv == ["torchrun", "b.py"]
    outputs = {launch.task: next(m.source for m in launch.mounts if m.target == "outputs") for launch in launches}
    assert outputs == {0: "outputs/o/sweep-1", 1: "outputs/o/sweep-2"}
    algorithms = {launch.task: next(m.source for m in launch.mounts if m.target == "algorithm") for launch in launches}
    assert algorithms == {0: "algorithms/a", 1: "algorithms/b"}


def test_hostfile_helpers() -> None:
    placement = servers(2, slots=4)
    assert hostfile_openmpi(placement) == "server1 slots=4\nserver2 slots=4\n"
    assert hostfile_mpich(placement) == "server1:4\nserver2:4\n"
    assert hostfile_openmpi([]) == "" and hostfile_mpich([]) == ""


# --- L1: workspace mounts --------------------------------------------------------------------------------


def full_spec(**extra: Any) -> JobSpec:
    return JobSpec(
        name="train", flavors=["gpu-4"], command="python3 train.py",
        algorithm=AlgorithmRef(name="code", read_only=True),
        datasets=[DatasetRef(name="mine"), DatasetRef(name="mine-rw", read_only=False),
                  DatasetRef(name="fav", source="favorite", version="v1")],
        annotation_datasets=[AnnotationDatasetRef(name="labels", version="v3", read_only=False)],
        models=[ModelRef(name="bert", source="pretrained"), ModelRef(name="mine"),
                ModelRef(name="shared", source="favorite", version="v9")],
        output=OutputRef(name="out"), volumes=[VolumeRef(name="scratch"), VolumeRef(name="cache")], **extra)


def targets(mounts: list[Mount]) -> dict[str, bool]:
    return {m.target: m.read_only for m in mounts}


def test_workspace_layout_follows_l1() -> None:
    assert targets(workspace_mounts(full_spec())) == {
        "algorithm": True,
        "dataset/private/mine": True,
        "dataset/private/mine-rw": False,
        "dataset/favorite/fav/v1": True,
        "anno_dataset/labels/annotation": False,
        "model/pretrained/bert": True,
        "model/private/mine": True,
        "model/favorite/shared/v9": True,
        "outputs": False,
        "volume/scratch": False,
        "volume/cache": False,
    }


def test_mount_sources_name_the_chosen_resource_and_version() -> None:
    sources = {m.target: m.source for m in workspace_mounts(full_spec())}
    assert sources["algorithm"].endswith("code")
    assert sources["dataset/favorite/fav/v1"].endswith("fav/v1")
    assert sources["anno_dataset/labels/annotation"].endswith("labels/v3")
    assert sources["model/favorite/shared/v9"].endswith("shared/v9")
    assert sources["outputs"].endswith("out")
    assert sources["volume/scratch"].endswith("scratch")
    assert len(set(sources.values())) == len(sources)


def test_writable_algorithm_is_mounted_writable() -> None:
    spec = job("single-node", nodes=1)
    assert targets(workspace_mounts(spec))["algorithm"] is False


def test_minimal_job_mounts_only_algorithm_and_outputs() -> None:
    assert targets(workspace_mounts(job("single-node", nodes=1))) == {"algorithm": False, "outputs": False}


def test_every_node_gets_the_same_workspace() -> None:
    spec = full_spec(mode="pytorch", nodes=2)
    launches = plan(spec)
    assert launches[0].mounts == launches[1].mounts == workspace_mounts(spec)


def test_batch_task_n_gets_its_algorithm_and_writes_to_job_name_dash_n() -> None:
    spec = JobSpec(name="sweep", type="batch", flavors=["cpu-8"], output=OutputRef(name="results"),
                   models=[ModelRef(name="base")],
                   tasks=[BatchTask(algorithm=AlgorithmRef(name="algo-a"), command="python3 a.py"),
                          BatchTask(algorithm=AlgorithmRef(name="algo-b", read_only=True), command="python3 b.py")])
    regular_output = workspace_mounts(JobSpec(name="x", output=OutputRef(name="results")))
    base = {m.target: m for m in regular_output}["outputs"].source
    for index, algorithm in enumerate(["algo-a", "algo-b"]):
        mounts = {m.target: m for m in workspace_mounts(spec, task_index=index)}
        assert mounts["outputs"].source == f"{base}/sweep-{index + 1}"
        assert mounts["outputs"].target == "outputs" and not mounts["outputs"].read_only
        assert mounts["algorithm"].source.endswith(algorithm)
        assert mounts["model/private/base"].read_only
    assert {m.target: m for m in workspace_mounts(spec, task_index=1)}["algorithm"].read_only


# --- J12: checkpoint resume; J15: debug terminal -----------------------------------------------------------


def resumable(**extra: Any) -> JobSpec:
    return job("pytorch", pool="dedicated", checkpoint_resume=CheckpointResume(), **extra)


def test_a_checkpoint_job_is_told_its_signal_folder_and_resumes_on_every_node() -> None:
    launches = plan_launch(resumable(), GPU4, servers(2), ports=each_rank(servers(2)), job_id="job-00000000000a",
                           attempt=3, resumes=2)
    for launch in launches:
        assert {k: v for k, v in launch.env.items() if k.startswith("TRAINYARD_")} == {
            "TRAINYARD_CHECKPOINT_SIGNAL": "SIGUSR1", "TRAINYARD_CHECKPOINT_DIR": "/workspace/checkpoints",
            "TRAINYARD_RESUME_COUNT": "2"}
        assert launch.env["RANK"] == str(launch.rank)  # the mode's variables are still there
        assert Mount(source="checkpoints/job-00000000000a/attempt-3", target="checkpoints",
                     read_only=False) in launch.mounts


def test_a_checkpoint_job_cannot_be_planned_without_its_id() -> None:
    with pytest.raises(ValueError, match="job id"):
        plan(resumable())


def test_other_jobs_get_no_checkpoint_variables_or_folder() -> None:
    launches = plan_launch(job("pytorch"), GPU4, servers(2), ports=each_rank(servers(2)), job_id="job-00000000000a")
    assert not any(k.startswith("TRAINYARD_") for launch in launches for k in launch.env)
    assert not any(m.target == "checkpoints" for launch in launches for m in launch.mounts)


@pytest.mark.parametrize(("terminal", "kept"), [(None, False), (DebugTerminal(), True),
                                                (DebugTerminal(enabled=False), False)])
def test_the_workspace_is_kept_only_with_the_debug_terminal_on(terminal: DebugTerminal | None, kept: bool) -> None:
    assert [launch.keep_workspace for launch in plan(job("pytorch", debug_terminal=terminal))] == [kept, kept]
