"""Instance types in the deployment config (SPEC A2, A4, A5, A7): a config that cannot work is refused at
the autoscaler's start, with the field named."""

from __future__ import annotations

import msgspec
import pytest

from libs.contracts.autoscaling import AutoscalerConfigError, check_autoscaler
from libs.contracts.cluster import ClusterConfig

GOOD = """
flavors:
  - {name: cpu-1, cpus: 1, memory_mib: 1024}
  - {name: gpu-1, cpus: 4, memory_mib: 8192, accelerators: 1, board: a100}
autoscaler:
  max_instances: 6
  boot_timeout_seconds: 300
  instance_types:
    - name: cpu-small
      provider: local
      node: {cpus: 2, memory_mib: 4096, labels: {tier: cheap}}
      flavors: [cpu-1]
      max_instances: 4
      idle_seconds: 120
      init_script: pip install -r requirements.txt
      cpu_only: true
    - name: gpu-a100
      provider: aws-ec2
      node: {cpus: 8, memory_mib: 32768, accelerators: [{board: a100, count: 2, driver_version: "535.104"}],
             pools: [research]}
      flavors: [gpu-1, cpu-1]
      image: trainyard/agent:latest
      aws: {image_id: ami-0abc, instance_type: p4d.24xlarge, subnet_id: subnet-1, security_group_ids: [sg-1],
            key_name: ops, tags: {team: ml}, spot: true}
"""


def load(text: str) -> ClusterConfig:
    return msgspec.yaml.decode(text.encode(), type=ClusterConfig)


def test_a_full_config_reads_and_passes() -> None:
    cluster = load(GOOD)
    check_autoscaler(cluster.autoscaler, cluster.flavors)
    gpu = cluster.autoscaler.instance_type("gpu-a100")
    assert gpu is not None and gpu.aws is not None and gpu.aws.spot and gpu.node.accelerators[0].count == 2
    assert cluster.autoscaler.max_instances == 6


def test_a_cluster_without_an_autoscaler_section_scales_nothing() -> None:
    cluster = load("flavors: [{name: cpu-1, cpus: 1, memory_mib: 1024}]")
    assert cluster.autoscaler.instance_types == []


BAD = {
    "an unknown flavor": (GOOD.replace("flavors: [cpu-1]", "flavors: [cpu-9]"),
                          "instance_types[0].flavors: 'cpu-9' is not a flavor of this cluster"),
    "a flavor larger than the node": (GOOD.replace("node: {cpus: 2,", "node: {cpus: 0.5,"),
                                      "instance_types[0].flavors: one node of flavor cpu-1 does not fit"),
    "no flavor served": (GOOD.replace("flavors: [cpu-1]\n", "flavors: []\n"), "instance_types[0].flavors: name at"),
    "a board the node lacks": (GOOD.replace("board: a100, count: 2", "board: h100, count: 2"),
                               "instance_types[1].flavors: flavor gpu-1 needs a100 boards"),
    "ec2 without settings": (GOOD.split("      aws: ")[0], "instance_types[1].aws: an aws-ec2 instance type needs"),
    "a repeated name": (GOOD.replace("name: gpu-a100", "name: cpu-small"), "instance_types[1].name: 'cpu-small'"),
    "an image on the local provider": (GOOD.replace("      cpu_only: true\n", "      image: x\n"),
                                       "instance_types[0].image:"),
}


@pytest.mark.parametrize(("text", "names"), BAD.values(), ids=BAD.keys())
def test_a_type_that_cannot_work_is_refused_with_the_field_named(text: str, names: str) -> None:
    cluster = load(text)
    with pytest.raises(AutoscalerConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        check_autoscaler(cluster.autoscaler, cluster.flavors)


@pytest.mark.parametrize(("change", "names"), [
    (("provider: local", "provider: gce"), "provider"),
    (("max_instances: 4", "max_instances: -1"), "max_instances"),
    (("idle_seconds: 120", "idle_seconds: 120\n      colour: red"), "colour"),
    (("boot_timeout_seconds: 300", "boot_timeout_seconds: 0"), "boot_timeout_seconds"),
], ids=["unknown provider", "negative limit", "unknown field", "zero boot timeout"])
def test_a_malformed_type_is_refused_when_read(change: tuple[str, str], names: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=names):
        load(GOOD.replace(*change))
