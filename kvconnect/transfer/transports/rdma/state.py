"""State the RDMA transport keeps per slice, per queue pair, per peer and per region.

Plain holders with their own small locks; the transport (``rdma.py``) drives them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvconnect.errors import RegistrationError
from kvconnect.transfer.batch import Slice
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.transports.rdma import verbs
from kvconnect.transfer.transports.rdma.plan import QpDriver, Spreader
from kvconnect.transfer.types import TransferOp


@dataclass(slots=True, eq=False)
class Work:
    """One slice on its way: the work requests it has posted and where."""

    peer: SegmentDescriptor
    op: TransferOp
    slice: Slice
    attempts: int = 0
    tried: set[int] = field(default_factory=set)  # id() of paths that failed it
    left: int = 0
    status: int = 0  # worst completion status of the current attempt (0: success)
    path: Path | None = None


class Path:
    """One RC queue pair of a link. Its driver's state tells whether it may take work."""

    def __init__(self, slot: int, nic: verbs.Nic, peer_nic: str, qp: Any) -> None:
        self.slot = slot
        self.nic = nic
        self.peer_nic = peer_nic
        self.qp = qp
        self.driver = QpDriver(lambda step: nic.apply(qp, step))
        self.outstanding = 0  # guarded by the transport's lock
        self.retired = False
        self._lock = threading.Lock()

    def abort(self) -> None:
        """Move the QP to ERR: posted work completes (flushed) and touches no memory after."""
        with self._lock:
            self.driver.fail()

    def close(self) -> None:
        """Destroy the QP (its work must have completed)."""
        self.qp.close()


class Link:
    """Paths and remote keys for one peer engine (the poster thread builds and uses it; the
    completion thread only drops keys that turned out dead)."""

    def __init__(self, peer: SegmentDescriptor) -> None:
        self.peer = peer
        self.paths: dict[int, Path] = {}
        self.degraded_until = 0.0
        self.spreader = Spreader()
        self._lock = threading.Lock()
        self._keys: dict[int, dict[str, tuple[int, int]]] = {}  # region → peer NIC → addr, rkey

    def key(self, region_id: int, peer_nic: str) -> tuple[int, int] | None:
        with self._lock:
            return self._keys.get(region_id, {}).get(peer_nic)

    def missing(self, region_ids: set[int]) -> list[int]:
        with self._lock:
            return sorted(r for r in region_ids if r not in self._keys)

    def store(self, keys: Sequence[wire.RdmaKey]) -> None:
        with self._lock:
            for key in keys:
                self._keys.setdefault(key.region_id, {})[key.nic] = (key.address, key.rkey)

    def drop(self, region_id: int) -> None:
        """The peer refused this region's key: ask for it again on next use."""
        with self._lock:
            self._keys.pop(region_id, None)


class Registrations:
    """MRs of registered regions, per NIC, created on first use and closed on withdrawal."""

    def __init__(self, owns: Callable[[MemoryRegion], bool]) -> None:
        """``owns`` tells whether a region is still registered with the engine."""
        self._owns = owns
        self._lock = threading.Lock()
        self._mrs: dict[int, dict[str, verbs.Registered]] = {}

    def mr(self, region: MemoryRegion, nic: verbs.Nic) -> verbs.Registered:
        """The MR of ``region`` on ``nic``; RegistrationError if it is (being) withdrawn."""
        with self._lock:
            per_nic = self._mrs.setdefault(region.id, {})
            mr = per_nic.get(nic.name)
            if mr is None:
                mr = per_nic[nic.name] = nic.register(region)
            # Checked under the lock, after the MR exists: an unregister that raced with us
            # either sees it in withdraw() or is seen here, never neither.
            if not self._owns(region):
                self._mrs.pop(region.id)
                for stale in per_nic.values():
                    stale.close()
                raise RegistrationError(f"region {region.id} was withdrawn")
            return mr

    def withdraw(self, region_id: int) -> None:
        """Deregister every MR of ``region_id``: peers' keys for it die now."""
        with self._lock:
            mrs = self._mrs.pop(region_id, {})
        for mr in mrs.values():
            mr.close()

    def close(self) -> None:
        """Deregister everything."""
        with self._lock:
            ids = list(self._mrs)
        for region_id in ids:
            self.withdraw(region_id)
