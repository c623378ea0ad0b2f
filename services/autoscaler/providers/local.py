"""The local provider (SPEC A5): an instance is a node agent started as a process on this machine.

Each instance gets a folder under TRAINYARD_LOCAL_INSTANCES (default `.trainyard/instances`): its node
credential, the output of its init script and its agent, and `instance.json` (the agent's process id).
The type's init script runs first (in that folder, under bash); then the agent starts in a session of its
own, presenting the type's CPUs, memory, boards, pools and labels, and keeps running whatever happens to
the autoscaler. A CPU-only type's agent, and so its jobs, get CUDA_VISIBLE_DEVICES=none (A4).

The agent gets the machine's environment without the control plane's secrets (the database, the
services' NATS passwords, the signing secret): it logs in with its own node credential only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

from libs.contracts.autoscaling import CPU_ONLY_ENV
from libs.contracts.cluster import InstanceType
from libs.settings import DATABASE_VARIABLES, LOCAL_INSTANCES_VARIABLE
from libs.telemetry.logs import get_logger
from services.autoscaler.providers import ProvisionError

log = get_logger(__name__)

RECORD = "instance.json"
INIT_SCRIPT_SECONDS = 600.0
# What an agent must never see: it speaks NATS with its node credential alone.
CONTROL_PLANE_VARIABLES = (*DATABASE_VARIABLES, "TRAINYARD_AUTH_SECRET", "TRAINYARD_AUTH_SECRET_FILE",
                           "TRAINYARD_TOKEN_FILE", "TRAINYARD_NATS_PASSWORD", "TRAINYARD_NATS_PASSWORD_FILE",
                           "TRAINYARD_NATS_ISSUER_SEED_FILE", "TRAINYARD_NODE_TOKEN", "TRAINYARD_NODE_TOKEN_FILE")


class Started(msgspec.Struct, frozen=True):
    pid: int  # the agent's, which leads its process group


def agent_environment(environ: Mapping[str, str], kind: InstanceType, token_file: Path) -> dict[str, str]:
    env = {key: value for key, value in environ.items() if key not in CONTROL_PLANE_VARIABLES}
    env["TRAINYARD_NODE_TOKEN_FILE"] = str(token_file)
    if kind.cpu_only:
        env.update(CPU_ONLY_ENV)
    return env


def agent_command(instance: str, kind: InstanceType, root: Path) -> list[str]:
    node = kind.node
    argv = [sys.executable, "-m", "agent", "--name", instance, "--address", "127.0.0.1", "--cpus", f"{node.cpus:g}",
            "--memory-mib", str(node.memory_mib), "--root", str(root)]
    for group in node.accelerators:
        argv += ["--accelerators", ":".join([group.board, str(group.count), *filter(None, [group.driver_version])])]
    for pool in node.pools:
        argv += ["--pool", pool]
    for key, value in {**node.labels, "trainyard.instance": instance, "trainyard.instance-type": kind.name}.items():
        argv += ["--label", f"{key}={value}"]
    return argv


def _log_file(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalProvider:
    def __init__(self, folder: Path | None = None, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.folder = (folder or Path(self.environ.get(LOCAL_INSTANCES_VARIABLE, ".trainyard/instances"))).resolve()

    def _started(self, instance: str) -> Started | None:
        record = self.folder / instance / RECORD
        try:
            started = msgspec.json.decode(record.read_bytes(), type=Started)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return started if _alive(started.pid) else None

    async def launch(self, instance: str, kind: InstanceType, node_token: str) -> str:
        if (started := self._started(instance)) is not None:
            return f"local-{started.pid}"  # started before the autoscaler restarted
        home = self.folder / instance
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        token_file = home / "node-token"
        token_file.touch(mode=0o600)
        token_file.write_text(node_token)
        env = agent_environment(self.environ, kind, token_file)
        if kind.init_script:
            await self._init(home, kind.init_script, env)
        output = _log_file(home / "agent.log")
        try:
            process = await asyncio.create_subprocess_exec(
                *agent_command(instance, kind, home / "agents"), cwd=os.getcwd(), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output, start_new_session=True)
        finally:
            os.close(output)
        (home / RECORD).write_bytes(msgspec.json.encode(Started(pid=process.pid)))
        log.info("autoscaler.local_instance_started", instance=instance, pid=process.pid)
        return f"local-{process.pid}"

    async def _init(self, home: Path, script: str, env: dict[str, str]) -> None:
        output = _log_file(home / "init.log")
        try:
            process = await asyncio.create_subprocess_exec(
                "bash", "-euo", "pipefail", "-c", script, cwd=home, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=output, stderr=output, start_new_session=True)
        finally:
            os.close(output)
        try:
            code = await asyncio.wait_for(process.wait(), INIT_SCRIPT_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise ProvisionError(f"the init script ran longer than {INIT_SCRIPT_SECONDS:g}s") from None
        if code != 0:
            raise ProvisionError(f"the init script exited with code {code}; see {home / 'init.log'}")

    async def terminate(self, instance: str) -> None:
        home = self.folder / instance
        if (started := self._started(instance)) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGTERM)
            for _ in range(100):
                if not _alive(started.pid):
                    break
                await asyncio.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGKILL)
        if home.exists():
            # The jobs an agent leaves running end with the instance, as they would with a machine.
            ending = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "--name", instance, "--root", str(home / "agents"), "--end-jobs",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL)
            await ending.wait()
            shutil.rmtree(home, ignore_errors=True)
        log.info("autoscaler.local_instance_ended", instance=instance)

    async def running(self) -> dict[str, str]:
        if not self.folder.is_dir():
            return {}
        return {home.name: f"local-{started.pid}" for home in sorted(self.folder.iterdir())
                if (started := self._started(home.name)) is not None}


async def end_all(folder: Path) -> list[str]:
    """End every instance in `folder`, and their jobs: the local stack went down."""
    provider = LocalProvider(folder)
    names = [home.name for home in sorted(folder.iterdir()) if home.is_dir()] if folder.is_dir() else []
    # Side by side: each waits for its agent to go, then for a Python that ends its jobs.
    await asyncio.gather(*(provider.terminate(name) for name in names))
    return names


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.autoscaler.providers.local",
                                     description="End the local provider's instances (make down does).")
    parser.add_argument("--end-all", type=Path, required=True, metavar="FOLDER", help="the instances' folder")
    args = parser.parse_args()
    ended = asyncio.run(end_all(args.end_all))
    print(f"ended {len(ended)} local instance(s)")


if __name__ == "__main__":
    main()
