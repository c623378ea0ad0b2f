"""The CLI without a stack (SPEC X6): input checked before connecting, tokens issued locally, and the
rendering of predictions, resources and explanations. Commands that need the services run against a
stand-in client, so what they print is checked without NATS."""

from __future__ import annotations

import re
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from client import cli
from client.api import CreationUnanswered, NoAnswer, TrainyardError
from client.cli.runner import unavailable_hint
from client.preload import NodePreload, preload_states
from libs.auth import verify_token
from libs.contracts.cluster import Flavor, NodeInfo, Resources
from libs.contracts.datacache import CachedImage, CacheEntry, CopyUnderWay, StagingFailed
from libs.contracts.events import (
    DebugEnvironmentKept,
    EventEnvelope,
    InstanceReady,
    InstanceRequested,
    JobPrecheckFailed,
    JobPredicted,
    JobResuming,
    LaunchHost,
    LaunchPlanned,
    LaunchShape,
    LaunchTask,
    PerformanceDegraded,
    PrecheckCompleted,
)
from libs.contracts.health import ComponentHealth, NodeCheck
from libs.contracts.identity import Identity
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import CheckpointResume, DatasetRef, FaultRestart, JobSpec, OutputRef
from libs.contracts.operations.autoscaler import QueueStatus, ScaledInstance, TypeCooldown
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cache import NodeCache, PreloadAccepted
from libs.contracts.operations.cluster import FlavorList, NodeView
from libs.contracts.operations.jobs import (
    SEARCH_JOBS,
    InstanceView,
    JobAccepted,
    JobDetails,
    JobList,
    JobSummary,
    JobView,
    SearchJobs,
    SearchResults,
)
from libs.contracts.scheduling import (
    BoardDemand,
    BoardUsage,
    FlavorInfo,
    FlavorWait,
    NodeResources,
    NodeShortage,
    Prediction,
    StoredAccess,
    WhyReport,
)
from libs.messaging.rpc import ServiceUnavailable
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]  # the fixtures, used by name

SECRET = "a-test-secret-long-enough-for-hmac-sha256-0123456789"
NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)
EXAMPLE_JOB = Path(__file__).resolve().parents[2] / "examples" / "pytorch-ddp.yaml"
SHOWN_JOB = "job-0123456789ab"


# --- clone: --set ------------------------------------------------------------------------------------


def test_set_values_are_yaml() -> None:
    overrides = cli.parse_set_options(["nodes=2", "flavors=[cpu-2, cpu-4]", "priority=urgent",
                                       "env={A: '1'}", "duration="])
    assert overrides == {"nodes": 2, "flavors": ["cpu-2", "cpu-4"], "priority": "urgent", "env": {"A": "1"},
                         "duration": None}


def test_set_keeps_text_for_text_fields() -> None:
    # YAML would read these as a float, an int and a boolean; the fields take text.
    overrides = cli.parse_set_options(["driver_version=535.104", "name=2024", "image=yes"])
    assert overrides == {"driver_version": "535.104", "name": "2024", "image": "yes"}


def test_set_reaches_into_a_field_by_a_dotted_path() -> None:
    overrides = cli.parse_set_options(["checkpoint_resume.max_resumes=5", "env.SEED=7", "output.name=2024",
                                       "checkpoint_resume.elastic.min_nodes=2"])
    # env's values and an output's name are text: kept as typed, as for top-level text fields
    assert overrides == {"checkpoint_resume.max_resumes": 5, "env.SEED": "7", "output.name": "2024",
                         "checkpoint_resume.elastic.min_nodes": 2}


def test_a_later_set_wins_over_an_earlier_one() -> None:
    overrides = cli.parse_set_options(["env.A=1", "env={B: '2'}", "env.C=3", "nodes=2", "nodes=4"])
    # the whole env replaces the path set before it; the path after it adds to it
    assert list(overrides.items()) == [("env", {"B": "2"}), ("env.C", "3"), ("nodes", 4)]


@pytest.mark.parametrize(("item", "expected", "hint"), [
    ("checkpoint_resume.max_resumez=5", "--set checkpoint_resume.max_resumez: checkpoint_resume has no field "
     "'max_resumez'", "did you mean 'max_resumes'?"),
    ("nodes.count=2", "--set nodes.count: nodes holds no fields to set one of", "set the whole of nodes instead"),
    ("tasks.0.command=x", "--set tasks.0.command: tasks holds no fields to set one of", "set the whole of tasks"),
    ("env..A=1", "--set env..A: 'env..A' is not a field or a dotted path to one", "checkpoint_resume.max_resumes"),
])
def test_set_refuses_a_path_the_spec_does_not_have(item: str, expected: str, hint: str) -> None:
    with pytest.raises(cli.OverrideError) as caught:
        cli.parse_set_options([item])
    assert str(caught.value) == expected
    assert hint in caught.value.hint


@pytest.mark.parametrize(("item", "expected"), [
    ("nodes", "is not key=value"),
    ("=2", "is not key=value"),
    ("nodez=2", "no field 'nodez'"),
    ("flavors=[cpu-2", "is not valid YAML"),
])
def test_set_refuses_bad_items(item: str, expected: str) -> None:
    with pytest.raises(cli.OverrideError, match=expected):
        cli.parse_set_options([item])


def test_unknown_field_suggests_the_close_one() -> None:
    with pytest.raises(cli.OverrideError) as caught:
        cli.parse_set_options(["nodez=2"])
    assert "did you mean 'nodes'" in caught.value.hint


def test_clone_refuses_a_path_the_spec_does_not_have_before_connecting(fake: FakeClient) -> None:
    result = invoke("clone", "job-0123456789ab", "--set", "output.nme=x")
    assert result.exit_code == 1
    assert "--set output.nme: output has no field 'nme'" in result.output
    assert "hint: did you mean 'name'?" in result.output
    assert fake.calls == []


def test_clone_sends_file_then_set_then_name(fake: FakeClient, tmp_path: Path) -> None:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("nodes: 4\npriority: urgent\nname: from-file\n")
    fake.answers["clone"] = JobAccepted(job_id="job-00000000000b", status="queued", created=True)
    result = invoke("clone", "job-00000000000a", "-f", str(overrides), "--set", "nodes=2", "--name", "again")
    assert result.exit_code == 0, result.output
    [(method, args, _)] = fake.calls
    assert (method, args) == ("clone", ("job-00000000000a", {"nodes": 2, "priority": "urgent", "name": "again"}))
    assert "cloned job-00000000000a as job-00000000000b: queued" in result.output


