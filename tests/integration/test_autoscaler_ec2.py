"""The EC2 provider (SPEC A5) against a real moto server: instances started with the type's settings and tags,
found and ended by their tags, started once per name, and a capacity error told apart. The instance's boot is
played: the user data the provider sent runs here, and a real node agent registers for that instance."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from botocore.stub import Stubber
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.auth import issue_node_token
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.autoscaling import INSTANCE_LABEL
from libs.contracts.cluster import Accelerators, Ec2Settings, InstanceNode, InstanceType
from libs.contracts.codec import decode_any, encode
from libs.contracts.operations.agents import REGISTER_NODE
from services.autoscaler.providers import NoCapacity, ProvisionError
from services.autoscaler.providers.ec2 import CLUSTER_TAG, INSTANCE_ID_LABEL, INSTANCE_TAG, Ec2Provider
from tests.support.ec2 import an_image, boot_environment, ec2_client, moto_server, user_data

pytestmark = pytest.mark.asyncio(loop_scope="session")

SECRET = "ec2-provider-tests-" * 3


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_server() as url:
        yield url


def gpu_type(moto_url: str, **changes: object) -> InstanceType:
    image = an_image(moto_url)
    kind = InstanceType(
        name="gpu", provider="aws-ec2", flavors=["gpu-1"], init_script='echo "init ran" > "$TRAINYARD_ETC/init-ran"',
        node=InstanceNode(cpus=4, memory_mib=8192, accelerators=[Accelerators(board="a100", count=1)],
                          labels={"team": "ml"}),
        aws=Ec2Settings(image_id=image, instance_type="g5.xlarge", region="eu-west-1", endpoint_url=moto_url,
                        key_name="ops", tags={"cost-center": "research"}, spot=True))
    return msgspec.structs.replace(kind, **changes)


async def test_an_instance_is_started_with_its_types_settings_and_found_and_ended_by_its_tags(moto_url: str) -> None:
    kind = gpu_type(moto_url)
    provider = Ec2Provider([kind], cluster="tests-a", nats_url="nats://10.0.0.1:4222")
    instance_id = await provider.launch("gpu-0a0b0c", kind, "node-token")
    assert await provider.launch("gpu-0a0b0c", kind, "node-token") == instance_id  # asked again: the same one

    client = ec2_client(moto_url)
    described = client.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    tags = {tag["Key"]: tag["Value"] for tag in described["Tags"]}
    assert tags[INSTANCE_TAG] == "gpu-0a0b0c" and tags[CLUSTER_TAG] == "tests-a"
    assert tags["cost-center"] == "research" and tags["Name"] == "gpu-0a0b0c"
    assert (described["InstanceType"], described["KeyName"]) == ("g5.xlarge", "ops")
    assert await provider.running() == {"gpu-0a0b0c": instance_id}
    other_cluster = Ec2Provider([kind], cluster="tests-b", nats_url="nats://10.0.0.1:4222")
    assert await other_cluster.running() == {}  # another deployment's instances are not its own

    await provider.terminate("gpu-0a0b0c")
    state = client.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated")
    assert await provider.running() == {}


async def test_a_capacity_error_is_told_apart_from_other_refusals(moto_url: str) -> None:
    kind = gpu_type(moto_url)
    provider = Ec2Provider([kind], cluster="tests-c", nats_url="nats://10.0.0.1:4222")
    assert kind.aws is not None
    client = provider.client(kind.aws)
    with Stubber(client) as stubber:
        stubber.add_response("describe_instances", {"Reservations": []})
        stubber.add_client_error("run_instances", service_error_code="InsufficientInstanceCapacity",
                                 service_message="We currently do not have sufficient g5.xlarge capacity")
        with pytest.raises(NoCapacity, match="InsufficientInstanceCapacity"):
            await provider.launch("gpu-1a1b1c", kind, "node-token")
        stubber.add_response("describe_instances", {"Reservations": []})
        stubber.add_client_error("run_instances", service_error_code="InvalidAMIID.NotFound")
        with pytest.raises(ProvisionError, match=r"InvalidAMIID\.NotFound") as refused:
            await provider.launch("gpu-1a1b1c", kind, "node-token")
        assert not isinstance(refused.value, NoCapacity)


async def test_the_played_boot_of_an_instance_runs_its_init_script_and_its_agent_registers(
        moto_url: str, nc: Client, nats_url: str, tmp_path: Path) -> None:
    kind = gpu_type(moto_url)
    provider = Ec2Provider([kind], cluster="tests-d", nats_url=nats_url)
    instance = "gpu-2a2b2c"
    instance_id = await provider.launch(instance, kind, issue_node_token(SECRET, instance))
    script = user_data(moto_url, instance_id)

    registered: asyncio.Future[RegisterNode] = asyncio.get_running_loop().create_future()

    async def accept(msg: Msg) -> None:  # the monitor's part of registration
        request = decode_any(msg.data, RegisterNode)
        if request.node.name == instance and not registered.done():
            registered.set_result(request)
        await msg.respond(encode(NodeAccepted(heartbeat_seconds=1.0)))

    registrar = await nc.subscribe(REGISTER_NODE.subject, cb=accept)
    # The boot as the instance would run it, with its files in the test's folder and this interpreter.
    env = {**boot_environment(tmp_path, instance_id, {"PATH": os.environ["PATH"]}),
           "TRAINYARD_WORKSPACE_BACKEND": "plain", "TRAINYARD_STORAGE": str(tmp_path / "storage")}
    boot = await asyncio.create_subprocess_exec("bash", "-c", script, env=env, cwd=tmp_path,
                                                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
    try:
        request = await asyncio.wait_for(registered, 60)
    finally:
        boot.terminate()
        await boot.wait()
        await registrar.unsubscribe()
    node = request.node
    assert (node.cpus, node.memory_mib, node.accelerators[0].board) == (4, 8192, "a100")
    assert node.labels[INSTANCE_LABEL] == instance and node.labels[INSTANCE_ID_LABEL] == instance_id
    assert node.labels["team"] == "ml"
    assert (tmp_path / "etc" / "init-ran").read_text() == "init ran\n"
    assert oct((tmp_path / "etc" / "node-token").stat().st_mode & 0o777) == "0o600"
