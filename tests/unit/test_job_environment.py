"""What a job's processes find in their environment and on disk (SPEC L1): no control-plane secrets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.agent import NodeAgent
from agent.isolation.sandbox import SYSTEM_PATHS, Bind, Hidden, HostEntry, SandboxSpec, bwrap_argv
from agent.isolation.workspace import BWRAP, Workspace, hidden_entries
from agent.output.runs import runs_folder, socket_path
from agent.processes.jobenv import job_environment, network_env, without_credentials
from agent.ranks.kept import ENVIRONMENT_NAME, Environment, read_environment, write_environment
from libs.contracts.cluster import Flavor, NodeInfo
from libs.contracts.events import Placement
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.controlsign import ControlVerifier
from libs.settings import Settings
from services.launcher.planner import plan_launch
from tests.support.bwrap import ops

# What an agent of the local stack is started with (stack.env and the shell's own variables).
AGENT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin", "HOME": "/home/ops", "USER": "ops", "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8", "TZ": "UTC", "TERM": "xterm", "LD_LIBRARY_PATH": "/opt/lib",
    "VIRTUAL_ENV": "/opt/venv", "PYTHONUNBUFFERED": "1",
    "DATABASE_URL": "postgresql://postgres@127.0.0.1:15432/trainyard",
    "NATS_URL": "nats://agent:s3cret@127.0.0.1:14222", "NATS_CREDS": "/etc/nats/agent.creds",
    "TRAINYARD_AUTH_SECRET": "signing-secret", "TRAINYARD_AUTH_SECRET_FILE": "/srv/ty/auth-secret",
    "TRAINYARD_TOKEN": "admin-token", "TRAINYARD_TOKEN_FILE": "/srv/ty/token", "TRAINYARD_STORAGE": "/srv/ty/storage",
    "TRAINYARD_CLUSTER": "deploy/local/cluster.yaml", "TRAINYARD_HIDDEN_PATHS": "/srv/ty",
    "AWS_SECRET_ACCESS_KEY": "cloud-key",
}
CONTROL_PLANE = {"DATABASE_URL", "NATS_CREDS", "TRAINYARD_AUTH_SECRET", "TRAINYARD_AUTH_SECRET_FILE",
                 "TRAINYARD_TOKEN", "TRAINYARD_TOKEN_FILE", "TRAINYARD_STORAGE", "TRAINYARD_CLUSTER",
                 "TRAINYARD_HIDDEN_PATHS", "AWS_SECRET_ACCESS_KEY"}
PLATFORM = {"TRAINYARD_JOB_ID": "job-1", "TRAINYARD_ATTEMPT": "1", "TRAINYARD_TASK": "0", "TRAINYARD_RANK": "1",
            "TRAINYARD_NODE": "server2", "TRAINYARD_WORKSPACE": "/workspace", "TRAINYARD_WORKSPACE_BACKEND": "bwrap"}
CPU = Flavor(name="cpu-8", cpus=8, memory_mib=16384)


def planned_env(mode: str, **extra: Any) -> dict[str, str]:
    """The plan's env for rank 1 of a two-node job, as the launcher sends it."""
    spec = JobSpec(name="train", mode=mode, nodes=2, flavors=["cpu-8"], algorithm=AlgorithmRef(name="code"),  # type: ignore[arg-type]
                   command="python /workspace/algorithm/train.py", output=OutputRef(name="out"), **extra)
    placement = [Placement(rank=i, node=f"server{i + 1}", address=f"10.0.0.{i + 1}", slots=1) for i in range(2)]
    return dict(plan_launch(spec, CPU, placement, ports={0: 29500, 1: 29501})[1].env)


def environment(plan_env: dict[str, str]) -> dict[str, str]:
    return job_environment(AGENT_ENV, plan_env, PLATFORM, python_dir=Path("/opt/venv/bin"),
                           nats_url=AGENT_ENV["NATS_URL"])


@pytest.mark.parametrize("mode", ["pytorch", "pytorch-deepspeed", "tensorflow", "horovod"])
def test_a_job_gets_no_control_plane_variable_of_its_agent(mode: str) -> None:
    env = environment(planned_env(mode, env={"MY_SETTING": "on"}))
    assert not CONTROL_PLANE & env.keys()
    assert not [v for v in env.values() if "s3cret" in v or "signing-secret" in v or "admin-token" in v]
    if mode != "horovod":
        assert "NATS_URL" not in env


