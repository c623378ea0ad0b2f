"""Run a node's command between its lifecycle scripts (SPEC J18), inside the job's environment.

    python -m agent.lifecycle [--before-start CMD] [--after-end CMD] -- COMMAND...

`before_start` runs first; if it fails, the command is not started and its exit code is the node's.
`after_end` runs after the command however it ended (TRAINYARD_EXIT_CODE tells it how); if it
fails, a successful node fails with its exit code. Every step is announced in the job's log.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from types import FrameType

PREFIX = "[trainyard]"


def _say(text: str) -> None:
    print(f"{PREFIX} {text}", flush=True)


def _run(argv: list[str], env: dict[str, str] | None = None) -> int:
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        _say(f"cannot start {argv[0]!r}: {exc}")
        return 127

    def forward(signum: int, _: FrameType | None) -> None:
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code


def run(before_start: str | None, after_end: str | None, command: list[str]) -> int:
    if before_start:
        _say(f"lifecycle before_start: {before_start}")
        code = _run(shlex.split(before_start))
        if code != 0:
            _say(f"lifecycle before_start failed with exit code {code}; the run command was not started")
            return code
    code = _run(command)
    if after_end:
        _say(f"lifecycle after_end: {after_end}")
        after = _run(shlex.split(after_end), env={**os.environ, "TRAINYARD_EXIT_CODE": str(code)})
        if after != 0:
            _say(f"lifecycle after_end failed with exit code {after}")
            return code or after
    return code


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agent.lifecycle", description=__doc__)
    parser.add_argument("--before-start")
    parser.add_argument("--after-end")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run after --")
    sys.exit(run(args.before_start, args.after_end, command))


if __name__ == "__main__":
    main()
