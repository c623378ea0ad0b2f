"""Real jobs through the real stack: services and agents as processes, NATS and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

import msgspec
import pytest

from devstack.stack import REPO_ROOT
from libs.contracts.events import LaunchPlanned
from libs.contracts.jobspec import AlgorithmRef, BatchTask, JobSpec, LifecycleScripts, OutputRef, decode_spec
from tests.support.runs import finished_run
from tests.support.specs import mpi_hello, sleeper
from tests.support.stack import Stack, process_alive
from tests.support.waiting import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]


async def test_example_pytorch_job_trains_on_two_nodes(stack: Stack) -> None:
    await stack.up()
    spec = decode_spec((REPO_ROOT / "examples" / "pytorch-ddp.yaml").read_bytes(), yaml=True)
    command = spec.command.replace("--steps 40", "--steps 20") if spec.command else None
    with contextlib.ExitStack() as held:
        # Something else on the node listens on 29500, the port rendezvous traditionally uses.
        with contextlib.suppress(OSError):  # or it does already
            taken = held.enter_context(socket.socket())
            taken.bind(("0.0.0.0", 29500))
            taken.listen()
        accepted = await (await stack.api()).submit(msgspec.structs.replace(spec, command=command))
        job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    assert {p.node for p in job.placement} == {"node-a", "node-b"}
    lines = await stack.logs(accepted.job_id)
    assert any(line.startswith("[0] rank 0/2") for line in lines)
    assert any(line.startswith("[1] rank 1/2") for line in lines)
    # Each rank read its share of the read-only dataset mounted from shared storage.
    assert "[0] rank 0 read 128 of 256 samples from points.csv" in lines
    assert "[1] rank 1 read 128 of 256 samples from points.csv" in lines
    assert (stack.storage / "outputs" / "pytorch-ddp-demo" / "checkpoint.pt").stat().st_size > 0
    # R1, R2: both ranks logged their loss into the job's one run, each step once.
    api = await stack.api()
    run = await finished_run(api, accepted.job_id)
    assert [(s.name, s.rank, s.count, s.last_step) for s in run.series if s.name == "loss"] == [
        ("loss", 0, 20, 20), ("loss", 1, 20, 20)]
    # The agents' samples of each rank joined the run as its system series.
    assert {(s.name, s.rank) for s in run.series if s.name == "system/memory_mib"} == {("system/memory_mib", 0),
                                                                                       ("system/memory_mib", 1)}
    assert (run.state, run.finished_by, run.attempts) == ("finished", "rank 0 ended", [1])
    assert run.config == {"lr": 0.1, "steps": 20, "world": 2} and set(run.summary) == {"weight", "bias"}
    assert [p.step for p in [p async for p in api.series(accepted.job_id, "loss", rank=1)]] == list(range(1, 21))
    events = await (await stack.api()).events(accepted.job_id)
    history = [type(e.event).name() for e in events]
    assert history[:4] == ["JobSubmitted", "JobPredicted", "JobAdmitted", "LaunchPlanned"]
    [plan] = [e.event for e in events if isinstance(e.event, LaunchPlanned)]
    assert plan.rank_ports()[0] != 29500  # the master's node chose a port free there
    assert history[-2:] == ["LaunchSucceeded", "JobSucceeded"]

    # One trace follows the job from the scheduler through the launcher to both agents and back.
    def records(process: str) -> list[dict[str, str]]:
        lines = stack.processes.log(process).splitlines()
        return [r for r in map(json.loads, filter(lambda line: line.startswith("{"), lines))
                if r.get("job_id") == accepted.job_id and "trace_id" in r]

    def traces(process: str) -> set[str]:
        return {r["trace_id"] for r in records(process)}

    shared = traces("scheduler") & traces("launcher") & traces("agent-node-a") & traces("agent-node-b")
    assert len(shared) == 1
    assert {r["trace_id"] for r in records("scheduler") if r.get("event_type") == "JobSucceeded"} == shared


async def test_a_failing_command_fails_the_job_with_its_exit_code(stack: Stack) -> None:
    await stack.up()
    accepted = await (await stack.api()).submit(sleeper("fails", seconds=0.2, exit_code=3))
    job = await stack.wait_until(accepted.job_id, "ended")
    assert (job.status, job.exit_code) == ("failed", 3)
    assert "exited with code 3" in (job.reason or "")


async def test_stopping_a_running_job_kills_its_processes(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(sleeper("long", nodes=2, seconds=120))
    running = await stack.wait_until(accepted.job_id, "running")
    await api.stop([accepted.job_id])
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "stopped"
    stopped = [e.event for e in await api.events(accepted.job_id) if type(e.event).name() == "JobStopped"]
    assert [getattr(e, "by", None) for e in stopped] == ["tester"]
    for instance in running.instances:
        assert instance.pid is not None
        assert not process_alive(instance.pid)


async def test_a_lost_node_fails_the_jobs_running_on_it(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(sleeper("on-two-nodes", nodes=2, seconds=120))
    await stack.wait_until(accepted.job_id, "running")
    stack.crash("agent-node-b")
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "failed"
    assert "node node-b was lost" in (job.reason or "")
    assert {n.info.name: n.status for n in await api.nodes()} == {"node-a": "ready", "node-b": "lost"}

    # The launcher stops rank 0, gives rank 1 up when node-b never answers, and closes the launch.
    async with asyncio.timeout(120):
        while "LaunchStopped" not in [type(e.event).name() for e in await api.events(accepted.job_id)]:
            await asyncio.sleep(0.3)
    instances = {i.rank: i.state for i in (await api.get_job(accepted.job_id)).job.instances}
    assert instances == {0: "exited", 1: "lost"}


async def test_the_cli_lists_shows_and_explains_errors(stack: Stack) -> None:
    await stack.up()
    accepted = await (await stack.api()).submit(sleeper("cli", nodes=2, seconds=0.2))
    await stack.wait_until(accepted.job_id, "ended")

    def trainyard(*args: str, token: str = stack.token) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NATS_URL": stack.nats_url, "COLUMNS": "200", "TRAINYARD_TOKEN": token}
        return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True,
                              env=env, cwd=REPO_ROOT, timeout=60, check=False)

    listed = trainyard("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(j["job_id"], j["status"]) for j in msgspec.json.decode(listed.stdout)["jobs"]] == [
        (accepted.job_id, "succeeded")]
    table = trainyard("list")
    assert accepted.job_id in table.stdout and "succeeded" in table.stdout
    # L8: the master instance only by default; worker instances with --all.
    assert "master@node-a" in table.stdout and "worker" not in table.stdout
    assert "worker 1@node-b" in trainyard("list", "--all").stdout
    shown = trainyard("show", accepted.job_id)
    assert "master" in shown.stdout and "exited" in shown.stdout
    logs = trainyard("logs", accepted.job_id)
    assert "[rank 0] started rank 0" in logs.stdout
    followed = trainyard("logs", accepted.job_id, "--node", "1", "--follow")  # ends with the job
    assert followed.stdout.splitlines()[-1] == "done rank 1"
    events = trainyard("events", accepted.job_id)
    assert "JobSucceeded" in events.stdout
    nodes = trainyard("nodes")
    assert "node-a" in nodes.stdout and "ready" in nodes.stdout
    resources = trainyard("resources", "--flavor", "cpu-1")
    assert resources.returncode == 0, resources.stderr
    assert "node-a" in resources.stdout and "idle" in resources.stdout
    found = trainyard("search", "--name", "CL", "--status", "succeeded", "--json")
    assert [j["job_id"] for j in msgspec.json.decode(found.stdout)] == [accepted.job_id]
    assert "tester" in trainyard("whoami").stdout
    anonymous = trainyard("list", token="x.y.z")
    assert anonymous.returncode == 1 and "TRAINYARD_TOKEN" in anonymous.stderr

    missing = trainyard("show", "job-ffffffffffff")
    assert missing.returncode == 1
    assert "no such job" in missing.stderr and "trainyard list" in missing.stderr

    bad = REPO_ROOT / "tests" / "e2e" / "bad-job.yaml"
    refused = trainyard("submit", str(bad))
    assert refused.returncode == 1
    assert "command" in refused.stderr and "bash -c" in refused.stderr and "nothing was submitted" in refused.stderr


async def test_lifecycle_scripts_run_around_the_command_on_every_node(stack: Stack) -> None:
    api = await stack.up()
    scripts = LifecycleScripts(before_start="python3 -c \"print('preparing')\"",
                               after_end="bash -c \"echo cleaning up after $TRAINYARD_EXIT_CODE\"")
    accepted = await api.submit(msgspec.structs.replace(sleeper("hooks", nodes=2, seconds=0.2), lifecycle=scripts))
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "succeeded", job.reason
    for rank in (0, 1):
        lines = [line.split("] ", 1)[1] for line in await stack.logs(accepted.job_id, rank)]
        assert lines.index("preparing") < lines.index(f"done rank {rank}") < lines.index("cleaning up after 0")

    failing = LifecycleScripts(before_start="python3 -c \"raise SystemExit(4)\"")
    refused = await api.submit(msgspec.structs.replace(sleeper("hooks-fail", seconds=0.2), lifecycle=failing))
    job = await stack.wait_until(refused.job_id, "ended")
    assert (job.status, job.exit_code) == ("failed", 4)
    lines = await stack.logs(refused.job_id)
    assert any("before_start failed with exit code 4; the run command was not started" in line for line in lines)
    assert not any("started rank" in line for line in lines)


def probe_output(lines: list[str]) -> dict[str, str]:
    (line,) = [line for line in lines if "PROBE " in line]
    result: dict[str, str] = json.loads(line.split("PROBE ", 1)[1])
    return result


async def test_tensorflow_parameter_servers_get_tf_config_and_stop_when_the_workers_finish(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="tf-ps", mode="tensorflow", nodes=2, parameter_servers=1, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="env-probe"), command="python3 probe.py", output=OutputRef(name="tf"))
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "succeeded", job.reason
    assert [(p.rank, p.role) for p in job.placement] == [(0, "worker"), (1, "worker"), (2, "ps")]
    assert [i.role for i in job.instances] == ["worker", "worker", "ps"]

    # The parameter server is stopped once both workers are done.
    async with asyncio.timeout(120):
        while True:
            states = {i.rank: (i.state, i.exit_code) for i in (await api.get_job(accepted.job_id)).job.instances}
            if states[2][0] == "exited":
                break
            await asyncio.sleep(0.2)
    # Every node's output is shipped before its exit is reported, so all probes are in the log now.
    places = {p.rank: p for p in job.placement}
    configs = [json.loads(probe_output(await stack.logs(accepted.job_id, rank))["TF_CONFIG"]) for rank in range(3)]
    # Each task listens on a port its own node chose, as the launch plan records.
    [plan] = [e.event for e in await api.events(accepted.job_id) if isinstance(e.event, LaunchPlanned)]
    ports = plan.rank_ports()
    assert len(set(ports.values())) == 3
    cluster = {"ps": [f"{places[2].address}:{ports[2]}"],
               "worker": [f"{places[0].address}:{ports[0]}", f"{places[1].address}:{ports[1]}"]}
    assert configs == [
        {"cluster": cluster, "task": {"type": "worker", "index": 0}, "environment": "cloud"},
        {"cluster": cluster, "task": {"type": "worker", "index": 1}, "environment": "cloud"},
        {"cluster": cluster, "task": {"type": "ps", "index": 0}, "environment": "cloud"},
    ]
    assert states[0] == states[1] == ("exited", 0)
    assert states[2][1] != 0


async def test_show_reports_each_nodes_cpu_and_memory_use(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="busy", mode="pytorch", nodes=2, flavors=["cpu-1"], algorithm=AlgorithmRef(name="spinner"),
                   command="bash -c \"exec python3 spin.py 100\"", output=OutputRef(name="busy"))
    accepted = await api.submit(spec)
    await stack.wait_until(accepted.job_id, "running")
    # Busy: far above the nothing an idle process shows, whatever share of a CPU a loaded machine gives each rank.
    async with asyncio.timeout(120):
        while True:
            usage = await api.usage(accepted.job_id)
            if len(usage) == 2 and all(u.cpu_percent > 5 and u.memory_mib >= 100 for u in usage):
                break
            await asyncio.sleep(0.5)
    assert [(u.rank, u.node) for u in usage] == [(0, "node-a"), (1, "node-b")]
    await api.stop([accepted.job_id])
    assert (await stack.wait_until(accepted.job_id, "ended")).status == "stopped"


async def test_a_batch_job_runs_its_tasks_in_turn_each_writing_to_its_own_folder(stack: Stack) -> None:
    api = await stack.up()
    # bash -c keeps the PyTorch mode from wrapping the scripts in torch.distributed.launch (L4).
    tasks = [BatchTask(algorithm=AlgorithmRef(name="writer"), command='bash -c "exec python3 write.py first"'),
             BatchTask(algorithm=AlgorithmRef(name="writer"), command='bash -c "exec python3 write.py second"'),
             BatchTask(algorithm=AlgorithmRef(name="sleeper"), command='bash -c "exec python3 run.py --seconds 0.2"')]
    spec = JobSpec(name="sweep", type="batch", mode="pytorch", nodes=2, flavors=["cpu-1"], tasks=tasks,
                   output=OutputRef(name="sweeps"))
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "succeeded", job.reason
    results = stack.storage / "outputs" / "sweeps"
    assert (results / "sweep-1" / "result.txt").read_text() == "written by first\n"
    assert (results / "sweep-2" / "result.txt").read_text() == "written by second\n"
    lines = [line.split("] ", 1)[1] for line in await stack.logs(accepted.job_id, 0)]
    assert lines.index("wrote result.txt for first") < lines.index("wrote result.txt for second") < lines.index(
        "done rank 0")

    failing = [tasks[0], BatchTask(algorithm=AlgorithmRef(name="sleeper"),
                                   command='bash -c "exec python3 run.py --seconds 0.1 --exit-code 3"'), tasks[1]]
    refused = await api.submit(msgspec.structs.replace(spec, name="sweep-fails", tasks=failing))
    job = await stack.wait_until(refused.job_id, "ended")
    assert (job.status, job.exit_code) == ("failed", 3)
    assert (job.reason or "").startswith("task 2: rank ")
    assert not any("second" in line for line in await stack.logs(refused.job_id))


async def test_a_clone_writes_again_into_the_outputs_its_source_made(stack: Stack) -> None:
    """A user's jobs run as one user (L1, `job_users` per user by default): a clone, or the same job submitted
    again, changes the files an earlier job of theirs left in its output folder."""
    api = await stack.up()
    spec = JobSpec(name="rewrite", flavors=["cpu-1"], algorithm=AlgorithmRef(name="writer"),
                   command="python3 write.py first", output=OutputRef(name="rewritten"))
    first = await api.submit(spec)
    assert (await stack.wait_until(first.job_id, "ended")).status == "succeeded"
    again = await api.clone(first.job_id, {"command": "python3 write.py again"})
    job = await stack.wait_until(again.job_id, "ended")
    assert job.status == "succeeded", (job.reason, await stack.logs(again.job_id))
    assert (stack.storage / "outputs" / "rewritten" / "result.txt").read_text() == "written by again\n"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI (Debian: openmpi-bin) is not installed")
async def test_horovod_mode_runs_mpirun_across_both_nodes_through_their_agents(stack: Stack) -> None:
    api = await stack.up()
    accepted = await api.submit(mpi_hello())
    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id, 0)
    assert "[0] hello from rank 0 of 2 on node-a" in lines
    assert "[0] hello from rank 1 of 2 on node-b" in lines


@pytest.mark.skipif(shutil.which("mpicc") is None,
                    reason="OpenMPI's compiler (Debian: libopenmpi-dev) is not installed")
async def test_an_mpi_program_started_by_a_written_out_mpirun_communicates_across_nodes(stack: Stack) -> None:
    api = await stack.up()
    # A command with mpirun runs as written (L2); outputs is shared storage, so both nodes see the binary.
    command = ('bash -c "mpicc -O2 -o /workspace/outputs/hello /workspace/algorithm/hello.c && '
               'exec mpirun --allow-run-as-root -np 2 -bind-to none -map-by slot /workspace/outputs/hello"')
    accepted = await api.submit(mpi_hello("mpi-c", command))
    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id, 0)
    assert "[0] hello from rank 0 of 2 on node-a" in lines
    assert "[0] hello from rank 1 of 2 on node-b" in lines
    assert "[0] sum of ranks 1" in lines  # MPI_Allreduce across the two nodes
    assert [i.role for i in (await api.get_job(accepted.job_id)).job.instances] == ["worker", "standby"]


async def test_a_batch_tensorflow_job_stops_each_tasks_parameter_servers_before_the_next(stack: Stack) -> None:
    api = await stack.up()
    probe = BatchTask(algorithm=AlgorithmRef(name="env-probe"), command="python3 probe.py")
    spec = JobSpec(name="tf-sweep", type="batch", mode="tensorflow", nodes=1, parameter_servers=1,
                   flavors=["cpu-1"], tasks=[probe, probe], output=OutputRef(name="tf-sweep"))
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=90)
    # Task 2's parameter server listens on the port task 1's used: it only can once that one is gone.
    assert job.status == "succeeded", job.reason

    async def both_servers_logged() -> bool:
        # A parameter server's output reaches the log store as its agent ships it, which may be after the
        # worker that ended the job: the last server's lines come with its stop.
        lines = await stack.logs(accepted.job_id, 1)
        return sum("parameter server serving" in line for line in lines) == 2

    await eventually(both_servers_logged, timeout=60)
    workers = await stack.logs(accepted.job_id, 0)
    assert sum("reached parameter server" in line for line in workers) == 2


async def test_deepspeed_nodes_get_the_pytorch_variables(stack: Stack) -> None:
    api = await stack.up()
    spec = JobSpec(name="ds", mode="pytorch-deepspeed", nodes=2, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="env-probe"), command="python3 probe.py", output=OutputRef(name="ds"))
    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended")
    assert job.status == "succeeded", job.reason
    probes = [probe_output(await stack.logs(accepted.job_id, rank)) for rank in (0, 1)]
    port = probes[0]["MASTER_PORT"]
    # Exactly these: the platform's secret and token files (probed too) never reach a job.
    assert probes == [{"MASTER_ADDR": job.placement[0].address, "MASTER_PORT": port, "RANK": str(rank),
                       "SLOTS": "1", "WORLD_SIZE": "2"} for rank in (0, 1)]
