"""The AWS EC2 provider (SPEC A5): an instance is an EC2 instance whose user data boots a node agent.

`launch` calls `run_instances` with the type's AMI, instance type, subnet, security groups, key, tags and
market (spot or on-demand), and user data (`boot_script`) that writes the node credential, runs the type's
init script, and starts the agent named after the instance, with its EC2 instance id as a label. Every
instance carries the tags `trainyard:instance` (its name) and `trainyard:cluster`, by which the provider
finds its own instances (`describe_instances`) and ends them (`terminate_instances`); asked to launch a
name it already runs, it answers that instance (EC2's client token makes the call itself idempotent too).

A capacity or quota error (`InsufficientInstanceCapacity`, `InstanceLimitExceeded`, ...) is `NoCapacity`:
the autoscaler cools the type down and tries the next type serving the same flavors. boto3 blocks, so
every call runs in a worker thread. The user data holds the node credential: whoever may read the
instance's attributes may read it, as they may log in to the machine.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from libs.contracts.autoscaling import CPU_ONLY_ENV, INSTANCE_LABEL, INSTANCE_TYPE_LABEL
from libs.contracts.cluster import Ec2Settings, InstanceType
from libs.telemetry.logs import get_logger
from services.autoscaler.providers import NoCapacity, ProvisionError

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = get_logger(__name__)

INSTANCE_TAG = "trainyard:instance"
CLUSTER_TAG = "trainyard:cluster"
INSTANCE_ID_LABEL = "trainyard.ec2-instance-id"
LIVE_STATES = ["pending", "running"]
CAPACITY_ERRORS = frozenset({"InsufficientInstanceCapacity", "InstanceLimitExceeded", "VcpuLimitExceeded",
                             "MaxSpotInstanceCountExceeded", "InsufficientCapacity", "SpotMaxPriceTooLow",
                             "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity"})
# Where the agent's files go on the instance; a played boot (the tests) puts them elsewhere.
BOOT_DEFAULTS = {"TRAINYARD_ETC": "/etc/trainyard", "TRAINYARD_AGENT_ROOT": "/var/lib/trainyard/agents",
                 "TRAINYARD_PYTHON": "python3"}
ClientFactory = Callable[[Ec2Settings], "EC2Client"]


def default_client(settings: Ec2Settings) -> EC2Client:
    return boto3.client("ec2", region_name=settings.region, endpoint_url=settings.endpoint_url)


def boot_script(instance: str, kind: InstanceType, node_token: str, nats_url: str) -> str:
    """The user data: the node credential, the type's init script, then the agent (in the type's image when
    it has one). The instance's id comes from the metadata service (or TRAINYARD_INSTANCE_ID)."""
    node = kind.node
    defaults = "".join(f': "${{{name}:={shlex.quote(value)}}}"\n' for name, value in BOOT_DEFAULTS.items())
    agent = ["-m", "agent", "--name", instance, "--cpus", f"{node.cpus:g}", "--memory-mib", str(node.memory_mib),
             "--root", "$TRAINYARD_AGENT_ROOT"]
    for group in node.accelerators:
        agent += ["--accelerators", ":".join([group.board, str(group.count), *filter(None, [group.driver_version])])]
    for pool in node.pools:
        agent += ["--pool", pool]
    labels = {**node.labels, INSTANCE_LABEL: instance, INSTANCE_TYPE_LABEL: kind.name}
    for key, value in labels.items():
        agent += ["--label", f"{key}={value}"]
    quoted = " ".join(shlex.quote(arg) if not arg.startswith("$") else f'"{arg}"' for arg in agent)
    environment = {"NATS_URL": nats_url, "TRAINYARD_NODE_TOKEN_FILE": "$TRAINYARD_ETC/node-token",
                   **(CPU_ONLY_ENV if kind.cpu_only else {})}
    exports = "".join(f'export {key}="{value}"\n' if value.startswith("$") else f"export {key}={shlex.quote(value)}\n"
                      for key, value in environment.items())
    if kind.image:
        passed = " ".join(f"-e {key}" for key in environment)
        run = (f'exec docker run --rm --network host -v "$TRAINYARD_ETC:$TRAINYARD_ETC:ro" '
               f'-v "$TRAINYARD_AGENT_ROOT:$TRAINYARD_AGENT_ROOT" {passed} {shlex.quote(kind.image)} python3 {quoted} '
               f'--address "$address" --label "{INSTANCE_ID_LABEL}=$instance_id"')
    else:
        run = f'exec "$TRAINYARD_PYTHON" {quoted} --address "$address" --label "{INSTANCE_ID_LABEL}=$instance_id"'
    imds = "http://169.254.169.254/latest"
    return (
        "#!/bin/bash\n"
        "# Trainyard node agent boot: written by the autoscaler.\n"
        "set -euo pipefail\n"
        f"{defaults}"
        'mkdir -p "$TRAINYARD_ETC" "$TRAINYARD_AGENT_ROOT"\n'
        "umask 077\n"
        f"printf %s {shlex.quote(node_token)} > \"$TRAINYARD_ETC/node-token\"\n"
        "umask 022\n"
        'if [ -z "${TRAINYARD_INSTANCE_ID:-}" ]; then\n'
        f'  imds_token=$(curl -sf -X PUT {imds}/api/token -H "X-aws-ec2-metadata-token-ttl-seconds: 300")\n'
        f'  TRAINYARD_INSTANCE_ID=$(curl -sf -H "X-aws-ec2-metadata-token: $imds_token" {imds}/meta-data/instance-id)\n'
        "fi\n"
        'instance_id="$TRAINYARD_INSTANCE_ID"\n'
        'address="${TRAINYARD_ADDRESS:-$(hostname -I | awk \'{print $1}\')}"\n'
        f"{exports}"
        "# The instance type's init script.\n"
        f"{kind.init_script or ':'}\n"
        f"{run}\n"
    )