def test_clone_chooses_the_new_id_and_says_it_before_sending(fake: FakeClient) -> None:
    fake.answers["clone"] = JobAccepted(job_id="job-00000000000b", status="queued", created=True)
    result = invoke("clone", "job-00000000000a")
    [(_, _, kwargs)] = fake.calls
    assert is_job_id(kwargs["job_id"])
    assert f"cloning job-00000000000a as job {kwargs['job_id']}" in result.stderr


# --- submit ----------------------------------------------------------------------------------------------


def test_submit_chooses_the_id_and_says_it_before_sending(fake: FakeClient) -> None:
    sent: list[str] = []

    async def submit(spec: JobSpec, *, job_id: str, on_retry: Any) -> JobAccepted:
        sent.append(job_id)
        return JobAccepted(job_id=job_id, status="queued", created=True)

    fake.answers["submit"] = submit
    result = invoke("submit", str(EXAMPLE_JOB))
    assert result.exit_code == 0, result.output
    [job_id] = sent
    assert is_job_id(job_id)
    assert f"submitting job {job_id}" in result.stderr
    assert f"submitted {job_id} (pytorch-ddp-demo): queued" in result.stdout


def test_submit_that_nothing_answers_names_the_job_to_look_for(fake: FakeClient) -> None:
    subject = "trainyard.cmd.jobs.submit"
    fake.answers["submit"] = CreationUnanswered(subject, "job-0000000000aa", 3,
                                                NoAnswer(subject, f"nothing answers on {subject}"))
    result = invoke("submit", str(EXAMPLE_JOB))
    assert result.exit_code == 1
    assert "error: nothing answered creating job job-0000000000aa (3 attempts" in result.stderr
    assert "the scheduler does not answer (trainyard.cmd.jobs.submit)" in result.stderr
    assert "`trainyard show job-0000000000aa` tells" in result.stderr


def submitted_specs(fake: FakeClient) -> list[JobSpec]:
    sent: list[JobSpec] = []

    async def submit(spec: JobSpec, *, job_id: str, on_retry: Any) -> JobAccepted:
        sent.append(spec)
        return JobAccepted(job_id=job_id, status="queued", created=True)

    fake.answers["submit"] = submit
    return sent


def test_submit_set_replaces_fields_of_the_file_in_order(fake: FakeClient) -> None:
    sent = submitted_specs(fake)
    result = invoke("submit", str(EXAMPLE_JOB), "--set", "nodes=4", "--set", "env.SEED=7", "--set", "env.LR=0.1",
                    "--set", "output.name=2026", "--set", "duration=2h", "--set", "duration=1h")
    assert result.exit_code == 0, result.output
    [spec] = sent
    assert (spec.name, spec.nodes, spec.env, spec.duration) == ("pytorch-ddp-demo", 4, {"SEED": "7", "LR": "0.1"}, "1h")
    assert spec.output is not None and spec.output.name == "2026"
    assert spec.command is not None and spec.command.startswith("python3 train.py")  # the file's other fields


def test_submit_set_may_fill_in_what_the_file_leaves_out(fake: FakeClient, tmp_path: Path) -> None:
    sent = submitted_specs(fake)
    template = tmp_path / "template.yaml"
    template.write_text(EXAMPLE_JOB.read_text().replace("output: {name: pytorch-ddp-demo}\n", ""))
    assert "output:" not in template.read_text()
    result = invoke("submit", str(template), "--set", "output.name=mine")
    assert result.exit_code == 0, result.output
    assert [spec.output for spec in sent] == [OutputRef(name="mine")]


def test_submit_refuses_what_its_set_options_make_invalid_before_sending(fake: FakeClient) -> None:
    result = invoke("submit", str(EXAMPLE_JOB), "--set", "nodes=0")
    assert result.exit_code == 1
    assert "nodes: Expected `int` >= 1" in result.output
    assert f"error: {EXAMPLE_JOB} with its --set options is not a valid job spec; nothing was submitted" in (
        result.output)
    result = invoke("submit", str(EXAMPLE_JOB), "--set", "output.nme=x")
    assert result.exit_code == 1
    assert "--set output.nme: output has no field 'nme'" in result.output
    assert fake.calls == []


def test_overrides_file_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "overrides.yaml"
    path.write_text("- nodes\n")
    with pytest.raises(cli.OverrideError, match="not a mapping"):
        cli.read_overrides_file(path)


# --- admin token -----------------------------------------------------------------------------------------


def test_admin_token_is_accepted_with_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    result = invoke("admin", "token", "alice", "--project", "vision", "-p", "nlp", "--admin", "--ttl", "2d")
    assert result.exit_code == 0, result.output
    identity = verify_token(SECRET, result.stdout.strip())
    assert identity == Identity(user="alice", projects=["vision", "nlp"], admin=True)


def test_admin_token_to_a_private_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    path = tmp_path / "token"
    result = invoke("admin", "token", "bob", "-o", str(path))
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert verify_token(SECRET, path.read_text().strip()) == Identity(user="bob")
    assert f"TRAINYARD_TOKEN_FILE={path}" in result.output


def test_admin_token_reads_the_local_stacks_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "stack.env").write_text(f"export TRAINYARD_AUTH_SECRET_FILE={secret_file}\n")
    result = invoke("admin", "token", "carol", "-p", "vision")
    assert result.exit_code == 0, result.output
    assert verify_token(SECRET, result.stdout.strip()) == Identity(user="carol", projects=["vision"])


def test_admin_token_without_a_secret_says_where_to_set_it() -> None:
    result = invoke("admin", "token", "alice")
    assert result.exit_code == 1
    assert "error: no signing secret" in result.output
    assert "TRAINYARD_AUTH_SECRET" in result.output
    assert result.stdout == ""


@pytest.mark.parametrize(("args", "expected"), [
    (["--ttl", "3w"], "is not a duration"),
    (["-p", "no spaces"], "invalid project name"),
])
def test_admin_token_refuses_bad_options(monkeypatch: pytest.MonkeyPatch, args: list[str], expected: str) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    result = invoke("admin", "token", "alice", *args)
    assert result.exit_code == 1
    assert expected in result.output


