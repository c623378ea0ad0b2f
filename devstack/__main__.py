"""`python -m devstack up | down | status`: the one-command local stack (SPEC X5).

`make up` then runs the example job with `python -m client.demo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from devstack.natscluster import NatsCluster, jetstream_ready
from devstack.natslogins import provision_nats_logins, service_login
from devstack.ops import metrics_env, start_prometheus
from devstack.pglogins import provision_service_logins
from devstack.processes import alive, forget_stopped, recorded_pids, stack_processes, stop_recorded
from devstack.servers import (
    ServerError,
    admin_url,
    create_database,
    port_open,
    start_nats,
    start_postgres,
    stop_postgres,
)
from devstack.stack import (
    LOCAL_NATS_URL,
    NATS_PORT,
    PG_PORT,
    REPO_ROOT,
    SERVICES,
    ProcessSet,
    local_socket_url,
    local_stack_urls,
    provision_auth,
    seed_storage,
    signin_links,
    stack_env,
)
from libs.contracts.cluster import ClusterConfig
from libs.contracts.operations.cluster import LIST_NODES
from libs.localstack import STACK_ENV_FILE, home_dir, write_stack_env
from libs.messaging.connection import STREAM_REPLICAS_VARIABLE
from services.gateway.console import links

app = typer.Typer(help="Run Trainyard locally.", no_args_is_help=True, add_completion=False)
# Piped or redirected (make up | tee), lines stay whole: rich would otherwise cut them at 80 columns.
console = Console(highlight=False, soft_wrap=not sys.stdout.isatty())
CLUSTER = REPO_ROOT / "deploy" / "local" / "cluster.yaml"


def supervisor_argv(home: Path, cluster: Path, replicas: int = 1, gateway: str | None = None) -> list[str]:
    return [sys.executable, "-m", "devstack.supervisor", "--home", str(home), "--cluster", str(cluster),
            "--replicas", str(replicas), *(["--gateway", gateway] if gateway else [])]


# The gateway's port (the HTTP API, docs/http-api.md); the stack comes up without it when the port is taken.
HTTP_PORT = int(os.environ.get("TRAINYARD_HTTP_PORT", "8080"))


@app.command()
def up(replicas: int = typer.Option(1, min=1, max=5,
                                    help="Processes per service: one acts, the others stand by to take over."),
       ops: bool = typer.Option(False, "--ops", help="Also start Prometheus scraping every process's metrics "
                                "(Debian's `prometheus`; port TRAINYARD_PROMETHEUS_PORT, 9090 by default)."),
       nats: int = typer.Option(1, "--nats", min=1, max=5, help="NATS servers: more than one make a cluster whose "
                                "streams are kept on three servers (or all, when fewer).")) -> None:
    """Start NATS, PostgreSQL, the services and the node agents; leave them running."""
    home = home_dir()
    run = home / "run"
    if any(alive(pid) for pid in recorded_pids(run).values()):
        console.print(f"the stack is already running (under {home}); `make down` stops it")
        return
    forget_stopped(run)  # records of a stack that ended without `down`: none of them runs
    home.mkdir(parents=True, exist_ok=True)
    # Servers named in the environment are used as they are, unless they are this stack's own
    # (left there by `source .trainyard/stack.env`): those are started again here.
    own = local_stack_urls()
    nats_url = os.environ.get("NATS_URL") if os.environ.get("NATS_URL") not in own else None
    database_url = os.environ.get("DATABASE_URL") if os.environ.get("DATABASE_URL") not in own else None
    streams: dict[str, str] = {}  # on a cluster, how many servers keep each stream
    try:
        if nats_url is None and nats > 1:
            nats_url = _start_nats_cluster(home, nats)
            streams = {STREAM_REPLICAS_VARIABLE: str(min(3, nats))}
        elif nats_url is None:
            if port_open(NATS_PORT):
                raise ServerError(f"port {NATS_PORT} is taken; set TRAINYARD_NATS_PORT or NATS_URL")
            console.print(f"[dim]starting nats-server (JetStream, a login per role) on 127.0.0.1:{NATS_PORT}[/]")
            server = start_nats(home / "nats", NATS_PORT, provision_nats_logins(home))
            run.mkdir(parents=True, exist_ok=True)
            (run / "nats.pid").write_text(str(server.pid))
            nats_url = LOCAL_NATS_URL
        if database_url is None:
            console.print(f"[dim]starting PostgreSQL (a password for every login, a role per service) on "
                          f"127.0.0.1:{PG_PORT}[/]")
            start_postgres(home / "postgres", PG_PORT)
            asyncio.run(create_database(admin_url(home / "postgres", PG_PORT, "postgres"), "trainyard"))
            # Each service logs in as its own role, through the server's Unix socket (LOCAL_DATABASE_URL's).
            provision_service_logins(home, SERVICES, local_socket_url(home),
                                     admin_url=admin_url(home / "postgres", PG_PORT, "trainyard"))
        else:
            provision_service_logins(home, SERVICES, database_url, admin_url=None)  # their server, their roles
    except ServerError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    storage = home / "storage"
    seed_storage(storage)
    env = stack_env(nats_url=nats_url, storage=storage, cluster=CLUSTER, extra={**provision_auth(home), **streams})
    write_stack_env(home, env)
    # Every process serves its metrics and says where (not variables for clients: stack.env has none of them).
    processes = ProcessSet(home, {**env, **metrics_env(home)})
    if ops:
        port = int(os.environ.get("TRAINYARD_PROMETHEUS_PORT", "9090"))
        try:
            if port_open(port):
                raise ServerError(f"port {port} is taken; set TRAINYARD_PROMETHEUS_PORT to another")
            prometheus = start_prometheus(processes, port)
        except ServerError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(1) from None
        console.print(f"[dim]started Prometheus at {prometheus}, scraping the stack (alerts at {prometheus}/alerts)[/]")
    # The supervisor starts the services and agents, and restarts any that exits (supervisor.py).
    gateway: str | None = f"127.0.0.1:{HTTP_PORT}"
    if port_open(HTTP_PORT):
        console.print(f"[yellow]port {HTTP_PORT} is taken: the HTTP API is not started; set TRAINYARD_HTTP_PORT[/]")
        gateway = None
    processes.start("supervisor", supervisor_argv(home, CLUSTER, replicas, gateway))
    expected = {n.name for n in ClusterConfig.load(CLUSTER).nodes}
    each = f" ({replicas} of each: one acts, the others stand by)" if replicas > 1 else ""
    console.print(f"[dim]started {', '.join(SERVICES)}{each} and {len(expected)} node agent(s) under a supervisor "
                  "that restarts them; waiting for nodes[/]")
    token = Path(env["TRAINYARD_TOKEN_FILE"]).read_text().strip()
    try:
        asyncio.run(_wait_for_nodes(nats_url, token, expected, timeout=90))
    except TimeoutError as exc:
        console.print(f"[red]error:[/] {exc}; see the logs in {home / 'logs'}")
        raise typer.Exit(1) from None
    console.print(f"[green]the stack is up[/]: NATS {nats_url}, logs in {home / 'logs'}, storage in {storage}")
    if gateway:
        code = links.issue(signin_links(home), token)
        console.print(f"the console: http://{gateway}/ (docs/console.md); this link signs you in once, within "
                      f"{int(links.LIFETIME_SECONDS) // 60} minutes:\n  http://{gateway}/signin#code={code}")
        console.print(f"the HTTP API: http://{gateway}/api/v1/openapi.json (docs/http-api.md)")


def _start_nats_cluster(home: Path, size: int) -> str:
    """`size` NATS servers in a cluster on ports TRAINYARD_NATS_PORT and up (routes 100 above), with the stack's
    logins; their URLs, once JetStream answers."""
    ports = [NATS_PORT + i for i in range(size)]
    route_ports = [port + 100 for port in ports]
    if taken := [port for port in ports + route_ports if port_open(port)]:
        raise ServerError(f"ports {taken} are taken; set TRAINYARD_NATS_PORT or NATS_URL")
    console.print(f"[dim]starting a cluster of {size} nats-servers (JetStream, every stream on {min(3, size)} of them, "
                  f"a login per role) on 127.0.0.1:{ports[0]}-{ports[-1]}[/]")
    cluster = NatsCluster(home, provision_nats_logins(home), size=size, ports=ports, route_ports=route_ports)
    cluster.start_all()
    run = home / "run"
    run.mkdir(parents=True, exist_ok=True)
    for index, server in enumerate(cluster.servers):
        assert server is not None
        (run / f"nats-{index + 1}.pid").write_text(str(server.pid))
    jetstream_ready(cluster.url, service_login(home, "scheduler"))
    return cluster.url


async def _wait_for_nodes(nats_url: str, token: str, expected: set[str], timeout: float) -> None:
    """Ask the scheduler for the nodes, as any client would, until every expected one is ready."""
    from libs.contracts.operations.base import CommandError
    from libs.contracts.operations.cluster import ListNodes, NodeList
    from libs.messaging.connection import NatsLogin, connect_once
    from libs.messaging.rpc import ServiceUnavailable, call

    deadline = time.monotonic() + timeout
    nc = None
    while nc is None:  # NATS admits the token once the scheduler or the monitor answers its auth callout
        try:
            nc = await connect_once(nats_url, "trainyard-devstack", NatsLogin.for_token(token))
        except Exception:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"NATS at {nats_url} did not admit the stack's token within {timeout:g}s") from None
            await asyncio.sleep(0.5)
    try:
        while time.monotonic() < deadline:
            try:
                reply = await call(nc, LIST_NODES.subject, ListNodes(), token=token)
                if isinstance(reply, CommandError):
                    raise RuntimeError(f"the scheduler refused to list the nodes: {reply.message}")
                if isinstance(reply, NodeList) and expected <= {n.info.name for n in reply.nodes
                                                                if n.status == "ready"}:
                    return
            except ServiceUnavailable:
                pass
            await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
    raise TimeoutError(f"nodes {sorted(expected)} did not all register within {timeout:g}s")


@app.command()
def down() -> None:
    """Stop everything `up` started."""
    home = home_dir()
    # The supervisor (which stops the services and agents), then anything still recorded, NATS last.
    stop_recorded(home / "run")
    stop_postgres(home / "postgres")
    (home / STACK_ENV_FILE).unlink(missing_ok=True)
    console.print("the stack is down")


@app.command()
def status() -> None:
    """Show every stack process, whether it runs, and how often the supervisor restarted it."""
    processes = stack_processes(home_dir())
    if not processes:
        console.print("the stack is not running")
        return
    for process in processes:
        state = "[green]running[/]" if process.running else "[red]exited[/] "
        console.print(f"{process.name:20} {state}  {escape(process.detail)}".rstrip())


if __name__ == "__main__":
    sys.exit(app())