class Ec2Provider:
    def __init__(self, kinds: Iterable[InstanceType], *, cluster: str, nats_url: str,
                 client: ClientFactory = default_client) -> None:
        self.kinds = [kind for kind in kinds if kind.provider == "aws-ec2" and kind.aws is not None]
        self.cluster = cluster  # tags this deployment's instances: several may share an account
        self.nats_url = nats_url
        self._client = client
        self._clients: dict[tuple[str, str | None], EC2Client] = {}

    def client(self, settings: Ec2Settings) -> EC2Client:
        key = (settings.region, settings.endpoint_url)
        if key not in self._clients:
            self._clients[key] = self._client(settings)
        return self._clients[key]

    def _settings(self) -> list[Ec2Settings]:
        unique = {(k.aws.region, k.aws.endpoint_url): k.aws for k in self.kinds if k.aws is not None}
        return list(unique.values())

    async def launch(self, instance: str, kind: InstanceType, node_token: str) -> str:
        if kind.aws is None:
            raise ProvisionError(f"instance type {kind.name} has no EC2 settings")
        client = self.client(kind.aws)
        running = await self._find(client, instance)
        if running:
            return running[0]  # asked again after a restart: the instance is there already
        try:
            reply = await asyncio.to_thread(client.run_instances, **self.run_arguments(instance, kind, node_token))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in CAPACITY_ERRORS:
                raise NoCapacity(f"EC2 has no capacity for {kind.aws.instance_type}: {code}") from exc
            raise ProvisionError(f"EC2 refused run_instances: {code}: {exc}") from exc
        except BotoCoreError as exc:
            raise ProvisionError(f"EC2 could not be reached: {exc}") from exc
        instance_id = reply["Instances"][0]["InstanceId"]
        log.info("autoscaler.ec2_instance_started", instance=instance, instance_id=instance_id,
                 instance_type=kind.aws.instance_type, spot=kind.aws.spot)
        return instance_id

    def run_arguments(self, instance: str, kind: InstanceType, node_token: str) -> dict[str, Any]:
        aws = kind.aws
        assert aws is not None
        tags = [{"Key": "Name", "Value": instance}, *({"Key": k, "Value": v} for k, v in aws.tags.items()),
                {"Key": INSTANCE_TAG, "Value": instance}, {"Key": CLUSTER_TAG, "Value": self.cluster}]
        arguments: dict[str, Any] = {
            "ImageId": aws.image_id, "InstanceType": aws.instance_type, "MinCount": 1, "MaxCount": 1,
            "UserData": boot_script(instance, kind, node_token, aws.nats_url or self.nats_url),
            "ClientToken": instance[:64],
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}],
        }
        if aws.subnet_id:
            arguments["SubnetId"] = aws.subnet_id
        if aws.security_group_ids:
            arguments["SecurityGroupIds"] = list(aws.security_group_ids)
        if aws.key_name:
            arguments["KeyName"] = aws.key_name
        if aws.spot:
            arguments["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        return arguments

    def _filters(self, instance: str | None = None) -> list[Any]:
        """This deployment's live instances (one of them, by name)."""
        filters = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [self.cluster]},
                   {"Name": "instance-state-name", "Values": LIVE_STATES}]
        if instance is not None:
            filters.append({"Name": f"tag:{INSTANCE_TAG}", "Values": [instance]})
        return filters

    async def _find(self, client: EC2Client, instance: str) -> list[str]:
        """The EC2 ids of the live instance named `instance`."""
        return [instance_id for _, instance_id in await self._described(client, self._filters(instance))]

    async def _described(self, client: EC2Client, filters: list[Any]) -> list[tuple[str, str]]:
        """(name, instance id) of the instances matching `filters`."""
        try:
            pages = await asyncio.to_thread(
                lambda: list(client.get_paginator("describe_instances").paginate(Filters=filters)))
        except (ClientError, BotoCoreError) as exc:
            raise ProvisionError(f"EC2 refused describe_instances: {exc}") from exc
        found = []
        for page in pages:
            for reservation in page.get("Reservations", []):
                for described in reservation.get("Instances", []):
                    tags = {tag["Key"]: tag["Value"] for tag in described.get("Tags", [])}
                    if INSTANCE_TAG in tags:
                        found.append((tags[INSTANCE_TAG], described["InstanceId"]))
        return found

    async def terminate(self, instance: str) -> None:
        for settings in self._settings():
            client = self.client(settings)
            ids = await self._find(client, instance)
            if ids:
                try:
                    await asyncio.to_thread(client.terminate_instances, InstanceIds=ids)
                except (ClientError, BotoCoreError) as exc:
                    raise ProvisionError(f"EC2 refused terminate_instances: {exc}") from exc
                log.info("autoscaler.ec2_instance_terminated", instance=instance, instance_ids=ids)

    async def running(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for settings in self._settings():
            found.update(dict(await self._described(self.client(settings), self._filters())))
        return found
