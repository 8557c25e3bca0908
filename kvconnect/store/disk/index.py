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
import gc
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import crc32c

from kvconnect.store.disk.checksum import CHUNK
from kvconnect.store.disk.files import BLOCK

log = logging.getLogger(__name__)

MAGIC = b"KVCDISK\x00"
VERSION = 1
_FILE_HEAD = struct.Struct("<8sII")
HEADER_BYTES = _FILE_HEAD.size  # magic, version, chunk size
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
    """About the bytes :func:`encode_put` produces for ``record``: the key is counted in
    characters, not UTF-8 bytes (what the compaction trigger needs, without encoding it)."""
    return _HEAD.size + len(record.key) + len(record.crcs)


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

    Overlapping objects (and two objects of one key): the later record wins. One tight loop
    with the collector paused (a million records are a million tuples): seconds per million.
    """
    view, end_of_data, head, unpack = memoryview(data), len(data), _HEAD.size, _HEAD.unpack_from
    crc_of, put, delete = crc32c.crc32c, Kind.PUT.value, Kind.DEL.value
    live: dict[int, Record] = {}  # in record order: a replaced offset moves to the end
    pos, entries = HEADER_BYTES, 0
    collecting = gc.isenabled()
    gc.disable()
    try:
        while pos + head <= end_of_data:
            crc, kind, key_len, offset, size = unpack(data, pos)
            if kind == put:
                end = pos + head + key_len + 4 * ((size + CHUNK - 1) // CHUNK)
            elif kind == delete and key_len == 0:
                end = pos + head
            else:
                break
            if end > end_of_data or crc_of(view[pos + 4 : end]) != crc:
                break
            live.pop(offset, None)
            if kind == put:
                key_end = pos + head + key_len
                key = str(data[pos + head : key_end], "utf-8", "replace")
                live[offset] = Record(key, offset, size, data[key_end:end])
            pos, entries = end, entries + 1
        records = _resolve(live, usable)
    finally:
        if collecting:
            gc.enable()
    return Replay(records, pos, entries, len(live) - len(records))


def _resolve(live: dict[int, Record], usable: int) -> list[Record]:
    """The live objects in offset order, once out-of-bounds ones are dropped, and of two that
    overlap or share a key the earlier."""
    ordered = [live[offset] for offset in sorted(live)]
    end, keys = 0, set()
    for rec in ordered:  # the common case: nothing to resolve
        if rec.offset < end or rec.offset % BLOCK or rec.size <= 0 or rec.key in keys:
            break
        end = rec.offset + rec.size
        keys.add(rec.key)
    else:
        if end <= usable:
            return ordered
    return _resolve_conflicts(live, usable)


def _resolve_conflicts(live: dict[int, Record], usable: int) -> list[Record]:
    seq = {offset: n for n, offset in enumerate(live)}
    kept: list[Record] = []
    for rec in sorted(live.values(), key=lambda r: r.offset):
        if rec.offset % BLOCK or rec.size <= 0 or rec.offset + rec.size > usable:
            continue
        while kept and kept[-1].offset + kept[-1].size > rec.offset:
            if seq[kept[-1].offset] > seq[rec.offset]:
                break
            kept.pop()
        else:
            kept.append(rec)
    latest: dict[str, Record] = {}
    for rec in kept:
        if rec.key not in latest or seq[latest[rec.key].offset] < seq[rec.offset]:
            latest[rec.key] = rec
    return sorted(latest.values(), key=lambda r: r.offset)


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
