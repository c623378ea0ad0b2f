"""`trainyard`: the command-line tool, a thin layer over `client.api.TrainyardClient` (SPEC X6)."""

from __future__ import annotations

import asyncio
import difflib
import inspect
import os
import re
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, date, datetime, timedelta
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, get_args

import msgspec
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from client import terminal
from client.api import TrainyardClient, TrainyardError
from libs.auth import AuthError, issue_token, read_secret
from libs.contracts.agent import LogChunk
from libs.contracts.events import AlertRaised, EventEnvelope, LaunchPlanned
from libs.contracts.health import COMPONENT_PATTERN, NodeCheck
from libs.contracts.identity import Identity
from libs.contracts.jobspec import Access, FieldError, JobSpec, Priority, SpecError, decode_spec, parse_duration
from libs.contracts.messages import (
    JOB_STATUSES,
    CommandError,
    InstanceView,
    JobDetails,
    JobStatus,
    JobSummary,
    JobView,
    NodeView,
)
from libs.contracts.scheduling import (
    AdminSettings,
    BoardDemand,
    FlavorInfo,
    FlavorWait,
    NodeResources,
    Prediction,
    StoredAccess,
    StoredKind,
    WhyReport,
)
from libs.messaging.rpc import ServiceUnavailable

app = typer.Typer(help="Trainyard: queue, launch and follow distributed training jobs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
admin_app = typer.Typer(help="Administrator commands: platform settings, user tokens and fault drills.",
                        no_args_is_help=True)
app.add_typer(admin_app, name="admin")
storage_app = typer.Typer(help="Owners of resources in shared storage, and what others may do with them (J2).",
                          no_args_is_help=True)
app.add_typer(storage_app, name="storage")
# Piped output is not cut to 80 columns: tables stay one row per item for grep and friends.
out = Console(highlight=False, width=None if os.isatty(1) else int(os.environ.get("COLUMNS", "200")))
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
FollowOption = Annotated[bool, typer.Option("--follow", "-f", help="Follow status and logs until the job ends.")]

STATUS_STYLE = {"queued": "yellow", "running": "cyan", "succeeded": "green", "failed": "red",
                "stopped": "magenta", "expired": "magenta"}


def _fail(message: str, hint: str | None = None) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}")
    if hint:
        err.print(f"[dim]hint:[/] {escape(hint)}")
    return typer.Exit(1)


def _print_field_errors(errors: list[FieldError]) -> None:
    for error in errors:
        err.print(f"  [red]{escape(error.field)}[/]: {escape(error.message)}"
                  + (f"\n    [dim]hint: {escape(error.hint)}[/]" if error.hint else ""))


UNAUTHENTICATED_HINT = "set TRAINYARD_TOKEN (or TRAINYARD_TOKEN_FILE) to a token from `trainyard admin token`"
STACK_HINT = "is the stack running? start it with `make up`, or set NATS_URL"

# What to do next when the service's refusal carries no hint of its own.
DEFAULT_HINTS: dict[str, str] = {
    "not-found": "`trainyard search` lists the jobs you can see; nothing was changed",
    "forbidden": "ask an administrator, or the job's creator to share it with your project (J2 access)",
    "over-cap": "lower one of your urgent jobs first (`trainyard priority JOB normal`), or wait for one to end",
    "invalid-state": "`trainyard show JOB` shows the job's state; nothing was changed",
    "conflict": "`trainyard show JOB` shows the job as it is now; nothing was changed",
    "invalid-request": "`trainyard COMMAND --help` lists the accepted values",
    "invalid-spec": "fix the fields named above and try again",
    "unavailable": STACK_HINT,
    "internal": "see the service's log (.trainyard/logs/ for a local stack) and try again",
}


def error_hint(error: CommandError) -> str | None:
    """The next step for a refused request: the service's own hint, else one chosen by its code."""
    if error.code == "unauthenticated":
        return UNAUTHENTICATED_HINT
    return error.hint or DEFAULT_HINTS.get(error.code)


def _with_client(action: Callable[[TrainyardClient], Coroutine[Any, Any, None]]) -> None:
    """Connect, run `action`, close; turn refusals and an unreachable stack into readable errors.

    Commands that check their input first call this after checking, so bad input is reported even
    when no stack is reachable.
    """

    async def main() -> None:
        client = await TrainyardClient.open()
        try:
            await action(client)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    except TrainyardError as exc:
        _print_field_errors(exc.error.errors)
        raise _fail(exc.error.message if not exc.error.errors else "the request was refused",
                    error_hint(exc.error)) from None
    except ServiceUnavailable as exc:
        raise _fail(str(exc), STACK_HINT) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _run(command: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async command with a connected client (see `_with_client`)."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        _with_client(lambda client: command(client, *args, **kwargs))

    # typer reads the signature: hide the injected client parameter (and resolve the annotations,
    # which are strings under `from __future__ import annotations`).
    signature = inspect.signature(command, eval_str=True)
    wrapper.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])  # type: ignore[attr-defined]
    return wrapper


def _json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


def _time(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _status(job: JobView) -> str:
    return _status_markup(job.status)


def _status_markup(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def _statuses(given: list[str] | None) -> list[JobStatus]:
    """The statuses named by --status, in their usual order; an unknown one is an error."""
    unknown = [s for s in given or [] if s not in JOB_STATUSES]
    if unknown:
        raise _fail(f"unknown status {unknown[0]!r}", f"choose from {', '.join(JOB_STATUSES)}")
    return [s for s in JOB_STATUSES if s in (given or [])]


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(box=None, header_style="bold", title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


def _add_text_row(table: Table, cells: Sequence[str]) -> None:
    """A row of plain text: names and messages from the services are never read as markup."""
    table.add_row(*(Text(cell) for cell in cells))


# --- commands --------------------------------------------------------------------------------------


@app.command()
@_run
async def submit(client: TrainyardClient,
                 file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).", exists=True, dir_okay=False,
                                                      callback=lambda path: _check_spec(path))],
                 follow: FollowOption = False,
                 as_json: JsonOption = False) -> None:
    """Submit a job described in FILE."""
    spec = _read_spec(file)
    accepted = await client.submit(spec)
    if as_json:
        _json(accepted)
    else:
        out.print(f"submitted [bold]{accepted.job_id}[/] ({escape(spec.name)}): {accepted.status}")
    if follow:
        job = await follow_job(client, accepted.job_id)
        if job.status != "succeeded":
            raise typer.Exit(1)


