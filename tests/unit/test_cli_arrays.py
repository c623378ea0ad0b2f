"""Job arrays and sweeps in the CLI: submitted as one request whose options are checked before anything is sent,
listed and shown as one object, and stopped or deleted whole or by index."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from client import cli
from client.api import NoAnswer
from libs.contracts.arrays import ArrayMember, SweepParameter, is_array_id, parse_indices, sweep_points
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.arrays import ArrayAccepted, ArrayDetails, ArrayMemberView, ArraySelection, ArrayView
from libs.contracts.operations.base import Done
from libs.contracts.operations.jobs import JobList, JobView
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]  # the fixtures, used by name

NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)
ARRAY = "array-0123456789ab"
OTHER_ARRAY = "array-ba9876543210"
JOB = "job-0123456789ab"


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text("name: train-{index}\ncommand: python3 train.py --seed {index}\nalgorithm: {name: code}\n"
                    "output: {name: out}\nflavors: [cpu-2]\n")
    return path


def accepting(sent: list[dict[str, Any]]) -> Callable[..., Any]:
    """A submit_array that keeps what it was sent and accepts one job per index or sweep point."""

    async def submit_array(spec: JobSpec, **request: Any) -> ArrayAccepted:
        sent.append({"spec": spec, **request})
        count = len(sweep_points(request["sweep"]) if request["sweep"] else parse_indices(request["indices"]).indices)
        return ArrayAccepted(array_id=request["array_id"], job_ids=[f"job-{i:012x}" for i in range(count)],
                             created=True)

    return submit_array


def lines_of(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


# --- submit --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "indices", "cap", "count"), [
    (["--array", "0-999%50"], "0-999", 50, 1000),
    (["--array", "1-10:2", "--max-running", "3"], "1-10:2", 3, 5),
    (["--array", "0,6,16-18"], "0,6,16-18", None, 5),
])
def test_submit_array_sends_the_indices_and_the_cap(fake: FakeClient, job_file: Path, options: list[str],
                                                    indices: str, cap: int | None, count: int) -> None:
    sent: list[dict[str, Any]] = []
    fake.answers["submit_array"] = accepting(sent)
    result = invoke("submit", str(job_file), *options)
    assert result.exit_code == 0, result.output
    [request] = sent
    assert (request["indices"], request["sweep"], request["max_running"]) == (indices, [], cap)
    assert request["spec"].name == "train-{index}"  # the scheduler fills in each job's index
    array_id = request["array_id"]
    assert is_array_id(array_id)
    assert f"submitting array {array_id} ({count} jobs)" in result.stderr  # said before it is sent
    assert result.stdout.strip() == f"submitted array {array_id} ({count} jobs): train-{{index}}"


def test_submit_sweep_sends_its_parameters_in_order(fake: FakeClient, job_file: Path) -> None:
    sent: list[dict[str, Any]] = []
    fake.answers["submit_array"] = accepting(sent)
    result = invoke("submit", str(job_file), "--sweep", "lr=0.1,0.01", "--sweep", "bs=32,64", "--max-running", "2")
    assert result.exit_code == 0, result.output
    [request] = sent
    assert request["sweep"] == [SweepParameter(name="lr", values=["0.1", "0.01"]),
                                SweepParameter(name="bs", values=["32", "64"])]
    assert (request["indices"], request["max_running"]) == ("", 2)
    assert f"submitting array {request['array_id']} (4 jobs)" in result.stderr
    assert f"submitted array {request['array_id']} (4 jobs)" in result.stdout


def test_an_unanswered_array_is_sent_again_under_the_id_said_first(fake: FakeClient, job_file: Path) -> None:
    ids: list[str] = []

    async def submit_array(spec: JobSpec, *, array_id: str, on_retry: Any, **_: Any) -> ArrayAccepted:
        ids.append(array_id)
        on_retry(2, NoAnswer("trainyard.cmd.arrays.submit", "nothing answers on trainyard.cmd.arrays.submit"))
        return ArrayAccepted(array_id=array_id, job_ids=["job-000000000001"], created=True)

    fake.answers["submit_array"] = submit_array
    result = invoke("submit", str(job_file), "--array", "7")
    assert result.exit_code == 0, result.output
    [array_id] = ids
    assert result.stderr.index(f"submitting array {array_id} (1 job)") < result.stderr.index(
        f"sending array {array_id} again (attempt 2 of 4)")


def test_submit_array_as_json_prints_what_was_accepted(fake: FakeClient, job_file: Path) -> None:
    fake.answers["submit_array"] = accepting([])
    result = invoke("submit", str(job_file), "--array", "1-5", "--json")
    assert result.exit_code == 0, result.output
    accepted = msgspec.json.decode(result.stdout)
    assert accepted["type"] == "ArrayAccepted.v1" and is_array_id(accepted["array_id"])
    assert len(accepted["job_ids"]) == 5


@pytest.mark.parametrize(("options", "message"), [
    (["--array", "0-x"], "--array '0-x': '0-x' is not an index, a range A-B or a stepped range A-B:S"),
    (["--array", "9-1"], "--array '9-1': in '9-1' the range must not end before it starts"),
    (["--array", "0-20000"], "--array '0-20000' makes more than 10000 jobs; split it into several arrays"),
    (["--array", "0-9%0"], "--array '0-9%0': after '%' comes how many may run at once"),
    (["--sweep", "lr"], "--sweep 'lr': write a sweep parameter as NAME=value1,value2"),
    (["--sweep", "lr=0.1,,0.2"], "--sweep 'lr=0.1,,0.2': a value of lr is empty"),
    (["--sweep", "lr=1,2", "--sweep", "lr=3"], "--sweep: a sweep parameter is given twice: lr"),
    (["--array", "0-9%2", "--max-running", "3"], "the cap is given twice: as %2 in --array and as --max-running 3"),
    (["--max-running", "3"], "--max-running caps how many jobs of an array run at once, and this submits one job"),
    (["--array", "0-3", "--follow"], "--follow follows one job, and this submits an array"),
])
def test_submit_refuses_a_bad_array_before_sending(fake: FakeClient, job_file: Path, options: list[str],
                                                   message: str) -> None:
    result = invoke("submit", str(job_file), *options)
    assert result.exit_code == 1
    assert f"error: {message}" in result.stderr
    assert "nothing was submitted" in result.stderr
    assert "submitting" not in result.stderr
    assert fake.calls == []


def test_submit_refuses_an_array_and_a_sweep_together(fake: FakeClient, job_file: Path) -> None:
    result = invoke("submit", str(job_file), "--array", "0-3", "--sweep", "lr=0.1,0.01")
    assert result.exit_code == 1
    assert "error: --array and --sweep each make the jobs of an array: give one of them" in result.stderr
    assert fake.calls == []


# --- list ----------------------------------------------------------------------------------------------------


def array_view(**fields: Any) -> ArrayView:
    defaults: dict[str, Any] = {"array_id": ARRAY, "name": "train-{index}", "project": "vision", "creator": "alice",
                                "submitted_at": NOW, "size": 1000, "indices": "0-999", "max_running": 50,
                                "statuses": {"queued": 990, "succeeded": 7, "running": 3}}
    return ArrayView(**{**defaults, **fields})


def job_view(job_id: str = JOB, name: str = "resnet", **fields: Any) -> JobView:
    return JobView(job_id=job_id, name=name, project="vision", creator="alice", status="running",
                   priority="normal", mode="pytorch", nodes=1, flavors=["cpu-2"], submitted_at=NOW, **fields)


def test_list_shows_an_array_as_one_row_with_its_jobs_counted(fake: FakeClient) -> None:
    fake.answers["listing"] = JobList(jobs=[job_view()], arrays=[array_view()])
    result = invoke("list", "--status", "running")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("listing", (["running"], None), {})]
    rows = lines_of(result.stdout)
    assert [JOB, "resnet", "running"] in [row[:3] for row in rows]
    header = rows.index(["ARRAY", "NAME", "STATUS", "INDICES", "JOBS", "CAP", "CREATOR", "SUBMITTED"])
    assert rows[header - 1] == ["arrays"]
    assert rows[header + 1] == [ARRAY, "train-{index}", "running", "0-999", "3", "running,", "990", "queued,", "7",
                                "succeeded", "50", "alice", *cli.local_time(NOW).split()]


def test_list_names_a_sweeps_parameters_and_an_array_without_a_cap(fake: FakeClient) -> None:
    sweep = [SweepParameter(name="lr", values=["0.1", "0.01"]), SweepParameter(name="bs", values=["32", "64"])]
    fake.answers["listing"] = JobList(jobs=[], arrays=[array_view(indices="0-3", size=4, sweep=sweep, max_running=None,
                                                                  statuses={"succeeded": 3, "failed": 1})])
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert "no jobs" not in result.stdout
    [row] = [row for row in lines_of(result.stdout) if row[0] == ARRAY]
    assert row[2:13] == ["ended", "0-3", "(sweep", "of", "lr,", "bs)", "3", "succeeded,", "1", "failed", "-"]


def test_list_all_lists_every_job_of_every_array(fake: FakeClient) -> None:
    member = job_view("job-00000000000a", name="train-7", array=ArrayMember(array_id=ARRAY, index=7))
    fake.answers["list_jobs"] = [job_view(), member]
    result = invoke("list", "--all")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("list_jobs", ([], None), {})]
    assert ["job-00000000000a", "train-7", "running"] in [row[:3] for row in lines_of(result.stdout)]
    assert "arrays" not in result.stdout


def test_list_as_json_holds_jobs_and_arrays(fake: FakeClient) -> None:
    fake.answers["listing"] = JobList(jobs=[job_view()], arrays=[array_view()])
    listed = msgspec.json.decode(invoke("list", "--json").stdout)
    assert [job["job_id"] for job in listed["jobs"]] == [JOB]
    assert [(array["array_id"], array["statuses"]["queued"]) for array in listed["arrays"]] == [(ARRAY, 990)]


# --- show ----------------------------------------------------------------------------------------------------


def members(indices: range, **fields: Any) -> list[ArrayMemberView]:
    return [ArrayMemberView(index=index, job_id=f"job-{index:012x}", status="queued", **fields) for index in indices]


def test_show_of_an_array_lists_its_first_jobs_and_tells_how_to_see_the_rest(fake: FakeClient) -> None:
    view = array_view(size=120, indices="0-119", statuses={"queued": 117, "failed": 1, "running": 2})
    jobs = members(range(50))
    jobs[1] = ArrayMemberView(index=1, job_id=jobs[1].job_id, status="failed", exit_code=3, reason="rank 0 exited 3")
    fake.answers["get_array"] = ArrayDetails(array=view, jobs=jobs, more=True)
    result = invoke("show", ARRAY)
    assert result.exit_code == 0, result.output
    assert fake.calls == [("get_array", (ARRAY,), {"limit": 50})]
    rows = lines_of(result.stdout)
    assert ["jobs", "120:", "2", "running,", "117", "queued,", "1", "failed"] in rows
    assert ["cap", "at", "most", "50", "running", "at", "once"] in rows
    assert ["INDEX", "JOB", "STATUS", "EXIT", "REASON"] in rows
    assert ["0", "job-000000000000", "queued", "-", "-"] in rows
    assert ["1", "job-000000000001", "failed", "3", "rank", "0", "exited", "3"] in rows
    assert ["49", "job-000000000031", "queued", "-", "-"] in rows
    assert f"… and 70 more jobs: `trainyard show {ARRAY} --all` lists every one" in result.stderr


def test_show_of_a_sweep_has_a_column_per_parameter(fake: FakeClient) -> None:
    sweep = [SweepParameter(name="lr", values=["0.1", "0.01"])]
    view = array_view(size=2, indices="0-1", sweep=sweep, statuses={"succeeded": 2}, max_running=None)
    jobs = [ArrayMemberView(index=i, job_id=f"job-{i:012x}", status="succeeded", exit_code=0, values={"lr": lr})
            for i, lr in enumerate(["0.1", "0.01"])]
    fake.answers["get_array"] = ArrayDetails(array=view, jobs=jobs)
    result = invoke("show", ARRAY)
    assert result.exit_code == 0, result.output
    rows = lines_of(result.stdout)
    assert ["sweep", "lr=0.1,0.01"] in rows and ["cap", "none"] in rows
    assert ["INDEX", "JOB", "STATUS", "EXIT", "lr", "REASON"] in rows
    assert ["1", "job-000000000001", "succeeded", "0", "0.01", "-"] in rows
    assert "more" not in result.stderr


def test_show_all_pages_through_every_job_of_the_array(fake: FakeClient) -> None:
    view = array_view(size=2500, indices="0-2499", statuses={"queued": 2500})
    fake.answers["get_array"] = ArrayDetails(array=view, jobs=members(range(1)), more=True)

    async def array_jobs(array_id: str) -> AsyncIterator[ArrayMemberView]:
        assert array_id == ARRAY
        for job in members(range(2500)):
            yield job

    fake.array_jobs = array_jobs  # type: ignore[attr-defined]
    result = invoke("show", ARRAY, "--all")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("get_array", (ARRAY,), {"limit": 1})]  # the summary; the jobs come page by page
    listed = [row[:3] for row in lines_of(result.stdout) if len(row) > 1 and row[1].startswith("job-")]
    assert listed == [[str(i), f"job-{i:012x}", "queued"] for i in range(2500)]
    assert "more" not in result.stderr


@pytest.mark.parametrize("target", ["job-r", "array-xyz", "arr-0123456789ab", "0123456789ab"])
def test_show_refuses_what_is_neither_a_job_id_nor_an_array_id(fake: FakeClient, target: str) -> None:
    result = invoke("show", target)
    assert result.exit_code == 1
    assert (f"error: {target!r} is neither a job id (job-<12 hex digits>) nor an array id (array-<12 hex digits>)"
            in result.stderr)
    assert fake.calls == []


def test_show_all_of_a_job_is_refused(fake: FakeClient) -> None:
    result = invoke("show", JOB, "--all")
    assert result.exit_code == 1
    assert f"error: --all lists every job of an array, and {JOB} is a job" in result.stderr
    assert fake.calls == []


# --- stop and delete -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["stop", "delete"])
def test_indices_select_jobs_of_the_array_given(fake: FakeClient, command: str) -> None:
    fake.answers[command] = Done(job_ids=[], message="stopping 4 job(s)" if command == "stop" else "deleted 4 job(s)")
    result = invoke(command, ARRAY, "--indices", "3,5-7")
    assert result.exit_code == 0, result.output
    assert fake.calls == [(command, ([],), {"arrays": [ArraySelection(array_id=ARRAY, indices="3,5-7")]})]
    assert result.stdout.strip() == ("stopping 4 job(s)" if command == "stop" else "deleted 4 job(s)")


@pytest.mark.parametrize("command", ["stop", "delete"])
def test_jobs_and_whole_arrays_go_together(fake: FakeClient, command: str) -> None:
    fake.answers[command] = Done(job_ids=[], message="done")
    result = invoke(command, JOB, ARRAY, OTHER_ARRAY, ARRAY)
    assert result.exit_code == 0, result.output
    assert fake.calls == [(command, ([JOB],), {"arrays": [ArraySelection(array_id=ARRAY),
                                                          ArraySelection(array_id=OTHER_ARRAY)]})]


@pytest.mark.parametrize(("args", "message"), [
    ([ARRAY, OTHER_ARRAY, "--indices", "3"],
     f"--indices selects jobs of one array, and 2 were given ({ARRAY}, {OTHER_ARRAY})"),
    ([JOB, "--indices", "3"], "--indices selects jobs of one array, and none was given"),
    ([ARRAY, "--indices", "3-x"], "--indices '3-x': '3-x' is not an index"),
    ([ARRAY, "--indices", "0-9%2"], "--indices '0-9%2': '%N' caps a new array's running jobs; it selects nothing"),
    ([ARRAY, "bogus"], "'bogus' is neither a job id (job-<12 hex digits>) nor an array id"),
])
@pytest.mark.parametrize("command", ["stop", "delete"])
def test_stop_and_delete_refuse_an_unclear_selection_before_sending(fake: FakeClient, command: str, args: list[str],
                                                                    message: str) -> None:
    result = invoke(command, *args)
    assert result.exit_code == 1
    assert f"error: {message}" in result.stderr
    assert "hint:" in result.stderr
    assert fake.calls == []
