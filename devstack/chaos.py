"""A chaos drill on the whole stack: jobs of mixed shapes run while, in turn, each service is killed -9
beside its standby, NATS is killed -9 and started again, PostgreSQL is stopped `-m immediate` and started
again, and a node agent is killed -9 and started again. Afterwards it checks what a user would:

- every job the client saw acknowledged exists, once (a retried submit keeps its id);
- no rank of any attempt was started twice (counted from the agents' own logs);
- every job ended, as its processes did: a succeeded job's last attempt exited 0 on every rank, a job
  that failed on a rank's exit code had that exit; any other end (a node lost meanwhile) is listed;
- the services rebuild the same state from their logs: every process is killed and started again, and
  each job reads as before.

`bench/chaos.py` runs the long drill and prints its figures; `tests/e2e/test_chaos.py` a short one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import asyncpg
import msgspec

from devstack.harness import Stack, StackClient
from devstack.servers import start_postgres, stop_postgres
from devstack.stack import SERVICES
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from libs.contracts.operations.base import JobStatus
from libs.contracts.operations.jobs import JobAccepted, JobSummary, JobView
from libs.messaging.rpc import ServiceUnavailable

ENDED: list[JobStatus] = ["succeeded", "failed", "stopped", "expired"]
PROBE_PATIENCE = 180.0  # how long a fault may take to recover from before the drill calls it unrecovered
NAME_GROUP = 10  # jobs per name search (`chaos-000` finds chaos-0000 … chaos-0009)
FAILING_EXIT = 3  # the exit code of the jobs meant to fail


class ChaosClient(StackClient, Protocol):
    """What the drill asks of the client beyond the harness's needs."""

    async def submit(self, spec: JobSpec, *, job_id: str | None = None) -> JobAccepted: ...

    async def search(self, *, name: str | None = None, statuses: list[JobStatus] | None = None,
                     creator: str | None = None, algorithm: str | None = None, favorite_algorithm: str | None = None,
                     flavor: str | None = None, output: str | None = None, project: str | None = None,
                     limit: int = 200) -> list[JobSummary]: ...


ChaosClientT = TypeVar("ChaosClientT", bound=ChaosClient)


def job_mix(count: int, seed: int = 7) -> list[JobSpec]:
    """`count` short jobs: one and two nodes, a tenth of them meant to fail with FAILING_EXIT."""
    pick = random.Random(seed)
    jobs = []
    for index in range(count):
        nodes = pick.choice((1, 1, 2))
        exit_code = FAILING_EXIT if index % 10 == 9 else 0
        seconds = round(pick.uniform(0.2, 2.0), 1)
        jobs.append(JobSpec(name=f"chaos-{index:04d}", mode="pytorch" if nodes > 1 else "single-node", nodes=nodes,
                            flavors=["cpu-1"], algorithm=AlgorithmRef(name="sleeper"),
                            output=OutputRef(name=f"chaos-{index:04d}"),
                            command=f'bash -c "exec python3 run.py --seconds {seconds} --exit-code {exit_code}"'))
    return jobs


@dataclass
class Postgres:
    """The drill's own PostgreSQL server (its folder and port), so that it can be crashed."""

    folder: Path
    port: int

    def crash_and_restart(self, down_seconds: float) -> None:
        stop_postgres(self.folder, mode="immediate")
        time.sleep(down_seconds)
        start_postgres(self.folder, self.port)


@dataclass
class Recovery:
    fault: str
    seconds: float | None  # from the fault to the stack answering and a job ending again; None: not seen


@dataclass
class ChaosReport:
    acknowledged: list[str] = field(default_factory=list)
    unacknowledged: list[str] = field(default_factory=list)  # ids whose submit never got an answer
    statuses: Counter[str] = field(default_factory=Counter)
    recoveries: list[Recovery] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # broken promises: each is a defect
    fault_ended: list[str] = field(default_factory=list)  # jobs a fault ended otherwise than their processes
    starts: int = 0
    seconds: float = 0.0