# --- errors ----------------------------------------------------------------------------------------------


def test_unauthenticated_hints_at_tokens(fake: FakeClient) -> None:
    fake.answers["whoami"] = TrainyardError(CommandError(code="unauthenticated", message="the token has expired"))
    result = invoke("whoami")
    assert result.exit_code == 1
    assert "error: the token has expired" in result.output
    assert "TRAINYARD_TOKEN (or TRAINYARD_TOKEN_FILE)" in result.output
    assert "`trainyard admin token`" in result.output


@pytest.mark.parametrize(("subject", "service", "args", "method"), [
    ("trainyard.query.jobs.list", "scheduler", ["list"], "listing"),
    ("trainyard.query.autoscaler.status", "autoscaler", ["queue"], "queue_status"),
    ("trainyard.cmd.nodes.mark", "monitor", ["admin", "fault", "node-a", "board:0"], "mark_component"),
])
def test_no_answer_names_the_service_that_does_not_answer(fake: FakeClient, subject: str, service: str,
                                                          args: list[str], method: str) -> None:
    fake.answers[method] = NoAnswer(subject, f"nothing answers on {subject}")
    result = invoke(*args)
    assert result.exit_code == 1
    assert f"error: nothing answers on {subject}" in result.stderr
    assert f"the {service} does not answer ({subject}): `make status` shows whether it runs" in result.stderr
    assert f"{service}.log" in result.stderr
    assert "make up" not in result.stderr


def test_queue_lists_the_autoscalers_instances(fake: FakeClient) -> None:
    fake.answers["queue_status"] = QueueStatus(queued_jobs=1, queued_by_flavor={"cpu-1": 1}, running_jobs=1, instances=[
        ScaledInstance(name="small-3f2a9c", instance_type="small", provider="local", state="booting", since=NOW,
                       jobs=["job-q"], provider_id="local-4242"),
        ScaledInstance(name="small-77aa01", instance_type="small", provider="local", state="ready", since=NOW,
                       jobs=["job-p"], busy=True)])
    result = invoke("queue")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert ["cpu-1:", "1", "queued"] in rows
    since = cli._time(NOW).split()
    assert ["small-3f2a9c", "small", "local", "booting", *since, "no", "job-q"] in rows
    assert ["small-77aa01", "small", "local", "ready", *since, "yes", "job-p"] in rows


def test_the_autoscaler_overview_counts_idle_busy_and_coming_instances_and_cooldowns(fake: FakeClient) -> None:
    fake.answers["queue_status"] = QueueStatus(
        queued_jobs=2, queued_by_flavor={"gpu-1": 2}, running_jobs=1,
        instances=[ScaledInstance(name="gpu-aa", instance_type="gpu", provider="aws-ec2", state="ready", since=NOW,
                                  jobs=[], busy=True),
                   ScaledInstance(name="gpu-bb", instance_type="gpu", provider="aws-ec2", state="ready", since=NOW,
                                  jobs=[]),
                   ScaledInstance(name="gpu-cc", instance_type="gpu", provider="aws-ec2", state="booting",
                                  since=datetime.now(UTC) - timedelta(seconds=42), jobs=["job-q"])],
        cooldowns=[TypeCooldown(instance_type="gpu-spot", until=NOW, failures=2)])
    result = invoke("autoscaler")
    assert result.exit_code == 0, result.output
    assert "instances: 1 idle, 1 busy, 1 on their way, 0 draining" in result.output
    assert "gpu-1: 2 queued" in result.output
    assert re.search(r"on its way: gpu-cc \(gpu, booting\) for 4[23]s", result.output)
    assert f"cooling down: gpu-spot until {cli._time(NOW)} after 2 failure(s)" in result.output


def test_the_autoscaler_log_lists_its_events(fake: FakeClient) -> None:
    entries = [EventEnvelope(event_id="a1", service="autoscaler", aggregate_type="instance", aggregate_id="gpu-cc",
                             version=1, position=1, recorded_at=NOW,
                             event=InstanceRequested(instance="gpu-cc", instance_type="gpu", provider="aws-ec2",
                                                     jobs=["job-q"])),
               EventEnvelope(event_id="a2", service="autoscaler", aggregate_type="instance", aggregate_id="gpu-cc",
                             version=2, position=2, recorded_at=NOW,
                             event=InstanceReady(instance="gpu-cc", node="gpu-cc"))]

    async def log(*, follow: bool = False) -> AsyncIterator[EventEnvelope]:
        for entry in entries:
            yield entry

    fake.autoscaler_log = log  # type: ignore[attr-defined]
    result = invoke("autoscaler", "log")
    assert result.exit_code == 0, result.output
    rows = [line.split()[2:] for line in result.output.splitlines()]  # after the date and time
    assert ["InstanceRequested", "gpu-cc", "instance_type=gpu", "provider=aws-ec2", "jobs=job-q"] in rows
    assert ["InstanceReady", "gpu-cc", "node=gpu-cc"] in rows


def test_no_answer_behind_another_error_still_names_the_service() -> None:
    try:
        try:
            raise NoAnswer("trainyard.query.alerts", "nothing answers on trainyard.query.alerts")
        except NoAnswer as exc:
            raise ServiceUnavailable(f"the monitor answers alerts, and it did not: {exc}") from None
    except ServiceUnavailable as wrapped:
        hint = unavailable_hint(wrapped)
    assert hint.startswith("the monitor does not answer (trainyard.query.alerts)")


def test_unreachable_nats_keeps_the_stack_hint(fake: FakeClient) -> None:
    fake.answers["listing"] = ServiceUnavailable("cannot connect to NATS at nats://127.0.0.1:1 (refused)")
    result = invoke("list")
    assert result.exit_code == 1
    assert "is the stack running? start it with `make up`, or set NATS_URL" in result.stderr


def test_error_hint_prefers_the_service_then_the_code() -> None:
    assert cli.error_hint(CommandError(code="over-cap", message="m", hint="their hint")) == "their hint"
    assert "trainyard priority" in (cli.error_hint(CommandError(code="over-cap", message="m")) or "")


@pytest.mark.parametrize("args", [["priority", "job-x", "asap"], ["duration", "job-x", "4 hours"],
                                  ["admin", "settings", "--sharing", "maybe"], ["resources"],
                                  ["search", "--status", "done"]])
