"""The scheduler's commands: submit, clone, stop, delete, priority, duration and settings.

Each handler gets the authenticated caller (libs.auth), checks the operation against J2 before it
changes anything, and answers a retried request the same way as the first one.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from libs.access import JobAction
from libs.contracts.arrays import ArrayError
from libs.contracts.codec import encode
from libs.contracts.events import (
    JobDeleted,
    JobDurationChanged,
    JobPriorityChanged,
    JobStopped,
    JobStopRequested,
    SettingsChanged,
    StorageAccessSet,
)
from libs.contracts.identity import Identity
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import JobSpec, field_error_from_msgspec, parse_duration
from libs.contracts.operations.arrays import SUBMIT_ARRAY, ArrayAccepted, SubmitArray
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cluster import (
    CHANGE_SETTINGS,
    SET_STORAGE_ACCESS,
    ChangeSettings,
    SetStorageAccess,
    SettingsView,
    StorageAccessList,
)
from libs.contracts.operations.jobs import (
    CHANGE_DURATION,
    CHANGE_PRIORITY,
    CLONE_JOB,
    DELETE_JOBS,
    STOP_JOBS,
    SUBMIT_JOB,
    ChangeDuration,
    ChangePriority,
    CloneJob,
    DeleteJobs,
    JobAccepted,
    StopJobs,
    SubmitJob,
)
from libs.contracts.overrides import apply_overrides
from libs.contracts.scheduling import STORAGE_FOLDERS, StoredAccess
from libs.contracts.strict import decode_strict
from libs.eventstore import NewEvent
from libs.messaging.responder import Route
from libs.storage import missing_inputs
from libs.telemetry.tracing import current_trace_headers
from services.scheduler.domain import arrays
from services.scheduler.domain.access import access_error, array_access_error
from services.scheduler.domain.images import LIST_HINT, image_use
from services.scheduler.domain.limits import (
    TokenBucket,
    queued_counts,
    queued_error,
    queued_limit_reachable,
    rate_taken,
)
from services.scheduler.domain.names import job_change, settings_change, storage_change
from services.scheduler.domain.spec_checks import cap_errors, invalid_spec, spec_errors
from services.scheduler.domain.state import SchedulerState
from services.scheduler.domain.storage_access import storage_errors
from services.scheduler.history.archived import Archive
from services.scheduler.interfaces import Scheduling
from services.scheduler.rules.archive import MIN_RETENTION_SECONDS
from services.scheduler.rules.submissions import Submission, retried, urgent_cap_error


class JobCommands:
    def __init__(self, scheduler: Scheduling, *, storage_root: Path, archive: Archive) -> None:
        self.scheduler = scheduler
        self.storage_root = storage_root  # shared storage, where a job's inputs must exist
        self.archive = archive  # jobs that ended long ago, read back from the log

    def routes(self) -> list[Route]:
        return [
            (SUBMIT_JOB, self.submit),
            (SUBMIT_ARRAY, self.submit_array),
            (CLONE_JOB, self.clone),
            (STOP_JOBS, self.stop),
            (DELETE_JOBS, self.delete),
            (CHANGE_PRIORITY, self.change_priority),
            (CHANGE_DURATION, self.change_duration),
            (CHANGE_SETTINGS, self.change_settings),
            (SET_STORAGE_ACCESS, self.set_storage_access),
        ]

    @property
    def state(self) -> SchedulerState:
        return self.scheduler.state

    # --- creating jobs ---------------------------------------------------------------------------

    async def submit(self, request: SubmitJob, identity: Identity) -> JobAccepted | CommandError:
        return await self._create(request.job_id, request.spec, identity, cloned_from=None, predict=request.predict)

    async def clone(self, request: CloneJob, identity: Identity) -> JobAccepted | CommandError:
        """O1: the source's spec with `overrides` applied, created as the caller's own job."""
        holding = await self.archive.holding(request.source_job_id)
        if error := access_error(holding, [request.source_job_id], identity, "clone"):
            return error
        source = holding.jobs[request.source_job_id].spec
        merged = apply_overrides(msgspec.to_builtins(source), request.overrides)
        if isinstance(merged, list):
            return CommandError(code="invalid-spec", message=f"cannot override {', '.join(e.field for e in merged)}",
                                hint="override fields such as name, nodes or priority, or a path into one such as "
                                     "checkpoint_resume.max_resumes or env.SEED",
                                errors=merged)
        try:
            spec = decode_strict(encode(merged), JobSpec)
        except msgspec.ValidationError as exc:
            problem = field_error_from_msgspec(exc)
            return CommandError(code="invalid-spec", message=f"the cloned spec is invalid: {problem}",
                                errors=[problem])
        return await self._create(request.job_id, spec, identity, cloned_from=request.source_job_id)

    async def _create(self, job_id: str, spec: JobSpec, identity: Identity, cloned_from: str | None, *,
                      predict: bool = False) -> JobAccepted | CommandError:
        if not is_job_id(job_id):
            return CommandError(code="invalid-request", message=f"{job_id!r} is not a job id",
                                hint="let the client choose it (job-<12 hex digits>)")
        if (answer := retried(self.state, job_id, spec, identity)) is not None:
            return answer
        if error := self._too_fast(identity, 1):
            return error
        if error := self._refusal(spec, identity):
            return error
        if errors := missing_inputs(spec, self.storage_root):
            return invalid_spec(errors)
        if error := urgent_cap_error(self.state, spec.project, identity.user, spec.priority):
            return error
        # S6: planned off the event loop and without the lock, of the queue without this job; otherwise it is
        # planned with other new jobs' once the job is recorded (the scheduler's prediction loop).
        prediction = await self.scheduler.predict(spec) if predict else None
        # The batch it joins decides on the per-user limits, in the order submissions arrive.
        return await self.scheduler.submissions.submit(Submission(job_id=job_id, spec=spec, identity=identity,
                                                                  cloned_from=cloned_from, prediction=prediction,
                                                                  trace=current_trace_headers(),
                                                                  at=self.scheduler.clock()))

    def _too_fast(self, identity: Identity, count: int) -> CommandError | None:
        """A submission the user's bucket could not take now, refused before any work is done for it (the
        bucket is only looked at: what is accepted takes from it when it is recorded)."""
        taken = rate_taken(identity.user, self.scheduler.submissions.buckets.get(identity.user), count,
                           self.scheduler.clock(), self.state.settings)
        return taken if isinstance(taken, CommandError) else None

    def _within_limits(self, identity: Identity, count: int) -> TokenBucket | CommandError:
        """The per-user limits (limits.py) for `count` new jobs, under the lock: the user's bucket once they
        are taken from it, or the refusal."""
        user, settings = identity.user, self.state.settings
        if queued_limit_reachable(self.state, count, settings) and (
                error := queued_error(user, queued_counts(self.state, {user})[user], count, settings)):
            return error
        return rate_taken(user, self.scheduler.submissions.buckets.get(user), count, self.scheduler.clock(),
                          self.state.settings)

    def _refusal(self, spec: JobSpec, identity: Identity) -> CommandError | None:
        """Everything that makes a spec unacceptable for this caller, in one answer."""
        settings = self.state.settings
        errors = spec_errors(spec, self.state.cluster, self.state.images) + cap_errors(spec, settings)
        if errors:
            return invalid_spec(errors)
        if not identity.member_of(spec.project):
            return CommandError(code="forbidden", message=f"you are not a member of project {spec.project!r}",
                                hint=f"your projects: {', '.join(identity.projects) or 'none'}")
        if spec.priority == "very-urgent" and not identity.admin:
            return CommandError(code="forbidden", message="only administrators may set priority very-urgent",
                                hint="use urgent, or ask an administrator")
        if errors := storage_errors(spec, identity, self.state.storage, sharing_enabled=settings.sharing_enabled):
            return CommandError(code="forbidden", message="the job uses storage beyond your access: "
                                + "; ".join(map(str, errors)), errors=errors,
                                hint="change the fields named, or ask the owners to share more "
                                "(`trainyard storage list` shows them); nothing was created")
        return None

    # --- changing jobs ---------------------------------------------------------------------------

    async def submit_array(self, request: SubmitArray, identity: Identity) -> ArrayAccepted | CommandError:
        """Many jobs from one spec (arrays.py): checked as one, recorded in one append, or refused whole."""
        if error := arrays.bad_array_id(request.array_id):
            return error
        try:
            indices, values, max_running = arrays.points(request)
        except ArrayError as exc:
            return arrays.array_error(exc, "indices" if request.indices else "sweep")
        if (answer := arrays.retried_array(self.state, request, identity, indices, values, max_running)) is not None:
            return answer
        if error := self._too_fast(identity, len(indices)):
            return error
        # The job whose placeholders are filled longest is the one a length limit refuses first.
        if error := self._refusal(arrays.widest_spec(request.spec, request.array_id, indices, list(request.sweep)),
                                  identity):
            return error
        if errors := missing_inputs(request.spec, self.storage_root):
            return invalid_spec(errors)
        async with self.scheduler.lock:
            if (answer := arrays.retried_array(self.state, request, identity, indices, values,
                                               max_running)) is not None:
                return answer
            spec = request.spec
            if error := urgent_cap_error(self.state, spec.project, identity.user, spec.priority, also=len(indices) - 1):
                return error
            if taken := arrays.taken_ids(self.state, request.array_id, indices):
                return CommandError(code="conflict", message=f"the array's job ids are taken: {', '.join(taken[:5])}",
                                    hint="submit again without choosing the id")
            try:
                image = image_use(spec, self.state.images)
            except LookupError as exc:
                return CommandError(code="invalid-spec", message=str(exc), hint=LIST_HINT)
            bucket = self._within_limits(identity, len(indices))
            if isinstance(bucket, CommandError):
                return bucket
            changes = arrays.array_events(request, identity, indices, values, max_running, image)
            await self.scheduler.record(changes)
            self.scheduler.submissions.buckets[identity.user] = bucket
        return ArrayAccepted(array_id=request.array_id, job_ids=[c.aggregate_id for c in changes[1:]], created=True)

    async def _selected(self, request: StopJobs | DeleteJobs, identity: Identity,
                        operation: JobAction) -> list[str] | CommandError:
        """The jobs a stop or delete names, itself or as the selected jobs of arrays (under the lock); archived ones
        are read back from the log to be checked."""
        job_ids = list(request.job_ids)
        if request.arrays:
            if error := array_access_error(self.state, [s.array_id for s in request.arrays], identity):
                return error
            members = arrays.selected_jobs(self.state, request.arrays)
            if isinstance(members, CommandError):
                return members
            job_ids += [j for j in members if not self.state.jobs[j].deleted]
        archived = await self.archive.state_of(job_ids)
        live = [j for j in job_ids if j in self.state.jobs]
        if error := access_error(self.state, live, identity, operation):
            return error
        missing = self.archive.archived(job_ids)  # read back from the log, or not found
        if missing and (error := access_error(archived or self.state, missing, identity, operation)):
            return error
        return list(dict.fromkeys(job_ids))

    async def stop(self, request: StopJobs, identity: Identity) -> Done | CommandError:
        async with self.scheduler.lock:
            selected = await self._selected(request, identity, "stop")
            if isinstance(selected, CommandError):
                return selected
            changes: list[NewEvent] = []
            for job_id in selected:
                job = self.state.jobs.get(job_id)
                if job is None:  # archived: it ended long ago
                    continue
                if job.status == "queued":
                    changes.append(job_change(JobStopped(job_id=job_id, by=identity.user)))
                elif job.status == "running" and job.stop_requested_by is None and not job.expiring:
                    changes.append(job_change(JobStopRequested(job_id=job_id, by=identity.user)))
            await self.scheduler.record(changes)
        return Done(job_ids=selected, message=f"stopping {len(changes)} job(s)")

    async def delete(self, request: DeleteJobs, identity: Identity) -> Done | CommandError:
        async with self.scheduler.lock:
            selected = await self._selected(request, identity, "delete")
            if isinstance(selected, CommandError):
                return selected
            archived = self.archive.archived(selected)
            live = [j for j in selected if j not in archived]
            active = [j for j in live if not self.state.jobs[j].terminal]
            if active:
                more = f" and {len(active) - 20} more" if len(active) > 20 else ""
                stop = " ".join(request.job_ids) if request.arrays else " ".join(active[:20]) + (" …" if more else "")
                if request.arrays:
                    stop += " " + " ".join(selection.array_id for selection in request.arrays)
                return CommandError(code="invalid-state", message=f"still queued or running: {', '.join(active[:20])}"
                                    + more, hint=f"stop first: trainyard stop {stop.strip()}; nothing was deleted")
            await self.scheduler.record([job_change(JobDeleted(job_id=j, by=identity.user)) for j in live])
            await self.scheduler.record_to_archived([job_change(JobDeleted(job_id=j, by=identity.user))
                                                     for j in archived])
        return Done(job_ids=selected, message=f"deleted {len(selected)} job(s)")

    async def change_priority(self, request: ChangePriority, identity: Identity) -> Done | CommandError:
        """S3: users may choose normal or urgent; very-urgent is for administrators."""
        async with self.scheduler.lock:
            holding = await self.archive.holding(request.job_id)
            if error := access_error(holding, [request.job_id], identity, "priority"):
                return error
            job = holding.jobs[request.job_id]
            if job.status != "queued":
                return CommandError(code="invalid-state",
                                    message=f"{job.job_id} is {job.status}: only a queued job's priority can change",
                                    hint="nothing was changed")
            if request.priority == "very-urgent" and not identity.admin:
                return CommandError(code="forbidden", message="only administrators may set priority very-urgent",
                                    hint="use urgent, or ask an administrator")
            if job.priority == request.priority:
                return Done(job_ids=[job.job_id], message=f"already {request.priority}")
            if error := urgent_cap_error(self.state, job.spec.project, job.creator, request.priority,
                                        ignore=job.job_id):
                return error
            await self.scheduler.record([job_change(JobPriorityChanged(job_id=job.job_id, priority=request.priority,
                                                                       by=identity.user))])
        return Done(job_ids=[request.job_id], message=f"priority is now {request.priority}")

    async def change_duration(self, request: ChangeDuration, identity: Identity) -> Done | CommandError:
        """S11: a new limit applies at once, to a running job too, without restarting it."""
        if request.duration is not None:
            try:
                parse_duration(request.duration)
            except ValueError as exc:
                return CommandError(code="invalid-request", message=str(exc),
                                    hint="e.g. 30m, 4h or 2d; none removes it")
        async with self.scheduler.lock:
            holding = await self.archive.holding(request.job_id)
            if error := access_error(holding, [request.job_id], identity, "duration"):
                return error
            job = holding.jobs[request.job_id]
            if job.terminal or job.expiring:
                return CommandError(code="invalid-state",
                                    message=f"{job.job_id} is {'expiring' if job.expiring else job.status}: "
                                    "its duration can no longer change", hint="nothing was changed")
            if job.duration != request.duration:
                await self.scheduler.record([job_change(JobDurationChanged(job_id=job.job_id, duration=request.duration,
                                                                           by=identity.user))])
        message = f"duration limit is now {request.duration}" if request.duration else "duration limit removed"
        return Done(job_ids=[request.job_id], message=message)

    async def change_settings(self, request: ChangeSettings, identity: Identity) -> SettingsView | CommandError:
        if not identity.admin:
            return CommandError(code="forbidden", message="only administrators change platform settings")
        changes = {k: v for k, v in msgspec.structs.asdict(request).items() if v is not None}
        for name in ("debug_retention", "cache_retention", "job_retention"):
            if (retention := changes.get(name)) is not None:
                try:
                    seconds = parse_duration(retention)
                except ValueError as exc:
                    return CommandError(code="invalid-request", message=f"{name}: {exc}")
                if name == "job_retention" and seconds < MIN_RETENTION_SECONDS:
                    return CommandError(code="invalid-request",
                                        message=f"job_retention: {retention} is shorter than a minute",
                                        hint="ended jobs are kept in memory at least 1m; e.g. 1d or 7d")
        negative = [k for k, v in changes.items() if isinstance(v, int) and not isinstance(v, bool) and v < 0]
        if negative:
            return CommandError(code="invalid-request", message=f"must not be negative: {', '.join(negative)}")
        async with self.scheduler.lock:
            settings = msgspec.structs.replace(self.state.settings, **changes)
            for kind in ("cache", "disk"):
                low, high = getattr(settings, f"{kind}_low_percent"), getattr(settings, f"{kind}_high_percent")
                if low > high:
                    return CommandError(code="invalid-request",
                                        message=f"{kind}_low_percent ({low:g}) is above {kind}_high_percent ({high:g})",
                                        hint="the low threshold must be at or below the high one")
            if settings != self.state.settings:
                await self.scheduler.record([settings_change(SettingsChanged(settings=settings, by=identity.user))])
        return SettingsView(settings=self.state.settings)

    # --- shared storage's owners (J2) ------------------------------------------------------------

    async def set_storage_access(self, request: SetStorageAccess,
                                 identity: Identity) -> StorageAccessList | CommandError:
        """Register a resource to its owner, or change its access for others (owner or administrator)."""
        what = f"{request.kind} {request.name!r}"
        if request.owner is not None and request.owner != identity.user and not identity.admin:
            return CommandError(code="forbidden", message="only administrators register resources to someone else",
                                hint="leave out the owner to register it to yourself")
        if not identity.member_of(request.project):
            return CommandError(code="forbidden", message=f"you are not a member of project {request.project!r}",
                                hint=f"your projects: {', '.join(identity.projects) or 'none'}")
        folder = f"{STORAGE_FOLDERS[request.kind]}/{request.name}"
        created_on_use = request.kind in ("output", "volume")
        if not created_on_use and not (self.storage_root / folder).is_dir():
            return CommandError(code="not-found", message=f"{folder} does not exist in shared storage",
                                hint="check the name, or upload it to shared storage first")
        async with self.scheduler.lock:
            known = self.state.storage.get((request.kind, request.name))
            if known is not None and known.owner != identity.user and not identity.admin:
                return CommandError(code="forbidden", message=f"{what} belongs to {known.owner}",
                                    hint="only its owner or an administrator may change it; nothing was changed")
            owner = request.owner or (known.owner if known is not None else identity.user)
            entry = StoredAccess(kind=request.kind, name=request.name, owner=owner, project=request.project,
                                 others=request.others)
            if entry != known:
                await self.scheduler.record([storage_change(StorageAccessSet(entry=entry, by=identity.user))])
        return StorageAccessList(entries=[entry])
