"""The create-job form and a job spec, both ways: a form read into a spec as the CLI reads a spec file (each
error named by its field and shown beside it), and a spec (a job being cloned, an uploaded file) made into the
form's values. Pure: no request, no I/O."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import yaml
from starlette.datastructures import FormData

from libs.contracts.ids import is_job_id, new_job_id
from libs.contracts.jobspec import (
    FieldError,
    JobSpec,
    SpecError,
    decode_spec,
    field_error_from_msgspec,
    validate_spec,
)
from libs.contracts.strict import decode_strict
from services.gateway.bodies import form_text

CLONE_SUFFIX = "-clone"
LONGEST_NAME = 128

# The lists of a spec edited as rows, each row's fields with their defaults (a check box is a bool).
ROW_FIELDS: dict[str, dict[str, str | bool]] = {
    "tasks": {"algorithm": "", "source": "private", "version": "", "read_only": False, "command": ""},
    "datasets": {"name": "", "source": "private", "version": "", "read_only": True},
    "annotation_datasets": {"name": "", "version": "", "read_only": True},
    "models": {"name": "", "source": "private", "version": ""},
    "volumes": {"name": ""},
}
ROW_NAME = re.compile(r"^(tasks|datasets|annotation_datasets|models|volumes)-(\d{1,4})-([a-z_]+)$")
SLOTS = frozenset(JobSpec.__struct_fields__)  # where a field's error is shown: its top-level field


# --- the form as typed: every value kept as written, so a refused form shows it again ---------------------------


def row_defaults(kind: str) -> dict[str, Any]:
    return dict(ROW_FIELDS[kind])


@dataclass
class Draft:
    """The form's values. Numbers stay text until read as a spec, so that what was typed is shown again."""

    job_id: str
    clone: str = ""
    name: str = ""
    project: str = "default"
    access: str = "none"
    type: str = "regular"
    priority: str = "normal"
    mode: str = "single-node"
    nodes: str = "1"
    parameter_servers: str = "0"
    flavors: list[str] = field(default_factory=list)
    node_names: str = ""
    driver_version: str = ""
    pool: str = ""
    image: str = ""
    algorithm: dict[str, Any] = field(default_factory=lambda: {"name": "", "source": "private", "version": "",
                                                               "read_only": False})
    command: str = ""
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {kind: [] for kind in ROW_FIELDS})
    output: str = ""
    env: str = ""
    checkpoint_resume: bool = False
    max_resumes: str = "3"
    graceful_shutdown_seconds: str = "60"
    elastic: bool = False
    min_nodes: str = "1"
    allow_scale_up: bool = True
    allow_scale_down: bool = True
    performance: bool = False
    threshold: str = ""
    performance_action: str = "alert"
    direction: str = "above"
    window: str = "10"
    fault_restart: bool = False
    max_restarts: str = "1"
    data_preparation: bool = False
    debug_terminal: bool = False
    retention: str = ""
    duration: str = ""
    before_start: str = ""
    after_end: str = ""

    def rows_with_blank(self, kind: str) -> list[dict[str, Any]]:
        """The rows to show: those given and one empty row to fill (the page's script adds more)."""
        return [*self.rows[kind], row_defaults(kind)]


_SCALARS = ("clone", "name", "project", "access", "type", "priority", "mode", "nodes", "parameter_servers",
            "node_names", "driver_version", "pool", "image", "command", "output", "env", "max_resumes",
            "graceful_shutdown_seconds", "min_nodes", "threshold", "performance_action", "direction", "window",
            "max_restarts", "retention", "duration", "before_start", "after_end")
_CHOICES = frozenset({"project", "access", "type", "priority", "mode", "performance_action", "direction"})
_SWITCHES = ("checkpoint_resume", "elastic", "allow_scale_up", "allow_scale_down", "performance", "fault_restart",
             "data_preparation", "debug_terminal")


def draft_from_form(form: FormData) -> Draft:
    job_id = form_text(form, "job_id")
    draft = Draft(job_id=job_id if is_job_id(job_id) else new_job_id())
    for name in _SCALARS:
        # A choice the form did not send (no radio button checked) is the spec's default, as in a spec file.
        setattr(draft, name, form_text(form, name) or (getattr(draft, name) if name in _CHOICES else ""))
    for name in _SWITCHES:
        setattr(draft, name, bool(form_text(form, name)))
    draft.flavors = list(dict.fromkeys(v.strip() for v in form.getlist("flavors") if isinstance(v, str) and v.strip()))
    draft.algorithm = {"name": form_text(form, "algorithm_name"),
                       "source": form_text(form, "algorithm_source") or "private",
                       "version": form_text(form, "algorithm_version"),
                       "read_only": bool(form_text(form, "algorithm_read_only"))}
    found: dict[str, dict[int, dict[str, Any]]] = {kind: {} for kind in ROW_FIELDS}
    for key in form:
        named = ROW_NAME.match(key)
        if named is None or named.group(3) not in ROW_FIELDS[named.group(1)]:
            continue
        kind, index, part = named.group(1), int(named.group(2)), named.group(3)
        row = found[kind].setdefault(index, row_defaults(kind) | {k: False for k, v in ROW_FIELDS[kind].items()
                                                                    if isinstance(v, bool)})
        row[part] = bool(form_text(form, key)) if isinstance(ROW_FIELDS[kind][part], bool) else form_text(form, key)
    for kind, rows in found.items():
        # A row whose every text is empty is the blank row left to fill: not part of the spec.
        draft.rows[kind] = [row for _, row in sorted(rows.items())
                            if any(isinstance(v, str) and v and k != "source" for k, v in row.items())]
    return draft


