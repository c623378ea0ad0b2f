"""NATS_URL naming a cluster's servers, and how many of them keep each stream."""

from __future__ import annotations

import pytest

from libs.messaging.connection import STREAM_REPLICAS_VARIABLE, server_urls, stream_replicas


def test_a_cluster_is_named_by_its_servers_urls_separated_by_commas() -> None:
    assert server_urls("nats://a:4222, nats://b:4222,,nats://c:4222 ") == ["nats://a:4222", "nats://b:4222",
                                                                          "nats://c:4222"]
    assert server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]


def test_streams_are_kept_on_one_server_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STREAM_REPLICAS_VARIABLE, raising=False)
    assert stream_replicas() == 1
    monkeypatch.setenv(STREAM_REPLICAS_VARIABLE, "3")
    assert stream_replicas() == 3


@pytest.mark.parametrize("value", ["0", "6", "three", "-1", "2.5"])
def test_a_replica_count_jetstream_cannot_keep_is_refused_with_what_to_give(monkeypatch: pytest.MonkeyPatch,
                                                                            value: str) -> None:
    monkeypatch.setenv(STREAM_REPLICAS_VARIABLE, value)
    with pytest.raises(ValueError, match="1 to 5"):
        stream_replicas()
