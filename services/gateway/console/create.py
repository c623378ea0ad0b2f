"""The create-job page (seed 001, 创建任务式训练): a form with every field of a job spec (libs/contracts/jobspec.py),
prefilled from a job being cloned or from an uploaded spec file, checked as the CLI checks a spec file, and sent
with a job id chosen when the form was made, so that posting the same form again creates one job.

Beside it: the flavors with the boards queued jobs need (4.5), the cluster's resources for the chosen flavors (4.0),
the queue prediction (排队预测) and the spec as YAML. The page's script asks this module to read the form as a spec
(`action=check`: the same reading a submission gets) and then the HTTP API for the prediction and the resources.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import (
    MAX_LIST_ITEMS,
    FieldError,
)
from libs.contracts.operations.base import CommandError, Operation
from libs.contracts.operations.cluster import GET_RESOURCES, LIST_FLAVORS, FlavorList, GetResources, ListFlavors
from libs.contracts.operations.images import LIST_IMAGES, ListImages
from libs.contracts.operations.jobs import CLONE_JOB, GET_JOB, SUBMIT_JOB, CloneJob, GetJob, SubmitJob
from libs.contracts.scheduling import BoardDemand, FlavorInfo, NodeResources
from services.gateway.bodies import form_text
from services.gateway.calls import Refused
from services.gateway.console.base import Console, redirect
from services.gateway.console.i18n import N_
from services.gateway.console.spec_form import (
    CLONE_SUFFIX,
    LONGEST_NAME,
    Draft,
    draft_from_form,
    draft_from_spec,
    read_spec,
    slot_of,
    spec_from_file,
    yaml_of,
)
from services.gateway.problems import STATUS
from services.gateway.sessions import Session

KIB = 1024
MOST_UPLOAD_BYTES = 256 * KIB  # a spec file; the spec itself is at most 256 KiB as JSON
MOST_FORM_BYTES = 2 * KIB * KIB  # the whole form: every field of the largest spec, and an upload
MOST_FIELDS = 5000  # every row of the largest spec's lists (256 each), field by field
Reply = TypeVar("Reply", bound=msgspec.Struct)
DURATIONS = ("1h", "4h", "12h", "1d", "3d", "7d")

# The texts the page's script shows, translated into the page as data.
PAGE_TEXTS: tuple[str, ...] = (
    N_("Starts now"), N_("Queues: position {position}, about {time}"), N_("Queues: position {position}"),
    N_("{count} jobs ahead"), N_("Cannot start: {reason}"), N_("Predicting…"),
    N_("The prediction is not available: fix the fields marked above."), N_("The prediction is not available"),
    N_("Idle"), N_("Tight"), N_("Choose one or more flavors first."), N_("No schedulable node for these flavors."),
    N_("Loading…"), N_("Hide YAML"), N_("YAML"),
)
NOTICES: dict[str, str] = {
    "uploaded": N_("The form is filled from the spec file. Check it, then create the job."),
    "applied": N_("The form is filled from the YAML. Check it, then create the job."),
}


@dataclass(frozen=True)
class Catalogue:
    """What the form offers: the flavors (with the boards queued jobs need) and the images marked for training."""

    flavors: list[FlavorInfo]
    demand: dict[str, BoardDemand]
    images: list[tuple[str, str]]  # (NAME:TAG, what it is built for)
    problem: CommandError | None = None

    @property
    def boards(self) -> list[str]:
        return sorted({info.flavor.board for info in self.flavors if info.flavor.board})


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f}".removesuffix(".0")


def amount(value: float) -> str:
    return f"{value:g}"


# --- the page -----------------------------------------------------------------------------------------------------


class CreatePage:
    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/jobs/new", self.page, methods=["GET"]),
            Route("/jobs/new", self.post, methods=["POST"]),
            Route("/jobs/new/resources", self.resources, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        """The empty form, or (`?clone=JOB`) the form filled with that job's spec (克隆)."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        projects = session.identity.projects
        draft = Draft(job_id=new_job_id(), project=projects[0] if projects else "default")
        source = request.query_params.get("clone", "").strip()
        if source:
            try:
                details = await self.console.ask(session, GET_JOB, GetJob(job_id=source[:64]))
            except Refused as refused:
                return self.console.refused_page(request, session, refused.error)
            draft = draft_from_spec(details.spec, job_id=draft.job_id, clone=details.job.job_id)
            draft.name = draft.name[:LONGEST_NAME - len(CLONE_SUFFIX)] + CLONE_SUFFIX
        return await self._form_page(request, session, draft)

    async def post(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        try:
            form = await self.console.checked_form(request, session, limit=MOST_FORM_BYTES, max_fields=MOST_FIELDS,
                                                     max_files=1)
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        try:
            return await self._act(request, session, form)
        finally:
            await form.close()

    async def _act(self, request: Request, session: Session, form: FormData) -> Response:
        action = form_text(form, "action") or "create"
        draft = draft_from_form(form)
        if action == "check":
            document, spec, errors = read_spec(draft)
            return JSONResponse({"valid": spec is not None, "spec": document if spec is not None else None,
                                 "yaml": yaml_of(document), "errors": msgspec.to_builtins(errors)})
        if action == "yaml":
            document, _, errors = read_spec(draft)
            return await self._form_page(request, session, draft, errors=errors, yaml_text=yaml_of(document))
        if action in ("upload", "apply-yaml"):
            return await self._fill(request, session, form, draft, action)
        return await self._create(request, session, draft)

    async def _fill(self, request: Request, session: Session, form: FormData, draft: Draft, action: str) -> Response:
        """The form filled from a spec file, or from the YAML edited on the page; what cannot be read leaves the
        form as it was and says why."""
        if action == "upload":
            upload = form.get("spec_file")
            if not isinstance(upload, UploadFile) or not upload.filename:
                return await self._form_page(request, session, draft, status_code=400, errors=[FieldError(
                    field="(document)", message=self.console.text(request, N_("Choose a spec file to upload.")))])
            data = await upload.read(MOST_UPLOAD_BYTES + 1)
        else:
            text = form.get("spec_yaml")
            data = text.encode() if isinstance(text, str) else b""
        if len(data) > MOST_UPLOAD_BYTES:
            return await self._form_page(request, session, draft, status_code=413, errors=[FieldError(
                field="(document)", message=f"is over the limit of {MOST_UPLOAD_BYTES} bytes")])
        spec, errors = spec_from_file(data)
        if spec is None:
            return await self._form_page(request, session, draft, errors=errors, status_code=422,
                                         yaml_text=data.decode(errors="replace") if action == "apply-yaml" else None)
        filled = draft_from_spec(spec, job_id=draft.job_id, clone=draft.clone)
        notice = NOTICES["uploaded" if action == "upload" else "applied"]
        return await self._form_page(request, session, filled, errors=errors, notice=notice)

    async def _create(self, request: Request, session: Session, draft: Draft) -> Response:
        _, spec, errors = read_spec(draft)
        if spec is None:
            return await self._form_page(request, session, draft, errors=errors, status_code=422)
        try:
            if draft.clone:
                # Cloning (O1) records the job it came from and checks that the person may clone it (J2); every
                # field is sent, so the new job's spec is the form's whatever the source's says.
                await self.console.ask(session, CLONE_JOB, CloneJob(source_job_id=draft.clone, job_id=draft.job_id,
                                                                    overrides=msgspec.to_builtins(spec)))
            else:
                await self.console.ask(session, SUBMIT_JOB, SubmitJob(job_id=draft.job_id, spec=spec))
        except Refused as refused:
            if refused.error.code == "conflict":  # the id names another job: a new one for the next attempt
                draft.job_id = new_job_id()
            return await self._form_page(request, session, draft, problem=refused.error, errors=refused.error.errors,
                                         status_code=STATUS.get(refused.error.code, 500))
        return redirect(f"/jobs/{draft.job_id}")

    async def resources(self, request: Request) -> Response:
        """集群可用资源 without the page's script: the schedulable nodes of the chosen flavors."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        flavors = list(dict.fromkeys(f for f in request.query_params.getlist("flavor") if f))[:MAX_LIST_ITEMS]
        nodes: list[NodeResources] = []
        if flavors:
            try:
                nodes = (await self.console.ask(session, GET_RESOURCES, GetResources(flavors=flavors))).nodes
            except Refused as refused:
                return self.console.refused_page(request, session, refused.error)
        return self.console.render(request, "create_resources.html", session=session, flavors=flavors, nodes=nodes,
                                   gib=gib, amount=amount)

    async def _catalogue(self, session: Session) -> Catalogue:
        """The flavors and images to offer; the form is still shown when either cannot be listed (and says so)."""
        asking_flavors = self._asked(session, LIST_FLAVORS, ListFlavors())
        asking_images = self._asked(session, LIST_IMAGES, ListImages())
        listed, images = await asyncio.gather(asking_flavors, asking_images)
        problem = next((answer for answer in (listed, images) if isinstance(answer, CommandError)), None)
        flavors = FlavorList(flavors=[], demand=[]) if isinstance(listed, CommandError) else listed
        marked = [] if isinstance(images, CommandError) else [
            (record.ref, ", ".join(record.boards)) for record in images.images if record.training]
        return Catalogue(flavors=flavors.flavors, demand={d.board: d for d in flavors.demand}, images=marked,
                         problem=problem)

    async def _asked(self, session: Session, operation: Operation[Any, Reply], request: msgspec.Struct,
                     ) -> Reply | CommandError:
        try:
            reply: Reply = await self.console.ask(session, operation, request)
        except Refused as refused:
            return refused.error
        return reply

    async def _form_page(self, request: Request, session: Session, draft: Draft, *,
                         errors: list[FieldError] | None = None, problem: CommandError | None = None,
                         yaml_text: str | None = None, notice: str | None = None,
                         status_code: int = 200) -> Response:
        catalogue = await self._catalogue(session)
        shown = errors or []
        by_slot: dict[str, list[FieldError]] = {}
        for error in shown:
            by_slot.setdefault(slot_of(error.field), []).append(error)
        listed = {info.flavor.name for info in catalogue.flavors}
        images = catalogue.images + ([(draft.image, "")] if draft.image and draft.image not in
                                     {ref for ref, _ in catalogue.images} else [])
        projects = list(dict.fromkeys([*session.identity.projects, draft.project or "default"]))
        texts = {text: self.console.text(request, text) for text in PAGE_TEXTS}
        return self.console.render(
            request, "create.html", session=session, draft=draft, catalogue=catalogue, images=images,
            unlisted_flavors=[name for name in draft.flavors if name not in listed], projects=projects,
            general_errors=by_slot.pop("", []), field_errors=by_slot, problem=problem, yaml_text=yaml_text,
            notice=notice, page_texts=texts, durations=DURATIONS, gib=gib, amount=amount, status_code=status_code)
