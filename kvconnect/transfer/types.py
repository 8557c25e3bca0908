"""The transfer vocabulary: operations, statuses, requests and transport capabilities."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvconnect.transfer.memory import MemoryRegion


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
    """Which peers and regions a transport reaches, as data: routing reads nothing else.

    Every transport moves host and device memory alike (TCP stages device memory through the
    engine's pinned staging pool itself), so there is no device-memory capability to route on.
    """

    endpoint: str | None = None
    """The ``SegmentDescriptor.endpoints`` key a peer must publish to be reached (None: none)."""
    endpoint_label: str = ""
    """How a refusal names that endpoint, e.g. ``"TCP endpoint"``."""
    both_ends: bool = False
    """This engine must publish ``endpoint`` too (both ends need the hardware, as for RDMA)."""
    same_host_only: bool = False
    """Only reaches engines on this host."""
    same_process_only: bool = False
    """Only reaches engines in this process."""
    shared_regions_only: bool = False
    """Only reaches regions in shared memory (``RegionInfo.shareable``)."""
    memory_only: bool = False
    """Only reaches regions of memory: never FILE regions, whose bytes only their owner's
    engine can produce (it touches the peer's memory without the peer engine's help)."""
