"""What a disk tier counts: :class:`DiskStats` snapshots of thread-safe :class:`Meters`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvconnect.transfer.stats import LatencyHistogram, LatencySnapshot


@dataclass(frozen=True, slots=True)
class DiskStats:
    """One disk tier, now. Bytes and operations count data-file I/O only (not the index)."""

    capacity: int = 0
    used: int = 0
    """Bytes of the objects held (durable)."""
    objects: int = 0
    bytes_written: int = 0
    writes: int = 0
    bytes_read: int = 0
    reads: int = 0
    demotions: int = 0
    """Moves into the tier made durable."""
    demotions_failed: int = 0
    loads: int = 0
    """Promotions read (verified) into DRAM."""
    loads_failed: int = 0
    checksum_failures: int = 0
    read_errors: int = 0
    """Reads that failed with an error or came back short."""
    lost: int = 0
    """Objects dropped because their bytes could not be served."""
    queue_bytes: int = 0
    """Staging memory of demotions not yet durable."""
    up: bool = False
    direct: bool = False
    """O_DIRECT I/O (False: buffered, pages dropped after use: the file system refused it)."""
    index_records: int = 0
    index_bytes: int = 0
    compactions: int = 0
    recovery_seconds: float = 0.0
    recovered: int = 0
    """Objects found at open."""
    recovery_dropped: int = 0
    """Durable records not recovered at open: out of bounds, or overlapped by a later one."""
    read_latency: LatencySnapshot = field(default_factory=LatencySnapshot)
    """Per pread of the data file."""
    write_latency: LatencySnapshot = field(default_factory=LatencySnapshot)
    """Per pwrite of the data file (an object; fdatasync not included)."""


_COUNTERS = (
    "bytes_written",
    "writes",
    "bytes_read",
    "reads",
    "demotions",
    "demotions_failed",
    "loads",
    "loads_failed",
    "checksum_failures",
    "read_errors",
    "lost",
    "compactions",
)


class Meters:
    """The counters and histograms behind :class:`DiskStats` (any thread)."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._recovery: tuple[float, int, int] = (0.0, 0, 0)
        self._reads = LatencyHistogram()
        self._writes = LatencyHistogram()
        self._lock = threading.Lock()

    def count(self, **deltas: int) -> None:
        """Add to named counters (unknown names raise KeyError)."""
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def read(self, seconds: float, nbytes: int) -> None:
        """One pread of ``nbytes`` that took ``seconds``."""
        self._reads.observe(seconds)
        self.count(reads=1, bytes_read=nbytes)

    def wrote(self, seconds: float, nbytes: int) -> None:
        """One pwrite of ``nbytes`` that took ``seconds``."""
        self._writes.observe(seconds)
        self.count(writes=1, bytes_written=nbytes)

    def recovered(self, seconds: float, objects: int, dropped: int) -> None:
        """What open() found."""
        self._recovery = (seconds, objects, dropped)

    def snapshot(
        self,
        *,
        capacity: int,
        used: int,
        objects: int,
        queue_bytes: int,
        up: bool,
        direct: bool,
        index_records: int,
        index_bytes: int,
    ) -> DiskStats:
        """The counters with the gauges the tier passes."""
        seconds, recovered, dropped = self._recovery
        with self._lock:
            c = dict(self._counts)
        return DiskStats(
            capacity=capacity,
            used=used,
            objects=objects,
            bytes_written=c["bytes_written"],
            writes=c["writes"],
            bytes_read=c["bytes_read"],
            reads=c["reads"],
            demotions=c["demotions"],
            demotions_failed=c["demotions_failed"],
            loads=c["loads"],
            loads_failed=c["loads_failed"],
            checksum_failures=c["checksum_failures"],
            read_errors=c["read_errors"],
            lost=c["lost"],
            queue_bytes=queue_bytes,
            up=up,
            direct=direct,
            index_records=index_records,
            index_bytes=index_bytes,
            compactions=c["compactions"],
            recovery_seconds=seconds,
            recovered=recovered,
            recovery_dropped=dropped,
            read_latency=self._reads.snapshot(),
            write_latency=self._writes.snapshot(),
        )
