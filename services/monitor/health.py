"""Node health verdicts (M2): what is faulty on a node, from its agent's probes and the marks.

A component is faulty when the agent's latest probe says so or an administrator marked it faulty
(a mark wins: it names who marked it and why). Problems are recorded as readable strings such as
`board:0 faulty (marked by root: drill)`; whether they changed is judged on the faulty components
and the marks, not on the wording of probe details, which may carry measured values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from libs.contracts.events import ComponentMarked
from libs.contracts.health import COMPONENT_KINDS, ComponentHealth, ComponentKind

MARK_PREFIX = "marked by "


def marked_component(mark: ComponentMarked) -> ComponentHealth:
    """A mark as a faulty component, its detail saying who marked it and why."""
    kind, _, name = mark.component.partition(":")
    detail = MARK_PREFIX + mark.by + (f": {mark.reason}" if mark.reason else "")
    return ComponentHealth(kind=_kind(kind), name=name, healthy=False, detail=detail)


def parse_problem(problem: str) -> ComponentHealth:
    """A recorded problem string back as the faulty component it was made from."""
    key, _, rest = problem.partition(" faulty")
    kind, _, name = key.partition(":")
    detail = rest[2:-1] if rest.startswith(" (") and rest.endswith(")") else ""
    return ComponentHealth(kind=_kind(kind), name=name, healthy=False, detail=detail)


def _kind(text: str) -> ComponentKind:
    return next((k for k in COMPONENT_KINDS if k == text), "runtime")


def is_mark(component: ComponentHealth) -> bool:
    return component.detail.startswith(MARK_PREFIX)


def faulty_components(probed: Iterable[ComponentHealth] | None, marks: Mapping[str, ComponentMarked],
                      recorded: Sequence[str] = ()) -> list[ComponentHealth]:
    """Every faulty component of a node, by component name.

    `probed` is the latest probe, or None when no probe arrived since the monitor started: the
    probed problems last recorded (`recorded`) then still stand.
    """
    if probed is None:
        found = {c.key: c for c in map(parse_problem, recorded) if not is_mark(c)}
    else:
        found = {c.key: c for c in probed if not c.healthy}
    for key, mark in marks.items():
        if mark.faulty:
            found[key] = marked_component(mark)
    return [found[key] for key in sorted(found)]


def problems_of(faulty: Iterable[ComponentHealth]) -> list[str]:
    return [str(c) for c in faulty]


def signature(problems: Iterable[str]) -> frozenset[tuple[str, str]]:
    """What makes two lists of problems different: the faulty components and the marks' details."""
    return frozenset((c.key, c.detail if is_mark(c) else "") for c in map(parse_problem, problems))


def changed(recorded: Sequence[str], problems: Sequence[str]) -> bool:
    return signature(recorded) != signature(problems)
