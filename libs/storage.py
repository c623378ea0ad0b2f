"""Shared storage: where a job's algorithm, data, models, outputs and volumes live (SPEC L1, J5–J7, J17).

Storage is a tree shared by the services and every node (a local folder for one machine, NFS or
the like for many). A job's /workspace is made of mounts of that tree:

    algorithms/<name>[/<version>]         -> /workspace/algorithm
    datasets/<name>[/<version>]           -> /workspace/dataset/private/<name>
                                             /workspace/dataset/favorite/<name>/<version>
    annotations/<name>/<version>          -> /workspace/anno_dataset/<name>/annotation
    models/<name>[/<version>]             -> /workspace/model/{pretrained,private}/<name>
                                             /workspace/model/favorite/<name>/<version>
    outputs/<name>[/<job name>-<n>]       -> /workspace/outputs      (writable)
    volumes/<name>                        -> /workspace/volume/<name> (writable)
    checkpoints/<job id>                  -> /workspace/checkpoints  (writable; checkpoint-resume jobs)

With data preparation (J14), datasets and annotation datasets are staged: each node copies them into its
dataset cache before the command starts and mounts the local copies (agent/caches/datacache.py).

A checkpoint-resume job (J12) saves its checkpoints in `checkpoints/<job id>`: the folder belongs to
the job, not to an attempt, so every attempt after a move reads what the last one saved. Like outputs
and volumes it is created on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libs.contracts.events import Mount
from libs.contracts.health import CHECKPOINT_DIR
from libs.contracts.jobspec import AlgorithmRef, FieldError, JobSpec


@dataclass(frozen=True)
class StorageRef:
    """One mount of a job's workspace and the spec field it comes from."""

    field: str
    mount: Mount
    must_exist: bool  # inputs must; outputs and volumes are created on first use


CHECKPOINT_TARGET = CHECKPOINT_DIR.removeprefix("/workspace/")


def checkpoint_mount(job_id: str, attempt: int) -> Mount:
    """J12: the checkpoint folder of one attempt of the job, shared by its nodes. The agent starts it as a
    copy of the newest earlier attempt's (agent/isolation/checkpoints.py), so that a process of an old attempt
    never writes into the folder a new attempt resumes from."""
    return Mount(source=f"checkpoints/{job_id}/attempt-{attempt}", target=CHECKPOINT_TARGET, read_only=False)


def workspace_layout(spec: JobSpec, *, task_index: int | None = None, job_id: str | None = None,
                     attempt: int = 1) -> list[StorageRef]:
    """L1: every mount of one node's /workspace (for task `task_index` of a batch job); with `job_id`,
    also the checkpoint folder of a checkpoint-resume job's `attempt`."""
    refs: list[StorageRef] = []
    algorithm: AlgorithmRef | None = spec.algorithm
    algorithm_field = "algorithm"
    if task_index is not None:
        algorithm, algorithm_field = spec.tasks[task_index].algorithm, f"tasks[{task_index}].algorithm"
    if algorithm is not None:
        source = f"algorithms/{algorithm.name}" + (f"/{algorithm.version}" if algorithm.version else "")
        refs.append(StorageRef(algorithm_field, Mount(source=source, target="algorithm",
                                                      read_only=algorithm.read_only), True))
    for i, dataset in enumerate(spec.datasets):
        source = f"datasets/{dataset.name}" + (f"/{dataset.version}" if dataset.version else "")
        target = (f"dataset/private/{dataset.name}" if dataset.source == "private"
                  else f"dataset/favorite/{dataset.name}/{dataset.version}")
        refs.append(StorageRef(f"datasets[{i}]", Mount(source=source, target=target, read_only=dataset.read_only,
                                                       stage=spec.data_preparation), True))
    for i, annotation in enumerate(spec.annotation_datasets):
        refs.append(StorageRef(f"annotation_datasets[{i}]",
                               Mount(source=f"annotations/{annotation.name}/{annotation.version}",
                                     target=f"anno_dataset/{annotation.name}/annotation",
                                     read_only=annotation.read_only, stage=spec.data_preparation), True))
    for i, model in enumerate(spec.models):
        source = f"models/{model.name}" + (f"/{model.version}" if model.version else "")
        target = (f"model/favorite/{model.name}/{model.version}" if model.source == "favorite"
                  else f"model/{model.source}/{model.name}")
        refs.append(StorageRef(f"models[{i}]", Mount(source=source, target=target, read_only=True), True))
    if spec.output is not None:
        # J3: task n of a batch job writes to <job name>-<n> without knowing it.
        suffix = f"/{spec.name}-{task_index + 1}" if task_index is not None else ""
        refs.append(StorageRef("output", Mount(source=f"outputs/{spec.output.name}{suffix}", target="outputs",
                                               read_only=False), False))
    for i, volume in enumerate(spec.volumes):
        refs.append(StorageRef(f"volumes[{i}]", Mount(source=f"volumes/{volume.name}", target=f"volume/{volume.name}",
                                                      read_only=False), False))
    if job_id is not None and spec.checkpoint_resume is not None:
        refs.append(StorageRef("checkpoint_resume", checkpoint_mount(job_id, attempt), False))
    return refs


def workspace_mounts(spec: JobSpec, *, task_index: int | None = None, job_id: str | None = None,
                     attempt: int = 1) -> list[Mount]:
    return [ref.mount for ref in workspace_layout(spec, task_index=task_index, job_id=job_id, attempt=attempt)]


def staged_sources(spec: JobSpec) -> list[str]:
    """J14: the folders of shared storage the job's nodes copy into their caches before it starts (none
    without data preparation)."""
    return list(dict.fromkeys(mount.source for mount in workspace_mounts(spec) if mount.stage))


def job_storage(spec: JobSpec) -> list[StorageRef]:
    """What the job mounts on any of its nodes, each spec field once (a batch job's shared fields as
    its first task mounts them)."""
    tasks: list[int | None] = list(range(len(spec.tasks))) if spec.type == "batch" else [None]
    refs: dict[str, StorageRef] = {}
    for task in tasks:
        for ref in workspace_layout(spec, task_index=task):
            refs.setdefault(ref.field, ref)
    return list(refs.values())


def missing_inputs(spec: JobSpec, root: Path) -> list[FieldError]:
    """Inputs the spec names that shared storage under `root` does not hold."""
    return [FieldError(field=ref.field, message=f"{ref.mount.source} does not exist in shared storage",
                       hint="check the name and version, or upload it to shared storage first")
            for ref in job_storage(spec) if ref.must_exist and not (root / ref.mount.source).is_dir()]
