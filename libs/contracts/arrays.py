"""Job arrays: many jobs from one spec, as Slurm's `sbatch --array` makes them, and parameter sweeps.

An array is written as Slurm writes it: `0-999`, `1-10:2` (every second), `0,6,16-32` (a list), each
optionally ending in `%N`, at most N of its jobs running at once. A sweep is one or more `NAME=v1,v2,...`
parameters, whose cross product makes the jobs (the first parameter changes slowest). Each job is an
ordinary job of its own; its index is in `TRAINYARD_ARRAY_INDEX`, and `{index}` (and, in a sweep,
`{NAME}`) is replaced in its name and command. The parsing here is shared by the CLI, the client and the
scheduler, so a bad expression is refused with the same words wherever it is typed.
"""

from __future__ import annotations

import itertools
import re
import secrets
from typing import Annotated

from msgspec import Meta, Struct

MAX_ARRAY_JOBS = 10_000  # jobs in one array (Slurm's MaxArraySize defaults to 1,001)
MAX_INDEX = 9_999_999
MAX_EXPRESSION_LENGTH = 1_000
MAX_SWEEP_PARAMETERS = 16
MAX_SWEEP_VALUE_LENGTH = 1_024
INDEX_VARIABLE = "TRAINYARD_ARRAY_INDEX"
ID_VARIABLE = "TRAINYARD_ARRAY_ID"

ARRAY_ID = re.compile(r"^array-[0-9a-f]{12}\Z")
_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z"
_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?\Z")

SweepName = Annotated[str, Meta(pattern=_NAME, description="an environment variable's name")]
SweepValue = Annotated[str, Meta(max_length=MAX_SWEEP_VALUE_LENGTH)]


class SweepParameter(Struct, frozen=True, kw_only=True):
    """One parameter of a sweep: an environment variable and the values it takes, in order."""

    name: SweepName
    values: Annotated[list[SweepValue], Meta(min_length=1, max_length=MAX_ARRAY_JOBS)]


class ArrayMember(Struct, frozen=True, kw_only=True):
    """Which array a job belongs to, at which index."""

    array_id: str
    index: int


class ArrayIndices(Struct, frozen=True, kw_only=True):
    """A parsed array expression: its indices, ascending and each once, and its `%N` cap."""

    indices: list[int]
    max_running: int | None = None


class ArrayError(ValueError):
    """An array expression or a sweep that cannot be used; the message says what to write instead."""


def new_array_id() -> str:
    """A random array id such as `array-3f9a1c0b7d2e`."""
    return f"array-{secrets.token_hex(6)}"


def is_array_id(text: str) -> bool:
    return bool(ARRAY_ID.match(text))


def parse_indices(text: str) -> ArrayIndices:
    """`0-999`, `1-10:2`, `0,6,16-32`, each optionally with `%N`: the indices and the cap."""
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise ArrayError(f"the array expression is {len(text)} characters long, over {MAX_EXPRESSION_LENGTH}")
    expression, _, cap = text.strip().partition("%")
    max_running = None
    if cap:
        if not cap.isdigit() or int(cap) < 1:
            raise ArrayError(f"{text!r}: after '%' comes how many may run at once, a whole number of at least 1")
        max_running = int(cap)
    indices: set[int] = set()
    for item in expression.split(","):
        match = _ITEM.match(item.strip())
        if match is None:
            raise ArrayError(f"{text!r}: {item.strip()!r} is not an index, a range A-B or a stepped range A-B:S "
                             "(for example 0-999, 1-10:2 or 0,6,16-32%4)")
        first, last, step = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        if last < first or step < 1:
            raise ArrayError(f"{text!r}: in {item.strip()!r} the range must not end before it starts, and its "
                             "step must be at least 1")
        if last > MAX_INDEX:
            raise ArrayError(f"{text!r}: indices go up to {MAX_INDEX}")
        if len(indices) + (last - first) // step + 1 > MAX_ARRAY_JOBS:
            raise ArrayError(f"{text!r} makes more than {MAX_ARRAY_JOBS} jobs; split it into several arrays")
        indices.update(range(first, last + 1, step))
    return ArrayIndices(indices=sorted(indices), max_running=max_running)


def describe_indices(indices: list[int]) -> str:
    """Ascending indices written back as an expression (`0-999:2,1001`), as short as runs of a step make it."""
    parts: list[str] = []
    position = 0
    while position < len(indices):
        start = indices[position]
        if position + 2 < len(indices):
            step = indices[position + 1] - start
            end = position + 1
            while end + 1 < len(indices) and indices[end + 1] - indices[end] == step:
                end += 1
            if end - position >= 2:
                last = indices[end]
                parts.append(f"{start}-{last}" if step == 1 else f"{start}-{last}:{step}")
                position = end + 1
                continue
        parts.append(str(start))
        position += 1
    return ",".join(parts)


def parse_sweep(text: str) -> SweepParameter:
    """`NAME=v1,v2,...`: one parameter of a sweep."""
    name, equals, values = text.partition("=")
    if not equals or not re.match(_NAME, name.strip()):
        raise ArrayError(f"{text!r}: write a sweep parameter as NAME=value1,value2 (NAME as an environment "
                         "variable's: letters, digits and '_')")
    found = [value.strip() for value in values.split(",")]
    if any(not value for value in found):
        raise ArrayError(f"{text!r}: a value of {name.strip()} is empty")
    if any(len(value) > MAX_SWEEP_VALUE_LENGTH for value in found):
        raise ArrayError(f"{text!r}: a value is longer than {MAX_SWEEP_VALUE_LENGTH} characters")
    return SweepParameter(name=name.strip(), values=found)


def sweep_points(parameters: list[SweepParameter]) -> list[dict[str, str]]:
    """Every combination of the parameters' values, the first parameter changing slowest."""
    if len(parameters) > MAX_SWEEP_PARAMETERS:
        raise ArrayError(f"a sweep takes at most {MAX_SWEEP_PARAMETERS} parameters")
    names = [p.name for p in parameters]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ArrayError(f"a sweep parameter is given twice: {', '.join(twice)}")
    size = 1
    for parameter in parameters:
        size *= len(parameter.values)
        if size > MAX_ARRAY_JOBS:
            raise ArrayError(f"the sweep makes more than {MAX_ARRAY_JOBS} jobs; sweep fewer values at once")
    return [dict(zip(names, values, strict=True))
            for values in itertools.product(*(parameter.values for parameter in parameters))]
