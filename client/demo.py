"""`python -m client.demo [SPEC]`: run the example job on the local stack that `make up` started.

Submits the spec (examples/pytorch-ddp.yaml unless another is named), follows its status and logs
to the end as `trainyard submit --follow` does, then lists the files in its output folder. Exits
with 1 unless the job succeeded.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from client.api import TrainyardClient
from client.cli import follow_job
from libs.contracts.jobspec import decode_spec
from libs.localstack import read_stack_env

# The example job of the checkout this runs from.
EXAMPLE_JOB = Path(__file__).resolve().parents[1] / "examples" / "pytorch-ddp.yaml"

app = typer.Typer(help="Run the example job on the local stack.", add_completion=False)
console = Console(highlight=False, soft_wrap=not sys.stdout.isatty())  # piped: whole lines, not cut at 80


@app.command()
def demo(spec: Path = typer.Argument(EXAMPLE_JOB)) -> None:
    """Submit the example job to the running stack, follow it to the end, show its outputs."""
    env = read_stack_env()
    if not env:
        console.print("[red]error:[/] the stack is not running; start it with `make up`")
        raise typer.Exit(1)
    status_ok = asyncio.run(_demo(env["NATS_URL"], spec, Path(env["TRAINYARD_STORAGE"])))
    raise typer.Exit(0 if status_ok else 1)


async def _demo(nats_url: str, spec_path: Path, storage: Path) -> bool:
    spec = decode_spec(spec_path.read_bytes(), yaml=True)
    async with TrainyardClient.connect(nats_url) as client:
        accepted = await client.submit(spec)
        console.print(f"submitted [bold]{accepted.job_id}[/] ({escape(spec.name)}) from {spec_path.name}")
        job = await follow_job(client, accepted.job_id)
        run = await client.run(accepted.job_id)
    if job.status != "succeeded":
        console.print(f"[red]{job.job_id} {job.status}[/]: {escape(job.reason or '')}")
        return False
    outputs = storage / "outputs" / (spec.output.name if spec.output else "")
    console.print(f"[green]{job.job_id} succeeded[/]; its outputs are in {outputs}:")
    for path in sorted(outputs.rglob("*")):
        if path.is_file():
            console.print(f"  {path.relative_to(outputs)}  ({path.stat().st_size} bytes)")
    for series in run.series:
        if series.rank == 0 and not series.name.startswith("system/"):
            console.print(f"  it logged {escape(series.name)}: {series.count} values, the last {series.last:.4g} "
                          f"(least {series.least:.4g}, greatest {series.greatest:.4g})")
    console.print("the stack stays up; try .venv/bin/trainyard list | show JOB | logs JOB | events JOB | "
                  "metrics JOB loss --plot, and `make down` to stop it")
    return True


if __name__ == "__main__":
    sys.exit(app())
