"""JSON Schemas of the contracts, for readers outside Python (SPEC X2, X4).

    python -m libs.contracts.schema_export docs/schemas          # write the files
    python -m libs.contracts.schema_export --check docs/schemas  # exit 1 if they are stale

One file per group of messages. The output is deterministic (sorted keys, two-space indent, one
trailing newline), so the committed files can be compared with a fresh export in tests.

The contract types tolerate unknown fields (stored events must survive newer writers), but where
people and clients write input (job specs, requests) `libs.contracts.strict.decode_strict` refuses
unknown fields at any depth; the schemas of those groups say so with `additionalProperties: false`
on every object they define.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from libs.contracts.agent import (
    AgentReply,
    AnnounceNodes,
    Heartbeat,
    LogChunk,
    ProcessReport,
    RegisterNode,
    ReservePorts,
    StartProcess,
    StopProcesses,
)
from libs.contracts.events import Event, EventEnvelope
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.catalogue import PEOPLE_REPLIES as Reply
from libs.contracts.operations.catalogue import PEOPLE_REQUESTS as Request
from libs.contracts.patterns import for_json_schema

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """One exported file: the types it describes and what they are."""

    filename: str
    title: str
    description: str
    types: tuple[Any, ...]
    strict: bool = False  # decoded with decode_strict: unknown fields are refused


GROUPS: tuple[Group, ...] = (
    Group(filename="jobspec.schema.json", title="Trainyard job spec",
          description="What a user submits (YAML or JSON): see docs/jobs.md. Unknown fields are refused.",
          types=(JobSpec,), strict=True),
    Group(filename="events.schema.json", title="Trainyard domain events",
          description="Every event type; `type` carries the versioned tag (e.g. JobSubmitted.v1).",
          types=(Event,)),
    Group(filename="envelope.schema.json", title="Trainyard event envelope",
          description="What is stored and published on trainyard.events.<service>.<aggregate>.<EventName>.",
          types=(EventEnvelope,)),
    Group(filename="requests.schema.json", title="Trainyard requests",
          description="Commands and queries sent over NATS request/reply to trainyard.cmd.* and trainyard.query.*.",
          types=(Request,), strict=True),
    Group(filename="replies.schema.json", title="Trainyard replies",
          description="Every reply: the expected type, or Error.v1 (CommandError).",
          types=(Reply,)),
    Group(filename="agent.schema.json", title="Trainyard node agent protocol",
          description="Registration, heartbeats, port, start and stop requests and their replies, process reports "
                      "and log chunks exchanged between node agents and the services.",
          types=(RegisterNode, AnnounceNodes, Heartbeat, ReservePorts, StartProcess, StopProcesses, AgentReply,
                 ProcessReport, LogChunk)),
)


def _cleaned(value: Any) -> Any:
    """`value` with every title and description dedented as `inspect.cleandoc` does: msgspec releases differ
    in whether they keep a docstring's indentation, and the same contracts must give the same schema."""
    if isinstance(value, dict):
        return {key: inspect.cleandoc(item) if key in ("title", "description") and isinstance(item, str)
                else _cleaned(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_cleaned(item) for item in value]
    return value


def group_schema(group: Group) -> dict[str, Any]:
    """The JSON Schema document of one group, with every referenced type under `$defs`."""
    roots, definitions = for_json_schema(_cleaned(msgspec.json.schema_components(group.types,
                                                                                 ref_template="#/$defs/{name}")))
    document: dict[str, Any] = {"$schema": JSON_SCHEMA_DIALECT, "title": group.title,
                                "description": group.description}
    if len(roots) == 1:
        # A struct's root is a `$ref` to its definition; a union's is `anyOf` with a discriminator.
        document.update(roots[0])
    else:
        document["anyOf"] = list(roots)
    if group.strict:
        for definition in definitions.values():
            if definition.get("type") == "object":
                definition["additionalProperties"] = False
    document["$defs"] = definitions
    return document


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """Every file name mapped to its exported text."""
    return {group.filename: render(group_schema(group)) for group in GROUPS}


def export(directory: str | Path) -> list[Path]:
    """Write every group's schema into `directory` (created if missing); return the paths written."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = target / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale(directory: str | Path) -> list[str]:
    """Names of files in `directory` that are missing or differ from a fresh export."""
    target = Path(directory)
    return [name for name, text in render_all().items()
            if not (target / name).is_file() or (target / name).read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.contracts.schema_export",
                                     description="Export the JSON Schemas of Trainyard's contracts.")
    parser.add_argument("directory", type=Path, help="where to write the *.schema.json files")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(args.directory)
        for name in outdated:
            print(f"{args.directory / name} is stale; run `make schemas`", file=sys.stderr)
        return 1 if outdated else 0
    for path in export(args.directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
