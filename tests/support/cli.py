"""The CLI without a stack: its commands run against a stand-in client, so what they print is checked without
NATS, and no stack of the machine is ever reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from client import cli

runner = CliRunner()


def isolate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No secret and no local stack unless a test provides them; NATS is never reachable."""
    monkeypatch.delenv("TRAINYARD_AUTH_SECRET", raising=False)
    monkeypatch.delenv("TRAINYARD_AUTH_SECRET_FILE", raising=False)
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")


class FakeClient:
    """Stands in for TrainyardClient: records calls, answers with what the test gave it."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        async def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            answer = self.answers[name]
            if isinstance(answer, Exception):
                raise answer
            if callable(answer):
                return await answer(*args, **kwargs)
            return answer

        return method

    async def close(self) -> None:
        pass


def stand_in(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """A fake that the CLI's commands connect to instead of the client."""
    client = FakeClient()

    class Factory:
        @staticmethod
        async def open() -> FakeClient:
            return client

    monkeypatch.setattr(cli, "TrainyardClient", Factory)
    return client


@pytest.fixture(autouse=True)
def no_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """For a test module that imports it: `isolate` before every test."""
    isolate(monkeypatch, tmp_path)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """For a test module that imports it: the stand-in client the commands connect to."""
    return stand_in(monkeypatch)


def invoke(*args: str) -> Result:
    return runner.invoke(cli.app, list(args))