def test_bad_input_is_refused_before_connecting(fake: FakeClient, args: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 1
    assert "hint:" in result.output
    assert fake.calls == []


# --- search ------------------------------------------------------------------------------------------------


def _summary(job_id: str) -> JobSummary:
    return JobSummary(job_id=job_id, name="bert", project="default", creator="alice", status="running",
                      priority="normal", mode="pytorch", flavors=["gpu-4"], flavor="gpu-4", submitted_at=NOW, nodes=2,
                      master="gpu-node-1")


def test_search_says_which_part_of_how_many_it_lists(fake: FakeClient) -> None:
    fake.answers["ask"] = SearchResults(jobs=[_summary("job-0000000000c9"), _summary("job-0000000000c8")], total=1234)
    result = invoke("search", "--name", "bert", "--limit", "2", "--offset", "200")
    assert result.exit_code == 0, result.output
    (name, (operation, request), _), = fake.calls
    assert (name, operation, request) == ("ask", SEARCH_JOBS, SearchJobs(name="bert", limit=2, offset=200))
    assert "job-0000000000c9" in result.stdout and "job-0000000000c8" in result.stdout
    assert "2 of 1234 jobs, after the first 200" in result.stderr


def test_search_past_the_last_page_tells_how_many_there_are(fake: FakeClient) -> None:
    fake.answers["ask"] = SearchResults(jobs=[], total=5)
    result = invoke("search", "--offset", "10")
    assert result.exit_code == 0, result.output
    assert "0 of 5 jobs, after the first 10" in result.stderr
    fake.answers["ask"] = SearchResults(jobs=[], total=0)
    assert "no jobs match" in invoke("search", "--offset", "10").stdout


def test_search_as_json_prints_the_jobs_with_their_node_columns(fake: FakeClient) -> None:
    fake.answers["ask"] = SearchResults(jobs=[_summary("job-0000000000c9")], total=1234)
    result = invoke("search", "--json")
    assert result.exit_code == 0, result.output
    printed, = msgspec.json.decode(result.stdout)
    assert (printed["job_id"], printed["nodes"], printed["master"]) == ("job-0000000000c9", 2, "gpu-node-1")


@pytest.mark.parametrize("args", [["--limit", "1001"], ["--limit", "0"], ["--offset", "-1"], ["--offset", "1000001"]])
def test_search_pages_out_of_bounds_are_refused_before_connecting(fake: FakeClient, args: list[str]) -> None:
    result = invoke("search", *args)
    assert result.exit_code == 2
    assert args[0] in result.output
    assert fake.calls == []


def test_duration_none_removes_the_limit(fake: FakeClient) -> None:
    fake.answers["change_duration"] = Done(job_ids=["job-x"], message="")
    result = invoke("duration", "job-x", "none")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("change_duration", ("job-x", None), {})]
    assert "job-x: duration limit removed" in result.output


# --- predict -----------------------------------------------------------------------------------------------


def test_prediction_starts_now() -> None:
    prediction = Prediction(starts_now=True, flavor="cpu-4", nodes=["n1", "n2"], node_count=2, predicted_at=NOW)
    assert cli.prediction_sentence(prediction, now=NOW) == "starts now with flavor cpu-4 on n1, n2"
    assert cli.prediction_sentence(prediction, now=NOW, requested_nodes=4).endswith("(2 of 4 nodes: elastic)")


def test_prediction_queues_with_an_estimate() -> None:
    prediction = Prediction(starts_now=False, position=3, jobs_ahead=2, predicted_at=NOW,
                            estimated_start=NOW + timedelta(minutes=25))
    assert (cli.prediction_sentence(prediction, now=NOW)
            == "queues at position 3 behind 2 jobs; estimated start 14:05 UTC (in 25 min)")


def test_prediction_queues_without_an_estimate() -> None:
    prediction = Prediction(starts_now=False, position=1, jobs_ahead=0, predicted_at=NOW,
                            reason="it waits for job-a, which has no duration limit")
    assert (cli.prediction_sentence(prediction, now=NOW)
            == "queues at position 1 behind 0 jobs; estimated start unknown: it waits for job-a, which has no "
               "duration limit")


def test_estimates_on_another_day_carry_the_date() -> None:
    later = NOW + timedelta(days=1, hours=2, minutes=10)
    assert cli.clock_time(later, NOW) == "2026-11-22 15:50 UTC"
    assert cli.relative_time(later, NOW) == "in 1 d 2 h"
    assert cli.relative_time(NOW + timedelta(hours=2, minutes=5), NOW) == "in 2 h 5 min"
    assert cli.relative_time(NOW - timedelta(minutes=1), NOW) == "any moment now"


def test_predict_command_prints_the_sentence(fake: FakeClient, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: demo\ncommand: python3 train.py\nalgorithm: {name: code}\noutput: {name: out}\n"
                    "flavors: [cpu-2]\n")
    fake.answers["predict"] = Prediction(starts_now=True, flavor="cpu-2", nodes=["node-a"], node_count=1,
                                         predicted_at=NOW)
    result = invoke("predict", "-f", str(spec))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "starts now with flavor cpu-2 on node-a"


# --- resources, flavors, why, events ------------------------------------------------------------------------


def gpu_node() -> NodeResources:
    return NodeResources(name="gpu-1", status={"gpu-2": "idle", "gpu-4": "tight"}, os="Ubuntu 22.04",
                         kernel="5.15.0", cpus_used=12, cpus_total=32, memory_mib_used=49152,
                         memory_mib_total=262144, accelerators_used=3, accelerators_total=8, board="A100",
                         driver_version="535.104", flavors=["gpu-1", "gpu-2", "gpu-4"],
                         usage=[BoardUsage(physical=2, virtual=2, application="train-a", job_id="job-a"),
                                BoardUsage(physical=1, virtual=1, application="eval-b", job_id="job-b")])


def test_resource_row() -> None:
    assert cli.resource_row(gpu_node()) == [
        "gpu-1", "gpu-2: idle, gpu-4: tight", "Ubuntu 22.04 / 5.15.0", "48.0/256.0", "12/32", "3/8 A100", "535.104",
        "gpu-1, gpu-2, gpu-4", "2(2):train-a 1(1):eval-b"]


