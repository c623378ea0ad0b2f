"""The local stack: servers, the four services and the node agents as separate processes.

`python -m devstack up` starts everything under `.trainyard/` (or $TRAINYARD_HOME) and leaves
it running, the services and agents under a supervisor (`supervisor.py`) that restarts them; `down`
stops it (`python -m client.demo` runs the example job on it). The whole-stack harness (`harness.py`)
uses `ProcessSet` to run the same processes unsupervised, and kill and restart them at will.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devstack.natslogins import nats_login_env
from devstack.pglogins import database_login_env
from devstack.servers import postgres_url
from libs.localstack import home_dir, read_stack_env
from libs.settings import DATABASE_VARIABLES, LOCAL_INSTANCES_VARIABLE

SERVICES = ("scheduler", "launcher", "monitor", "autoscaler")
REPO_ROOT = Path(__file__).resolve().parents[1]


NATS_PORT = int(os.environ.get("TRAINYARD_NATS_PORT", "14222"))
PG_PORT = int(os.environ.get("TRAINYARD_PG_PORT", "15432"))
LOCAL_NATS_URL = f"nats://127.0.0.1:{NATS_PORT}"
LOCAL_DATABASE_URL = f"postgresql://postgres@127.0.0.1:{PG_PORT}/trainyard"


def local_socket_url(home: Path) -> str:
    """LOCAL_DATABASE_URL through the Unix socket of the stack's own PostgreSQL, as its processes connect (each as
    its own role: devstack/pglogins.py)."""
    return postgres_url(PG_PORT, "trainyard", socket_dir=home / "postgres")


def local_stack_urls() -> set[str]:
    """The addresses of the local stack's own servers, whether it runs now or not."""
    return {LOCAL_NATS_URL, LOCAL_DATABASE_URL, local_socket_url(home_dir()), *read_stack_env().values()}


def service_argv(name: str) -> list[str]:
    return [sys.executable, "-m", f"services.{name}"]


def agent_argv(node: str, cluster: Path, root: Path) -> list[str]:
    return [sys.executable, "-m", "agent", "--name", node, "--config", str(cluster), "--root", str(root)]


def end_platform(nodes: Iterable[str], home: Path) -> None:
    """What a stack that went down leaves: the jobs its agents left running, and the instances its autoscaler
    started on this machine (agents of their own, with their jobs)."""
    end_agent_jobs(nodes, home / "agents")
    instances = home / "instances"
    if instances.is_dir() and any(instances.iterdir()):
        subprocess.run([sys.executable, "-m", "services.autoscaler.providers.local", "--end-all", str(instances)],
                       cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=300, check=False)


