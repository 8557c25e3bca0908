"""Verified reads of one object: whole chunks into a pooled, page-aligned bounce buffer, checked,
then handed out window by window. Nothing is handed out before its chunks verified."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvconnect.store.disk.checksum import CHUNK, bad_chunk
from kvconnect.store.disk.files import DataFile, aligned_buffer, round_up
from kvconnect.store.disk.index import Record
from kvconnect.store.disk.watchdog import OpsInFlight

WINDOW = 4 << 20
"""Bytes read per pread (a multiple of CHUNK): the size of a bounce buffer."""
KEPT = 4
"""Bounce buffers a pool keeps between reads (more are made while more reads run at once)."""


class Fault(enum.Enum):
    """Why bytes could not be served."""

    MISMATCH = "checksum mismatch"
    SHORT = "short read"  # the file ends before the object: it was truncated
    ERROR = "read error"


class ReadFault(Exception):
    """A read of an object failed; ``errno`` is set for ``Fault.ERROR``."""

    def __init__(self, fault: Fault, detail: str, errno: int = 0) -> None:
        super().__init__(f"{fault.value}: {detail}")
        self.fault = fault
        self.errno = errno


class Bounces:
    """Page-aligned bounce buffers for reads on any thread, reused (thread-safe)."""

    def __init__(self) -> None:
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    @contextmanager
    def buffer(self) -> Iterator[memoryview]:
        """A WINDOW-sized buffer for the block; given back after it."""
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None:
            buffer = memoryview(aligned_buffer(WINDOW))
        try:
            yield buffer
        finally:
            with self._lock:
                if len(self._free) < KEPT:
                    self._free.append(buffer)


def verified(
    bounces: Bounces,
    data: DataFile,
    record: Record,
    start: int,
    length: int,
    ops: OpsInFlight,
    observe: Callable[[float, int], None],
) -> Iterator[tuple[int, memoryview]]:
    """Bytes [start, start+length) of ``record``'s object as ``(position from start, bytes)``
    windows in order, each valid until the next is asked for.

    Runs on the caller's thread (blocking preads); ``observe(seconds, bytes)`` is called per
    pread. Raises ReadFault; the caller decides what happens to the object.
    """
    with bounces.buffer() as bounce:
        yield from _windows(bounce, data, record, start, length, ops, observe)


def _windows(
    bounce: memoryview,
    data: DataFile,
    record: Record,
    start: int,
    length: int,
    ops: OpsInFlight,
    observe: Callable[[float, int], None],
) -> Iterator[tuple[int, memoryview]]:
    crcs = memoryview(record.crcs).cast("I")
    stop = min(record.size, round_up(start + length, CHUNK))
    pos = start - start % CHUNK
    while pos < stop:
        n = min(WINDOW, stop - pos)
        began = time.monotonic()
        try:
            with ops.track("read"):
                got = data.read_into(record.offset + pos, bounce[: round_up(n)])
        except OSError as e:
            raise ReadFault(
                Fault.ERROR, f"{e.strerror} at {record.offset + pos}", e.errno or 0
            ) from e
        observe(time.monotonic() - began, got)
        if got < n:
            raise ReadFault(Fault.SHORT, f"{got} of {n} bytes at {record.offset + pos}")
        window = bounce[:n]
        bad = bad_chunk(window, pos // CHUNK, crcs)
        if bad is not None:
            raise ReadFault(Fault.MISMATCH, f"chunk {bad} of {record.key!r} at {record.offset}")
        lo, hi = max(start, pos) - pos, min(start + length, pos + n) - pos
        yield max(start, pos) - start, window[lo:hi]
        pos += n
