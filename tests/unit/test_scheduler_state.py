"""The scheduler's state as a fold of stored events (SPEC X1, S1, S12)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from libs.contracts.cluster import ClusterConfig, Flavor, NodeInfo, Resources
from libs.contracts.datacache import CacheEntry, CacheEviction, StagedDataset
from libs.contracts.events import (
    DatasetCached,
    DatasetEvicted,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    EventEnvelope,
    JobAdmitted,
    JobDeleted,
    JobDurationChanged,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobPriorityChanged,
    JobRequeued,
    JobRescaling,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    LaunchPlanned,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeHealthy,
    NodeLaunch,
    NodeLost,
    NodeProcessExited,
    NodeProcessStarted,
    NodeRecovered,
    NodeRegistered,
    NodeUnhealthy,
    Placement,
    SettingsChanged,
)
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, DatasetRef, JobSpec, OutputRef
from libs.contracts.scheduling import AdminSettings
from services.scheduler.domain.names import job_change
from services.scheduler.domain.state import SchedulerState
from tests.support.platform import Platform, plain_spec

T0 = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
CPU4 = Flavor(name="cpu-4", cpus=4, memory_mib=8192)
GPU4 = Flavor(name="gpu-4", cpus=8, memory_mib=32768, accelerators=4)
CLUSTER = ClusterConfig(flavors=[CPU4, GPU4])
AGGREGATE = {"scheduler": "job", "launcher": "launch", "monitor": "node"}


class Log:
    """Builds envelopes the way the event store numbers them and folds them into a fresh state."""

    def __init__(self) -> None:
        self.state = SchedulerState(CLUSTER)
        self.position = 0
        self.versions: dict[tuple[str, str], int] = {}

    def apply(self, event: Any, *, service: str = "scheduler", aggregate_id: str | None = None,
              trace: dict[str, str] | None = None) -> EventEnvelope:
        self.position += 1
        aggregate = aggregate_id or getattr(event, "job_id", None) or getattr(event, "node_name", None) \
            or event.node.name
        key = (service, aggregate)
        self.versions[key] = self.versions.get(key, 0) + 1
        envelope = EventEnvelope(event_id=f"e{self.position}", service=service,
                                 aggregate_type=AGGREGATE[service], aggregate_id=aggregate,
                                 version=self.versions[key], position=self.position,
                                 recorded_at=T0 + timedelta(minutes=self.position), event=event,
                                 trace=trace or {})
        self.state.apply(envelope)
        return envelope

    def submit(self, job_id: str, priority: str = "normal", nodes: int = 1, **extra: Any) -> None:
        spec = JobSpec(name=f"name-{job_id}", priority=priority, nodes=nodes,  # type: ignore[arg-type]
                       mode="pytorch" if nodes > 1 else "single-node", flavors=["cpu-4", "gpu-4"],
                       algorithm=AlgorithmRef(name="code"), command="python3 train.py",
                       output=OutputRef(name="out"), **extra)
        self.apply(JobSubmitted(job_id=job_id, spec=spec, creator="alice"))

    def admit(self, job_id: str, nodes: list[str], flavor: str = "cpu-4", attempt: int = 1) -> None:
        placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(nodes)]
        self.apply(JobAdmitted(job_id=job_id, attempt=attempt, flavor=flavor, placement=placement))

    def register(self, name: str, cpus: float = 16, memory_mib: int = 65536) -> None:
        self.apply(NodeRegistered(node=NodeInfo(name=name, address=f"addr-{name}", cpus=cpus, memory_mib=memory_mib)),
                   service="monitor")

    def queue_ids(self) -> list[str]:
        return [job.job_id for job in self.state.queue()]


@pytest.fixture
def log() -> Log:
    return Log()


# --- S1: queue order ------------------------------------------------------------------------------------


def test_queue_orders_by_priority_then_submission(log: Log) -> None:
    for job_id, priority in [("n1", "normal"), ("u1", "urgent"), ("v1", "very-urgent"), ("n2", "normal"),
                             ("u2", "urgent"), ("v2", "very-urgent"), ("n3", "normal")]:
        log.submit(job_id, priority)
    assert log.queue_ids() == ["v1", "v2", "u1", "u2", "n1", "n2", "n3"]


def test_queue_positions_in_views_follow_the_queue(log: Log) -> None:
    log.submit("a")
    log.submit("b", "urgent")
    log.submit("c")
    positions = {j: log.state.view(log.state.jobs[j]).queue_position for j in ("a", "b", "c")}
    assert positions == {"b": 1, "a": 2, "c": 3}


def test_admitted_and_finished_jobs_leave_the_queue(log: Log) -> None:
    for job_id in ("a", "b", "c", "d"):
        log.submit(job_id)
    log.register("n1")
    log.admit("a", ["n1"])
    log.apply(JobStopped(job_id="b", by="alice"))
    assert log.queue_ids() == ["c", "d"]
    assert log.state.view(log.state.jobs["a"]).queue_position is None


def test_first_come_first_served_survives_interleaved_events(log: Log) -> None:
    log.submit("early")
    log.register("n1")
    log.register("n2")
    log.submit("late")
    assert log.queue_ids() == ["early", "late"]


# --- S12: status transitions ------------------------------------------------------------------------------


def test_submitted_job_is_queued_with_its_submission_time(log: Log) -> None:
    log.submit("a")
    job = log.state.jobs["a"]
    assert job.status == "queued"
    assert job.submitted_at == T0 + timedelta(minutes=1)
    assert job.creator == "alice"
    assert not job.terminal
    view = log.state.view(job)
    assert (view.status, view.name, view.output, view.attempt, view.flavor) == ("queued", "name-a", "out", 0, None)


def test_admission_makes_the_job_running_with_its_placement(log: Log) -> None:
    log.submit("a", nodes=2)
    log.admit("a", ["n1", "n2"], flavor="gpu-4")
    job = log.state.jobs["a"]
    assert job.status == "running"
    assert (job.attempt, job.flavor) == (1, "gpu-4")
    assert [p.node for p in job.placement] == ["n1", "n2"]
    assert job.started_at == T0 + timedelta(minutes=2)
    view = log.state.view(job)
    assert [(i.rank, i.node, i.master, i.state) for i in view.instances] == [
        (0, "n1", True, "pending"), (1, "n2", False, "pending")]
    assert [j.job_id for j in log.state.running()] == ["a"]


def test_running_job_succeeds(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(JobSucceeded(job_id="a"))
    job = log.state.jobs["a"]
    assert (job.status, job.exit_code, job.terminal) == ("succeeded", 0, True)
    assert job.ended_at == T0 + timedelta(minutes=3)
    assert log.state.running() == []


def test_a_job_ended_when_its_last_rank_exited_not_when_the_report_was_recorded(log: Log) -> None:
    """The launcher (or NATS) was away when the ranks exited: the agents' exit times say when the job ended."""
    log.submit("a", nodes=2)
    log.admit("a", ["n1", "n2"])
    exits = [T0 + timedelta(minutes=2, seconds=5), T0 + timedelta(minutes=2, seconds=9)]
    for rank, (node, exited_at) in enumerate(zip(["n1", "n2"], exits, strict=True)):
        log.apply(NodeProcessExited(job_id="a", attempt=1, rank=rank, node=node, exit_code=0, exited_at=exited_at),
                  service="launcher")
    log.apply(JobSucceeded(job_id="a"))  # recorded minutes later

    assert log.state.jobs["a"].ended_at == exits[1]