def _read_spec(file: Path) -> JobSpec:
    """The spec in FILE, checked before anything is sent (so errors show even with no stack)."""
    try:
        return decode_spec(file.read_bytes(), yaml=file.suffix in (".yaml", ".yml"))
    except SpecError as exc:
        _print_field_errors(exc.errors)
        raise _fail(f"{file} is not a valid job spec; nothing was submitted") from None


def _check_spec(file: Path) -> Path:
    _read_spec(file)
    return file


async def follow_job(client: TrainyardClient, job_id: str) -> JobView:
    """Print status changes and every node's log lines until the job ends."""

    last_status: list[str] = []

    def on_change(job: JobView) -> None:
        running = sum(i.state == "running" for i in job.instances)
        if job.status == "queued":
            detail = f" (position {job.queue_position})" if job.queue_position else ""
        elif job.status == "running" and last_status[-1:] != ["running"]:
            detail = " on " + ", ".join(f"rank {p.rank}@{p.node}" for p in job.placement)
        elif job.status == "running":
            detail = f": {running}/{len(job.instances)} instances running"
        else:
            detail = f": {escape(job.reason)}" if job.reason else ""
        last_status.append(job.status)
        out.print(f"[dim]{datetime.now().strftime('%H:%M:%S')}[/] {job.job_id} {_status(job)}{detail}")

    async def print_logs() -> None:
        async for chunk in client.logs(job_id, follow=True):
            _print_chunk(chunk, prefix=True)

    log_task = asyncio.create_task(print_logs())
    job = await client.wait(job_id, on_change=on_change)
    await log_task
    return job


def _print_chunk(chunk: LogChunk, *, prefix: bool) -> None:
    # Log lines are the job's text: never read as markup or emoji, never re-wrapped.
    for line in chunk.lines:
        text = Text.assemble((f"[rank {chunk.rank}] ", "blue"), line) if prefix else Text(line)
        out.print(text, soft_wrap=True, emoji=False, highlight=False)


@app.command("list")
@_run
async def list_jobs(client: TrainyardClient,
                    status: Annotated[list[str] | None,
                                      typer.Option("--status", "-s", help="Only these statuses.")] = None,
                    project: Annotated[str | None, typer.Option(help="Only this project.")] = None,
                    show_all: Annotated[bool, typer.Option("--all", "-a", help="Also list worker instances "
                                                           "(rank > 0) of multi-node jobs.")] = False,
                    as_json: JsonOption = False) -> None:
    """List jobs, newest first: one row per job, its master instance (L8)."""
    jobs = await client.list_jobs(_statuses(status), project)
    if not show_all:
        jobs = [msgspec.structs.replace(j, instances=[i for i in j.instances if i.rank == 0]) for j in jobs]
    if as_json:
        _json(jobs)
        return
    table = Table(box=None, header_style="bold")
    for column in ("JOB", "NAME", "STATUS", "INSTANCE", "PRIORITY", "MODE", "NODES", "FLAVOR", "CREATOR",
                   "SUBMITTED"):
        table.add_column(column)
    for job in jobs:
        instances: list[InstanceView | None] = [*job.instances] or [None]
        for inst in instances:
            if inst is not None and inst.rank > 0:  # a worker row under its job (--all)
                table.add_row("", "", f"[dim]{inst.state}[/]", f"{inst.role} {inst.rank}@{inst.node}", "", "", "", "",
                              "", "")
                continue
            instance = f"master@{inst.node}" if inst is not None else "-"
            table.add_row(job.job_id, escape(job.name), _status(job), instance, job.priority, job.mode,
                          str(job.nodes), job.flavor or ",".join(job.flavors), job.creator, _time(job.submitted_at))
    out.print(table if jobs else "no jobs")


@app.command()
@_run
async def show(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
               as_json: JsonOption = False) -> None:
    """Show a job: its state, placement and per-node instances."""
    details = await client.get_job(job_id)
    usage = {sample.rank: sample for sample in await client.usage(job_id)}
    if as_json:
        _json({**msgspec.to_builtins(details), "usage": msgspec.to_builtins(list(usage.values()))})
        return
    job = details.job
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [("job", job.job_id), ("name", escape(job.name)), ("project", job.project), ("creator", job.creator),
            ("status", _status(job)), ("reason", escape(job.reason or "-")),
            ("exit code", "-" if job.exit_code is None else str(job.exit_code)),
            ("priority", job.priority), ("mode", f"{job.mode}, {job.nodes} node(s)"),
            ("flavor", job.flavor or f"one of {', '.join(job.flavors)}"), ("attempt", str(job.attempt)),
            ("submitted", _time(job.submitted_at)), ("started", _time(job.started_at)),
            ("ended", _time(job.ended_at)), ("output", job.output or "-")]
    if job.queue_position:
        rows.insert(5, ("queue position", str(job.queue_position)))
    rows.extend((key, escape(value)) for key, value in recovery_rows(details))
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)
    if job.instances:
        instances = Table(title="instances", box=None, header_style="bold", title_justify="left")
        for column in ("RANK", "NODE", "ROLE", "STATE", "PID", "EXIT", "CPU %", "MEMORY (MiB)", "ACCEL %", "SAMPLED"):
            instances.add_column(column)
        for inst in job.instances:
            sample = usage.get(inst.rank)
            measured = ((f"{sample.cpu_percent:.0f}", str(sample.memory_mib),
                         "-" if sample.accelerator_percent is None else f"{sample.accelerator_percent:.0f}",
                         _time(sample.sampled_at)) if sample else ("-", "-", "-", "-"))
            instances.add_row(str(inst.rank), inst.node, "master" if inst.master else inst.role, inst.state,
                              str(inst.pid or "-"), "-" if inst.exit_code is None else str(inst.exit_code), *measured)
        out.print(instances)


