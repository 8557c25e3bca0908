"""CRC32C of an object, one checksum per 64 KiB chunk, so a read checks only what it touches."""

from __future__ import annotations

import array

import crc32c

CHUNK = 64 << 10
"""Bytes covered by one checksum (the last chunk of an object may be shorter)."""


def chunk_crcs(data: memoryview) -> bytes:
    """The CRC32C of every chunk of ``data``, as little-endian uint32s (the index's encoding).

    Releases the GIL on large chunks (the package's default mode), so the writer thread does
    not stall the server's other threads.
    """
    crcs = array.array(
        "I", (crc32c.crc32c(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK))
    )
    return crcs.tobytes()


def bad_chunk(data: memoryview, first: int, crcs: memoryview) -> int | None:
    """Check ``data`` (whole chunks from chunk ``first`` on; the object's last one may be short)
    against the object's ``crcs`` (uint32s); returns the first mismatching chunk, or None."""
    for n, i in enumerate(range(0, len(data), CHUNK), start=first):
        if crc32c.crc32c(data[i : i + CHUNK]) != crcs[n]:
            return n
    return None
