"""Job arrays in the scheduler: pure rules that make an array's jobs, select them, and show the array.

An array's jobs are ordinary jobs: each has its own spec (the array's, with `{index}` and the sweep's
`{NAME}` filled in its name and commands, and its index and sweep values in its environment) and its own
JobSubmitted, recorded in one append with the array's ArraySubmitted. Their ids follow from the array's
id and the index, so a retried submission makes the same jobs. The whole array is checked before anything
is recorded: one job that would be refused refuses it all.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import msgspec

from libs.contracts.arrays import (
    ID_VARIABLE,
    INDEX_VARIABLE,
    ArrayError,
    ArrayIndices,
    ArrayMember,
    SweepParameter,
    describe_indices,
    is_array_id,
    parse_indices,
    sweep_points,
)
from libs.contracts.events import ArraySubmitted, JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.images import ImageUse
from libs.contracts.jobspec import FieldError, JobSpec
from libs.contracts.operations.arrays import (
    ArrayAccepted,
    ArrayDetails,
    ArrayMemberView,
    ArraySelection,
    ArrayView,
    SubmitArray,
)
from libs.contracts.operations.base import CommandError
from libs.eventstore import NewEvent
from services.scheduler.domain.names import ARRAY, JOB
from services.scheduler.domain.state import Array, SchedulerState


def member_id(array_id: str, index: int) -> str:
    """The id of an array's job at `index`: the same for a retried submission."""
    return "job-" + hashlib.sha256(f"{array_id}/{index}".encode()).hexdigest()[:12]


def points(request: SubmitArray) -> tuple[list[int], list[dict[str, str]], int | None]:
    """The indices the request makes, each job's sweep values, and the cap on how many run at once."""
    if bool(request.indices) == bool(request.sweep):
        raise ArrayError("give either indices (an array expression such as 0-999) or a sweep, one of them")
    if request.indices:
        parsed = parse_indices(request.indices)
        if parsed.max_running is not None and request.max_running is not None:
            raise ArrayError("the cap is given twice: as %N in the indices and as max_running")
        return parsed.indices, [{} for _ in parsed.indices], parsed.max_running or request.max_running
    values = sweep_points(list(request.sweep))
    return list(range(len(values))), values, request.max_running


def fill(text: str, index: int, values: dict[str, str]) -> str:
    """`text` with `{index}` and each sweep parameter's `{NAME}` replaced."""
    text = text.replace("{index}", str(index))
    for name, value in values.items():
        text = text.replace(f"{{{name}}}", value)
    return text


def member_spec(spec: JobSpec, array_id: str, index: int, values: dict[str, str]) -> JobSpec:
    """The spec of the array's job at `index`."""
    env = {**spec.env, **values, INDEX_VARIABLE: str(index), ID_VARIABLE: array_id}
    return msgspec.structs.replace(
        spec, name=fill(spec.name, index, values), env=env,
        command=fill(spec.command, index, values) if spec.command is not None else None,
        tasks=[msgspec.structs.replace(task, command=fill(task.command, index, values)) if task.command else task
               for task in spec.tasks])


def widest_spec(spec: JobSpec, array_id: str, indices: list[int], sweep: list[SweepParameter]) -> JobSpec:
    """The array's job spec with every placeholder at its longest: the one a length limit refuses first."""
    longest = {p.name: max(p.values, key=len) for p in sweep}
    return member_spec(spec, array_id, max(indices, key=lambda i: len(str(i))), longest)


def array_events(request: SubmitArray, identity: Identity, indices: list[int], values: list[dict[str, str]],
                 max_running: int | None, image: ImageUse | None = None) -> list[NewEvent]:
    """The array's ArraySubmitted and each job's JobSubmitted, in index order; every job runs in `image` (J10)."""
    array_id, spec = request.array_id, request.spec
    submitted = ArraySubmitted(array_id=array_id, job_name=spec.name, project=spec.project, creator=identity.user,
                               indices=describe_indices(indices), size=len(indices), sweep=list(request.sweep),
                               max_running=max_running)
    changes = [NewEvent(ARRAY, array_id, submitted)]
    for index, point in zip(indices, values, strict=True):
        job_id = member_id(array_id, index)
        changes.append(NewEvent(JOB, job_id, JobSubmitted(
            job_id=job_id, spec=member_spec(spec, array_id, index, point), creator=identity.user,
            creator_email=identity.email, array=ArrayMember(array_id=array_id, index=index), image=image)))
    return changes


