"""The protocol between the launcher, the monitor and node agents.

Agents speak NATS only: they register and heartbeat to the monitor, take start/stop requests from
the launcher, and publish process reports and log chunks to JetStream, where the services read
them durably (an agent never touches PostgreSQL).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from libs.contracts.cluster import NodeInfo
from libs.contracts.datacache import STAGE_SOURCE, CachePolicy, StagedDataset
from libs.contracts.events import NodeLaunch
from libs.contracts.health import ComponentHealth


class _AgentMessage(Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class RegisterNode(_AgentMessage, frozen=True, tag="RegisterNode.v1"):
    node: NodeInfo


class AnnounceNodes(_AgentMessage, frozen=True, tag="AnnounceNodes.v1"):
    """The monitor asks the agents of `nodes` (every agent: empty) to register again (RegisterNode)."""

    nodes: list[str] = msgspec.field(default_factory=list)


class NodeAccepted(_AgentMessage, frozen=True, tag="NodeAccepted.v1"):
    heartbeat_seconds: float
    cache: CachePolicy = msgspec.field(default_factory=CachePolicy)  # D1, D2: how it keeps its dataset cache


class Heartbeat(_AgentMessage, frozen=True, tag="Heartbeat.v1"):
    node: str
    sent_at: datetime
    running: list[str] = msgspec.field(default_factory=list)
    # M2: what the agent's probes found (NICs, boards, runtime environment); empty from old agents.
    health: list[ComponentHealth] = msgspec.field(default_factory=list)
    # D1: why the node's disk is under pressure (it takes no new work), after its cache evicted what it could.
    disk_pressure: Annotated[str, Meta(max_length=500)] | None = None


class StartProcess(_AgentMessage, frozen=True, tag="StartProcess.v1"):
    """Start one node of a job. Idempotent per (job_id, attempt, task, rank).

    `job_token` (libs.auth.issue_job_token) is made when the request is sent and never stored in an
    event: the job's processes get it only when they need it (MPI's remote shell, agent.rsh).
    """

    job_id: str
    attempt: int
    launch: NodeLaunch
    job_token: str | None = None


class ProcessAccepted(_AgentMessage, frozen=True, tag="ProcessAccepted.v1"):
    already_known: bool


# Bounds a request of several starts: what the launcher has due for one node at once, in requests of this many.
MAX_STARTS_PER_REQUEST = 64
# Bounds the trace context a start carries (`traceparent`, `tracestate`, a few more for other propagators).
MAX_TRACE_FIELDS = 8


class TracedStart(Struct, frozen=True, kw_only=True):
    """One start of a StartProcesses and the trace context it continues: its job's (the launcher's span of it)."""

    start: StartProcess
    trace: Annotated[dict[str, str], Meta(max_length=MAX_TRACE_FIELDS)] = msgspec.field(default_factory=dict)


class StartProcesses(_AgentMessage, frozen=True, tag="StartProcesses.v1"):
    """Start several nodes of jobs on this node, each as StartProcess starts one (idempotent alike): what the
    launcher has due for a node at once goes in one request, with one signature and one answer."""

    starts: Annotated[list[TracedStart], Meta(min_length=1, max_length=MAX_STARTS_PER_REQUEST)]


class StartRefused(_AgentMessage, frozen=True, tag="StartRefused.v1"):
    """A start of a StartProcesses not taken: why, as start-process's error would say it (`code`, `message`)."""

    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=2000)]


class StartsAnswered(_AgentMessage, frozen=True, tag="StartsAnswered.v1"):
    """Each start's answer, in the order of the request: accepted, or refused."""

    answers: list[ProcessAccepted | StartRefused]


# Bounds a request for rendezvous ports: more ranks than this on one node is no placement of ours.
MAX_PORTS_PER_REQUEST = 256


