"""metadata="embedded": descriptors in an in-process registry (all-in-one deployments, tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvconnect.errors import ConfigError, SegmentNotFound
from kvconnect.transfer.segment import SegmentDescriptor


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
