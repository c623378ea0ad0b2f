"""Nodes and flavors: what a compute host offers and what one node of a job asks for; and the instance
types the autoscaler may start (SPEC A2, A4, A5, A7)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.jobspec import NodeName, ResourceName


class Accelerators(Struct, frozen=True, kw_only=True):
    """A group of identical accelerator boards on one host."""

    board: str
    count: Annotated[int, Meta(ge=0)]
    driver_version: str | None = None


class NodeInfo(Struct, frozen=True, kw_only=True):
    """What a node agent registers: identity, address and resources of its host."""

    name: NodeName
    address: str
    os: str = ""
    kernel: str = ""
    cpus: Annotated[float, Meta(gt=0)]
    memory_mib: Annotated[int, Meta(gt=0)]
    accelerators: list[Accelerators] = msgspec.field(default_factory=list)
    pools: list[ResourceName] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def accelerator_count(self) -> int:
        return sum(group.count for group in self.accelerators)

    @property
    def board(self) -> str | None:
        return self.accelerators[0].board if self.accelerators else None

    @property
    def driver_version(self) -> str | None:
        return self.accelerators[0].driver_version if self.accelerators else None


class Flavor(Struct, frozen=True, kw_only=True):
    """The resources of one node of a job (SPEC J9)."""

    name: ResourceName
    cpus: Annotated[float, Meta(gt=0)]
    memory_mib: Annotated[int, Meta(gt=0)]
    accelerators: Annotated[int, Meta(ge=0)] = 0
    board: str | None = None

    @property
    def slots(self) -> int:
        """L7: processes per node: the accelerator count, or 1 for CPU flavors."""
        return self.accelerators or 1


# J8: a TensorFlow parameter server always gets 1 CPU and 1 GiB, whatever the job's flavor.
PARAMETER_SERVER_FLAVOR = Flavor(name="tf-parameter-server", cpus=1, memory_mib=1024)


class Resources(Struct, frozen=True, kw_only=True):
    """An amount of CPU, memory and accelerators, used for free/used arithmetic."""

    cpus: float = 0.0
    memory_mib: int = 0
    accelerators: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(cpus=self.cpus + other.cpus, memory_mib=self.memory_mib + other.memory_mib,
                         accelerators=self.accelerators + other.accelerators)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(cpus=self.cpus - other.cpus, memory_mib=self.memory_mib - other.memory_mib,
                         accelerators=self.accelerators - other.accelerators)

    def fits_in(self, other: Resources) -> bool:
        # A small epsilon keeps fractional CPUs (0.5 + 0.5) from failing on float rounding.
        return (self.cpus <= other.cpus + 1e-9 and self.memory_mib <= other.memory_mib
                and self.accelerators <= other.accelerators)

    @classmethod
    def of_flavor(cls, flavor: Flavor) -> Resources:
        return cls(cpus=flavor.cpus, memory_mib=flavor.memory_mib, accelerators=flavor.accelerators)

    @classmethod
    def of_node(cls, node: NodeInfo) -> Resources:
        return cls(cpus=node.cpus, memory_mib=node.memory_mib, accelerators=node.accelerator_count)


class AgentConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A node agent to run: unset resources are read from the real machine; accelerators listed
    here are presented as simulated boards (for tests and demos on machines without any)."""

    name: NodeName
    address: str = "127.0.0.1"
    cpus: Annotated[float, Meta(gt=0)] | None = None
    memory_mib: Annotated[int, Meta(gt=0)] | None = None
    accelerators: list[Accelerators] = msgspec.field(default_factory=list)
    pools: list[ResourceName] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)


Provider = Literal["local", "aws-ec2"]


