"""Host windows onto registered memory, staging device memory for transports that need host bytes.

A socket can only send from and receive into host memory. :func:`open_window` gives a host view
of ``(region, offset, length)``: the region's own bytes for host memory (zero copy), or a pinned
staging buffer for device memory, filled by ``load()`` before sending and written back to the
device by ``store()`` after receiving.
"""

from __future__ import annotations

import threading

from kvconnect.transfer.cuda import DeviceCopier
from kvconnect.transfer.memory import MemoryKind, MemoryRegion, host_address


class StagingPool:
    """Reusable pinned host buffers of ``chunk`` bytes (larger requests get their own)."""

    def __init__(self, copier: DeviceCopier, chunk: int, keep: int = 8) -> None:
        self.copier = copier
        self._chunk = chunk
        self._keep = keep
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A staging buffer of at least ``nbytes``."""
        if nbytes <= self._chunk:
            with self._lock:
                if self._free:
                    return self._free.pop()
            return self.copier.alloc_pinned(self._chunk)
        return self.copier.alloc_pinned(nbytes)

    def give(self, buffer: memoryview) -> None:
        """Return a buffer from :meth:`take`."""
        if buffer.nbytes == self._chunk:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buffer)


class HostWindow:
    """Host bytes standing for ``length`` bytes of ``region`` at ``offset``."""

    __slots__ = ("_buffer", "_device_address", "_pool", "view")

    def __init__(
        self, region: MemoryRegion, offset: int, length: int, pool: StagingPool | None
    ) -> None:
        if region.kind is MemoryKind.HOST:
            self.view = region.view[offset : offset + length]
            self._pool = None
            self._buffer: memoryview | None = None
            self._device_address = 0
            return
        if pool is None:
            raise RuntimeError("device memory without a staging pool")
        self._pool = pool
        self._buffer = pool.take(length)
        self.view = self._buffer[:length]
        self._device_address = region.address + offset

    def load(self) -> None:
        """Bring device bytes into the window (before they are sent)."""
        if self._pool is not None:
            self._pool.copier.copy(host_address(self.view), self._device_address, self.view.nbytes)

    def store(self) -> None:
        """Write received window bytes back to the device."""
        if self._pool is not None:
            self._pool.copier.copy(self._device_address, host_address(self.view), self.view.nbytes)

    def close(self) -> None:
        """Return the staging buffer, if any."""
        if self._pool is not None and self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None
