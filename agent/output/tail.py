"""A rank's output as it is shipped out of the node: the part of its `output.log` not shipped yet, taken a
chunk at a time, and the lines the agent itself adds to it.

The holder (agent/processes/holder.py) writes the command's output to `output.log` in the rank's folder.
`shipped.json` beside it holds the number of the next log chunk and the byte offset where it starts; while a
chunk is on its way, also where it ends. An agent that dies with a chunk on its way leaves that record, and
the next one ships exactly those bytes again under the same number: JetStream drops the repeat by its message
id when the first one had arrived (within the stream's duplicate window).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from agent.processes.holder import OUTPUT_NAME, write_atomically

CURSOR_NAME = "shipped.json"
# A longer output line is shipped in pieces of this size, so that no line holds up the others and a
# log chunk of them stays well within one NATS message.
MAX_LINE_BYTES = 16 * 1024
CHUNK_LINES = 200
CHUNK_BYTES = 128 * 1024  # a chunk's text, however escaped, stays one NATS message


def append_note(folder: Path, text: str) -> None:
    """A line of the agent's own in the rank's output (`[trainyard] …`), shipped with the rest."""
    with (folder / OUTPUT_NAME).open("ab") as output:
        output.write(f"[trainyard] {text}\n".encode())


class OutputTail:
    """The part of a rank's output.log not shipped yet, taken a chunk at a time, in order."""

    def __init__(self, folder: Path) -> None:
        self.output = folder / OUTPUT_NAME
        self.cursor = folder / CURSOR_NAME
        self.seq, self.offset, self.end = 0, 0, None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(self.cursor.read_text())
            self.seq, self.offset, self.end = int(record["seq"]), int(record["offset"]), record.get("end")

    def waiting(self) -> bool:
        """Whether anything waits to be shipped: a chunk on its way, or bytes past the offset."""
        try:
            return self.end is not None or self.output.stat().st_size > self.offset
        except OSError:
            return False

    def take(self, *, final: bool) -> tuple[int, list[str]] | None:
        """The next chunk (its number and lines), recorded as on its way; None when no whole line waits.

        `final`: the command ended, so a last line without its newline is taken as it is.
        """
        if self.end is not None:  # on its way when the agent before stopped: the same bytes again
            lines, _ = split_lines(self._read(self.end - self.offset), final=True)
            return self.seq, lines
        window = CHUNK_BYTES + CHUNK_LINES  # a chunk's bytes and newlines, or a line's pieces
        data = self._read(window)
        lines, used = split_lines(data, final=final and len(data) < window)  # a last line only at the end
        if not lines:
            return None
        self.end = self.offset + used
        self._save()
        return self.seq, lines

    def shipped(self) -> None:
        assert self.end is not None
        self.seq, self.offset, self.end = self.seq + 1, self.end, None
        self._save()

    def _read(self, size: int) -> bytes:
        try:
            with self.output.open("rb") as output:
                output.seek(self.offset)
                return output.read(size)
        except OSError:
            return b""

    def _save(self) -> None:
        write_atomically(self.cursor, json.dumps({"seq": self.seq, "offset": self.offset, "end": self.end}))


def split_lines(data: bytes, *, final: bool) -> tuple[list[str], int]:
    """Whole lines from the start of `data` that fit one chunk, and how many bytes they took.

    A line longer than MAX_LINE_BYTES comes in pieces of that size; a last line without its newline
    only when `final`.
    """
    lines: list[str] = []
    start = size = 0
    while start < len(data) and len(lines) < CHUNK_LINES:
        end = data.find(b"\n", start, start + MAX_LINE_BYTES + 1)
        if end != -1:
            piece, after = data[start:end], end + 1
        elif len(data) - start >= MAX_LINE_BYTES:
            piece, after = data[start:start + MAX_LINE_BYTES], start + MAX_LINE_BYTES
        elif final:
            piece, after = data[start:], len(data)
        else:
            break
        if lines and size + len(piece) > CHUNK_BYTES:
            break
        lines.append(piece.decode("utf-8", errors="replace"))
        size += len(piece)
        start = after
    return lines, start
