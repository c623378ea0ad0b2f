"""Run a node agent: `python -m agent --name node-a [--config deploy/local/cluster.yaml]`, with the node's
credential in the file TRAINYARD_NODE_TOKEN_FILE names (or in TRAINYARD_NODE_TOKEN).

Jobs outlive their agent: stopping or restarting it leaves them running for the next agent to adopt.
`python -m agent --name node-a --end-jobs` ends them, when a host's platform is shut down."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

from agent.agent import NodeAgent
from agent.presence.resources import describe_host, parse_accelerators
from agent.ranks.process import end_recorded_jobs
from agent.ranks.tcp_ports import PortBook, PortRangeError
from libs.auth import AuthError, node_token_control_keys
from libs.contracts.cluster import AgentConfig, ClusterConfig
from libs.controlsign import ControlKeysMissing, ControlVerifier, parse_control_keys
from libs.settings import NODE_TOKEN_FILE_VARIABLE, NODE_TOKEN_VARIABLE, Settings
from libs.skeleton.entrypoint import run


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
                       accelerators=[parse_accelerators(a) for a in args.accelerators], pools=args.pool,
                       labels=dict(args.label))


def _label(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__)
    parser.add_argument("--name", required=True, help="node name (lower-case DNS label)")
    parser.add_argument("--config", help="take this node's settings from a cluster config file")
    parser.add_argument("--address", default="127.0.0.1", help="address other nodes reach this one at")
    parser.add_argument("--cpus", type=float, help="CPUs to offer (default: what the machine has)")
    parser.add_argument("--memory-mib", type=int, help="memory to offer (default: what the machine has)")
    parser.add_argument("--accelerators", action="append", default=[], metavar="BOARD:COUNT[:DRIVER]",
                        help="present simulated accelerator boards")
    parser.add_argument("--pool", action="append", default=[], help="dedicated resource pool")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", type=_label,
                        help="a label of the node (the autoscaler names its instances' nodes so)")
    parser.add_argument("--root", type=Path, default=Path(".trainyard/agents"),
                        help="where job workspaces are created (a folder per node is made inside)")
    parser.add_argument("--end-jobs", action="store_true",
                        help="end the jobs this node's agents left running, then exit (no NATS needed)")
    return parser.parse_args()


def node_credential(node: str, environ: Mapping[str, str] = os.environ) -> str:
    """The node's credential, from the file TRAINYARD_NODE_TOKEN_FILE names or else TRAINYARD_NODE_TOKEN."""
    ask = f"ask an administrator: trainyard admin node-token {node}"
    if path := environ.get(NODE_TOKEN_FILE_VARIABLE):
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"no node credential: cannot read {NODE_TOKEN_FILE_VARIABLE} {path} "
                             f"({exc.strerror or exc}); {ask}") from None
        if not token:
            raise SystemExit(f"no node credential: {path} ({NODE_TOKEN_FILE_VARIABLE}) is empty; {ask}")
        return token
    if token := environ.get(NODE_TOKEN_VARIABLE, "").strip():
        return token
    raise SystemExit(f"no node credential: set {NODE_TOKEN_FILE_VARIABLE} to the file that holds this node's "
                     f"token (or {NODE_TOKEN_VARIABLE} to the token); {ask}")


def control_of(token: str, node: str) -> ControlVerifier:
    """The check of the launcher's and the monitor's signatures, with the keys the node credential carries."""
    try:
        return ControlVerifier(parse_control_keys(node_token_control_keys(token)))
    except (AuthError, ControlKeysMissing) as exc:
        raise SystemExit(f"{exc}: this agent could not tell the control plane's requests from anyone else's; "
                         f"ask an administrator for a new node credential: trainyard admin node-token {node}") from None


class RunningAgent:
    """A started node agent as `libs.skeleton.entrypoint.run` keeps it: up until SIGTERM or SIGINT, then closed."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def stopped(self) -> None:
        # Nothing stops a started agent on its own (a refused registration fails its start instead).
        await asyncio.Event().wait()

    async def close(self) -> None:
        await self.agent.close()


async def started(args: argparse.Namespace) -> RunningAgent:
    """Check the node's settings, then start its agent: registered with the monitor and answering."""
    settings = Settings()
    info = describe_host(_config(args))
    token = node_credential(info.name)
    try:
        ports = PortBook.from_environment()
    except PortRangeError as exc:
        raise SystemExit(str(exc)) from None
    agent = NodeAgent(info, nats_url=settings.nats_url, root=args.root.resolve() / args.name,
                      storage=settings.storage_root, node_token=token, control=control_of(token, info.name),
                      ports=ports)
    await agent.start()  # a refused registration raises SystemExit with the monitor's reason
    return RunningAgent(agent)


def main() -> None:
    # The node's name is known before anything starts: the agent traces as agent-<name>.
    args = _arguments()
    if args.end_jobs:
        ended = end_recorded_jobs(args.root.resolve() / args.name, args.name,
                                  "the node's platform was shut down, and this process with it")
        print(f"{args.name}: ended {len(ended)} job process(es)")
        return
    run("agent", lambda: started(args), trace_as=f"agent-{args.name}", node=args.name)


if __name__ == "__main__":
    main()