@app.command()
@_run
async def logs(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
               node: Annotated[int | None, typer.Option("--node", "-n", help="Only this rank.")] = None,
               follow: FollowOption = False) -> None:
    """Print a job's logs: every node merged with rank prefixes, or one node."""
    await client.get_job(job_id)  # a clear error for an unknown job
    async for chunk in client.logs(job_id, node, follow=follow):
        _print_chunk(chunk, prefix=node is None)


@app.command()
@_run
async def events(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
                 as_json: JsonOption = False) -> None:
    """Print the full event history of a job across services."""
    history = await client.history(job_id)
    if not history:
        raise _fail(f"no events for {job_id}", "check the id with `trainyard list`")
    if as_json:
        _json(history)
        return
    table = Table(box=None, header_style="bold")
    for column in ("TIME", "SERVICE", "EVENT", "DETAILS"):
        table.add_column(column)
    for envelope in history:
        table.add_row(_time(envelope.recorded_at), envelope.service, type(envelope.event).name(),
                      escape(event_details(envelope)))
    out.print(table)


def event_details(envelope: EventEnvelope) -> str:
    """An event's fields as `key=value`, without the job id, spec and launch plan (`--json` has them)."""
    skip = {"job_id", "spec"} | ({"nodes"} if isinstance(envelope.event, LaunchPlanned) else set())
    fields = msgspec.structs.asdict(envelope.event)
    parts = []
    for key, value in fields.items():
        if key in skip or value in (None, [], {}):
            continue
        if key == "placement":
            value = ", ".join(f"{p.rank}@{p.node}" for p in value)
        elif isinstance(value, Prediction):  # read as it was when made
            value = prediction_sentence(value, now=value.predicted_at)
        elif isinstance(value, list) and all(isinstance(item, NodeCheck) for item in value):
            value = "; ".join(node_check_text(check) for check in value)
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            value = ", ".join(value)
        elif isinstance(value, datetime):
            value = _time(value)
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


@app.command()
@_run
async def stop(client: TrainyardClient, job_ids: Annotated[list[str], typer.Argument(help="Job ids.")]) -> None:
    """Stop jobs: queued ones leave the queue, running ones are terminated."""
    done = await client.stop(job_ids)
    out.print(done.message)


@app.command()
@_run
async def delete(client: TrainyardClient, job_ids: Annotated[list[str], typer.Argument(help="Job ids.")]) -> None:
    """Delete ended jobs (stop running ones first)."""
    done = await client.delete(job_ids)
    out.print(done.message)


