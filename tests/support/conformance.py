"""What every transport's conformance suite runs (tests/transfer and tests/rdma)."""

from __future__ import annotations

from collections.abc import Callable

from kvconnect.testing import conformance
from kvconnect.testing.conformance import Target
from kvconnect.testing.peer import PeerProcess
from kvconnect.transfer import MemoryRegion, TransferEngine

CHECKS: list[Callable[[TransferEngine, MemoryRegion, Target, int], None]] = [
    conformance.check_sizes,
    conformance.check_many_small,
    conformance.check_concurrent,
    conformance.check_refusals,
]


class ProcessTarget:
    """A conformance Target living in a child process (its shared region)."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        self.name = peer.name
        self.region = peer.regions["shared"]

    def sha256(self, offset: int, length: int) -> str:
        return self.peer.sha256("shared", offset, length)

    def fill(self, seed: int) -> None:
        self.peer.fill("shared", seed)
