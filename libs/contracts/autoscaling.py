"""What the autoscaler's config must hold beyond its types' shapes (SPEC A2, A4, A5, A7), and the names
it gives its instances' nodes.

The types themselves are part of the deployment config (`libs.contracts.cluster.AutoscalerConfig`);
`check_autoscaler` refuses types that cannot work, naming the field.
"""

from __future__ import annotations

from libs.contracts.cluster import AutoscalerConfig, Flavor, Resources

# Labels the autoscaler puts on the nodes of its instances: which instance a node is, of which type.
INSTANCE_LABEL = "trainyard.instance"
INSTANCE_TYPE_LABEL = "trainyard.instance-type"
# A4: the variable that keeps CUDA from seeing any board on a CPU-only instance.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "none"}


class AutoscalerConfigError(ValueError):
    """The autoscaler config cannot work; the message names the field."""


def check_autoscaler(config: AutoscalerConfig, flavors: list[Flavor]) -> None:
    """Refuse instance types that could never serve a job: unknown or too large flavors, a provider
    without its settings, a repeated name, nothing served."""
    known = {flavor.name: flavor for flavor in flavors}
    seen: set[str] = set()
    for index, kind in enumerate(config.instance_types):
        field = f"autoscaler.instance_types[{index}]"
        if kind.name in seen:
            raise AutoscalerConfigError(f"{field}.name: {kind.name!r} is used by another instance type")
        seen.add(kind.name)
        if not kind.flavors:
            raise AutoscalerConfigError(f"{field}.flavors: name at least one flavor whose jobs {kind.name} serves")
        for name in kind.flavors:
            flavor = known.get(name)
            if flavor is None:
                raise AutoscalerConfigError(f"{field}.flavors: {name!r} is not a flavor of this cluster "
                                            f"(one of {', '.join(sorted(known)) or 'none'})")
            if not Resources.of_flavor(flavor).fits_in(kind.node.resources):
                raise AutoscalerConfigError(f"{field}.flavors: one node of flavor {name} does not fit in "
                                            f"{kind.name}'s node ({kind.node.cpus:g} CPUs, {kind.node.memory_mib} "
                                            f"MiB, {kind.node.resources.accelerators} boards)")
            boards = {group.board for group in kind.node.accelerators if group.count}
            if flavor.board is not None and flavor.accelerators and flavor.board not in boards:
                raise AutoscalerConfigError(f"{field}.flavors: flavor {name} needs {flavor.board} boards, which "
                                            f"{kind.name}'s node does not have")
        if kind.cpu_only and kind.node.accelerators:
            raise AutoscalerConfigError(f"{field}.cpu_only: a CPU-only instance type presents no accelerators")
        if kind.provider == "aws-ec2" and kind.aws is None:
            raise AutoscalerConfigError(f"{field}.aws: an aws-ec2 instance type needs its EC2 settings "
                                        "(image_id, instance_type, ...)")
        if kind.provider != "aws-ec2" and kind.aws is not None:
            raise AutoscalerConfigError(f"{field}.aws: only aws-ec2 instance types take EC2 settings")
        if kind.provider == "local" and kind.image is not None:
            raise AutoscalerConfigError(f"{field}.image: the local provider runs agents on this host, not in images")
