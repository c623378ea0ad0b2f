"""A real local EC2 endpoint (moto's server) and the boots of its instances, played on this machine.

moto records what `run_instances` was asked, user data included, but runs nothing. `BootPlayer` plays the
part of the machines: for each instance of a cluster that appears, it runs the user data the autoscaler
sent with bash, so the instance's real node agent starts and registers. `interrupt` is a spot
interruption: the instance is terminated at the provider and the machine vanishes with its agent and jobs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

from devstack.stack import REPO_ROOT, end_agent_jobs
from services.autoscaler.providers.ec2 import CLUSTER_TAG, INSTANCE_TAG, LIVE_STATES
from services.autoscaler.providers.local import CONTROL_PLANE_VARIABLES

REGION = "eu-west-1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto server on 127.0.0.1 with test credentials in this process's environment (which the stack's
    processes inherit); its URL."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def ec2_client(moto_url: str):  # type: ignore[no-untyped-def]  # boto3's client type comes from its stubs
    return boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)


def an_image(moto_url: str) -> str:
    """An AMI moto offers."""
    image: str = ec2_client(moto_url).describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return image


def user_data(moto_url: str, instance_id: str) -> str:
    attribute = ec2_client(moto_url).describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attribute["UserData"]["Value"]).decode()


def boot_environment(home: Path, instance_id: str, base: Mapping[str, str]) -> dict[str, str]:
    """What a played boot runs with: `base` without the control plane's secrets (a machine of its own has
    none), its files in a folder of its own under `home`, this interpreter, and its instance id as the
    metadata service would tell it."""
    env = {key: value for key, value in base.items() if key not in CONTROL_PLANE_VARIABLES}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO_ROOT), "TRAINYARD_ETC": str(home / "etc"),
            "TRAINYARD_AGENT_ROOT": str(home / "agents"), "TRAINYARD_PYTHON": sys.executable,
            "TRAINYARD_INSTANCE_ID": instance_id, "TRAINYARD_ADDRESS": "127.0.0.1"}


@dataclass
class Machine:
    instance: str  # the autoscaler's name for it
    instance_id: str
    home: Path
    boot: asyncio.subprocess.Process


@dataclass
class BootPlayer:
    """Plays the boot of every instance of `cluster` the moto server at `moto_url` runs."""

    moto_url: str
    cluster: str
    home: Path
    base_env: Mapping[str, str]
    machines: dict[str, Machine] = field(default_factory=dict)  # by EC2 instance id
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            for instance_id, name in await asyncio.to_thread(self._live):
                if instance_id not in self.machines:
                    await self._play(instance_id, name)
            await asyncio.sleep(0.3)

    def _live(self) -> list[tuple[str, str]]:
        pages = ec2_client(self.moto_url).describe_instances(Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [self.cluster]},
            {"Name": "instance-state-name", "Values": LIVE_STATES}])["Reservations"]
        return [(i["InstanceId"], {t["Key"]: t["Value"] for t in i.get("Tags", [])}.get(INSTANCE_TAG, ""))
                for reservation in pages for i in reservation["Instances"]]

    async def _play(self, instance_id: str, name: str) -> None:
        script = await asyncio.to_thread(user_data, self.moto_url, instance_id)
        home = self.home / instance_id
        home.mkdir(parents=True)
        log = (home / "boot.log").open("ab")
        boot = await asyncio.create_subprocess_exec(
            "bash", "-c", script, env=boot_environment(home, instance_id, self.base_env), cwd=home,
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        log.close()
        self.machines[instance_id] = Machine(name, instance_id, home, boot)

    def machine(self, instance: str) -> Machine:
        return next(m for m in self.machines.values() if m.instance == instance)

    async def vanish(self, machine: Machine) -> None:
        """The machine is gone: its agent and every job it ran end at once (kill -9)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(machine.boot.pid, signal.SIGKILL)
        await machine.boot.wait()
        await asyncio.to_thread(end_agent_jobs, [machine.instance], machine.home / "agents")

    async def interrupt(self, instance: str) -> str:
        """A spot interruption of `instance`: terminated at the provider, and its machine vanishes. Its id."""
        machine = self.machine(instance)
        await asyncio.to_thread(ec2_client(self.moto_url).terminate_instances, InstanceIds=[machine.instance_id])
        await self.vanish(machine)
        return machine.instance_id

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for machine in self.machines.values():
            await self.vanish(machine)