@app.command()
@_run
async def nodes(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """List registered nodes with their resources and use."""
    views = await client.nodes()
    if as_json:
        _json(views)
        return
    table = _table(*NODE_COLUMNS)
    for view in views:
        row: list[str | Text] = [Text(cell) for cell in node_row(view)]
        row[1] = Text(view.status, style=NODE_STATUS_STYLE.get(view.status, ""))
        table.add_row(*row)
    out.print(table if views else "no nodes registered")


@app.command()
@_run
async def queue(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """Show demand as the autoscaler sees it: queued jobs per flavor."""
    status = await client.queue_status()
    if as_json:
        _json(status)
        return
    out.print(f"queued jobs: {status.queued_jobs}   running jobs: {status.running_jobs}")
    for flavor, count in status.queued_by_flavor.items():
        out.print(f"  {flavor}: {count} queued")


@app.command()
@_run
async def wait(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
               timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None) -> None:
    """Wait until a job ends; exit 0 only if it succeeded."""
    try:
        job = await client.wait(job_id, timeout=timeout)
    except TimeoutError as exc:
        raise _fail(str(exc), "wait longer with --timeout, or drop it to wait until the job ends") from None
    out.print(f"{job.job_id} {_status(job)}" + (f": {escape(job.reason)}" if job.reason else ""))
    if job.status != "succeeded":
        raise typer.Exit(1)


@app.command("exec")
def exec_in_job(job_id: Annotated[str, typer.Argument(help="Job id.")],
                command: Annotated[list[str] | None, typer.Argument(
                    metavar="-- COMMAND", show_default=False,
                    help="The command to run, after --; without one, an interactive shell.")] = None,
                node: Annotated[str | None, typer.Option("--node", "-n", help="The node of the job to open it on "
                                                         "(default: the master's).")] = None) -> None:
    """Run a command, or open a shell, in a job's kept (or running) node environment (J15).

    Exits with the command's (or the shell's) exit code.
    """
    line = terminal.command_line(command or [])
    if line is not None and not line.strip():
        raise _fail("the command is empty", f"e.g. trainyard exec {job_id} -- ls /workspace, or leave it out for a "
                    "shell")
    stdin_tty = sys.stdin is not None and sys.stdin.isatty()
    interactive = line is None
    # A command's input is what is piped to it; typed at a terminal, it is closed (as with ssh host cmd).
    stdin = sys.stdin.buffer if sys.stdin is not None and (interactive or not stdin_tty) else None
    codes: list[int] = []

    async def action(client: TrainyardClient) -> None:
        columns, rows = terminal.terminal_size()
        async with client.session(job_id, line, node=node, columns=columns, rows=rows) as session:
            if interactive:
                err.print(Text(f"shell on {session.node} (rank {session.rank}, attempt {session.attempt}) of "
                               f"{job_id}; type exit to leave"), style="dim")
            try:
                codes.append(await terminal.attach(session, stdin=stdin, raw=interactive and stdin_tty))
            except ConnectionError as exc:
                raise _fail(str(exc), f"`trainyard nodes` shows whether {session.node} still answers") from None

    _with_client(action)
    raise typer.Exit(terminal.exit_status(codes[0]))


@app.command()
@_run
async def alerts(client: TrainyardClient,
                 follow: Annotated[bool, typer.Option("--follow", "-f", help="Then print new alerts as they are "
                                                      "raised, until Ctrl-C.")] = False,
                 as_json: Annotated[bool, typer.Option("--json", help="Print each alert's event envelope as one "
                                                       "line of JSON.")] = False) -> None:
    """List alerts (M7): unhealthy and lost nodes, resumed jobs, performance incidents, failed pre-checks."""
    if as_json:
        async for envelope in client.alerts(follow=follow):
            sys.stdout.write(msgspec.json.encode(envelope).decode() + "\n")
            sys.stdout.flush()
        return
    if follow:
        out.print(Text(alert_line(ALERT_COLUMNS), style="bold"), soft_wrap=True)
        async for envelope in client.alerts(follow=True):
            out.print(Text(alert_line(alert_row(envelope))), soft_wrap=True)
        return
    table = _table(*ALERT_COLUMNS)
    async for envelope in client.alerts():
        _add_text_row(table, alert_row(envelope))
    out.print(table if table.row_count else "no alerts")


# --- rendering: pure functions, so they can be checked without a stack ------------------------------


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f}"


def relative_time(when: datetime, now: datetime) -> str:
    """`in 25 min`, `in 2 h 5 min`, `in 3 d 4 h`: counted in whole minutes, as the clock time reads."""
    if when <= now:
        return "any moment now"
    minutes = int((when.replace(second=0, microsecond=0) - now.replace(second=0, microsecond=0)).total_seconds()
                  // 60)
    if minutes < 1:
        return "in under a minute"
    if minutes < 60:
        return f"in {minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"in {hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(hours, 24)
    return f"in {days} d" + (f" {hours} h" if hours else "")


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
    text += f" behind {_plural(prediction.jobs_ahead, 'job')}"
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
                     f"{_plural(report.jobs_ahead_count, 'job')}" + (f": {ahead}" if ahead else ""))
    return lines


def flavor_wait_title(wait: FlavorWait) -> str:
    """One flavor's standing: how many nodes it may use, how many fit one rank now, how many it needs."""
    if wait.eligible_nodes == 0:
        title = f"flavor {wait.flavor}: no eligible node, {wait.needed_nodes} needed"
    else:
        title = (f"flavor {wait.flavor}: {wait.fitting_nodes} of {_plural(wait.eligible_nodes, 'eligible node')} "
                 f"fit one rank now, {wait.needed_nodes} needed")
    return f"{title} ({wait.note})" if wait.note else title


def shortage_rows(wait: FlavorWait) -> list[list[str]]:
    return [[s.node, "; ".join(s.missing) or "-", ", ".join(s.held_by) or "-"] for s in wait.shortages]


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
            f"{_gib(node.memory_mib_used)}/{_gib(node.memory_mib_total)}",
            f"{node.cpus_used:g}/{node.cpus_total:g}",
            accelerators,
            node.driver_version or "-",
            ", ".join(node.flavors) or "-",
            " ".join(str(usage) for usage in node.usage) or "-"]


FLAVOR_COLUMNS = ("FLAVOR", "CPUS", "MEMORY (GiB)", "ACCELERATORS", "BOARD", "SCHEDULABLE NODES")
DEMAND_COLUMNS = ("BOARD", "BOARDS NEEDED", "QUEUED JOBS")


def flavor_row(info: FlavorInfo) -> list[str]:
    flavor = info.flavor
    return [flavor.name, f"{flavor.cpus:g}", _gib(flavor.memory_mib), str(flavor.accelerators), flavor.board or "-",
            str(info.schedulable_nodes)]


def demand_row(demand: BoardDemand) -> list[str]:
    return [demand.board, str(demand.boards_needed), str(demand.queued_jobs)]


SEARCH_COLUMNS = ("JOB", "NAME", "STATUS", "PRIORITY", "MODE", "FLAVOR", "ALGORITHM", "OUTPUT", "PROJECT", "CREATOR",
                  "SUBMITTED")


def search_row(job: JobSummary) -> list[str]:
    algorithm = job.algorithm or "-"
    if job.algorithm and job.algorithm_source == "favorite":
        algorithm += " (favorite)"
    return [job.job_id, job.name, job.status, job.priority, job.mode, job.flavor or ",".join(job.flavors) or "-",
            algorithm, job.output or "-", job.project, job.creator, _time(job.submitted_at)]


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
        rows.append(("environment", f"kept for the debug terminal until {_time(job.kept_until)}; "
                                    f"`trainyard exec {job.job_id}` opens a shell in it"))
    return rows


NODE_COLUMNS = ("NODE", "STATUS", "ADDRESS", "CPU", "MEMORY (MiB)", "ACCELERATORS", "POOLS", "OS / KERNEL", "JOBS",
                "PROBLEMS")
NODE_STATUS_STYLE = {"ready": "green", "lost": "red", "unhealthy": "yellow"}


def node_row(view: NodeView) -> list[str]:
    """One node: resources as used/total, and why it is unhealthy (M2), if it is."""
    info = view.info
    boards = ", ".join(f"{a.count}x {a.board}" for a in info.accelerators) or "-"
    return [info.name, view.status, info.address, f"{view.used.cpus:g}/{info.cpus:g}",
            f"{view.used.memory_mib}/{info.memory_mib}",
            f"{view.used.accelerators}/{info.accelerator_count} {boards}" if info.accelerators else "-",
            ",".join(info.pools) or "-", f"{info.os} / {info.kernel}", str(len(view.jobs)),
            "; ".join(view.problems) or "-"]


ALERT_COLUMNS = ("TIME", "KIND", "JOB", "NODE", "TITLE")
# `alerts --follow` prints row by row, so its columns have fixed widths (the title takes the rest).
ALERT_WIDTHS = (19, 15, 16, 12)


def alert_row(envelope: EventEnvelope) -> list[str]:
    alert = envelope.event
    assert isinstance(alert, AlertRaised)
    return [_time(envelope.recorded_at), alert.kind, alert.job_id or "-", alert.node or "-", alert.title]


def alert_line(cells: Sequence[str]) -> str:
    return "  ".join([*(cell.ljust(width) for cell, width in zip(cells, ALERT_WIDTHS, strict=False)),
                      *cells[len(ALERT_WIDTHS):]])


def settings_rows(settings: AdminSettings) -> list[list[str]]:
    return [["urgent cap", f"{settings.urgent_cap} running + queued urgent jobs per user and project"],
            ["sharing", "on" if settings.sharing_enabled else "off (every job's access for others is none)"],
            ["max resumes cap", str(settings.max_resumes_cap)],
            ["max graceful shutdown", f"{settings.max_graceful_shutdown_seconds} s"],
            ["debug retention", settings.debug_retention]]


def identity_rows(identity: Identity) -> list[list[str]]:
    return [["user", identity.user], ["projects", ", ".join(identity.projects) or "-"],
            ["administrator", "yes" if identity.admin else "no"], ["email", identity.email or "-"]]


def _print_pairs(rows: list[list[str]]) -> None:
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for row in rows:
        _add_text_row(table, row)
    out.print(table)


# --- clone overrides ---------------------------------------------------------------------------------


class OverrideError(ValueError):
    """A --set or overrides file the CLI refuses before anything is sent; `hint` says how to write it."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def _spec_fields() -> dict[str, msgspec.inspect.Type]:
    info = msgspec.inspect.type_info(JobSpec)
    assert isinstance(info, msgspec.inspect.StructType)
    return {field.name: field.type for field in info.fields}


def _check_key(key: str, origin: str) -> None:
    fields = _spec_fields()
    if key in fields:
        return
    close = difflib.get_close_matches(key, fields, n=1)
    raise OverrideError(f"{origin}: a job spec has no field {key!r}",
                        (f"did you mean {close[0]!r}? " if close else "") + "docs/jobs.md lists the fields")


def _keeps_text(field_type: msgspec.inspect.Type, value: object) -> bool:
    """Whether a YAML scalar that is not text (`535.104`, `2024`, `yes`, `2024-01-01`) is meant as the text
    typed: the field takes text and no number, boolean or date."""
    inspect_ = msgspec.inspect
    types = field_type.types if isinstance(field_type, inspect_.UnionType) else (field_type,)
    takes_text = any(isinstance(t, inspect_.StrType)
                     or (isinstance(t, inspect_.LiteralType) and any(isinstance(v, str) for v in t.values))
                     for t in types)
    if not takes_text:
        return False
    if isinstance(value, bool):
        return not any(isinstance(t, inspect_.BoolType) for t in types)
    if isinstance(value, int | float):
        return not any(isinstance(t, inspect_.IntType | inspect_.FloatType) for t in types)
    return isinstance(value, date)


def parse_set_options(items: Sequence[str]) -> dict[str, Any]:
    """`--set key=value` options as top-level spec overrides; values are YAML (`2`, `[cpu-2]`, `{name: x}`).

    Only top-level fields can be replaced (CloneJob replaces whole fields), so `a.b=c` is refused with
    the equivalent whole-field form rather than silently dropping a's other settings.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OverrideError(f"--set {item!r} is not key=value",
                                "write it as --set nodes=2, --set 'flavors=[cpu-2]' or --set priority=urgent")
        if "." in key:
            top, *rest = key.split(".")
            nested = raw.strip() or "..."
            for part in reversed(rest):
                nested = f"{{{part}: {nested}}}"
            raise OverrideError(f"--set {key}: nested keys are not supported; only top-level fields of the spec "
                                "can be set",
                                f"set the whole field instead, e.g. --set '{top}={nested}' (this replaces all of "
                                f"{top}: repeat the parts to keep), or put it in an overrides file (-f)")
        _check_key(key, f"--set {key}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = str(getattr(exc, "problem", None) or exc)
            raise OverrideError(f"--set {key}: the value {raw!r} is not valid YAML ({problem})",
                                f"quote the whole option in the shell, e.g. --set '{key}=[a, b]'") from None
        overrides[key] = raw.strip() if _keeps_text(_spec_fields()[key], value) else value
    return overrides


def read_overrides_file(path: Path) -> dict[str, Any]:
    """An overrides file: a YAML (or JSON) mapping of top-level spec fields to their new values."""
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise OverrideError(f"{path} is not valid YAML ({exc})", "fix the file; it holds top-level fields of a "
                            "job spec, e.g. `nodes: 2`") from None
    if document is None:
        return {}
    if not isinstance(document, dict) or not all(isinstance(key, str) for key in document):
        raise OverrideError(f"{path} is not a mapping of field names to values",
                            "write top-level fields of a job spec, one per line, e.g. `nodes: 2`")
    for key in document:
        _check_key(key, f"{path}: {key}")
    return document


def clone_overrides(file: Path | None, items: Sequence[str], name: str | None) -> dict[str, Any]:
    """The overrides of `trainyard clone`: the file's, then each --set, then --name (later ones win)."""
    overrides = read_overrides_file(file) if file is not None else {}
    overrides.update(parse_set_options(items))
    if name is not None:
        overrides["name"] = name
    return overrides


# --- tokens --------------------------------------------------------------------------------------------


EMAIL_PATTERN = re.compile(r"[^@\s]+@[^@\s]+")
NO_SECRET_HINT = ("set TRAINYARD_AUTH_SECRET to the secret the services sign tokens with, or "
                  "TRAINYARD_AUTH_SECRET_FILE to the file that holds it (a local stack started with `make up` "
                  "records its file in .trainyard/stack.env)")


def signing_secret() -> str:
    """The platform secret: TRAINYARD_AUTH_SECRET(_FILE), else the file a running local stack recorded."""
    try:
        secret = read_secret(required=False)
    except OSError as exc:
        raise _fail(f"cannot read TRAINYARD_AUTH_SECRET_FILE ({exc})", NO_SECRET_HINT) from None
    if secret:
        return secret
    from libs.devstack.stack import read_stack_env

    path = read_stack_env().get("TRAINYARD_AUTH_SECRET_FILE")
    if path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as exc:
            raise _fail(f"cannot read the local stack's secret file {path} ({exc})", NO_SECRET_HINT) from None
        if secret:
            return secret
    raise _fail("no signing secret to issue the token with", NO_SECRET_HINT)


# --- commands: scheduling and operations --------------------------------------------------------------


@app.command()
def predict(file: Annotated[Path, typer.Option("--file", "-f", help="Job spec (YAML or JSON).", exists=True,
                                               dir_okay=False)],
            as_json: JsonOption = False) -> None:
    """Predict whether a job would start now or queue, and until when (S6); creates nothing."""
    spec = _read_spec(file)

    async def action(client: TrainyardClient) -> None:
        prediction = await client.predict(spec)
        if as_json:
            _json(prediction)
            return
        out.print(Text(prediction_sentence(prediction, requested_nodes=spec.nodes)))
        if prediction.reason and prediction.estimated_start is not None:
            out.print(Text(f"  {prediction.reason}"), style="dim")

    _with_client(action)


@app.command()
@_run
async def why(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
              as_json: JsonOption = False) -> None:
    """Explain what a queued job waits for: jobs ahead, and per flavor the nodes and resources it lacks."""
    report = await client.why(job_id)
    if as_json:
        _json(report)
        return
    for line in why_lines(report):
        out.print(Text(line))
    for wait in report.flavors:
        out.print()
        out.print(Text(flavor_wait_title(wait)), soft_wrap=True)  # a title would wrap at the table's width
        if wait.shortages:
            table = _table("NODE", "MISSING", "HELD BY")
            for row in shortage_rows(wait):
                _add_text_row(table, row)
            out.print(table)


PRIORITIES: tuple[str, ...] = get_args(Priority)


@app.command()
def priority(job_id: Annotated[str, typer.Argument(help="Job id.")],
             level: Annotated[str, typer.Argument(help="normal, urgent or very-urgent (administrators).")]) -> None:
    """Change the priority of a queued job (S3); urgent jobs per user and project are capped (S2)."""
    if level not in PRIORITIES:
        raise _fail(f"unknown priority {level!r}", f"choose from {', '.join(PRIORITIES)}")
    chosen: Priority = level  # type: ignore[assignment]

    async def action(client: TrainyardClient) -> None:
        done = await client.change_priority(job_id, chosen)
        out.print(Text(done.message or f"{job_id}: priority set to {level}"))

    _with_client(action)


@app.command()
def duration(job_id: Annotated[str, typer.Argument(help="Job id.")],
             limit: Annotated[str, typer.Argument(metavar="DURATION",
                                                  help="New limit (90s, 30m, 4h, 2d), or none to remove it.")]) -> None:
    """Change a job's duration limit, also while it runs, without restarting it (S11)."""
    new: str | None = None if limit.strip().lower() == "none" else limit.strip()
    if new is not None:
        try:
            parse_duration(new)
        except ValueError as exc:
            raise _fail(str(exc), "give a number and a unit (s, m, h, d), e.g. 4h, or none to remove the "
                        "limit") from None

    async def action(client: TrainyardClient) -> None:
        done = await client.change_duration(job_id, new)
        out.print(Text(done.message or f"{job_id}: duration limit " + (f"set to {new}" if new else "removed")))

    _with_client(action)


@app.command()
def clone(job_id: Annotated[str, typer.Argument(help="The job to copy.")],
          set_: Annotated[list[str] | None, typer.Option("--set", help="Replace a top-level spec field: key=value, "
                                                         "the value read as YAML (repeatable).")] = None,
          file: Annotated[Path | None, typer.Option("--file", "-f", help="YAML mapping of top-level fields to "
                                                    "replace.", exists=True, dir_okay=False)] = None,
          name: Annotated[str | None, typer.Option("--name", help="The new job's name.")] = None,
          as_json: JsonOption = False) -> None:
    """Create a job from another's spec, with fields replaced (O1); prints the new job's id."""
    try:
        overrides = clone_overrides(file, set_ or [], name)
    except OverrideError as exc:
        raise _fail(str(exc), exc.hint) from None

    async def action(client: TrainyardClient) -> None:
        accepted = await client.clone(job_id, overrides)
        if as_json:
            _json(accepted)
            return
        out.print(f"cloned {escape(job_id)} as [bold]{accepted.job_id}[/]: {accepted.status}")

    _with_client(action)


@app.command()
@_run
async def devenv(client: TrainyardClient, job_id: Annotated[str, typer.Argument(help="Job id.")],
                 output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the YAML to this file.",
                                                             dir_okay=False)] = None) -> None:
    """Print a development environment spec derived from a job (O4), as YAML."""
    spec = await client.devenv(job_id)
    document = msgspec.yaml.encode(spec).decode()
    if output is None:
        sys.stdout.write(document)
        return
    output.write_text(document)
    out.print(Text(f"wrote the development environment of {job_id} to {output}"))


