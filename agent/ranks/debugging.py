"""Debugging in a rank's environment on this node (SPEC J15): the debug sessions open in running or kept
environments, and the release of a job's kept environments once the monitor says their time is over.

A session runs in the environment of a rank that runs here, or of one whose folder was kept after its
process ended (also by an agent that ran before: the environment is on disk, agent/ranks/kept.py). A
released folder goes with the sessions still open in it and its image pin; a running rank's folder goes
when its process ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client

from agent.caches.imageprep import ImagePreparation
from agent.caches.preparation import holder_of
from agent.output.runs import remove_run_folder
from agent.ranks.kept import (
    SAFE_ID,
    Environment,
    RemovalRefused,
    has_few_entries,
    kept_roots,
    rank_of_folder,
    rank_root,
    read_environment,
    remove_node_root,
)
from agent.ranks.running_rank import RankKey, RunningNode
from agent.ranks.sessions import Session
from libs.contracts.agent import OpenSession, Released, ReleaseWorkspaces, SessionOpened
from libs.contracts.operations.base import CommandError
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
# How long closing the agent waits for its debug sessions to report their end.
SESSION_CLOSE_SECONDS = 5.0


async def remove_rank_folder(root: Path, directory: Path) -> None:
    """Remove a node folder under the agent's `root`: on the loop when it is small (most are), else in a worker
    thread."""
    if has_few_entries(directory):
        remove_node_root(root, directory)
    else:
        await asyncio.to_thread(remove_node_root, root, directory)


class DebugSessions:
    """The debug sessions of this node, and the kept environments they run in."""

    def __init__(self, nc: Client, node: str, root: Path, nodes: dict[RankKey, RunningNode],
                 images: ImagePreparation) -> None:
        """`nodes`: the ranks the agent runs (agent/ranks/runner.py), whose environments sessions may use."""
        self.nc = nc
        self.node = node
        self.root = root
        self.nodes = nodes
        self.images = images
        self.sessions: dict[str, Session] = {}

    def _environment(self, job_id: str, attempt: int, task: int, rank: int) -> tuple[Environment, Path] | None:
        """A running node's environment, or one kept on disk (also by an agent that ran before)."""
        node = self.nodes.get((job_id, attempt, task, rank))
        if node is not None and node.workspace is not None and node.is_running():
            return Environment(workspace=node.workspace, env=node.env), node.workspace.root
        directory = rank_root(self.root, job_id, attempt, task, rank)
        kept = read_environment(directory)
        return None if kept is None else (kept, directory)

    async def open(self, request: OpenSession) -> SessionOpened | CommandError:
        """Start a debug session and answer; the session then lives on its own subjects until it ends."""
        bound = log.bind(job_id=request.job_id, attempt=request.attempt, task=request.task, rank=request.rank,
                         node=self.node, session_id=request.session_id)
        if not (SAFE_ID.match(request.session_id) and SAFE_ID.match(request.job_id) and SAFE_ID.match(request.owner)):
            return CommandError(code="invalid-request",
                                message="the session's owner and the session and job ids are letters, digits, '-' "
                                        "and '_' only; a session has an owner")
        if request.session_id in self.sessions:
            return CommandError(code="conflict",
                                message=f"session {request.session_id} is already open on {self.node}")
        found = self._environment(request.job_id, request.attempt, request.task, request.rank)
        if found is None:
            bound.info("agent.session_refused")
            return CommandError(
                code="not-found",
                message=f"no environment of job {request.job_id} attempt {request.attempt} task {request.task} "
                        f"rank {request.rank} on {self.node}: it does not run here, and was not kept or "
                        "was already released",
                hint="open a terminal while the job runs, or within the retention time of a job that keeps its "
                     "environment (debug terminal)")
        environment, directory = found
        session = Session(self.nc, self.node, request, environment, directory)
        try:
            pid = await session.start()
        except OSError as exc:
            bound.warning("agent.session_not_started", error=str(exc))
            return CommandError(code="internal", message=f"cannot start the session: {exc}")
        self.sessions[request.session_id] = session
        assert session.done is not None
        session.done.add_done_callback(lambda _: self.sessions.pop(request.session_id, None))
        return SessionOpened(session_id=request.session_id, pid=pid)

    async def end(self, sessions: list[Session]) -> None:
        for session in sessions:
            session.kill()
        done = [s.done for s in sessions if s.done is not None]
        if done:
            await asyncio.wait(done, timeout=SESSION_CLOSE_SECONDS)

    async def end_in(self, directory: Path) -> None:
        """End the sessions open in the node folder `directory`."""
        await self.end([s for s in self.sessions.values() if s.directory == directory])

    async def end_all(self) -> None:
        await self.end(list(self.sessions.values()))

    async def release(self, request: ReleaseWorkspaces) -> Released | CommandError:
        if not SAFE_ID.match(request.job_id):
            return CommandError(code="invalid-request", message=f"{request.job_id!r} is not a job id")
        running = [n for n in self.nodes.values() if n.job_id == request.job_id and n.workspace is not None
                   and n.is_running()]
        for node in running:
            node.keep = False  # its folder goes when its process ends
        in_use = {n.workspace.root for n in running if n.workspace is not None}
        removed = 0
        for directory in kept_roots(self.root, request.job_id):
            if directory in in_use:
                continue
            await self.end_in(directory)
            if (rank := rank_of_folder(directory)) is not None:
                self.images.release(holder_of(request.job_id, *rank))
            remove_run_folder(directory)
            try:
                await remove_rank_folder(self.root, directory)
            except (RemovalRefused, OSError) as exc:
                log.warning("agent.workspace_not_removed", job_id=request.job_id, node=self.node,
                            folder=str(directory), error=str(exc))
                continue
            removed += 1
        log.info("agent.workspaces_released", job_id=request.job_id, node=self.node, removed=removed)
        return Released(removed=removed)