class ReservePorts(_AgentMessage, frozen=True, tag="ReservePorts.v1"):
    """Choose `count` ports free on this node for a job attempt's rendezvous (L1, L3, L4) and hold them for
    it: ports no process listens on and no other reservation on the host holds. Idempotent per
    (job_id, attempt): asked again, the agent answers the same ports. They are held while the attempt has
    processes on the node, or for a while after the answer when it has none yet."""

    job_id: str
    attempt: int
    count: Annotated[int, Meta(ge=1, le=MAX_PORTS_PER_REQUEST)]


class PortsReserved(_AgentMessage, frozen=True, tag="PortsReserved.v1"):
    ports: list[Annotated[int, Meta(ge=1, le=65535)]]


class StopProcesses(_AgentMessage, frozen=True, tag="StopProcesses.v1"):
    """Stop every process of a job attempt on this node: SIGTERM, then SIGKILL after the grace.

    With `checkpoint_signal` (J12, M3), every process of the attempt that handles that signal gets it
    instead of SIGTERM, and the grace is the job's graceful shutdown time; then what is left is killed.
    """

    job_id: str
    attempt: int
    grace_seconds: float = 10.0
    task: int | None = None  # only this task of a batch job (its parameter servers, its standbys)
    checkpoint_signal: str | None = None


class PrecheckNode(_AgentMessage, frozen=True, tag="PrecheckNode.v1"):
    """M1: probe the node now for a job about to be placed here with these resources."""

    job_id: str
    cpus: float
    memory_mib: int
    accelerators: int = 0


class PrecheckReport(_AgentMessage, frozen=True, tag="PrecheckReport.v1"):
    node: str
    checks: list[ComponentHealth]


class StageDataset(_AgentMessage, frozen=True, tag="StageDataset.v1"):
    """D2, signed by the monitor: copy `source` (a dataset folder of shared storage) into the node's cache, as
    the preload `preload_id` asks. Answered at once (`StageAccepted`); the copy shows in the node's cache
    reports, as under way, then as an entry or a failure."""

    preload_id: str
    source: Annotated[str, Meta(pattern=STAGE_SOURCE)]


class StageAccepted(_AgentMessage, frozen=True, tag="StageAccepted.v1"):
    pass


class ReleaseWorkspaces(_AgentMessage, frozen=True, tag="ReleaseWorkspaces.v1"):
    """J15: the retention of a job's kept environments is over: remove them. Idempotent."""

    job_id: str


class Released(_AgentMessage, frozen=True, tag="Released.v1"):
    removed: int


class OpenSession(_AgentMessage, frozen=True, tag="OpenSession.v1"):
    """J15: run `command` (or, without one, an interactive shell on a terminal) in a kept or running
    node environment of a job, with the job's variables and mounts.

    The session then speaks on `subjects.session(node, owner, session_id, ...)`: the client publishes
    keystrokes (raw bytes) to `in` and `SessionControl` to `control`; the agent publishes output
    (raw bytes) to `out` and, once, `SessionExited` to `exit`. A session without a control message
    for `idle_seconds` is ended. `owner` is the NATS user of the person the monitor opened it for
    (libs.natsroles.user_nats_name): NATS lets no one else read or type into it. An agent refuses a
    request without one (from a monitor older than this field).
    """

    session_id: str
    job_id: str
    attempt: int
    rank: int
    task: int = 0
    command: str | None = None
    columns: int = 80
    rows: int = 24
    idle_seconds: float = 60.0
    owner: str = ""


class SessionOpened(_AgentMessage, frozen=True, tag="SessionOpened.v1"):
    session_id: str
    pid: int


class SessionControl(_AgentMessage, frozen=True, tag="SessionControl.v1"):
    """A keep-alive, a terminal resize, or (close) the end of input."""

    columns: int | None = None
    rows: int | None = None
    close: bool = False


class SessionExited(_AgentMessage, frozen=True, tag="SessionExited.v1"):
    exit_code: int


class ExecInJob(_AgentMessage, frozen=True, tag="ExecInJob.v1"):
    """Run `command` (a shell command line) on this node, inside a running job's environment and
    process group. How MPI's launcher starts its daemons on the other nodes of a job (L2); the
    exit code is published to `reply_to` as ExecExited."""

    job_id: str
    attempt: int
    command: str
    reply_to: str
    task: int = 0


