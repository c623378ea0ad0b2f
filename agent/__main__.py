"""Run a node agent: `python -m agent --name node-a [--config deploy/local/cluster.yaml]`."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import msgspec

from agent.agent import NodeAgent
from agent.resources import describe_host, parse_accelerators
from libs.contracts.cluster import AgentConfig, ClusterConfig
from libs.settings import Settings
from libs.telemetry.logs import configure_logging
from libs.telemetry.tracing import configure_tracing, shutdown_tracing


def _config(args: argparse.Namespace) -> AgentConfig:
    config = _read_config(args)
    try:  # Struct constructors do not check constraints; a round trip through msgspec does.
        return msgspec.convert(msgspec.to_builtins(config), AgentConfig)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid node settings: {exc}; node names are lower-case DNS labels "
                         "such as node-a") from None


def _read_config(args: argparse.Namespace) -> AgentConfig:
    if args.config:
        try:
            cluster = ClusterConfig.load(args.config)
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise SystemExit(f"cannot read {args.config}: {exc}") from None
        for node in cluster.nodes:
            if node.name == args.name:
                return node
        raise SystemExit(f"node {args.name!r} is not in {args.config}; add it under nodes:")
    return AgentConfig(name=args.name, address=args.address, cpus=args.cpus, memory_mib=args.memory_mib,
                       accelerators=[parse_accelerators(a) for a in args.accelerators], pools=args.pool)


async def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__)
    parser.add_argument("--name", required=True, help="node name (lower-case DNS label)")
    parser.add_argument("--config", help="take this node's settings from a cluster config file")
    parser.add_argument("--address", default="127.0.0.1", help="address other nodes reach this one at")
    parser.add_argument("--cpus", type=float, help="CPUs to offer (default: what the machine has)")
    parser.add_argument("--memory-mib", type=int, help="memory to offer (default: what the machine has)")
    parser.add_argument("--accelerators", action="append", default=[], metavar="BOARD:COUNT[:DRIVER]",
                        help="present simulated accelerator boards")
    parser.add_argument("--pool", action="append", default=[], help="dedicated resource pool")
    parser.add_argument("--root", type=Path, default=Path(".trainyard/agents"),
                        help="where job workspaces are created (a folder per node is made inside)")
    args = parser.parse_args()
    settings = Settings()
    configure_logging("agent")
    configure_tracing(f"agent-{args.name}")
    agent = NodeAgent(describe_host(_config(args)), nats_url=settings.nats_url,
                      root=args.root.resolve() / args.name, storage=settings.storage_root)
    await agent.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await agent.close()
    shutdown_tracing()


if __name__ == "__main__":
    asyncio.run(main())
