"""Whole-string patterns match whole strings: an id, a name or a key with a newline at its end (which Python's `$`
lets through) is refused at the edge, and the JSON Schemas still say `$`, as JSON Schema's patterns mean it."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from libs.contracts.arrays import is_array_id
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import JobSpec, OutputRef
from libs.contracts.operations.jobs import SubmitJob
from libs.contracts.patterns import for_json_schema

CONTRACTS = Path(__file__).resolve().parents[2] / "libs" / "contracts"
DOLLAR_PATTERN = re.compile(r'r?"\^[^"\n]*(?<!\\s\*)\$"')  # a whole-string pattern ended by `$`


def test_no_pattern_of_the_contracts_ends_with_a_dollar() -> None:
    found = [f"{path.relative_to(CONTRACTS)}: {literal}" for path in sorted(CONTRACTS.rglob("*.py"))
             for literal in DOLLAR_PATTERN.findall(path.read_text())]
    assert not found, f"end these with \\Z (libs/contracts/patterns.py): {found}"


@pytest.mark.parametrize("request_json", [
    b'{"job_id": "job-0123456789ab", "spec": {"name": "a", "output": {"name": "out\\n"}}}',
    b'{"job_id": "job-0123456789ab", "spec": {"name": "a", "flavors": ["cpu-1\\n"]}}',
    b'{"job_id": "job-0123456789ab", "spec": {"name": "a", "node_names": ["node-a\\n"]}}',
])
def test_a_newline_at_the_end_of_an_id_or_a_name_is_refused(request_json: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(request_json, type=SubmitJob)


def test_the_same_names_without_the_newline_pass() -> None:
    submit = msgspec.json.decode(b'{"job_id": "job-0123456789ab", "spec": {"name": "a", "output": {"name": "out"}}}',
                                 type=SubmitJob)
    assert submit.spec == JobSpec(name="a", output=OutputRef(name="out"))
    # A job id is checked by the scheduler when it records a submit (and by the auth of a job's token).
    assert is_job_id("job-0123456789ab") and not is_job_id("job-0123456789ab\n")
    assert is_array_id("array-0123456789ab") and not is_array_id("array-0123456789ab\n")


def test_json_schemas_say_dollar_where_the_contracts_say_end_of_string() -> None:
    schema = msgspec.json.schema(SubmitJob)
    patterns = [p for p in re.findall(r"'pattern': '([^']*)'", str(for_json_schema(schema)))]
    assert patterns and all(p.endswith("$") and "\\Z" not in p for p in patterns)
