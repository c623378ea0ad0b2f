"""What JetStream's `sync_interval: always` costs: acknowledged publishes to a file stream, per second.

    python -m bench.jetstream_sync [--messages 2000] [--size 1024] [--in-flight 1,32]

The stack runs nats-server with every acknowledged write synced to disk (libs.natsroles.DURABLE_JETSTREAM),
so an acknowledged event survives a crash of the server's machine; the server's default syncs every two
minutes, and a crash of the machine can lose what was acknowledged since. This starts two servers of
the same binary side by side, one of each, each with a file stream like TRAINYARD_EVENTS, and publishes
MESSAGES messages of SIZE bytes with a message id each (as the outbox relay does), IN_FLIGHT at a time
(1: one after the other, each acknowledged first; more: several in flight, as the relay's runs are), and
prints messages per second and the median and 99th-percentile time to the acknowledgement.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import StorageType, StreamConfig

from devstack.servers import free_port, start_nats
from libs.natsroles import DURABLE_JETSTREAM


async def publish_all(url: str, messages: int, size: int, in_flight: int) -> tuple[float, list[float]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE))
    body = b"x" * size
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for number in range(messages):
        queue.put_nowait(number)

    async def publisher() -> None:
        while not queue.empty():
            number = queue.get_nowait()
            began = time.perf_counter()
            await js.publish(f"bench.{number % 16}", body, headers={"Nats-Msg-Id": f"m{number}"})
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(publisher() for _ in range(in_flight)))
    elapsed = time.perf_counter() - began
    await nc.close()
    return messages / elapsed, latencies


async def measure(always: bool, messages: int, size: int, in_flight: int) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench-js-") as folder:
        config = Path(folder) / "nats.conf"
        config.write_text(DURABLE_JETSTREAM if always else "")
        port = free_port()
        server = start_nats(Path(folder) / "data", port, config=config)
        try:
            return await publish_all(f"nats://127.0.0.1:{port}", messages, size, in_flight)
        finally:
            server.terminate()
            server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.jetstream_sync", description=__doc__)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--in-flight", default="1,32", help="comma-separated publishers at a time")
    args = parser.parse_args()
    print(f"{'sync':<16}{'in flight':>10}{'msg/s':>10}{'p50 ms':>9}{'p99 ms':>9}")
    for in_flight in (int(n) for n in args.in_flight.split(",")):
        rates = {}
        for always in (False, True):
            rate, latencies = asyncio.run(measure(always, args.messages, args.size, in_flight))
            rates[always] = rate
            cut = statistics.quantiles(latencies, n=100)
            label = "always" if always else "default (2 min)"
            print(f"{label:<16}{in_flight:>10}{rate:>10.0f}{cut[49] * 1000:>9.2f}{cut[98] * 1000:>9.2f}", flush=True)
        print(f"{'ratio always/default':<26}{rates[True] / rates[False]:>10.2f}")


if __name__ == "__main__":
    main()