def test_running_job_fails_with_reason_and_exit_code(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(JobFailed(job_id="a", reason="rank 0 on n1 exited with code 3", exit_code=3))
    view = log.state.view(log.state.jobs["a"])
    assert (view.status, view.reason, view.exit_code) == ("failed", "rank 0 on n1 exited with code 3", 3)
    assert view.ended_at is not None


def test_stop_request_keeps_the_job_running_until_it_is_stopped(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(JobStopRequested(job_id="a", by="alice"))
    job = log.state.jobs["a"]
    assert (job.status, job.stop_requested_by) == ("running", "alice")
    log.apply(JobStopped(job_id="a", by="alice"))
    assert (job.status, job.reason) == ("stopped", "stopped by user")
    assert job.terminal


def test_queued_job_can_be_stopped_directly(log: Log) -> None:
    log.submit("a")
    log.apply(JobStopped(job_id="a", by="bob", reason="no longer needed"))
    job = log.state.jobs["a"]
    assert (job.status, job.reason, job.started_at) == ("stopped", "no longer needed", None)
    assert log.state.queue() == []


def test_deleted_job_is_marked_and_keeps_its_final_status(log: Log) -> None:
    log.submit("a")
    log.apply(JobStopped(job_id="a", by="alice"))
    log.apply(JobDeleted(job_id="a", by="alice"))
    job = log.state.jobs["a"]
    assert job.deleted and job.status == "stopped"
    assert log.state.queue() == [] and log.state.running() == []


def test_readmission_starts_a_new_attempt(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"], attempt=1)
    log.admit("a", ["n2"], attempt=2)
    job = log.state.jobs["a"]
    assert job.attempt == 2
    assert [i.node for i in job.instances.values()] == ["n2"]


async def test_job_version_tracks_its_own_scheduler_events() -> None:
    platform = Platform()
    await platform.submit("a", plain_spec())
    await platform.submit("b", plain_spec())
    placement = [Placement(rank=0, node="n1", address="addr-n1", slots=1)]
    await platform.scheduler.record([job_change(JobAdmitted(job_id="a", attempt=1, flavor="cpu-4",
                                                            placement=placement))])
    await platform.deliver(platform.log.record("launcher", "launch", "a", NodeProcessStarted(
        job_id="a", attempt=1, rank=0, node="n1", pid=5)))
    assert platform.scheduler.version("job", "a") == 2
    assert platform.scheduler.version("job", "b") == 1


def test_submission_trace_is_kept_for_the_admission(log: Log) -> None:
    log.apply(JobSubmitted(job_id="a", spec=JobSpec(name="a"), creator="alice"),
              trace={"traceparent": "00-1-2-01"})
    assert log.state.jobs["a"].trace == {"traceparent": "00-1-2-01"}


def test_events_of_unknown_jobs_are_ignored(log: Log) -> None:
    log.apply(JobSucceeded(job_id="ghost"))
    log.apply(NodeProcessStarted(job_id="ghost", attempt=1, rank=0, node="n1", pid=1), service="launcher")
    assert log.state.jobs == {}


# --- launcher events: instances --------------------------------------------------------------------------


def test_process_reports_update_the_instances_of_the_current_attempt(log: Log) -> None:
    log.submit("a", nodes=2)
    log.admit("a", ["n1", "n2"])
    log.apply(LaunchPlanned(job_id="a", attempt=1, mode="pytorch", nodes=[
        NodeLaunch(rank=r, node=n, address=f"addr-{n}", argv=["python3"], env={}, mounts=[])
        for r, n in enumerate(["n1", "n2"])]), service="launcher")
    log.apply(NodeProcessStarted(job_id="a", attempt=1, rank=0, node="n1", pid=100), service="launcher")
    log.apply(NodeProcessStarted(job_id="a", attempt=1, rank=1, node="n2", pid=200), service="launcher")
    log.apply(NodeProcessExited(job_id="a", attempt=1, rank=1, node="n2", exit_code=1), service="launcher")
    instances = log.state.view(log.state.jobs["a"]).instances
    assert [(i.rank, i.state, i.pid, i.exit_code) for i in instances] == [
        (0, "running", 100, None), (1, "exited", 200, 1)]


def test_reports_of_an_older_attempt_are_ignored(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"], attempt=1)
    log.admit("a", ["n1"], attempt=2)
    log.apply(NodeProcessStarted(job_id="a", attempt=1, rank=0, node="n1", pid=100), service="launcher")
    assert log.state.jobs["a"].instances[0].pid is None


def test_launch_outcomes_do_not_change_the_status_by_themselves(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(LaunchFailed(job_id="a", attempt=1, reason="boom"), service="launcher")
    assert log.state.jobs["a"].status == "running"  # the scheduler records JobFailed in reaction


# --- nodes and used resources -----------------------------------------------------------------------------


def test_used_resources_per_node_sum_the_flavors_of_running_ranks(log: Log) -> None:
    for name in ("n1", "n2", "n3"):
        log.register(name)
    log.submit("a", nodes=2)
    log.submit("b", nodes=1)
    log.admit("a", ["n1", "n2"], flavor="gpu-4")
    log.admit("b", ["n1"], flavor="cpu-4")
    used = log.state.used()
    assert used == {
        "n1": Resources(cpus=12, memory_mib=40960, accelerators=4),
        "n2": Resources(cpus=8, memory_mib=32768, accelerators=4),
        "n3": Resources(),
    }
    assert sorted(j.job_id for j in log.state.jobs_on("n1")) == ["a", "b"]
    assert [j.job_id for j in log.state.jobs_on("n3")] == []


def test_two_ranks_on_one_node_count_twice(log: Log) -> None:
    log.register("n1")
    log.submit("a", nodes=2)
    log.admit("a", ["n1", "n1"])
    assert log.state.used()["n1"] == Resources(cpus=8, memory_mib=16384)


@pytest.mark.parametrize("end", [JobSucceeded(job_id="a"), JobFailed(job_id="a", reason="x"),
                                 JobStopped(job_id="a", by="u")], ids=lambda e: type(e).__name__)
def test_finished_jobs_release_their_resources(log: Log, end: Any) -> None:
    log.register("n1")
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(end)
    assert log.state.used() == {"n1": Resources()}
    assert log.state.jobs_on("n1") == []


def test_queued_jobs_hold_no_resources(log: Log) -> None:
    log.register("n1")
    log.submit("a")
    assert log.state.used() == {"n1": Resources()}


def test_node_lost_and_recovered(log: Log) -> None:
    log.register("n1")
    log.apply(NodeLost(node_name="n1", last_seen=T0, reason="no heartbeat"), service="monitor")
    assert log.state.nodes["n1"].lost
    log.apply(NodeRecovered(node_name="n1"), service="monitor")
    assert not log.state.nodes["n1"].lost


def test_loss_of_an_unknown_node_is_ignored(log: Log) -> None:
    log.apply(NodeLost(node_name="ghost", last_seen=T0, reason="?"), service="monitor")
    assert log.state.nodes == {}


def test_reregistration_replaces_the_node_resources(log: Log) -> None:
    log.register("n1", cpus=8)
    log.register("n1", cpus=32)
    assert log.state.nodes["n1"].info.cpus == 32
    assert list(log.state.nodes) == ["n1"]


def test_flavor_lookup_uses_the_cluster_config(log: Log) -> None:
    assert log.state.flavor("gpu-4") == GPU4
    assert log.state.flavor("nope") is None


# --- S3, S11, J16, S10: changes folded from the log -------------------------------------------------------


def test_a_priority_change_moves_the_job_but_keeps_its_submission_order(log: Log) -> None:
    for job_id in ("a", "b", "c"):
        log.submit(job_id)
    log.submit("u", "urgent")
    log.apply(JobPriorityChanged(job_id="c", priority="urgent", by="alice"))
    assert log.queue_ids() == ["c", "u", "a", "b"]  # c was submitted before u
    assert log.state.view(log.state.jobs["c"]).priority == "urgent"


def test_a_running_jobs_deadline_follows_its_current_duration(log: Log) -> None:
    log.submit("a", duration="1h")
    log.register("n1")
    log.admit("a", ["n1"])
    job = log.state.jobs["a"]
    assert job.started_at is not None and job.ends_at == job.started_at + timedelta(hours=1)
    log.apply(JobDurationChanged(job_id="a", duration="3h", by="alice"))
    assert job.ends_at == job.started_at + timedelta(hours=3)
    log.apply(JobExpiring(job_id="a", attempt=1, limit_seconds=10800))
    log.apply(JobExpired(job_id="a", reason="ran past its duration limit of 3h"))
    assert (job.status, job.terminal) == ("expired", True)


def test_a_job_being_moved_holds_both_placements_until_its_next_attempt(log: Log) -> None:
    log.submit("a", nodes=2, duration="1h")
    log.register("n1")
    log.register("n2")
    log.admit("a", ["n1"])
    started = log.state.jobs["a"].started_at
    target = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(["n1", "n2"])]
    log.apply(JobRescaling(job_id="a", attempt=1, flavor="cpu-4", placement=target, reason="grows"))
    used = log.state.used()
    assert (used["n1"].cpus, used["n2"].cpus) == (8, 4)
    log.apply(JobAdmitted(job_id="a", attempt=2, flavor="cpu-4", placement=target))
    used = log.state.used()
    assert (used["n1"].cpus, used["n2"].cpus) == (4, 4)
    # The duration limit still counts from the first start.
    assert log.state.jobs["a"].started_at == started


def test_settings_are_folded_from_their_own_aggregate(log: Log) -> None:
    log.apply(SettingsChanged(settings=AdminSettings(urgent_cap=1, sharing_enabled=False), by="root"),
              aggregate_id="platform")
    assert (log.state.settings.urgent_cap, log.state.settings.sharing_enabled) == (1, False)
    log.submit("a", access="read-only")
    assert log.state.view(log.state.jobs["a"]).access == "none"


# --- M1, J12, J13, M2, J15: pre-checks, moves, restarts, node health, kept environments --------------------


def precheck(job_id: str, nodes: list[str], attempt: int = 1) -> JobPrechecking:
    placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(nodes)]
    return JobPrechecking(job_id=job_id, attempt=attempt, flavor="cpu-4", placement=placement)


def test_a_job_being_prechecked_has_left_the_queue_but_holds_its_nodes(log: Log) -> None:
    log.register("n1")
    log.submit("a")
    log.submit("b")
    log.apply(precheck("a", ["n1"]))
    job = log.state.jobs["a"]
    assert (job.status, log.queue_ids()) == ("queued", ["b"])
    assert log.state.view(job).queue_position is None
    assert log.state.used()["n1"] == Resources(cpus=4, memory_mib=8192)
    log.apply(JobStopped(job_id="a", by="alice"))
    assert log.state.used()["n1"] == Resources()


def test_a_failed_precheck_puts_the_job_back_at_its_place_with_the_reason(log: Log) -> None:
    log.register("n1")
    log.submit("a")
    log.submit("b")
    log.apply(precheck("a", ["n1"]))
    log.apply(JobPrecheckFailed(job_id="a", attempt=1, reason="the pre-check failed on n1: board:0 faulty",
                                nodes=["n1"]))
    assert log.queue_ids() == ["a", "b"]
    assert log.state.view(log.state.jobs["a"]).reason == "the pre-check failed on n1: board:0 faulty"
    assert log.state.used()["n1"] == Resources()


def test_a_requeued_job_keeps_its_place_its_first_start_and_counts_its_resumes(log: Log) -> None:
    log.register("n1")
    log.submit("a", duration="2h")
    log.submit("b")
    log.admit("a", ["n1"])
    started = log.state.jobs["a"].started_at
    log.apply(JobResuming(job_id="a", attempt=1, reason="it is slow on node n1", exclude_nodes=["n1"]))
    assert log.state.jobs["a"].status == "running"
    log.apply(JobRequeued(job_id="a", attempt=1, reason="it is slow on node n1", resumes=1))
    view = log.state.view(log.state.jobs["a"])
    assert (view.status, view.queue_position, view.placement, view.resumes) == ("queued", 1, [], 1)
    assert (view.excluded_nodes, view.reason) == (["n1"], "it is slow on node n1")
    assert log.state.used()["n1"] == Resources()
    log.admit("a", ["n2"], attempt=2)
    job = log.state.jobs["a"]
    assert (job.started_at, job.reason, log.state.view(job).resumes) == (started, None, 1)


def test_time_back_in_the_queue_does_not_count_toward_the_duration_limit(log: Log) -> None:
    log.submit("a", duration="1h")
    log.admit("a", ["n1"])  # minute 2
    log.apply(JobResuming(job_id="a", attempt=1, reason="node n1 was lost: gone", lost_nodes=["n1"]))
    log.apply(JobRequeued(job_id="a", attempt=1, reason="node n1 was lost: gone", resumes=1))  # minute 4: ran 2
    for index in range(10):  # ten minutes pass in the queue
        log.submit(f"later-{index}")
    log.admit("a", ["n2"], attempt=2)  # minute 15
    job = log.state.jobs["a"]
    assert job.ends_at == T0 + timedelta(minutes=15 + 60 - 2)
    assert log.state.view(job).expires_at == job.ends_at


def test_restarts_are_counted(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(JobRestarting(job_id="a", attempt=1, restarts=1, reason="rank 0 on n1 exited with code 3",
                            exit_code=3))
    log.admit("a", ["n1"], attempt=2)
    assert log.state.view(log.state.jobs["a"]).restarts == 1


def test_the_effective_maximum_resumes_is_the_spec_within_the_cap(log: Log) -> None:
    log.submit("plain")
    log.submit("resumable", pool="p", checkpoint_resume=CheckpointResume(max_resumes=5))
    assert log.state.view(log.state.jobs["plain"]).max_resumes is None
    assert log.state.view(log.state.jobs["resumable"]).max_resumes == 5
    log.apply(SettingsChanged(settings=AdminSettings(max_resumes_cap=2), by="root"), aggregate_id="platform")
    assert log.state.view(log.state.jobs["resumable"]).max_resumes == 2


def test_an_unhealthy_node_keeps_its_problems_until_it_is_healthy(log: Log) -> None:
    log.register("n1")
    log.apply(NodeUnhealthy(node_name="n1", problems=["board:0 faulty (xid 79)"]), service="monitor")
    node = log.state.nodes["n1"]
    assert (node.status, node.problems, node.schedulable) == ("unhealthy", ["board:0 faulty (xid 79)"], False)
    log.register("n1", cpus=32)  # registering again does not clear a fault
    assert log.state.nodes["n1"].status == "unhealthy"
    log.apply(NodeHealthy(node_name="n1"), service="monitor")
    node = log.state.nodes["n1"]
    assert (node.status, node.problems, node.schedulable) == ("ready", [], True)


def test_a_kept_environment_shows_until_it_is_released(log: Log) -> None:
    log.submit("a")
    log.admit("a", ["n1"])
    log.apply(JobFailed(job_id="a", reason="rank 0 on n1 exited with code 1", exit_code=1))
    until = T0 + timedelta(hours=4)
    log.apply(DebugEnvironmentKept(job_id="a", attempt=1, nodes=["n1"], until=until), service="monitor")
    assert log.state.view(log.state.jobs["a"]).kept_until == until
    log.apply(DebugEnvironmentReleased(job_id="a", attempt=1), service="monitor")
    assert log.state.view(log.state.jobs["a"]).kept_until is None


def test_data_preparation_does_not_count_toward_the_duration_limit(log: Log) -> None:
    """J14: the longest node's staging of an attempt is added to its deadline, once per attempt."""
    log.submit("a", nodes=2, duration="1h")
    log.admit("a", ["n1", "n2"])
    job = log.state.jobs["a"]
    deadline = job.ends_at
    assert deadline is not None
    for rank, (node, seconds) in enumerate((("n1", 90.0), ("n2", 30.0))):
        log.apply(NodeProcessStarted(job_id="a", attempt=1, rank=rank, node=node, pid=100 + rank, staged=[
            StagedDataset(source="datasets/imgs", key="0123456789abcdef01234567", bytes=1, files=1, hit=False,
                          seconds=seconds)]), service="launcher")
    assert job.ends_at == deadline + timedelta(seconds=90)
    log.apply(NodeProcessStarted(job_id="a", attempt=1, rank=0, node="n1", pid=100, staged=[
        StagedDataset(source="datasets/imgs", key="0123456789abcdef01234567", bytes=1, files=1, hit=False,
                      seconds=90.0)]), service="launcher")  # the same report again
    assert job.ends_at == deadline + timedelta(seconds=90)
    # The node blocked by a full disk takes nothing new; its reason shows with its problems.
    log.register("n3")
    log.apply(NodeDiskPressure(node_name="n3", reason="local disk 95% full"), service="monitor")
    blocked = log.state.nodes["n3"]
    assert (blocked.schedulable, blocked.status, blocked.reasons) == (False, "disk-full", ["local disk 95% full"])
    log.apply(NodeDiskRelieved(node_name="n3"), service="monitor")
    assert (blocked.schedulable, blocked.status, blocked.reasons) == (True, "ready", [])


def test_the_data_a_nodes_cache_holds_for_a_job_counts_each_dataset_once(log: Log) -> None:
    spec = JobSpec(name="prep", flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"), command="python3 t.py",
                   output=OutputRef(name="out"), data_preparation=True,
                   datasets=[DatasetRef(name="imgs", source="favorite", version="v2"), DatasetRef(name="labels")])

    def cached(node: str, key: str, source: str, size: int) -> None:
        log.apply(DatasetCached(node=node, entry=CacheEntry(key=key, source=source, bytes=size, files=1,
                                                            staged_at=T0, last_used=T0)),
                  service="monitor", aggregate_id=node)

    cached("n1", "a" * 24, "datasets/imgs/v2", 700)
    cached("n1", "b" * 24, "datasets/imgs/v2", 900)  # the same dataset copied again after a change
    cached("n1", "c" * 24, "datasets/labels", 50)
    cached("n2", "d" * 24, "datasets/other", 10**9)  # not this job's
    assert log.state.data_on_nodes(spec) == {"n1": 950}
    log.apply(DatasetEvicted(node="n1", eviction=CacheEviction(key="b" * 24, source="datasets/imgs/v2", bytes=900,
                                                               cause="watermark", evicted_at=T0)),
              service="monitor", aggregate_id="n1")
    assert log.state.data_on_nodes(spec) == {"n1": 750}
    assert log.state.data_on_nodes(JobSpec(name="plain", flavors=["cpu-4"], algorithm=AlgorithmRef(name="c"),
                                           command="true", datasets=spec.datasets)) == {}
