"""A real Slurm (Debian's `slurm-wlm`, 22.05) beside Trainyard, shaped like the bench cluster, for job throughput.

    python -m bench.slurm [--jobs 1000] [--gang-jobs N] [--in-flight 1,4,16] [--array 10000] [--listed]

`SlurmPeer(folder)` runs a whole Slurm cluster out of `folder`, as root and without systemd: one `slurmctld` and
one `slurmd` per node, and with munge authentication its own `munged` (a fresh key, its own socket, `--force`
since it runs as root). Debian builds Slurm with multiple-slurmd support, so every node is a real `slurmd -N
nodeK` on localhost with a port of its own: 8 nodes of 16 CPUs and 4000 MiB by default, which the real machine
need not have (`SlurmdParameters=config_overrides`). Its ports are free ones between 20000 and 30000 (below the
ephemeral range), so a Slurm already on 6817/6818 is left alone. Scheduling is `select/cons_tres`, FIFO priorities
(`priority/basic`) and `sched/backfill` with the throughput settings of Slurm's high-throughput guide
(`SchedulerParameters`); no accounting database, no cgroups (`proctrack/linuxproc`, `task/none`), no job
accounting gathered. The folders Slurm makes a folder in for each job (its state's `hash.N`, each node's spool)
are marked for their subfolders to be spread apart, as Trainyard's agents mark theirs (agent/ranks/spread.py): on
ext4 that keeps each job's inodes cheap to allocate for both.

What else slurm.conf says is a `Settings`, of which two are named:

- `THROUGHPUT`, the peer at its fastest while every job still runs as a real process, which the throughput
  workloads use: a finished job leaves slurmctld's memory within seconds of its end (`MinJobAge=2`; an hour's
  worth of ended jobs would be walked by every scheduling pass and every `squeue`), and is counted from the line
  `jobcomp/filetxt` writes for it; cores alone are the consumable resource (`CR_Core`: a trivial job asks one
  CPU and 64 MiB, a gang job whole nodes, so a node's 16 CPUs bind long before its 4000 MiB and packing memory
  too would change no placement); no authentication (`auth/none`, `cred/none`, which Debian's 22.05 ships and
  accepts: no `munged`, no credential signed or checked for each RPC); logs at `error` (the guide's advice), and
  slurmctld listening on 4 ports (the guide's advice for bursts of RPCs). Tried beside these and left, as none
  made a job measurably cheaper here: `proctrack/pgid`, `sched/builtin` (the guide's advice where most jobs are
  short) and `SchedulerParameters=defer`;
- `LISTED`, what a benchmark that reads jobs back with `squeue` needs: finished jobs listed for an hour, memory
  packed as well as cores (`CR_Core_Memory`), munge (`munged` with 10 threads, the guide's advice), logs at
  `info`. It is `SlurmPeer`'s default.

Every job really runs: a trivial job is `sbatch --wrap true` on one CPU; a gang job takes k whole nodes
(`--exclusive -N k`) and runs `srun true` in its batch script, so that a step with one `true` is launched by the
slurmd of every node it holds, as a multi-node training job runs on all of its nodes (the batch script alone would
run on the first node only); nodes a gang job frees go to the next one at slurmctld's next scheduling pass after
the job's end, about once a second, which bounds that workload. Each job is one `sbatch` process, at most
`in_flight` at a time, as a user's script submits them; how many at once suits Slurm best depends on the machine,
so the trivial workload can be run at several (`--in-flight 1,4,16`) and the fastest kept, whose count the gang
workload then uses. A workload's time runs from its first submit until its last job is done: with jobcomp, until
the file holds a line for each of its jobs (read every 0.2 s, which costs slurmctld nothing); without, until
`squeue` (polled every 0.2 s, pending, running and completing jobs of that workload only) lists none of them.
Either can only overstate Slurm's time, by at most a poll. Each workload is then checked to have exactly as many
COMPLETED jobs as it submitted (from the jobcomp file, or `squeue` while finished jobs are listed), so that a
failed or lost job never counts as done.

Other benchmarks drive the peer one job at a time: `submit` sends one batch job of given nodes, CPUs and memory
per node, time limit and command, and `jobs` reads what `squeue` lists of each job (state, submit, start and end
times; a pending job's start is Slurm's estimate, as `squeue --start` shows it), which with `LISTED` includes
finished jobs for an hour. `scheduler_parameters` adds `SchedulerParameters` to the throughput ones, or replaces
one of them (`bf_interval=1`, ...). `run_wide` runs jobs of k whole nodes, each rank printing the time it
started, and gives each job's launch: from its allocation (slurmctld's log, which needs `debug="info"`) to its
batch script's start and to every rank started (bench/gang.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType

from agent.ranks.spread import spread_subfolders

COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "munged")
POLL_SECONDS = 0.2
TRIVIAL_MEMORY_MIB = 64  # small: a node's 16 CPUs, not its memory, bound how many trivial jobs it runs
STALL_SECONDS = 120.0  # a workload whose active jobs do not change for this long is stuck
START_SECONDS = 60.0  # and a second more for every two nodes: 128 slurmd take a while to register
STOP_SECONDS = 15.0
MUNGE_THREADS = 10  # the high-throughput guide's advice (munged's default is 2)
IN_FLIGHT = (1, 4, 16)  # sbatch processes at once tried for the trivial workload
# Slurm clients read these from the environment: none of the caller's may leak into the peer's commands.
CLIENT_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_", "SALLOC_", "SCONTROL_")
# Slurm's high-throughput guide: look deep into the queue, and schedule at every submission and end at once.
THROUGHPUT_PARAMETERS = ("default_queue_depth=1000", "sched_min_interval=0", "batch_sched_delay=0")


@dataclass(frozen=True)
class Settings:
    """What the peer's slurm.conf sets differently for different uses; the rest is the same for all."""

    min_job_age: int = 3600  # seconds an ended job stays in slurmctld's memory (and `squeue -t all`)
    select: str = "CR_Core_Memory"  # SelectTypeParameters: what a job's allocation counts
    auth: str = "munge"  # AuthType and CredType: auth/munge and cred/munge, or auth/none and cred/none
    jobcomp: bool = False  # every ended job written to a jobcomp/filetxt file, where workloads are counted
    debug: str = "info"  # SlurmctldDebug and SlurmdDebug
    controller_ports: int = 1  # slurmctld listens on this many ports, its clients spread over them

    def describe(self) -> str:
        """The settings as slurm.conf says them, on one line."""
        return (f"MinJobAge={self.min_job_age} SelectTypeParameters={self.select} AuthType=auth/{self.auth} "
                f"JobCompType=jobcomp/{'filetxt' if self.jobcomp else 'none'} SlurmctldDebug={self.debug} "
                f"SlurmdDebug={self.debug}, slurmctld on {self.controller_ports} "
                f"port{'s' if self.controller_ports > 1 else ''}")