def test_a_job_keeps_its_documented_variables_and_the_basics() -> None:
    env = environment(planned_env("pytorch", env={"MY_SETTING": "on", "PATH": "/mine"}))
    assert env["MY_SETTING"] == "on"
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")} == {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}
    assert PLATFORM.items() <= env.items()
    assert env["PATH"] == "/opt/venv/bin:/usr/local/bin:/usr/bin"  # the agent's interpreter first, as documented
    for name in ("HOME", "USER", "LANG", "LC_ALL", "TZ", "TERM", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED"):
        assert env[name] == AGENT_ENV[name]


def test_the_platform_job_variables_win_over_the_spec() -> None:
    env = environment({"TRAINYARD_RANK": "7", "TRAINYARD_JOB_ID": "someone-else"})
    assert (env["TRAINYARD_RANK"], env["TRAINYARD_JOB_ID"]) == ("1", "job-1")


def test_an_mpi_job_reaches_agents_through_nats_without_the_agents_credentials() -> None:
    env = environment(planned_env("horovod"))
    assert env["OMPI_MCA_plm_rsh_agent"] == "python3 -m agent.rsh"
    assert env["NATS_URL"] == "nats://127.0.0.1:14222"
    assert without_credentials("nats://a:b@n1:4222,nats://n2:4222") == "nats://n1:4222,nats://n2:4222"


def test_the_settings_name_what_jobs_must_not_see(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_HIDDEN_PATHS", f"{tmp_path / 'state'}:{tmp_path / 'more'}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "auth-secret").write_text("signing-secret")
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET_FILE", str(tmp_path / "elsewhere" / "auth-secret"))
    monkeypatch.delenv("TRAINYARD_TOKEN_FILE", raising=False)
    assert Settings().hidden_paths == (tmp_path / "state", tmp_path / "more", tmp_path / "elsewhere" / "auth-secret")


# --- the sandbox hides them -------------------------------------------------------------------------


def _entries(*names: str) -> list[HostEntry]:
    return [HostEntry(name=n, is_dir=True) for n in names]


HOST = {"/": _entries("etc", "srv", "tmp", "usr"), "/etc": [HostEntry("passwd", is_dir=False)]}


def sandbox(*hidden: Hidden, keep: Sequence[Path] = ()) -> list[tuple[str, ...]]:
    spec = SandboxSpec(binds=[Bind(Path("/srv/ty/storage/algorithms/a"), "/workspace/algorithm", read_only=True),
                              Bind(Path("/srv/ty/agents/n/jobs/j/files/job/hostfile"), "/job/hostfile", True)],
                       tmp=Path("/srv/ty/agents/n/jobs/j/tmp"), keep=keep, hidden=hidden,
                       system=(*SYSTEM_PATHS, "srv"))  # a host folder shown that holds the platform's state
    return ops(bwrap_argv(spec, ["true"], list_dir=lambda p: HOST.get(p, [])))


def test_the_state_folder_is_an_empty_read_only_tmpfs_while_mounts_from_it_still_work() -> None:
    found = sandbox(Hidden(Path("/srv/ty"), is_dir=True))
    # Hidden where the host's files are, so through /srv and /.host/srv alike.
    hide, remount = found.index(("--tmpfs", "/.host/srv/ty")), found.index(("--remount-ro", "/.host/srv/ty"))
    assert found.index(("--ro-bind", "/srv", "/.host/srv")) < hide < remount
    assert ("--symlink", ".host/srv", "/srv") in found
    assert ("--ro-bind", "/srv/ty/storage/algorithms/a", "/workspace/algorithm") in found
    assert ("--ro-bind", "/srv/ty/agents/n/jobs/j/files/job/hostfile", "/job/hostfile") in found
    assert ("--bind", "/srv/ty/agents/n/jobs/j/tmp", "/tmp") in found


def test_a_secret_file_reads_as_empty_and_paths_the_job_cannot_see_are_left_alone() -> None:
    found = sandbox(Hidden(Path("/srv/auth-secret"), is_dir=False), Hidden(Path("/tmp/ty"), is_dir=True),
                    Hidden(Path("/workspace"), is_dir=True), Hidden(Path("/"), is_dir=True))
    assert ("--ro-bind", "/dev/null", "/.host/srv/auth-secret") in found
    # /tmp/ty: the host's /tmp is not shown at all; /workspace: the job's own; /: everything.
    assert [o for o in found if o[0] == "--tmpfs"] == [("--tmpfs", "/dev/shm")]  # nothing hidden, shm its own
    assert not any(o[-1].startswith("/.host/tmp") for o in found)


def test_the_agents_python_stays_visible_inside_a_hidden_folder() -> None:
    found = sandbox(Hidden(Path("/srv"), is_dir=True), Hidden(Path("/srv/venv/secret"), is_dir=False),
                    keep=[Path("/srv/venv")])
    hide, keep = found.index(("--tmpfs", "/.host/srv")), found.index(("--ro-bind", "/srv/venv", "/.host/srv/venv"))
    # A hidden path inside the kept one is hidden again after the binding.
    assert hide < keep < found.index(("--ro-bind", "/dev/null", "/.host/srv/venv/secret"))


def test_hidden_entries_are_the_existing_paths(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "secret").write_text("x")
    assert hidden_entries([tmp_path / "state", tmp_path / "secret", tmp_path / "missing"]) == [
        Hidden(tmp_path / "state", is_dir=True), Hidden(tmp_path / "secret", is_dir=False)]


def test_a_kept_environment_keeps_what_is_hidden(tmp_path: Path) -> None:
    spec = SandboxSpec(binds=[], hidden=[Hidden(Path("/srv/ty"), is_dir=True)])
    workspace = Workspace(root=tmp_path, path=Path("/workspace"), backend=BWRAP, sandbox=spec)
    write_environment(tmp_path, job_id="job-1", attempt=1, task=0, rank=0, node="n",
                      environment=Environment(workspace=workspace, env={}))
    found = read_environment(tmp_path)
    assert found is not None and found.workspace.sandbox is not None
    assert list(found.workspace.sandbox.hidden) == [Hidden(Path("/srv/ty"), is_dir=True)]
    # A record written before paths were hidden still reads.
    record = msgspec.json.decode((tmp_path / ENVIRONMENT_NAME).read_bytes())
    del record["workspace"]["sandbox"]["hidden"]
    (tmp_path / ENVIRONMENT_NAME).write_bytes(msgspec.json.encode(record))
    old = read_environment(tmp_path)
    assert old is not None and old.workspace.sandbox is not None and list(old.workspace.sandbox.hidden) == []


def test_an_agent_hides_its_folder_and_every_ranks_run_socket(tmp_path: Path) -> None:
    agent = NodeAgent(NodeInfo(name="node-a", address="127.0.0.1", cpus=1, memory_mib=256), nats_url="nats://x:1",
                      root=tmp_path / "agent", storage=tmp_path / "storage",
                      control=ControlVerifier.of_secret("s" * 48))
    # A rank's own socket folder is bound where its job finds it; the others' stay out of sight.
    assert {tmp_path / "agent", Path(runs_folder())} <= set(agent.hidden_paths)
    assert socket_path(tmp_path / "rank-0").parent.parent == Path(runs_folder())


HOST_INTERFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fe80::1"], "ib0": ["192.168.7.2"]}


def test_ranks_talk_over_the_interface_that_holds_their_nodes_address() -> None:
    network = network_env("10.0.0.2", HOST_INTERFACES)
    env = job_environment(AGENT_ENV, planned_env("pytorch"), PLATFORM, python_dir=Path("/opt/venv/bin"),
                          nats_url=AGENT_ENV["NATS_URL"], network=network)
    # Gloo and NCCL would otherwise bind the address the host's name resolves to, often a loopback one.
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["OMPI_MCA_btl_tcp_if_include"] == env["OMPI_MCA_oob_tcp_if_include"] == "eth0"
    assert network_env("192.168.7.2", HOST_INTERFACES)["GLOO_SOCKET_IFNAME"] == "ib0"


def test_a_job_on_one_host_or_behind_a_name_is_left_to_its_libraries_defaults() -> None:
    assert network_env("127.0.0.1", HOST_INTERFACES) == {}
    assert network_env("node-7.cluster.example", HOST_INTERFACES) == {}


def test_the_specs_own_choice_of_interface_wins() -> None:
    env = job_environment(AGENT_ENV, {**planned_env("pytorch"), "NCCL_SOCKET_IFNAME": "ib0"}, PLATFORM,
                          python_dir=Path("/opt/venv/bin"), nats_url=AGENT_ENV["NATS_URL"],
                          network=network_env("10.0.0.2", HOST_INTERFACES))
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
