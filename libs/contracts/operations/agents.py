"""The operations of node agents: registering with the monitor, and what the launcher, the monitor and a
job's remote shell ask the agent of one node (SPEC L1–L5, M2, D2, J15). Their messages are in
`libs/contracts/agent.py`.

An agent's subject names its node; the declaration has `*` in its place (`Operation.subject_for`).
"""

from __future__ import annotations

from libs.contracts import subjects
from libs.contracts.agent import (
    ExecInJob,
    NodeAccepted,
    OpenSession,
    PortsReserved,
    PrecheckNode,
    PrecheckReport,
    ProcessAccepted,
    RegisterNode,
    Released,
    ReleaseWorkspaces,
    ReservePorts,
    SessionOpened,
    StageAccepted,
    StageDataset,
    StartProcess,
    StartProcesses,
    StartsAnswered,
    Stopped,
    StopProcesses,
)
from libs.contracts.operations.base import NODE, Caller, Operation, ReplyT, RequestT

REGISTER_NODE = Operation(
    name="register-node", subject="trainyard.nodes.register", request=RegisterNode, reply=NodeAccepted,
    answered_by="monitor", callers=frozenset({"agent"}), changes_state=True, authentication="agent-credential",
    summary="A node agent joins the cluster (again) and learns how often to heartbeat.")


def _control(name: str, subject: str, request: type[RequestT], reply: type[ReplyT], sender: Caller, *,
             changes_state: bool, summary: str) -> Operation[RequestT, ReplyT]:
    """An operation one control-plane service asks an agent, signed by it."""
    return Operation(name=name, subject=subject, request=request, reply=reply, answered_by="agent",
                     callers=frozenset({sender}), changes_state=changes_state, authentication="control-signature",
                     summary=summary)


RESERVE_PORTS = _control(
    "reserve-ports", subjects.agent_ports(NODE), ReservePorts, PortsReserved, "launcher", changes_state=True,
    summary="Choose free TCP ports on the node for a job's rendezvous.")
# What the launcher sends: every start due for the node at once. Agents still answer start-process, which the
# launcher sent before it: an agent is upgraded before the launcher that asks it.
START_PROCESSES = _control(
    "start-processes", subjects.agent_starts(NODE), StartProcesses, StartsAnswered, "launcher", changes_state=True,
    summary="Start several nodes of jobs on the node at once, each as start-process does.")
START_PROCESS = _control(
    "start-process", subjects.agent_start(NODE), StartProcess, ProcessAccepted, "launcher", changes_state=True,
    summary="Start one node of a job.")
STOP_PROCESSES = _control(
    "stop-processes", subjects.agent_stop(NODE), StopProcesses, Stopped, "launcher", changes_state=True,
    summary="Stop a job's processes on the node; answered once they are gone.")
PRECHECK_NODE = _control(
    "precheck-node", subjects.agent_precheck(NODE), PrecheckNode, PrecheckReport, "monitor", changes_state=False,
    summary="Probe the node's components before a job starts on it.")
RELEASE_WORKSPACES = _control(
    "release-workspaces", subjects.agent_release(NODE), ReleaseWorkspaces, Released, "monitor", changes_state=True,
    summary="Remove an ended job's workspace from the node.")
STAGE_DATASET = _control(
    "stage-dataset", subjects.agent_stage(NODE), StageDataset, StageAccepted, "monitor", changes_state=True,
    summary="Copy a dataset into the node's cache.")
OPEN_SESSION = _control(
    "open-session", subjects.agent_open_session(NODE), OpenSession, SessionOpened, "monitor", changes_state=True,
    summary="Start a debug terminal inside a job on the node.")
EXEC_IN_JOB = Operation(
    name="exec-in-job", subject=subjects.agent_exec(NODE), request=ExecInJob, reply=ProcessAccepted,
    answered_by="agent", callers=frozenset({"job"}), changes_state=True, authentication="job-token",
    summary="Run a command inside the job on another of its nodes (MPI's remote shell).")
