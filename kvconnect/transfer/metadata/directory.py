"""The engine's cache of peer descriptors in front of a metadata backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from kvconnect.transfer.metadata import MetadataBackend
from kvconnect.transfer.segment import SegmentDescriptor


class SegmentDirectory:
    """The engine's cache of peer descriptors; concurrent lookups of one name share one call.

    ``on_replaced(old)`` runs (on the looking-up thread, outside the lock) when a lookup finds
    a segment served by another engine than the descriptor last known for that name (``old``):
    the peer restarted, so what transports hold for ``old.engine_id`` is stale.
    """

    def __init__(
        self,
        backend: MetadataBackend,
        timeout: float,
        on_replaced: Callable[[SegmentDescriptor], None],
    ) -> None:
        self._backend = backend
        self._timeout = timeout
        self._on_replaced = on_replaced
        self._lock = threading.Lock()
        self._cache: dict[str, SegmentDescriptor] = {}
        self._known: dict[str, SegmentDescriptor] = {}  # last looked-up, kept across forget()
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
            previous = self._known.get(name)
            self._known[name] = descriptor
        if previous is not None and previous.engine_id != descriptor.engine_id:
            self._on_replaced(previous)
        future.set_result(descriptor)
        return descriptor

    def forget(self, name: str) -> None:
        """Drop the cached descriptor of ``name`` (it changed, vanished or stopped answering):
        the next :meth:`resolve` looks it up again."""
        with self._lock:
            self._cache.pop(name, None)

    def drop(self, name: str) -> SegmentDescriptor | None:
        """Forget everything about ``name`` (its peer is gone for good): the cached and the
        last known descriptor. Returns the last known one (None if there was none)."""
        with self._lock:
            cached = self._cache.pop(name, None)
            known = self._known.pop(name, None)
        return known or cached