class ExecExited(_AgentMessage, frozen=True, tag="ExecExited.v1"):
    exit_code: int


class Stopped(_AgentMessage, frozen=True, tag="Stopped.v1"):
    stopped: int


# A process report (ProcessStarted, ProcessExited) is published on `subjects.agent_report(node)`, which only
# `node`'s agent may publish on; the launcher takes it only when `node` is that subject's and the one the attempt's
# plan put the rank on (services.launcher.rules.report_refusal).


class ProcessStarted(_AgentMessage, frozen=True, tag="ProcessStarted.v1"):
    job_id: str
    attempt: int
    rank: int
    node: str
    pid: int
    # How the node's /workspace was made: "bwrap" (a mount namespace) or "plain" (directories).
    backend: str = "plain"
    task: int = 0  # J3: which task of a batch job
    staged: list[StagedDataset] = msgspec.field(default_factory=list)  # J14: its data preparation
    # J10: the image it runs in (NAME:TAG@digest), and whether this start unpacked it (else: the node's cache).
    image: Annotated[str, Meta(max_length=400)] | None = None
    image_unpacked: bool = False
    # When the process started, by the node's clock: a start reported with its exit reaches the launcher after
    # the process ended. None from older agents.
    started_at: datetime | None = None


class ProcessExited(_AgentMessage, frozen=True, tag="ProcessExited.v1"):
    job_id: str
    attempt: int
    rank: int
    node: str
    exit_code: int
    task: int = 0  # J3: which task of a batch job
    # Why the command never started, when the node is at fault (J14: its data could not be prepared on
    # its disk); the job is then tried on other nodes.
    node_fault: Annotated[str, Meta(max_length=1000)] | None = None
    # Why the command never started when its node is not at fault (J14: a dataset refused or gone from shared
    # storage); the job fails with it. None from older agents, and for a command that ran.
    not_started: Annotated[str, Meta(max_length=1000)] | None = None
    # When the process ended, by the node's clock: the report may reach the launcher much later (NATS or
    # the launcher away). None from older agents.
    exited_at: datetime | None = None
    # The process's start, when it is reported with its exit (a command that ended within moments): one
    # report, and one record of both, instead of two. None when the start was reported on its own, or never.
    started: ProcessStarted | None = None

    def __post_init__(self) -> None:
        started = self.started
        if started is not None and (started.job_id, started.attempt, started.task, started.rank, started.node) != (
                self.job_id, self.attempt, self.task, self.rank, self.node):
            raise ValueError("the start reported with an exit must be of the same process")


class LogChunk(Struct, frozen=True, kw_only=True):
    """Consecutive lines of one node's output; `seq` numbers chunks from 0 for dedupe, across restarts
    of the agent (-1 marked a notice of agents that ended their predecessor's processes). Published on
    `subjects.node_logs(job_id, rank, node)`, which only `node`'s agent may publish on."""

    job_id: str
    attempt: int
    rank: int
    node: str
    seq: int
    lines: list[str]
    task: int = 0  # J3: which task of a batch job


class UsageSample(Struct, frozen=True, kw_only=True):
    """What one node of a job uses now (L9), sampled by its agent over the whole process group.

    Kept as the latest value per node in the key-value bucket `subjects.USAGE_BUCKET`, under the key
    `<job id>.<attempt>.<rank>.<node>` (`subjects.usage_key`): NATS lets an agent write only its own node's keys,
    and a sample whose `node` is not its key's is no sample of that node.
    """

    job_id: str
    attempt: int
    rank: int
    node: str
    cpu_percent: float  # 100 = one CPU fully busy
    memory_mib: int
    processes: int
    sampled_at: datetime
    accelerator_percent: float | None = None  # where the host reports it


ProcessReport = ProcessStarted | ProcessExited
AgentReply = (NodeAccepted | ProcessAccepted | StartsAnswered | PortsReserved | Stopped | PrecheckReport | Released
              | SessionOpened | StageAccepted)
