"""`trainyard`: the command-line tool, a thin layer over `client.api.TrainyardClient` (SPEC X6)."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from collections.abc import Callable, Coroutine
from datetime import datetime
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from client.api import TrainyardClient, TrainyardError
from libs.contracts.agent import LogChunk
from libs.contracts.events import EventEnvelope
from libs.contracts.jobspec import FieldError, JobSpec, SpecError, decode_spec
from libs.contracts.messages import JOB_STATUSES, InstanceView, JobStatus, JobView
from libs.messaging.rpc import ServiceUnavailable

app = typer.Typer(help="Trainyard: queue, launch and follow distributed training jobs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
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


def _run(command: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async command with a connected client; turn refusals into readable errors."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        async def main() -> None:
            client = await TrainyardClient.open()
            try:
                await command(client, *args, **kwargs)
            finally:
                await client.close()

        try:
            asyncio.run(main())
        except TrainyardError as exc:
            _print_field_errors(exc.error.errors)
            raise _fail(exc.error.message if not exc.error.errors else "the request was refused",
                        exc.error.hint) from None
        except ServiceUnavailable as exc:
            raise _fail(str(exc), "is the stack running? start it with `make up`, or set NATS_URL") from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

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
    return f"[{STATUS_STYLE.get(job.status, 'white')}]{job.status}[/]"


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
    unknown = [s for s in status or [] if s not in JOB_STATUSES]
    if unknown:
        raise _fail(f"unknown status {unknown[0]!r}", f"choose from {', '.join(JOB_STATUSES)}")
    statuses: list[JobStatus] = [s for s in JOB_STATUSES if s in (status or [])]
    jobs = await client.list_jobs(statuses, project)
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
    history = await client.events(job_id)
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
                      escape(_event_details(envelope)))
    out.print(table)


def _event_details(envelope: EventEnvelope) -> str:
    skip = {"job_id", "spec", "nodes"}
    fields = msgspec.structs.asdict(envelope.event)
    parts = []
    for key, value in fields.items():
        if key in skip or value in (None, [], {}):
            continue
        if key == "placement":
            value = ", ".join(f"{p.rank}@{p.node}" for p in value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


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
    table = Table(box=None, header_style="bold")
    for column in ("NODE", "STATUS", "ADDRESS", "CPU", "MEMORY (MiB)", "ACCELERATORS", "POOLS", "OS / KERNEL", "JOBS"):
        table.add_column(column)
    for view in views:
        info = view.info
        boards = ", ".join(f"{a.count}x {a.board}" for a in info.accelerators) or "-"
        table.add_row(info.name, "[green]ready[/]" if view.status == "ready" else "[red]lost[/]", info.address,
                      f"{view.used.cpus:g}/{info.cpus:g}", f"{view.used.memory_mib}/{info.memory_mib}",
                      f"{view.used.accelerators}/{info.accelerator_count} {boards}" if info.accelerators else "-",
                      ",".join(info.pools) or "-", f"{info.os} / {info.kernel}", str(len(view.jobs)))
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