def test_resource_row_of_a_cpu_node() -> None:
    node = NodeResources(name="node-a", status={"cpu-2": "idle"}, os="Debian 12", kernel="6.1", cpus_used=0.5,
                         cpus_total=4, memory_mib_used=0, memory_mib_total=8192, accelerators_used=0,
                         accelerators_total=0)
    assert cli.resource_row(node)[3:] == ["0.0/8.0", "0.5/4", "-", "-", "-", "-"]


def test_resources_command_table(fake: FakeClient) -> None:
    fake.answers["resources"] = [gpu_node()]
    result = invoke("resources", "--flavor", "gpu-2", "--flavor", "gpu-4")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("resources", (["gpu-2", "gpu-4"],), {})]
    assert "2(2):train-a 1(1):eval-b" in result.output
    assert "gpu-2: idle, gpu-4: tight" in result.output


def test_flavors_command_shows_flavors_and_demand(fake: FakeClient) -> None:
    fake.answers["flavors"] = FlavorList(
        flavors=[FlavorInfo(flavor=Flavor(name="gpu-4", cpus=16, memory_mib=65536, accelerators=4, board="A100"),
                            schedulable_nodes=2)],
        demand=[BoardDemand(board="A100", boards_needed=12, queued_jobs=3)])
    result = invoke("flavors", "--board", "A100")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("flavors", ("A100",), {})]
    lines = [line.split() for line in result.output.splitlines()]
    assert ["gpu-4", "16", "64.0", "4", "A100", "2"] in lines
    assert ["A100", "12", "3"] in lines


def test_why_prints_the_summary_and_shortages(fake: FakeClient) -> None:
    wait = FlavorWait(flavor="cpu-4", eligible_nodes=3, fitting_nodes=1, needed_nodes=2,
                      shortages=[NodeShortage(node="node-b", missing=["cpus: 2 free, 4 needed"], held_by=["job-a"])])
    fake.answers["why"] = WhyReport(job_id="job-q", status="queued", position=2, jobs_ahead=["job-p"],
                                    jobs_ahead_count=1, flavors=[wait],
                                    summary=["job-q is second in line, behind job-p."])
    result = invoke("why", "job-q")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("job-q is second in line, behind job-p.\n")
    assert "flavor cpu-4: 1 of 3 eligible nodes fit one rank now, 2 needed" in result.output
    assert ["node-b", "cpus:", "2", "free,", "4", "needed", "job-a"] in [line.split()
                                                                       for line in result.output.splitlines()]


def test_why_without_a_summary_builds_one() -> None:
    report = WhyReport(job_id="job-q", status="queued", position=4, jobs_ahead=["job-a", "job-b"],
                       jobs_ahead_count=3)
    assert cli.why_lines(report) == ["job-q is at position 4, behind 3 jobs: job-a, job-b and 1 more"]


def test_events_come_from_the_history_and_show_predictions(fake: FakeClient) -> None:
    prediction = Prediction(starts_now=False, position=2, jobs_ahead=1, predicted_at=NOW,
                            estimated_start=NOW + timedelta(minutes=10))
    fake.answers["history"] = [EventEnvelope(
        event_id="e1", service="scheduler", aggregate_type="job", aggregate_id="job-q", version=2, position=7,
        recorded_at=NOW, event=JobPredicted(job_id="job-q", prediction=prediction))]
    result = invoke("events", "job-q")
    assert result.exit_code == 0, result.output
    assert "JobPredicted" in result.output
    assert "prediction=queues at position 2 behind 1 job; estimated start 13:50 UTC (in 10 min)" in result.output


def envelope_of(event: Any, position: int = 1) -> EventEnvelope:
    return EventEnvelope(event_id=f"e{position}", service="monitor", aggregate_type="job", aggregate_id="job-r",
                         version=position, position=position, recorded_at=NOW, event=event)


def test_events_show_prechecks_resumes_and_kept_environments(fake: FakeClient) -> None:
    failed = NodeCheck(node="node-b", passed=False,
                       checks=[ComponentHealth(kind="board", name="0", healthy=False, detail="xid 79")])
    passed = NodeCheck(node="node-a", passed=True, checks=[])
    fake.answers["history"] = [
        envelope_of(PrecheckCompleted(job_id="job-r", attempt=1, passed=False, nodes=[passed, failed]), 1),
        envelope_of(JobPrecheckFailed(job_id="job-r", attempt=1, reason="board:0 faulty", nodes=["node-b"]), 2),
        envelope_of(JobResuming(job_id="job-r", attempt=2, reason="node-c is unhealthy",
                                exclude_nodes=["node-c", "node-d"]), 3),
        envelope_of(PerformanceDegraded(job_id="job-r", attempt=2, node="node-a", rank=0, ratio=0.6634521,
                                        threshold=0.7, direction="below", window=10, action="alert"), 4),
        envelope_of(DebugEnvironmentKept(job_id="job-r", attempt=2, nodes=["node-a"],
                                         until=datetime(2026, 11, 21, 18, 0, tzinfo=UTC)), 5),
    ]
    result = invoke("events", "job-r")
    assert result.exit_code == 0, result.output
    assert "nodes=node-a passed; node-b failed (board:0 faulty (xid 79))" in result.output
    assert "reason=board:0 faulty nodes=node-b" in result.output
    assert "exclude_nodes=node-c, node-d" in result.output
    assert "ratio=0.6635 threshold=0.7" in result.output
    assert f"nodes=node-a until={cli._time(datetime(2026, 11, 21, 18, 0, tzinfo=UTC))}" in result.output


def test_events_show_the_ports_a_launch_listens_on(fake: FakeClient) -> None:
    shape = LaunchShape(hosts=[LaunchHost("node-a", "10.0.0.1", 1, "worker", 30211),
                               LaunchHost("node-b", "10.0.0.2", 1, "worker", 30212)],
                        slots=1, env={}, tasks=[LaunchTask(command="python3 train.py", mounts=[])])
    fake.answers["history"] = [envelope_of(LaunchPlanned(job_id="job-r", attempt=2, mode="tensorflow", shape=shape)),
                               envelope_of(LaunchPlanned(job_id="job-r", attempt=1, mode="tensorflow", nodes=[],
                                                         ports={1: 30212, 0: 30211}))]
    result = invoke("events", "job-r")
    assert result.exit_code == 0, result.output
    assert "attempt=2 mode=tensorflow ports=0:30211, 1:30212 ranks=2" in result.output
    assert "attempt=1 mode=tensorflow ports=0:30211, 1:30212" in result.output  # a plan recorded before shapes
    assert "base_port" not in result.output and "hosts" not in result.output


