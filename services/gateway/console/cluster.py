"""The cluster pages (seed 001, 集群可用资源 and 算力规格): the nodes with their health and problems, the flavors
and the boards queued jobs need, the alerts (kept up to date by cluster.js), the nodes' dataset and image caches
and the image catalogue, the autoscaler's instances, queues and log; and, for administrators, the image marks, the
components marked faulty and the platform settings, each changed by a form with the session's CSRF token.

Every part of a page asks the service that answers it; a service that does not answer leaves a notice in its
part and the rest of the page is shown. The pages show what the CLI shows (`trainyard nodes`, `flavors`,
`alerts`, `cache`, `autoscaler`, `image list`, `admin settings`), as tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

import msgspec
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from libs.contracts.datacache import CachedImage, CacheEntry
from libs.contracts.events import AlertRaised, EventEnvelope
from libs.contracts.health import COMPONENT_PATTERN
from libs.contracts.operations.alerts import LIST_ALERTS, MAX_ALERT_PAGE, AlertPage, ListAlerts
from libs.contracts.operations.autoscaler import (
    AUTOSCALER_LOG,
    MAX_AUTOSCALER_LOG_PAGE,
    QUEUE_STATUS,
    AutoscalerLog,
    GetAutoscalerLog,
    GetQueueStatus,
    QueueStatus,
)
from libs.contracts.operations.base import CommandError, Operation
from libs.contracts.operations.cache import LIST_CACHE, ListCache, NodeCache
from libs.contracts.operations.cluster import (
    CHANGE_SETTINGS,
    GET_SETTINGS,
    LIST_FLAVORS,
    LIST_NODES,
    MARK_COMPONENT,
    ChangeSettings,
    GetSettings,
    ListFlavors,
    ListNodes,
    MarkComponent,
    NodeView,
)
from libs.contracts.operations.images import LIST_IMAGES, MARK_IMAGE, ListImages, MarkImage
from libs.contracts.scheduling import AdminSettings
from services.gateway.bodies import form_text
from services.gateway.calls import Refused
from services.gateway.console.base import Console, moment, redirect
from services.gateway.console.i18n import N_
from services.gateway.problems import STATUS
from services.gateway.sessions import Session

T = TypeVar("T")
ReplyT = TypeVar("ReplyT", bound=msgspec.Struct)

SHOWN_ALERTS = 200  # the newest alerts a page shows; cluster.js adds the ones raised while it is open
SHOWN_LOG_ENTRIES = 200  # the newest entries of the autoscaler's log
MOST_PAGES = 50  # pages read to reach the newest alerts (or log entries): a bound on one page view's cost
MOST_REASON_CHARS = 500
MOST_REF_CHARS = 300

# A service that does not answer: its part of the page says so, the rest is shown.
UNAVAILABLE_TEXT: dict[str, str] = {
    "scheduler": N_("The scheduler does not answer right now, so this part cannot be shown. Try again shortly."),
    "monitor": N_("The monitor does not answer right now, so this part cannot be shown. Try again shortly."),
    "autoscaler": N_("The autoscaler does not answer right now, so this part cannot be shown. Try again shortly."),
}
NODE_STATUS_TEXT: dict[str, str] = {
    "ready": N_("Ready"), "lost": N_("Lost"), "unhealthy": N_("Unhealthy"), "draining": N_("Draining"),
    "disk-full": N_("Disk full"),
}
ALERT_KIND_TEXT: dict[str, str] = {
    "node-unhealthy": N_("Node unhealthy"), "node-lost": N_("Node lost"), "job-resuming": N_("Job resuming"),
    "resume-limit": N_("Resume limit reached"), "performance": N_("Performance"),
    "precheck-failed": N_("Pre-check failed"), "message-set-aside": N_("Message set aside"),
    "instance-boot-timeout": N_("Instance did not boot"), "provisioning-failing": N_("Provisioning failing"),
}
INSTANCE_STATE_TEXT: dict[str, str] = {
    "requested": N_("Requested"), "booting": N_("Booting"), "ready": N_("Ready"), "draining": N_("Draining"),
}
LOG_EVENT_TEXT: dict[str, str] = {
    "InstanceRequested": N_("Requested"), "InstanceLaunched": N_("Launched"), "InstanceReady": N_("Ready"),
    "InstanceDraining": N_("Draining"), "InstanceKept": N_("Kept"), "InstanceReleased": N_("Released"),
    "ProvisionFailed": N_("Could not start"),
}
NOTICES: dict[str, str] = {
    "marked": N_("The component is marked faulty."), "cleared": N_("The mark is cleared."),
    "image-marked": N_("The image is marked for training jobs."),
    "image-unmarked": N_("The image is no longer marked for training jobs."),
    "settings": N_("The settings are changed."), "unchanged": N_("Nothing was changed."),
}
MARKED_BY = " faulty (marked by "  # how the monitor words a component an administrator marked


@dataclass(frozen=True)
class Setting:
    """One administrator setting as the form shows it: its field, what kind of value it takes, and its texts."""

    name: str
    kind: str  # count, least-one, percent, duration or switch
    label: str
    hint: str = ""


SETTINGS: tuple[Setting, ...] = (
    Setting("urgent_cap", "count", N_("Urgent cap"), N_("Running and queued urgent jobs per user and project.")),
    Setting("sharing_enabled", "switch", N_("Sharing"),
            N_("Off: every job's access for others in its project is no access.")),
    Setting("max_resumes_cap", "count", N_("Most resumes a job may ask for")),
    Setting("max_graceful_shutdown_seconds", "count", N_("Longest graceful shutdown (seconds)")),
    Setting("debug_retention", "duration", N_("Debug environment kept for"), N_("e.g. 30m, 4h, 2d")),
    Setting("cache_retention", "duration", N_("Unused cached dataset kept for"), N_("e.g. 12h, 7d")),
    Setting("job_retention", "duration", N_("Ended job kept in memory for"),
            N_("At least 1m; search finds it after. e.g. 7d")),
    Setting("cache_high_percent", "percent", N_("Dataset cache at most (percent of a node's disk)")),
    Setting("cache_low_percent", "percent", N_("Dataset cache cut down to (percent of the disk)")),
    Setting("disk_high_percent", "percent", N_("No new work above (percent of the disk full)")),
    Setting("disk_low_percent", "percent", N_("Work again at or below (percent full)")),
    Setting("max_queued_jobs_per_user", "count", N_("Queued jobs per user"), N_("All projects together; 0: no limit.")),
    Setting("submit_rate", "count", N_("Submissions per second per user"), N_("0: no limit.")),
    Setting("submit_burst", "least-one", N_("Submissions at once per user"), N_("Also the largest array.")),
)


@dataclass(frozen=True)
class Answer(Generic[T]):
    """A service's reply, or, when the service did not answer, the notice its part of the page shows."""

    reply: T | None = None
    missing: str | None = None  # the notice (a text of UNAVAILABLE_TEXT)
    detail: str = ""


