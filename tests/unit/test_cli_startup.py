"""The CLI starts fast: importing it loads none of what only some commands, or only the services, need.

Each check runs in a fresh interpreter, since this test process has imported much of it already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def modules_loaded_by(code: str, candidates: tuple[str, ...]) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))"
    finished = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    loaded: list[str] = json.loads(finished.stdout.splitlines()[-1])
    return loaded


def test_importing_the_cli_does_not_import_faststream() -> None:
    finished = subprocess.run([sys.executable, "-c", "import client.cli, sys; print('faststream' in sys.modules)"],
                              capture_output=True, text=True, check=True, timeout=60)
    assert finished.stdout.strip() == "False"


def test_importing_the_cli_leaves_what_commands_need_to_them() -> None:
    # The client (NATS, asyncio), output (rich), YAML, tokens (PyJWT) and the services' libraries.
    heavy = ("faststream", "opentelemetry", "structlog", "rich", "yaml", "jwt", "nats", "asyncio", "client.api")
    assert modules_loaded_by("import client.cli", heavy) == []


def test_the_client_leaves_the_services_libraries_out() -> None:
    assert modules_loaded_by("import client.api", ("faststream", "opentelemetry", "structlog")) == []


@pytest.mark.parametrize("args", [["--help"], ["list", "--help"]])
def test_the_cli_runs_as_a_module(args: list[str]) -> None:
    finished = subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True,
                              timeout=60, check=False)
    assert finished.returncode == 0, finished.stderr
    assert "Usage:" in finished.stdout