@app.command()
def search(name: Annotated[str | None, typer.Option(help="Part of the name (any case).")] = None,
           status: Annotated[list[str] | None, typer.Option("--status", "-s", help="Only these statuses "
                                                            "(repeatable).")] = None,
           creator: Annotated[str | None, typer.Option(help="Created by this user.")] = None,
           algorithm: Annotated[str | None, typer.Option(help="Runs this own algorithm.")] = None,
           favorite_algorithm: Annotated[str | None, typer.Option(help="Runs this favourite algorithm.")] = None,
           flavor: Annotated[str | None, typer.Option(help="Has this flavor among its flavors.")] = None,
           output: Annotated[str | None, typer.Option(help="Writes to this output location.")] = None,
           project: Annotated[str | None, typer.Option(help="In this project.")] = None,
           limit: Annotated[int, typer.Option(min=1, help="At most this many jobs.")] = 200,
           as_json: JsonOption = False) -> None:
    """Search the jobs you may see (O2); every filter given must match."""
    statuses = _statuses(status)

    async def action(client: TrainyardClient) -> None:
        jobs = await client.search(name=name, statuses=statuses, creator=creator, algorithm=algorithm,
                                   favorite_algorithm=favorite_algorithm, flavor=flavor, output=output,
                                   project=project, limit=limit)
        if as_json:
            _json(jobs)
            return
        if not jobs:
            out.print("no jobs match")
            return
        table = _table(*SEARCH_COLUMNS)
        for job in jobs:
            row = [escape(cell) for cell in search_row(job)]
            row[2] = _status_markup(job.status)
            table.add_row(*row)
        out.print(table)

    _with_client(action)


