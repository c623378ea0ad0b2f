"""Job spec decoding and validation (SPEC J1–J18): every rule names its field and says how to fix it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libs.contracts.jobspec import (
    FieldError,
    JobSpec,
    SpecError,
    command_problem,
    decode_spec,
    parse_duration,
    validate_spec,
)


def regular(**overrides: Any) -> dict[str, Any]:
    """A minimal valid regular job, as a user would write it, with `overrides` applied."""
    doc: dict[str, Any] = {
        "name": "resnet",
        "algorithm": {"name": "resnet-code"},
        "command": "python3 train.py",
        "output": {"name": "resnet-out"},
        "flavors": ["gpu-4"],
    }
    doc.update(overrides)
    return doc


def batch(**overrides: Any) -> dict[str, Any]:
    """A minimal valid batch job with two tasks."""
    doc: dict[str, Any] = {
        "name": "sweep",
        "type": "batch",
        "tasks": [
            {"algorithm": {"name": "algo-a"}, "command": "python3 a.py"},
            {"algorithm": {"name": "algo-b"}, "command": "python3 b.py --lr 0.1"},
        ],
        "output": {"name": "sweep-out"},
        "flavors": ["cpu-2"],
    }
    doc.update(overrides)
    return doc


def errors_of(doc: Any) -> list[FieldError]:
    """The errors `decode_spec` raises for `doc`; fails the test when it is accepted."""
    with pytest.raises(SpecError) as raised:
        decode_spec(json.dumps(doc))
    assert raised.value.errors, "a SpecError must list at least one problem"
    return raised.value.errors


def fields_of(doc: Any) -> list[str]:
    return [e.field for e in errors_of(doc)]


def only_error(doc: Any) -> FieldError:
    errors = errors_of(doc)
    assert len(errors) == 1, errors
    return errors[0]


# --- accepted specs ---------------------------------------------------------------------------------


def test_minimal_regular_job_is_accepted_with_documented_defaults() -> None:
    spec = decode_spec(json.dumps(regular()))
    assert spec.name == "resnet"
    assert spec.type == "regular"
    assert spec.priority == "normal"
    assert spec.mode == "single-node"
    assert spec.nodes == 1
    assert spec.parameter_servers == 0
    assert spec.access == "none"
    assert spec.algorithm is not None and spec.algorithm.read_only is False
    assert spec.max_duration_seconds is None
    assert validate_spec(spec) == []


def test_minimal_batch_job_is_accepted() -> None:
    spec = decode_spec(json.dumps(batch()))
    assert [t.algorithm.name for t in spec.tasks] == ["algo-a", "algo-b"]
    assert spec.command is None and spec.algorithm is None


def test_yaml_spec_decodes_like_json() -> None:
    text = """
name: bert
mode: pytorch
nodes: 2
priority: urgent
flavors: [gpu-8, gpu-4]
algorithm: {name: bert-code, read_only: true}
command: torchrun --nnodes 2 train.py
output: {name: bert-out}
datasets:
  - {name: wiki, source: favorite, version: v3}
