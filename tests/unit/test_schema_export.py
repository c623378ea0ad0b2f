"""docs/schemas/ is generated from the contracts and must never go stale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import pytest

from libs.contracts import schema_export
from libs.contracts.events import EVENT_TYPES
from libs.contracts.jobspec import MODES
from libs.contracts.operations.catalogue import PEOPLE_REQUESTS as Request

SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def _load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    return document


@pytest.mark.parametrize("name", sorted(schema_export.render_all()))
def test_committed_schema_matches_a_fresh_export(name: str) -> None:
    committed = SCHEMAS / name
    assert committed.is_file(), f"{committed} is missing; run `make schemas`"
    assert committed.read_text(encoding="utf-8") == schema_export.render_all()[name], (
        f"{committed} is stale; run `make schemas` and commit the result"
    )


def test_no_unexpected_files_in_the_schema_directory() -> None:
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(schema_export.render_all())


def test_export_is_deterministic_and_check_passes_after_export(tmp_path: Path) -> None:
    written = schema_export.export(tmp_path)
    assert sorted(p.name for p in written) == sorted(schema_export.render_all())
    assert schema_export.stale(tmp_path) == []
    assert schema_export.main(["--check", str(tmp_path)]) == 0
    (tmp_path / "events.schema.json").write_text("{}\n", encoding="utf-8")
    assert schema_export.stale(tmp_path) == ["events.schema.json"]
    assert schema_export.main(["--check", str(tmp_path)]) == 1


def test_job_spec_schema_requires_a_name_and_forbids_unknown_fields() -> None:
    document = _load("jobspec.schema.json")
    assert document["$ref"] == "#/$defs/JobSpec"
    job_spec = document["$defs"]["JobSpec"]
    assert job_spec["required"] == ["name"]
    assert job_spec["additionalProperties"] is False
    assert document["$defs"]["AlgorithmRef"]["additionalProperties"] is False
    assert set(job_spec["properties"]["mode"]["enum"]) == set(MODES)
    assert job_spec["properties"]["mode"]["default"] == "single-node"


def test_events_schema_names_every_event_tag() -> None:
    document = _load("events.schema.json")
    mapping = document["discriminator"]["mapping"]
    assert document["discriminator"]["propertyName"] == "type"
    assert mapping["JobSubmitted.v1"] == "#/$defs/JobSubmitted"
    assert set(mapping) == {f"{t.name()}.v1" for t in EVENT_TYPES}


def test_stored_events_tolerate_unknown_fields_but_requests_do_not() -> None:
    assert "additionalProperties" not in _load("events.schema.json")["$defs"]["JobSpec"]
    requests = _load("requests.schema.json")["$defs"]
    assert requests["SubmitJob"]["additionalProperties"] is False
    assert requests["JobSpec"]["additionalProperties"] is False


def test_envelope_schema_wraps_the_event_union() -> None:
    document = _load("envelope.schema.json")
    envelope = document["$defs"]["EventEnvelope"]
    assert {"event_id", "service", "aggregate_type", "aggregate_id", "version", "position",
            "recorded_at", "event"} <= set(envelope["required"])
    assert "JobSubmitted" in document["$defs"]


def test_request_reply_and_agent_schemas_name_their_tags() -> None:
    requests = _load("requests.schema.json")["discriminator"]["mapping"]
    assert {f"{t.__name__}.v1" for t in get_args(Request)} == set(requests)
    assert {"SubmitJob.v1", "ChangePriority.v1", "PredictJob.v1", "SearchJobs.v1", "WhoAmI.v1"} <= set(requests)
    replies = _load("replies.schema.json")["discriminator"]["mapping"]
    assert "Error.v1" in replies and "JobAccepted.v1" in replies
    agent = _load("agent.schema.json")
    for name in ("RegisterNode", "Heartbeat", "StartProcess", "StopProcesses", "NodeAccepted", "ProcessAccepted",
                 "Stopped", "ProcessStarted", "ProcessExited", "LogChunk"):
        assert name in agent["$defs"], name


def test_docstrings_are_exported_dedented_whatever_msgspec_keeps() -> None:
    # Some msgspec releases keep a docstring's indentation in `description`, others dedent it: the export
    # must give one text either way, so the committed schemas do not depend on the installed release.
    indented = {"title": "Thing", "description": "First line,\n    second line.",
                "properties": {"description": {"type": "string", "description": "  Its text.\n    More."}},
                "required": ["description"]}
    assert schema_export._cleaned(indented) == {
        "title": "Thing", "description": "First line,\nsecond line.",
        "properties": {"description": {"type": "string", "description": "Its text.\nMore."}},
        "required": ["description"]}
