"""Transfer vocabulary and the one Protocol every transport implements.

A transport receives *slices* (pieces of requests, at most ``slice_bytes`` each) for one peer and
completes each through its batch (``Slice.done``). It never blocks the submitting thread: work
runs on the transport's own threads. Transports never import each other.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvconnect.transfer.memory import MemoryRegion

if TYPE_CHECKING:
    from kvconnect.transfer.batch import Slice
    from kvconnect.transfer.segment import SegmentDescriptor
    from kvconnect.transfer.stats import TransportStats


class TransferOp(enum.Enum):
    """READ copies remote bytes into local memory; WRITE copies local bytes to the remote."""

    READ = "read"
    WRITE = "write"


class TransferStatus(enum.Enum):
    """Per-request outcome."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELED = "canceled"


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Move ``length`` bytes between ``local`` at ``local_offset`` and a remote region.

    ``segment`` names the remote engine's segment, ``remote_region`` one of its region ids.
    """

    local: MemoryRegion
    local_offset: int
    segment: str
    remote_region: int
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do, as data (not ``supports_x()`` methods)."""

    device_memory: bool
    """Reads and writes device (CUDA) memory directly; otherwise the engine stages via host."""
    same_host_only: bool
    """Only reaches engines on this host."""
    same_process_only: bool
    """Only reaches engines in this process."""


class Transport(Protocol):
    """One way of moving bytes to a peer."""

    name: str
    capabilities: Capabilities

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        """Start moving ``slices`` to/from ``peer``; returns at once. Each slice completes once."""

    def forget(self, engine_id: str) -> None:
        """Drop connections and mappings of a peer engine (it restarted or was withdrawn)."""

    def stats(self) -> TransportStats:
        """Counters since start."""

    def close(self) -> None:
        """Fail queued work with ClosedError, stop threads, release resources. Idempotent."""
