"""What the agent publishes for the ranks it runs: their output in numbered log chunks, their start and exit
reports, their metrics (R1) and their resource usage (L9), and the node's cache reports.

Every JetStream publish is retried until the stream acknowledges it, under a message id that makes a repeat
harmless; a rank's output file is the buffer meanwhile, so a job never waits on its agent. Usage is best
effort: a sample that cannot be stored is passed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from nats.aio.client import Client
from nats.js.kv import KeyValue

from agent.output.runs import RunRelay, socket_path
from agent.output.tail import OutputTail
from agent.output.usage import GroupSampler, ProcessTree, accelerator_percent, system_values
from libs.contracts import subjects
from libs.contracts.agent import LogChunk, ProcessExited, ProcessStarted, UsageSample
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.datacache import CacheReport
from libs.contracts.runs import MetricBatch
from libs.telemetry.logs import get_logger

log = get_logger(__name__)
LOG_FLUSH_SECONDS = 0.2  # how often a node's output file is read for lines to ship
USAGE_SECONDS = float(os.environ.get("TRAINYARD_USAGE_SECONDS", "2"))
FIRST_SAMPLE_SECONDS = 0.5


class ShippedRank(Protocol):
    """What the shipper reads of a rank it ships for (agent/ranks/running_rank.py `RunningNode`)."""

    job_id: str
    attempt: int
    task: int
    rank: int
    trace: dict[str, str]  # the job's trace context, carried on the rank's reports
    output: OutputTail | None
    output_done: bool  # the process ended: ship what is left, then stop
    relay: RunRelay | None

    async def pause(self, seconds: float) -> None: ...


class OutputShipper:
    """Publishes what leaves the node for its ranks, on the agent's one connection."""

    def __init__(self, nc: Client, info: NodeInfo) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.info = info
        self._usage: KeyValue | None = None  # the usage bucket, once looked up
        self._processes = ProcessTree()  # one look at the host's processes serves every rank sampled meanwhile

    def relay(self, node: ShippedRank, root: Path) -> RunRelay:
        """R1: the socket the rank's processes log their metrics to, relayed to JetStream."""
        async def publish(batch: MetricBatch, msg_id: str) -> None:
            await self.publish(subjects.job_metrics(batch.job_id, self.info.name), encode(batch), msg_id)
        return RunRelay(job_id=node.job_id, attempt=node.attempt, task=node.task, rank=node.rank, node=self.info.name,
                        path=socket_path(root), publish=publish)

    async def publish_cache(self, report: CacheReport, msg_id: str) -> None:
        await self.publish(subjects.agent_cache(self.info.name), encode(report), msg_id)

    async def sample_usage(self, node: ShippedRank, pid: int) -> None:
        """Keep the node's latest usage in the usage bucket while it runs (L9)."""
        if pid <= 0:
            return
        sampler = GroupSampler(pid, self._processes)
        key = subjects.usage_key(node.job_id, node.attempt, node.rank, self.info.name)
        pause = min(USAGE_SECONDS, FIRST_SAMPLE_SECONDS)
        while True:
            # A sample costs a scan of every process on the host: a job that ends within FIRST_SAMPLE_SECONDS
            # has none (the first measures the CPU since each process started, the next since the one before).
            await asyncio.sleep(pause)
            pause = USAGE_SECONDS
            cpu, memory_mib, processes = await asyncio.to_thread(sampler.sample)
            boards = await asyncio.to_thread(accelerator_percent) if self.info.accelerators else None
            sample = UsageSample(job_id=node.job_id, attempt=node.attempt, rank=node.rank, node=self.info.name,
                                 cpu_percent=cpu, memory_mib=memory_mib, processes=processes,
                                 sampled_at=datetime.now(UTC), accelerator_percent=boards)
            if node.relay is not None:  # R1: the rank's system series in its run
                node.relay.system(system_values(sample), sample.sampled_at)
            with contextlib.suppress(Exception):  # usage is best effort; the job goes on without it
                if self._usage is None:
                    self._usage = await self.js.key_value(subjects.USAGE_BUCKET)
                await self._usage.put(key, encode(sample))
            if (task := asyncio.current_task()) is not None and task.cancelling():
                return  # cancelled while publishing: nats-py swallows a cancel that comes while it flushes

    async def ship_continuously(self, node: ShippedRank, stop: asyncio.Event | None = None) -> None:
        """Ship the node's output file as it grows, a chunk at a time, in order; once the process ended,
        what is left (a last line without its newline too), then stop. The file is the buffer: the process
        writes on while a shipment waits for NATS, and a later agent ships what this one could not. With
        `stop`: once it is set, end after the chunk on its way (the next shipper takes the rest)."""
        assert node.output is not None
        while not (stop is not None and stop.is_set()):
            final = node.output_done  # read before the file: nothing is written after the exit is known
            # Read in a thread, unless there is nothing to read (one look at the file's size).
            taken = await asyncio.to_thread(node.output.take, final=final) if node.output.waiting() else None
            if taken is None:
                if final:
                    return
                await node.pause(LOG_FLUSH_SECONDS)
                continue
            seq, lines = taken
            chunk = LogChunk(job_id=node.job_id, attempt=node.attempt, rank=node.rank, task=node.task,
                             node=self.info.name, seq=seq, lines=lines)
            msg_id = f"{node.job_id}.{node.attempt}.{node.task}.{node.rank}.log.{seq}"
            await self.publish(subjects.node_logs(node.job_id, node.rank, self.info.name), encode(chunk), msg_id)
            await asyncio.to_thread(node.output.shipped)

    async def report(self, report: ProcessStarted | ProcessExited, kind: str, node: ShippedRank) -> None:
        msg_id = f"{node.job_id}.{node.attempt}.{node.task}.{node.rank}.{kind}"
        await self.publish(subjects.agent_report(self.info.name), encode(report), msg_id, node.trace)

    async def publish(self, subject: str, payload: bytes, msg_id: str, trace: dict[str, str] | None = None) -> None:
        """Publish to JetStream until it acknowledges; the message id makes repeats harmless."""
        delay = 0.1
        while True:
            try:
                await self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id, **(trace or {})})
                return
            except Exception as exc:  # JetStream unavailable or timed out: try again
                if self.nc.is_closed:  # the agent closed: what it did not publish, the next one does
                    raise
                log.warning("agent.publish_retry", subject=subject, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
