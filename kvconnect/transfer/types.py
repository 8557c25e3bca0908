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
    """What a transport can do, as data (not ``supports_x()`` methods)."""

    device_memory: bool
    """Reads and writes device (CUDA) memory directly; otherwise the engine stages via host."""
    same_host_only: bool
    """Only reaches engines on this host."""
    same_process_only: bool
    """Only reaches engines in this process."""
