"""O1: a cloned job's spec is the source's with the overrides applied in order, a dotted path setting one entry of
a field and keeping the others (services/scheduler/rules/clone.py)."""

from __future__ import annotations

from typing import Any

from libs.contracts.jobspec import FieldError
from services.scheduler.rules.clone import cloned_fields

SOURCE: dict[str, Any] = {"name": "orig", "nodes": 2, "env": {"A": "1"}, "checkpoint_resume": None,
                          "output": {"name": "out"}}


def test_a_path_sets_one_entry_and_keeps_its_siblings() -> None:
    merged = cloned_fields(SOURCE, {"env.B": "2", "output.name": "other"})
    assert isinstance(merged, dict)
    assert (merged["env"], merged["output"]) == ({"A": "1", "B": "2"}, {"name": "other"})
    assert SOURCE["env"] == {"A": "1"} and SOURCE["output"] == {"name": "out"}  # the source is left as it was


def test_a_path_through_a_null_field_makes_it() -> None:
    merged = cloned_fields(SOURCE, {"checkpoint_resume.elastic.min_nodes": 1})
    assert isinstance(merged, dict)
    assert merged["checkpoint_resume"] == {"elastic": {"min_nodes": 1}}


def test_overrides_apply_in_order() -> None:
    merged = cloned_fields(SOURCE, {"env.B": "2", "env": {"C": "3"}, "env.D": "4", "nodes": 4})
    assert isinstance(merged, dict)
    assert (merged["env"], merged["nodes"]) == ({"C": "3", "D": "4"}, 4)


def test_a_path_into_what_holds_no_fields_is_refused() -> None:
    assert cloned_fields(SOURCE, {"nodes.count": 2}) == [
        FieldError(field="nodes.count", message="nodes holds a value, not fields to set one of",
                   hint="set the whole of nodes instead")]
    refused = cloned_fields({**SOURCE, "tasks": []}, {"tasks.0": "x"})
    assert isinstance(refused, list) and refused[0].message == "tasks holds a list, not fields to set one of"


def test_unknown_fields_and_empty_names_are_refused_and_nothing_is_applied() -> None:
    errors = cloned_fields(SOURCE, {"nodez": 2, "env..A": "1", "name": "new"})
    assert isinstance(errors, list)
    assert [(e.field, e.message) for e in errors] == [("nodez", "is not a known field"),
                                                      ("env..A", "is not a field or a dotted path to one")]