@app.command()
def resources(flavor: Annotated[list[str] | None, typer.Option("--flavor", help="A flavor to place "
                                                               "(repeatable).")] = None,
              as_json: JsonOption = False) -> None:
    """Show the schedulable nodes for flavors: fit, OS, memory, CPUs, boards and who uses them (S7)."""
    if not flavor:
        raise _fail("name at least one flavor", "e.g. trainyard resources --flavor cpu-2; `trainyard flavors` "
                    "lists them")
    asked = flavor

    async def action(client: TrainyardClient) -> None:
        nodes = await client.resources(asked)
        if as_json:
            _json(nodes)
            return
        if not nodes:
            out.print(Text(f"no schedulable node for {', '.join(asked)}"))
            return
        table = _table(*RESOURCE_COLUMNS)
        for node in nodes:
            _add_text_row(table, resource_row(node))
        out.print(table)

    _with_client(action)


@app.command()
@_run
async def flavors(client: TrainyardClient,
                  board: Annotated[str | None, typer.Option(help="Only flavors of this board model.")] = None,
                  as_json: JsonOption = False) -> None:
    """List flavors, and the boards of each model that queued jobs need (S8)."""
    listing = await client.flavors(board)
    if as_json:
        _json(listing)
        return
    table = _table(*FLAVOR_COLUMNS)
    for info in listing.flavors:
        _add_text_row(table, flavor_row(info))
    out.print(table if listing.flavors else "no flavors" + (f" with board {board}" if board else ""))
    out.print()
    if not listing.demand:
        out.print("no queued job needs boards")
        return
    demand = _table(*DEMAND_COLUMNS, title="queued demand")
    for entry in listing.demand:
        _add_text_row(demand, demand_row(entry))
    out.print(demand)


