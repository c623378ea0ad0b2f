"""Wire contracts (SPEC X1, X2): tagged unions round-trip through the codec; requests are strict,
stored events are lenient."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, get_args

import msgspec
import pytest

from libs.contracts import subjects
from libs.contracts.agent import (
    MAX_PORTS_PER_REQUEST,
    AgentReply,
    Heartbeat,
    LogChunk,
    NodeAccepted,
    OpenSession,
    PortsReserved,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    ProcessExited,
    ProcessReport,
    ProcessStarted,
    RegisterNode,
    Released,
    ReleaseWorkspaces,
    ReservePorts,
    SessionControl,
    SessionExited,
    SessionOpened,
    StageAccepted,
    StageDataset,
    StartProcess,
    Stopped,
    StopProcesses,
    UsageSample,
)
from libs.contracts.arrays import SweepParameter
from libs.contracts.cluster import Accelerators, NodeInfo, Resources
from libs.contracts.codec import decode, decode_any, encode
from libs.contracts.datacache import (
    MAX_CACHE_ENTRIES_REPORTED,
    CachedImage,
    CacheEntry,
    CacheEviction,
    CachePolicy,
    CacheReport,
    CopyUnderWay,
    StagedDataset,
    StagingFailed,
)
from libs.contracts.events import (
    EVENT_TYPES,
    AlertMailed,
    AlertRaised,
    ArraySubmitted,
    ComponentMarked,
    DatasetCached,
    DatasetEvicted,
    DatasetPreloadRequested,
    DebugEnvironmentKept,
    DebugEnvironmentReleased,
    Event,
    EventEnvelope,
    ImageDeleted,
    ImageMarked,
    ImageRegistered,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobDurationChanged,
    JobExpired,
    JobExpiring,
    JobFailed,
    JobPrecheckFailed,
    JobPrechecking,
    JobPredicted,
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
    LaunchHost,
    LaunchPlanned,
    LaunchShape,
    LaunchStopped,
    LaunchSucceeded,
    LaunchTask,
    LostProcessesStopped,
    Mount,
    NodeDiskPressure,
    NodeDiskRelieved,
    NodeDrained,
    NodeHealthy,
    NodeLaunch,
    NodeLost,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    NodeRecovered,
    NodeRegistered,
    NodeRetired,
    NodeUnhealthy,
    PerformanceDegraded,
    Placement,
    PrecheckCompleted,
    ProvisionFailed,
    RunBegan,
    RunContinued,
    RunFinished,
    RunLived,
    RunProcessEnded,
    SettingsChanged,
    StorageAccessSet,
    UpstreamMessageSetAside,
    WaitingJobsPacked,
    set_aside_id,
)
from libs.contracts.health import PERFORMANCE_LINE, ComponentHealth, NodeCheck
from libs.contracts.images import ImageRecord
from libs.contracts.jobspec import (
    AlgorithmRef,
    CheckpointResume,
    DatasetRef,
    Elastic,
    FieldError,
    JobSpec,
    OutputRef,
    field_error_from_msgspec,
)
from libs.contracts.operations.alerts import LIST_ALERTS, MAX_ALERT_PAGE, AlertPage, ListAlerts
from libs.contracts.operations.arrays import (
    ArrayAccepted,
    ArrayDetails,
    ArrayMemberView,
    ArraySelection,
    ArrayView,
    GetArray,
    SubmitArray,
)
from libs.contracts.operations.autoscaler import (
    AutoscalerLog,
    GetAutoscalerLog,
    GetQueueStatus,
    QueueStatus,
    ScaledInstance,
    TypeCooldown,
)
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cache import CacheListing, ListCache, NodeCache, PreloadAccepted, PreloadDataset
from libs.contracts.operations.catalogue import PEOPLE_REPLIES as Reply
from libs.contracts.operations.catalogue import PEOPLE_REQUESTS as Request
from libs.contracts.operations.cluster import (
    ChangeSettings,
    GetResources,
    GetSettings,
    ListFlavors,
    ListNodes,
    ListStorageAccess,
    MarkComponent,
    NodeList,
    NodeView,
    SetStorageAccess,
    StorageAccessList,
    WhoAmI,
)
from libs.contracts.operations.images import (
    DeleteImage,
    ImageList,
    ListImages,
    MarkImage,
    RegisterImage,
    UploadImageChunk,
    UploadReceived,
)
from libs.contracts.operations.jobs import (
    JOB_LOGS,
    JOB_USAGE,
    MAX_HISTORY_PAGE_BYTES,
    MAX_LOG_PAGE_BYTES,
    MAX_LOG_PAGE_CHUNKS,
    SUBMIT_JOB,
    ChangeDuration,
    ChangePriority,
    ChunksOnce,
    CloneJob,
    DeleteJobs,
    GetDevEnv,
    GetJob,
    GetJobHistory,
    GetJobLogs,
    GetJobUsage,
    GetQueue,
    InstanceView,
    JobAccepted,
    JobDetails,
    JobHistory,
    JobList,
    JobSummary,
    JobUsage,
    JobView,
    ListJobs,
    LogPage,
    SearchJobs,
    SearchResults,
    StopJobs,
    SubmitJob,
    history_page,
)
from libs.contracts.operations.planning import (
    ExplainJob,
    FlavorUse,
    MovedJob,
    PredictJob,
    PriorityWaits,
    SimulateHistory,
    SimulationPoint,
    SimulationReport,
)
from libs.contracts.operations.runs import (
    GetRun,
    GetSeries,
    OpenTerminal,
    RunView,
    SeriesPage,
    SeriesPoint,
    SeriesView,
    TerminalOpened,
)
from libs.contracts.operations.watches import JobChanged, JobPush, LogPushed, WatchJob
from libs.contracts.runs import MetricBatch, MetricPoint
from libs.contracts.scheduling import AdminSettings, BoardUsage, Prediction, StoredAccess
from libs.contracts.strict import decode_strict

AT = datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=UTC)
CACHE_ENTRY = CacheEntry(key="0123456789abcdef01234567", source="datasets/imgs/v1", bytes=2048, files=2, staged_at=AT,
                         last_used=AT, pins=["job-000000000001/1/0/0"])
CACHED_IMAGE = CachedImage(key="5a2e07c4bd31" + "0" * 12, digest="sha256:5a2e07c4bd31" + "0" * 52,
                           ref="team/torch:2.13", format="oci-archive", bytes=3 * 2**30, unpacked_at=AT, last_used=AT,
                           pins=["job-000000000001/1/0/0"])

SPEC = JobSpec(
    name="bert", mode="pytorch", nodes=2, flavors=["gpu-4", "gpu-8"], pool="team-a",
    algorithm=AlgorithmRef(name="bert-code"), command="python3 train.py --lr 0.1",
    output=OutputRef(name="bert-out"), datasets=[DatasetRef(name="wiki", source="favorite", version="v2")],
    env={"NCCL_DEBUG": "INFO"}, checkpoint_resume=CheckpointResume(elastic=Elastic(min_nodes=1)),
)
NODE = NodeInfo(name="gpu-node-1", address="10.0.0.7", os="ubuntu 22.04", kernel="6.5", cpus=64.0,
                memory_mib=512000, accelerators=[Accelerators(board="A100", count=8, driver_version="535.104")],
                pools=["team-a"], labels={"zone": "a"})
PLACEMENT = [Placement(rank=0, node="gpu-node-1", address="10.0.0.7", slots=4),
             Placement(rank=1, node="gpu-node-2", address="10.0.0.8", slots=4)]
LAUNCH = NodeLaunch(rank=0, node="gpu-node-1", address="10.0.0.7", argv=["python3", "train.py"],
                    env={"RANK": "0"}, mounts=[Mount(source="outputs/o", target="outputs", read_only=False)],
                    files={"/job/hostfile": "gpu-node-1 slots=4\n"}, master=True)
SHAPE = LaunchShape(hosts=[LaunchHost("gpu-node-1", "10.0.0.7", 4, "worker", 29500),
                           LaunchHost("gpu-node-2", "10.0.0.8", 4)],
                    slots=4, env={"A": "1"}, tasks=[LaunchTask(command="python3 train.py", mounts=LAUNCH.mounts)])

IMAGE = ImageRecord(name="team/torch", tag="2.13", digest="sha256:" + "0" * 64, format="oci-archive", size_bytes=10,
                    boards=["cpu", "sim-a100"], training=True, registered_by="root", registered_at=AT)
EVENT_SAMPLES: list[Any] = [
    JobSubmitted(job_id="job-000000000001", spec=SPEC, creator="alice"),
    JobAdmitted(job_id="job-000000000001", attempt=1, flavor="gpu-4", placement=PLACEMENT),
    JobStopRequested(job_id="job-000000000001", by="alice"),
    JobSucceeded(job_id="job-000000000001"),
    JobFailed(job_id="job-000000000001", reason="rank 1 exited with code 3", exit_code=3),
    JobStopped(job_id="job-000000000001", by="bob", reason="maintenance"),
    JobDeleted(job_id="job-000000000001", by="alice"),
    JobArchived(job_id="job-000000000001", retention="7d"),
    LaunchPlanned(job_id="job-000000000001", attempt=2, mode="horovod", shape=SHAPE),
    NodeProcessStarted(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", pid=4242, staged=[
        StagedDataset(source="datasets/imgs/v1", key="0123456789abcdef01234567", bytes=2048, files=2, hit=False,
                      seconds=1.5)]),
    NodeProcessExited(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", exit_code=137),
    NodeProcessLost(job_id="job-000000000001", attempt=1, rank=1, node="gpu-node-2", reason="no answer for 60s"),
    LostProcessesStopped(job_id="job-000000000001", attempt=1, node="gpu-node-2"),
    LaunchSucceeded(job_id="job-000000000001", attempt=1),
    LaunchFailed(job_id="job-000000000001", attempt=2, reason="agent unreachable"),
    LaunchStopped(job_id="job-000000000001", attempt=1),
    NodeRegistered(node=NODE),
    NodeLost(node_name="gpu-node-1", last_seen=AT, reason="no heartbeat for 30s"),
    NodeRecovered(node_name="gpu-node-1"),
    JobPredicted(job_id="job-000000000001", prediction=Prediction(
        starts_now=False, flavor="gpu-4", position=3, jobs_ahead=2, estimated_start=AT, predicted_at=AT,
        reason="waits behind 2 jobs")),
    JobPriorityChanged(job_id="job-000000000001", priority="urgent", by="alice"),
    JobDurationChanged(job_id="job-000000000001", duration="4h", by="alice"),
    JobExpiring(job_id="job-000000000001", attempt=1, limit_seconds=14400),
    JobExpired(job_id="job-000000000001", reason="ran past its duration limit of 4h"),
    JobRescaling(job_id="job-000000000001", attempt=1, flavor="gpu-4", placement=PLACEMENT,
                 reason="grows from 1 to 2 nodes"),
    SettingsChanged(settings=AdminSettings(urgent_cap=2, sharing_enabled=False), by="root"),
    StorageAccessSet(entry=StoredAccess(kind="dataset", name="imgs", owner="bob", project="vision",
                                        others="read-only"), by="bob"),
    ImageRegistered(image=IMAGE, by="root"),
    ImageMarked(ref="team/torch:2.13", training=False, by="root"),
    ImageDeleted(ref="team/torch:2.13", by="root"),
    JobPrechecking(job_id="job-000000000001", attempt=2, flavor="gpu-4", placement=PLACEMENT),
    JobPrecheckFailed(job_id="job-000000000001", attempt=2, reason="board:0 faulty on gpu-node-2",
                      nodes=["gpu-node-2"]),
    JobResuming(job_id="job-000000000001", attempt=1, reason="node gpu-node-2 is unhealthy: board:0 faulty",
                lost_nodes=[], exclude_nodes=["gpu-node-2"]),
    JobRequeued(job_id="job-000000000001", attempt=1, reason="resumes after a fault on gpu-node-2", resumes=1),
    JobRestarting(job_id="job-000000000001", attempt=1, restarts=1, reason="rank 0 exited with code 3",
                  exit_code=3),
    NodeUnhealthy(node_name="gpu-node-2", problems=["board:0 faulty (marked by root)"]),
    NodeHealthy(node_name="gpu-node-2"),
    NodeDiskPressure(node_name="gpu-node-2", reason="local disk 93% full (above 90%); takes work again at 85%"),
    NodeDiskRelieved(node_name="gpu-node-2"),
    ComponentMarked(node_name="gpu-node-2", component="board:0", faulty=True, by="root", reason="drill"),
    PrecheckCompleted(job_id="job-000000000001", attempt=2, passed=False, nodes=[NodeCheck(
        node="gpu-node-2", passed=False, checks=[ComponentHealth(kind="board", name="0", healthy=False)])]),
    PerformanceDegraded(job_id="job-000000000001", attempt=1, node="gpu-node-1", rank=0, ratio=0.91,
                        threshold=0.8, direction="above", window=10, action="reschedule"),
    DebugEnvironmentKept(job_id="job-000000000001", attempt=1, nodes=["gpu-node-1"], until=AT),
    DebugEnvironmentReleased(job_id="job-000000000001", attempt=1),
    RunBegan(job_id="job-000000000001", attempt=1, began_at=datetime(2026, 1, 1, tzinfo=UTC)),
    RunContinued(job_id="job-000000000001", attempt=2),
    RunProcessEnded(job_id="job-000000000001", attempt=1, task=0, rank=1, node="n2", exit_code=None,
                    ended_at=datetime(2026, 1, 1, tzinfo=UTC)),
    RunFinished(job_id="job-000000000001", attempt=2, by="rank 0 ended", finished_at=datetime(2026, 1, 1, tzinfo=UTC)),
    RunLived(job_id="job-000000000001", attempt=1, began_at=datetime(2026, 1, 1, tzinfo=UTC),
             ended=[RunProcessEnded(job_id="job-000000000001", attempt=1, task=0, rank=0, node="n1", exit_code=0,
                                    ended_at=datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC))],
             finished=RunFinished(job_id="job-000000000001", attempt=1, by="rank 0 ended",
                                  finished_at=datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC))),
    AlertRaised(alert_id="performance-job-000000000001-1", kind="performance", title="bert is slow",
                message="ratio 0.91 above 0.8", recipients=["alice@example.com"], job_id="job-000000000001"),
    AlertMailed(alert_id="performance-job-000000000001-1", recipients=["alice@example.com"]),
    NodeDrained(node_name="gpu-small-3f2a9c", instance="gpu-small-3f2a9c"),
    DatasetPreloadRequested(preload_id="preload-0123456789ab", source="datasets/imgs/v1", nodes=["gpu-node-1"],
                            by="alice"),
    NodeRetired(node_name="gpu-small-3f2a9c", reason="released by the autoscaler: idle for 300s"),
    InstanceRequested(instance="gpu-small-3f2a9c", instance_type="gpu-small", provider="aws-ec2",
                      jobs=["job-000000000001"]),
    InstanceLaunched(instance="gpu-small-3f2a9c", provider_id="i-0abc123"),
    InstanceReady(instance="gpu-small-3f2a9c", node="gpu-small-3f2a9c"),
    InstanceDraining(instance="gpu-small-3f2a9c", node="gpu-small-3f2a9c", idle_since=AT),
    InstanceKept(instance="gpu-small-3f2a9c", node="gpu-small-3f2a9c", reason="job-000000000002 runs on it"),
    InstanceReleased(instance="gpu-small-3f2a9c", reason="idle for 300s"),
    ProvisionFailed(instance="gpu-small-3f2a9d", instance_type="gpu-small", reason="InsufficientInstanceCapacity",
                    capacity=True, retry_after=AT),
    DatasetCached(node="gpu-node-1", entry=CACHE_ENTRY),
    DatasetEvicted(node="gpu-node-1", eviction=CacheEviction(key="0123456789abcdef01234567", source="datasets/imgs/v1",
                                                             bytes=2048, cause="watermark", evicted_at=AT)),
    WaitingJobsPacked(packed={"job-000000000001": {"gpu-small-3f2a9c": Resources(cpus=2.0, memory_mib=4096,
                                                                                  accelerators=1)}},
                      unpacked=["job-000000000002"]),
    UpstreamMessageSetAside(consumer="monitor-events", stream="TRAINYARD_EVENTS", sequence=7,
                            subject="trainyard.events.monitor.job.job-000000000001.JobSucceeded",
                            cause="inconsistent", reason="claims service scheduler", claimed_service="scheduler",
                            claimed_type="JobSucceeded.v1"),
    ArraySubmitted(array_id="array-0123456789ab", job_name="sweep-{index}", project="default", creator="alice",
                   indices="0-3", size=4, sweep=[SweepParameter(name="lr", values=["0.1", "0.01"]),
                                                 SweepParameter(name="bs", values=["32", "64"])], max_running=2),
]


def test_a_launch_shape_records_each_rank_as_a_short_array() -> None:
    """Each host of a launch costs a few dozen bytes: its fields without their names, the rank its index."""
    encoded = msgspec.json.encode(SHAPE.hosts)
    assert encoded == b'[["gpu-node-1","10.0.0.7",4,"worker",29500],["gpu-node-2","10.0.0.8",4,"worker",0]]'
    assert msgspec.json.decode(b'[["n1","10.0.0.1",8]]', type=list[LaunchHost]) == [LaunchHost("n1", "10.0.0.1", 8)]


def test_a_plan_names_each_rank_s_node_and_role_in_either_form() -> None:
    """A plan recorded with a shape, and one recorded before shapes (every node's launch), both say where each
    rank runs and as what: under Horovod the ranks past the master stand by for its mpirun."""
    shaped = LaunchPlanned(job_id="job-000000000001", attempt=2, mode="horovod", shape=SHAPE)
    assert shaped.ranks() == [(0, "gpu-node-1", "worker"), (1, "gpu-node-2", "standby")]
    older = msgspec.json.decode(msgspec.json.encode(LaunchPlanned(job_id="job-000000000001", attempt=1,
                                                                  mode="pytorch", nodes=[LAUNCH])), type=Event)
    assert isinstance(older, LaunchPlanned) and older.shape is None
    assert older.ranks() == [(0, "gpu-node-1", "worker")]


def test_samples_cover_every_event_type() -> None:
    assert {type(e) for e in EVENT_SAMPLES} == set(EVENT_TYPES)
    assert len(EVENT_SAMPLES) == len(EVENT_TYPES)


@pytest.mark.parametrize("event", EVENT_SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_through_the_event_union(event: Any) -> None:
    data = encode(event)
    decoded = decode_any(data, Event)
    assert type(decoded) is type(event)
    assert decoded == event
    assert encode(decoded) == data


@pytest.mark.parametrize("event", EVENT_SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_carries_its_versioned_tag(event: Any) -> None:
    document = json.loads(encode(event))
    assert document["type"] == f"{type(event).__name__}.v1"
    assert type(event).name() == type(event).__name__


def test_event_tags_are_unique() -> None:
    tags = [t.__struct_config__.tag for t in EVENT_TYPES]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("event", EVENT_SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trips_with_its_event(event: Any) -> None:
    envelope = EventEnvelope(event_id="e-1", service="scheduler", aggregate_type="job",
                             aggregate_id="job-000000000001", version=3, position=17, recorded_at=AT,
                             event=event, trace={"traceparent": "00-abc-def-01"})
    decoded = decode(encode(envelope), EventEnvelope)
    assert decoded == envelope
    assert decoded.recorded_at == AT


def test_event_with_an_unknown_field_still_decodes() -> None:
    document = json.loads(encode(JobFailed(job_id="job-000000000001", reason="oom", exit_code=137)))
    document["added_by_a_newer_writer"] = {"nested": [1, 2]}
    decoded = decode_any(json.dumps(document), Event)
    assert decoded == JobFailed(job_id="job-000000000001", reason="oom", exit_code=137)


def test_envelope_and_nested_parts_with_unknown_fields_still_decode() -> None:
    for planned in (LaunchPlanned(job_id="job-000000000001", attempt=1, mode="pytorch", nodes=[LAUNCH]),
                    LaunchPlanned(job_id="job-000000000001", attempt=2, mode="horovod", shape=SHAPE)):
        envelope = EventEnvelope(event_id="e-1", service="launcher", aggregate_type="launch",
                                 aggregate_id="job-000000000001", version=1, position=1, recorded_at=AT,
                                 event=planned)
        document = json.loads(encode(envelope))
        document["shard"] = 3
        document["event"]["priority"] = "high"
        if planned.nodes:
            document["event"]["nodes"][0]["cgroup"] = "/trainyard"
            document["event"]["nodes"][0]["mounts"][0]["propagation"] = "rslave"
        else:  # a host gets one more element at its end, a task one more field
            document["event"]["shape"]["hosts"][0].append("rack-7")
            document["event"]["shape"]["tasks"][0]["gpus"] = 2
        assert decode(json.dumps(document), EventEnvelope) == envelope


def test_event_missing_an_optional_field_gets_its_default() -> None:
    decoded = decode_any(b'{"type": "JobStopped.v1", "job_id": "job-1", "by": "alice"}', Event)
    assert decoded == JobStopped(job_id="job-1", by="alice", reason="stopped by user")


@pytest.mark.parametrize(
    "data",
    [
        b'{"type": "JobExploded.v1", "job_id": "job-1"}',
        b'{"type": "JobSucceeded.v2", "job_id": "job-1"}',
        b'{"job_id": "job-1"}',
        b'{"type": "JobSucceeded.v1"}',
        b'{"type": "JobAdmitted.v1", "job_id": "j", "attempt": "one", "flavor": "f", "placement": []}',
    ],
)
def test_unknown_tags_and_bad_events_are_rejected(data: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_any(data, Event)


def test_datetimes_keep_their_instant_across_time_zones() -> None:
    shanghai = timezone(timedelta(hours=8))
    event = NodeLost(node_name="n1", last_seen=AT.astimezone(shanghai), reason="gone")
    decoded = decode_any(encode(event), Event)
    assert decoded.last_seen == AT


# --- requests: strict ------------------------------------------------------------------------------------

REQUEST_SAMPLES: list[Any] = [
    SubmitJob(job_id="job-000000000001", spec=SPEC),
    SubmitJob(job_id="job-000000000001", spec=SPEC, predict=True),
    SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-999%50"),
    SubmitArray(array_id="array-0123456789ab", spec=SPEC, sweep=[SweepParameter(name="lr", values=["0.1"])],
                max_running=4),
    GetArray(array_id="array-0123456789ab", after=1999, limit=500),
    StopJobs(job_ids=["job-000000000001", "job-000000000002"]),
    StopJobs(job_ids=[], arrays=[ArraySelection(array_id="array-0123456789ab", indices="3,5-7")]),
    DeleteJobs(job_ids=["job-000000000001"]),
    DeleteJobs(job_ids=[], arrays=[ArraySelection(array_id="array-0123456789ab")]),
    ListJobs(group_arrays=True),
    ListJobs(statuses=["queued", "running"], project="vision", limit=20),
    ListJobs(),
    GetJob(job_id="job-000000000001"),
    ListNodes(),
    GetQueue(),
    GetQueue(at=AT, limit=1000),
    SimulateHistory(start=AT),
    SimulateHistory(start=AT, end=AT + timedelta(days=7), add_nodes={"gpu-4": 2}, remove_nodes={"cpu-2": 1},
                    depth=500),
    ListJobs(statuses=["queued"], at=AT),
    GetJob(job_id="job-000000000001", at=AT),
    GetArray(array_id="array-0123456789ab", at=AT),
    ListNodes(at=AT),
    ExplainJob(job_id="job-000000000001", at=AT),
    GetResources(flavors=["gpu-4"], at=AT),
    ListAlerts(after=3, limit=50),
    GetAutoscalerLog(after=12, limit=100),
    ListCache(node="gpu-node-1"),
    GetRun(job_id="job-000000000001"),
    GetSeries(job_id="job-000000000001", name="loss", rank=0, after=12, limit=100),
    PreloadDataset(preload_id="preload-0123456789ab", name="imgs", version="v1", nodes=["gpu-node-1"]),
    PreloadDataset(preload_id="preload-0123456789ab", name="imgs", flavor="gpu-4"),
    ListCache(),
    GetQueueStatus(),
    ChangePriority(job_id="job-000000000001", priority="urgent"),
    ChangeDuration(job_id="job-000000000001", duration=None),
    CloneJob(source_job_id="job-000000000001", job_id="job-000000000002", overrides={"nodes": 4, "name": "b"}),
    PredictJob(spec=SPEC),
    ExplainJob(job_id="job-000000000001"),
    GetDevEnv(job_id="job-000000000001"),
    GetJobHistory(job_id="job-000000000001"),
    SearchJobs(name="bert", statuses=["failed"], favorite_algorithm="resnet", flavor="gpu-4", limit=50, offset=100),
    GetResources(flavors=["gpu-4", "gpu-8"]),
    ListFlavors(board="A100"),
    GetSettings(),
    ChangeSettings(urgent_cap=3, sharing_enabled=False),
    WhoAmI(),
    MarkComponent(node="gpu-node-2", component="board:0", reason="drill"),
    OpenTerminal(job_id="job-000000000001", node="gpu-node-1", command="ls /workspace"),
    SetStorageAccess(kind="algorithm", name="resnet", project="vision", others="none", owner="alice"),
    ListStorageAccess(kind="dataset"),
    UploadImageChunk(upload_id="0" * 32, offset=0, data=b"\x00\x01"),
    RegisterImage(name="team/torch", tag="2.13", upload_id="0" * 32, digest="sha256:" + "0" * 64, boards=["cpu"]),
    ListImages(ref="team/torch:2.13"),
    MarkImage(ref="team/torch:2.13", training=True),
    DeleteImage(ref="team/torch:2.13"),
    GetJobLogs(job_id="job-000000000001", rank=1, after=42, max_chunks=50),
    GetJobUsage(job_id="job-000000000001"),
    WatchJob(job_id="job-000000000001", inbox="_INBOX.users.user-alice.Zq3", logs=True),
]


def test_request_samples_cover_every_request_type() -> None:
    assert {type(r) for r in REQUEST_SAMPLES} == set(get_args(Request))


def test_a_board_usage_reads_physical_virtual_and_application() -> None:
    assert str(BoardUsage(physical=2, virtual=2, application="bert", job_id="job-000000000001")) == "2(2):bert"


def test_admin_settings_refuse_unknown_fields_and_negative_caps() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"urgent_cap": -1}', type=AdminSettings)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"urgent_caps": 1}', type=AdminSettings)


@pytest.mark.parametrize("request_", REQUEST_SAMPLES, ids=lambda r: type(r).__name__)
def test_every_request_round_trips_through_the_request_union(request_: Any) -> None:
    decoded = decode_any(encode(request_), Request)
    assert type(decoded) is type(request_)
    assert decoded == request_


@pytest.mark.parametrize("request_", REQUEST_SAMPLES, ids=lambda r: type(r).__name__)
def test_requests_forbid_unknown_fields(request_: Any) -> None:
    document = json.loads(encode(request_))
    document["colour"] = "blue"
    with pytest.raises(msgspec.ValidationError, match="unknown field `colour`"):
        decode_any(json.dumps(document), Request)


def test_unknown_field_inside_a_submitted_spec_is_named_with_its_path() -> None:
    document = json.loads(encode(REQUEST_SAMPLES[0]))
    document["spec"]["checkpoint_resume"]["max_resume"] = 2
    with pytest.raises(msgspec.ValidationError) as raised:
        decode_strict(json.dumps(document), Request)
    error = field_error_from_msgspec(raised.value)
    assert error.field == "spec.checkpoint_resume.max_resume"
    assert error.message == "is not a known field"


def test_missing_field_inside_a_submitted_spec_is_named_with_its_path() -> None:
    document = json.loads(encode(REQUEST_SAMPLES[0]))
    del document["spec"]["name"]
    with pytest.raises(msgspec.ValidationError) as raised:
        decode_any(json.dumps(document), Request)
    assert field_error_from_msgspec(raised.value).field == "spec.name"


@pytest.mark.parametrize("kind", ["ListJobs.v1", "GetQueue.v1", "ListNodes.v1"])
def test_a_past_instant_must_name_its_time_zone(kind: str) -> None:
    # 03:00 where? A view of the past is refused rather than read in the service's zone.
    with pytest.raises(msgspec.ValidationError, match=r"\$\.at"):
        decode_any(json.dumps({"type": kind, "at": "2026-11-27T03:00:00"}), Request)
    assert decode_any(json.dumps({"type": kind, "at": "2026-11-27T03:00:00+01:00"}), Request).at == datetime(
        2026, 11, 27, 2, tzinfo=UTC)


@pytest.mark.parametrize("limit", [0, 1001])
def test_a_queue_page_is_bounded(limit: int) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.limit"):
        decode_any(json.dumps({"type": "GetQueue.v1", "limit": limit}), Request)


@pytest.mark.parametrize(("field", "value"), [("offset", -1), ("offset", 1_000_001), ("limit", 0), ("limit", 1001)])
def test_a_search_page_is_bounded(field: str, value: int) -> None:
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{field}"):
        decode_any(json.dumps({"type": "SearchJobs.v1", field: value}), Request)


def test_a_search_page_accepts_its_bounds_and_defaults_to_the_first_200() -> None:
    page = decode_any(json.dumps({"type": "SearchJobs.v1", "offset": 1_000_000, "limit": 1000}), Request)
    assert (page.offset, page.limit) == (1_000_000, 1000)
    assert (SearchJobs().offset, SearchJobs().limit) == (0, 200)


@pytest.mark.parametrize("change", [{"add_nodes": {"gpu-4": 0}}, {"remove_nodes": {"gpu 4": 1}},
                                    {"add_nodes": {"gpu-4": 10_001}}, {"depth": 0}])
def test_a_what_if_refuses_changes_out_of_bounds(change: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_any(json.dumps({"type": "SimulateHistory.v1", "start": "2026-11-20T00:00:00Z", **change}), Request)


def test_request_with_a_bad_status_filter_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.statuses\[0\]"):
        decode_any(b'{"type": "ListJobs.v1", "statuses": ["sleeping"]}', Request)


def test_an_event_is_not_a_request() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_any(encode(EVENT_SAMPLES[0]), Request)


# --- replies ---------------------------------------------------------------------------------------------

VIEW = JobView(job_id="job-000000000001", name="bert", project="default", creator="alice", status="running",
               priority="urgent", mode="pytorch", nodes=2, flavors=["gpu-4"], submitted_at=AT, flavor="gpu-4",
               attempt=1, started_at=AT, placement=PLACEMENT,
               instances=[InstanceView(rank=0, node="gpu-node-1", master=True, state="running", pid=7)])

ARRAY_VIEW = ArrayView(array_id="array-0123456789ab", name="sweep-{index}", project="default", creator="alice",
                       submitted_at=AT, size=4, indices="0-3", max_running=2,
                       statuses={"running": 2, "queued": 1, "succeeded": 1})
SUMMARY = JobSummary(job_id="job-000000000001", name="bert", project="default", creator="alice", status="running",
                     priority="urgent", mode="pytorch", flavors=["gpu-4"], flavor="gpu-4", submitted_at=AT, nodes=2,
                     master="gpu-node-1")

REPLY_SAMPLES: list[Any] = [
    CommandError(code="invalid-spec", message="the job spec is invalid", hint="fix it",
                 errors=[FieldError(field="nodes", message="is bad", hint="use 1")]),
    JobAccepted(job_id="job-000000000001", status="queued", created=True),
    SimulationReport(start=AT, end=AT + timedelta(days=1), jobs=3, nodes_real=2, nodes_simulated=3, cycles=40,
                     waits=[PriorityWaits(priority="urgent", jobs=2, real_p50=30.0, simulated_p50=0.0)],
                     utilization=[FlavorUse(flavor="gpu-4", real=0.5, simulated=0.4)], compared=3, same_start=2,
                     moved=[MovedJob(job_id="job-000000000001", name="bert", priority="normal", submitted_at=AT,
                                     real_start=AT + timedelta(hours=2), simulated_start=AT)],
                     series=[SimulationPoint(at=AT, queued_real=2, queued_simulated=1, busy_real=0.5,
                                             busy_simulated=0.75)],
                     notes=["nodes present throughout"]),
    JobList(jobs=[VIEW]),
    JobList(jobs=[VIEW], arrays=[ARRAY_VIEW]),
    SearchResults(jobs=[SUMMARY], total=1234),
    ArrayAccepted(array_id="array-0123456789ab", job_ids=["job-000000000001", "job-000000000002"], created=True),
    ArrayDetails(array=ARRAY_VIEW, jobs=[ArrayMemberView(index=3, job_id="job-000000000001", status="failed",
                                                         exit_code=1, values={"lr": "0.1"})], more=True),
    JobDetails(job=VIEW, spec=SPEC),
    NodeList(nodes=[NodeView(info=NODE, status="ready", used=Resources(cpus=8, memory_mib=1024, accelerators=4),
                             jobs=["job-000000000001"])]),
    Done(job_ids=["job-000000000001"], message="stopping 1 job(s)"),
    QueueStatus(queued_jobs=2, queued_by_flavor={"gpu-4": 3}, running_jobs=1),
    QueueStatus(queued_jobs=1, queued_by_flavor={"gpu-4": 1}, running_jobs=0, instances=[
        ScaledInstance(name="gpu-3f2a9c", instance_type="gpu", provider="aws-ec2", state="booting", since=AT,
                       jobs=["job-000000000001"], provider_id="i-0abc")],
        cooldowns=[TypeCooldown(instance_type="gpu-spot", until=AT, failures=2)]),
    AutoscalerLog(entries=[EventEnvelope(event_id="e-3", service="autoscaler", aggregate_type="instance",
                                         aggregate_id="gpu-3f2a9c", version=1, position=3, recorded_at=AT,
                                         event=InstanceReady(instance="gpu-3f2a9c", node="gpu-3f2a9c"))],
                  next_after=3, more=False),
    CacheListing(nodes=[NodeCache(node="gpu-node-1", reported_at=AT, entries=[CACHE_ENTRY], disk_bytes=10**12,
                                  used_bytes=10**11, copying=[CopyUnderWay(
                                      source="datasets/b", key="0123456789abcdef01234568", done_bytes=5,
                                      total_bytes=10, started_at=AT)],
                                  failures=[StagingFailed(source="datasets/c", reason="gone", failed_at=AT)],
                                  complete=False, total_entries=7000, images=[CACHED_IMAGE])]),
    PreloadAccepted(preload_id="preload-0123456789ab", source="datasets/imgs/v1", nodes=["gpu-node-1"]),
    RunView(job_id="job-000000000001", series=[SeriesView(name="loss", task=0, rank=0, count=2, last=0.5, least=0.5,
                                                          greatest=0.9, last_step=2, last_at=AT)],
            config={"lr": 0.1, "optimizer": "adam"}, summary={"best": 0.5}),
    SeriesPage(points=[SeriesPoint(rank=0, step=2, value=0.5, at=AT)], next_after=7, more=True),
    TerminalOpened(session_id="3f2a", node="gpu-node-1", rank=0, attempt=1),
    StorageAccessList(entries=[StoredAccess(kind="output", name="out", owner="alice", project="default")]),
    UploadReceived(upload_id="0" * 32, received_bytes=2),
    ImageList(images=[IMAGE]),
    LogPage(chunks=[LogChunk(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", seq=3,
                             lines=["epoch 1"])], next_after=43, more=True, ended=False),
    JobUsage(samples=[UsageSample(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1",
                                  cpu_percent=97.5, memory_mib=2048, processes=3, sampled_at=AT)]),
    AlertPage(alerts=[EventEnvelope(event_id="e-9", service="monitor", aggregate_type="alert",
                                    aggregate_id="node-lost-gpu-node-1-2", version=1, position=9, recorded_at=AT,
                                    event=AlertRaised(alert_id="node-lost-gpu-node-1-2", kind="node-lost",
                                                      title="Node gpu-node-1 was lost", message="silent",
                                                      node="gpu-node-1"))],
              next_after=9, more=False),
]


@pytest.mark.parametrize("reply", REPLY_SAMPLES, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips_through_the_reply_union(reply: Any) -> None:
    decoded = decode_any(encode(reply), Reply)
    assert type(decoded) is type(reply)
    assert decoded == reply


def test_search_results_of_a_scheduler_without_counts_or_node_columns_still_decode() -> None:
    document = json.loads(encode(SearchResults(jobs=[SUMMARY], total=1234)))
    del document["total"], document["jobs"][0]["nodes"], document["jobs"][0]["master"]
    decoded = decode_any(json.dumps(document), Reply)
    assert decoded == SearchResults(jobs=[msgspec.structs.replace(SUMMARY, nodes=None, master=None)])


def test_command_error_is_tagged_error_v1() -> None:
    assert json.loads(encode(REPLY_SAMPLES[0]))["type"] == "Error.v1"


# --- node agent protocol ---------------------------------------------------------------------------------

AGENT_SAMPLES: list[Any] = [
    RegisterNode(node=NODE),
    NodeAccepted(heartbeat_seconds=2.5),
    Heartbeat(node="gpu-node-1", sent_at=AT, running=["job-000000000001"]),
    StartProcess(job_id="job-000000000001", attempt=1, launch=LAUNCH),
    ProcessAccepted(already_known=False),
    StopProcesses(job_id="job-000000000001", attempt=1, grace_seconds=30.0),
    Stopped(stopped=2),
    ProcessStarted(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", pid=99),
    ProcessExited(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", exit_code=0),
    ProcessExited(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", exit_code=0, exited_at=AT,
                  started=ProcessStarted(job_id="job-000000000001", attempt=1, rank=0, node="gpu-node-1", pid=99,
                                         started_at=AT)),
]
HEALTH_SAMPLES: list[Any] = [
    Heartbeat(node="gpu-node-1", sent_at=AT, health=[ComponentHealth(kind="nic", name="eth0", healthy=True)]),
    StopProcesses(job_id="job-000000000001", attempt=1, grace_seconds=60.0, checkpoint_signal="SIGUSR1"),
    PrecheckNode(job_id="job-000000000001", cpus=4, memory_mib=8192, accelerators=4),
    PrecheckReport(node="gpu-node-1", checks=[ComponentHealth(kind="runtime", name="storage", healthy=False,
                                                              detail="not writable")]),
    ReleaseWorkspaces(job_id="job-000000000001"),
    Released(removed=2),
    OpenSession(session_id="3f2a", job_id="job-000000000001", attempt=1, rank=0, command=None),
    SessionOpened(session_id="3f2a", pid=77),
    SessionControl(columns=120, rows=40),
    SessionExited(exit_code=0),
    ReservePorts(job_id="job-000000000001", attempt=2, count=1),
    PortsReserved(ports=[30211]),
    StageDataset(preload_id="preload-0123456789ab", source="datasets/imgs/v1"),
    StageAccepted(),
]
AgentMessage = (RegisterNode | NodeAccepted | Heartbeat | StartProcess | ProcessAccepted | StopProcesses | Stopped
                | ProcessStarted | ProcessExited | PrecheckNode | PrecheckReport | ReleaseWorkspaces | Released
                | OpenSession | SessionOpened | SessionControl | SessionExited | ReservePorts | PortsReserved
                | StageDataset | StageAccepted)


@pytest.mark.parametrize("message", AGENT_SAMPLES + HEALTH_SAMPLES, ids=lambda m: type(m).__name__)
def test_every_agent_message_round_trips(message: Any) -> None:
    decoded = decode_any(encode(message), AgentMessage)
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("report", AGENT_SAMPLES[7:], ids=lambda m: type(m).__name__)
def test_process_reports_decode_as_process_report(report: Any) -> None:
    assert decode_any(encode(report), ProcessReport) == report


@pytest.mark.parametrize("reply", [AGENT_SAMPLES[1], AGENT_SAMPLES[4], AGENT_SAMPLES[6]],
                         ids=lambda m: type(m).__name__)
def test_agent_replies_decode_as_agent_reply(reply: Any) -> None:
    assert decode_any(encode(reply), AgentReply) == reply


def test_a_registration_hands_the_agent_its_cache_policy_and_defaults_to_the_spec() -> None:
    accepted = NodeAccepted(heartbeat_seconds=2.5, cache=CachePolicy(retention_seconds=3600.0, high_percent=80.0,
                                                                       low_percent=60.0))
    assert decode_any(encode(accepted), AgentReply) == accepted
    default = decode_any(b'{"type": "NodeAccepted.v1", "heartbeat_seconds": 1.0}', AgentReply)
    assert isinstance(default, NodeAccepted) and default.cache.retention_seconds == 7 * 86400  # D1: 7 days


def test_a_cache_report_round_trips_and_its_keys_are_checked() -> None:
    report = CacheReport(node="gpu-node-1", sent_at=AT, entries=[CACHE_ENTRY], disk_bytes=10**12, used_bytes=10**9,
                         evicted=[CacheEviction(key="0123456789abcdef01234568", source="datasets/old", bytes=1,
                                                cause="retention", evicted_at=AT)])
    assert decode(encode(report), CacheReport) == report
    forged = msgspec.structs.replace(report, entries=[msgspec.structs.replace(CACHE_ENTRY, key="../../etc")])
    with pytest.raises(msgspec.ValidationError, match="key"):
        decode(encode(forged), CacheReport)


def test_a_cache_report_carries_the_nodes_images_and_says_when_it_is_cut_short() -> None:
    report = CacheReport(node="gpu-node-1", sent_at=AT, entries=[CACHE_ENTRY], total_entries=1, images=[CACHED_IMAGE])
    assert decode(encode(report), CacheReport) == report and report.complete
    assert not msgspec.structs.replace(report, total_entries=MAX_CACHE_ENTRIES_REPORTED + 1).complete
    for forged in (msgspec.structs.replace(CACHED_IMAGE, key="../../etc"),
                   msgspec.structs.replace(CACHED_IMAGE, digest="5a2e07c4bd31"),
                   msgspec.structs.replace(CACHED_IMAGE, format="zip")):
        with pytest.raises(msgspec.ValidationError, match=r"images\[0\]"):
            decode(encode(msgspec.structs.replace(report, images=[forged])), CacheReport)


def test_an_older_agents_cache_report_still_decodes_and_one_that_fills_the_bound_may_be_cut_short() -> None:
    """Agents are upgraded node by node: a report without the later fields is the whole cache and no images,
    unless it holds as many entries as a report carries (an older agent cut its cache there, without saying)."""
    older = {"type": "CacheReport.v1", "node": "gpu-node-1", "sent_at": AT.isoformat(),
             "entries": [msgspec.to_builtins(CACHE_ENTRY)], "disk_bytes": 10**12, "used_bytes": 10**9}
    report = decode(encode(older), CacheReport)
    assert (report.entries, report.images, report.total_entries, report.complete) == ([CACHE_ENTRY], [], None, True)
    full = {**older, "entries": [msgspec.to_builtins(msgspec.structs.replace(CACHE_ENTRY, key=f"{i:024x}"))
                                 for i in range(MAX_CACHE_ENTRIES_REPORTED)]}
    assert not decode(encode(full), CacheReport).complete
    listed = decode(b'{"type": "CacheListing.v1", "nodes": [{"node": "gpu-node-1", "entries": [],'
                    b' "reported_at": "2024-05-01T12:30:15Z"}]}', CacheListing)
    assert (listed.nodes[0].complete, listed.nodes[0].total_entries, listed.nodes[0].images) == (True, None, [])


@pytest.mark.parametrize("source", ["../etc", "datasets/../../etc", "/datasets/a", "models/m", "datasets/a/b/c",
                                    "datasets/.hidden"])
def test_a_preload_copies_only_a_dataset_folder_of_shared_storage(source: str) -> None:
    body = encode({"type": "StageDataset.v1", "preload_id": "preload-0123456789ab", "source": source})
    with pytest.raises(msgspec.ValidationError, match="source"):
        decode_any(body, AgentMessage)


def test_a_metric_batch_round_trips_and_names_and_labels_are_checked() -> None:
    batch = MetricBatch(job_id="job-000000000001", attempt=1, task=0, rank=1, node="gpu-node-1", process="pid-42",
                        points=[MetricPoint(seq=1, name="eval/acc", value=0.5, at=AT, step=3)],
                        config={"lr": 0.1}, summary={"best": 0.9})
    assert decode(encode(batch), MetricBatch) == batch
    for field, forged in (("process", "../x"), ("points", [[1, "bad name", 1.0, AT.isoformat(), None]])):
        raw = {**msgspec.to_builtins(batch), field: forged}
        with pytest.raises(msgspec.ValidationError, match="process" if field == "process" else "points"):
            decode(msgspec.json.encode(raw), MetricBatch)


def test_ports_reserved_is_an_agent_reply() -> None:
    assert decode_any(encode(PortsReserved(ports=[30211, 30212])), AgentReply) == PortsReserved(ports=[30211, 30212])


@pytest.mark.parametrize("count", [0, -1, MAX_PORTS_PER_REQUEST + 1])
def test_a_port_request_asks_for_at_least_one_port_and_a_bounded_number(count: int) -> None:
    body = f'{{"type": "ReservePorts.v1", "job_id": "job-000000000001", "attempt": 1, "count": {count}}}'.encode()
    with pytest.raises(msgspec.ValidationError, match="count"):
        decode_any(body, AgentMessage)


@pytest.mark.parametrize("other", [{"rank": 1}, {"attempt": 2}, {"node": "gpu-node-2"}, {"task": 1},
                                   {"job_id": "job-000000000002"}], ids=lambda o: next(iter(o)))
def test_an_exit_report_refuses_a_start_of_another_process(other: dict[str, Any]) -> None:
    start = {"job_id": "job-000000000001", "attempt": 1, "rank": 0, "node": "gpu-node-1", "pid": 99, **other}
    report = {"type": "ProcessExited.v1", "job_id": "job-000000000001", "attempt": 1, "rank": 0,
              "node": "gpu-node-1", "exit_code": 0, "started": start}
    with pytest.raises(msgspec.ValidationError, match="the start reported with an exit must be of the same process"):
        decode_any(json.dumps(report).encode(), ProcessReport)


def test_a_process_report_is_not_an_agent_reply() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_any(encode(AGENT_SAMPLES[7]), AgentReply)


def test_stop_processes_defaults_to_a_ten_second_grace() -> None:
    decoded = decode_any(b'{"type": "StopProcesses.v1", "job_id": "j", "attempt": 1}', AgentMessage)
    assert decoded == StopProcesses(job_id="j", attempt=1, grace_seconds=10.0)


def test_log_chunk_round_trips() -> None:
    chunk = LogChunk(job_id="job-000000000001", attempt=1, rank=1, node="gpu-node-2", seq=0,
                     lines=["epoch 1", "this iteration hardware time is 2201.521 and e2e time is 3317.79 ms."])
    assert decode(encode(chunk), LogChunk) == chunk


def test_node_info_accelerator_summary() -> None:
    assert NODE.accelerator_count == 8
    assert NODE.board == "A100"
    assert NODE.driver_version == "535.104"
    cpu_only = NodeInfo(name="cpu-1", address="10.0.0.9", cpus=4, memory_mib=8192)
    assert (cpu_only.accelerator_count, cpu_only.board, cpu_only.driver_version) == (0, None, None)


def test_a_stored_submission_with_a_newer_spec_field_still_decodes() -> None:
    """Events outlive their writers: a spec field an older reader does not know is skipped."""
    event = JobSubmitted(job_id="job-000000000001", spec=SPEC, creator="alice")
    document = json.loads(encode(event))
    document["spec"]["added_later"] = {"x": 1}
    document["spec"]["checkpoint_resume"]["added_later_too"] = True
    assert decode_any(json.dumps(document), Event) == event


def test_strict_decoding_names_unknown_fields_in_lists_and_options() -> None:
    document = json.loads(encode(REQUEST_SAMPLES[0]))
    document["spec"]["datasets"] = [{"name": "a"}, {"name": "b", "readonly": True}]
    with pytest.raises(msgspec.ValidationError) as raised:
        decode_strict(json.dumps(document), Request)
    assert field_error_from_msgspec(raised.value).field == "spec.datasets[1].readonly"


def test_the_performance_line_of_the_platform_document_parses() -> None:
    match = PERFORMANCE_LINE.search("this iteration hardware time is 2201.521 and e2e time is 3317.794921875 ms.")
    assert match is not None
    assert float(match["hardware"]) / float(match["e2e"]) == pytest.approx(0.66355, abs=1e-5)
    assert PERFORMANCE_LINE.search("this iteration e2e time is 3317 ms.") is None


def test_a_failed_node_check_lists_its_faulty_components() -> None:
    check = NodeCheck(node="n", passed=False, checks=[
        ComponentHealth(kind="nic", name="eth0", healthy=True),
        ComponentHealth(kind="board", name="1", healthy=False, detail="ECC errors")])
    assert check.problems() == ["board:1 faulty (ECC errors)"]


@pytest.mark.parametrize("document", [
    b'{"type": "GetJobLogs.v1", "job_id": "j", "rank": -1}',
    b'{"type": "GetJobLogs.v1", "job_id": "j", "after": -1}',
    b'{"type": "GetJobLogs.v1", "job_id": "j", "max_chunks": 0}',
    b'{"type": "GetJobLogs.v1", "job_id": "j", "max_chunks": %d}' % (MAX_LOG_PAGE_CHUNKS + 1),
    b'{"type": "GetJobLogs.v1", "job_id": "j", "max_bytes": %d}' % (MAX_LOG_PAGE_BYTES + 1),
])
def test_a_log_page_request_out_of_bounds_is_refused_by_field(document: bytes) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.(rank|after|max_chunks|max_bytes)`"):
        decode_strict(document, Request)


def test_a_long_history_is_answered_in_pages_that_each_fit_a_reply_and_join_up() -> None:
    """A job of 1,024 nodes records a start and an exit per node: more than one reply may hold."""
    events = [EventEnvelope(event_id=f"e-{i}", service="launcher", aggregate_type="launch",
                            aggregate_id="job-000000000001", version=i + 1, position=i + 1, recorded_at=AT,
                            event=NodeProcessStarted(job_id="job-000000000001", attempt=1, rank=i, node=f"node-{i:04}",
                                                     pid=1000 + i)) for i in range(2048)]
    pages, start = [], 0
    while True:
        page = history_page(events, start)
        assert len(encode(page)) <= MAX_HISTORY_PAGE_BYTES
        pages.append(page)
        if page.next is None:
            break
        start = page.next
    assert len(pages) > 1
    assert [e for page in pages for e in page.events] == events
    assert history_page(events, len(events)) == JobHistory(events=[])
    assert history_page(events[:1], 0, max_bytes=10).events == events[:1]  # one event, whatever its size


def test_a_log_page_request_defaults_to_the_first_page_of_every_rank_within_a_reply() -> None:
    request = decode_strict(b'{"type": "GetJobLogs.v1", "job_id": "job-000000000001"}', Request)
    assert request == GetJobLogs(job_id="job-000000000001", rank=None, after=0)
    assert request.max_bytes <= MAX_LOG_PAGE_BYTES <= 1024 * 1024 // 2  # well under NATS's default max payload


@pytest.mark.parametrize("document", [
    b'{"type": "ListAlerts.v1", "after": -1}',
    b'{"type": "ListAlerts.v1", "limit": 0}',
    b'{"type": "ListAlerts.v1", "limit": %d}' % (MAX_ALERT_PAGE + 1),
])
def test_an_alert_page_request_out_of_bounds_is_refused_by_field(document: bytes) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.(after|limit)`"):
        decode_strict(document, Request)


def test_an_alert_page_request_defaults_to_a_bounded_first_page_on_the_monitors_query_subject() -> None:
    request = decode_strict(b'{"type": "ListAlerts.v1"}', Request)
    assert request == ListAlerts(after=0) and 1 <= request.limit <= MAX_ALERT_PAGE
    assert LIST_ALERTS.subject == "trainyard.query.alerts"


def test_log_and_usage_queries_are_scheduler_queries_and_name_one_jobs_subjects() -> None:
    assert JOB_LOGS.subject == "trainyard.query.jobs.logs"
    assert JOB_USAGE.subject == "trainyard.query.jobs.usage"
    assert subjects.job_logs("job-000000000001") == "trainyard.logs.job-000000000001.*.*"
    assert subjects.job_logs("job-000000000001", 2) == "trainyard.logs.job-000000000001.2.*"
    assert subjects.USAGE_STREAM == "KV_trainyard-usage"
    assert subjects.usage_of_job("job-000000000001") == "$KV.trainyard-usage.job-000000000001.>"


def test_every_subject_an_agent_publishes_for_a_job_ends_with_its_node() -> None:
    job = "job-000000000001"
    assert subjects.node_logs(job, 2, "node-a") == "trainyard.logs.job-000000000001.2.node-a"
    assert subjects.usage_key(job, 1, 2, "node-a") == "job-000000000001.1.2.node-a"
    assert subjects.agent_usage("node-a") == "$KV.trainyard-usage.*.*.*.node-a"
    for subject in (subjects.agent_report("node-a"), subjects.agent_cache("node-a"), subjects.heartbeat("node-a"),
                    subjects.node_logs(job, 2, "node-a"), subjects.job_metrics(job, "node-a"),
                    f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key(job, 1, 2, 'node-a')}"):
        assert subjects.sender_of(subject) == "node-a", subject
        assert subjects.sender_refusal(subject, "node-a") is None
        assert subjects.sender_refusal(subject, "node-b") == (
            f"published by node node-a on {subject} but it names node node-b")


def test_a_subject_that_names_no_node_binds_no_message_to_a_sender() -> None:
    for subject in ("trainyard.logs.job-000000000001.2", f"$KV.{subjects.USAGE_BUCKET}.job-000000000001.1.2",
                    "trainyard.agent-reports.node-a.extra", SUBMIT_JOB.subject):
        assert subjects.sender_of(subject) is None, subject
        assert subjects.sender_refusal(subject, "node-a") == f"published on {subject}, which names no node"


def test_a_set_aside_record_is_one_aggregate_per_consumer_and_stream_sequence() -> None:
    assert set_aside_id("monitor-events", 7) == "monitor-events-7"
    record = decode_any(b'{"type": "UpstreamMessageSetAside.v1", "consumer": "agent-reports", "stream": "S", '
                        b'"sequence": 3, "subject": "x", "cause": "undecodable", "reason": "not JSON"}', Event)
    assert isinstance(record, UpstreamMessageSetAside)
    assert (record.claimed_service, record.claimed_type) == (None, None)
    # The monitor follows every service's set-aside records and nothing else.
    subject = subjects.event_subject("launcher", "upstream", "UpstreamMessageSetAside")
    assert subject == "trainyard.events.launcher.upstream.UpstreamMessageSetAside"
    assert subjects.SET_ASIDE_ALL == "trainyard.events.*.upstream.UpstreamMessageSetAside"


def test_the_service_a_follower_follows_is_read_from_its_subject_filter() -> None:
    assert subjects.service_of_events(subjects.events_of_service("monitor")) == "monitor"
    assert subjects.service_of_events(subjects.SET_ASIDE_ALL) is None
    assert subjects.service_of_events(subjects.EVENTS_ALL) is None
    assert subjects.service_of_events(subjects.AGENT_REPORTS_ALL) is None
    assert subjects.service_of_events(subjects.events_of("monitor", "node", "job")) == "monitor"
    several = [*subjects.events_of("monitor", "node"), subjects.events_of_service("launcher")]
    assert subjects.service_of_events(several) is None


def test_a_follower_names_the_aggregates_it_reads() -> None:
    assert subjects.events_of("monitor", "node", "cache") == ("trainyard.events.monitor.node.>",
                                                              "trainyard.events.monitor.cache.>")


def test_a_watch_names_an_inbox_and_pushes_decode_by_their_tag() -> None:
    for inbox in ("", "users.user-alice.x", "_INBOX", "_INBOX.users.*", "_INBOX.users.>", "_INBOX.a b.c",
                  "_INBOX.users.user-alice.x\n"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"type": "WatchJob.v1", "job_id": "job-000000000001", "inbox": inbox}, WatchJob)
    chunk = LogChunk(job_id="job-000000000001", attempt=1, rank=0, node="n0", seq=0, lines=["hi"])
    for push in (LogPushed(job_id="job-000000000001", position=9, previous=None, chunk=chunk),
                 JobChanged(job_id="job-000000000001", status="running")):
        assert decode_any(encode(push), JobPush) == push


def test_each_chunk_of_a_rank_is_passed_once_and_notices_always() -> None:
    def chunk(seq: int, node: str = "n0", attempt: int = 1) -> LogChunk:
        return LogChunk(job_id="job-000000000001", attempt=attempt, rank=0, node=node, seq=seq, lines=[str(seq)])

    once = ChunksOnce()
    shipped = [chunk(0), chunk(1), chunk(1), chunk(0), chunk(-1), chunk(-1), chunk(0, node="n1"), chunk(0, attempt=2),
               chunk(2)]
    assert [(c.node, c.attempt, c.seq) for c in once.fresh(shipped)] == [
        ("n0", 1, 0), ("n0", 1, 1), ("n0", 1, -1), ("n0", 1, -1), ("n1", 1, 0), ("n0", 2, 0), ("n0", 1, 2)]
