"""The engine's cache of peer descriptors in front of a metadata backend."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from kvconnect.transfer.metadata import MetadataBackend
from kvconnect.transfer.segment import SegmentDescriptor


class SegmentDirectory:
    """The engine's cache of peer descriptors; concurrent lookups of one name share one call."""

    def __init__(self, backend: MetadataBackend, timeout: float) -> None:
        self._backend = backend
        self._timeout = timeout
        self._lock = threading.Lock()
        self._cache: dict[str, SegmentDescriptor] = {}
        self._inflight: dict[str, Future[SegmentDescriptor]] = {}

    def cached(self, name: str) -> SegmentDescriptor | None:
        """The cached descriptor of ``name``, without I/O."""
        with self._lock:
            return self._cache.get(name)

    def resolve(self, name: str) -> SegmentDescriptor:
        """Cached or looked-up descriptor (blocking, bounded by the lookup timeout)."""
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None:
                return cached
            future = self._inflight.get(name)
            owner = future is None
            if future is None:
                future = self._inflight[name] = Future()
        if not owner:
            return future.result(timeout=self._timeout * 2)
        try:
            descriptor = self._backend.lookup(name, self._timeout)
        except BaseException as exc:
            with self._lock:
                del self._inflight[name]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[name]
            self._cache[name] = descriptor
        future.set_result(descriptor)
        return descriptor

    def forget(self, name: str) -> None:
        """Drop the cached descriptor of ``name``."""
        with self._lock:
            self._cache.pop(name, None)
