"""The one Protocol every transport implements, and what a transport module contributes.

A transport receives *slices* (pieces of requests, at most ``slice_bytes`` each) for one peer and
completes each through its batch (``Slice.done``, or the ``*_slices`` helpers of
:mod:`kvconnect.transfer.batch`). It never blocks the submitting thread: work runs on the
transport's own threads. Transports never import each other.

Each transport module defines one :class:`TransportEntry` (``ENTRY``): its name and a factory
the engine calls at start with a :class:`TransportContext`. :mod:`.registry` lists the entries in
order of preference; routing chooses among the built transports by their :class:`Capabilities`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvconnect.transfer.batch import Slice
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.datapath.iov import DataPath
from kvconnect.transfer.datapath.staging import StagingPool
from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.stats import TransportStats
from kvconnect.transfer.types import Capabilities, TransferOp


class Transport(Protocol):
    """One way of moving bytes to a peer."""

    name: str
    capabilities: Capabilities

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        """Start moving ``slices`` to/from ``peer``; returns at once. Each slice completes once."""

    def forget(self, engine_id: str) -> None:
        """Drop connections and mappings of a peer engine (it restarted or was withdrawn).

        Called by the engine when the metadata says the segment now belongs to another engine.
        Work still queued for that engine fails; later submits start afresh.
        """

    def stats(self) -> TransportStats:
        """Counters since start."""

    def close(self) -> None:
        """Fail queued work with ClosedError, stop threads, release resources. Idempotent."""


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What the engine hands every transport factory at start (all owned by the engine)."""

    config: TransferConfig
    registry: MemoryRegistry
    """This engine's registered memory."""
    engine_id: str
    datapath: DataPath
    """Socket and memcpy primitives (native or pure Python)."""
    copier: Copier
    """Copies slices between local regions and mapped or device memory."""
    workers: CopyWorkers
    """The engine's copy threads, shared by the memcpy transports."""
    staging: Callable[[], StagingPool]
    """The pinned host buffers for device memory a socket cannot reach (created on first use)."""
    on_lost: Callable[[SegmentDescriptor], None]
    """Report that a peer went away, so the engine looks its segment up afresh."""
    built: Mapping[str, Transport]
    """The transports built so far: every less-preferred one (RDMA falls back to TCP)."""


@dataclass(frozen=True, slots=True)
class TransportEntry:
    """One transport as the registry knows it."""

    name: str
    """The name ``TransferConfig.transport`` forces it by and stats report it under."""
    build: Callable[[TransportContext], Transport | None]
    """Builds and starts the transport; None when it cannot run here and is not forced
    (raises ConfigError when it is forced and cannot run)."""
