"""The job specification (SPEC J1–J18) and its validation at the edge.

`JobSpec` is what a user writes (YAML or JSON). `decode_spec` refuses unknown fields, so a typo is
an error rather than a silently ignored setting. `validate_spec` applies the cross-field rules that a
type alone cannot express and returns every problem at once, each naming its field and the fix.
"""

from __future__ import annotations

import functools
import re
import shlex
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.strict import decode_strict

# Names appear in NATS subjects and in paths under /workspace, so keep them to a safe alphabet.
SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z"
NODE_NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z"

ResourceName = Annotated[str, Meta(pattern=SAFE_NAME, description="letters, digits, '_', '.', '-'")]
NodeName = Annotated[str, Meta(pattern=NODE_NAME, description="lower-case DNS label")]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]

Access = Literal["read-write", "read-only", "none"]
JobType = Literal["regular", "batch"]
Priority = Literal["normal", "urgent", "very-urgent"]
Mode = Literal["pytorch", "pytorch-deepspeed", "horovod", "tensorflow", "single-node"]

MODES: tuple[Mode, ...] = ("pytorch", "pytorch-deepspeed", "horovod", "tensorflow", "single-node")
PRIORITY_RANK: dict[str, int] = {"very-urgent": 0, "urgent": 1, "normal": 2}


class _Spec(Struct, frozen=True, kw_only=True):
    """Base of every user-written part. Values are immutable; unknown fields are refused where
    people and clients write specs (`decode_spec`, request decoding: see `strict`), but tolerated
    inside stored events so that an older reader survives a newer writer."""


class AlgorithmRef(_Spec, frozen=True):
    """J6: the code to run, mounted at /workspace/algorithm: an own algorithm, or a favourite (another
    user's shared algorithm) at one version."""

    name: ResourceName
    source: Literal["private", "favorite"] = "private"
    version: ResourceName | None = None
    read_only: bool = False


class DatasetRef(_Spec, frozen=True):
    """J5: a dataset, own (`private`) or a favourite with a version."""

    name: ResourceName
    source: Literal["private", "favorite"] = "private"
    version: ResourceName | None = None
    read_only: bool = True


class AnnotationDatasetRef(_Spec, frozen=True):
    """J5: the annotation files of one version of an annotation dataset."""

    name: ResourceName
    version: ResourceName
    read_only: bool = True


class ModelRef(_Spec, frozen=True):
    """J17: a model, always mounted read-only."""

    name: ResourceName
    source: Literal["pretrained", "private", "favorite"] = "private"
    version: ResourceName | None = None


class VolumeRef(_Spec, frozen=True):
    """J17: a storage volume, always writable."""

    name: ResourceName


class OutputRef(_Spec, frozen=True):
    """J7: the output model location, mounted writable at /workspace/outputs."""

    name: ResourceName


class BatchTask(_Spec, frozen=True):
    """J3: one task of a batch job, with its own algorithm and run command."""

    algorithm: AlgorithmRef
    command: str


class Elastic(_Spec, frozen=True):
    """J12/S10: run on any node count from `min_nodes` up to the requested count."""

    min_nodes: PositiveInt
    allow_scale_up: bool = True
    allow_scale_down: bool = True


class PerformanceDetection(_Spec, frozen=True):
    """J12/M6: act when hardware time / e2e time crosses `threshold` over `window` iterations."""

    threshold: Annotated[float, Meta(gt=0)]
    action: Literal["alert", "reschedule"] = "alert"
    direction: Literal["above", "below"] = "above"
    window: PositiveInt = 10


class CheckpointResume(_Spec, frozen=True):
    """J12: resume from a checkpoint after hardware faults."""

    max_resumes: NonNegativeInt = 3
    graceful_shutdown_seconds: NonNegativeInt = 60
    elastic: Elastic | None = None
    performance: PerformanceDetection | None = None


class FaultRestart(_Spec, frozen=True):
    """J13: restart a failed command up to `max_restarts` times."""

    max_restarts: PositiveInt


class DebugTerminal(_Spec, frozen=True):
    """J15: keep the environment after an abnormal end; `retention` defaults to the admin setting."""

    enabled: bool = True
    retention: str | None = None


