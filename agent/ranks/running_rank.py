"""A rank of a job as this node's agent knows it while it is prepared, runs and is reported: what started it,
where it runs, what it holds of the node's caches, and how far its output is shipped."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from agent.caches.preparation import holder_of
from agent.isolation.workspace import Workspace
from agent.output.runs import RunRelay
from agent.output.tail import OutputTail
from agent.processes.holder_client import HeldProcess
from agent.ranks.process import ProcessGroup
from libs.contracts.agent import StartProcess
from libs.contracts.datacache import StagedDataset

RankKey = tuple[str, int, int, int]  # (job, attempt, task, rank)


class PendingStart(msgspec.Struct, frozen=True, kw_only=True):
    """A start accepted and not begun yet, as kept on disk (agent/ranks/process.py write_pending)."""

    request: StartProcess
    trace: dict[str, str] = msgspec.field(default_factory=dict)


@dataclass
class RunningNode:
    job_id: str
    attempt: int
    rank: int
    task: int = 0  # J3: which task of a batch job
    group: HeldProcess | None = None
    runner: asyncio.Task[None] | None = None
    output: OutputTail | None = None  # what of the node's output file is shipped
    output_done: bool = False  # the process ended: ship what is left, then stop
    # The job's trace context from the start request, carried on this node's reports.
    trace: dict[str, str] = field(default_factory=dict)
    # Where and how the node's command runs, for commands run later in the same environment.
    workspace: Workspace | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Commands run in this node's environment on another node's request (MPI daemons).
    execs: list[ProcessGroup] = field(default_factory=list)
    # J15: the node's folder stays after the process ended (debug sessions) until it is released.
    keep: bool = False
    # The job attempt's token from the launcher: only a request carrying it may run a command in this node.
    job_token: str | None = None
    staged: list[StagedDataset] = field(default_factory=list)  # J14: its data preparation
    image: str | None = None  # J10: the image it runs in (NAME:TAG@digest), pinned in the node's cache
    image_unpacked: bool = False  # and whether its start unpacked it
    # Its launch names no image, so it pins none: its end costs no look at the image cache (a rank adopted from
    # the agent before is not known to be, and is looked for there).
    imageless: bool = False
    relay: RunRelay | None = None  # R1: where its processes log their metrics
    # A parameter server or standby: it runs until stopped, and the launcher must know it runs before the
    # workers' exits end their task, so its start is reported at once.
    helper: bool = False

    # Done once the process ended: its shipper wakes at once rather than at its next look.
    _ended: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    @property
    def holder(self) -> str:
        return holder_of(self.job_id, self.attempt, self.task, self.rank)

    @property
    def key(self) -> RankKey:
        return self.job_id, self.attempt, self.task, self.rank

    def is_running(self) -> bool:
        """Whether its process is followed by this agent and has not ended."""
        return self.runner is not None and not self.runner.done()

    def process_ended(self) -> None:
        """Ship what is left of the output now, then stop."""
        self.output_done = True
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    async def pause(self, seconds: float) -> None:
        """Wait `seconds` before looking at the output again, or less once the process ended."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        if not self.output_done:
            await asyncio.wait((self._ended,), timeout=seconds)