@app.command()
@_run
async def whoami(client: TrainyardClient, as_json: JsonOption = False) -> None:
    """Show who the services take you for: the user, projects and role in your token."""
    identity = await client.whoami()
    if as_json:
        _json(identity)
        return
    _print_pairs(identity_rows(identity))


# --- commands: shared storage's owners ----------------------------------------------------------------

STORAGE_COLUMNS = ("KIND", "NAME", "OWNER", "PROJECT", "OTHERS")
StoredKindArgument = Annotated[str, typer.Argument(metavar="KIND", help=f"One of: {', '.join(get_args(StoredKind))}.")]


def _stored_kind(kind: str) -> StoredKind:
    if kind not in get_args(StoredKind):
        raise _fail(f"{kind!r} is not a kind of stored resource", f"choose from: {', '.join(get_args(StoredKind))}")
    return kind  # type: ignore[return-value]


def _print_storage(entries: list[StoredAccess]) -> None:
    table = _table(*STORAGE_COLUMNS)
    for entry in entries:
        _add_text_row(table, [entry.kind, entry.name, entry.owner, entry.project, entry.others])
    out.print(table)


@storage_app.command("access")
def storage_access(kind: StoredKindArgument,
                   name: Annotated[str, typer.Argument(help="The resource's name (every version of it).")],
                   others: Annotated[str, typer.Option(metavar="read-write|read-only|none",
                                                       help="What the other members of the project may do.")],
                   project: Annotated[str, typer.Option(help="The project whose members it is shared with.")]
                   = "default",
                   owner: Annotated[str | None, typer.Option(help="Administrators: register it to this user.")]
                   = None,
                   as_json: JsonOption = False) -> None:
    """Register a resource to yourself, or change what others in its project may do with it.

    A job's access for others may never exceed its creator's own access to the resources it uses;
    resources nobody registered are open to everyone.
    """
    stored_kind = _stored_kind(kind)
    if others not in get_args(Access):
        raise _fail(f"--others takes {', '.join(get_args(Access))}, not {others!r}", "e.g. --others read-only")

    async def action(client: TrainyardClient) -> None:
        entry = await client.set_storage_access(stored_kind, name, project=project, others=others,  # type: ignore[arg-type]
                                                owner=owner)
        if as_json:
            _json(entry)
            return
        _print_storage([entry])

    _with_client(action)


@storage_app.command("list")
def storage_list(kind: Annotated[str | None, typer.Option(help="Only this kind.")] = None,
                 as_json: JsonOption = False) -> None:
    """Registered resources of your projects and your own (resources not listed are open to everyone)."""
    stored_kind = None if kind is None else _stored_kind(kind)

    async def action(client: TrainyardClient) -> None:
        entries = await client.storage_access(stored_kind)
        if as_json:
            _json(entries)
            return
        if not entries:
            out.print("no registered resources: everything in shared storage is open to everyone")
            return
        _print_storage(entries)

    _with_client(action)


# --- commands: administration --------------------------------------------------------------------------


