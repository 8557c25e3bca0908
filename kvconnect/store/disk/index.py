"""The index: an append-only log of checksummed records beside the data file.

File layout: a 16-byte header (magic, version, chunk size), then records, each
``crc32c u32 | kind u8 | pad u8 | key length u16 | offset u64 | size u64`` (little-endian,
24 bytes), then for a PUT the key (UTF-8) and one CRC32C per 64 KiB chunk of the object. The
record's CRC covers everything after it. A DEL carries only its offset.

Replay reads records in log order and stops at the first one that is torn (past the end of the
file) or does not verify; the tail from there is truncated. Only the writer thread of a tier
appends; compaction rewrites the live records into a new file and renames it over the log.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import crc32c

from kvconnect.store.disk.checksum import CHUNK, chunk_count
from kvconnect.store.disk.files import BLOCK

log = logging.getLogger(__name__)

MAGIC = b"KVCDISK\x00"
VERSION = 1
_FILE_HEAD = struct.Struct("<8sII")
_HEAD = struct.Struct("<IBxHQQ")


class Kind(enum.IntEnum):
    """What a record says."""

    PUT = 1  # an object is durable at offset
    DEL = 2  # the object at offset is gone


class Record(NamedTuple):
    """One object on disk: key, place and the CRC32C of each chunk (uint32, little-endian)."""

    key: str
    offset: int
    size: int
    crcs: bytes


def encode_put(record: Record) -> bytes:
    """The log record saying ``record`` is durable."""
    key = record.key.encode()
    body = _HEAD.pack(0, Kind.PUT, len(key), record.offset, record.size) + key + record.crcs
    return _seal(body)


def encode_del(offset: int) -> bytes:
    """The log record forgetting the object at ``offset``."""
    return _seal(_HEAD.pack(0, Kind.DEL, 0, offset, 0))


def put_length(record: Record) -> int:
    """Bytes :func:`encode_put` produces for ``record`` (without encoding it)."""
    return _HEAD.size + len(record.key.encode()) + len(record.crcs)


def _seal(body: bytes) -> bytes:
    return struct.pack("<I", crc32c.crc32c(memoryview(body)[4:])) + body[4:]


class Replay(NamedTuple):
    """What a log holds: the live objects in offset order, and how much of the log is good."""

    records: list[Record]
    valid: int  # bytes of the log up to the first bad record
    entries: int  # records in that prefix
    dropped: int  # durable PUTs not recovered: out of bounds, or overlapped by a later one


def replay(data: bytes, usable: int) -> Replay:
    """Decode a whole log; objects must lie in [0, usable) on BLOCK boundaries.

    Overlapping objects (and two objects of one key): the later record wins.
    """
    view = memoryview(data)
    live: dict[int, tuple[int, Record]] = {}
    pos, seq = _FILE_HEAD.size, 0
    while pos + _HEAD.size <= len(data):
        crc, kind, key_len, offset, size = _HEAD.unpack_from(data, pos)
        if kind == Kind.PUT:
            end = pos + _HEAD.size + key_len + 4 * chunk_count(size)
        elif kind == Kind.DEL and key_len == 0:
            end = pos + _HEAD.size
        else:
            break
        if end > len(data) or crc32c.crc32c(view[pos + 4 : end]) != crc:
            break
        if kind == Kind.PUT:
            key_at = pos + _HEAD.size
            key = str(data[key_at : key_at + key_len], "utf-8", "replace")
            live[offset] = (seq, Record(key, offset, size, data[key_at + key_len : end]))
        else:
            live.pop(offset, None)
        pos, seq = end, seq + 1
    records = _resolve(live, usable)
    return Replay(records, pos, seq, len(live) - len(records))


def _resolve(live: dict[int, tuple[int, Record]], usable: int) -> list[Record]:
    """Drop objects out of bounds, and of two that overlap or share a key the earlier."""
    kept: list[tuple[int, Record]] = []
    for seq, rec in sorted(live.values(), key=lambda item: item[1].offset):
        if rec.offset % BLOCK or rec.size <= 0 or rec.offset + rec.size > usable:
            continue
        while kept and kept[-1][1].offset + kept[-1][1].size > rec.offset:
            if kept[-1][0] > seq:
                break
            kept.pop()
        else:
            kept.append((seq, rec))
    latest: dict[str, tuple[int, Record]] = {}
    for seq, rec in kept:
        if rec.key not in latest or latest[rec.key][0] < seq:
            latest[rec.key] = (seq, rec)
    return sorted((rec for _, rec in latest.values()), key=lambda rec: rec.offset)


class IndexLog:
    """The open log of one tier. Not thread-safe: only the tier's writer thread writes."""

    def __init__(self, path: Path, fd: int, length: int, records: int) -> None:
        self.path = path
        self._fd = fd
        self.length = length
        """Bytes in the log."""
        self.records = records
        """Records in the log."""

    @classmethod
    def open(cls, path: Path, usable: int) -> tuple[IndexLog, Replay]:
        """Open (or create) the log at ``path``, replay it and truncate a bad tail.

        Raises OSError, or ValueError when the file is not a kvconnect index of this version.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            if not data:
                data = _FILE_HEAD.pack(MAGIC, VERSION, CHUNK)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                _sync_dir(path)
            if _FILE_HEAD.unpack_from(data.ljust(_FILE_HEAD.size)) != (MAGIC, VERSION, CHUNK):
                raise ValueError(f"{path}: not a kvconnect disk index (version {VERSION})")
            result = replay(data, usable)
            if result.valid < len(data):
                log.warning(
                    "%s: dropped %d bytes of torn or bad records at the tail",
                    path,
                    len(data) - result.valid,
                )
                os.ftruncate(fd, result.valid)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, result.valid, result.entries), result

    def append(self, records: list[bytes]) -> None:
        """Append encoded records (not durable until :meth:`sync`). Raises OSError."""
        blob = b"".join(records)
        written = os.pwrite(self._fd, blob, self.length)
        if written != len(blob):  # a short write is a full disk: the tail is torn, replay stops
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        self.length += written
        self.records += len(records)

    def sync(self) -> None:
        """Make every appended record durable (fdatasync). Raises OSError."""
        os.fdatasync(self._fd)

    def compact(self, live: Iterable[Record]) -> None:
        """Replace the log by the PUT records of ``live``: a new file, fsynced, renamed over the
        log, directory fsynced. On OSError the old log stays in use (and the tmp file may remain
        until the next compaction)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        records = [encode_put(rec) for rec in live]
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            blob = _FILE_HEAD.pack(MAGIC, VERSION, CHUNK) + b"".join(records)
            if os.write(fd, blob) != len(blob):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            os.fsync(fd)
            os.replace(tmp, self.path)
            _sync_dir(self.path)
        except BaseException:
            os.close(fd)
            raise
        os.close(self._fd)
        self._fd, self.length, self.records = fd, len(blob), len(records)

    def close(self) -> None:
        """Close the log. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _sync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
