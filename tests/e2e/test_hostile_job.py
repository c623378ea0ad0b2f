"""A job is untrusted code (SPEC L1): a hostile job probes its node from inside and finds nothing of the control
plane's, of the host's or of another job's (docs/security.md, "What a job can reach").

It runs beside a victim job that holds an API key in its environment and writes to its own outputs, and looks,
as an attacker with the job's rights would, at: its user, capabilities and `no_new_privs`; the processes it can
see (/proc: the agents', the services', the victim's, and the victim's environment); the agents' root folders
through /proc/<pid>/root; the stack's state folder (signing secret, tokens, node credentials, service passwords);
the victim's outputs; writes outside its workspace; PostgreSQL without a password; NATS without a credential.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from agent.isolation.workspace import BACKEND_VARIABLE, bwrap_problem, bwrap_program
from client.api import TrainyardClient
from devstack.harness import TESTER
from libs.auth import issue_token
from libs.contracts.cluster import JobUsers
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.jobusers import job_uid
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

API_KEY = "victim-api-key-5e5510aa"
PROBE = r'''
import asyncio, json, os, sys

home, database_port, nats_url, agent_pids, victim_outputs = sys.argv[1:6]
report = {}
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
report["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]
report["capabilities"] = {k: status[k].strip() for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb")}
report["no_new_privs"] = status["NoNewPrivs"].strip()
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
report["pids"] = pids
commands, secrets_seen = [], []
for pid in pids:
    try:
        commands.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        if API_KEY.encode() in open(f"/proc/{pid}/environ", "rb").read():
            secrets_seen.append(pid)
    except OSError:
        pass
report["commands"] = commands
report["victim_key_seen"] = secrets_seen
roots = {}
for pid in agent_pids.split(","):
    try:
        roots[pid] = os.listdir(f"/proc/{pid}/root{home}")
    except OSError as exc:
        roots[pid] = type(exc).__name__
report["agent_roots"] = roots
found = {}
for path in [home, f"{home}/auth-secret", f"{home}/token", f"{home}/nats", f"{home}/agents", victim_outputs,
             "/home", "/var", "/srv", "/run/postgresql", "/.host/tmp", "/.host/root", "/.host/home"]:
    found[path] = os.path.exists(path)
report["paths"] = found
report["mount_types"] = sorted({line.split(" - ")[1].split()[0] for line in open("/proc/self/mountinfo")})
report["root_home"] = [os.path.join(top, name) for top, dirs, files in os.walk("/root") for name in files][:5]
written = []
for path in ["/etc/probe", "/usr/probe", "/probe", "/.host/etc/probe", f"{home}/probe", "/dev/probe",
             "/sys/probe", "/proc/probe"]:
    try:
        with open(path, "w") as out:
            out.write("x")
        written.append(path)
    except OSError:
        pass
report["written"] = written
with open("/workspace/outputs/mine.txt", "w") as out:
    out.write("mine")


async def databases():
    import asyncpg
    outcome = {}
    for user in ("postgres", "scheduler", "root"):
        try:
            connection = await asyncpg.connect(host="127.0.0.1", port=int(database_port), user=user,
                                               database="postgres", timeout=10)
            await connection.close()
            outcome[user] = "connected"
        except Exception as exc:
            outcome[user] = type(exc).__name__
    return outcome


async def nats_anonymous():
    import nats
    try:
        client = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)
    except Exception as exc:
        return type(exc).__name__
    await client.close()
    return "connected"

report["postgres"] = asyncio.run(databases())
report["nats"] = asyncio.run(nats_anonymous())
print("REPORT " + json.dumps(report))
'''.replace("API_KEY", repr(API_KEY))


def report(lines: list[str]) -> dict[str, Any]:
    found = [line for line in lines if "REPORT " in line]
    assert found, lines
    parsed: dict[str, Any] = json.loads(found[-1].split("REPORT ", 1)[1])
    return parsed


async def test_a_hostile_job_finds_nothing_of_the_control_plane_the_host_or_another_job(
        stack: Stack, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if problem := bwrap_problem():
        pytest.skip(f"bubblewrap cannot run jobs here: {problem}")
    monkeypatch.setenv(BACKEND_VARIABLE, "bwrap")
    (stack.storage / "algorithms" / "hostile").mkdir(parents=True)
    (stack.storage / "algorithms" / "hostile" / "probe.py").write_text(PROBE)
    api = await stack.up()
    # The victim is another user's job: the attacker's user (its creator's, L1) is not the victim's.
    secret = (stack.home / "auth-secret").read_text().strip()
    other = await TrainyardClient.open(stack.nats_url, token=issue_token(secret, Identity(user="victim-owner",
                                                                                         projects=["default"])))
    victim = await other.submit(JobSpec(name="victim", mode="single-node", nodes=1, flavors=["cpu-1"],
                                      algorithm=AlgorithmRef(name="hostile"), output=OutputRef(name="victim"),
                                      env={"API_KEY": API_KEY},
                                      command="python3 -c 'import time; open(\"/workspace/outputs/v\", \"w\"); "
                                              "print(\"victim up\", flush=True); time.sleep(300)'"))
    await stack.wait_until(victim.job_id, "running")
    async with asyncio.timeout(60):
        while "victim up" not in " ".join(await stack.logs(victim.job_id)):
            await asyncio.sleep(0.2)
    agents = ",".join(str(p.pid) for name, p in stack.processes.processes.items() if name.startswith("agent-"))
    victim_outputs = stack.storage / "outputs" / "victim"
    attacker = await api.submit(JobSpec(
        name="attacker", mode="single-node", nodes=1, flavors=["cpu-1"], algorithm=AlgorithmRef(name="hostile"),
        output=OutputRef(name="attacker"),
        command=f"python3 probe.py {stack.home} {urlsplit(database_url).port} {stack.nats_url} {agents} "
                f"{victim_outputs}"))
    job = await stack.wait_until(attacker.job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    seen = report(await stack.logs(attacker.job_id))

    # An unprivileged user of its own, no groups, no capability now or to gain.
    users = JobUsers()
    uid, euid, gid, groups = seen["ids"]
    assert uid == euid == gid and users.uid_base <= uid < users.uid_base + users.uid_count and groups == []
    # Its creator's user, not the victim's, whose creator is another.
    assert uid == job_uid(users, attacker.job_id, TESTER) != job_uid(users, victim.job_id, "victim-owner")
    assert set(seen["capabilities"].values()) == {"0000000000000000"}
    assert seen["no_new_privs"] == "1"
    # Its own processes only (bwrap's init of its namespace, then the probe): no agent, service, server or victim
    # process, nor the victim's key.
    commands = seen["commands"]
    assert seen["pids"] == [1, 2] and commands[0].startswith(f"{bwrap_program()} "), commands
    assert "probe.py" in commands[1]
    assert seen["victim_key_seen"] == []
    assert all(outcome in ("FileNotFoundError", "PermissionError") for outcome in seen["agent_roots"].values())
    # Nothing of the stack's state (secret, tokens, credentials, passwords), the host's homes, or the victim's files.
    assert not any(seen["paths"].values()), seen["paths"]
    # /root holds only the path to the agent's Python, when the agent's Python lies there (pyenv), read-only.
    assert all(path.startswith(sys.base_prefix) for path in seen["root_home"]), seen["root_home"]
    assert seen["written"] == []  # no write outside its workspace
    # None of the host's cgroup hierarchies or kernel debugging, tracing and security interfaces, even read-only.
    assert not set(seen["mount_types"]) & {"cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf",
                                            "mqueue"}, seen["mount_types"]
    assert (stack.storage / "outputs" / "attacker" / "mine.txt").read_text() == "mine"  # its own outputs are
    # The control plane's servers take no one without a credential.
    assert set(seen["postgres"].values()) <= {"InvalidPasswordError", "InvalidAuthorizationSpecificationError",
                                               "ConnectionRefusedError", "OSError"}, seen["postgres"]
    assert seen["nats"] != "connected"
    await other.stop([victim.job_id])
    await other.close()
    assert not Path(f"{stack.home}/probe").exists()
