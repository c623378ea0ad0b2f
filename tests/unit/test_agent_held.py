"""A node's command under its holder (agent/processes/holder.py, agent/processes/holder_client.py): it runs on
without the agent that started it, another agent adopts it, and its output is shipped once, in order, whichever
agent ships it (agent/output/tail.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.output.tail import CHUNK_LINES, MAX_LINE_BYTES, OutputTail, split_lines
from agent.processes.holder import EXIT_NAME, OUTPUT_NAME, start_ticks
from agent.processes.holder_client import HOLDER, HeldProcess, HoldServer
from agent.ranks.kept import rank_root
from agent.ranks.process import Record, end_recorded_jobs, read_records, write_record
from tests.support.strategies import SETTINGS

on_loop = pytest.mark.asyncio(loop_scope="session")
WAIT_SECONDS = 30  # for what happens at once, on a machine that may be slow to get to it


def shipped_lines(folder: Path, *, final: bool) -> list[str]:
    tail, lines = OutputTail(folder), []
    while (taken := tail.take(final=final)) is not None:
        lines += taken[1]
        tail.shipped()
    return lines


# --- output, a chunk at a time --------------------------------------------------------------------------


def test_a_line_without_its_newline_waits_for_the_rest_unless_the_process_ended() -> None:
    assert split_lines(b"one\ntwo\nthr", final=False) == (["one", "two"], 8)
    assert split_lines(b"one\ntwo\nthr", final=True) == (["one", "two", "thr"], 11)
    assert split_lines(b"thr", final=False) == ([], 0)


def test_a_long_line_comes_in_pieces_and_a_chunk_holds_at_most_its_lines() -> None:
    long = b"x" * (MAX_LINE_BYTES * 2 + 5)
    lines, used = split_lines(long + b"\n", final=False)
    assert [len(line) for line in lines] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 5] and used == len(long) + 1
    many = b"".join(b"%d\n" % i for i in range(CHUNK_LINES + 50))
    assert len(split_lines(many, final=True)[0]) == CHUNK_LINES


@SETTINGS
@given(st.lists(st.text(alphabet="abc é\t", max_size=40), max_size=600), st.booleans())
def test_every_line_is_taken_once_and_in_order(lines: list[str], newline_at_end: bool) -> None:
    data = "\n".join(lines).encode() + (b"\n" if newline_at_end and lines else b"")
    taken, offset = [], 0
    while chunk := split_lines(data[offset:], final=True)[0]:
        taken += chunk
        offset += split_lines(data[offset:], final=True)[1]
    expected = data.decode().split("\n")
    assert taken == (expected[:-1] if expected[-1] == "" else expected)


def test_a_chunk_on_its_way_when_the_agent_stopped_is_shipped_again_as_it_was(tmp_path: Path) -> None:
    (tmp_path / OUTPUT_NAME).write_bytes(b"a\nb\n")
    first = OutputTail(tmp_path)
    assert first.take(final=False) == (0, ["a", "b"])  # on its way when the agent died
    with (tmp_path / OUTPUT_NAME).open("ab") as output:
        output.write(b"c\n")

    second = OutputTail(tmp_path)  # the next agent
    assert second.take(final=False) == (0, ["a", "b"])  # the same number and lines: JetStream drops a repeat
    second.shipped()
    assert second.take(final=False) == (1, ["c"])
    second.shipped()
    assert OutputTail(tmp_path).take(final=True) is None


# --- the holder ------------------------------------------------------------------------------------------


async def held(folder: Path, script: str) -> HeldProcess:
    folder.mkdir(parents=True, exist_ok=True)
    return await HeldProcess.start(folder, [sys.executable, "-c", script], {"PATH": os.environ["PATH"]}, folder)


@on_loop
async def test_the_holder_records_the_output_and_the_exit(tmp_path: Path) -> None:
    process = await held(tmp_path, "print('hello'); raise SystemExit(3)")
    assert process.started
    code, _ = await process.wait_exit()
    assert code == 3
    assert shipped_lines(tmp_path, final=True) == ["hello"]


@on_loop
async def test_a_command_that_cannot_start_exits_127_and_says_why(tmp_path: Path) -> None:
    process = await HeldProcess.start(tmp_path, ["/no/such/program"], {}, tmp_path)
    assert not process.started
    assert (await process.wait_exit())[0] == 127
    assert shipped_lines(tmp_path, final=True)[0].startswith("[trainyard] cannot start '/no/such/program'")


def until(flag: Path) -> str:
    """Python that waits for `flag` to exist: a command that runs until the test lets it end."""
    return f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\n"


@on_loop
async def test_another_agent_adopts_the_command_and_sees_its_exit(tmp_path: Path) -> None:
    server, flag = HoldServer(), tmp_path / "go"
    started = await HeldProcess.start(tmp_path, [sys.executable, "-c", until(flag) + "print('late')"],
                                      {}, tmp_path, server)
    server.close()  # the agent that started it is gone
    # What a restarted agent makes of the record.
    adopted = HeldProcess(tmp_path, started.pid, started.holder_pid, started.holder_since)
    assert adopted.running
    flag.touch()
    assert (await adopted.wait_exit())[0] == 0
    assert shipped_lines(tmp_path, final=True) == ["late"]
    assert (await started.wait_exit())[0] == 0


@on_loop
async def test_an_exit_is_written_down_only_when_its_agent_did_not_report_it(tmp_path: Path) -> None:
    """The holder tells its agent each exit; it writes one to the rank's folder only when the agent went away
    before it reported it, for the next agent to find."""
    server = HoldServer()
    reported, unreported = tmp_path / "rank a", tmp_path / "rank b"  # told with their folders, spaces and all
    processes = []
    for folder, code in ((reported, 5), (unreported, 6)):
        folder.mkdir()
        processes.append(await HeldProcess.start(folder, [sys.executable, "-c", f"raise SystemExit({code})"], {},
                                                 folder, server))
    assert [(await process.wait_exit())[0] for process in processes] == [5, 6]
    assert not (reported / EXIT_NAME).exists() and not (unreported / EXIT_NAME).exists()
    await processes[0].reported()
    holder = processes[0].holder_pid
    server.close()  # gone before it reported the second
    async with asyncio.timeout(WAIT_SECONDS):
        while start_ticks(holder) is not None:
            await asyncio.sleep(0.05)
    assert not (reported / EXIT_NAME).exists()
    assert json.loads((unreported / EXIT_NAME).read_text())["exit_code"] == 6
    second = processes[1]
    assert HeldProcess(unreported, second.pid, second.holder_pid, second.holder_since).exit() is not None


def test_a_holder_started_by_an_agent_before_writes_every_exit_before_it_tells_it(tmp_path: Path) -> None:
    """An agent from before `--tell-exits` reads each exit from the rank's folder once told `ended <pid>`."""
    holder = subprocess.Popen([sys.executable, "-I", "-S", str(HOLDER), "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={}, cwd="/")
    assert holder.stdin is not None and holder.stdout is not None
    request = {"folder": str(tmp_path), "argv": [sys.executable, "-c", "raise SystemExit(7)"], "env": {},
               "cwd": str(tmp_path)}
    holder.stdin.write(json.dumps(request).encode() + b"\n")
    holder.stdin.flush()
    started, ended = holder.stdout.readline().split(), holder.stdout.readline().split()
    assert started[0] == b"started" and ended == [b"ended", started[1]]
    assert json.loads((tmp_path / EXIT_NAME).read_text())["exit_code"] == 7
    holder.stdin.close()
    assert holder.wait(timeout=10) == 0


@on_loop
async def test_a_killed_holder_counts_as_a_kill_and_takes_its_command_along(tmp_path: Path) -> None:
    process = await held(tmp_path, "import time; time.sleep(60)")
    adopted = HeldProcess(tmp_path, process.pid, process.holder_pid, process.holder_since)
    os.kill(process.holder_pid, signal.SIGKILL)
    assert (await process.wait_exit())[0] == 137  # the agent that started it learns it from the holder's pipe
    assert (await adopted.wait_exit())[0] == 137
    async with asyncio.timeout(WAIT_SECONDS):  # taken along: gone once the kernel got to it
        while Path(f"/proc/{process.pid}").exists() and "Z" not in Path(f"/proc/{process.pid}/stat").read_text():
            await asyncio.sleep(0.05)
    assert json.loads((tmp_path / EXIT_NAME).read_text())["exit_code"] == 137


def until_dead(pid: int) -> None:
    """Wait until the process `pid` is dead (gone, or a zombie), blocking whatever loop calls it."""
    while start_ticks(pid) is not None and "Z" not in Path(f"/proc/{pid}/stat").read_text():
        time.sleep(0.01)


@on_loop
async def test_a_start_right_after_its_holder_was_killed_runs_in_a_new_holder_at_once(tmp_path: Path) -> None:
    """The agent asks whether its holder still runs only now and then: one killed just before a start, before the
    agent read the end of its output, is found gone by that start's request, which a new holder then takes."""
    server = HoldServer()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = await HeldProcess.start(tmp_path / "a", [sys.executable, "-c", "pass"], {}, tmp_path, server)
    assert (await first.wait_exit())[0] == 0
    os.kill(first.holder_pid, signal.SIGKILL)
    until_dead(first.holder_pid)  # without giving the loop a turn: nothing of its end was read
    began = time.monotonic()
    second = await HeldProcess.start(tmp_path / "b", [sys.executable, "-c", "pass"], {}, tmp_path, server)
    assert second.started and second.holder_pid not in (0, first.holder_pid)
    assert time.monotonic() - began < 10  # not after the request's timeout (HOLDER_START_SECONDS)
    assert (await second.wait_exit())[0] == 0
    server.close()


@on_loop
async def test_commands_outlive_their_agent_and_the_holder_ends_after_the_last(tmp_path: Path) -> None:
    server, flag = HoldServer(), tmp_path / "go"
    sleeping = []
    for folder in (tmp_path / "a", tmp_path / "b"):
        folder.mkdir()
        sleeping.append(await HeldProcess.start(folder, [sys.executable, "-c", until(flag)], {}, folder, server))
    [holder] = {process.holder_pid for process in sleeping}  # one holder holds both
    assert start_ticks(holder) == sleeping[0].holder_since
    parents = {int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in sleeping}
    assert parents == {holder}
    server.close()  # the agent is gone: its input ends
    assert all(process.running for process in sleeping)  # the jobs run on
    flag.touch()
    assert [(await process.wait_exit())[0] for process in sleeping] == [0, 0]
    async with asyncio.timeout(WAIT_SECONDS):  # once its commands ended, the holder ends too, having reaped them
        while start_ticks(holder) is not None:
            await asyncio.sleep(0.05)


@on_loop
async def test_what_a_command_leaves_behind_is_the_holder_s_to_reap(tmp_path: Path) -> None:
    """As bwrap leaves its sandbox's first process behind: the holder becomes its parent and reaps it, so that its
    CPU is counted as its jobs' rather than lost to the machine's init."""
    server, flag = HoldServer(), tmp_path / "go"
    script = (f"import subprocess, sys\nleft = subprocess.Popen([sys.executable, '-c', {until(flag)!r}])\n"
              "print(left.pid, flush=True)\n")
    process = await HeldProcess.start(tmp_path, [sys.executable, "-c", script], {}, tmp_path, server)
    assert (await process.wait_exit())[0] == 0
    left = int((tmp_path / OUTPUT_NAME).read_text().split()[0])
    assert int(Path(f"/proc/{left}/stat").read_text().rsplit(")", 1)[1].split()[1]) == process.holder_pid
    flag.touch()
    async with asyncio.timeout(WAIT_SECONDS):  # reaped: no zombie left
        while Path(f"/proc/{left}").exists():
            await asyncio.sleep(0.05)
    server.close()


@on_loop
async def test_the_holder_tells_its_agent_when_a_command_ended(tmp_path: Path) -> None:
    server = HoldServer()
    process = await HeldProcess.start(tmp_path, [sys.executable, "-c", "raise SystemExit(4)"], {}, tmp_path, server)
    async with asyncio.timeout(WAIT_SECONDS):  # told, not found by looking at the folder
        await server.ended(process.pid).wait()
    assert (await process.wait_exit())[0] == 4
    server.close()


@on_loop
async def test_the_command_is_found_on_its_own_path_and_runs_where_asked(tmp_path: Path) -> None:
    tools, work = tmp_path / "tools", tmp_path / "work"
    for folder in (tools, work):
        folder.mkdir()
    (tools / "where").write_text("#!/bin/sh\npwd\n")
    (tools / "where").chmod(0o755)
    process = await HeldProcess.start(tmp_path, ["where"], {"PATH": f"/nonexistent:{tools}"}, work)
    assert (await process.wait_exit())[0] == 0
    assert shipped_lines(tmp_path, final=True) == [str(work)]


@on_loop
async def test_a_command_starts_with_every_signal_at_its_default(tmp_path: Path) -> None:
    """The holder ignores a terminal's hang-up and interrupt for itself; a job must not inherit that: one whose
    checkpoint signal is SIGINT would never hear it."""
    process = await HeldProcess.start(tmp_path, ["/bin/sh", "-c", "grep SigIgn /proc/self/status"], {}, tmp_path)
    assert (await process.wait_exit())[0] == 0
    ignored = int(shipped_lines(tmp_path, final=True)[0].split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} is ignored in the job"


@on_loop
async def test_an_exit_told_needs_no_folder_and_one_that_cannot_be_recorded_counts_as_a_kill(tmp_path: Path) -> None:
    told, lost, flag = tmp_path / "told", tmp_path / "lost", tmp_path / "go"
    servers = [HoldServer(), HoldServer()]
    processes = []
    for folder, server in zip((told, lost), servers, strict=True):
        folder.mkdir()
        processes.append(await HeldProcess.start(folder, [sys.executable, "-c", until(flag)], {}, folder, server))
    servers[1].close()  # nobody to tell that one's exit to
    for folder in (told, lost):
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()  # removed under the command: its holder has nowhere to record the exit
    flag.touch()
    async with asyncio.timeout(WAIT_SECONDS):
        assert (await processes[0].wait_exit())[0] == 0  # its agent was told
        adopted = HeldProcess(lost, processes[1].pid, processes[1].holder_pid, processes[1].holder_since)
        assert (await adopted.wait_exit())[0] == 137


def test_a_holder_recorded_by_an_older_agent_is_told_by_its_command_line(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", str(tmp_path)])
    try:
        while str(tmp_path).encode() not in Path(f"/proc/{holder.pid}/cmdline").read_bytes():
            time.sleep(0.01)  # started, not yet the program it runs
        assert HeldProcess(tmp_path, 0, holder.pid)._holder_alive()
        assert not HeldProcess(tmp_path / "other", 0, holder.pid)._holder_alive()  # another folder's
        assert not HeldProcess(tmp_path, 0, holder.pid, holder_since=1)._holder_alive()  # a later process
    finally:
        holder.kill()
        holder.wait()


@on_loop
async def test_ending_the_jobs_of_a_node_kills_what_is_recorded_and_says_why(tmp_path: Path) -> None:
    folder = rank_root(tmp_path, "job-1", 1, 0, 0)
    process = await held(folder, "import time; time.sleep(60)")
    write_record(folder, Record(job_id="job-1", attempt=1, rank=0, pid=process.pid, holder=process.holder_pid,
                                holder_since=process.holder_since))
    assert [r.pid for _, r in read_records(tmp_path)] == [process.pid]

    ended = end_recorded_jobs(tmp_path, "node-a", "the node's platform was shut down")

    assert [r.job_id for r in ended] == ["job-1"]
    assert (await process.wait_exit())[0] == 137
    assert shipped_lines(folder, final=True) == ["[trainyard] the node's platform was shut down"]
