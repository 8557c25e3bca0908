"""The data file: preallocated, locked, written and read in page-aligned blocks with O_DIRECT.

Where the file system refuses O_DIRECT (EINVAL at open), I/O is buffered and every range is
dropped from the page cache after use (``posix_fadvise(DONTNEED)``), so disk-resident objects
are not cached twice. Every call may raise OSError; the tier decides what an errno means.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

BLOCK = 4096
"""O_DIRECT alignment of offsets, lengths and buffers (the master's DISK_ALIGNMENT)."""


def round_up(n: int, to: int = BLOCK) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def aligned_buffer(size: int) -> mmap.mmap:
    """Anonymous page-aligned memory of ``size`` bytes rounded up to BLOCK (zero-filled)."""
    return mmap.mmap(-1, round_up(max(size, 1)))


class StagingPool:
    """Page-aligned staging buffers kept for reuse: a copy into fresh anonymous memory faults
    its pages in and runs at a fifth of the speed of one into warm memory. Thread-safe."""

    def __init__(self) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.kept = 0
        """Bytes of buffers kept for reuse."""

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes (rounded up to BLOCK), zero past ``size``."""
        length = round_up(max(size, 1))
        with self._lock:
            stack = self._free.get(length)
            buffer = stack.pop() if stack else None
            if buffer is not None:
                self.kept -= length
        if buffer is None:
            return aligned_buffer(size)
        if length > size:
            buffer[size:length] = bytes(length - size)
        return buffer

    def give(self, buffer: mmap.mmap, room: int) -> None:
        """Keep ``buffer`` for reuse if the pool then holds at most ``room`` bytes; else let
        it go."""
        with self._lock:
            if self.kept + len(buffer) <= room:
                self._free.setdefault(len(buffer), []).append(buffer)
                self.kept += len(buffer)


class DataFile:
    """One open, exclusively locked data file of at least ``size`` bytes.

    Thread-safe: pread/pwrite at explicit offsets, no shared file position. Buffers passed to
    :meth:`write` and :meth:`read_into` must be page-aligned (from :func:`aligned_buffer`) and
    their lengths, like offsets, multiples of BLOCK.
    """

    def __init__(self, path: Path, size: int) -> None:
        """Open or create ``path``, lock it and make sure ``size`` bytes are allocated.

        Raises OSError (BlockingIOError: another process holds the lock; ENOSPC: no room).
        """
        self.path = path
        self.direct = True
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("%s: O_DIRECT refused, using buffered I/O with DONTNEED", path)
            self.direct = False
            self._fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(self._fd).st_size < size:
                os.posix_fallocate(self._fd, 0, size)
                os.fsync(self._fd)
            self.length = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def fd(self) -> int:
        """The descriptor (for fstat by the watchdog)."""
        return self._fd

    def write(self, offset: int, buffers: list[mmap.mmap]) -> None:
        """Write ``buffers`` back to back from ``offset``, in one call where the kernel takes
        them all (a short write that makes no progress raises ENOSPC)."""
        views = [memoryview(buffer) for buffer in buffers]
        while views:
            n = os.pwritev(self._fd, views, offset)
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            offset += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]

    def read_into(self, offset: int, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes at ``offset``; returns how many (short at end of file)."""
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        if not self.direct:
            os.posix_fadvise(self._fd, offset, done, os.POSIX_FADV_DONTNEED)
        return done

    def sync(self) -> None:
        """Make every completed write durable (fdatasync). Buffered: the pages are dropped now,
        as DONTNEED cannot drop dirty pages at write time."""
        os.fdatasync(self._fd)
        if not self.direct:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the descriptor (releases the lock). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