# --- show and nodes: faults, resumes, kept environments ------------------------------------------------------


def details(**fields: Any) -> JobDetails:
    spec_fields = {key: fields.pop(key) for key in ("checkpoint_resume", "fault_restart") if key in fields}
    job = JobView(job_id=SHOWN_JOB, name="resnet", project="vision", creator="alice", status="failed",
                  priority="normal", mode="pytorch", nodes=2, flavors=["gpu-4"], submitted_at=NOW, **fields)
    return JobDetails(job=job, spec=JobSpec(name="resnet", pool="dedicated", **spec_fields))


def show_rows(result: Any) -> dict[str, str]:
    return {key: value.strip() for key, _, value in
            (line.strip().partition("  ") for line in result.stdout.splitlines()) if key}


def test_show_counts_resumes_against_their_maximum(fake: FakeClient) -> None:
    fake.answers["get_job"] = details(resumes=1, max_resumes=3, excluded_nodes=["node-b", "node-c"],
                                      checkpoint_resume=CheckpointResume(max_resumes=5))
    fake.answers["usage"] = []
    result = invoke("show", SHOWN_JOB)
    assert result.exit_code == 0, result.output
    rows = show_rows(result)
    assert rows["resumes"] == "1 of 3"  # the effective maximum, within the administrator's cap
    assert rows["excluded nodes"] == "node-b, node-c"
    assert "restarts" not in rows


def test_show_counts_restarts_and_says_how_long_the_environment_is_kept(fake: FakeClient) -> None:
    kept_until = datetime.now(UTC) + timedelta(hours=4)
    fake.answers["get_job"] = details(restarts=2, fault_restart=FaultRestart(max_restarts=5), kept_until=kept_until)
    fake.answers["usage"] = []
    result = invoke("show", SHOWN_JOB)
    assert result.exit_code == 0, result.output
    rows = show_rows(result)
    assert rows["restarts"] == "2 of 5"
    assert rows["environment"] == (f"kept for the debug terminal until {cli._time(kept_until)}; "
                                   f"`trainyard exec {SHOWN_JOB}` opens a shell in it")
    assert "resumes" not in rows


def test_show_names_the_image_a_job_runs_in_and_no_image_when_it_has_none(fake: FakeClient) -> None:
    fake.answers["get_job"] = details(image="team/torch:2.13@sha256:" + "5a2e07c4bd31" + "0" * 52)
    fake.answers["usage"] = []
    result = invoke("show", SHOWN_JOB)
    assert result.exit_code == 0, result.output
    assert show_rows(result)["image"] == "team/torch:2.13 (5a2e07c4bd31)"
    fake.answers["get_job"] = details()
    assert "image" not in show_rows(invoke("show", SHOWN_JOB))


def test_show_leaves_out_an_environment_no_longer_kept(fake: FakeClient) -> None:
    fake.answers["get_job"] = details(kept_until=datetime.now(UTC) - timedelta(minutes=1))
    fake.answers["usage"] = []
    result = invoke("show", SHOWN_JOB)
    assert result.exit_code == 0, result.output
    assert "environment" not in show_rows(result)


def test_nodes_show_why_a_node_is_unhealthy(fake: FakeClient) -> None:
    def node(name: str, status: Any, problems: list[str]) -> NodeView:
        return NodeView(info=NodeInfo(name=name, address="10.0.0.1", os="Debian 12", kernel="6.1", cpus=4,
                                      memory_mib=8192),
                        status=status, used=Resources(), problems=problems)

    fake.answers["nodes"] = [node("node-a", "ready", []),
                             node("node-b", "unhealthy", ["board:0 faulty (xid 79)", "nic:eth0 faulty (down)"])]
    result = invoke("nodes")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[-1] == "PROBLEMS"
    assert lines[1].split()[:2] == ["node-a", "ready"] and lines[1].split()[-1] == "-"
    assert lines[2].split()[:2] == ["node-b", "unhealthy"]
    assert lines[2].rstrip().endswith("board:0 faulty (xid 79); nic:eth0 faulty (down)")


# --- admin fault ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["gpu0", "board", "disk:sda", "board:", "nic:eth 0"])
def test_admin_fault_refuses_a_bad_component_before_connecting(fake: FakeClient, component: str) -> None:
    result = invoke("admin", "fault", "node-a", component)
    assert result.exit_code == 1
    assert f"error: {component!r} is not a component name" in result.output
    assert "e.g. board:0, nic:eth0 or runtime:storage" in result.output
    assert fake.calls == []


def test_admin_fault_marks_and_clears(fake: FakeClient) -> None:
    fake.answers["mark_component"] = Done(job_ids=[], message="")
    marked = invoke("admin", "fault", "node-a", "board:0", "--reason", "drill")
    cleared = invoke("admin", "fault", "node-a", "board:0", "--clear")
    assert marked.exit_code == 0 and cleared.exit_code == 0, marked.output + cleared.output
    assert fake.calls == [("mark_component", ("node-a", "board:0"), {"faulty": True, "reason": "drill"}),
                          ("mark_component", ("node-a", "board:0"), {"faulty": False, "reason": ""})]
    assert "board:0 marked faulty; clear it with `trainyard admin fault node-a board:0 --clear`" in marked.output
    assert "node-a: cleared the mark on board:0" in cleared.output


def test_admin_fault_refused_for_a_non_administrator(fake: FakeClient) -> None:
    fake.answers["mark_component"] = TrainyardError(CommandError(code="forbidden",
                                                                 message="only administrators mark components"))
    result = invoke("admin", "fault", "node-a", "nic:eth0")
    assert result.exit_code == 1
    assert "error: only administrators mark components" in result.output


# --- admin token --email, exec's arguments ----------------------------------------------------------------------