class LifecycleScripts(_Spec, frozen=True):
    """J18: commands run at defined points of the job's life."""

    before_start: str | None = None
    after_end: str | None = None


class JobSpec(_Spec, frozen=True):
    """Everything a user states about a training job (SPEC J1–J18)."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    project: ResourceName = "default"
    access: Access = "none"
    type: JobType = "regular"
    priority: Priority = "normal"
    mode: Mode = "single-node"
    nodes: PositiveInt = 1
    parameter_servers: NonNegativeInt = 0
    flavors: list[ResourceName] = msgspec.field(default_factory=list)
    node_names: list[NodeName] = msgspec.field(default_factory=list)
    driver_version: str | None = None
    pool: ResourceName | None = None
    image: str | None = None
    algorithm: AlgorithmRef | None = None
    command: str | None = None
    tasks: list[BatchTask] = msgspec.field(default_factory=list)
    datasets: list[DatasetRef] = msgspec.field(default_factory=list)
    annotation_datasets: list[AnnotationDatasetRef] = msgspec.field(default_factory=list)
    models: list[ModelRef] = msgspec.field(default_factory=list)
    volumes: list[VolumeRef] = msgspec.field(default_factory=list)
    output: OutputRef | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    checkpoint_resume: CheckpointResume | None = None
    fault_restart: FaultRestart | None = None
    data_preparation: bool = False
    debug_terminal: DebugTerminal | None = None
    duration: str | None = None
    lifecycle: LifecycleScripts | None = None

    @property
    def max_duration_seconds(self) -> int | None:
        """J16: the duration limit in seconds, or None for no limit."""
        return parse_duration(self.duration) if self.duration else None


class FieldError(Struct, frozen=True, kw_only=True):
    """One problem with a spec: which field, what is wrong, and how to fix it."""

    field: str
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        text = f"{self.field}: {self.message}"
        return f"{text} (hint: {self.hint})" if self.hint else text


class SpecError(ValueError):
    """A job spec that cannot be accepted; `errors` lists every problem found."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


# --- Bounded inputs ---------------------------------------------------------------------------------
# A spec is stored whole in the scheduler's JobSubmitted event and its command, env and mounts once in the
# launcher's LaunchPlanned event (whatever the node count: each node's launch is derived from it), and every
# event must fit one NATS message (1 MiB by default).
# The limits are far above what a real job needs (a long `torchrun ... --config ...` line is a few
# hundred bytes; a large env a few KiB), yet keep every event well under that size. They are checked
# before anything else and in time linear in the input, so an oversized spec costs no parsing.

KIB = 1024
# The whole spec, encoded as JSON: a quarter of a NATS message, so JobSubmitted fits with room to spare.
MAX_SPEC_BYTES = 256 * KIB
# One command (`command`, `tasks[].command`, lifecycle scripts). Checked before shlex parses it,
# whose cost grows with the square of a token's length (64 KiB: about 0.1 s).
MAX_COMMAND_LENGTH = 64 * KIB
# `env`: how many variables, how long a name and a value, and all names and values together.
MAX_ENV_VARS = 256
MAX_ENV_NAME_LENGTH = 256
MAX_ENV_VALUE_LENGTH = 32 * KIB
MAX_ENV_BYTES = 128 * KIB
# Each list of the spec (flavors, node_names, tasks, datasets, annotation_datasets, models, volumes).
MAX_LIST_ITEMS = 256
# Short free-form fields: image, driver_version, duration, debug_terminal.retention.
MAX_SHORT_TEXT_LENGTH = 512
# A spec file, before it is parsed: YAML may take more room than the JSON it becomes.
MAX_DOCUMENT_BYTES = 2 * MAX_SPEC_BYTES
# Field names quote env keys: cut them short in errors.
_FIELD_KEY_LENGTH = 64


def _env_field(key: str) -> str:
    return f"env.{key}" if len(key) <= _FIELD_KEY_LENGTH else f"env.{key[:_FIELD_KEY_LENGTH]}…"


