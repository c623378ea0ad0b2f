"""Overrides of a spec's fields (a clone's, O1, and `submit --set`'s) apply in order, a dotted path setting one
entry of a field and keeping the others (libs/contracts/overrides.py)."""

from __future__ import annotations

from datetime import date
from typing import Any

import msgspec
import pytest

from libs.contracts.jobspec import FieldError, SpecError
from libs.contracts.overrides import MAX_OVERRIDES, apply_overrides, overridden_document

SOURCE: dict[str, Any] = {"name": "orig", "nodes": 2, "env": {"A": "1"}, "checkpoint_resume": None,
                          "output": {"name": "out"}}


def test_a_path_sets_one_entry_and_keeps_its_siblings() -> None:
    merged = apply_overrides(SOURCE, {"env.B": "2", "output.name": "other"})
    assert isinstance(merged, dict)
    assert (merged["env"], merged["output"]) == ({"A": "1", "B": "2"}, {"name": "other"})
    assert SOURCE["env"] == {"A": "1"} and SOURCE["output"] == {"name": "out"}  # the source is left as it was


def test_a_path_through_a_null_field_makes_it() -> None:
    merged = apply_overrides(SOURCE, {"checkpoint_resume.elastic.min_nodes": 1})
    assert isinstance(merged, dict)
    assert merged["checkpoint_resume"] == {"elastic": {"min_nodes": 1}}


def test_overrides_apply_in_order() -> None:
    merged = apply_overrides(SOURCE, {"env.B": "2", "env": {"C": "3"}, "env.D": "4", "nodes": 4})
    assert isinstance(merged, dict)
    assert (merged["env"], merged["nodes"]) == ({"C": "3", "D": "4"}, 4)


def test_a_path_into_what_holds_no_fields_is_refused() -> None:
    assert apply_overrides(SOURCE, {"nodes.count": 2}) == [
        FieldError(field="nodes.count", message="nodes holds a value, not fields to set one of",
                   hint="set the whole of nodes instead")]
    refused = apply_overrides({**SOURCE, "tasks": []}, {"tasks.0": "x"})
    assert isinstance(refused, list) and refused[0].message == "tasks holds a list, not fields to set one of"


def test_unknown_fields_and_empty_names_are_refused_and_nothing_is_applied() -> None:
    errors = apply_overrides(SOURCE, {"nodez": 2, "env..A": "1", "name": "new"})
    assert isinstance(errors, list)
    assert [(e.field, e.message) for e in errors] == [("nodez", "is not a known field"),
                                                      ("env..A", "is not a field or a dotted path to one")]


def test_a_documents_overrides_come_back_as_yaml_to_decode_whole() -> None:
    data = overridden_document(b"name: x\nenv: {A: '1'}\n", {"env.B": "2", "nodes": 2}, yaml=True)
    assert msgspec.yaml.decode(data) == {"name": "x", "env": {"A": "1", "B": "2"}, "nodes": 2}


@pytest.mark.parametrize(("data", "yaml", "message"), [
    (b"- nodes\n", True, "is not a mapping of a job spec's fields"),
    (b"name: [x\n", True, "is not valid: "),
    (b"{", False, "is not valid: "),
])
def test_a_document_that_is_not_a_mapping_of_fields_is_refused(data: bytes, yaml: bool, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        overridden_document(data, {"nodes": 2}, yaml=yaml)
    [error] = refused.value.errors
    assert error.field == "(document)" and error.message.startswith(message)


def test_an_override_that_cannot_apply_to_a_document_is_refused() -> None:
    with pytest.raises(SpecError) as refused:
        overridden_document(b'{"nodes": 2}', {"nodes.count": 3})
    assert [e.field for e in refused.value.errors] == ["nodes.count"]


def test_a_path_deeper_than_any_field_is_refused_before_anything_is_nested() -> None:
    refused = apply_overrides(SOURCE, {"env" + ".a" * 5000: "x"})
    assert isinstance(refused, list)
    [error] = refused
    assert error.message == "is a path of 5001 names, deeper than any field of a job spec"
    assert len(error.field) == 200


def test_many_paths_into_one_field_each_copy_it_once() -> None:
    overrides = {f"env.K{i}": str(i) for i in range(MAX_OVERRIDES)}
    merged = apply_overrides(SOURCE, overrides)
    assert isinstance(merged, dict) and len(merged["env"]) == MAX_OVERRIDES + 1
    assert SOURCE["env"] == {"A": "1"}
    refused = apply_overrides(SOURCE, {**overrides, "nodes": 2})
    assert isinstance(refused, list)
    assert [(e.field, e.message) for e in refused] == [("(overrides)", f"are {MAX_OVERRIDES + 1}, more than "
                                                                        f"{MAX_OVERRIDES}")]


def test_a_documents_yaml_keeps_what_json_could_not_hold() -> None:
    data = overridden_document(b"name: x\nenv: {ON: '1'}\nwhen: 2024-01-01\n", {"nodes": 2}, yaml=True)
    assert msgspec.yaml.decode(data) == {"name": "x", "env": {True: "1"}, "when": date(2024, 1, 1), "nodes": 2}
