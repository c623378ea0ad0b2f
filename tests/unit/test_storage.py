"""Which storage inputs a spec needs, and how a missing one is reported."""

from __future__ import annotations

from pathlib import Path

import msgspec

from libs.contracts.events import Mount
from libs.contracts.jobspec import (
    AlgorithmRef,
    AnnotationDatasetRef,
    BatchTask,
    CheckpointResume,
    DatasetRef,
    JobSpec,
    ModelRef,
    OutputRef,
    VolumeRef,
)
from libs.storage import missing_inputs, workspace_mounts

BASE = JobSpec(name="train", flavors=["cpu-1"], algorithm=AlgorithmRef(name="algo"), command="python3 a.py",
               output=OutputRef(name="out"))


def make(root: Path, *paths: str) -> Path:
    for path in paths:
        (root / path).mkdir(parents=True)
    return root


def test_present_inputs_and_absent_outputs_are_fine(tmp_path: Path) -> None:
    spec = msgspec.structs.replace(BASE, datasets=[DatasetRef(name="mnist", source="favorite", version="v2")],
                                   volumes=[VolumeRef(name="scratch")])
    root = make(tmp_path, "algorithms/algo", "datasets/mnist/v2")
    assert missing_inputs(spec, root) == []


def test_every_missing_input_is_named_by_its_field(tmp_path: Path) -> None:
    spec = msgspec.structs.replace(
        BASE, datasets=[DatasetRef(name="mnist"), DatasetRef(name="cifar", source="favorite", version="v1")],
        annotation_datasets=[AnnotationDatasetRef(name="boxes", version="v3")],
        models=[ModelRef(name="bert", source="pretrained")])
    root = make(tmp_path, "datasets/mnist")
    errors = missing_inputs(spec, root)
    assert [(e.field, e.message) for e in errors] == [
        ("algorithm", "algorithms/algo does not exist in shared storage"),
        ("datasets[1]", "datasets/cifar/v1 does not exist in shared storage"),
        ("annotation_datasets[0]", "annotations/boxes/v3 does not exist in shared storage"),
        ("models[0]", "models/bert does not exist in shared storage"),
    ]


def test_batch_tasks_each_need_their_algorithm(tmp_path: Path) -> None:
    spec = msgspec.structs.replace(BASE, type="batch", algorithm=None, command=None, tasks=[
        BatchTask(algorithm=AlgorithmRef(name="a"), command="python3 a.py"),
        BatchTask(algorithm=AlgorithmRef(name="b"), command="python3 b.py")])
    root = make(tmp_path, "algorithms/a")
    assert [e.field for e in missing_inputs(spec, root)] == ["tasks[1].algorithm"]


def test_a_checkpoint_job_gets_its_own_writable_checkpoint_folder(tmp_path: Path) -> None:
    spec = msgspec.structs.replace(BASE, pool="p", checkpoint_resume=CheckpointResume())
    mounts = workspace_mounts(spec, job_id="job-00000000000a", attempt=2)
    assert Mount(source="checkpoints/job-00000000000a/attempt-2", target="checkpoints", read_only=False) in mounts
    assert not any(m.target == "checkpoints" for m in workspace_mounts(BASE, job_id="job-00000000000a"))
    # Created on first use: a submit never waits for it.
    root = make(tmp_path, "algorithms/algo")
    assert missing_inputs(spec, root) == []