def size_errors(spec: JobSpec) -> list[FieldError]:
    """Every field over its limit, found by lengths alone (no parsing), in time linear in the spec."""
    errors: list[FieldError] = []
    add = errors.append

    def too_long(field: str, text: str | None, limit: int, what: str = "characters") -> None:
        if text is not None and len(text) > limit:
            add(FieldError(field=field, message=f"is {len(text)} {what} long, over the limit of {limit}",
                           hint="keep long content in a file under the algorithm and pass its path"))

    commands = [("command", spec.command)] + [(f"tasks[{i}].command", t.command)
                                              for i, t in enumerate(spec.tasks[:MAX_LIST_ITEMS])]
    if spec.lifecycle is not None:
        commands += [("lifecycle.before_start", spec.lifecycle.before_start),
                     ("lifecycle.after_end", spec.lifecycle.after_end)]
    for field, command in commands:
        too_long(field, command, MAX_COMMAND_LENGTH)
    for field, text in (("image", spec.image), ("driver_version", spec.driver_version),
                        ("duration", spec.duration),
                        ("debug_terminal.retention", spec.debug_terminal and spec.debug_terminal.retention)):
        too_long(field, text or None, MAX_SHORT_TEXT_LENGTH)
    for field, items in (("flavors", spec.flavors), ("node_names", spec.node_names), ("tasks", spec.tasks),
                         ("datasets", spec.datasets), ("annotation_datasets", spec.annotation_datasets),
                         ("models", spec.models), ("volumes", spec.volumes)):
        if len(items) > MAX_LIST_ITEMS:
            add(FieldError(field=field, message=f"has {len(items)} entries, over the limit of {MAX_LIST_ITEMS}"))
    if len(spec.env) > MAX_ENV_VARS:
        add(FieldError(field="env", message=f"has {len(spec.env)} variables, over the limit of {MAX_ENV_VARS}"))
    env_bytes = 0
    for key, value in spec.env.items():
        env_bytes += len(key) + len(value)
        too_long(_env_field(key), key if len(key) > MAX_ENV_NAME_LENGTH else None, MAX_ENV_NAME_LENGTH)
        if len(value) > MAX_ENV_VALUE_LENGTH:
            add(FieldError(field=_env_field(key), message=f"has a value {len(value)} characters long, "
                           f"over the limit of {MAX_ENV_VALUE_LENGTH}",
                           hint="put large settings in a file under the algorithm and pass its path"))
    if env_bytes > MAX_ENV_BYTES:
        add(FieldError(field="env", message=f"holds {env_bytes} characters of names and values, "
                       f"over the limit of {MAX_ENV_BYTES}"))
    spec_bytes = len(msgspec.json.encode(spec))
    if spec_bytes > MAX_SPEC_BYTES:
        add(FieldError(field="(document)", message=f"is {spec_bytes} bytes as JSON, over the limit of "
                       f"{MAX_SPEC_BYTES}"))
    return errors


_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_OPERATOR_CHARS = frozenset(";&|<>()")
_QUOTED_COMMAND_LENGTH = 500