@dataclass(frozen=True)
class Mark:
    """A component an administrator marked faulty, as the node's problems tell it."""

    node: str
    component: str
    said: str  # who marked it and why


def marks_of(nodes: list[NodeView]) -> list[Mark]:
    found: list[Mark] = []
    for view in nodes:
        for problem in view.problems:
            component, marker, rest = problem.partition(MARKED_BY)
            if marker and COMPONENT_PATTERN.match(component):
                found.append(Mark(node=view.info.name, component=component, said=rest.removesuffix(")")))
    return found


def mib(size: int) -> str:
    return f"{size / 2**20:.1f}"


def gib_of_mib(size: float) -> str:
    return f"{size / 1024:.1f}"


def disk_text(cache: NodeCache) -> str:
    if not cache.disk_bytes:
        return ""
    return f"{100 * cache.used_bytes / cache.disk_bytes:.0f}% / {cache.disk_bytes / 2**30:.0f} GiB"


def pin_jobs(entry: CacheEntry | CachedImage) -> list[str]:
    """The jobs using a cached dataset or image now (a pin is <job>/<attempt>/<task>/<rank>), each once."""
    return list(dict.fromkeys(pin.split("/")[0] for pin in entry.pins))


def log_details(envelope: EventEnvelope) -> tuple[str, str]:
    """An entry of the autoscaler's log as its instance and the rest of its event, `key=value` each."""
    fields = msgspec.structs.asdict(envelope.event)
    instance = str(fields.pop("instance", "") or "")
    parts: list[str] = []
    for key, value in fields.items():
        if value in (None, [], {}, ""):
            continue
        if isinstance(value, datetime):
            value = moment(value)
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        parts.append(f"{key}={value}")
    return instance, " ".join(parts)