duration: 4h
"""
    spec = decode_spec(text, yaml=True)
    assert spec.mode == "pytorch"
    assert spec.nodes == 2
    assert spec.flavors == ["gpu-8", "gpu-4"]
    assert spec.datasets[0].version == "v3"
    assert spec.datasets[0].read_only is True  # datasets default to read-only
    assert spec.max_duration_seconds == 4 * 3600


def test_a_fully_featured_distributed_spec_is_accepted() -> None:
    doc = regular(
        mode="tensorflow", nodes=4, parameter_servers=2, priority="very-urgent", access="read-only",
        flavors=["gpu-8", "gpu-4"], driver_version="535.104", pool="team-a",
        datasets=[{"name": "imagenet", "read_only": True}, {"name": "coco", "source": "favorite", "version": "v1"}],
        annotation_datasets=[{"name": "labels", "version": "v2"}],
        models=[{"name": "bert-base", "source": "pretrained"}, {"name": "mine", "source": "favorite", "version": "v9"}],
        volumes=[{"name": "scratch"}], env={"NCCL_DEBUG": "INFO", "_X1": "y"},
        checkpoint_resume={"max_resumes": 5, "graceful_shutdown_seconds": 120,
                           "elastic": {"min_nodes": 2}, "performance": {"threshold": 0.6, "action": "reschedule"}},
        data_preparation=True, debug_terminal={"retention": "8h"}, duration="2d",
        lifecycle={"before_start": "bash prepare.sh", "after_end": "python3 report.py --all"},
    )
    spec = decode_spec(json.dumps(doc))
    assert spec.checkpoint_resume is not None and spec.checkpoint_resume.elastic is not None
    assert spec.checkpoint_resume.elastic.min_nodes == 2
    assert spec.max_duration_seconds == 2 * 86400


# --- J3 / J6 / J11: what runs -------------------------------------------------------------------------


def test_regular_job_needs_an_algorithm() -> None:
    doc = regular()
    del doc["algorithm"]
    error = only_error(doc)
    assert error.field == "algorithm"
    assert "exactly one algorithm" in error.message


def test_regular_job_needs_a_command() -> None:
    doc = regular()
    del doc["command"]
    error = only_error(doc)
    assert error.field == "command"
    assert "required" in error.message


def test_regular_job_refuses_batch_tasks() -> None:
    doc = regular(tasks=[{"algorithm": {"name": "a"}, "command": "python3 a.py"}])
    error = only_error(doc)
    assert error.field == "tasks"
    assert error.hint is not None and "type: batch" in error.hint


def test_batch_job_needs_at_least_one_task() -> None:
    error = only_error(batch(tasks=[]))
    assert error.field == "tasks"
    assert "at least one task" in error.message


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"command": "python3 train.py"}, "command"),
        ({"algorithm": {"name": "algo"}}, "algorithm"),
    ],
)
def test_batch_job_takes_algorithm_and_command_per_task(extra: dict[str, Any], field: str) -> None:
    error = only_error(batch(**extra))
    assert error.field == field
    assert "per task" in error.message
    assert error.hint is not None and "tasks" in error.hint


def test_batch_job_with_job_level_command_and_algorithm_names_both() -> None:
    assert sorted(fields_of(batch(command="python3 x.py", algorithm={"name": "x"}))) == ["algorithm", "command"]


def test_batch_task_command_errors_name_the_task() -> None:
    doc = batch()
    doc["tasks"][1]["command"] = "python3 a.py && python3 b.py"
    error = only_error(doc)
    assert error.field == "tasks[1].command"
    assert error.hint is not None and "bash -c" in error.hint


def test_batch_task_without_command_is_a_type_error_on_that_task() -> None:
    doc = batch()
    del doc["tasks"][0]["command"]
    assert fields_of(doc) == ["tasks[0].command"]


# --- J11: run command rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("KEY=VALUE python3 train.py", "variable assignment 'KEY=VALUE'"),
        ("python3 a.py && python3 b.py", "'&&'"),
        ("python3 train.py && python3 evaluate.py", "'&&'"),
        ("python3 a.py || python3 b.py", "'||'"),
        ("python3 a.py; python3 b.py", "';'"),
        ("python3 a.py | tee log", "'|'"),
        ("python3 a.py > log.txt", "'>'"),
        ("python3 a.py 2>&1", "'>&'"),
        ("python3 a.py &> log.txt", "'&>'"),
        ("python3 a.py < input.txt", "'<'"),
        ("python3 a.py &", "'&'"),
        ("python3 a.py\npython3 b.py", "several lines"),
        ("python3 train.py --tag `date`", "command substitution"),
        ("python3 train.py --tag $(date)", "command substitution"),
        ("", "empty"),
        ("   ", "empty"),
        ('python3 "train.py', "cannot be parsed"),
    ],
)
def test_command_that_is_not_a_plain_executable_is_rejected(command: str, problem: str) -> None:
    reason = command_problem(command)
    assert reason is not None, f"{command!r} should be rejected"
    assert problem in reason


@pytest.mark.parametrize(
    "command",
    [
        "python3 train.py",
        "python3 train.py --lr 0.1",
        "torchrun --nnodes 2 train.py",
        'bash -c "KEY=VALUE python3 train.py && python3 b.py"',
        'bash -c "python3 train.py --tag $(date +%s)"',
        "bash -c 'python3 train.py > log.txt 2>&1'",
        'python3 train.py --separator "|" --stop ";"',
        "python3 train.py --expr 'a && b'",
        r"python3 train.py --glob \&",
        "env KEY=VALUE python3 train.py",
        "python3 train.py --opt=KEY=VALUE",
        "deepspeed train.py --deepspeed --deepspeed_config ds_config.json",
        "mpirun -np 16 -bind-to none -map-by slot \\\n-x NCCL_DEBUG=INFO \\\npython /workspace/algorithm/train.py",
        "python3 train.py\n",
    ],
)
def test_command_beginning_with_an_executable_is_accepted(command: str) -> None:
    assert command_problem(command) is None
    assert decode_spec(json.dumps(regular(command=command))).command == command


@pytest.mark.parametrize("command", ["KEY=VALUE python3 train.py", "python3 a.py && python3 b.py"])
def test_rejected_command_error_suggests_bash_c(command: str) -> None:
    error = only_error(regular(command=command))
    assert error.field == "command"
    assert "must begin with an executable" in error.message
    assert error.hint is not None and "bash -c" in error.hint
    assert command in error.hint  # the suggestion wraps the user's own command


def test_assignment_prefix_hint_points_to_env() -> None:
    error = only_error(regular(command="CUDA_VISIBLE_DEVICES=0 python3 train.py"))
    assert error.hint is not None and "env:" in error.hint


def test_lifecycle_scripts_follow_the_command_rules() -> None:
    errors = errors_of(regular(lifecycle={"before_start": "A=1 ./prepare.sh", "after_end": "bash report.sh"}))
    assert [e.field for e in errors] == ["lifecycle.before_start"]


# --- J7: output --------------------------------------------------------------------------------------


def test_output_location_is_required() -> None:
    doc = regular()
    del doc["output"]
    error = only_error(doc)
    assert error.field == "output"
    assert error.hint is not None and "output:" in error.hint


def test_batch_job_also_needs_an_output() -> None:
    doc = batch()
    del doc["output"]
    assert fields_of(doc) == ["output"]


# --- J8: distributed mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pytorch", "pytorch-deepspeed", "horovod", "single-node"])
def test_parameter_servers_are_only_for_tensorflow(mode: str) -> None:
    doc = regular(mode=mode, parameter_servers=1)
    error = next(e for e in errors_of(doc) if e.field == "parameter_servers")
    assert "tensorflow" in error.message


def test_tensorflow_takes_parameter_servers() -> None:
    assert decode_spec(json.dumps(regular(mode="tensorflow", nodes=3, parameter_servers=2))).parameter_servers == 2


def test_single_node_job_runs_on_exactly_one_node() -> None:
    error = only_error(regular(mode="single-node", nodes=2))
    assert error.field == "nodes"
    assert "exactly 1 node" in error.message


@pytest.mark.parametrize("mode", ["pytorch", "pytorch-deepspeed", "horovod", "tensorflow"])
def test_distributed_modes_take_several_nodes(mode: str) -> None:
    assert decode_spec(json.dumps(regular(mode=mode, nodes=4))).nodes == 4


def test_unknown_mode_is_rejected_naming_mode() -> None:
    error = only_error(regular(mode="mpi"))
    assert error.field == "mode"
    assert "'mpi'" in error.message


# --- J9: flavors and placement restrictions -------------------------------------------------------------


def test_at_least_one_flavor_is_required() -> None:
    error = only_error(regular(flavors=[]))
    assert error.field == "flavors"
    assert "at least one" in error.message


def test_a_flavor_listed_twice_is_rejected() -> None:
    error = only_error(regular(flavors=["gpu-4", "gpu-8", "gpu-4"]))
    assert error.field == "flavors"
    assert "twice" in error.message


@pytest.mark.parametrize("extra", [{"driver_version": "535.104"}, {"pool": "team-a"},
                                   {"driver_version": "535.104", "pool": "team-a"}])
def test_node_pinning_excludes_driver_version_and_pool(extra: dict[str, Any]) -> None:
    error = only_error(regular(node_names=["node-1"], **extra))
    assert error.field == "node_names"
    assert "driver_version" in error.message and "pool" in error.message


def test_node_pinning_alone_and_driver_version_with_pool_are_fine() -> None:
    assert decode_spec(json.dumps(regular(node_names=["node-1", "node-2"]))).node_names == ["node-1", "node-2"]
    spec = decode_spec(json.dumps(regular(driver_version="535.104", pool="team-a")))
    assert (spec.driver_version, spec.pool) == ("535.104", "team-a")


def test_pinned_node_names_must_be_dns_labels() -> None:
    error = only_error(regular(node_names=["Node_1"]))
    assert error.field == "node_names[0]"


# --- J12 / J13: checkpoint resume and fault restart ----------------------------------------------------


def test_checkpoint_resume_with_a_pool_is_accepted_with_defaults() -> None:
    spec = decode_spec(json.dumps(regular(pool="team-a", checkpoint_resume={})))
    assert spec.checkpoint_resume is not None
    assert spec.checkpoint_resume.max_resumes == 3
    assert spec.checkpoint_resume.graceful_shutdown_seconds == 60


def test_checkpoint_resume_needs_a_dedicated_pool() -> None:
    error = only_error(regular(checkpoint_resume={"max_resumes": 2}))
    assert error.field == "checkpoint_resume"
    assert "dedicated resource pool" in error.message
    assert error.hint is not None and "pool:" in error.hint


def test_checkpoint_resume_is_only_for_regular_jobs() -> None:
    error = only_error(batch(pool="team-a", checkpoint_resume={}))
    assert error.field == "checkpoint_resume"
    assert "regular" in error.message


def test_checkpoint_resume_excludes_fault_restart() -> None:
    error = only_error(regular(pool="team-a", checkpoint_resume={}, fault_restart={"max_restarts": 2}))
    assert error.field == "fault_restart"
    assert "checkpoint_resume" in error.message


def test_checkpoint_resume_rules_are_all_reported_together() -> None:
    fields = fields_of(batch(checkpoint_resume={}, fault_restart={"max_restarts": 1}))
    assert sorted(fields) == ["checkpoint_resume", "checkpoint_resume", "fault_restart"]


def test_elastic_minimum_cannot_exceed_the_node_count() -> None:
    error = only_error(regular(mode="pytorch", nodes=2, pool="p",
                               checkpoint_resume={"elastic": {"min_nodes": 3}}))
    assert error.field == "checkpoint_resume.elastic.min_nodes"
    assert "3" in error.message and "2" in error.message


def test_performance_detection_threshold_must_be_positive() -> None:
    error = only_error(regular(pool="p", checkpoint_resume={"performance": {"threshold": 0}}))
    assert error.field == "checkpoint_resume.performance.threshold"


def test_fault_restart_alone_is_accepted() -> None:
    spec = decode_spec(json.dumps(regular(fault_restart={"max_restarts": 3})))
    assert spec.fault_restart is not None and spec.fault_restart.max_restarts == 3


def test_fault_restart_needs_at_least_one_restart() -> None:
    error = only_error(regular(fault_restart={"max_restarts": 0}))
    assert error.field == "fault_restart.max_restarts"
    assert ">= 1" in error.message


# --- J14 / J5 / J17: data ---------------------------------------------------------------------------------


def test_data_preparation_needs_read_only_datasets() -> None:
    doc = regular(data_preparation=True,
                  datasets=[{"name": "a"}, {"name": "b", "read_only": False}, {"name": "c", "read_only": False}])
    errors = errors_of(doc)
    assert [e.field for e in errors] == ["datasets[1].read_only", "datasets[2].read_only"]
    assert all("read-only" in e.message for e in errors)


def test_writable_datasets_are_fine_without_data_preparation() -> None:
    spec = decode_spec(json.dumps(regular(datasets=[{"name": "b", "read_only": False}])))
    assert spec.datasets[0].read_only is False


def test_data_preparation_is_allowed_for_batch_jobs() -> None:
    assert decode_spec(json.dumps(batch(data_preparation=True, datasets=[{"name": "a"}]))).data_preparation


def test_favourite_dataset_and_model_need_a_version() -> None:
    doc = regular(datasets=[{"name": "ok"}, {"name": "fav", "source": "favorite"}],
                  models=[{"name": "m", "source": "favorite"}])
    assert fields_of(doc) == ["datasets[1].version", "models[0].version"]


def test_annotation_dataset_needs_a_version() -> None:
    assert fields_of(regular(annotation_datasets=[{"name": "labels"}])) == ["annotation_datasets[0].version"]


@pytest.mark.parametrize("key", ["1ABC", "MY-VAR", "A B", ""])
def test_env_keys_must_be_variable_names(key: str) -> None:
    error = only_error(regular(env={key: "x"}))
    assert error.field == f"env.{key}"


# --- J15 / J16: durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("4h", 14400), ("2d", 172800), (" 1h ", 3600), ("12 h", 43200)],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0h", "4", "h", "1.5h", "-1h", "4w", "4 hours", "", "1h30m"])
def test_parse_duration_rejects_other_text(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_spec_duration_gives_the_limit_in_seconds() -> None:
    assert decode_spec(json.dumps(regular(duration="30m"))).max_duration_seconds == 1800


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"duration": "forever"}, "duration"), ({"debug_terminal": {"retention": "4 days"}}, "debug_terminal.retention")],
)
def test_bad_durations_name_their_field(extra: dict[str, Any], field: str) -> None:
    error = only_error(regular(**extra))
    assert error.field == field
    assert "30m, 4h or 2d" in error.message


# --- decoding: unknown fields, types, documents ---------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"nodez": 2}, "nodez"),
        ({"checkpoint_resume": {"foo": 1}}, "checkpoint_resume.foo"),
        ({"checkpoint_resume": {"elastic": {"min_nodes": 1, "scale": True}}}, "checkpoint_resume.elastic.scale"),
        ({"datasets": [{"name": "a"}, {"name": "b", "readonly": True}]}, "datasets[1].readonly"),
        ({"algorithm": {"name": "a", "revision": "v1"}}, "algorithm.revision"),
        ({"volumes": [{"name": "v", "read_only": True}]}, "volumes[0].read_only"),
    ],
)
def test_unknown_fields_are_errors_naming_the_field(extra: dict[str, Any], field: str) -> None:
    error = only_error(regular(**extra))
    assert error.field == field
    assert error.message == "is not a known field"
    assert error.hint is not None and "spelling" in error.hint


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"nodes": "two"}, "nodes", "Expected `int`, got `str`"),
        ({"nodes": 0}, "nodes", ">= 1"),
        ({"parameter_servers": -1}, "parameter_servers", ">= 0"),
        ({"flavors": "gpu-4"}, "flavors", "Expected `array`"),
        ({"priority": "asap"}, "priority", "'asap'"),
        ({"data_preparation": "yes"}, "data_preparation", "Expected `bool`"),
        ({"datasets": [{"name": "has space"}]}, "datasets[0].name", "regex"),
        ({"name": ""}, "name", "length >= 1"),
    ],
)
def test_type_errors_name_the_field(extra: dict[str, Any], field: str, message: str) -> None:
    error = only_error(regular(**extra))
    assert error.field == field
    assert message in error.message


@pytest.mark.parametrize(("path", "field"), [(("name",), "name"), (("algorithm", "name"), "algorithm.name"),
                                            (("output", "name"), "output.name")])
def test_missing_required_fields_are_named(path: tuple[str, ...], field: str) -> None:
    doc = regular()
    target = doc
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    error = only_error(doc)
    assert error.field == field
    assert "required" in error.message


def test_env_value_type_error_points_into_env() -> None:
    error = only_error(regular(env={"A": 1}))
    assert error.field.startswith("env")
    assert "Expected `str`, got `int`" in error.message


def test_blank_name_is_rejected() -> None:
    assert fields_of(regular(name="   ")) == ["name"]


@pytest.mark.parametrize("document", [[1, 2], "a string", 3])
def test_a_document_that_is_not_a_mapping_is_rejected(document: Any) -> None:
    error = only_error(document)
    assert error.field == "(document)"
    assert "Expected `object`" in error.message


def test_malformed_json_and_yaml_are_document_errors() -> None:
    with pytest.raises(SpecError) as raised:
        decode_spec(b'{"name": ')
    assert [e.field for e in raised.value.errors] == ["(document)"]
    with pytest.raises(SpecError) as raised:
        decode_spec("name: [unclosed", yaml=True)
    assert [e.field for e in raised.value.errors] == ["(document)"]


def test_yaml_type_errors_name_the_field() -> None:
    with pytest.raises(SpecError) as raised:
        decode_spec("name: j\nnodes: many\n", yaml=True)
    assert [e.field for e in raised.value.errors] == ["nodes"]


def test_every_problem_is_reported_at_once() -> None:
    doc = regular(mode="single-node", nodes=3, parameter_servers=1, flavors=[], command="A=1 python3 x.py",
                  duration="soon")
    del doc["output"]
    assert sorted(fields_of(doc)) == sorted(["command", "output", "parameter_servers", "nodes", "flavors",
                                             "duration"])


def test_spec_error_message_lists_fields_and_hints() -> None:
    doc = regular(command="python3 a.py && python3 b.py", flavors=[])
    with pytest.raises(SpecError) as raised:
        decode_spec(json.dumps(doc))
    text = str(raised.value)
    assert "command: must begin with an executable" in text
    assert "(hint: wrap shell syntax as bash -c" in text
    assert "flavors: at least one node flavor is required" in text
    assert isinstance(raised.value, ValueError)


def test_field_error_str() -> None:
    assert str(FieldError(field="nodes", message="is bad")) == "nodes: is bad"
    assert str(FieldError(field="nodes", message="is bad", hint="use 1")) == "nodes: is bad (hint: use 1)"


def test_validate_spec_works_on_a_constructed_spec() -> None:
    spec = JobSpec(name="x", command="python3 x.py", flavors=["cpu"])
    assert sorted(e.field for e in validate_spec(spec)) == ["algorithm", "output"]


def test_spec_is_immutable() -> None:
    spec = decode_spec(json.dumps(regular()))
    with pytest.raises(AttributeError):
        spec.nodes = 4  # type: ignore[misc]


def test_a_favourite_algorithm_needs_a_version() -> None:
    error = only_error(regular(algorithm={"name": "shared-resnet", "source": "favorite"}))
    assert (error.field, error.message) == ("algorithm.version", "a favourite algorithm needs a version")
    assert decode_spec(json.dumps(regular(algorithm={"name": "shared-resnet", "source": "favorite",
                                                     "version": "v3"}))).algorithm is not None
