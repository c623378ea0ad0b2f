"""The local stack's nats-server keeps what it acknowledged through a crash of nats-server itself, though it
does not sync every write to disk (as its PostgreSQL does not fsync); deploy/'s syncs every write."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import nats
from nats.js.api import StorageType

from devstack.natslogins import provision_nats_logins
from devstack.servers import free_port, start_nats
from libs.natsroles import DEVELOPMENT_JETSTREAM, DURABLE_JETSTREAM


def test_the_stack_hands_writes_to_the_os_and_deploy_syncs_them(tmp_path: Path) -> None:
    local = provision_nats_logins(tmp_path / "local").read_text()
    assert local.endswith(DEVELOPMENT_JETSTREAM) and "sync_interval" not in local
    synced = provision_nats_logins(tmp_path / "synced", sync_every_write=True).read_text()
    assert synced.endswith(DURABLE_JETSTREAM) and "sync_interval: always" in synced


async def test_acknowledged_messages_survive_a_crash_of_nats_server(tmp_path: Path) -> None:
    config = tmp_path / "nats.conf"
    config.write_text(DEVELOPMENT_JETSTREAM)  # the stack's JetStream settings, without its logins
    port = free_port()
    server = start_nats(tmp_path / "data", port, config)
    try:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        await js.add_stream(name="REPORTS", subjects=["reports.>"], storage=StorageType.FILE)
        acknowledged = [f"exit-{n}".encode() for n in range(300)]
        for n, payload in enumerate(acknowledged):  # each acknowledged before the next is sent
            await js.publish(f"reports.{n}", payload)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        await nc.close()

        server = start_nats(tmp_path / "data", port, config)
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        info = await js.stream_info("REPORTS")
        assert info.state.messages == len(acknowledged)
        last = await js.get_last_msg("REPORTS", f"reports.{len(acknowledged) - 1}")
        assert last.data == acknowledged[-1]
        await nc.close()
    finally:
        server.kill()
        await asyncio.to_thread(server.wait, 10)