def end_agent_jobs(nodes: Iterable[str], root: Path) -> None:
    """End the jobs the agents of `nodes` left running: a stopped agent leaves them to the next one."""
    ending = [subprocess.Popen([sys.executable, "-m", "agent", "--name", node, "--root", str(root), "--end-jobs"],
                               cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
              for node in nodes]
    for process in ending:
        process.wait(timeout=60)


@dataclass
class ProcessSet:
    """Named child processes with logs in `home/logs` and pid files in `home/run`."""

    home: Path
    env: Mapping[str, str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None, *,
              withhold: Iterable[str] = ()) -> subprocess.Popen[bytes]:
        """Start `argv` with the set's environment and `env` (this process's own, e.g. a node credential), less the
        variables named in `withhold`, wherever they come from (this process's own environment included)."""
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        (self.home / "run").mkdir(parents=True, exist_ok=True)
        withheld = set(withhold)
        environment = {key: value for key, value in {**os.environ, **self.env, **(env or {})}.items()
                       if key not in withheld}
        with (self.home / "logs" / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(argv, cwd=REPO_ROOT, env=environment, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = process
        (self.home / "run" / f"{name}.pid").write_text(str(process.pid))
        return process

    def send(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to one process and leave it be (SIGSTOP, SIGCONT)."""
        self.processes[name].send_signal(sig)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal one process (SIGKILL by default: a crash, not a shutdown) and reap it."""
        process = self.processes.pop(name)
        process.send_signal(sig)
        process.wait(timeout=30)

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self, timeout: float = 15.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()


def stack_env(*, nats_url: str, storage: Path, cluster: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every process's variables; the autoscaler's local instances live beside the shared storage. No database
    variable: each service gets its own login (`start_service`), and nothing else gets any."""
    return {"NATS_URL": nats_url, "TRAINYARD_STORAGE": str(storage),
            "TRAINYARD_CLUSTER": str(cluster), LOCAL_INSTANCES_VARIABLE: str(storage.parent / "instances"),
            "PYTHONUNBUFFERED": "1", **(extra or {})}


def provision_auth(home: Path, *, user: str | None = None, email: str | None = None) -> dict[str, str]:
    """A signing secret for this stack and an administrator token for its user, kept under `home`.

    Services read the secret from TRAINYARD_AUTH_SECRET_FILE; clients find the token through
    TRAINYARD_TOKEN_FILE in stack.env (see client.config.default_token). Agents hide all of `home` from
    jobs (TRAINYARD_HIDDEN_PATHS): the secret, tokens, stack.env, the servers' data and logs.
    """
    from libs.auth import issue_token, new_secret
    from libs.contracts.identity import Identity

    home.mkdir(parents=True, exist_ok=True)
    secret_file, token_file = home / "auth-secret", home / "token"
    if not secret_file.exists():
        secret_file.touch(mode=0o600)
        secret_file.write_text(new_secret())
    token = issue_token(secret_file.read_text().strip(),
                        Identity(user=user or getpass.getuser(), projects=["default"], admin=True, email=email))
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    return {"TRAINYARD_AUTH_SECRET_FILE": str(secret_file), "TRAINYARD_TOKEN_FILE": str(token_file),
            "TRAINYARD_HIDDEN_PATHS": str(home.resolve())}


def provision_node_token(home: Path, node: str, secret_file: Path) -> dict[str, str]:
    """A node credential for `node`'s agent in `home/node-tokens/<node>` (mode 0600), signed with the stack's
    secret: the agent's TRAINYARD_NODE_TOKEN_FILE. Like all of `home`, jobs cannot see it."""
    from libs.auth import issue_node_token

    folder = home / "node-tokens"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_file = folder / node
    token_file.touch(mode=0o600)
    token_file.write_text(issue_node_token(secret_file.read_text().strip(), node))
    return {"TRAINYARD_NODE_TOKEN_FILE": str(token_file)}


def start_service(processes: ProcessSet, name: str, instance: str | None = None) -> subprocess.Popen[bytes]:
    """Start service `name` with its own NATS login, when the stack provisioned one, and its own database login
    (devstack/pglogins.py); `instance` names the process (logs/<instance>.log) when several of the service
    run (one acts, the others stand by)."""
    env = {**nats_login_env(processes.home, name), **database_login_env(processes.home, name)}
    return processes.start(instance or name, service_argv(name), env=env)


# What the gateway is not given: it acts with each caller's token only, so it holds no secret of the platform.
GATEWAY_WITHHELD = (*DATABASE_VARIABLES, "TRAINYARD_AUTH_SECRET", "TRAINYARD_AUTH_SECRET_FILE", "TRAINYARD_TOKEN",
                    "TRAINYARD_TOKEN_FILE", "TRAINYARD_NATS_PASSWORD", "TRAINYARD_NATS_PASSWORD_FILE",
                    "TRAINYARD_NATS_ISSUER_SEED_FILE")


def signin_links(home: Path) -> Path:
    """Where the stack leaves one-time sign-in links for the console (services/gateway/console/links.py)."""
    return home / "run" / "signin-links"


def start_gateway(processes: ProcessSet, address: str) -> subprocess.Popen[bytes]:
    """Start the gateway (the HTTP API and the console) on `address`: it logs in to NATS with each caller's token
    only, and gets no database URL, password, signing secret or token of its own."""
    env = {"TRAINYARD_HTTP_ADDRESS": address, "TRAINYARD_SIGNIN_LINKS": str(signin_links(processes.home))}
    return processes.start("gateway", service_argv("gateway"), env=env, withhold=GATEWAY_WITHHELD)


def start_agent(processes: ProcessSet, node: str, cluster: Path, agents_root: Path,
                host: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start `node`'s agent with a fresh node credential of its own, signed with the set's secret file; `host` is
    what runs a command on the node's own host (devstack/hosts.py), if it has one. An agent gets no database
    URL or password, even one in the caller's environment: it speaks NATS alone."""
    secret_file = Path(processes.env.get("TRAINYARD_AUTH_SECRET_FILE", processes.home / "auth-secret"))
    return processes.start(f"agent-{node}", [*(host or []), *agent_argv(node, cluster, agents_root)],
                           env=provision_node_token(processes.home, node, secret_file), withhold=DATABASE_VARIABLES)


def seed_storage(storage: Path, examples: Path = REPO_ROOT / "examples") -> None:
    """Copy the example algorithms and datasets into shared storage (refreshing older copies)."""
    for kind in ("algorithms", "datasets"):
        source = examples / kind
        if not source.is_dir():
            continue
        for item in source.iterdir():
            target = storage / kind / item.name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(item, target)
    (storage / "outputs").mkdir(parents=True, exist_ok=True)
