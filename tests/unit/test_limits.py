"""Bounded inputs: oversized spec fields are refused by their length, before any parsing, with the
field named; whatever passes makes events that fit one NATS message; undecodable requests are refused."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from libs.auth import issue_job_token
from libs.contracts import jobspec
from libs.contracts.agent import StartProcess
from libs.contracts.cluster import Flavor
from libs.contracts.events import EventEnvelope, JobAdmitted, JobSubmitted, LaunchPlanned, Placement
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
from libs.contracts.operations.base import MAX_REQUEST_BYTES
from libs.contracts.operations.jobs import SubmitJob
from libs.contracts.strict import decode_strict
from libs.eventstore.store import MAX_EVENT_BYTES
from libs.messaging.responder import error_for_decode_failure
from services.launcher.planner import NodeLaunches, plan_shape
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


MODES = ["pytorch", "horovod", "tensorflow", "pytorch-deepspeed"]


def placed(nodes: int) -> list[Placement]:
    return [Placement(rank=i, node=f"server-node-{i:05}", address=f"10.100.{i // 250}.{i % 250 + 1}", slots=8)
            for i in range(nodes)]


def planned(job: JobSpec, nodes: int) -> tuple[LaunchPlanned, list[StartProcess]]:
    """The launch event of `job` on `nodes` nodes, and the start request each node is sent."""
    placement = placed(nodes)
    ports = {place.rank: 29500 + place.rank for place in placement}
    shape = plan_shape(job, GPU4, placement, ports=ports, job_id="job-0123456789ab")
    event = LaunchPlanned(job_id="job-0123456789ab", attempt=1, mode=job.mode, shape=shape)
    token = issue_job_token("s" * 32, "job-0123456789ab", 1, [place.node for place in placement])
    starts = [StartProcess(job_id="job-0123456789ab", attempt=1, launch=launch, job_token=token)
              for launch in NodeLaunches.of(event).every()]
    return event, starts


@pytest.mark.parametrize("mode", MODES)
def test_a_job_of_any_size_is_accepted_in_every_mode(mode: str) -> None:
    """Its size does not make a spec invalid: the cluster decides how many nodes a job may have."""
    assert validate_spec(spec(mode=mode, nodes=10_000)) == []
    assert validate_spec(msgspec.structs.replace(largest_accepted(), mode=mode, nodes=10_000)) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_launch_grows_with_the_node_count_not_its_square(mode: str) -> None:
    """The launcher's event, and each node's start request, take no more room per node at 1,024 nodes than at
    64: nothing of one node is held once per peer."""
    small_event, small_starts = planned(spec(mode=mode), 64)
    large_event, large_starts = planned(spec(mode=mode), 1024)
    assert len(msgspec.json.encode(large_event)) / 1024 <= len(msgspec.json.encode(small_event)) / 64
    largest_start = max(len(msgspec.json.encode(start)) for start in large_starts)
    assert largest_start / 1024 <= max(len(msgspec.json.encode(start)) for start in small_starts) / 64


@pytest.mark.parametrize("mode", MODES)
def test_a_launch_of_a_spec_at_its_limits_on_a_thousand_nodes_fits_one_event(mode: str) -> None:
    """The largest spec accepted, on 1,024 nodes: the launcher's event fits one event, each node's start one
    request (and the job's own events, its admission, fit too)."""
    job = msgspec.structs.replace(largest_accepted(), mode=mode, nodes=1024)
    event, starts = planned(job, 1024)
    assert len(msgspec.json.encode(event)) < MAX_EVENT_BYTES
    assert max(len(msgspec.json.encode(start)) for start in starts) < MAX_REQUEST_BYTES
    admitted = JobAdmitted(job_id="job-0123456789ab", attempt=1, flavor="gpu-4", placement=placed(1024))
    assert len(msgspec.json.encode(admitted)) < MAX_EVENT_BYTES


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
