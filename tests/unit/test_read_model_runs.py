"""The projection's batch as runs of statements (services/scheduler/read_model.py `in_runs`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.read_model import in_runs
from tests.support.strategies import SETTINGS

KINDS = ("insert", "admit", "requeue", "end")

statements = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(min_value=0, max_value=5)), max_size=60).map(
    lambda drawn: [(kind, (f"job-{job}", number)) for number, (kind, job) in enumerate(drawn)])


@SETTINGS
@given(statements)
def test_every_statement_runs_once_and_each_job_sees_its_own_in_order(batch: list[tuple[str, tuple[str, int]]]) -> None:
    runs = in_runs(batch)
    flat = [(sql, values) for sql, rows in runs for values in rows]
    assert sorted(flat, key=lambda statement: statement[1][1]) == batch
    for job in {values[0] for _, values in batch}:
        assert [v for _, v in flat if v[0] == job] == [v for _, v in batch if v[0] == job]
    assert all(sql == kind for sql, rows in runs for kind, values in batch if values in rows)


def test_a_burst_of_interleaved_jobs_is_a_few_runs() -> None:
    batch = [(kind, (f"job-{job}", kind)) for job in range(50) for kind in ("insert", "admit", "end")]
    interleaved = sorted(batch, key=lambda statement: KINDS.index(statement[0]) + int(statement[1][0][4:]) % 7)
    assert [(sql, len(rows)) for sql, rows in in_runs(interleaved)] == [("insert", 50), ("admit", 50), ("end", 50)]
