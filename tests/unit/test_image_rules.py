"""J10 as pure rules: image references, the catalogue's fold, what a spec's image must be, how a launch and a
command's environment change for a job in an image."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.caches.imageprep import on_agent_python
from agent.processes.jobenv import job_environment
from libs.contracts.cluster import Flavor
from libs.contracts.events import ImageDeleted, ImageMarked, ImageRegistered, Placement
from libs.contracts.images import ImageRecord, ImageRefError, ImageUse, parse_image_ref
from libs.contracts.jobspec import JobSpec, LifecycleScripts
from services.launcher.planner import MPI_REMOTE_SHELL, plan_launch
from services.scheduler.domain.images import fold_image, image_errors, image_use

FLAVORS = [Flavor(name="cpu-1", cpus=1, memory_mib=1024),
           Flavor(name="gpu-1", cpus=1, memory_mib=1024, accelerators=1, board="sim-a100")]
DIGEST = "sha256:" + "ab" * 32


def record(ref: str = "team/torch:2.13", boards: tuple[str, ...] = ("cpu",), training: bool = True) -> ImageRecord:
    name, tag = parse_image_ref(ref)
    return ImageRecord(name=name, tag=tag, digest=DIGEST, format="oci-archive", size_bytes=1, boards=list(boards),
                       training=training, registered_by="root", registered_at=datetime(2026, 1, 1, tzinfo=UTC))


def spec(image: str | None, flavors: tuple[str, ...] = ("cpu-1",), **changes: object) -> JobSpec:
    return JobSpec(name="t", image=image, flavors=list(flavors), command="python3 train.py", **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ref", "expected"), [
    ("torch", ("torch", "latest")), ("team/torch:2.13", ("team/torch", "2.13")),
    ("registry.local/a_b/c-d:v1.0-rc1", ("registry.local/a_b/c-d", "v1.0-rc1"))])
def test_a_reference_is_a_name_and_a_tag(ref: str, expected: tuple[str, str]) -> None:
    assert parse_image_ref(ref) == expected


@pytest.mark.parametrize("ref", ["Torch:1", "torch:", ":1", "torch::1", "a//b:1", "torch:1/2", "torch:-x"])
def test_a_malformed_reference_is_refused(ref: str) -> None:
    with pytest.raises(ImageRefError):
        parse_image_ref(ref)


def test_the_catalogue_folds_registrations_marks_and_deletions() -> None:
    images: dict[str, ImageRecord] = {}
    fold_image(images, ImageRegistered(image=record(), by="root"))
    fold_image(images, ImageMarked(ref="team/torch:2.13", training=False, by="root"))
    assert not images["team/torch:2.13"].training
    fold_image(images, ImageMarked(ref="team/other:1", training=True, by="root"))  # unknown: nothing
    fold_image(images, ImageDeleted(ref="team/torch:2.13", by="root"))
    assert images == {}


def test_a_job_without_an_image_needs_no_catalogue() -> None:
    assert image_errors(spec(None), {}, FLAVORS) == []
    assert image_use(spec(None), {}) is None


def test_an_image_must_be_known_marked_and_of_each_flavors_board() -> None:
    images = {"team/torch:2.13": record(boards=("sim-a100",), training=False)}
    errors = image_errors(spec("team/torch:2.13", ("gpu-1", "cpu-1")), images, FLAVORS)
    assert [(e.field, e.message) for e in errors] == [
        ("image", "team/torch:2.13 is not marked for training jobs"),
        ("flavors[1]", "flavor 'cpu-1' has board cpu, and image team/torch:2.13 is built for sim-a100")]
    assert [e.field for e in image_errors(spec("team/torch:9"), images, FLAVORS)] == ["image"]
    assert "not an image reference" in image_errors(spec("Team/Torch"), images, FLAVORS)[0].message


def test_a_job_is_accepted_with_what_the_name_means_then() -> None:
    images = {"team/torch:latest": record("team/torch")}
    assert image_use(spec("team/torch"), images) == ImageUse(ref="team/torch:latest", digest=DIGEST,
                                                             format="oci-archive")
    with pytest.raises(LookupError):
        image_use(spec("team/torch"), {"team/torch:latest": record("team/torch", training=False)})


def test_every_node_of_a_launch_runs_in_the_image() -> None:
    use = ImageUse(ref="team/torch:2.13", digest=DIGEST, format="rootfs")
    placement = [Placement(rank=0, node="a", address="10.0.0.1", slots=1),
                 Placement(rank=1, node="b", address="10.0.0.2", slots=1)]
    launches = plan_launch(spec("team/torch:2.13", mode="horovod", nodes=2), FLAVORS[0], placement, ports={},
                           image=use)
    assert [launch.image for launch in launches] == [use, use]
    assert [launch.image for launch in plan_launch(spec(None), FLAVORS[0], placement[:1], ports={})] == [None]


def test_in_an_image_the_platforms_helpers_run_on_the_agents_interpreter() -> None:
    wrapped = plan_launch(spec("x:1", lifecycle=LifecycleScripts(before_start="echo hi")), FLAVORS[0],
                          [Placement(rank=0, node="a", address="127.0.0.1", slots=1)], ports={})[0].argv
    argv, env = on_agent_python(wrapped, {"OMPI_MCA_plm_rsh_agent": MPI_REMOTE_SHELL}, "/opt/venv/bin/python")
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "agent.lifecycle"]
    assert env["OMPI_MCA_plm_rsh_agent"] == "/opt/venv/bin/python -m agent.rsh"
    assert on_agent_python(["python3", "-m", "mymodule"], {}, "/p") == (["python3", "-m", "mymodule"], {})


def test_in_an_image_its_environment_and_path_are_the_jobs_and_the_agents_host_paths_are_not() -> None:
    agent = {"PATH": "/host/bin", "HOME": "/root", "VIRTUAL_ENV": "/opt/venv", "LD_LIBRARY_PATH": "/host/lib",
             "DATABASE_URL": "postgres://secret"}
    image = {"PATH": "/opt/conda/bin:/usr/bin", "LANG": "C.UTF-8", "SEED": "1"}
    env = job_environment(agent, {"SEED": "7"}, {"TRAINYARD_RANK": "0"}, python_dir=Path("/opt/venv/bin"),
                          nats_url="nats://x", image_env=image)
    assert env == {"HOME": "/root", "LANG": "C.UTF-8", "SEED": "7", "PATH": "/opt/conda/bin:/usr/bin",
                   "TRAINYARD_RANK": "0"}
    own_path = job_environment(agent, {"PATH": "/mine"}, {}, python_dir=Path("/v"), nats_url="n", image_env={})
    assert own_path["PATH"] == "/mine"
    assert job_environment(agent, {}, {}, python_dir=Path("/v"), nats_url="n", image_env={})["PATH"].startswith(
        "/usr/local/sbin")