def as_alert(envelope: EventEnvelope) -> AlertRaised | None:
    return envelope.event if isinstance(envelope.event, AlertRaised) else None


class FormRefusal(Exception):
    """A form whose values are not valid: the page is shown again with why."""

    def __init__(self, error: CommandError) -> None:
        super().__init__(error.message)
        self.error = error


class ClusterPages:
    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/cluster", self.nodes, methods=["GET"]),
            Route("/cluster/alerts", self.alerts, methods=["GET"]),
            Route("/cluster/caches", self.caches, methods=["GET"]),
            Route("/cluster/autoscaler", self.autoscaler, methods=["GET"]),
            Route("/cluster/admin", self.admin, methods=["GET"]),
            Route("/cluster/admin/mark-component", self.mark_component, methods=["POST"]),
            Route("/cluster/admin/mark-image", self.mark_image, methods=["POST"]),
            Route("/cluster/admin/change-settings", self.change_settings, methods=["POST"]),
        ]

    # --- asking ---------------------------------------------------------------------------------------------

    async def _answer(self, session: Session, operation: Operation[Any, ReplyT],
                      request: msgspec.Struct) -> Answer[ReplyT]:
        """The reply; a service that does not answer as a notice; any other refusal raised (`Refused`)."""
        try:
            return Answer(reply=await self.console.ask(session, operation, request))
        except Refused as refused:
            if refused.error.code != "unavailable":
                raise
            return Answer(missing=UNAVAILABLE_TEXT[operation.answered_by], detail=refused.error.message)

    @staticmethod
    async def _paged(read: Callable[[int], Awaitable[tuple[list[EventEnvelope], int, bool]]],
                     keep: int) -> tuple[list[EventEnvelope], int]:
        """The newest `keep` envelopes of a service's log read page after page, newest first, and where the
        next page would start."""
        found: list[EventEnvelope] = []
        after = 0
        for _ in range(MOST_PAGES):
            envelopes, after, more = await read(after)
            found = [*found, *envelopes][-keep:]
            if not more:
                break
        return found[::-1], after

    # --- everyone's pages -------------------------------------------------------------------------------------

    async def nodes(self, request: Request) -> Response:
        """The nodes (S7: status, OS, memory, CPUs, boards, what runs there and why a node is unhealthy) and the
        flavors (S8) with the boards queued jobs need."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        try:
            nodes, flavors = await asyncio.gather(self._answer(session, LIST_NODES, ListNodes()),
                                                  self._answer(session, LIST_FLAVORS, ListFlavors()))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        counts: dict[str, int] = {}
        for view in nodes.reply.nodes if nodes.reply else []:
            counts[view.status] = counts.get(view.status, 0) + 1
        return self.console.render(request, "cluster.html", session=session, here="nodes", nodes=nodes,
                                   flavors=flavors, counts=counts, node_status=NODE_STATUS_TEXT, gib=gib_of_mib)

    async def alerts(self, request: Request) -> Response:
        """M7: the alerts the person may see, newest first; the page's script adds new ones as they are raised."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)

        async def read(after: int) -> tuple[list[EventEnvelope], int, bool]:
            page: AlertPage = await self.console.ask(session, LIST_ALERTS,
                                                     ListAlerts(after=after, limit=MAX_ALERT_PAGE))
            return page.alerts, page.next_after, page.more

        missing: Answer[None] = Answer()
        shown: list[EventEnvelope] = []
        after = 0
        try:
            shown, after = await self._paged(read, SHOWN_ALERTS)
        except Refused as refused:
            if refused.error.code != "unavailable":
                return self.console.refused_page(request, session, refused.error)
            missing = Answer(missing=UNAVAILABLE_TEXT["monitor"], detail=refused.error.message)
        rows = [(envelope, alert) for envelope in shown if (alert := as_alert(envelope)) is not None]
        texts = {"live": self.console.text(request, N_("Live: new alerts appear as they are raised.")),
                 "polling": self.console.text(request, N_("New alerts are looked for every few seconds.")),
                 "reconnecting": self.console.text(request, N_("Reconnecting…")),
                 "unavailable": self.console.text(request, N_("The monitor does not answer right now.")),
                 "kinds": {kind: self.console.text(request, text) for kind, text in ALERT_KIND_TEXT.items()}}
        return self.console.render(request, "cluster_alerts.html", session=session, here="alerts", rows=rows,
                                   missing=missing, after=after, kinds=ALERT_KIND_TEXT, page_texts=texts)

    async def caches(self, request: Request) -> Response:
        """D1, D2: each node's dataset cache; J10: the images each node keeps unpacked in its image cache, and
        the images jobs may run in."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        try:
            caches, images = await asyncio.gather(self._answer(session, LIST_CACHE, ListCache()),
                                                  self._answer(session, LIST_IMAGES, ListImages()))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        return self.console.render(request, "cluster_caches.html", session=session, here="caches", caches=caches,
                                   images=images, mib=mib, disk_text=disk_text, pin_jobs=pin_jobs)

    async def autoscaler(self, request: Request) -> Response:
        """A6: idle, busy and coming instances, the queued jobs per flavor, the types cooling down, and the
        autoscaler's own log."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)

        async def read(after: int) -> tuple[list[EventEnvelope], int, bool]:
            page: AutoscalerLog = await self.console.ask(
                session, AUTOSCALER_LOG, GetAutoscalerLog(after=after, limit=MAX_AUTOSCALER_LOG_PAGE))
            return page.entries, page.next_after, page.more

        try:
            status = await self._answer(session, QUEUE_STATUS, GetQueueStatus())
            entries: list[EventEnvelope] = []
            if status.reply is not None:
                entries, _ = await self._paged(read, SHOWN_LOG_ENTRIES)
        except Refused as refused:
            if refused.error.code != "unavailable":
                return self.console.refused_page(request, session, refused.error)
            status = Answer(missing=UNAVAILABLE_TEXT["autoscaler"], detail=refused.error.message)
        summary = self._instance_counts(status.reply)
        log = [(envelope, type(envelope.event).__name__, *log_details(envelope)) for envelope in entries]
        return self.console.render(request, "cluster_autoscaler.html", session=session, here="autoscaler",
                                   status=status, summary=summary, log=log, states=INSTANCE_STATE_TEXT,
                                   events=LOG_EVENT_TEXT)

    @staticmethod
    def _instance_counts(status: QueueStatus | None) -> dict[str, int]:
        instances = status.instances if status else []
        return {"idle": sum(1 for i in instances if i.state == "ready" and not i.busy),
                "busy": sum(1 for i in instances if i.state == "ready" and i.busy),
                "coming": sum(1 for i in instances if i.state in ("requested", "booting")),
                "draining": sum(1 for i in instances if i.state == "draining")}

    # --- administrators --------------------------------------------------------------------------------------

    def _not_admin(self, request: Request, session: Session) -> Response:
        return self.console.refused_page(request, session, CommandError(
            code="forbidden", message=self.console.text(request, N_("Only administrators may see this page.")),
            hint=self.console.text(request, N_("Ask an administrator."))))

    async def admin(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        if not session.admin:
            return self._not_admin(request, session)
        notice = NOTICES.get(request.query_params.get("done", ""))
        return await self._admin_page(request, session, notice=notice)

    async def _admin_page(self, request: Request, session: Session, *, notice: str | None = None,
                          error: CommandError | None = None, values: Mapping[str, str] | None = None) -> Response:
        """The settings form, the components marked faulty with a form to mark one, and the image catalogue
        with each image's training mark; after a refused change, with why and the values as they were sent."""
        try:
            settings, nodes, images = await asyncio.gather(
                self._answer(session, GET_SETTINGS, GetSettings()), self._answer(session, LIST_NODES, ListNodes()),
                self._answer(session, LIST_IMAGES, ListImages()))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        current: dict[str, str] = {}
        if settings.reply is not None:
            current = {setting.name: self._shown_value(getattr(settings.reply.settings, setting.name))
                       for setting in SETTINGS}
        marks = marks_of(nodes.reply.nodes) if nodes.reply else []
        return self.console.render(
            request, "cluster_admin.html", session=session, here="admin", settings=settings, nodes=nodes,
            images=images, marks=marks, fields=SETTINGS, values={**current, **(values or {})}, notice=notice,
            error=error, status_code=STATUS.get(error.code, 400) if error else 200)

    @staticmethod
    def _shown_value(value: object) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    async def _admin_form(self, request: Request) -> tuple[Session, FormData] | Response:
        """The signed-in administrator and their form, checked to come from the console's own page; else the
        page to answer with."""
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        if not session.admin:
            return self._not_admin(request, session)
        try:
            form = await self.console.checked_form(request, session, max_fields=len(SETTINGS) + 8)
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        return session, form

    async def mark_component(self, request: Request) -> Response:
        """M2 drills: mark a node's component faulty (the node is unhealthy until the mark is cleared), or clear
        a mark."""
        checked = await self._admin_form(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        node, component = form_text(form, "node"), form_text(form, "component")
        reason, faulty = form_text(form, "reason"), form_text(form, "faulty") != "no"
        try:
            if not node:
                raise FormRefusal(CommandError(code="invalid-request", message=self.console.text(
                    request, N_("Choose the node."))))
            if not COMPONENT_PATTERN.match(component):
                raise FormRefusal(CommandError(code="invalid-request", message=self.console.text(request, N_(
                    "Name the component as kind:name, with kind nic, board or runtime, e.g. board:0, nic:eth0 "
                    "or runtime:storage."))))
            if len(reason) > MOST_REASON_CHARS:
                raise FormRefusal(CommandError(code="invalid-request", message=self.console.text(
                    request, N_("The reason is too long."))))
            await self.console.ask(session, MARK_COMPONENT, MarkComponent(node=node, component=component,
                                                                          faulty=faulty, reason=reason))
        except (Refused, FormRefusal) as refused:
            return await self._admin_page(request, session, error=refused.error)
        return redirect("/cluster/admin?done=" + ("marked" if faulty else "cleared"))

    async def mark_image(self, request: Request) -> Response:
        """J10: mark an image for training jobs, or take the mark away (accepted jobs keep their image)."""
        checked = await self._admin_form(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        ref, training = form_text(form, "ref")[:MOST_REF_CHARS], form_text(form, "training") == "yes"
        try:
            await self.console.ask(session, MARK_IMAGE, MarkImage(ref=ref, training=training))
        except Refused as refused:
            return await self._admin_page(request, session, error=refused.error)
        return redirect("/cluster/admin?done=" + ("image-marked" if training else "image-unmarked"))

    async def change_settings(self, request: Request) -> Response:
        """The settings whose value the form changed, and only those: another administrator's change to the
        others meanwhile stands."""
        checked = await self._admin_form(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        sent = {setting.name: form_text(form, setting.name) for setting in SETTINGS}
        try:
            current: AdminSettings = (await self.console.ask(session, GET_SETTINGS, GetSettings())).settings
            changes = self._changes(request, current, sent)
            if not changes:
                return redirect("/cluster/admin?done=unchanged")
            await self.console.ask(session, CHANGE_SETTINGS, ChangeSettings(**changes))
        except (Refused, FormRefusal) as refused:
            return await self._admin_page(request, session, error=refused.error, values=sent)
        return redirect("/cluster/admin?done=settings")

    def _changes(self, request: Request, current: AdminSettings, sent: Mapping[str, str]) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        for setting in SETTINGS:
            text = sent.get(setting.name, "")
            if not text:
                continue
            value = self._parsed(request, setting, text)
            if value != getattr(current, setting.name):
                changes[setting.name] = value
        return changes

    def _parsed(self, request: Request, setting: Setting, text: str) -> object:
        label = self.console.text(request, setting.label)
        if setting.kind == "switch":
            if text not in ("on", "off"):
                raise FormRefusal(CommandError(code="invalid-request", message=f"{label}: on / off"))
            return text == "on"
        if setting.kind == "duration":
            return text[:32]
        try:
            number: float = float(text) if setting.kind == "percent" else int(text)
        except ValueError:
            number = -1
        least = 1 if setting.kind == "least-one" else 0
        if not number >= least or (setting.kind == "percent" and not number <= 100):
            message = (N_("a percentage from 0 to 100") if setting.kind == "percent"
                       else N_("a whole number, at least 1") if least else N_("a whole number, 0 or more"))
            raise FormRefusal(CommandError(code="invalid-request",
                                           message=f"{label}: {self.console.text(request, message)}"))
        return number