def parse_duration(text: str) -> int:
    """Parse `90s`, `30m`, `4h` or `2d` into seconds; raise ValueError otherwise."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration like 30m, 4h or 2d")
    return int(match.group(1)) * _DURATION_UNITS[match.group(2)]


@functools.lru_cache(maxsize=1024)
def command_problem(command: str) -> str | None:
    """J11: why `command` does not begin with an executable, or None when it is fine.

    Shell syntax (variable assignments, `&&`, pipes, redirections) is refused because the
    platform runs the command directly, not through a shell. Remembered per command: a sweep's
    thousands of jobs share a few, and parsing one costs more than the rest of a spec's checks.
    """
    if not command.strip():
        return "is empty"
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:  # unbalanced quotes
        return f"cannot be parsed ({exc})"
    if _ENV_ASSIGNMENT.match(tokens[0]):
        return f"begins with the variable assignment {tokens[0][:100]!r}, not an executable"
    return _unquoted_shell_syntax(command.strip())


def _unquoted_shell_syntax(command: str) -> str | None:
    """The first shell operator (`&&`, `|`, `2>&1`, ...), command substitution or statement break
    outside quotes, if any.

    Quoted text is literal (`--sep "|"` is a plain argument, `bash -c "echo $(date)"` hands the
    substitution to bash) and a backslash escapes the next character, so a line continuation is not
    a second statement.
    """
    quote: str | None = None
    index = 0
    while index < len(command):
        char = command[index]
        if quote == "'":
            if char == "'":
                quote = None
        elif char == "\\":
            index += 1
        elif quote == '"':
            if char == '"':
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "`" or command.startswith("$(", index):
            return "uses shell command substitution"
        elif char in _SHELL_OPERATOR_CHARS:
            end = index
            while end < len(command) and command[end] in _SHELL_OPERATOR_CHARS:
                end += 1
            return f"uses the shell operator {command[index:end]!r}"
        elif char == "\n":
            return "has several lines, i.e. several statements"
        index += 1
    return None


def _command_errors(field: str, command: str | None) -> list[FieldError]:
    if command is None:
        return [FieldError(field=field, message="is required", hint='e.g. "python3 train.py"')]
    problem = command_problem(command)
    if problem is None:
        return []
    # The hint quotes the command: a short one, so that the refusal stays small.
    wrapped = shlex.quote(command) if len(command) <= _QUOTED_COMMAND_LENGTH else "'...'"
    return [
        FieldError(
            field=field,
            message=f"must begin with an executable; it {problem}",
            hint=f"wrap shell syntax as bash -c {wrapped}, "
            "and put variables in `env:` instead of KEY=VALUE prefixes",
        )
    ]


def validate_spec(spec: JobSpec) -> list[FieldError]:
    """Apply the cross-field rules of J1–J18; an empty list means the spec is acceptable.

    Sizes are checked first (`size_errors`); a spec over a limit gets only those errors, so that no
    rule parses an oversized field and the refusal stays small."""
    if errors := size_errors(spec):
        return errors
    add = errors.append

    if not spec.name.strip():
        add(FieldError(field="name", message="must not be blank"))

    # J3 / J6 / J11: what runs.
    if spec.type == "regular":
        if spec.tasks:
            add(FieldError(field="tasks", message="is only for batch jobs", hint="set type: batch"))
        if spec.algorithm is None:
            add(FieldError(field="algorithm", message="a regular job needs exactly one algorithm"))
        errors.extend(_command_errors("command", spec.command))
    else:
        if not spec.tasks:
            add(FieldError(field="tasks", message="a batch job needs at least one task",
                           hint="list tasks, each with an algorithm and a command"))
        for field, value in (("algorithm", spec.algorithm), ("command", spec.command)):
            if value is not None:
                add(FieldError(field=field, message="a batch job takes its algorithm and command per task",
                               hint="move them under tasks:"))
        for index, task in enumerate(spec.tasks):
            errors.extend(_command_errors(f"tasks[{index}].command", task.command))

    # J7: exactly one output location.
    if spec.output is None:
        add(FieldError(field="output", message="an output model location is required",
                       hint="output: {name: my-outputs}"))

    # J8: distributed mode and node counts.
    if spec.parameter_servers and spec.mode != "tensorflow":
        add(FieldError(field="parameter_servers", message="is only for the tensorflow mode",
                       hint="remove it or set mode: tensorflow"))
    if spec.mode == "single-node" and spec.nodes != 1:
        add(FieldError(field="nodes", message="single-node jobs run on exactly 1 node",
                       hint="set nodes: 1 or choose a distributed mode"))

    # J9: flavors and placement restrictions.
    if not spec.flavors:
        add(FieldError(field="flavors", message="at least one node flavor is required"))
    if len(set(spec.flavors)) != len(spec.flavors):
        add(FieldError(field="flavors", message="lists a flavor twice"))
    if spec.node_names and (spec.driver_version or spec.pool):
        add(FieldError(field="node_names", message="node pinning cannot be combined with "
                       "driver_version or pool", hint="keep node_names, or driver_version/pool"))

    # J12 / J13: checkpoint resume and fault restart.
    resume = spec.checkpoint_resume
    if resume is not None:
        if spec.fault_restart is not None:
            add(FieldError(field="fault_restart", message="excludes checkpoint_resume",
                           hint="choose one of checkpoint_resume and fault_restart"))
        if spec.type != "regular":
            add(FieldError(field="checkpoint_resume", message="is only for regular jobs"))
        if spec.pool is None:
            add(FieldError(field="checkpoint_resume", message="needs a dedicated resource pool",
                           hint="set pool: <your dedicated pool>"))
        if resume.elastic is not None and resume.elastic.min_nodes > spec.nodes:
            add(FieldError(field="checkpoint_resume.elastic.min_nodes",
                           message=f"is {resume.elastic.min_nodes}, more than nodes ({spec.nodes})"))

    # J14: data preparation copies datasets, so they must be read-only.
    if spec.data_preparation:
        for index, dataset in enumerate(spec.datasets):
            if not dataset.read_only:
                add(FieldError(field=f"datasets[{index}].read_only",
                               message="data preparation needs read-only datasets",
                               hint="set read_only: true or turn data_preparation off"))

    algorithms = [("algorithm", spec.algorithm)] + [(f"tasks[{i}].algorithm", t.algorithm)
                                                     for i, t in enumerate(spec.tasks)]
    for field, algorithm in algorithms:
        if algorithm is not None and algorithm.source == "favorite" and algorithm.version is None:
            add(FieldError(field=f"{field}.version", message="a favourite algorithm needs a version"))
    for index, dataset in enumerate(spec.datasets):
        if dataset.source == "favorite" and dataset.version is None:
            add(FieldError(field=f"datasets[{index}].version", message="a favourite dataset needs a version"))
    for index, model in enumerate(spec.models):
        if model.source == "favorite" and model.version is None:
            add(FieldError(field=f"models[{index}].version", message="a favourite model needs a version"))

    for key in spec.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", key):
            add(FieldError(field=f"env.{key}", message="is not a valid environment variable name"))

    for field, text in (("duration", spec.duration),
                        ("debug_terminal.retention", spec.debug_terminal and spec.debug_terminal.retention)):
        if text:
            try:
                parse_duration(text)
            except ValueError as exc:
                add(FieldError(field=field, message=str(exc)))

    if spec.lifecycle is not None:
        for point in ("before_start", "after_end"):
            script = getattr(spec.lifecycle, point)
            if script is not None:
                errors.extend(_command_errors(f"lifecycle.{point}", script))
    return errors


def check_document_size(data: bytes | str) -> None:
    """SpecError for a spec document longer than MAX_DOCUMENT_BYTES, before anything decodes it."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise SpecError([FieldError(field="(document)", message=f"is {len(data)} bytes long, over the limit of "
                                    f"{MAX_DOCUMENT_BYTES}")])


