"""The autoscaler's rules (SPEC A1, A4, A5): an instance is ready only when its agent registers with what
its type promises, a type without capacity cools down longer after each failure, an instance whose agent
never registers is ended, and a local instance's agent sees no control-plane secret."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from libs.contracts.cluster import (
    Accelerators,
    AutoscalerConfig,
    Ec2Settings,
    InstanceNode,
    InstanceType,
    NodeInfo,
)
from libs.contracts.events import (
    EventEnvelope,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceRequested,
    JobAdmitted,
    JobSubmitted,
    JobSucceeded,
    NodeDrained,
    NodeRegistered,
    Placement,
    ProvisionFailed,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from services.autoscaler.providers import ProvisionError
from services.autoscaler.providers.ec2 import boot_script
from services.autoscaler.providers.local import LocalProvider, agent_command, agent_environment
from services.autoscaler.rules import drained, drains, launch_failed, overdue, registered
from services.autoscaler.state import AutoscalerState
from tests.support.autoscaling import AT, CLUSTER, GPU


def envelope(event: object, service: str = "autoscaler", at: datetime = AT, position: int = 1) -> EventEnvelope:
    return msgspec.convert({"event_id": f"e{position}", "service": service, "aggregate_type": "instance",
                            "aggregate_id": "x", "version": 1, "position": position, "recorded_at": at,
                            "event": msgspec.to_builtins(event)}, EventEnvelope)


def state_with(*events: object) -> AutoscalerState:
    state = AutoscalerState()
    for position, event in enumerate(events, start=1):
        state.apply(envelope(event, position=position))
    return state


ASKED = InstanceRequested(instance="gpu-1a2b3c", instance_type="gpu", provider="local", jobs=["job-1"])


def node(**changes: object) -> NodeInfo:
    base = NodeInfo(name="gpu-1a2b3c", address="10.0.0.9", cpus=8, memory_mib=32768,
                    accelerators=[Accelerators(board="a100", count=2)])
    return msgspec.structs.replace(base, **changes)


def test_an_instance_is_ready_when_its_agent_registers_with_what_its_type_promises() -> None:
    state = state_with(ASKED)
    [ready] = registered(state, CLUSTER, envelope(NodeRegistered(node=node()), service="monitor"))
    assert (ready.aggregate_id, type(ready.event).__name__) == ("gpu-1a2b3c", "InstanceReady")


@pytest.mark.parametrize("changes", [{"accelerators": []}, {"cpus": 4}, {"name": "someone-else"}],
                         ids=["no boards", "fewer CPUs", "another node"])
def test_a_node_short_of_its_types_promise_does_not_make_it_ready(changes: dict[str, object]) -> None:
    state = state_with(ASKED)
    assert registered(state, CLUSTER, envelope(NodeRegistered(node=node(**changes)), service="monitor")) == []


def test_a_type_without_capacity_waits_longer_after_each_failure_and_no_longer_than_ten_minutes() -> None:
    waits = []
    state = AutoscalerState()
    for attempt in range(8):
        name = f"gpu-{attempt:06x}"
        state.apply(envelope(InstanceRequested(instance=name, instance_type="gpu", provider="local"), position=attempt))
        [failed] = launch_failed(state, name, "InsufficientInstanceCapacity", capacity=True, now=AT)
        assert isinstance(failed.event, ProvisionFailed) and failed.event.retry_after is not None
        assert failed.event.failures == attempt + 1  # in a row: the monitor alerts on a streak
        waits.append(failed.event.retry_after - AT)
        state.apply(envelope(failed.event, position=100 + attempt))
    assert waits[:4] == [timedelta(seconds=30), timedelta(seconds=60), timedelta(seconds=120), timedelta(seconds=240)]
    assert waits[-1] == timedelta(minutes=10)
    assert state.cooling(AT + timedelta(minutes=9)) == {"gpu"}
    state.apply(envelope(InstanceRequested(instance="gpu-ok", instance_type="gpu", provider="local"), position=200))
    state.apply(envelope(InstanceLaunched(instance="gpu-ok", provider_id="local-1"), position=201))
    assert state.cooling(AT) == set()  # the provider had capacity again


def test_a_type_whose_instances_cannot_boot_cools_down_too() -> None:
    state = state_with(ASKED)
    [failed] = launch_failed(state, "gpu-1a2b3c", "the init script exited with code 1", capacity=False, now=AT)
    assert isinstance(failed.event, ProvisionFailed) and failed.event.retry_after == AT + timedelta(seconds=30)


def test_an_instance_whose_agent_never_registers_is_overdue_after_the_boot_timeout() -> None:
    state = state_with(ASKED)
    assert overdue(state, CLUSTER.autoscaler, AT + timedelta(seconds=300)) == []
    assert [i.name for i in overdue(state, CLUSTER.autoscaler, AT + timedelta(seconds=301))] == ["gpu-1a2b3c"]


def test_a_local_instances_agent_gets_its_credential_and_no_control_plane_secret(tmp_path: Path) -> None:
    environ = {"PATH": "/usr/bin", "DATABASE_URL": "postgresql://x", "TRAINYARD_AUTH_SECRET_FILE": "/s",
               "TRAINYARD_NATS_PASSWORD_FILE": "/p", "NATS_URL": "nats://127.0.0.1:4222"}
    cpu_only = msgspec.structs.replace(GPU, cpu_only=True, node=msgspec.structs.replace(GPU.node, accelerators=[]))
    env = agent_environment(environ, cpu_only, tmp_path / "token")
    assert env == {"PATH": "/usr/bin", "NATS_URL": "nats://127.0.0.1:4222",
                   "TRAINYARD_NODE_TOKEN_FILE": str(tmp_path / "token"), "CUDA_VISIBLE_DEVICES": "none"}
    argv = agent_command("gpu-1a2b3c", GPU, tmp_path)
    assert argv[argv.index("--accelerators") + 1] == "a100:2"
    assert "trainyard.instance=gpu-1a2b3c" in argv and "trainyard.instance-type=gpu" in argv


async def test_a_failing_init_script_fails_the_launch_and_starts_no_agent(tmp_path: Path) -> None:
    provider = LocalProvider(tmp_path)
    failing = msgspec.structs.replace(GPU, init_script="echo preparing; exit 3")
    with pytest.raises(ProvisionError, match="init script exited with code 3"):
        await provider.launch("gpu-1a2b3c", failing, "token")
    assert (tmp_path / "gpu-1a2b3c" / "init.log").read_text() == "preparing\n"
    assert await provider.running() == {}


# --- A3: idle instances are drained, then released only if still idle ---------------------------------------

CPU = InstanceType(name="small", provider="local", flavors=["gpu-1"], idle_seconds=60,
                   node=InstanceNode(cpus=8, memory_mib=32768, accelerators=[Accelerators(board="a100", count=2)]))
SCALED = AutoscalerConfig(instance_types=[CPU])
READY_AT = AT


def ready_instance() -> AutoscalerState:
    state = state_with(InstanceRequested(instance="small-1", instance_type="small", provider="local"),
                       InstanceLaunched(instance="small-1", provider_id="local-1"))
    state.apply(envelope(InstanceReady(instance="small-1", node="small-1"), at=READY_AT, position=3))
    return state


def scheduler(state: AutoscalerState, event: object, at: datetime, position: int) -> None:
    aggregate = getattr(event, "job_id", None) or getattr(event, "node_name", "")
    state.apply_scheduler(msgspec.convert(
        {"event_id": f"s{position}", "service": "scheduler", "aggregate_type": "drain" if isinstance(event, NodeDrained)
         else "job", "aggregate_id": aggregate, "version": position, "position": position, "recorded_at": at,
         "event": msgspec.to_builtins(event)}, EventEnvelope))


SPEC = JobSpec(name="j", flavors=["gpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
               output=OutputRef(name="o"))
ON_IT = [Placement(rank=0, node="small-1", address="a", slots=1)]


def test_an_instance_idle_for_its_types_idle_time_is_drained_not_released() -> None:
    state = ready_instance()
    assert drains(state, SCALED, READY_AT + timedelta(seconds=59)) == []
    [draining] = drains(state, SCALED, READY_AT + timedelta(seconds=60))
    assert isinstance(draining.event, InstanceDraining) and draining.event.idle_since == READY_AT
    state.apply(envelope(draining.event, position=4))
    assert drained(state) == ([], [])  # released only once the scheduler acknowledged the drain


def test_idle_time_counts_from_the_last_job_that_held_it() -> None:
    state = ready_instance()
    scheduler(state, JobSubmitted(job_id="job-1", spec=SPEC, creator="alice"), AT, 1)
    scheduler(state, JobAdmitted(job_id="job-1", attempt=1, flavor="gpu-1", placement=ON_IT), AT, 2)
    assert drains(state, SCALED, AT + timedelta(hours=1)) == []  # busy: never released
    scheduler(state, JobSucceeded(job_id="job-1"), AT + timedelta(minutes=30), 3)
    assert drains(state, SCALED, AT + timedelta(minutes=30, seconds=59)) == []
    assert len(drains(state, SCALED, AT + timedelta(minutes=31))) == 1


def test_a_drained_instance_still_idle_is_released_and_one_a_job_took_first_is_kept() -> None:
    idle, taken = ready_instance(), ready_instance()
    for state in (idle, taken):
        state.apply(envelope(InstanceDraining(instance="small-1", node="small-1", idle_since=AT), position=4))
    # The scheduler admitted a job to it before it folded the drain: the admission precedes its NodeDrained.
    scheduler(taken, JobSubmitted(job_id="job-1", spec=SPEC, creator="alice"), AT, 1)
    scheduler(taken, JobAdmitted(job_id="job-1", attempt=1, flavor="gpu-1", placement=ON_IT), AT, 2)
    for state in (idle, taken):
        scheduler(state, NodeDrained(node_name="small-1", instance="small-1"), AT, 3)

    assert [i.name for i in drained(idle)[1]] == ["small-1"] and drained(idle)[0] == []
    [kept], released = drained(taken)
    assert isinstance(kept.event, InstanceKept) and released == []
    taken.apply(envelope(kept.event, position=5))
    assert drained(taken) == ([], [])  # not released until drained again once idle


def test_an_ec2_boot_writes_the_credential_runs_the_init_script_then_the_agent_in_the_types_image() -> None:
    kind = msgspec.structs.replace(GPU, provider="aws-ec2", cpu_only=False, image="trainyard/agent:1.4",
                                   init_script="apt-get install -y nvidia-driver-535",
                                   aws=Ec2Settings(image_id="ami-1", instance_type="g5.xlarge"))
    script = boot_script("gpu-1a2b3c", kind, "the-node-token", "nats://10.0.0.5:4222")
    lines = script.splitlines()
    token, init, run = (next(i for i, line in enumerate(lines) if marker in line)
                        for marker in ("the-node-token", "apt-get install", "docker run"))
    assert token < init < run == len(lines) - 1
    assert "--network host" in lines[run] and "trainyard/agent:1.4 python3 -m agent --name gpu-1a2b3c" in lines[run]
    assert "export NATS_URL=nats://10.0.0.5:4222" in lines
    cpu_only = msgspec.structs.replace(kind, image=None, cpu_only=True,
                                       node=msgspec.structs.replace(kind.node, accelerators=[]))
    assert "export CUDA_VISIBLE_DEVICES=none" in boot_script("cpu-1", cpu_only, "t", "nats://n:4222").splitlines()
