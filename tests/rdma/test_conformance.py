"""The transfer conformance suite, unchanged, over the RDMA transport: this process's engine
against a peer engine in another process, both on the same RDMA device (Soft-RoCE in CI)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvconnect.testing.conformance import TARGET_BYTES, Target
from kvconnect.testing.peer import PeerProcess
from kvconnect.transfer import MemoryRegion, TransferConfig, TransferEngine
from tests.support.conformance import CHECKS, ProcessTarget

pytestmark = [pytest.mark.rdma, pytest.mark.integration]


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[TransferEngine, MemoryRegion, Target]]:
    with TransferEngine(TransferConfig(transport="rdma")) as engine:
        local = engine.register(np.zeros(TARGET_BYTES, dtype=np.uint8))
        with PeerProcess(config={"transport": "rdma"}, shared=TARGET_BYTES, seed=1) as peer:
            yield engine, local, ProcessTarget(peer)
            stats = engine.stats().transports
            # Every byte went over RDMA: nothing fell back to TCP.
            assert stats["rdma"].bytes_read > 0
            assert stats["rdma"].bytes_written > 0
            assert stats["tcp"].bytes_read == stats["tcp"].bytes_written == 0


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(
    setup: tuple[TransferEngine, MemoryRegion, Target],
    check: Callable[[TransferEngine, MemoryRegion, Target, int], None],
) -> None:
    engine, local, target = setup
    check(engine, local, target, 42)
