"""A request an agent obeyed stays spent for the next agent on the node: its signature is on disk before
the request is acted on, read back at the next start, forgotten once too old to be accepted anyway; and
nothing signed before an agent started is obeyed, which covers a folder that lost them."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.seen import FOLDER_NAME, MINUTE, SeenFolder, entry_line, remember_across_restarts
from libs.controlsign import MAX_SKEW_SECONDS, ControlSigner, ControlVerifier

SECRET = "seen-requests-tests-secret-" * 2
NOW = 1_800_000_000.0
SUBJECT = "trainyard.agent.node-a.start"
BODY = b'{"type": "StartProcess.v1"}'
LAUNCHER = ControlSigner.of(SECRET, "launcher")


def started_agent(root: Path, now: float) -> ControlVerifier:
    """The verifier of an agent started at `now` with the agent folder `root`."""
    control = ControlVerifier.of_secret(SECRET)
    remember_across_restarts(control, root, now)
    return control


def test_a_request_obeyed_is_refused_by_the_next_agent_even_if_the_first_was_killed(tmp_path: Path) -> None:
    headers = LAUNCHER.headers(SUBJECT, BODY, NOW)
    assert started_agent(tmp_path, NOW - 5).refusal("launcher", SUBJECT, BODY, headers, NOW) is None
    # Nothing is closed or flushed: the first agent was killed right after it accepted the request.

    refusal = started_agent(tmp_path, NOW + 1).refusal("launcher", SUBJECT, BODY, headers, NOW + 2)

    assert refusal == "the request was already received once: a replay is refused"


def test_without_what_the_agent_before_wrote_down_nothing_signed_before_the_start_is_obeyed(tmp_path: Path) -> None:
    # A new disk, or a signer whose clock is ahead: the start of the agent is the bound, to the millisecond.
    control = started_agent(tmp_path, NOW)

    before = control.refusal("launcher", SUBJECT, BODY, LAUNCHER.headers(SUBJECT, BODY, NOW - 0.001), NOW + 1)
    assert before is not None and "signed before this agent started" in before
    assert control.refusal("launcher", SUBJECT, BODY, LAUNCHER.headers(SUBJECT, BODY, NOW), NOW + 1) is None


def test_agents_on_one_host_each_write_in_their_own_folder(tmp_path: Path) -> None:
    node_a, node_b = started_agent(tmp_path / "node-a", NOW - 5), started_agent(tmp_path / "node-b", NOW - 5)

    assert node_a.refusal("launcher", SUBJECT, BODY, LAUNCHER.headers(SUBJECT, BODY, NOW), NOW) is None

    assert len(SeenFolder(tmp_path / "node-a" / FOLDER_NAME).load(NOW)) == 1
    assert SeenFolder(tmp_path / "node-b" / FOLDER_NAME).load(NOW) == {}
    assert node_b._seen == {}


def test_what_is_too_old_to_be_accepted_is_not_read_back_and_its_files_go(tmp_path: Path) -> None:
    control = started_agent(tmp_path, NOW)
    for second in range(0, 600, 10):
        body = str(second).encode()
        assert control.refusal("launcher", SUBJECT, body, LAUNCHER.headers(SUBJECT, body, NOW + second),
                               NOW + second) is None
    folder = tmp_path / FOLDER_NAME
    # Each file holds a minute's worth: those of minutes over were removed meanwhile.
    assert len(list(folder.iterdir())) <= MAX_SKEW_SECONDS / MINUTE + 2

    later = NOW + 590
    seen = SeenFolder(folder).load(later)

    assert seen and all(until >= later for until in seen.values())
    assert len(seen) <= MAX_SKEW_SECONDS / 10 + 1
    assert SeenFolder(folder).load(later + 10 * MAX_SKEW_SECONDS) == {}
    assert list(folder.iterdir()) == []


def test_a_damaged_file_loses_only_its_damaged_lines(tmp_path: Path) -> None:
    folder = tmp_path / FOLDER_NAME
    good, other = bytes(range(64)), bytes(range(1, 65))
    SeenFolder(folder).load(NOW)
    until = NOW + 60
    path = folder / f"{int(until // MINUTE)}.seen"
    path.write_bytes(b"\xff\xfe garbage\n" + entry_line(good, until) + b"nan " + b"ab" * 64 + b"\n"
                     + f"{until} abcd\n".encode() + b"not a line at all\n\n"
                     + entry_line(other, until)[:-20])  # a line cut short by a power loss
    (folder / "notes.txt").write_text("not the agent's")

    seen = SeenFolder(folder)
    assert seen.load(NOW) == {good: until}

    third = bytes(range(2, 66))
    seen.remember(third, until, NOW)  # after the cut line, on a line of its own
    assert SeenFolder(folder).load(NOW) == {good: until, third: until}
    assert (folder / "notes.txt").exists()


def test_a_request_that_cannot_be_written_down_is_refused_and_not_obeyed() -> None:
    class Disk:
        def __init__(self) -> None:
            self.full, self.written = True, list[bytes]()

        def remember(self, signature: bytes, until: float, now: float) -> None:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written.append(signature)

    control, disk = ControlVerifier.of_secret(SECRET), Disk()
    control.restore(disk, {}, NOW - 5)
    headers = LAUNCHER.headers(SUBJECT, BODY, NOW)

    refusal = control.refusal("launcher", SUBJECT, BODY, headers, NOW)

    assert refusal is not None and "No space left on device" in refusal and "free space" in refusal
    disk.full = False  # space freed: the request is obeyed when it comes (the sender's next try is signed anew)
    assert control.refusal("launcher", SUBJECT, BODY, headers, NOW) is None
    assert len(disk.written) == 1


def test_an_agent_that_cannot_read_its_folder_stops_saying_what_to_do(tmp_path: Path) -> None:
    (tmp_path / FOLDER_NAME).write_text("a file where the folder should be")

    with pytest.raises(SystemExit, match="or remove it"):
        remember_across_restarts(ControlVerifier.of_secret(SECRET), tmp_path, NOW)
