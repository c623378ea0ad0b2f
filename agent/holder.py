"""The holder of one node's command: what lets a job outlive its agent (as slurmstepd outlives slurmd).

The agent starts a holder per rank, in a session of its own, and gives it the command through a spec
file in the rank's folder. The holder starts the command (in a session and process group of its own,
so a stop reaches every child it forks), points its output at the folder's `output.log`, waits for it
and writes its exit code to `exit.json`. Nothing of the command hangs on the agent: no pipe breaks when
the agent is killed or restarted, and a new agent adopts the command from these files (agent/held.py):
it ships the output from where the last one stopped and reports the exit when it comes.

Run as `python -I -S holder.py <rank folder>`: standard library only, so that it starts fast, needs no
installed package and reads no PYTHON* variable. It carries none of the job's TRAINYARD_* variables
itself, so a stop that kills every process of the attempt leaves it alive to record the exit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

SPEC_NAME = "holder-spec.json"  # argv, env and cwd; removed once read (the job's secrets are in it)
PID_NAME = "job.pid"  # the command's pid, which is its process group's id too
OUTPUT_NAME = "output.log"
EXIT_NAME = "exit.json"  # {"exit_code": ..., "exited_at": ..., "started": ...}


def write_atomically(path: Path, text: str) -> None:
    """Readers see the whole file or none of it."""
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    partial.replace(path)


def exit_record(code: int, *, started: bool) -> str:
    # A process killed by signal N reports -N; shells report 128+N. Use the shell convention.
    return json.dumps({"exit_code": 128 - code if code < 0 else code, "started": started,
                       "exited_at": datetime.now(UTC).isoformat()})


def hold(folder: Path) -> int:
    spec_path = folder / SPEC_NAME
    spec = json.loads(spec_path.read_text())
    spec_path.unlink()
    with (folder / OUTPUT_NAME).open("ab") as output:
        try:
            child = subprocess.Popen(spec["argv"], env=spec["env"], cwd=spec["cwd"], stdin=subprocess.DEVNULL,
                                     stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            output.write(f"[trainyard] cannot start {spec['argv'][0]!r}: {exc}\n".encode())
            write_atomically(folder / EXIT_NAME, exit_record(127, started=False))
            return 0
    write_atomically(folder / PID_NAME, str(child.pid))
    code = child.wait()
    write_atomically(folder / EXIT_NAME, exit_record(code, started=True))
    return 0


def main() -> int:
    # A terminal's hang-up or interrupt is not meant for the holder; a stop is sent to the command.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return hold(Path(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
