"""What the CLI shows, as text: pure functions from the services' answers to sentences and table rows.

Nothing here writes or connects, so it can be checked without a stack. A table cell is plain text or
`(text, style)` (a rich style name); text from the services is never read as markup, and `shown` writes
out the control characters in it (output.py applies it to everything it prints).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import msgspec

from libs.contracts.events import AlertRaised, LaunchPlanned
from libs.contracts.health import NodeCheck
from libs.contracts.scheduling import Prediction
from libs.storage import staged_sources

if TYPE_CHECKING:
    from libs.contracts.agent import UsageSample
    from libs.contracts.events import EventEnvelope
    from libs.contracts.identity import Identity
    from libs.contracts.jobspec import JobSpec
    from libs.contracts.operations.arrays import ArrayMemberView, ArrayView
    from libs.contracts.operations.autoscaler import QueueStatus, ScaledInstance
    from libs.contracts.operations.cache import NodeCache
    from libs.contracts.operations.cluster import NodeView
    from libs.contracts.operations.jobs import InstanceView, JobDetails, JobSummary, JobView
    from libs.contracts.operations.runs import RunView, SeriesPoint, SeriesView
    from libs.contracts.scheduling import (
        AdminSettings,
        BoardDemand,
        FlavorInfo,
        FlavorWait,
        NodeResources,
        StoredAccess,
        WhyReport,
    )

Styled = str | tuple[str, str]
"""A piece of output: plain text, or (text, rich style)."""

# What a terminal obeys rather than shows: C0 controls (ESC opens colour, cursor, title and hyperlink
# sequences), DEL, C1 controls (CSI alone moves the cursor) and the bidirectional overrides and isolates
# (they reorder what follows on screen). `_LAYOUT` spares newline and tab, a log's own line breaks and indents.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_LAYOUT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _written_out(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str, *, layout: bool = False) -> str:
    """`text` with every character a terminal would obey written out as an escape (ESC as `\\x1b`, CSI as
    `\\x9b`, a newline as `\\n`), so that what someone else wrote is read, never executed; with `layout`,
    newlines and tabs stay as they are."""
    return (_LAYOUT if layout else _CONTROLS).sub(_written_out, text)


STATUS_STYLE = {"queued": "yellow", "running": "cyan", "succeeded": "green", "failed": "red",
                "stopped": "magenta", "expired": "magenta"}
NODE_STATUS_STYLE = {"ready": "green", "lost": "red", "unhealthy": "yellow", "draining": "cyan", "disk-full": "magenta"}


def status_cell(status: str) -> tuple[str, str]:
    return status, STATUS_STYLE.get(status, "white")


def local_time(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f}"


# --- times and predictions -------------------------------------------------------------------------------


def relative_time(when: datetime, now: datetime) -> str:
    """`in 25 min`, `in 2 h 5 min`, `in 3 d 4 h`: counted in whole minutes, as the clock time reads."""
    if when <= now:
        return "any moment now"
    minutes = int((when.replace(second=0, microsecond=0) - now.replace(second=0, microsecond=0)).total_seconds()
                  // 60)
    return "in under a minute" if minutes < 1 else f"in {minutes_text(minutes)}"


def minutes_text(minutes: int) -> str:
    """`25 min`, `2 h 5 min`, `3 d 4 h`."""
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(hours, 24)
    return f"{days} d" + (f" {hours} h" if hours else "")


def clock_time(when: datetime, now: datetime) -> str:
    """`14:05 UTC` today, `2026-11-22 14:05 UTC` on another day: UTC, so it reads the same everywhere."""
    at = when.astimezone(UTC)
    fmt = "%H:%M" if at.date() == now.astimezone(UTC).date() else "%Y-%m-%d %H:%M"
    return f"{at.strftime(fmt)} UTC"


def prediction_sentence(prediction: Prediction, *, now: datetime | None = None,
                        requested_nodes: int | None = None) -> str:
    """S6 in one sentence: where the job would start now, or where it would queue and until when."""
    now = now or datetime.now(UTC)
    if prediction.starts_now:
        text = "starts now"
        if prediction.flavor:
            text += f" with flavor {prediction.flavor}"
        if prediction.nodes:
            text += f" on {', '.join(prediction.nodes)}"
        count = prediction.node_count or len(prediction.nodes)
        if requested_nodes and 0 < count < requested_nodes:
            text += f" ({count} of {requested_nodes} nodes: elastic)"
        return text
    text = "queues"
    if prediction.position is not None:
        text += f" at position {prediction.position}"
    text += f" behind {plural(prediction.jobs_ahead, 'job')}"
    if prediction.estimated_start is None:
        return f"{text}; estimated start unknown" + (f": {prediction.reason}" if prediction.reason else "")
    when = prediction.estimated_start
    return f"{text}; estimated start {clock_time(when, now)} ({relative_time(when, now)})"


def why_lines(report: WhyReport) -> list[str]:
    """The explanation of `trainyard why`: the service's sentences, else sentences built from its fields."""
    if report.summary:
        return list(report.summary)
    if report.status != "queued":
        return [f"{report.job_id} is {report.status}: it waits for nothing"]
    lines = []
    if report.head:
        line = f"{report.job_id} is first in line"
        if report.reserved_nodes:
            line += f"; {', '.join(report.reserved_nodes)} are reserved for it"
        if report.reserved_start is not None:
            line += f" from {clock_time(report.reserved_start, datetime.now(UTC))}"
        lines.append(line)
    elif report.position is not None:
        ahead = ", ".join(report.jobs_ahead)
        more = report.jobs_ahead_count - len(report.jobs_ahead)
        if more > 0:
            ahead += f" and {more} more"
        lines.append(f"{report.job_id} is at position {report.position}, behind "
                     f"{plural(report.jobs_ahead_count, 'job')}" + (f": {ahead}" if ahead else ""))
    return lines


