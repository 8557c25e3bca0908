"""Counters of transports and of the listener, as immutable snapshots."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Generic, TypeVar


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Initiator-side counters of one transport."""

    bytes_read: int = 0
    bytes_written: int = 0
    ops: int = 0
    errors: int = 0
    retries: int = 0


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """Target-side counters: what peers asked of this engine."""

    connections: int = 0
    frames: int = 0
    bytes_served: int = 0
    bytes_received: int = 0
    refused: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Everything an engine counts, keyed by transport name."""

    transports: Mapping[str, TransportStats]
    listener: ListenerStats


_S = TypeVar("_S", TransportStats, ListenerStats)


class Counters(Generic[_S]):
    """Thread-safe counters producing snapshots of type ``kind``."""

    def __init__(self, kind: type[_S]) -> None:
        self._kind: type[_S] = kind
        self._values = {f.name: 0 for f in fields(kind)}
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add to named counters (unknown names raise KeyError)."""
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> _S:
        """Current values."""
        with self._lock:
            return self._kind(**self._values)
