"""A real job of a real node agent holds no control-plane secret (SPEC L1): not in its environment,
not on disk under bwrap, and neither does a debug session in its kept environment (J15).

The agent is started like the local stack's: with DATABASE_URL, NATS_URL, the signing secret and
tokens in its environment, and its state folder (secret, token, storage, agent folders) in one
place outside /tmp (a job's /tmp is its own, which would hide anything under the host's /tmp).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client

from agent.isolation.workspace import BACKEND_VARIABLE, BWRAP, PLAIN, bwrap_problem
from libs.contracts.agent import SessionOpened
from libs.contracts.events import Mount, NodeLaunch
from tests.support.agents import Node, registered_node

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-5e5510aa0003"
SECRET = "the-signing-secret"
CONTROL_PLANE = {"DATABASE_URL": "postgresql://postgres@127.0.0.1:15432/trainyard",
                 "NATS_CREDS": "/etc/nats/agent.creds", "TRAINYARD_AUTH_SECRET": SECRET,
                 "TRAINYARD_TOKEN": "admin-token", "TRAINYARD_CLUSTER": "deploy/local/cluster.yaml"}
# Prints what the job sees: its environment, the secret file, the state folder, its workspace.
PROBE = r"""
import json, os, sys
secret, state = sys.argv[1], sys.argv[2]
workspace = os.environ["TRAINYARD_WORKSPACE"]
try:
    read = open(secret).read()
except OSError as exc:
    read = type(exc).__name__
with open(os.path.join(workspace, "outputs", "written.txt"), "w") as out:
    out.write("written by the job")
seen = {"env": dict(os.environ), "secret": read, "state": sorted(os.listdir(state)) if os.path.isdir(state) else None,
        "data": open(os.path.join(workspace, "algorithm", "hello.txt")).read()}
print("SEEN " + json.dumps(seen))
raise SystemExit(3)
"""


@pytest.fixture
def state() -> Iterator[Path]:
    """The stack's state folder, as `.trainyard/` is: outside /tmp."""
    home = Path(tempfile.mkdtemp(prefix="trainyard-isolation-", dir="/var/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session", params=[PLAIN, BWRAP])
async def node(request: pytest.FixtureRequest, nc: Client, nats_url: str, state: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    if request.param == BWRAP and (problem := bwrap_problem()):
        pytest.skip(problem)
    monkeypatch.setenv(BACKEND_VARIABLE, request.param)
    (state / "auth-secret").write_text(SECRET)
    (state / "token").write_text("admin-token")
    for name, value in CONTROL_PLANE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET_FILE", str(state / "auth-secret"))
    monkeypatch.setenv("TRAINYARD_TOKEN_FILE", str(state / "token"))
    monkeypatch.setenv("TRAINYARD_HIDDEN_PATHS", str(state))
    storage = state / "storage"
    (storage / "algorithms" / "demo").mkdir(parents=True)
    (storage / "algorithms" / "demo" / "hello.txt").write_text("hello from storage\n")

    async with registered_node(nc, nats_url, state, job_id=JOB, storage=storage) as found:
        yield found


def probe(node: Node, state: Path) -> NodeLaunch:
    return NodeLaunch(rank=0, node=node.name, address="127.0.0.1",
                      argv=[sys.executable, "-c", PROBE, str(state / "auth-secret"), str(state)],
                      env={"GREETING": "forty-two"},
                      mounts=[Mount(source="algorithms/demo", target="algorithm", read_only=True),
                              Mount(source="outputs/demo", target="outputs", read_only=False)],
                      keep_workspace=True)


def seen(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("SEEN ")]
    assert lines, output
    found: dict[str, Any] = json.loads(lines[-1].removeprefix("SEEN "))
    return found


def assert_no_control_plane_variables(env: dict[str, str]) -> None:
    assert not {*CONTROL_PLANE, "NATS_URL", "TRAINYARD_AUTH_SECRET_FILE", "TRAINYARD_TOKEN_FILE",
                "TRAINYARD_HIDDEN_PATHS"} & env.keys()
    assert not [v for v in env.values() if SECRET in v or "admin-token" in v]


async def test_a_job_sees_neither_the_agents_secrets_nor_the_stack_state(node: Node, state: Path) -> None:
    assert await node.run(probe(node, state)) == 3
    output = next((state / "agents" / node.name / "jobs").glob("*.attempt-1.task-0.rank-0/output.log")).read_text()
    job = seen(output)

    assert_no_control_plane_variables(job["env"])
    assert job["env"]["GREETING"] == "forty-two" and job["env"]["TRAINYARD_NODE"] == node.name
    assert job["data"] == "hello from storage\n"  # mounts from storage under the state folder still work
    assert (node.storage / "outputs" / "demo" / "written.txt").read_text() == "written by the job"
    if node.agent.backend == BWRAP:
        assert job["secret"] == "FileNotFoundError"
        assert job["state"] is None  # secret, token, storage and agent folders: not there at all


async def test_a_debug_session_in_a_kept_environment_follows_the_same_rule(node: Node, state: Path) -> None:
    assert await node.run(probe(node, state)) == 3

    session = node.session()
    command = f'echo "SEEN $(python3 -c "import json, os; print(json.dumps(dict(env=dict(os.environ))))")"; ' \
              f'cat {state}/auth-secret {state}/token 2>/dev/null; ls -A {state} 2>/dev/null'
    assert isinstance(await session.open(attempt=1, rank=0, command=command), SessionOpened)
    await session.exit_code()

    assert_no_control_plane_variables(seen(session.text)["env"])
    if node.agent.backend == BWRAP:
        assert SECRET not in session.text and "admin-token" not in session.text
        assert session.text.splitlines()[1:] == []
