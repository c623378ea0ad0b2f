"""Job specs the end-to-end tests submit, on the algorithms in tests/e2e/algorithms."""

from __future__ import annotations

from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef


def sleeper(name: str, *, nodes: int = 1, seconds: float = 1.0, exit_code: int = 0) -> JobSpec:
    return JobSpec(name=name, mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="sleeper"), output=OutputRef(name=name),
                   command=f"bash -c \"exec python3 run.py --seconds {seconds} --exit-code {exit_code}\"")