def retried_array(state: SchedulerState, request: SubmitArray, identity: Identity, indices: list[int],
                  values: list[dict[str, str]], max_running: int | None) -> ArrayAccepted | CommandError | None:
    """The answer to a submission whose array exists already: the same as the first time, when it is the
    same array (its first job made anew from the request is the job made then)."""
    array = state.arrays.get(request.array_id)
    if array is None:
        return None
    first = array.submitted
    same = (first.creator == identity.user and first.indices == describe_indices(indices)
            and first.sweep == list(request.sweep) and first.max_running == max_running and bool(array.jobs))
    if same:
        index, job_id = next(iter(array.jobs.items()))
        same = state.jobs[job_id].spec == member_spec(request.spec, request.array_id, index,
                                                      values[indices.index(index)])
    if not same:
        return CommandError(code="conflict", message=f"array {request.array_id} exists with another spec",
                            hint="submit again without choosing the id")
    return ArrayAccepted(array_id=array.array_id, job_ids=list(array.jobs.values()), created=False)


def taken_ids(state: SchedulerState, array_id: str, indices: Iterable[int]) -> list[str]:
    """Ids an array's jobs would have that another job has (as unlikely as 48 random bits allow)."""
    return [job_id for index in indices if (job_id := member_id(array_id, index)) in state.jobs]


def bad_array_id(array_id: str) -> CommandError | None:
    if is_array_id(array_id):
        return None
    return CommandError(code="invalid-request", message=f"{array_id!r} is not an array id",
                        hint="let the client choose it (array-<12 hex digits>)")


def array_error(exc: ArrayError, field: str) -> CommandError:
    return CommandError(code="invalid-request", message=str(exc), errors=[FieldError(field=field, message=str(exc))])


# --- selecting an array's jobs -------------------------------------------------------------------------------


def selected_jobs(state: SchedulerState, selections: Iterable[ArraySelection]) -> list[str] | CommandError:
    """The job ids of the selected arrays' jobs (all, or those of the given indices), in order."""
    found: list[str] = []
    for selection in selections:
        array = state.arrays.get(selection.array_id)
        if array is None:
            return CommandError(code="not-found", message=f"no such array: {selection.array_id}",
                                hint="`trainyard list` shows the arrays you can see; nothing was changed")
        if not selection.indices:
            found += array.jobs.values()
            continue
        try:
            wanted: ArrayIndices = parse_indices(selection.indices)
        except ArrayError as exc:
            return array_error(exc, "arrays.indices")
        missing = [index for index in wanted.indices if index not in array.jobs]
        if missing:
            return CommandError(code="not-found", message=f"array {array.array_id} has no index "
                                f"{describe_indices(missing)}", hint=f"its indices are {array.submitted.indices}")
        found += [array.jobs[index] for index in wanted.indices]
    return list(dict.fromkeys(found))


# --- showing an array ----------------------------------------------------------------------------------------


def array_view(state: SchedulerState, array: Array) -> ArrayView:
    counts: Counter[str] = Counter(state.jobs[job_id].status for job_id in array.jobs.values()
                                   if not state.jobs[job_id].deleted)
    submitted = array.submitted
    return ArrayView(array_id=array.array_id, name=submitted.job_name, project=submitted.project,
                     creator=submitted.creator, submitted_at=array.submitted_at, size=submitted.size,
                     indices=submitted.indices, sweep=list(submitted.sweep), max_running=submitted.max_running,
                     statuses=dict(counts))


def array_details(state: SchedulerState, array: Array, after: int, limit: int) -> ArrayDetails:
    later = [(index, job_id) for index, job_id in array.jobs.items()
             if index > after and not state.jobs[job_id].deleted]
    page = later[:limit]
    values = sweep_points(list(array.submitted.sweep)) if array.submitted.sweep else []
    jobs = []
    for index, job_id in page:
        job = state.jobs[job_id]
        jobs.append(ArrayMemberView(index=index, job_id=job_id, status=job.status, started_at=job.started_at,
                                    ended_at=job.ended_at, exit_code=job.exit_code, reason=job.reason,
                                    values=values[index] if index < len(values) else {}))
    return ArrayDetails(array=array_view(state, array), jobs=jobs, more=len(later) > len(page))


def members_of(state: SchedulerState, array_id: str) -> list[str]:
    array = state.arrays.get(array_id)
    return [] if array is None else list(array.jobs.values())


# --- how many of an array run at once (`%N`) ----------------------------------------------------------------


def held_back(state: SchedulerState, queue_order: Iterable[str]) -> set[str]:
    """Queued jobs of capped arrays that may not start now: all but the first ones in queue order that fit
    under the array's cap beside its jobs running (or being pre-checked)."""
    capped = {array_id: array for array_id, array in state.arrays.items() if array.submitted.max_running}
    if not capped:
        return set()
    # Its jobs running or pre-checked are among those holding resources: counted there, not over all its jobs.
    busy = Counter(job.array.array_id for job in state.holding() if job.array is not None)
    room = {array_id: (array.submitted.max_running or 0) - busy[array_id] for array_id, array in capped.items()}
    held: set[str] = set()
    for job_id in queue_order:
        member = state.jobs[job_id].array
        if member is None or member.array_id not in room:
            continue
        if room[member.array_id] > 0:
            room[member.array_id] -= 1
        else:
            held.add(job_id)
    return held