# Finished jobs listed for an hour and memory packed: what the start-estimates benchmark reads back with squeue.
LISTED = Settings()
# The peer at its fastest with every job a real process: ended jobs forgotten within seconds and counted from
# the jobcomp file, cores alone counted, no authentication, logs only of errors, RPCs spread over 4 ports.
THROUGHPUT = Settings(min_job_age=2, select="CR_Core", auth="none", jobcomp=True, debug="error",
                      controller_ports=4)


def slurm_missing() -> str | None:
    """None when Slurm's daemons and commands (and munge) are installed, else what to install."""
    missing = [command for command in COMMANDS if shutil.which(command) is None]
    if not missing:
        return None
    return (f"{', '.join(missing)} not found: install Slurm with "
            "`DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm` (it brings munge)")


def scheduler_settings(defaults: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """`SchedulerParameters` items: `defaults`, each replaced by the item of `extra` with the same key, then the
    rest of `extra`; so each key is given once."""
    given = {item.split("=", 1)[0]: item for item in extra}
    kept = [given.pop(item.split("=", 1)[0], item) for item in defaults]
    return (*kept, *given.values())


@dataclass(frozen=True)
class JobTimes:
    """One job as `squeue` lists it; times in whole seconds since the epoch, None where Slurm shows N/A."""

    job_id: str
    name: str
    state: str
    submitted: int | None
    start: int | None  # when it started; while it is pending, Slurm's estimate (what `squeue --start` shows)
    end: int | None
    nodes: str  # where it runs or ran
    planned: str  # while it is pending, the nodes it is planned to start on (`squeue --start`'s SCHEDNODES)
    reason: str


# `squeue` fields of a JobTimes, with SLURM_TIME_FORMAT=%s (seconds since the epoch): its times are the
# controller's, whatever the time zone.
SQUEUE_FORMAT = "%i|%j|%T|%V|%S|%e|%N|%Y|%r"


def parse_jobs(text: str) -> list[JobTimes]:
    """The jobs of `squeue -h -o SQUEUE_FORMAT` output, with SLURM_TIME_FORMAT=%s."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id, name, state, submitted, start, end, nodes, planned, reason = line.strip().split("|", 8)
        jobs.append(JobTimes(job_id, name, state, _epoch(submitted), _epoch(start), _epoch(end), nodes.strip(),
                             "" if planned.strip() == "(null)" else planned.strip(), reason))
    return jobs


def _epoch(text: str) -> int | None:
    """Seconds since the epoch, or None for N/A, Unknown, None or 0 (Slurm's ways of saying not known)."""
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


@dataclass(frozen=True)
class Completion:
    """One ended job as jobcomp/filetxt records it."""

    job_id: str
    name: str
    state: str


COMPLETION_FIELDS = re.compile(r"(?:^|\s)(JobId|Name|JobState)=(\S*)")


def parse_completions(text: str) -> list[Completion]:
    """The records of whole lines of a jobcomp/filetxt file (`JobId=7 UserId=root(0) ... Name=trivial-1
    JobState=COMPLETED ...`); a job's name is one word, as the peer names its jobs."""
    found = []
    for line in text.splitlines():
        fields = dict(COMPLETION_FIELDS.findall(line))
        if "JobId" in fields and "JobState" in fields:
            found.append(Completion(fields["JobId"], fields.get("Name", ""), fields["JobState"]))
    return found


class Completions:
    """A jobcomp/filetxt file read as it grows: the states of the ended jobs of each name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.states: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._offset = 0

    def read(self) -> None:
        """Take in the whole lines written since the last read."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return  # no job ended yet
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line being written is read once it is whole
        self._offset += len(whole)
        for record in parse_completions(whole.decode(errors="replace")):
            self.states[record.name][record.state] += 1

    def ended(self, name: str) -> int:
        return sum(self.states[name].values())


# slurmctld's log (its default time format, to the millisecond, local time) of a job's nodes allocated, by the
# main scheduler or by a backfill pass.
ALLOCATED = re.compile(r"^\[(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})\] (?:sched: Allocate JobId=(?P<main>\d+) "
                       r"|sched/backfill: _start_job: Started JobId=(?P<bf>\d+) )")


def parse_allocations(text: str) -> dict[str, float]:
    """When each job's nodes were allocated (seconds since the epoch), from slurmctld's log at `info`."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if (match := ALLOCATED.match(line)) is not None:
            found.setdefault(match["main"] or match["bf"], datetime.fromisoformat(match["at"]).timestamp())
    return found


@dataclass(frozen=True)
class Launch:
    """One wide job's launch, in seconds since the epoch: its nodes allocated, its batch script started, and each
    rank started (each printed the time it started)."""

    job_id: str
    allocated: float
    script: float
    ranks: tuple[float, ...]

    @property
    def seconds(self) -> float:
        """From the allocation to every rank started."""
        return max(self.ranks) - self.allocated


def parse_launch(job_id: str, allocated: float, output: str) -> Launch:
    """A wide job's launch from its output: the batch script's start on the first line, each rank's after."""
    times = [float(line) for line in output.split()]
    return Launch(job_id, allocated, times[0], tuple(times[1:]))


@dataclass(frozen=True)
class Result:
    workload: str
    jobs: int
    seconds: float  # from the first submit to the last job completed
    submit_seconds: float  # from the first submit to the last submit's return
    latencies: tuple[float, ...]  # seconds of each sbatch process
    in_flight: int = 1  # sbatch processes at once
    job_ids: tuple[str, ...] = ()  # as the submissions answered, in their order

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.seconds

    def latency(self, percent: int) -> float:
        """The percent-th percentile of the submit latencies."""
        if len(self.latencies) < 2:
            return self.latencies[0]
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[percent - 1]


def fastest(results: Sequence[Result]) -> Result:
    """The run with the most jobs a second."""
    return max(results, key=lambda result: result.jobs_per_second)


def free_ports(count: int, taken: Sequence[int] = ()) -> list[int]:
    """Ports nothing listens on, below the ephemeral range so that no outgoing connection takes one meanwhile;
    consecutive ones where they are free, and none of `taken`."""
    ports: list[int] = []
    candidate = random.randrange(20000, 30000)
    while len(ports) < count:
        if candidate in taken:
            candidate += 1
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("", candidate))
                ports.append(candidate)
            except OSError:
                pass
        candidate += 1
    return ports


def free_port_range(count: int) -> int:
    """The first of `count` consecutive free ports."""
    while True:
        ports = free_ports(count)
        if ports == list(range(ports[0], ports[0] + count)):
            return ports[0]


def marked_processes(marker: bytes) -> list[int]:
    """Processes whose environment holds `marker`: every process the peer's daemons and jobs started."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue  # gone, or a kernel thread
        if marker in environ.split(b"\0"):
            found.append(int(entry))
    return found


class SlurmPeer:
    """A Slurm cluster of `nodes` nodes run from `folder`; stopped with everything it started on exit."""

    def __init__(self, folder: Path, nodes: int = 8, cpus: int = 16, memory_mib: int = 4000,
                 max_array: int = 10_000, scheduler_parameters: Sequence[str] = (),
                 settings: Settings = LISTED) -> None:
        self.folder = folder
        self.nodes = nodes
        self.cpus = cpus
        self.memory_mib = memory_mib
        self.max_array = max_array
        self.settings = settings
        # The throughput settings, with `scheduler_parameters` (`bf_interval=1`, ...) added or put in their place.
        self.scheduler_parameters = scheduler_settings(THROUGHPUT_PARAMETERS, scheduler_parameters)
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self.completions = Completions(folder / "jobcomp.txt")
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._munged: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._workloads = 0
        # Every daemon, slurmstepd and job process inherits this, which is how stop() finds the ones left.
        self._marker = f"SLURM_CONF={self.conf}".encode()
        kept = {name: value for name, value in os.environ.items() if not name.startswith(CLIENT_PREFIXES)}
        self.env = {**kept, "SLURM_CONF": str(self.conf)}  # for any Slurm command run against this peer

    def describe(self) -> str:
        """The cluster and its settings, on one line."""
        return (f"{self.nodes} nodes of {self.cpus} CPUs and {self.memory_mib} MiB, one slurmd each; "
                f"{self.settings.describe()}; SchedulerParameters={','.join(self.scheduler_parameters)}")

    def __enter__(self) -> SlurmPeer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> SlurmPeer:
        try:
            await asyncio.to_thread(self.start)
        except BaseException:
            self.stop()  # a start still running in its thread spawns nothing once stopped
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        self.stop()  # not in a thread: it must finish even while the task is being cancelled

    # Starting and stopping.

    def start(self) -> None:
        """Write slurm.conf, start munged (with munge), slurmctld and the slurmds, and wait until every node is
        idle."""
        spread = ("jobs", *(f"state/hash.{k}" for k in range(10)),
                  *(f"spool/node{k}" for k in range(1, self.nodes + 1)))
        for sub in ("state", "log", "munge", *spread):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        for sub in spread:  # where Slurm makes a folder for each job: spread apart, as the agents' are
            spread_subfolders(self.folder / sub)
        controller_port = free_port_range(self.settings.controller_ports)
        controller_ports = range(controller_port, controller_port + self.settings.controller_ports)
        self.conf.write_text(self._slurm_conf(controller_port, free_ports(self.nodes, controller_ports)))
        if self.settings.auth == "munge":
            self._start_munged()
        self._daemons.append(("slurmctld", self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])))
        for k in range(1, self.nodes + 1):
            node = f"node{k}"
            slurmd = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
            self._daemons.append((node, self._spawn(f"slurmd-{node}", slurmd)))
        self._wait_for(f"{self.nodes} idle nodes", self._all_idle, START_SECONDS + self.nodes / 2)

    def _start_munged(self) -> None:
        munge = self.folder / "munge"
        munge.chmod(0o711)  # munged wants its socket's folder searchable by all
        self._write_munge_key()
        self._munged = self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}",
            f"--num-threads={MUNGE_THREADS}",
        ], env={name: value for name, value in self.env.items() if name != "SLURM_CONF"})
        self._wait_for("munged's socket", self.munge_socket.exists)

    def stop(self) -> None:
        """Stop every daemon and whatever their jobs left running; munged last, as the others use it to the end."""
        with self._lock:
            self._closed = True
        for _, daemon in self._daemons:
            if daemon.poll() is None:
                daemon.terminate()
        for _, daemon in self._daemons:
            _reap(daemon)
        self._daemons.clear()
        self._sweep()
        if self._munged is not None:
            if self._munged.poll() is None:
                self._munged.terminate()
            _reap(self._munged)
            self._munged = None

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the Slurm peer was stopped while starting")
            with (self.folder / "log" / f"{name}.out").open("ab") as output:
                # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the daemons in order.
                return subprocess.Popen(argv, cwd=self.folder, env=env or self.env, stdin=subprocess.DEVNULL,
                                        stdout=output, stderr=subprocess.STDOUT, start_new_session=True)

    def _sweep(self) -> None:
        """Kill slurmstepd and job processes that outlived their slurmd (they are no children of ours)."""
        deadline = time.monotonic() + STOP_SECONDS
        while (left := marked_processes(self._marker)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def _wait_for(self, what: str, ready: Callable[[], bool], seconds: float = START_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if self._closed:
                raise RuntimeError("the Slurm peer was stopped while starting")
            dead = [(name, daemon) for name, daemon in [("munged", self._munged), *self._daemons]
                    if daemon is not None and daemon.poll() is not None]
            if dead:
                name, daemon = dead[0]
                raise RuntimeError(f"{name} exited ({daemon.returncode}) while waiting for {what}; "
                                   f"its logs are in {self.folder / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {seconds:.0f} s; logs in {self.folder / 'log'}")
            time.sleep(POLL_SECONDS)

    def _all_idle(self) -> bool:
        listed = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True,
                                text=True, check=False)
        return listed.returncode == 0 and listed.stdout.split().count("idle") == self.nodes

    def _write_munge_key(self) -> None:
        key = self.folder / "munge" / "munge.key"
        key.unlink(missing_ok=True)
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)  # munged refuses a readable key
        with os.fdopen(descriptor, "wb") as file:
            file.write(os.urandom(1024))

    def _slurm_conf(self, controller_port: int, node_ports: Sequence[int]) -> str:
        folder, settings = self.folder, self.settings
        if settings.auth == "munge":
            auth = ["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}"]
        else:
            auth = [f"AuthType=auth/{settings.auth}", f"CredType=cred/{settings.auth}"]
        ports = (f"{controller_port}-{controller_port + settings.controller_ports - 1}"
                 if settings.controller_ports > 1 else str(controller_port))
        jobcomp = (["JobCompType=jobcomp/filetxt", f"JobCompLoc={self.completions.path}"] if settings.jobcomp
                   else ["JobCompType=jobcomp/none"])
        lines = [
            "ClusterName=trainyardbench",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports}",
            "SlurmUser=root",
            "SlurmdUser=root",
            *auth,
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'log' / 'slurmd-%n.log'}",
            f"SlurmctldDebug={settings.debug}",
            f"SlurmdDebug={settings.debug}",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",  # this kernel's cgroups are not usable
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            *jobcomp,
            "SwitchType=switch/none",
            "MpiDefault=none",
            "PriorityType=priority/basic",  # FIFO, the guide's cheapest; Slurm's default, named
            "SelectType=select/cons_tres",
            f"SelectTypeParameters={settings.select}",
            "SchedulerType=sched/backfill",  # Slurm's default, named
            f"SchedulerParameters={','.join(self.scheduler_parameters)}",
            f"MinJobAge={settings.min_job_age}",
            "MaxJobCount=200000",
            f"MaxArraySize={self.max_array + 1}",
            "SlurmdParameters=config_overrides",  # nodes bigger than the machine are not refused
            "ReturnToService=2",
        ]
        lines += [f"NodeName=node{k} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                  f"Boards=1 Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={self.memory_mib} "
                  "State=UNKNOWN" for k, port in enumerate(node_ports, start=1)]
        lines.append("PartitionName=bench Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    # One job at a time: submitting it and reading its times.

    def command(self, argv: Sequence[str]) -> str:
        """Run a Slurm command against this peer, times printed as seconds since the epoch; its output."""
        done = subprocess.run(list(argv), env={**self.env, "SLURM_TIME_FORMAT": "%s"}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return done.stdout

    def submit(self, name: str, command: str, *, nodes: int = 1, cpus: int = 1, memory_mib: int = 64,
               minutes: int | None = None) -> str:
        """One batch job named `name` running `command` (a shell line) on `nodes` nodes, with `cpus` CPUs and
        `memory_mib` on each and a time limit of `minutes`; its job id."""
        argv = ["sbatch", "--parsable", "-J", name, f"-N{nodes}", "--ntasks-per-node=1", f"-c{cpus}",
                f"--mem={memory_mib}", "-o", "/dev/null", f"--chdir={self.folder / 'jobs'}"]
        if minutes is not None:
            argv.append(f"--time={minutes}")
        return self.command([*argv, "--wrap", command]).strip().split(";")[0]

    def jobs(self, name: str | None = None) -> list[JobTimes]:
        """Every job Slurm still lists (finished ones for `MinJobAge`), or those named `name`."""
        argv = ["squeue", "-h", "-t", "all", "-o", SQUEUE_FORMAT] + (["-n", name] if name else [])
        return parse_jobs(self.command(argv))

    # Workloads.

    async def run_trivial(self, jobs: int, in_flight: int = 1) -> Result:
        """`jobs` one-CPU jobs running `true`, one sbatch each, at most `in_flight` sbatch at once."""
        name = await self._begin("trivial")
        argv = ["sbatch", "--parsable", "-J", name, "-n1", "-c1", f"--mem={TRIVIAL_MEMORY_MIB}",
                "-o", "/dev/null", f"--chdir={self.folder / 'jobs'}", "--wrap", "true"]
        return await self._run(name, [argv] * jobs, in_flight, jobs)

    async def run_trivial_fastest(self, jobs: int, in_flights: Sequence[int] = IN_FLIGHT,
                                  progress: Callable[[str], None] = lambda _: None) -> list[Result]:
        """The trivial workload once at each of `in_flights` sbatch at once, in that order: every run (the
        fastest is Slurm's figure)."""
        results = []
        for in_flight in in_flights:
            results.append(result := await self.run_trivial(jobs, in_flight))
            progress(f"  {in_flight:>2} sbatch at once: {result.jobs_per_second:.1f} jobs/s")
        return results

    async def run_gang(self, jobs: int, sizes: Sequence[int] = (1, 2, 4), in_flight: int = 1) -> Result:
        """Job i takes sizes[i % len(sizes)] whole nodes and runs `true` on each of them with srun."""
        if max(sizes) > self.nodes:
            raise ValueError(f"a gang of {max(sizes)} nodes does not fit {self.nodes} nodes")
        name = await self._begin("gang")
        commands = [["sbatch", "--parsable", "-J", name, "--exclusive", f"-N{sizes[i % len(sizes)]}",
                     "--ntasks-per-node=1", "--mem=0", "-o", "/dev/null", f"--chdir={self.folder / 'jobs'}",
                     "--wrap", "srun true"] for i in range(jobs)]
        return await self._run(name, commands, in_flight, jobs)

    async def run_wide(self, jobs: int, nodes: int, in_flight: int = 1) -> tuple[Result, list[Launch]]:
        """`jobs` jobs of `nodes` whole nodes each, whose batch script prints its start's time and then runs a
        step of one `date` on every node (each rank prints the time it started): the workload, and each job's
        launch (which needs slurmctld's log at `info`)."""
        if nodes > self.nodes:
            raise ValueError(f"a job of {nodes} nodes does not fit {self.nodes} nodes")
        if self.settings.debug not in ("info", "verbose") and not self.settings.debug.startswith("debug"):
            raise ValueError("a launch's allocation is read from slurmctld's log, which needs debug='info'")
        name = await self._begin(f"wide{nodes}")
        outputs = self.folder / "jobs" / name
        outputs.mkdir()
        argv = ["sbatch", "--parsable", "-J", name, "--exclusive", f"-N{nodes}", "--ntasks-per-node=1", "--mem=0",
                "-o", f"{outputs}/%j.out", f"--chdir={self.folder / 'jobs'}",
                "--wrap", "date +%s.%N; srun date +%s.%N"]
        result = await self._run(name, [argv] * jobs, in_flight, jobs)
        allocated = parse_allocations((self.folder / "log" / "slurmctld.log").read_text(errors="replace"))
        launches = [parse_launch(job_id, allocated[job_id], (outputs / f"{job_id}.out").read_text())
                    for job_id in result.job_ids]
        return result, launches

    async def run_array(self, size: int) -> Result:
        """One job array of `size` one-CPU tasks running `true`, from its submit until every task is done."""
        if size > self.max_array:
            raise ValueError(f"an array of {size} is over this peer's max_array of {self.max_array}")
        name = await self._begin("array")
        argv = ["sbatch", "--parsable", "-J", name, f"--array=0-{size - 1}", "-n1", "-c1",
                f"--mem={TRIVIAL_MEMORY_MIB}", "-o", "/dev/null", f"--chdir={self.folder / 'jobs'}", "--wrap", "true"]
        return await self._run(name, [argv], 1, size)

    async def _begin(self, kind: str) -> str:
        """Wait until the previous workload has left the queue; name the next one's jobs."""
        while await self._active():
            await asyncio.sleep(POLL_SECONDS)
        self._workloads += 1
        return f"{kind}-{self._workloads}"

    async def _run(self, name: str, commands: list[list[str]], in_flight: int, jobs: int) -> Result:
        gate = asyncio.Semaphore(in_flight)
        latencies = [0.0] * len(commands)
        ids = [""] * len(commands)

        async def submit(index: int, argv: list[str]) -> None:
            async with gate:
                started = time.perf_counter()
                ids[index] = (await self._command(argv)).strip().split(";")[0]
                latencies[index] = time.perf_counter() - started

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for index, argv in enumerate(commands):
                group.create_task(submit(index, argv))
        submitted = time.perf_counter() - started
        if self.settings.jobcomp:
            await self._wait_recorded(name, jobs)
            seconds = time.perf_counter() - started
            states = self.completions.states[name]
        else:
            await self._wait_done(name)
            seconds = time.perf_counter() - started
            states = collections.Counter((await self._command(
                ["squeue", "-h", "-r", "-t", "all", "-n", name, "-o", "%T"])).split())
        if states != collections.Counter({"COMPLETED": jobs}):
            raise RuntimeError(f"workload {name}: {jobs} jobs expected COMPLETED, Slurm recorded {dict(states)}")
        return Result(name.split("-")[0], jobs, seconds, submitted, tuple(latencies), in_flight, tuple(ids))

    async def _wait_recorded(self, name: str, jobs: int) -> None:
        """Until the jobcomp file holds a record of each of the workload's jobs."""
        last, changed = -1, time.monotonic()
        while True:
            self.completions.read()
            if (ended := self.completions.ended(name)) >= jobs:
                return
            if ended != last:
                last, changed = ended, time.monotonic()
            elif time.monotonic() - changed > STALL_SECONDS:
                active = await self._active(name)
                raise RuntimeError(f"workload {name}: {ended} of {jobs} jobs recorded ended, {active} in the "
                                   f"queue, none more for {STALL_SECONDS:.0f} s; logs in {self.folder / 'log'}")
            await asyncio.sleep(POLL_SECONDS)

    async def _wait_done(self, name: str) -> None:
        """Until squeue lists none of the workload's jobs as pending, running or completing."""
        last, changed = -1, time.monotonic()
        while active := await self._active(name):
            if active != last:
                last, changed = active, time.monotonic()
            elif time.monotonic() - changed > STALL_SECONDS:
                raise RuntimeError(f"workload {name}: {active} jobs unchanged for {STALL_SECONDS:.0f} s; "
                                   f"logs in {self.folder / 'log'}")
            await asyncio.sleep(POLL_SECONDS)

    async def _active(self, name: str | None = None) -> int:
        argv = ["squeue", "-h", "-r", "-o", "%i"] + (["-n", name] if name else [])
        return len((await self._command(argv)).split())

    async def _command(self, argv: list[str]) -> str:
        process = await asyncio.create_subprocess_exec(*argv, env=self.env, stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({process.returncode}): {err.decode().strip()[-500:]}")
        return out.decode()


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def slurm_version() -> str:
    shown = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, check=False)
    return shown.stdout.strip() or "slurm (unknown version)"


def in_flight_counts(text: str) -> tuple[int, ...]:
    """`--in-flight`'s counts: `16`, or several to try, `1,4,16`."""
    counts = tuple(int(item) for item in text.split(",") if item.strip())
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more counts of at least 1, such as 1,4,16")
    return counts


def print_result(result: Result) -> None:
    print(f"{result.workload:<10}{result.jobs:>7}{result.in_flight:>10}{result.seconds:>10.1f}"
          f"{result.jobs_per_second:>10.1f}{result.submit_seconds:>10.1f}"
          f"{len(result.latencies) / result.submit_seconds:>11.1f}"
          f"{result.latency(50) * 1000:>9.1f}{result.latency(99) * 1000:>9.1f}")


async def workloads(peer: SlurmPeer, jobs: int, gang_jobs: int, in_flights: Sequence[int], array: int) -> None:
    print(f"{'workload':<10}{'jobs':>7}{'in flight':>10}{'seconds':>10}{'jobs/s':>10}{'submit s':>10}"
          f"{'submits/s':>11}{'p50 ms':>9}{'p99 ms':>9}")
    in_flight = in_flights[0]
    if jobs:
        tried = await peer.run_trivial_fastest(jobs, in_flights)
        for result in tried:
            print_result(result)
        in_flight = fastest(tried).in_flight
        if len(tried) > 1:
            print(f"(the fastest: {in_flight} sbatch at once, which the gang workload uses)")
    if gang_jobs:
        print_result(await peer.run_gang(gang_jobs, in_flight=in_flight))
    if array:
        print_result(await peer.run_array(array))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="trivial jobs (0 skips them)")
    parser.add_argument("--gang-jobs", type=int, help="whole-node gang jobs of 1, 2 and 4 nodes (default: --jobs)")
    parser.add_argument("--in-flight", type=in_flight_counts, default=IN_FLIGHT,
                        help="sbatch processes running at once; several (1,4,16: the default) are each tried "
                             "with the trivial jobs, and the fastest used for the gang jobs")
    parser.add_argument("--array", type=int, default=0, help="tasks of one job array (0 skips it)")
    parser.add_argument("--listed", action="store_true",
                        help="the LISTED settings (finished jobs listed for an hour, memory packed, munge) "
                             "instead of THROUGHPUT's")
    args = parser.parse_args()
    if (missing := slurm_missing()) is not None:
        raise SystemExit(missing)
    gang_jobs = args.jobs if args.gang_jobs is None else args.gang_jobs
    with tempfile.TemporaryDirectory(prefix="trainyard-slurm-") as workdir:
        peer = SlurmPeer(Path(workdir), max_array=max(args.array, 1), settings=LISTED if args.listed else THROUGHPUT)
        print(f"{slurm_version()} on {os.cpu_count()} CPUs ({platform.machine()}): {peer.describe()}")
        # The daemons run outside the event loop, so that a Ctrl-C still stops them in order.
        with peer:
            asyncio.run(workloads(peer, args.jobs, gang_jobs, args.in_flight, args.array))


if __name__ == "__main__":
    main()