def test_admin_token_carries_the_email(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    result = invoke("admin", "token", "alice", "-p", "vision", "--email", "alice@example.com")
    assert result.exit_code == 0, result.output
    assert verify_token(SECRET, result.stdout.strip()) == Identity(user="alice", projects=["vision"],
                                                                    email="alice@example.com")
    assert "alice <alice@example.com>" in result.output


def test_admin_token_refuses_what_is_not_an_email(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    result = invoke("admin", "token", "alice", "--email", "alice at example")
    assert result.exit_code == 1
    assert "'alice at example' is not an email address" in result.output
    assert result.stdout == ""


def test_whoami_shows_the_email(fake: FakeClient) -> None:
    fake.answers["whoami"] = Identity(user="alice", email="alice@example.com")
    result = invoke("whoami")
    assert ["email", "alice@example.com"] in [line.split() for line in result.output.splitlines()]


def test_exec_refuses_an_empty_command_before_connecting(fake: FakeClient) -> None:
    result = invoke("exec", "job-r", "--", " ")
    assert result.exit_code == 1
    assert "error: the command is empty" in result.output
    assert fake.calls == []


# --- storage: owners of shared storage's resources (J2) ---------------------------------------------------------


@pytest.mark.parametrize("args", [["storage", "access", "notebook", "x", "--others", "none"],
                                  ["storage", "access", "dataset", "x", "--others", "everyone"],
                                  ["storage", "list", "--kind", "notebook"]])
def test_storage_refuses_bad_kinds_and_levels_before_connecting(fake: FakeClient, args: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 1
    assert "hint:" in result.output
    assert fake.calls == []


def test_storage_access_registers_and_lists_as_a_table(fake: FakeClient) -> None:
    entry = StoredAccess(kind="dataset", name="imgs", owner="bob", project="vision", others="read-only")
    fake.answers["set_storage_access"] = entry
    fake.answers["storage_access"] = [entry]
    registered = invoke("storage", "access", "dataset", "imgs", "--others", "read-only", "--project", "vision")
    listed = invoke("storage", "list")
    assert registered.exit_code == 0 and listed.exit_code == 0, registered.output + listed.output
    assert fake.calls == [("set_storage_access", ("dataset", "imgs"),
                           {"project": "vision", "others": "read-only", "owner": None}),
                          ("storage_access", (None,), {})]
    header, row = listed.output.splitlines()
    assert header.split() == ["KIND", "NAME", "OWNER", "PROJECT", "OTHERS"]
    assert row.split() == ["dataset", "imgs", "bob", "vision", "read-only"]


def test_storage_list_says_unregistered_storage_is_open(fake: FakeClient) -> None:
    fake.answers["storage_access"] = []
    assert "open to everyone" in invoke("storage", "list").output


def test_cache_lists_each_nodes_entries_with_size_last_use_and_the_jobs_using_them(fake: FakeClient) -> None:
    entry = CacheEntry(key="0123456789abcdef01234567", source="datasets/imgs/v1", bytes=3 * 2**20, files=12,
                       staged_at=NOW, last_used=NOW, pins=["job-0123456789ab/1/0/0", "job-0123456789ab/1/0/1"])
    fake.answers["cache"] = [NodeCache(node="node-a", reported_at=NOW, entries=[entry], disk_bytes=100 * 2**30,
                                       used_bytes=42 * 2**30)]
    result = invoke("cache", "--node", "node-a")
    assert result.exit_code == 0, result.output
    assert fake.calls[-1] == ("cache", ("node-a",), {})
    assert "node-a: 1 entry, 3.0 MiB, disk 42% full of 100 GiB" in result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert any(row[:5] == ["node-a", "datasets/imgs/v1", "0123456789ab", "3.0", "12"] and row[-1] == "job-0123456789ab"
               for row in rows), result.output


def test_cache_lists_each_nodes_unpacked_images_and_says_when_a_nodes_entries_are_cut_short(
        fake: FakeClient) -> None:
    entry = CacheEntry(key="0123456789abcdef01234567", source="datasets/imgs/v1", bytes=2**20, files=1,
                       staged_at=NOW, last_used=NOW)
    image = CachedImage(key="5a2e07c4bd31" + "0" * 12, digest="sha256:5a2e07c4bd31" + "0" * 52, ref="team/torch:2.13",
                        format="oci-archive", bytes=1536 * 2**20, unpacked_at=NOW, last_used=NOW,
                        pins=["job-0123456789ab/1/0/0", "job-0123456789ab/1/0/1"])
    older = msgspec.structs.replace(image, key="6" * 24, digest="sha256:" + "6" * 64, ref="", pins=[])
    fake.answers["cache"] = [NodeCache(node="node-a", reported_at=NOW, entries=[entry], complete=False,
                                       total_entries=7342, images=[image]),
                             NodeCache(node="node-b", reported_at=NOW, entries=[], images=[older])]
    result = invoke("cache")
    assert result.exit_code == 0, result.output
    assert "node-a holds 7342 entries: only its 1 most recently used are listed" in result.output
    assert "node-b holds" not in result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert ["NODE", "IMAGE", "DIGEST", "FORMAT", "SIZE", "(MiB)", "UNPACKED", "LAST", "USE", "USED", "BY"] in rows
    assert any(row[:5] == ["node-a", "team/torch:2.13", "5a2e07c4bd31", "oci-archive", "1536.0"]
               and row[-1] == "job-0123456789ab" for row in rows), result.output
    assert any(row[:4] == ["node-b", "-", "666666666666", "oci-archive"] and row[-1] == "-" for row in rows)


def test_cache_says_so_when_no_node_reported_one(fake: FakeClient) -> None:
    fake.answers["cache"] = []
    result = invoke("cache")
    assert result.exit_code == 0 and "no node has reported a dataset cache yet" in result.output


def test_cache_preload_shows_each_nodes_progress_until_done_and_fails_with_the_reason(fake: FakeClient) -> None:
    accepted = PreloadAccepted(preload_id="preload-0123456789ab", source="datasets/imgs/v1", nodes=["node-a", "node-b"])
    fake.answers["preload"] = accepted

    async def progress(given: PreloadAccepted, since: datetime) -> AsyncIterator[list[NodePreload]]:
        assert given == accepted and since <= datetime.now(UTC)
        yield [NodePreload("node-a", "copying", 2 * 2**20, 4 * 2**20), NodePreload("node-b", "waiting")]
        yield [NodePreload("node-a", "done", 4 * 2**20, 4 * 2**20),
               NodePreload("node-b", "failed", reason="datasets/imgs/v1 changed in shared storage while it was copied")]

    fake.preload_progress = progress  # type: ignore[attr-defined]
    result = invoke("cache", "preload", "imgs:v1", "--node", "node-a", "--nodes", "node-b")
    assert fake.calls[0] == ("preload", ("imgs", "v1"), {"nodes": ["node-a", "node-b"], "flavor": None})
    assert "node-a: copying 2.0/4.0 MiB" in result.output and "node-a: done 4.0/4.0 MiB" in result.output
    assert result.exit_code == 1
    assert "node-b: datasets/imgs/v1 changed in shared storage while it was copied" in result.output


def test_cache_preload_refuses_a_malformed_dataset_before_connecting(fake: FakeClient) -> None:
    result = invoke("cache", "preload", "imgs:", "--node", "node-a")
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "'imgs:' is not DATASET or DATASET:VERSION" in words
    assert fake.calls == []


def test_preload_states_read_each_node_from_its_latest_report() -> None:
    since = NOW - timedelta(seconds=1)
    old = CacheEntry(key="0" * 24, source="datasets/imgs", bytes=9, files=1, staged_at=NOW - timedelta(days=1),
                     last_used=NOW - timedelta(days=1))
    caches = [NodeCache(node="a", reported_at=NOW, entries=[msgspec.structs.replace(old, last_used=NOW)]),
              NodeCache(node="b", reported_at=NOW, entries=[old], copying=[CopyUnderWay(
                  source="datasets/imgs", key="1" * 24, done_bytes=3, total_bytes=9, started_at=NOW)]),
              NodeCache(node="c", reported_at=NOW, entries=[old], failures=[
                  StagingFailed(source="datasets/imgs", reason="disk full", failed_at=NOW)])]
    states = preload_states(caches, ["a", "b", "c", "d"], "datasets/imgs", since)
    assert [(s.node, s.state, s.done_bytes, s.reason) for s in states] == [
        ("a", "done", 9, ""), ("b", "copying", 3, ""), ("c", "failed", 0, "disk full"), ("d", "waiting", 0, "")]


def test_show_tells_how_far_a_starting_jobs_nodes_are_in_copying_its_datasets(fake: FakeClient) -> None:
    job = JobView(job_id=SHOWN_JOB, name="resnet", project="vision", creator="alice", status="running",
                  priority="normal", mode="pytorch", nodes=1, flavors=["cpu-1"], submitted_at=NOW,
                  instances=[InstanceView(rank=0, node="node-a", master=True, state="pending")])
    spec = JobSpec(name="resnet", data_preparation=True, datasets=[DatasetRef(name="imgs")])
    fake.answers["get_job"] = JobDetails(job=job, spec=spec)
    fake.answers["usage"] = []
    copying = CopyUnderWay(source="datasets/imgs", key="1" * 24, done_bytes=3 * 2**20, total_bytes=12 * 2**20,
                           started_at=datetime.now(UTC) - timedelta(seconds=1))
    other = msgspec.structs.replace(copying, source="datasets/someone-elses")
    fake.answers["cache"] = [NodeCache(node="node-a", reported_at=NOW, entries=[], copying=[copying, other]),
                             NodeCache(node="node-b", reported_at=NOW, entries=[], copying=[copying])]
    result = invoke("show", SHOWN_JOB)
    assert result.exit_code == 0, result.output
    assert "data preparation" in result.output
    staging = [line.split() for line in result.output.splitlines() if "datasets/" in line]
    assert [row[:4] for row in staging] == [["node-a", "datasets/imgs", "3.0", "12.0"]]


def _waiting_view(job_id: str, *, likely: datetime, latest: datetime | None) -> JobView:
    expected = Prediction(starts_now=False, flavor="gpu-4", position=2, jobs_ahead=1, estimated_start=likely,
                          latest_start=latest, predicted_at=NOW, reason="Waits behind 1 job; expected to start "
                          "around 10:40 UTC, going by how long similar jobs ran; by 14:05 UTC at the latest.")
    return JobView(job_id=job_id, name="resnet", project="vision", creator="alice", status="queued",
                   priority="normal", mode="pytorch", nodes=2, flavors=["gpu-4"], submitted_at=NOW, queue_position=2,
                   expected=expected)


def test_show_and_list_tell_a_waiting_jobs_expected_start_likely_and_latest(fake: FakeClient) -> None:
    likely, latest = NOW.replace(hour=10, minute=40), NOW.replace(hour=14, minute=5)
    view = _waiting_view(SHOWN_JOB, likely=likely, latest=latest)
    fake.answers["get_job"] = JobDetails(job=view, spec=JobSpec(name="resnet"))
    fake.answers["usage"] = []
    rows = show_rows(invoke("show", SHOWN_JOB))
    assert rows["expected start"] == "likely 10:40 UTC, latest 14:05 UTC"
    assert rows["waiting"].startswith("Waits behind 1 job; expected to start around 10:40 UTC")

    fake.answers["listing"] = JobList(jobs=[view, _waiting_view("job-000000000002", likely=latest, latest=latest)])
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert "EXPECTED START" in result.output.splitlines()[0]
    lines = [line.split() for line in result.output.splitlines()]
    shown = next(line for line in lines if SHOWN_JOB in line)
    assert shown[-6:] == ["likely", "10:40", "UTC,", "latest", "14:05", "UTC"]
    assert next(line for line in lines if "job-000000000002" in line)[-2:] == ["14:05", "UTC"]


def test_clone_sends_a_path_after_the_files_whole_field(fake: FakeClient, tmp_path: Path) -> None:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("env: {A: '1'}\ncheckpoint_resume.max_resumes: 2\n")
    fake.answers["clone"] = JobAccepted(job_id="job-00000000000b", status="queued", created=True)
    result = invoke("clone", "job-00000000000a", "-f", str(overrides), "--set", "env.B=2")
    assert result.exit_code == 0, result.output
    [(_, (_, sent), _)] = fake.calls
    assert list(sent.items()) == [("env", {"A": "1"}), ("checkpoint_resume.max_resumes", 2), ("env.B", "2")]


def test_set_keeps_text_for_names_with_a_pattern() -> None:
    # a project's and an output's names are text of a pattern: still text where YAML reads a number
    assert cli.parse_set_options(["project=2024", "output.name=2025"]) == {"project": "2024", "output.name": "2025"}