def decode_spec(data: bytes | str, *, yaml: bool = False) -> JobSpec:
    """Decode and validate a spec; raise SpecError naming every bad field."""
    check_document_size(data)
    try:
        spec: JobSpec = decode_strict(data, JobSpec, yaml=yaml)
    except msgspec.ValidationError as exc:
        raise SpecError([field_error_from_msgspec(exc)]) from None
    except msgspec.DecodeError as exc:
        raise SpecError([FieldError(field="(document)", message=f"is not valid: {exc}")]) from None
    errors = validate_spec(spec)
    if errors:
        raise SpecError(errors)
    return spec


def field_error_from_msgspec(exc: msgspec.ValidationError) -> FieldError:
    """Turn msgspec's "Expected ... - at `$.nodes`" into a FieldError on `nodes`."""
    text = str(exc)
    named = re.match(r"Object (contains unknown|missing required) field `(.+?)`(?: - at `\$\.?(.*)`)?$", text)
    if named:
        where = named.group(3)
        field = f"{where}.{named.group(2)}" if where else named.group(2)
        if named.group(1) == "missing required":
            return FieldError(field=field, message="is required")
        return FieldError(field=field, message="is not a known field", hint="check its spelling against docs/jobs.md")
    match = re.search(r" - at `\$\.?(.*)`$", text)
    if match:
        return FieldError(field=match.group(1) or "(document)", message=text[: match.start()])
    return FieldError(field="(document)", message=text)