def draft_from_spec(spec: JobSpec, *, job_id: str, clone: str = "") -> Draft:
    resume, terminal, lifecycle = spec.checkpoint_resume, spec.debug_terminal, spec.lifecycle
    draft = Draft(
        job_id=job_id, clone=clone, name=spec.name, project=spec.project, access=spec.access, type=spec.type,
        priority=spec.priority, mode=spec.mode, nodes=str(spec.nodes), parameter_servers=str(spec.parameter_servers),
        flavors=list(spec.flavors), node_names=", ".join(spec.node_names), driver_version=spec.driver_version or "",
        pool=spec.pool or "", image=spec.image or "", command=spec.command or "",
        output=spec.output.name if spec.output else "",
        env="\n".join(f"{key}={value}" for key, value in spec.env.items()),
        data_preparation=spec.data_preparation,
        fault_restart=spec.fault_restart is not None,
        max_restarts=str(spec.fault_restart.max_restarts) if spec.fault_restart else "1",
        debug_terminal=terminal is not None and terminal.enabled,
        retention=(terminal.retention or "") if terminal else "", duration=spec.duration or "",
        before_start=(lifecycle.before_start or "") if lifecycle else "",
        after_end=(lifecycle.after_end or "") if lifecycle else "",
    )
    if spec.algorithm is not None:
        draft.algorithm = {"name": spec.algorithm.name, "source": spec.algorithm.source,
                           "version": spec.algorithm.version or "", "read_only": spec.algorithm.read_only}
    draft.rows = {
        "tasks": [{"algorithm": t.algorithm.name, "source": t.algorithm.source, "version": t.algorithm.version or "",
                   "read_only": t.algorithm.read_only, "command": t.command} for t in spec.tasks],
        "datasets": [{"name": d.name, "source": d.source, "version": d.version or "", "read_only": d.read_only}
                     for d in spec.datasets],
        "annotation_datasets": [{"name": a.name, "version": a.version, "read_only": a.read_only}
                                for a in spec.annotation_datasets],
        "models": [{"name": m.name, "source": m.source, "version": m.version or ""} for m in spec.models],
        "volumes": [{"name": v.name} for v in spec.volumes],
    }
    if resume is not None:
        draft.checkpoint_resume = True
        draft.max_resumes, draft.graceful_shutdown_seconds = str(resume.max_resumes), str(
            resume.graceful_shutdown_seconds)
        if resume.elastic is not None:
            draft.elastic, draft.min_nodes = True, str(resume.elastic.min_nodes)
            draft.allow_scale_up = resume.elastic.allow_scale_up
            draft.allow_scale_down = resume.elastic.allow_scale_down
        if resume.performance is not None:
            draft.performance, draft.threshold = True, f"{resume.performance.threshold:g}"
            draft.performance_action, draft.direction = resume.performance.action, resume.performance.direction
            draft.window = str(resume.performance.window)
    return draft


# --- the form read as a spec, every problem named by its field as the CLI names it ------------------------------