@admin_app.command("settings")
def admin_settings(urgent_cap: Annotated[int | None, typer.Option(min=0, help="Running + queued urgent jobs per "
                                                                  "user and project (S2).")] = None,
                   sharing: Annotated[str | None, typer.Option(metavar="on|off", help="off forces every job's "
                                                               "access for others to none (J2).")] = None,
                   max_resumes_cap: Annotated[int | None, typer.Option(min=0, help="Cap on a job's maximum "
                                                                       "resumes (J12).")] = None,
                   max_graceful_shutdown_seconds: Annotated[int | None, typer.Option(
                       min=0, help="Cap on a job's graceful shutdown time (J12).")] = None,
                   debug_retention: Annotated[str | None, typer.Option(help="How long a failed job's environment "
                                                                       "is kept (J15), e.g. 4h.")] = None,
                   as_json: JsonOption = False) -> None:
    """Show the platform settings; with options, change them (administrators only)."""
    sharing_enabled: bool | None = None
    if sharing is not None:
        if sharing.lower() not in ("on", "off"):
            raise _fail(f"--sharing takes on or off, not {sharing!r}", "e.g. --sharing off")
        sharing_enabled = sharing.lower() == "on"
    if debug_retention is not None:
        try:
            parse_duration(debug_retention)
        except ValueError as exc:
            raise _fail(str(exc), "give a number and a unit (s, m, h, d), e.g. --debug-retention 4h") from None
    changes = {"urgent_cap": urgent_cap, "sharing_enabled": sharing_enabled, "max_resumes_cap": max_resumes_cap,
               "max_graceful_shutdown_seconds": max_graceful_shutdown_seconds, "debug_retention": debug_retention}
    changing = any(value is not None for value in changes.values())

    async def action(client: TrainyardClient) -> None:
        if changing:
            settings = await client.change_settings(
                urgent_cap=urgent_cap, sharing_enabled=sharing_enabled, max_resumes_cap=max_resumes_cap,
                max_graceful_shutdown_seconds=max_graceful_shutdown_seconds, debug_retention=debug_retention)
        else:
            settings = await client.settings()
        if as_json:
            _json(settings)
            return
        if changing:
            out.print("settings changed")
        _print_pairs(settings_rows(settings))

    _with_client(action)


@admin_app.command("fault")
def admin_fault(node: Annotated[str, typer.Argument(help="The node's name.")],
                component: Annotated[str, typer.Argument(help="<kind>:<name>, e.g. board:0, nic:eth0, "
                                                         "runtime:storage.")],
                reason: Annotated[str, typer.Option(help="Why, recorded with the mark.")] = "",
                clear: Annotated[bool, typer.Option("--clear", help="Clear the mark instead.")] = False) -> None:
    """Mark a node's component faulty, e.g. for a drill (M2), or clear the mark (administrators only).

    A marked node is unhealthy: nothing new is placed on it and its checkpoint-resume jobs are moved.
    """
    if not COMPONENT_PATTERN.match(component):
        raise _fail(f"{component!r} is not a component name",
                    "write <kind>:<name> with kind nic, board or runtime, e.g. board:0, nic:eth0 or runtime:storage")
    if not node.strip():
        raise _fail("the node name is empty", "`trainyard nodes` lists the nodes")

    async def action(client: TrainyardClient) -> None:
        done = await client.mark_component(node, component, faulty=not clear, reason=reason)
        if done.message:
            out.print(Text(done.message))
        elif clear:
            out.print(Text(f"{node}: cleared the mark on {component}"))
        else:
            out.print(Text(f"{node}: {component} marked faulty; clear it with "
                           f"`trainyard admin fault {node} {component} --clear`"))

    _with_client(action)


@admin_app.command("token")
def admin_token(user: Annotated[str, typer.Argument(help="The user the token speaks for.")],
                project: Annotated[list[str] | None, typer.Option("--project", "-p", help="A project the user "
                                                                  "belongs to (repeatable).")] = None,
                admin: Annotated[bool, typer.Option("--admin", help="Make the user an administrator.")] = False,
                email: Annotated[str | None, typer.Option(help="Where alerts about the user's jobs are mailed "
                                                          "(M7).")] = None,
                ttl: Annotated[str, typer.Option(help="How long the token is valid: 90s, 30m, 4h, 2d.")] = "30d",
                output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the token to this file "
                                                            "(readable by you only).", dir_okay=False)] = None) -> None:
    """Issue a signed token for a user, locally with the platform secret (no stack needed)."""
    try:
        ttl_seconds = parse_duration(ttl)
    except ValueError as exc:
        raise _fail(str(exc), "give a number and a unit (s, m, h, d), e.g. --ttl 30d") from None
    if not user.strip():
        raise _fail("the user name is empty", "e.g. trainyard admin token alice --project vision")
    if email is not None and not EMAIL_PATTERN.fullmatch(email.strip()):
        raise _fail(f"{email!r} is not an email address", "e.g. --email alice@example.com")
    try:
        identity = msgspec.convert({"user": user.strip(), "projects": project or [], "admin": admin,
                                    "email": email.strip() if email else None}, Identity)
    except msgspec.ValidationError as exc:
        raise _fail(f"invalid project name ({exc})", "project names use letters, digits, '_', '.' and '-'") from None
    try:
        token = issue_token(signing_secret(), identity, ttl_seconds=ttl_seconds)
    except AuthError as exc:
        raise _fail(str(exc), NO_SECRET_HINT) from None
    expires = (datetime.now(UTC) + timedelta(seconds=ttl_seconds)).strftime("%Y-%m-%d %H:%M UTC")
    who = (f"{identity.user}" + (f" <{identity.email}>" if identity.email else "")
           + f" (projects: {', '.join(identity.projects) or 'none'}"
           + ("; administrator" if identity.admin else "") + ")")
    if output is None:
        # Only the token on stdout, so that `export TRAINYARD_TOKEN=$(trainyard admin token ...)` works.
        sys.stdout.write(token + "\n")
        err.print(Text(f"token for {who}, valid until {expires}; use it as TRAINYARD_TOKEN"), style="dim")
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    output.chmod(0o600)
    out.print(Text(f"wrote a token for {who} to {output}, valid until {expires}; use it with "
                   f"TRAINYARD_TOKEN_FILE={output}"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
