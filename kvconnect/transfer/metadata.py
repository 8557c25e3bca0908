"""Where segment descriptors live: the MetadataBackend interface, its backends, the peer cache.

Backends:

- :class:`P2PMetadata` (default): a segment's name is its listener's ``host:port``; lookups ask
  that listener directly. No service to run; ``publish`` has nothing to do.
- :class:`EmbeddedMetadata`: an in-process :class:`SegmentRegistry`, for all-in-one deployments
  and tests.

A backend that can push changes (etcd, with watches) calls the ``on_change`` callback given to
``start`` with a segment name whenever that segment's descriptor changed or vanished; the engine
then drops its cached copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from kvconnect.errors import ConfigError, ProtocolError, SegmentNotFound
from kvconnect.transfer import wire
from kvconnect.transfer.segment import SegmentDescriptor, decode_descriptor


class MetadataBackend(Protocol):
    """Publishes this engine's descriptor and finds peers' descriptors by segment name."""

    def start(self, on_change: Callable[[str], None]) -> None:
        """Begin; ``on_change(name)`` reports a peer descriptor that changed or vanished."""

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Make (a new version of) our descriptor visible to peers."""

    def withdraw(self, name: str) -> None:
        """Remove our descriptor; peers stop finding the segment."""

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        """The current descriptor of segment ``name``; SegmentNotFound if there is none.

        Blocks for at most ``timeout`` seconds. Raises PeerUnreachable for an unreachable peer.
        """

    def close(self) -> None:
        """Release connections and threads. Idempotent."""


class P2PMetadata:
    """Ask the peer's own listener (segment name = ``host:port``)."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def start(self, on_change: Callable[[str], None]) -> None:
        """Nothing to watch: peers are asked on demand."""

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Our listener serves the live descriptor itself."""

    def withdraw(self, name: str) -> None:
        """Closing the listener withdraws the segment."""

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        deadline = wire.deadline_after(timeout)  # bounds the connect, handshake and call
        sock, _engine_id = wire.open_connection(name, self._token, timeout)
        try:
            reply, _fds = wire.control_call(sock, wire.GetSegment(), deadline)
        finally:
            sock.close()
        if not isinstance(reply, wire.SegmentReply):
            raise ProtocolError(f"segment {name}: unexpected reply {reply!r}")
        return decode_descriptor(reply.descriptor)

    def close(self) -> None:
        """No resources are held between lookups."""


class SegmentRegistry:
    """In-process name → descriptor table shared by the engines of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[str, SegmentDescriptor] = {}
        self._listeners: list[Callable[[str], None]] = []

    def put(self, descriptor: SegmentDescriptor) -> None:
        """Insert or replace; refuses a name held by another live engine."""
        with self._lock:
            current = self._segments.get(descriptor.name)
            if current is not None and current.engine_id != descriptor.engine_id:
                raise ConfigError(
                    f"segment name {descriptor.name!r} is already used by another engine"
                )
            self._segments[descriptor.name] = descriptor
            listeners = list(self._listeners)
        for listener in listeners:
            listener(descriptor.name)

    def remove(self, name: str, engine_id: str) -> None:
        """Remove ``name`` if it still belongs to ``engine_id``."""
        with self._lock:
            current = self._segments.get(name)
            if current is None or current.engine_id != engine_id:
                return
            del self._segments[name]
            listeners = list(self._listeners)
        for listener in listeners:
            listener(name)

    def get(self, name: str) -> SegmentDescriptor:
        """The descriptor of ``name``; SegmentNotFound otherwise."""
        with self._lock:
            descriptor = self._segments.get(name)
        if descriptor is None:
            raise SegmentNotFound(f"no segment named {name!r} in the embedded registry")
        return descriptor

    def subscribe(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(name)`` on every change; returns the unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe


DEFAULT_REGISTRY = SegmentRegistry()
"""The registry embedded engines share unless given their own."""


class EmbeddedMetadata:
    """Descriptors in an in-process :class:`SegmentRegistry`."""

    def __init__(self, registry: SegmentRegistry | None = None) -> None:
        self._registry = DEFAULT_REGISTRY if registry is None else registry
        self._unsubscribe: Callable[[], None] | None = None
        self._engine_id: str | None = None

    def start(self, on_change: Callable[[str], None]) -> None:
        self._unsubscribe = self._registry.subscribe(on_change)

    def publish(self, descriptor: SegmentDescriptor) -> None:
        self._engine_id = descriptor.engine_id
        self._registry.put(descriptor)

    def withdraw(self, name: str) -> None:
        if self._engine_id is not None:
            self._registry.remove(name, self._engine_id)

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        return self._registry.get(name)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


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
