"""Bounded inputs: oversized spec fields are refused by their length, before any parsing, with the
field named; whatever passes makes events that fit one NATS message; undecodable requests are refused."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from libs.contracts import jobspec
from libs.contracts.cluster import Flavor
from libs.contracts.events import EventEnvelope, JobSubmitted, LaunchPlanned, Placement
from libs.contracts.jobspec import (
    MAX_COMMAND_LENGTH,
    MAX_ENV_VALUE_LENGTH,
    MAX_LIST_ITEMS,
    MAX_SPEC_BYTES,
    BatchTask,
    DatasetRef,
    JobSpec,
    SpecError,
    decode_spec,
    size_errors,
    validate_spec,
)
from libs.contracts.operations.jobs import SubmitJob
from libs.contracts.strict import decode_strict
from libs.eventstore.store import MAX_EVENT_BYTES
from libs.messaging.responder import error_for_decode_failure
from services.launcher.planner import plan_launch
from tests.support.schedulers import spec

NATS_MAX_PAYLOAD = 1024 * 1024
GPU4 = Flavor(name="gpu-4", cpus=16, memory_mib=65536, accelerators=4, board="A100")


def fields(spec: JobSpec) -> set[str]:
    return {error.field for error in validate_spec(spec)}


def test_a_megabyte_env_value_is_refused_naming_the_variable() -> None:
    refused = fields(spec(env={"BIG": "x" * 1_000_000}))
    assert "env.BIG" in refused
    assert "(document)" in refused  # and the spec as a whole is over its size


def test_a_five_megabyte_command_is_refused_by_its_length_without_parsing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parsing(*_: object, **__: object) -> None:
        raise AssertionError("an over-long command must not be parsed")

    # Neither the lexer nor the character-by-character scan for shell syntax (the costly parts) is reached.
    monkeypatch.setattr(shlex, "shlex", no_parsing)
    monkeypatch.setattr(jobspec, "command_problem", no_parsing)
    monkeypatch.setattr(jobspec, "_unquoted_shell_syntax", no_parsing)
    too_long = spec(command="python3 " + "a" * 5_000_000)
    errors = validate_spec(too_long)
    assert errors == size_errors(too_long)  # refused by its lengths alone, before any other rule
    command_errors = [e for e in errors if e.field == "command"]
    assert command_errors and str(MAX_COMMAND_LENGTH) in command_errors[0].message
    assert sum(len(str(e)) for e in errors) < 2000  # the refusal does not quote the command


def test_a_command_at_the_limit_is_still_checked_and_accepted() -> None:
    assert validate_spec(spec(command="python3 train.py --x " + "a" * (MAX_COMMAND_LENGTH - 30))) == []


@pytest.mark.parametrize(("changes", "field"), [
    ({"tasks": [BatchTask(algorithm=spec().algorithm, command="a" * (MAX_COMMAND_LENGTH + 1))],  # type: ignore[arg-type]
      "type": "batch", "algorithm": None, "command": None}, "tasks[0].command"),
    ({"env": {f"V{i}": "1" for i in range(1000)}}, "env"),
    ({"env": {"A" * 100_000: "1"}}, "env." + "A" * 64 + "…"),
    ({"image": "x" * 10_000}, "image"),
    ({"duration": "1" * 100_000 + "x"}, "duration"),
    ({"datasets": [DatasetRef(name=f"d{i}") for i in range(MAX_LIST_ITEMS + 1)]}, "datasets"),
    ({"nodes": 5000, "mode": "pytorch"}, "nodes"),
])
def test_each_free_form_field_has_a_limit(changes: dict[str, Any], field: str) -> None:
    assert field in fields(spec(**changes))


def test_the_cli_refuses_an_oversized_spec_file_before_parsing_it() -> None:
    document = json.dumps({**msgspec.to_builtins(spec()), "env": {"A": "x" * (3 * MAX_SPEC_BYTES)}})
    with pytest.raises(SpecError) as refused:
        decode_spec(document)
    assert refused.value.errors[0].field == "(document)"
    with pytest.raises(SpecError) as refused:
        decode_spec(json.dumps({**msgspec.to_builtins(spec()), "env": {"BIG": "x" * (MAX_ENV_VALUE_LENGTH + 1)}}))
    assert "env.BIG" in {e.field for e in refused.value.errors}


def largest_accepted(**changes: Any) -> JobSpec:
    """A spec at the limits: the longest command and env values that validate."""
    env = {f"VAR_{i}": "v" * (MAX_ENV_VALUE_LENGTH - 8) for i in range(3)}
    candidate = spec(command="python3 train.py " + "a" * (MAX_COMMAND_LENGTH - 100), env=env, **changes)
    assert validate_spec(candidate) == []
    return candidate


def test_a_job_submitted_at_the_limits_fits_one_event() -> None:
    job = largest_accepted()
    envelope = EventEnvelope(event_id="0" * 36, service="scheduler", aggregate_type="job", aggregate_id="job-1",
                             version=1, position=2**62, recorded_at=datetime.now(UTC),
                             event=JobSubmitted(job_id="job-1", spec=job, creator="alice"))
    assert len(msgspec.json.encode(envelope)) < MAX_EVENT_BYTES < NATS_MAX_PAYLOAD


@pytest.mark.parametrize("mode", ["pytorch", "horovod", "tensorflow", "pytorch-deepspeed"])
def test_the_launch_of_any_accepted_spec_fits_one_event(mode: str) -> None:
    """For the largest node count accepted with a spec at its limits, the launcher's event fits."""
    base = largest_accepted()
    nodes = 1
    while not validate_spec(msgspec.structs.replace(base, mode=mode, nodes=nodes + 1)):
        nodes += 1
    for job in (msgspec.structs.replace(base, mode=mode, nodes=nodes),
                msgspec.structs.replace(spec(), mode=mode, nodes=max_nodes(mode))):
        placement = [Placement(rank=i, node=f"server-node-{i:04}", address=f"10.100.{i // 250}.{i % 250 + 1}",
                               slots=8) for i in range(job.nodes)]
        ports = {place.rank: 29500 + place.rank for place in placement}
        launches = plan_launch(job, GPU4, placement, ports=ports, job_id="job-0123456789ab")
        event = LaunchPlanned(job_id="job-0123456789ab", attempt=1, mode=mode, nodes=launches, ports=ports)
        assert len(msgspec.json.encode(event)) < MAX_EVENT_BYTES


def max_nodes(mode: str) -> int:
    """The most nodes a small spec is accepted with in `mode`."""
    nodes = 1
    while not validate_spec(spec(mode=mode, nodes=nodes + 1)):
        nodes += 1
    assert nodes >= 64  # real multi-node jobs are not refused
    return nodes


@pytest.mark.parametrize("body", [b"[" * 2000 + b"]" * 2000, b'{"type":"SubmitJob.v1","spec":' + b"{\"a\":" * 3000])
def test_deeply_nested_requests_are_a_decode_error_not_a_crash(body: bytes) -> None:
    with pytest.raises(msgspec.DecodeError) as refused:
        decode_strict(body, SubmitJob)
    assert error_for_decode_failure(refused.value).code == "invalid-request"


def test_a_refusal_quoting_a_huge_unknown_field_stays_small() -> None:
    body = json.dumps({"type": "SubmitJob.v1", "job_id": "job-0123456789ab", "spec": msgspec.to_builtins(spec()),
                       "x" * 2_000_000: 1})
    with pytest.raises(msgspec.ValidationError) as refused:
        decode_strict(body, SubmitJob)
    assert len(msgspec.json.encode(error_for_decode_failure(refused.value))) < 10_000
