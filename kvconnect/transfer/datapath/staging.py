"""Host views of registered memory for sockets, staging device memory through pinned buffers.

A socket can only send from and receive into host memory. :func:`host_views` turns
``(region, offset, length)`` entries into host views: the region's own bytes for host memory
(zero copy); for device memory a pinned staging buffer (a :class:`StagedWindow`) that
``load()`` fills from the device before sending and ``store()`` writes back after receiving;
for a FILE region a host buffer (a :class:`SourceWindow`) that ``load()`` fills from its source.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from kvconnect.errors import AccessDenied
from kvconnect.transfer.datapath.cuda import DeviceCopier
from kvconnect.transfer.memory import MemoryKind, MemoryRegion, host_address
from kvconnect.transfer.source import FileSource, read_source


class Window(Protocol):
    """A host buffer standing for bytes a socket cannot reach directly."""

    view: memoryview

    def load(self) -> None:
        """Bring the bytes into ``view`` (before they are sent)."""

    def store(self) -> None:
        """Write received ``view`` bytes back where they belong."""

    def close(self) -> None:
        """Give the buffer back."""


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


class StagedWindow:
    """A pinned host buffer standing for ``length`` bytes of device memory at ``address``."""

    __slots__ = ("_buffer", "_device_address", "_pool", "view")

    def __init__(self, address: int, length: int, pool: StagingPool) -> None:
        self._pool = pool
        self._buffer: memoryview | None = pool.take(length)
        self.view = self._buffer[:length]
        self._device_address = address

    def load(self) -> None:
        """Bring device bytes into the window (before they are sent)."""
        self._pool.copier.copy(host_address(self.view), self._device_address, self.view.nbytes)

    def store(self) -> None:
        """Write received window bytes back to the device."""
        self._pool.copier.copy(self._device_address, host_address(self.view), self.view.nbytes)

    def close(self) -> None:
        """Return the staging buffer."""
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None


class SourceWindow:
    """A host buffer standing for ``length`` bytes of a FILE region at ``offset``."""

    __slots__ = ("_offset", "_source", "view")

    def __init__(self, source: FileSource, offset: int, length: int) -> None:
        self._source = source
        self._offset = offset
        self.view = np.empty(length, dtype=np.uint8).data  # filled by load()

    def load(self) -> None:
        """Read the bytes from the source; raises SourceUnavailable."""
        read_source(self._source, self._offset, self.view)

    def store(self) -> None:
        """FILE regions are read-only: the registry refuses writes before any window exists."""
        raise AccessDenied("a FILE region cannot be written")

    def close(self) -> None:
        """The buffer is freed with the window."""


def host_views(
    entries: Iterable[tuple[MemoryRegion, int, int]], pool: Callable[[], StagingPool]
) -> tuple[list[memoryview], list[Window]]:
    """Host views of ``(region, offset, length)`` entries, and the windows among them.

    The caller loads/stores and closes the windows; host entries cost one slice each.
    """
    views: list[memoryview] = []
    staged: list[Window] = []
    for region, offset, length in entries:
        window: Window
        if region.kind is MemoryKind.HOST:
            views.append(region.view[offset : offset + length])
            continue
        if region.kind is MemoryKind.FILE:
            window = SourceWindow(region.source, offset, length)
        else:
            window = StagedWindow(region.address + offset, length, pool())
        views.append(window.view)
        staged.append(window)
    return views, staged


def close_all(windows: Iterable[Window]) -> None:
    """Return every window's staging buffer."""
    for window in windows:
        window.close()