class Ec2Settings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an `aws-ec2` instance is launched (run_instances)."""

    image_id: Annotated[str, Meta(min_length=1)]  # the AMI
    instance_type: Annotated[str, Meta(min_length=1)]  # e.g. g5.xlarge
    region: str = "us-east-1"
    subnet_id: str | None = None
    security_group_ids: list[str] = msgspec.field(default_factory=list)
    key_name: str | None = None
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    spot: bool = False
    # Another endpoint than AWS's own (a moto server in tests, a private endpoint).
    endpoint_url: str | None = None
    # The NATS address the instance's agent reaches (default: the autoscaler's own NATS_URL).
    nats_url: str | None = None


class InstanceNode(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an instance offers once its agent registers."""

    cpus: Annotated[float, Meta(gt=0)]
    memory_mib: Annotated[int, Meta(gt=0)]
    accelerators: list[Accelerators] = msgspec.field(default_factory=list)
    pools: list[ResourceName] = msgspec.field(default_factory=list)  # the dedicated pools it joins (and serves)
    labels: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def resources(self) -> Resources:
        return Resources(cpus=self.cpus, memory_mib=self.memory_mib,
                         accelerators=sum(group.count for group in self.accelerators))


class InstanceType(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One kind of instance: which provider starts it, the node it becomes, the flavors whose queues it serves,
    how many of it may run, how long one may idle before it is released, and how it boots (an init script
    before the agent, a container image for the agent or none, CPU-only forcing)."""

    name: NodeName  # instances are named `<type>-<suffix>`, a node name too
    provider: Provider
    node: InstanceNode
    flavors: list[ResourceName] = msgspec.field(default_factory=list)  # the queues it serves
    max_instances: Annotated[int, Meta(ge=0)] = 1
    idle_seconds: Annotated[float, Meta(ge=0)] = 300.0
    init_script: str | None = None  # run before the agent starts (a shell script)
    image: str | None = None  # a container image to run the agent in; None: on the host itself
    cpu_only: bool = False  # A4: CUDA_VISIBLE_DEVICES=none for the agent and its jobs
    aws: Ec2Settings | None = None


class AutoscalerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_instances: Annotated[int, Meta(ge=0)] = 10  # A7: of all types together
    # Tags this deployment's cloud instances, so several deployments may share an account.
    cluster: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z")] = "trainyard"
    # An instance whose agent has not registered by then is terminated, and the reason recorded.
    boot_timeout_seconds: Annotated[float, Meta(gt=0)] = 600.0
    # How often the log is compared with each provider's own list of instances (one may vanish: a spot
    # interruption, an end by hand), and how long a new instance's absence from that list is forgiven (a
    # provider's list may lag behind its launches).
    reconcile_seconds: Annotated[float, Meta(gt=0)] = 60.0
    listing_grace_seconds: Annotated[float, Meta(ge=0)] = 120.0
    instance_types: list[InstanceType] = msgspec.field(default_factory=list)

    def instance_type(self, name: str) -> InstanceType | None:
        return next((t for t in self.instance_types if t.name == name), None)


# The highest user id a job runs as: many tools still take uids for signed 32-bit numbers.
MAX_JOB_UID = 2**31 - 2


class JobUsers(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """L1: the Unix user (and group of the same number) a job's processes run as on nodes whose agent runs as
    root: one per user (the default: the same on every node and in every job of theirs, so that what their jobs
    write to shared storage is theirs alike, and a clone writes again into its source's outputs), or one per job
    (every job apart, even two of one user's: a job then cannot change what another left in shared storage). The
    number is `uid_base` plus a hash of the user's name or the job's id modulo `uid_count`: every node works it out
    alike, with no table to keep."""

    per: Literal["job", "user"] = "user"
    uid_base: Annotated[int, Meta(ge=1000, le=MAX_JOB_UID)] = 1_000_000_000
    uid_count: Annotated[int, Meta(ge=1, le=MAX_JOB_UID)] = 1_000_000_000

    def __post_init__(self) -> None:
        if self.uid_base + self.uid_count - 1 > MAX_JOB_UID:
            raise ValueError(f"job_users: uid_base + uid_count - 1 must be at most {MAX_JOB_UID}")


class ClusterConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flavors a deployment offers, for a local stack the agents it runs, and what the autoscaler may
    start."""

    flavors: list[Flavor]
    nodes: list[AgentConfig] = msgspec.field(default_factory=list)
    autoscaler: AutoscalerConfig = msgspec.field(default_factory=AutoscalerConfig)
    job_users: JobUsers = msgspec.field(default_factory=JobUsers)

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        return msgspec.yaml.decode(Path(path).read_bytes(), type=cls)

    def flavor(self, name: str) -> Flavor | None:
        return next((f for f in self.flavors if f.name == name), None)
