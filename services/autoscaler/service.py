"""The autoscaler service (SPEC A1–A7): asks providers for instances when waiting jobs need them.

It follows the scheduler's job events (the queue) and the monitor's node events (what is registered), and
records every decision as an event of its own before acting on it: `InstanceRequested` (with the jobs it
is for) before the provider is asked, `InstanceLaunched` or `ProvisionFailed` with the provider's answer,
`InstanceReady` when the instance's agent registers with what its type promises, `InstanceReleased` when
it is ended. A restarted autoscaler rebuilds all of it from its log; providers start instances
idempotently by name, so an instance asked for just before a crash is never started twice.

An ended instance leaves the state once the jobs it was asked for were archived (state.py), and with it the
version of its log: a new instance that happens to get its name goes on from the version its log holds.

It starts from the latest snapshot of its state (libs.skeleton.snapshots): its instances, the jobs not yet archived,
the nodes and the last entries of its log it shows, with where it stood in its log and in the events it follows.

Decisions are made on events: every fold wakes the scale loop, so a job that queues is looked at within a
second; provider calls run in tasks of their own and never hold up the loop. What to record is decided by
the pure rules (rules.py, with the placement search in scaling.py); the queue status and the autoscaler's log
are answered in handlers.py; this module wires them to the state, the upstreams, the providers and the loop.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, ClassVar, Self

import msgspec

from libs.auth import issue_node_token
from libs.contracts import subjects
from libs.contracts.autoscaling import check_autoscaler
from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import EventEnvelope, InstanceRequested, ReleaseCause, WaitingJobsPacked
from libs.eventstore import NewEvent
from libs.messaging.rpc import serve_operations
from libs.natsroles import events_consumer
from libs.outages import OUTAGES
from libs.skeleton.eventsourced import EventSourcedService, Loop, Pacer, Upstream
from libs.skeleton.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from services.autoscaler import metrics
from services.autoscaler.handlers import AutoscalerQueries
from services.autoscaler.providers import NoCapacity, Provider, ProvisionError
from services.autoscaler.providers.ec2 import Ec2Provider
from services.autoscaler.providers.local import LocalProvider
from services.autoscaler.rules import (
    INSTANCE,
    drained,
    drains,
    launch_failed,
    launched,
    overdue,
    packing,
    registered,
    released,
    requested,
)
from services.autoscaler.scaling import scale_up
from services.autoscaler.state import AutoscalerState, Instance, SavedAutoscalerState

log = get_logger(__name__)
NAMES_PER_DECISION = 64  # at most this many instances are asked for in one decision
HISTORY = 10_000  # entries of its own log kept for `trainyard autoscaler log`


class Autoscaler(EventSourcedService):
    name = "autoscaler"
    # What a snapshot of its state depends on: the state, its folds (the jobs' and the nodes' too) and the contracts.
    snapshot_code: ClassVar[tuple[str, ...]] = (
        "services/autoscaler/service.py", "services/autoscaler/state.py", "libs/jobstatus.py", "libs/nodes.py",
        "libs/contracts/*.py", "libs/skeleton/eventsourced.py", "libs/skeleton/snapshots.py")

    def __init__(self, runtime: ServiceRuntime, cluster: ClusterConfig,
                 providers: Mapping[str, Provider] | None = None) -> None:
        super().__init__(runtime)
        self.cluster = cluster
        self.config = cluster.autoscaler
        self.state = AutoscalerState(instance_left=partial(self.forget, INSTANCE))
        self.providers: Mapping[str, Provider] = providers if providers is not None else {
            "local": LocalProvider(),
            "aws-ec2": Ec2Provider(self.config.instance_types, cluster=self.config.cluster,
                                   nats_url=runtime.settings.nats_url)}
        self.secret = runtime.settings.require_auth_secret()  # signs its instances' node credentials
        self._busy: set[str] = set()  # instances a provider call is under way for
        self._calls: set[asyncio.Task[None]] = set()
        self._told_unservable: set[str] = set()  # the unservable jobs of the last decision, each warned of once
        self.history: deque[EventEnvelope] = deque(maxlen=HISTORY)  # its own log, newest last (A6)

    @classmethod
    def create(cls, runtime: ServiceRuntime) -> Self:
        cluster = ClusterConfig.load(runtime.settings.cluster_config)
        check_autoscaler(cluster.autoscaler, cluster.flavors)  # a config that cannot work stops the start
        return cls(runtime, cluster)

    # --- state, upstreams, handlers, loops -------------------------------------------------------------

    def fold(self, envelope: EventEnvelope) -> None:
        self.state.apply(envelope)
        if not isinstance(envelope.event, WaitingJobsPacked):  # its log is its instances' story
            self.history.append(envelope)

    def save_state(self) -> bytes:
        return _ENCODER.encode(_Saved(state=self.state.to_save(), history=list(self.history)))

    def load_state(self, data: bytes) -> None:
        saved = _DECODER.decode(data)
        del data  # read: let it go before the state is made of it (the base keeps no other reference)
        self.state = AutoscalerState.restored(saved.state, instance_left=partial(self.forget, INSTANCE))
        self.history.clear()
        self.history.extend(saved.history)

    def upstreams(self) -> Sequence[Upstream]:
        return [
            Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("scheduler", "job", "drain", "settings"),
                     consumer=events_consumer("scheduler"), message_type=EventEnvelope, fold=self.state.apply_scheduler,
                     reactions=False),
            Upstream(stream=subjects.EVENTS_STREAM, subject=subjects.events_of("monitor", "node"),
                     consumer=events_consumer("monitor"), message_type=EventEnvelope, fold=self.state.apply_monitor,
                     react=lambda envelope: registered(self.state, self.cluster, envelope)),
        ]

    def handlers(self) -> None:
        queries = AutoscalerQueries(self.state, self.history)
        serve_operations(self.rt.broker, self.name, queries.routes(), secret=self.secret)

    def loops(self) -> Mapping[str, Loop]:
        return {"scale": self.scale_loop}

    def sample_metrics(self) -> None:
        metrics.sample(self.state, [kind.name for kind in self.config.instance_types])

    # --- the scale loop -------------------------------------------------------------------------------

    async def scale_loop(self) -> None:
        """Once every upstream is replayed: decide after every fold, and at least every second."""
        await self.caught_up()
        await self.reconcile()
        reconciled = time.monotonic()
        pacer = Pacer()
        while True:
            with pacer.run():
                await self.scale_once(datetime.now(UTC))
            if time.monotonic() - reconciled >= self.config.reconcile_seconds:
                reconciled = time.monotonic()
                self._spawn(self._reconcile_weathering())
            with suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 1.0)
            await pacer.turn()
            self.wake.clear()

    async def scale_once(self, now: datetime) -> None:
        """Ask for the instances waiting jobs need, then make the provider calls that are due."""
        if not self.config.instance_types and not self.state.live:
            return  # nothing to start, nothing to release: no decision to make
        async with self.lock:
            decided = scale_up(self.state.demand(self.cluster), self.config, on_the_way=self.state.on_the_way(),
                               promised=self.state.promised(), nominated=self.state.packing,
                               alive=self.state.alive_per_type(),
                               cooling=self.state.cooling(now),
                               suffixes=[secrets.token_hex(3) for _ in range(NAMES_PER_DECISION)], now=now)
            for job_id in set(decided.unservable) - self._told_unservable:
                log.warning("autoscaler.job_unservable", job_id=job_id,
                            reason="no instance type serves its flavors, pool or nodes")
            # Only those still unservable are remembered: a job that started, ended or left is not kept.
            self._told_unservable = set(decided.unservable)
            for request in decided.requests:
                log.info("autoscaler.instance_requested", instance=request.instance,
                         instance_type=request.instance_type, jobs=request.jobs)
            # The instances and where the waiting jobs go on them, in one append: a restart packs as before.
            changes = requested(decided, self.config) + packing(self.state, decided)
            await self._continue_left_names(changes)
            await self.record(changes)
            await self.record(drains(self.state, self.config, now))
            kept, idle = drained(self.state)
            await self.record(kept)
            launches = [i for i in self.state.to_launch() if i.name not in self._busy]
            late = [i for i in overdue(self.state, self.config, now) if i.name not in self._busy]
            idle = [i for i in idle if i.name not in self._busy]
        for instance in launches:
            self._call(instance, self._launch(instance))
        for instance in late:
            self._call(instance, self._release(instance, f"its agent did not register within "
                                                         f"{self.config.boot_timeout_seconds:g}s", "boot-timeout"))
        for instance in idle:
            kind = self.config.instance_type(instance.instance_type)
            self._call(instance, self._release(instance, f"idle for {kind.idle_seconds:g}s" if kind else "idle",
                                               "idle"))

    async def _continue_left_names(self, changes: list[NewEvent]) -> None:
        """A new instance named as one that left the state (the same random suffix again) goes on in that one's log,
        at the version the log holds, which the state no longer knows."""
        for change in changes:
            key = (change.aggregate_type, change.aggregate_id)
            if isinstance(change.event, InstanceRequested) and key not in self.versions:
                stored = await self.rt.store.read_aggregate(*key)
                if stored:
                    self.versions[key] = stored[-1].version

    def _call(self, instance: Instance, call: Coroutine[Any, Any, None]) -> None:
        self._busy.add(instance.name)

        async def calling() -> None:
            try:
                await call
            finally:
                self._busy.discard(instance.name)
                self.wake.set()

        self._spawn(calling())

    def _spawn(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(call)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _reconcile_weathering(self) -> None:
        try:
            await self.reconcile()
        except OUTAGES as exc:  # the next round tries again
            log.warning("autoscaler.reconcile_postponed", error=str(exc))

    def _provider(self, instance: Instance) -> Provider | None:
        return self.providers.get(instance.provider)

    async def _launch(self, instance: Instance) -> None:
        kind, provider = self.config.instance_type(instance.instance_type), self._provider(instance)
        if kind is None or provider is None:
            changes = launch_failed(self.state, instance.name, f"no provider {instance.provider} or type "
                                                               f"{instance.instance_type} in the config now",
                                    capacity=False, now=datetime.now(UTC))
        else:
            try:
                provider_id = await provider.launch(instance.name, kind, issue_node_token(self.secret, instance.name))
            except ProvisionError as exc:
                log.warning("autoscaler.provision_failed", instance=instance.name, error=str(exc),
                            capacity=isinstance(exc, NoCapacity))
                changes = launch_failed(self.state, instance.name, str(exc), capacity=isinstance(exc, NoCapacity),
                                        now=datetime.now(UTC))
            else:
                changes = launched(self.state, instance.name, provider_id)
        async with self.lock:
            await self.record(changes)

    async def _release(self, instance: Instance, reason: str, cause: ReleaseCause) -> None:
        provider = self._provider(instance)
        if provider is not None:
            try:
                await provider.terminate(instance.name)
            except ProvisionError as exc:  # asked again on a later round
                log.warning("autoscaler.release_failed", instance=instance.name, error=str(exc))
                return
        log.info("autoscaler.instance_released", instance=instance.name, reason=reason)
        async with self.lock:
            await self.record(released(self.state, instance.name, reason, cause))

    async def reconcile(self) -> None:
        """At start, the providers' own lists against the log: an instance the log does not know (or knows
        ended) is terminated; a launched one the provider no longer has is recorded released."""
        for name, provider in self.providers.items():
            try:
                running = await provider.running()
            except ProvisionError as exc:
                log.warning("autoscaler.provider_unreachable", provider=name, error=str(exc))
                continue
            for instance_name in running:
                known = self.state.instances.get(instance_name)
                if (known is None or not known.alive) and instance_name not in self._busy:
                    log.warning("autoscaler.unknown_instance_ended", instance=instance_name, provider=name)
                    with suppress(ProvisionError):  # ended at the next reconciliation
                        await provider.terminate(instance_name)
            settled = datetime.now(UTC) - timedelta(seconds=self.config.listing_grace_seconds)
            gone = [i for i in self.state.live.values()
                    if i.provider == name and i.provider_id is not None and i.name not in running
                    and i.name not in self._busy and i.requested_at < settled]
            async with self.lock:
                for instance in gone:
                    await self.record(released(self.state, instance.name, f"{name} no longer runs it", "gone"))


class _Saved(msgspec.Struct, array_like=True):
    """A snapshot of the autoscaler: its state, and the entries of its log it shows (`HISTORY`)."""

    state: SavedAutoscalerState
    history: list[EventEnvelope]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Saved)
