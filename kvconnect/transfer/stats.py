"""Counters of transports and of the listener, as immutable snapshots."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Initiator-side counters of one transport."""

    bytes_read: int = 0
    bytes_written: int = 0
    ops: int = 0
    errors: int = 0
    retries: int = 0
    inline: int = 0
    """Frames whose response their submitting thread read itself (TCP: it came within
    ``poll_window``); the others were completed by the transport's own threads."""
    peers: int = 0
    """Peer engines the transport holds connections or mappings for now (a gauge)."""


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """Target-side counters: what peers asked of this engine. They move before the answer
    that completes them goes out, so a peer that saw an answer sees it counted."""

    connections: int = 0
    frames: int = 0
    bytes_served: int = 0
    bytes_received: int = 0
    refused: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0
    handshake_timeouts: int = 0
    """Connections closed because their handshake did not finish within connect_timeout."""
    handshakes_dropped: int = 0
    """Connections closed in their handshake to make room for a newer one (max_handshakes)."""
    unavailable: int = 0
    """READ frames answered UNAVAILABLE: a FILE region's source failed (SourceUnavailable)."""


LATENCY_BOUNDS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """A histogram: ``counts[i]`` observations at most ``bounds[i]`` seconds (the last count
    is everything slower), and their ``total`` seconds."""

    bounds: tuple[float, ...] = LATENCY_BOUNDS
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS) + 1)
    total: float = 0.0


class LatencyHistogram:
    """Thread-safe fixed-bucket histogram of durations."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Count one duration."""
        bucket = bisect.bisect_left(LATENCY_BOUNDS, seconds)
        with self._lock:
            self._counts[bucket] += 1
            self._total += seconds

    def snapshot(self) -> LatencySnapshot:
        """Current counts."""
        with self._lock:
            return LatencySnapshot(LATENCY_BOUNDS, tuple(self._counts), self._total)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Everything an engine counts, keyed by transport name."""

    transports: Mapping[str, TransportStats]
    listener: ListenerStats
    served_latency: LatencySnapshot = field(default_factory=LatencySnapshot)
    """Time the listener took per READ/WRITE frame (first header byte to last byte sent)."""


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