def flavor_wait_title(wait: FlavorWait) -> str:
    """One flavor's standing: how many nodes it may use, how many fit one rank now, how many it needs."""
    if wait.eligible_nodes == 0:
        title = f"flavor {wait.flavor}: no eligible node, {wait.needed_nodes} needed"
    else:
        title = (f"flavor {wait.flavor}: {wait.fitting_nodes} of {plural(wait.eligible_nodes, 'eligible node')} "
                 f"fit one rank now, {wait.needed_nodes} needed")
    return f"{title} ({wait.note})" if wait.note else title


SHORTAGE_COLUMNS = ("NODE", "MISSING", "HELD BY")


def shortage_rows(wait: FlavorWait) -> list[list[str]]:
    return [[s.node, "; ".join(s.missing) or "-", ", ".join(s.held_by) or "-"] for s in wait.shortages]


# --- jobs ------------------------------------------------------------------------------------------------

JOB_COLUMNS = ("JOB", "NAME", "STATUS", "INSTANCE", "PRIORITY", "MODE", "NODES", "FLAVOR", "CREATOR", "SUBMITTED")


def job_rows(job: JobView, *, expected: bool = False) -> list[list[Styled]]:
    """`list` (L8): a row for the job with its master instance, and one under it per worker instance it
    carries (`--all`); with `expected`, a last cell: a waiting job's expected start."""
    rows = _job_rows(job)
    if expected:
        start = expected_start(job.expected) if job.expected is not None else "-"
        rows = [[*row, start if index == 0 else ""] for index, row in enumerate(rows)]
    return rows


def _job_rows(job: JobView) -> list[list[Styled]]:
    rows: list[list[Styled]] = []
    instances: list[InstanceView | None] = [*job.instances] or [None]
    for inst in instances:
        if inst is not None and inst.rank > 0:
            rows.append(["", "", (inst.state, "dim"), f"{inst.role} {inst.rank}@{inst.node}", "", "", "", "", "", ""])
            continue
        instance = f"master@{inst.node}" if inst is not None else "-"
        rows.append([job.job_id, job.name, status_cell(job.status), instance, job.priority, job.mode, str(job.nodes),
                     job.flavor or ",".join(job.flavors), job.creator, local_time(job.submitted_at)])
    return rows


