"""A cluster with one autoscaled instance type (gpu: 8 CPUs, 2 A100 boards), for the autoscaler's unit tests."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.contracts.cluster import (
    Accelerators,
    AutoscalerConfig,
    ClusterConfig,
    Flavor,
    InstanceNode,
    InstanceType,
)

AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
GPU = InstanceType(name="gpu", provider="local", flavors=["gpu-1"], max_instances=4, init_script="true",
                   node=InstanceNode(cpus=8, memory_mib=32768, accelerators=[Accelerators(board="a100", count=2)]))
CLUSTER = ClusterConfig(flavors=[Flavor(name="gpu-1", cpus=2, memory_mib=4096, accelerators=1, board="a100")],
                        autoscaler=AutoscalerConfig(boot_timeout_seconds=300, instance_types=[GPU]))
