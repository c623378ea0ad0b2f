"""Job specs the end-to-end tests submit, on the algorithms in tests/e2e/algorithms."""

from __future__ import annotations

from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef, PerformanceDetection


def sleeper(name: str, *, nodes: int = 1, seconds: float = 1.0, exit_code: int = 0) -> JobSpec:
    return JobSpec(name=name, mode="pytorch" if nodes > 1 else "single-node", nodes=nodes, flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="sleeper"), output=OutputRef(name=name),
                   command=f"bash -c \"exec python3 run.py --seconds {seconds} --exit-code {exit_code}\"")


def mpi_hello(name: str = "mpi", command: str = "python3 /workspace/algorithm/hello.py") -> JobSpec:
    """A 2-node Horovod (MPI) job whose ranks say hello with their rank and node."""
    return JobSpec(name=name, mode="horovod", nodes=2, flavors=["cpu-1"], algorithm=AlgorithmRef(name="mpi-hello"),
                   command=command, output=OutputRef(name=name))


def resumable(name: str, *, nodes: int = 2, steps: int = 60, extra: str = "",
              performance: PerformanceDetection | None = None) -> JobSpec:
    """A PyTorch checkpoint-resume job of the `resilient` pool: `steps` steps of 0.2 s, a checkpoint on the
    platform's signal, at most two resumes."""
    return JobSpec(name=name, mode="pytorch", nodes=nodes, flavors=["cpu-1"], pool="resilient",
                   algorithm=AlgorithmRef(name="pytorch-resumable"), output=OutputRef(name=name),
                   command=f"python3 train.py --steps {steps} --step-seconds 0.2 {extra}".strip(),
                   checkpoint_resume=CheckpointResume(max_resumes=2, graceful_shutdown_seconds=20,
                                                      performance=performance))