class _Reading:
    """Numbers and lines read from the form's text; what cannot be read is an error on its field."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def whole(self, where: str, text: str) -> int | None:
        if re.fullmatch(r"-?\d{1,9}", text):
            return int(text)
        self.errors.append(FieldError(field=where, message=f"{text[:40]!r} is not a whole number"))
        return None

    def number(self, where: str, text: str) -> float | None:
        try:
            value = float(text) if len(text) <= 40 else math.nan
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return value
        self.errors.append(FieldError(field=where, message=f"{text[:40]!r} is not a number", hint="e.g. 0.8"))
        return None

    def env(self, text: str) -> dict[str, str]:
        variables: dict[str, str] = {}
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, equals, value = line.partition("=")
            if not equals:
                self.errors.append(FieldError(field="env", message=f"line {number} has no '='",
                                              hint="one KEY=VALUE per line"))
                continue
            variables[key.strip()] = value
        return variables


def _put(document: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        document[key] = value


def _algorithm(row: Mapping[str, Any], name_key: str = "name") -> dict[str, Any]:
    algorithm: dict[str, Any] = {"name": row[name_key], "source": row["source"] or "private"}
    if row["version"]:
        algorithm["version"] = row["version"]
    algorithm["read_only"] = bool(row["read_only"])
    return algorithm


def _optional_version(row: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {key: row[key] for key in keys if not (key == "version" and not row[key])}


def document_of(draft: Draft) -> tuple[dict[str, Any], list[FieldError]]:
    """The spec the form describes, as a YAML or JSON document says it (fields left empty are left out), and the
    values that could not be read."""
    read = _Reading()
    document: dict[str, Any] = {"name": draft.name, "project": draft.project or "default", "access": draft.access,
                                "type": draft.type, "priority": draft.priority, "mode": draft.mode}
    _put(document, "nodes", read.whole("nodes", draft.nodes or "1"))
    if draft.mode == "tensorflow":  # J8: parameter servers exist only in the TensorFlow mode
        _put(document, "parameter_servers", read.whole("parameter_servers", draft.parameter_servers or "0"))
    document["flavors"] = list(draft.flavors)
    if pinned := [name for name in re.split(r"[\s,]+", draft.node_names) if name]:
        document["node_names"] = pinned
    for key in ("driver_version", "pool", "image"):
        if value := getattr(draft, key):
            document[key] = value
    if draft.type == "batch":
        document["tasks"] = [{"algorithm": _algorithm(row, "algorithm"), "command": row["command"]}
                             for row in draft.rows["tasks"]]
    else:
        if draft.algorithm["name"]:
            document["algorithm"] = _algorithm(draft.algorithm)
        if draft.command:
            document["command"] = draft.command
    lists = {"datasets": ("name", "source", "version", "read_only"),
             "annotation_datasets": ("name", "version", "read_only"), "models": ("name", "source", "version"),
             "volumes": ("name",)}
    for kind, keys in lists.items():
        if draft.rows[kind]:
            document[kind] = [_optional_version(row, *keys) for row in draft.rows[kind]]
    if draft.output:
        document["output"] = {"name": draft.output}
    if variables := read.env(draft.env):
        document["env"] = variables
    if draft.checkpoint_resume:
        document["checkpoint_resume"] = _resume(draft, read)
    if draft.fault_restart:
        restarts = read.whole("fault_restart.max_restarts", draft.max_restarts or "1")
        document["fault_restart"] = {"max_restarts": restarts if restarts is not None else 1}
    if draft.data_preparation:
        document["data_preparation"] = True
    if draft.debug_terminal:
        document["debug_terminal"] = {"enabled": True, **({"retention": draft.retention} if draft.retention else {})}
    if draft.duration:
        document["duration"] = draft.duration
    scripts = {key: value for key in ("before_start", "after_end") if (value := getattr(draft, key))}
    if scripts:
        document["lifecycle"] = scripts
    return document, read.errors


def _resume(draft: Draft, read: _Reading) -> dict[str, Any]:
    resume: dict[str, Any] = {}
    _put(resume, "max_resumes", read.whole("checkpoint_resume.max_resumes", draft.max_resumes or "3"))
    _put(resume, "graceful_shutdown_seconds",
         read.whole("checkpoint_resume.graceful_shutdown_seconds", draft.graceful_shutdown_seconds or "60"))
    if draft.elastic:
        elastic: dict[str, Any] = {"allow_scale_up": draft.allow_scale_up, "allow_scale_down": draft.allow_scale_down}
        _put(elastic, "min_nodes", read.whole("checkpoint_resume.elastic.min_nodes", draft.min_nodes or "1"))
        resume["elastic"] = elastic
    if draft.performance:
        performance: dict[str, Any] = {"action": draft.performance_action or "alert",
                                       "direction": draft.direction or "above"}
        _put(performance, "threshold", read.number("checkpoint_resume.performance.threshold", draft.threshold))
        _put(performance, "window", read.whole("checkpoint_resume.performance.window", draft.window or "10"))
        resume["performance"] = performance
    return resume


def read_spec(draft: Draft) -> tuple[dict[str, Any], JobSpec | None, list[FieldError]]:
    """The form's document, its spec when it is acceptable (None otherwise), and every problem found: the values
    the form could not read, then what `decode_spec` (the CLI's reading of a spec file) says."""
    document, errors = document_of(draft)
    try:
        spec = decode_spec(msgspec.json.encode(document))
    except SpecError as exc:
        return document, None, errors + exc.errors
    return document, (spec if not errors else None), errors


def spec_from_file(data: bytes) -> tuple[JobSpec | None, list[FieldError]]:
    """A spec file (YAML, or JSON, which YAML reads too): the spec when its fields decode, with what its rules say
    (shown beside the prefilled form), or None and why it cannot be read."""
    try:
        spec: JobSpec = decode_strict(data, JobSpec, yaml=True)
    except msgspec.ValidationError as exc:
        return None, [field_error_from_msgspec(exc)]
    except (msgspec.DecodeError, ValueError) as exc:
        return None, [FieldError(field="(document)", message=f"is not a YAML job spec: {str(exc)[:300]}")]
    return spec, validate_spec(spec)


def yaml_of(document: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(document), sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)


def slot_of(where: str) -> str:
    """Where an error on `where` (e.g. `tasks[0].command`, `env.KEY`) is shown: beside its top-level field, or
    above the form ("") for the whole document."""
    head = re.split(r"[.\[]", where, maxsplit=1)[0]
    return head if head in SLOTS else ""
