"""A job the scheduler archives (JobArchived) leaves the autoscaler whole, and so does an ended instance once every
job it was asked for has, with its node, its idle time and the version of its log. What every decision and the gauge
look at is kept as the fold goes: the jobs not ended, the instances not ended and their count per type and state.
Jobs still under way and live instances are untouched by another job's archival."""

from __future__ import annotations

import asyncio
from dataclasses import fields
from types import SimpleNamespace
from typing import Any, cast

import pytest

from libs.contracts.cluster import (
    Accelerators,
    InstanceType,
    NodeInfo,
)
from libs.contracts.events import (
    Event,
    EventEnvelope,
    InstanceDraining,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobAdmitted,
    JobArchived,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    NodeDrained,
    NodeRegistered,
    NodeRetired,
    Placement,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.eventstore import EventStore
from services.autoscaler import service as autoscaler_service
from services.autoscaler.rules import released
from services.autoscaler.service import Autoscaler
from services.autoscaler.state import AutoscalerState
from tests.support.autoscaling import AT, CLUSTER
from tests.support.eventlog import EventLog, FakeStore, fake_runtime

SPEC = JobSpec(name="j", flavors=["gpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
               output=OutputRef(name="o"))
JOB, OTHER = "job-1", "job-2"


def gpu_node(name: str) -> NodeInfo:
    return NodeInfo(name=name, address="10.0.0.9", cpus=8, memory_mib=32768,
                    accelerators=[Accelerators(board="a100", count=2)])


def on(node: str) -> list[Placement]:
    return [Placement(rank=0, node=node, address="10.0.0.9", slots=1)]


class Folds:
    """The autoscaler's state fed its own events, the scheduler's and the monitor's, each numbered in one log."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.left: list[str] = []
        self.state = AutoscalerState(instance_left=self.left.append)

    def own(self, event: Event) -> None:
        self.state.apply(self.log.record("autoscaler", "instance", getattr(event, "instance", ""), event))

    def scheduler(self, event: Event) -> None:
        kind = "drain" if isinstance(event, NodeDrained) else "job"
        aggregate = event.node_name if isinstance(event, NodeDrained) else getattr(event, "job_id", "")
        self.state.apply_scheduler(self.log.record("scheduler", kind, aggregate, event))

    def monitor(self, event: Event) -> None:
        self.state.apply_monitor(self.log.record("monitor", "node", getattr(event, "node_name", ""), event))

    def run_on_an_instance(self, job_id: str, instance: str) -> None:
        """The job's whole life up to its end, on an instance asked for it that is released afterwards."""
        self.scheduler(JobSubmitted(job_id=job_id, spec=SPEC, creator="alice"))
        self.ask(instance, job_id)
        self.scheduler(JobAdmitted(job_id=job_id, attempt=1, flavor="gpu-1", placement=on(instance)))
        self.scheduler(JobSucceeded(job_id=job_id))

    def ask(self, instance: str, job_id: str) -> None:
        self.own(InstanceRequested(instance=instance, instance_type="gpu", provider="local", jobs=[job_id]))
        self.own(InstanceLaunched(instance=instance, provider_id=f"p-{instance}"))
        self.monitor(NodeRegistered(node=gpu_node(instance)))
        self.own(InstanceReady(instance=instance, node=instance))

    def release(self, instance: str) -> None:
        self.own(InstanceDraining(instance=instance, node=instance, idle_since=AT))
        self.scheduler(NodeDrained(node_name=instance, instance=instance))
        self.own(InstanceReleased(instance=instance, reason="idle for 60s"))
        self.monitor(NodeRetired(node_name=instance, reason="released by the autoscaler: idle for 60s"))


def kept(state: AutoscalerState) -> dict[str, Any]:
    """Everything the state keeps, field by field (the administrator's settings aside)."""
    held = {f.name: getattr(state, f.name) for f in fields(state) if f.compare and f.name != "lifecycle"}
    return {**held, "jobs": state.lifecycle.jobs}


def test_a_job_archived_after_its_whole_life_leaves_nothing_nor_does_its_ended_instance() -> None:
    folds = Folds()
    folds.run_on_an_instance(JOB, "gpu-1a2b3c")
    folds.release("gpu-1a2b3c")
    # Ended, the instance stays while its job is kept: its log page still names the job.
    assert "gpu-1a2b3c" in folds.state.instances and JOB in folds.state.asked and folds.left == []

    folds.scheduler(JobArchived(job_id=JOB, retention="1m"))

    assert kept(folds.state) == kept(AutoscalerState())
    assert folds.left == ["gpu-1a2b3c"]


def test_an_instance_that_ends_after_its_jobs_were_archived_leaves_at_once() -> None:
    folds = Folds()
    folds.run_on_an_instance(JOB, "gpu-1a2b3c")
    folds.scheduler(JobArchived(job_id=JOB, retention="1m"))
    assert "gpu-1a2b3c" in folds.state.live  # it runs on, idle, until it is released
    assert folds.state.instance_counts == {("gpu", "ready"): 1}

    folds.release("gpu-1a2b3c")

    assert kept(folds.state) == kept(AutoscalerState())
    assert folds.left == ["gpu-1a2b3c"]


def test_a_running_job_and_its_instance_are_untouched_by_another_jobs_archival() -> None:
    folds = Folds()
    folds.run_on_an_instance(JOB, "gpu-1a2b3c")
    folds.release("gpu-1a2b3c")
    folds.scheduler(JobSubmitted(job_id=OTHER, spec=SPEC, creator="alice"))
    folds.ask("gpu-4d5e6f", OTHER)
    folds.scheduler(JobAdmitted(job_id=OTHER, attempt=1, flavor="gpu-1", placement=on("gpu-4d5e6f")))

    folds.scheduler(JobArchived(job_id=JOB, retention="1m"))

    state = folds.state
    assert list(state.lifecycle.jobs) == list(state.open_jobs) == [OTHER]
    assert list(state.instances) == list(state.live) == ["gpu-4d5e6f"] and list(state.nodes) == ["gpu-4d5e6f"]
    assert state.asked == {OTHER: ["gpu-4d5e6f"]} and state.running == {OTHER}
    assert state.busy_nodes() == {"gpu-4d5e6f"}
    assert [view.state for view in state.instance_views()] == ["ready"]
    assert state.instance_counts == {("gpu", "ready"): 1}


def test_the_gauges_counts_follow_each_instance_through_its_states() -> None:
    folds = Folds()
    counts = folds.state.instance_counts
    folds.scheduler(JobSubmitted(job_id=JOB, spec=SPEC, creator="alice"))
    folds.own(InstanceRequested(instance="gpu-1a2b3c", instance_type="gpu", provider="local", jobs=[JOB]))
    assert counts == {("gpu", "requested"): 1}
    folds.own(InstanceLaunched(instance="gpu-1a2b3c", provider_id="p-1"))
    assert counts == {("gpu", "booting"): 1}
    folds.own(InstanceReady(instance="gpu-1a2b3c", node="gpu-1a2b3c"))
    folds.own(InstanceRequested(instance="gpu-4d5e6f", instance_type="gpu", provider="local", jobs=[JOB]))
    assert counts == {("gpu", "ready"): 1, ("gpu", "requested"): 1}
    folds.own(InstanceDraining(instance="gpu-1a2b3c", node="gpu-1a2b3c", idle_since=AT))
    folds.own(InstanceReleased(instance="gpu-4d5e6f", reason="its agent did not register", cause="boot-timeout"))
    assert counts == {("gpu", "draining"): 1}
    assert counts == {(view.instance_type, view.state): 1 for view in folds.state.instance_views()}


class Provider:
    """A provider that starts every instance asked for."""

    async def launch(self, instance: str, kind: InstanceType, node_token: str) -> str:
        return f"p-{instance}"

    async def terminate(self, instance: str) -> None:
        return None

    async def running(self) -> dict[str, str]:
        return {}


class ReadableStore(FakeStore):
    async def read_aggregate(self, aggregate_type: str, aggregate_id: str) -> list[EventEnvelope]:
        return [e for e in self.log.envelopes if (e.service, e.aggregate_type, e.aggregate_id)
                == (self.service, aggregate_type, aggregate_id)]


@pytest.fixture
def autoscaler(monkeypatch: pytest.MonkeyPatch) -> Autoscaler:
    log = EventLog()
    runtime = fake_runtime(log, "autoscaler")
    runtime.store = cast(EventStore, ReadableStore(log, "autoscaler"))
    # Every new instance gets the same random suffix, as two of a million may.
    monkeypatch.setattr(autoscaler_service, "secrets", SimpleNamespace(token_hex=lambda _: "1a2b3c"))
    return Autoscaler(runtime, CLUSTER, providers={"local": Provider()})


def log_of(autoscaler: Autoscaler) -> EventLog:
    store = autoscaler.rt.store
    assert isinstance(store, FakeStore)
    return store.log


async def decide(autoscaler: Autoscaler) -> None:
    await autoscaler.scale_once(log_of(autoscaler).now)
    await asyncio.gather(*autoscaler._calls)  # the provider's answers are recorded


def scheduler(autoscaler: Autoscaler, event: Event) -> None:
    autoscaler.state.apply_scheduler(log_of(autoscaler).record("scheduler", "job", getattr(event, "job_id", ""), event))


async def test_an_instance_that_left_is_forgotten_and_a_new_one_of_its_name_goes_on_in_its_log(
        autoscaler: Autoscaler) -> None:
    scheduler(autoscaler, JobSubmitted(job_id=JOB, spec=SPEC, creator="alice"))
    await decide(autoscaler)
    assert list(autoscaler.state.instances) == ["gpu-1a2b3c"] and autoscaler.version("instance", "gpu-1a2b3c") == 2
    scheduler(autoscaler, JobStopped(job_id=JOB, by="alice"))
    await autoscaler.record(released(autoscaler.state, "gpu-1a2b3c", "no job wants it", "idle"))
    scheduler(autoscaler, JobArchived(job_id=JOB, retention="1m"))
    assert autoscaler.state.instances == {} and ("instance", "gpu-1a2b3c") not in autoscaler.versions

    scheduler(autoscaler, JobSubmitted(job_id=OTHER, spec=SPEC, creator="alice"))
    await decide(autoscaler)  # asks for an instance of the very same name

    assert [i.jobs for i in autoscaler.state.instances.values()] == [[OTHER]]
    assert autoscaler.version("instance", "gpu-1a2b3c") == 5  # after the three events of the one that left
