"""A node's output read line by line: no line, however long, stops the reader or outgrows a log chunk."""

from __future__ import annotations

import asyncio

import pytest

from agent.ranks.process import output_lines


async def lines_of(*pieces: bytes, max_bytes: int = 8) -> list[bytes]:
    stream = asyncio.StreamReader()
    for piece in pieces:
        stream.feed_data(piece)
    stream.feed_eof()
    return [line async for line in output_lines(stream, max_bytes)]


@pytest.mark.asyncio
async def test_lines_come_without_their_newline_across_reads() -> None:
    assert await lines_of(b"epoch 1\nep", b"och 2\n", b"\nlast") == [b"epoch 1", b"epoch 2", b"", b"last"]


@pytest.mark.asyncio
async def test_a_line_longer_than_the_limit_comes_in_pieces() -> None:
    assert await lines_of(b"12345678\n" + b"a" * 20 + b"\nok\n") == [
        b"12345678", b"aaaaaaaa", b"aaaaaaaa", b"aaaa", b"ok"]


@pytest.mark.asyncio
async def test_a_megabyte_without_a_newline_is_read_whole() -> None:
    lines = await lines_of(b"x" * 1_000_000, max_bytes=16 * 1024)
    assert b"".join(lines) == b"x" * 1_000_000
    assert max(map(len, lines)) == 16 * 1024