QUEUE_COLUMNS = ("#", "JOB", "NAME", "PRIORITY", "NODES", "FLAVORS", "CREATOR", "SUBMITTED", "WAITED",
                 "EXPECTED START")


def expected_start(prediction: Prediction) -> str:
    """S6 for a waiting job, labelled: `14:05 UTC`, or `likely 10:40 UTC, latest 14:05 UTC`, or `unknown`."""
    if prediction.starts_now:
        return "now"
    likely, latest, now = prediction.estimated_start, prediction.latest_start, prediction.predicted_at
    if likely is None:
        return "unknown"
    if latest is None or latest == likely:
        return clock_time(likely, now) if latest is not None else f"likely {clock_time(likely, now)}, latest unknown"
    return f"likely {clock_time(likely, now)}, latest {clock_time(latest, now)}"


def ago(when: datetime, now: datetime) -> str:
    """`just now`, `25 min ago`, `2 h 5 min ago`: how long before `now` `when` was, in whole minutes."""
    minutes = int((now - when).total_seconds() // 60)
    return "just now" if minutes < 1 else f"{minutes_text(minutes)} ago"


def waited(since: datetime, now: datetime) -> str:
    """`45 min`, `3 h 5 min`, `2 d 4 h`: how long a job has waited, in whole minutes."""
    return minutes_text(max(0, int((now - since).total_seconds() // 60)))


def queue_row(job: JobView, now: datetime) -> list[Styled]:
    """`trainyard at TIME queue`: a waiting job at its place in the order the scheduler tries them."""
    return [str(job.queue_position or "-"), job.job_id, job.name, job.priority, str(job.nodes), ",".join(job.flavors),
            job.creator, local_time(job.submitted_at), waited(job.submitted_at, now),
            expected_start(job.expected) if job.expected is not None else "-"]


def job_detail_rows(details: JobDetails, *, now: datetime | None = None) -> list[tuple[str, Styled]]:
    """`show`: the job's state, placement and recovery, one (key, value) per line."""
    job = details.job
    rows: list[tuple[str, Styled]] = [
        ("job", job.job_id), ("name", job.name), ("project", job.project), ("creator", job.creator),
        ("status", status_cell(job.status)), ("reason", job.reason or "-"),
        ("exit code", "-" if job.exit_code is None else str(job.exit_code)),
        ("priority", job.priority), ("mode", f"{job.mode}, {job.nodes} node(s)"),
        ("flavor", job.flavor or f"one of {', '.join(job.flavors)}"), ("attempt", str(job.attempt)),
        ("submitted", local_time(job.submitted_at)), ("started", local_time(job.started_at)),
        ("ended", local_time(job.ended_at)), ("output", job.output or "-")]
    if job.image is not None:
        ref, _, digest = job.image.partition("@")
        rows.insert(rows.index(("mode", f"{job.mode}, {job.nodes} node(s)")) + 1,
                    ("image", f"{ref} ({digest.removeprefix('sha256:')[:12]})"))
    if job.queue_position:
        rows.insert(5, ("queue position", str(job.queue_position)))
    if job.expected is not None:  # S6, as `why` and `predict` tell it, from the latest plan: how old it is
        expected: list[tuple[str, Styled]] = [("expected start", expected_start(job.expected))]
        if job.expected.reason:
            expected.append(("waiting", job.expected.reason))
        expected.append(("planned", ago(job.expected.predicted_at, now or datetime.now(UTC))))
        rows[6:6] = expected
    rows.extend(recovery_rows(details))
    return rows


def recovery_rows(details: JobDetails, *, now: datetime | None = None) -> list[tuple[str, str]]:
    """What `show` adds about faults: resumes of their maximum (J12, M4), restarts of theirs (J13, M5),
    the nodes the job was moved away from, and until when its environment is kept (J15)."""
    job, spec = details.job, details.spec
    rows: list[tuple[str, str]] = []
    if spec.checkpoint_resume is not None or job.resumes:
        most = job.max_resumes if job.max_resumes is not None else (
            spec.checkpoint_resume.max_resumes if spec.checkpoint_resume else None)
        rows.append(("resumes", str(job.resumes) if most is None else f"{job.resumes} of {most}"))
    if spec.fault_restart is not None or job.restarts:
        most = spec.fault_restart.max_restarts if spec.fault_restart else None
        rows.append(("restarts", str(job.restarts) if most is None else f"{job.restarts} of {most}"))
    if job.excluded_nodes:
        rows.append(("excluded nodes", ", ".join(job.excluded_nodes)))
    if job.kept_until is not None and job.kept_until > (now or datetime.now(UTC)):
        rows.append(("environment", f"kept for the debug terminal until {local_time(job.kept_until)}; "
                                    f"`trainyard exec {job.job_id}` opens a shell in it"))
    return rows


INSTANCE_COLUMNS = ("RANK", "NODE", "ROLE", "STATE", "PID", "EXIT", "CPU %", "MEMORY (MiB)", "ACCEL %", "SAMPLED")


def instance_row(inst: InstanceView, sample: UsageSample | None) -> list[str]:
    """One node of a job as `show` lists it, with its last resource sample."""
    measured = ((f"{sample.cpu_percent:.0f}", str(sample.memory_mib),
                 "-" if sample.accelerator_percent is None else f"{sample.accelerator_percent:.0f}",
                 local_time(sample.sampled_at)) if sample else ("-", "-", "-", "-"))
    return [str(inst.rank), inst.node, "master" if inst.master else inst.role, inst.state, str(inst.pid or "-"),
            "-" if inst.exit_code is None else str(inst.exit_code), *measured]


SEARCH_COLUMNS = ("JOB", "NAME", "STATUS", "PRIORITY", "MODE", "FLAVOR", "ALGORITHM", "OUTPUT", "PROJECT", "CREATOR",
                  "SUBMITTED")


def search_row(job: JobSummary) -> list[str]:
    algorithm = job.algorithm or "-"
    if job.algorithm and job.algorithm_source == "favorite":
        algorithm += " (favorite)"
    return [job.job_id, job.name, job.status, job.priority, job.mode, job.flavor or ",".join(job.flavors) or "-",
            algorithm, job.output or "-", job.project, job.creator, local_time(job.submitted_at)]


def search_cells(job: JobSummary) -> list[Styled]:
    cells: list[Styled] = [*search_row(job)]
    cells[2] = status_cell(job.status)
    return cells


# --- arrays ----------------------------------------------------------------------------------------------

ARRAY_COLUMNS = ("ARRAY", "NAME", "STATUS", "INDICES", "JOBS", "CAP", "CREATOR", "SUBMITTED")
# Busy jobs first: what an array is doing now reads before what it has done.
COUNT_ORDER = ("running", "queued", "succeeded", "failed", "stopped", "expired")


def array_counts(statuses: dict[str, int]) -> str:
    """`3 running, 990 queued, 7 succeeded`: how many of an array's jobs are in each status, none left out."""
    order = [*COUNT_ORDER, *sorted(set(statuses) - set(COUNT_ORDER))]
    return ", ".join(f"{statuses[status]} {status}" for status in order if statuses.get(status)) or "no jobs left"


def array_indices_cell(array: ArrayView) -> str:
    """The array's indices, and for a sweep the parameters its points come from."""
    if array.sweep:
        return f"{array.indices} (sweep of {', '.join(p.name for p in array.sweep)})"
    return array.indices


def array_row(array: ArrayView) -> list[Styled]:
    """`list`: an array as one row, its jobs counted by status."""
    return [array.array_id, array.name, status_cell(array.status), array_indices_cell(array),
            array_counts(array.statuses), "-" if array.max_running is None else str(array.max_running),
            array.creator, local_time(array.submitted_at)]


def array_detail_rows(array: ArrayView) -> list[tuple[str, Styled]]:
    """`show ARRAY`: what the array was made from and where its jobs stand, one (key, value) per line."""
    rows: list[tuple[str, Styled]] = [
        ("array", array.array_id), ("name", array.name), ("project", array.project), ("creator", array.creator),
        ("status", status_cell(array.status)), ("jobs", f"{array.size}: {array_counts(array.statuses)}"),
        ("indices", array.indices)]
    if array.sweep:
        rows.append(("sweep", "; ".join(f"{p.name}={','.join(p.values)}" for p in array.sweep)))
    rows += [("cap", "none" if array.max_running is None else f"at most {array.max_running} running at once"),
             ("submitted", local_time(array.submitted_at))]
    return rows


def array_job_columns(array: ArrayView) -> tuple[str, ...]:
    """The columns of an array's jobs: a sweep adds one per parameter, named as the parameter is."""
    return ("INDEX", "JOB", "STATUS", "EXIT", *(p.name for p in array.sweep), "REASON")


def array_job_row(job: ArrayMemberView, array: ArrayView) -> list[Styled]:
    return [str(job.index), job.job_id, status_cell(job.status), "-" if job.exit_code is None else str(job.exit_code),
            *(job.values.get(p.name, "-") for p in array.sweep), job.reason or "-"]


def more_jobs_line(array: ArrayView, shown: int) -> str:
    """What `show ARRAY` says under a table that holds only the first of its jobs."""
    left = sum(array.statuses.values()) - shown
    count = f"{left} more {'job' if left == 1 else 'jobs'}" if left > 0 else "more jobs"
    return f"… and {count}: `trainyard show {array.array_id} --all` lists every one"


# --- events ------------------------------------------------------------------------------------------------

EVENT_COLUMNS = ("TIME", "SERVICE", "EVENT", "DETAILS")


def event_row(envelope: EventEnvelope) -> list[str]:
    return [local_time(envelope.recorded_at), envelope.service, type(envelope.event).name(), event_details(envelope)]


def event_details(envelope: EventEnvelope) -> str:
    """An event's fields as `key=value`, without the job id, spec and launch plan (`--json` has them)."""
    skip = {"job_id", "spec"} | ({"nodes", "shape"} if isinstance(envelope.event, LaunchPlanned) else set())
    fields = msgspec.structs.asdict(envelope.event)
    if isinstance(envelope.event, LaunchPlanned) and (shape := envelope.event.shape) is not None:
        # The plan's size and rendezvous ports, as a plan recorded before shapes showed them.
        fields["ranks"] = len(shape.hosts)
        fields["ports"] = {rank: host.port for rank, host in enumerate(shape.hosts) if host.port}
    parts = []
    for key, value in fields.items():
        if key in skip or value in (None, [], {}) or (key == "base_port" and not value):
            continue
        if key == "placement":
            value = ", ".join(f"{p.rank}@{p.node}" for p in value)
        elif isinstance(value, Prediction):  # read as it was when made
            value = prediction_sentence(value, now=value.predicted_at)
        elif isinstance(value, list) and all(isinstance(item, NodeCheck) for item in value):
            value = "; ".join(node_check_text(check) for check in value)
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            value = ", ".join(value)
        elif key == "ports" and isinstance(value, dict):  # rank: port
            value = ", ".join(f"{rank}:{port}" for rank, port in sorted(value.items()))
        elif isinstance(value, datetime):
            value = local_time(value)
        elif isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, msgspec.Struct):
            value = "{" + ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(value).items()) + "}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def node_check_text(check: NodeCheck) -> str:
    """M1: one node's pre-check, `node-a passed` or `node-b failed (board:0 faulty (xid 79))`."""
    if check.passed:
        return f"{check.node} passed"
    return f"{check.node} failed ({', '.join(check.problems()) or 'no detail'})"


ALERT_COLUMNS = ("TIME", "KIND", "JOB", "NODE", "TITLE")
# `alerts --follow` prints row by row, so its columns have fixed widths (the title takes the rest).
ALERT_WIDTHS = (19, 15, 16, 12)


def alert_row(envelope: EventEnvelope) -> list[str]:
    alert = envelope.event
    assert isinstance(alert, AlertRaised)
    return [local_time(envelope.recorded_at), alert.kind, alert.job_id or "-", alert.node or "-", alert.title]


def alert_line(cells: Sequence[str], widths: Sequence[int] = ALERT_WIDTHS) -> str:
    """One row as a line of fixed-width columns (the last one as wide as it is), for output that follows."""
    return "  ".join([*(cell.ljust(width) for cell, width in zip(cells, widths, strict=False)),
                      *cells[len(widths):]])


# --- nodes, resources and flavors ------------------------------------------------------------------------------

NODE_COLUMNS = ("NODE", "STATUS", "ADDRESS", "CPU", "MEMORY (MiB)", "ACCELERATORS", "POOLS", "OS / KERNEL", "JOBS",
                "PROBLEMS")


def node_row(view: NodeView) -> list[str]:
    """One node: resources as used/total, and why it is unhealthy (M2), if it is."""
    info = view.info
    boards = ", ".join(f"{a.count}x {a.board}" for a in info.accelerators) or "-"
    return [info.name, view.status, info.address, f"{view.used.cpus:g}/{info.cpus:g}",
            f"{view.used.memory_mib}/{info.memory_mib}",
            f"{view.used.accelerators}/{info.accelerator_count} {boards}" if info.accelerators else "-",
            ",".join(info.pools) or "-", f"{info.os} / {info.kernel}", str(len(view.jobs)),
            "; ".join(view.problems) or "-"]


def node_cells(view: NodeView) -> list[Styled]:
    cells: list[Styled] = [*node_row(view)]
    cells[1] = (view.status, NODE_STATUS_STYLE.get(view.status, ""))
    return cells


SCALED_COLUMNS = ("INSTANCE", "TYPE", "PROVIDER", "STATE", "SINCE", "BUSY", "FOR JOBS")


def scaled_cells(instance: ScaledInstance) -> list[Styled]:
    """One instance the autoscaler started: on its way (requested, booting) with its age, ready or draining."""
    return [instance.name, instance.instance_type, instance.provider, instance.state, local_time(instance.since),
            "yes" if instance.busy else "no", ", ".join(instance.jobs) or "-"]


AUTOSCALER_LOG_COLUMNS = ("TIME", "EVENT", "INSTANCE", "DETAILS")
AUTOSCALER_LOG_WIDTHS = (19, 17, 24)


def autoscaler_log_row(envelope: EventEnvelope) -> list[str]:
    """One entry of the autoscaler's log: what happened to which instance, and the rest of the event."""
    details = event_details(envelope).split(" ")
    instance = next((part.split("=", 1)[1] for part in details if part.startswith("instance=")), "-")
    return [local_time(envelope.recorded_at), type(envelope.event).name(), instance,
            " ".join(part for part in details if not part.startswith("instance=")) or "-"]


def autoscaler_summary(status: QueueStatus, now: datetime) -> list[str]:
    """A6, as the seed's dashboard has it: idle and busy instances, those on their way with their age, the
    queues, and the types cooling down."""
    ready = [i for i in status.instances if i.state == "ready"]
    coming = [i for i in status.instances if i.state in ("requested", "booting")]
    lines = [f"instances: {sum(1 for i in ready if not i.busy)} idle, {sum(1 for i in ready if i.busy)} busy, "
             f"{len(coming)} on their way, {sum(1 for i in status.instances if i.state == 'draining')} draining",
             f"jobs: {status.queued_jobs} queued, {status.running_jobs} running"]
    lines += [f"  {flavor}: {count} queued" for flavor, count in status.queued_by_flavor.items()]
    lines += [f"  on its way: {i.name} ({i.instance_type}, {i.state}) for {(now - i.since).total_seconds():.0f}s"
              for i in coming]
    lines += [f"cooling down: {c.instance_type} until {local_time(c.until)} after {c.failures} failure(s)"
              for c in status.cooldowns]
    return lines


RESOURCE_COLUMNS = ("NODE", "STATUS", "OS / KERNEL", "MEMORY (GiB)", "CPUS", "ACCELERATORS", "DRIVER", "FLAVORS",
                    "USAGE")


def resource_row(node: NodeResources) -> list[str]:
    """S7: one node as used/total, its fit per asked flavor, and who holds its boards (`1(1):app`)."""
    accelerators = "-"
    if node.accelerators_total:
        accelerators = f"{node.accelerators_used}/{node.accelerators_total}" + (f" {node.board}" if node.board else "")
    return [node.name,
            ", ".join(f"{flavor}: {fit}" for flavor, fit in node.status.items()) or "-",
            f"{node.os or '-'} / {node.kernel or '-'}",
            f"{gib(node.memory_mib_used)}/{gib(node.memory_mib_total)}",
            f"{node.cpus_used:g}/{node.cpus_total:g}",
            accelerators,
            node.driver_version or "-",
            ", ".join(node.flavors) or "-",
            " ".join(str(usage) for usage in node.usage) or "-"]


FLAVOR_COLUMNS = ("FLAVOR", "CPUS", "MEMORY (GiB)", "ACCELERATORS", "BOARD", "SCHEDULABLE NODES")
DEMAND_COLUMNS = ("BOARD", "BOARDS NEEDED", "QUEUED JOBS")


def flavor_row(info: FlavorInfo) -> list[str]:
    flavor = info.flavor
    return [flavor.name, f"{flavor.cpus:g}", gib(flavor.memory_mib), str(flavor.accelerators), flavor.board or "-",
            str(info.schedulable_nodes)]


def demand_row(demand: BoardDemand) -> list[str]:
    return [demand.board, str(demand.boards_needed), str(demand.queued_jobs)]


# --- storage, settings, identity ---------------------------------------------------------------------------

STORAGE_COLUMNS = ("KIND", "NAME", "OWNER", "PROJECT", "OTHERS")


def storage_row(entry: StoredAccess) -> list[str]:
    return [entry.kind, entry.name, entry.owner, entry.project, entry.others]


def settings_rows(settings: AdminSettings) -> list[tuple[str, str]]:
    return [("urgent cap", f"{settings.urgent_cap} running + queued urgent jobs per user and project"),
            ("sharing", "on" if settings.sharing_enabled else "off (every job's access for others is none)"),
            ("max resumes cap", str(settings.max_resumes_cap)),
            ("max graceful shutdown", f"{settings.max_graceful_shutdown_seconds} s"),
            ("debug retention", settings.debug_retention),
            ("job retention", f"ended jobs kept in memory {settings.job_retention}; `search` finds them after"),
            ("dataset cache", f"unused entries kept {settings.cache_retention}; at most "
                              f"{settings.cache_high_percent:g}% of a node's disk, cut to "
                              f"{settings.cache_low_percent:g}% when above"),
            ("disk pressure", f"no new work above {settings.disk_high_percent:g}% full, again at or below "
                              f"{settings.disk_low_percent:g}%"),
            ("max queued jobs", f"{settings.max_queued_jobs_per_user} per user, all projects together"
             if settings.max_queued_jobs_per_user else "no limit"),
            ("submit rate", f"{settings.submit_rate} jobs per second per user, up to {settings.submit_burst} at once"
             if settings.submit_rate else "no limit")]


def identity_rows(identity: Identity) -> list[tuple[str, str]]:
    return [("user", identity.user), ("projects", ", ".join(identity.projects) or "-"),
            ("administrator", "yes" if identity.admin else "no"), ("email", identity.email or "-")]


# --- dataset caches (D1, D2) ------------------------------------------------------------------------------

CACHE_COLUMNS = ("NODE", "DATASET", "KEY", "SIZE (MiB)", "FILES", "COPIED", "LAST USE", "USED BY")


def cache_summary(cache: NodeCache) -> str:
    held = sum(entry.bytes for entry in cache.entries)
    disk = (f", disk {100 * cache.used_bytes / cache.disk_bytes:.0f}% full of {cache.disk_bytes / 2**30:.0f} GiB"
            if cache.disk_bytes else "")
    return (f"{cache.node}: {len(cache.entries)} entr{'y' if len(cache.entries) == 1 else 'ies'}, "
            f"{held / 2**20:.1f} MiB{disk} (reported {local_time(cache.reported_at)})")


def cache_rows(cache: NodeCache) -> list[tuple[str, ...]]:
    return [(cache.node, entry.source, entry.key[:12], f"{entry.bytes / 2**20:.1f}", str(entry.files),
             local_time(entry.staged_at), local_time(entry.last_used),
             ", ".join(pin.split("/")[0] for pin in dict.fromkeys(entry.pins)) or "-") for entry in cache.entries]


STAGING_COLUMNS = ("NODE", "DATASET", "COPIED (MiB)", "OF (MiB)", "RATE (MiB/s)")


def staging_rows(caches: Sequence[NodeCache], spec: JobSpec) -> list[tuple[str, ...]]:
    """J14: the copies of the job's datasets under way on its nodes."""
    sources = set(staged_sources(spec))
    now = datetime.now(UTC)
    rows: list[tuple[str, ...]] = []
    for cache in caches:
        for copy in cache.copying:
            if copy.source in sources:
                seconds = max((now - copy.started_at).total_seconds(), 1e-3)
                rows.append((cache.node, copy.source, f"{copy.done_bytes / 2**20:.1f}",
                             f"{copy.total_bytes / 2**20:.1f}", f"{copy.done_bytes / 2**20 / seconds:.1f}"))
    return rows


# --- runs (R2) ------------------------------------------------------------------------------------------

SERIES_COLUMNS = ("SERIES", "TASK", "RANK", "COUNT", "LAST", "MIN", "MAX", "LAST STEP")
VALUE_COLUMNS = ("STEP", "RANK", "VALUE", "LOGGED")


def _number(value: float) -> str:
    return f"{value:.6g}"


def series_rows(series: Sequence[SeriesView], *, all_ranks: bool) -> list[tuple[str, ...]]:
    """Rank 0's series (every rank's with `all_ranks`), and per name and task logged by several ranks a row
    across them: the mean of their last values, the least and the greatest of all."""
    rows: list[tuple[str, ...]] = []
    groups: dict[tuple[str, int], list[SeriesView]] = {}
    for s in series:
        groups.setdefault((s.name, s.task), []).append(s)
    for (name, task), members in groups.items():
        for s in members:
            if all_ranks or s.rank == 0:
                rows.append((name, str(task), str(s.rank), str(s.count), _number(s.last), _number(s.least),
                             _number(s.greatest), "-" if s.last_step is None else str(s.last_step)))
        if len(members) > 1:
            mean = sum(s.last for s in members) / len(members)
            rows.append((name, str(task), f"all {len(members)}", str(sum(s.count for s in members)),
                         f"{_number(mean)} (mean)", _number(min(s.least for s in members)),
                         _number(max(s.greatest for s in members)), "-"))
    return rows


def value_row(point: SeriesPoint) -> tuple[str, ...]:
    return ("-" if point.step is None else str(point.step), str(point.rank), _number(point.value),
            local_time(point.at))


def value_line(row: Sequence[str]) -> str:
    """A row of VALUE_COLUMNS in fixed columns, for values printed as they come (`--follow`)."""
    step, rank, value, logged = row
    return f"{step:>10}  {rank:>4}  {value:>12}  {logged}"


def run_life_lines(view: RunView) -> list[str]:
    """R1: where the run stands (waiting, running, finished and by what), its attempts, and the ranks
    that ended badly."""
    if view.state == "waiting":
        return ["run: waiting for the job's first process"]
    attempts = f" (attempts {', '.join(map(str, view.attempts))})" if len(view.attempts) > 1 else ""
    lines = [f"run: running since {local_time(view.began_at)}{attempts}" if view.state == "running" else
             f"run: finished {local_time(view.finished_at)}: {view.finished_by}{attempts}"]
    if view.processes:
        finished = sum(1 for p in view.processes if p.finished_at is not None)
        count = len(view.processes)
        lines.append(f"  {count} process{'' if count == 1 else 'es'} logged into it"
                     + (f", {finished} of them finished their logging" if finished else ""))
    for end in view.ended:
        if end.exit_code != 0:
            how = "was lost with its node" if end.exit_code is None else f"exited with {end.exit_code}"
            task = f"task {end.task} " if end.task else ""
            lines.append(f"  {task}rank {end.rank} of attempt {end.attempt} on {end.node} {how} at "
                         f"{local_time(end.ended_at)}")
    return lines
