"""CRC32C of an object, one checksum per 64 KiB chunk, so a read checks only what it touches."""

from __future__ import annotations

import array

import crc32c

CHUNK = 64 << 10
"""Bytes covered by one checksum (the last chunk of an object may be shorter)."""


def chunk_crcs(data: memoryview) -> bytes:
    """The CRC32C of every chunk of ``data``, as little-endian uint32s (the index's encoding).

    Keeps the GIL: a chunk takes microseconds, and a thread that lets the GIL go 16 times per
    MiB waits for it again behind every busy thread of the server.
    """
    crcs = array.array(
        "I",
        (
            crc32c.crc32c(data[i : i + CHUNK], gil_release_mode=0)
            for i in range(0, len(data), CHUNK)
        ),
    )
    return crcs.tobytes()


def bad_chunk(data: memoryview, first: int, crcs: memoryview) -> int | None:
    """Check ``data`` (whole chunks from chunk ``first`` on; the object's last one may be short)
    against the object's ``crcs`` (uint32s); returns the first mismatching chunk, or None."""
    for n, i in enumerate(range(0, len(data), CHUNK), start=first):
        if crc32c.crc32c(data[i : i + CHUNK], gil_release_mode=0) != crcs[n]:
            return n
    return None
