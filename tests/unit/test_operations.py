"""The operation catalogue: each operation declared once, consistently, and docs/cli.md's table made from it."""

from __future__ import annotations

from pathlib import Path

from libs.contracts.operations.base import RequestMessage
from libs.contracts.operations.catalogue import BY_NAME, BY_SUBJECT, OPERATIONS, sent_by, with_operations_table

ROOT = Path(__file__).resolve().parents[2]


def test_every_operation_has_a_subject_and_a_name_of_its_own() -> None:
    assert len(BY_SUBJECT) == len(OPERATIONS) == len(BY_NAME)


def test_peoples_commands_change_state_and_their_queries_do_not() -> None:
    for operation in sent_by("user"):
        kind = operation.subject.split(".")[1]
        assert kind in ("cmd", "query"), operation.subject
        assert operation.changes_state == (kind == "cmd"), operation.name


def test_peoples_requests_refuse_fields_they_do_not_know() -> None:
    """People's requests are decoded strictly (`RequestMessage`): a mistyped field is an error, not ignored."""
    for operation in sent_by("user"):
        assert issubclass(operation.request, RequestMessage), operation.name
        assert operation.authentication == "user-token", operation.name


def test_requests_to_agents_are_signed_by_the_one_service_that_sends_them_or_come_from_a_job() -> None:
    for operation in OPERATIONS:
        if operation.answered_by != "agent":
            continue
        assert len(operation.callers) == 1, operation.name
        assert operation.authentication == ("job-token" if "job" in operation.callers else "control-signature")
        assert operation.subject_for("node-a").startswith("trainyard.agent.node-a.")


def test_the_table_of_operations_in_docs_cli_md_is_fresh() -> None:
    """`make schemas` writes it; an operation added or changed without it fails here."""
    page = (ROOT / "docs" / "cli.md").read_text()
    assert page == with_operations_table(page)