class Drill:
    """One chaos drill on `stack` (with standbys started here) and its own PostgreSQL `postgres`."""

    def __init__(self, stack: Stack[ChaosClientT], database_url: str, postgres: Postgres | None,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        self.stack = stack
        self.database_url = database_url
        self.postgres = postgres
        self.progress = progress
        self.report = ChaosReport()

    # --- faults ------------------------------------------------------------------------------------------

    async def active_instance(self, service: str) -> str:
        """The process name (`scheduler` or `scheduler-2`) of the service's lease holder."""
        holder = ""
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            connection = await asyncpg.connect(self.database_url, timeout=5)
            try:
                holder = str(await connection.fetchval(f"SELECT holder FROM {service}.leadership"))
            finally:
                await connection.close()
        pid = holder.rsplit(":", 1)[-1]
        for name, process in self.stack.processes.processes.items():
            if name in (service, f"{service}-2") and str(process.pid) == pid:
                return name
        return service

    async def kill_service(self, service: str) -> str:
        """kill -9 the active instance of `service` and start it again, as the standby now."""
        name = await self.active_instance(service)
        self.stack.crash(name)
        await asyncio.sleep(0.5)
        if name == service:
            self.stack.start(service)
        else:
            self.stack.start_standby(service)
        return f"kill -9 {name} (active)"

    async def restart_nats(self) -> str:
        await asyncio.to_thread(self.stack.restart_nats, 2.0)
        return "kill -9 nats-server, 2 s down"

    async def crash_postgres(self) -> str:
        assert self.postgres is not None
        await asyncio.to_thread(self.postgres.crash_and_restart, 2.0)
        return "pg_ctl stop -m immediate, 2 s down"

    async def kill_agent(self, node: str) -> str:
        self.stack.crash(f"agent-{node}")
        await asyncio.sleep(0.5)
        self.stack.start(f"agent-{node}")
        return f"kill -9 agent-{node}"

    def faults(self, *, services: Sequence[str] = SERVICES, nats: bool = True, agents: int = 1,
               postgres: bool = True) -> list[Callable[[], Awaitable[str]]]:
        chosen: list[Callable[[], Awaitable[str]]] = []
        for service in services:
            chosen.append(lambda service=service: self.kill_service(service))  # type: ignore[misc]
        if nats:
            chosen.append(self.restart_nats)
        if postgres and self.postgres is not None:
            chosen.append(self.crash_postgres)
        for node in self.stack.nodes[:agents]:
            chosen.append(lambda node=node: self.kill_agent(node))  # type: ignore[misc]
        return chosen

    # --- the run -----------------------------------------------------------------------------------------

    async def run(self, jobs: Sequence[JobSpec], faults: Sequence[Callable[[], Awaitable[str]]], *,
                  fault_every: float, end_timeout: float) -> ChaosReport:
        """Submit `jobs` spread over the faults' time, inject a fault every `fault_every` seconds, wait up to
        `end_timeout` for every job to end, then check."""
        started = time.monotonic()
        self.stack.start_all()
        for service in SERVICES:
            self.stack.start_standby(service)
        await self.stack.wait_for_nodes()
        submitting = asyncio.create_task(self._submit_all(jobs, (len(faults) + 1) * fault_every))
        watching = asyncio.create_task(self._watch_endings())
        try:
            for fault in faults:
                await asyncio.sleep(fault_every)
                await self._inject(fault)
            await submitting
            await self._wait_all_ended(end_timeout)
        finally:
            submitting.cancel()
            watching.cancel()
        await self._check(jobs)
        self.report.seconds = time.monotonic() - started
        return self.report

    async def _submit_all(self, jobs: Sequence[JobSpec], over_seconds: float) -> None:
        for spec in jobs:
            await self._submit(spec, new_job_id())
            if len(self.report.acknowledged) % 50 == 0:
                self.progress(f"submitted {len(self.report.acknowledged)}/{len(jobs)}")
            await asyncio.sleep(over_seconds / len(jobs))

    async def _submit(self, spec: JobSpec, job_id: str, patience: float = 90.0, probe: bool = False) -> None:
        """Submit as a careful user does: again with the same id while it goes unanswered (the client sends it
        a few times itself), for up to `patience` seconds."""
        deadline = time.monotonic() + patience
        while True:
            try:
                await (await self.stack.api()).submit(spec, job_id=job_id)
                if not probe:
                    self.report.acknowledged.append(job_id)
                return
            except Exception as exc:  # unanswered (it may exist all the same), or refused
                if time.monotonic() > deadline:
                    self.report.unacknowledged.append(f"{job_id} ({spec.name}): {exc}")
                    return
                await asyncio.sleep(1.0)

    async def _ended(self) -> int:
        """How many of the drill's jobs ended, by the search read model (a moment behind the jobs)."""
        api = await self.stack.api()
        return len(await api.search(name="chaos-", statuses=ENDED, limit=1000))

    async def _views(self, job_ids: Sequence[str]) -> dict[str, JobView]:
        api = await self.stack.api()
        return {job_id: (await api.get_job(job_id)).job for job_id in job_ids}

    async def _watch_endings(self) -> None:
        """Show how many jobs ended, every 50."""
        ended = 0
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(ServiceUnavailable):
                now = await self._ended()
                if now // 50 > ended // 50:
                    self.progress(f"ended {now}/{len(self.report.acknowledged)} acknowledged")
                ended = now

    async def _inject(self, fault: Callable[[], Awaitable[str]]) -> None:
        """Inject `fault`, then time until a job submitted after it (urgent, ahead of the queue) has run to
        its end: the whole path, submit to exit report, works again."""
        at = time.monotonic()
        name = await fault()
        self.progress(f"fault: {name}")
        probe = msgspec.structs.replace(job_mix(1)[0], name=f"probe-{len(self.report.recoveries):03d}",
                                        nodes=1, mode="single-node", priority="urgent",
                                        command='bash -c "exec python3 run.py --seconds 0.1"')
        recovered: float | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PROBE_PATIENCE):
                job_id = new_job_id()
                await self._submit(probe, job_id, patience=PROBE_PATIENCE, probe=True)
                while True:
                    with contextlib.suppress(ServiceUnavailable):
                        if (await (await self.stack.api()).get_job(job_id)).job.status in ENDED:
                            recovered = time.monotonic() - at
                            break
                    await asyncio.sleep(0.2)
        self.report.recoveries.append(Recovery(name, recovered))
        self.progress(f"  a job ran again {recovered:.1f} s after it" if recovered is not None
                      else f"  no job ran within {PROBE_PATIENCE:.0f} s")

    async def _wait_all_ended(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while True:
                    with contextlib.suppress(ServiceUnavailable):
                        if await self._ended() >= len(self.report.acknowledged):
                            return
                    await asyncio.sleep(1.0)

    # --- the checks --------------------------------------------------------------------------------------

    async def _check(self, jobs: Sequence[JobSpec]) -> None:
        api = await self.stack.api()
        problems = self.report.problems
        names: Counter[str] = Counter()
        for group in range(0, len(jobs), NAME_GROUP):
            names.update(job.name for job in await api.search(name=f"chaos-{group // NAME_GROUP:03d}", limit=1000))
        problems += [f"{name} exists {count} times" for name, count in names.items() if count > 1]
        views: dict[str, JobView] = {}
        for job_id in self.report.acknowledged:
            try:
                views[job_id] = view = (await api.get_job(job_id)).job
            except Exception as exc:
                problems.append(f"acknowledged job {job_id} cannot be read: {exc}")
                continue
            if view.status not in ENDED:
                problems.append(f"{job_id} ({view.name}) did not end: {view.status}")
            else:
                self.report.statuses[view.status] += 1
        starts, exits = agent_records(self.stack.home / "logs")
        self.report.starts = sum(starts.values())
        problems += [f"{job} attempt {attempt} task {task} rank {rank} was started {count} times"
                     for (job, attempt, task, rank), count in starts.items() if count > 1]
        expected = {spec.name: spec for spec in jobs}
        for job_id, ended in views.items():
            if ended.status not in ENDED:
                continue
            view, spec = ended, expected[ended.name]
            ranks = {(t, r): code for (j, a, t, r), code in exits.items() if j == job_id and a == view.attempt}
            meant_to_fail = f"--exit-code {FAILING_EXIT}" in (spec.command or "")
            if view.status == "succeeded":
                if meant_to_fail or len(ranks) < spec.nodes or any(code != 0 for code in ranks.values()):
                    problems.append(f"{job_id} ({view.name}) succeeded, but its ranks exited {ranks}")
            elif meant_to_fail and FAILING_EXIT in ranks.values():
                continue  # failed as its process did
            else:
                self.report.fault_ended.append(f"{job_id} ({view.name}) {view.status}: {view.reason}")
        await self._check_replay(views)

    async def _check_replay(self, before: dict[str, JobView]) -> None:
        """Kill every service process, start one of each again: each job must read as before."""
        for name in [n for n in self.stack.processes.processes if n.split("-")[0] in SERVICES]:
            self.stack.crash(name)
        for service in SERVICES:
            self.stack.start(service)
        await self.stack.wait_for_nodes()
        async with asyncio.timeout(120):
            while True:
                with contextlib.suppress(ServiceUnavailable):
                    after = await self._views(list(before))
                    break
                await asyncio.sleep(0.5)
        for job_id, view in before.items():
            again = after[job_id]
            if (again.status, again.attempt, again.exit_code, again.reason) != (
                    view.status, view.attempt, view.exit_code, view.reason):
                self.report.problems.append(f"{job_id} reads {again.status}/{again.attempt} after the replay, "
                                            f"{view.status}/{view.attempt} before")


Unit = tuple[str, int, int, int]  # job, attempt, task, rank


def agent_records(logs: Path) -> tuple[Counter[Unit], dict[Unit, int]]:
    """From the agents' logs: how often each (job, attempt, task, rank) was started, and how each exited."""
    starts: Counter[Unit] = Counter()
    exits: dict[Unit, int] = {}
    for path in sorted(logs.glob("agent-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"agent.process_' not in line:
                continue
            try:
                record = json.loads(line)
                unit = (str(record["job_id"]), int(record["attempt"]), int(record["task"]), int(record["rank"]))
            except (ValueError, KeyError, TypeError):
                continue
            if record.get("event") == "agent.process_started":
                starts[unit] += 1
            elif record.get("event") == "agent.process_exited":
                exits[unit] = int(record["exit_code"])
    return starts, exits


def recovery_table(report: ChaosReport) -> list[str]:
    rows = [f"{'fault':<40} {'a new job ran to its end after':>31}"]
    for recovery in report.recoveries:
        seconds = f"{recovery.seconds:.1f} s" if recovery.seconds is not None else f"not in {PROBE_PATIENCE:.0f} s"
        rows.append(f"{recovery.fault:<40} {seconds:>31}")
    return rows
