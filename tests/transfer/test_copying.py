"""Which same-host copies the submitting thread makes itself (CopyWorkers.inline)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvconnect.transfer import TransferOp, TransferRequest
from kvconnect.transfer.batch import BatchState, Slice, make_slices
from kvconnect.transfer.datapath.copying import CopyWorkers
from kvconnect.transfer.memory import MemoryRegion, MemoryRegistry

MiB = 1 << 20


@pytest.fixture
def host() -> Iterator[MemoryRegion]:
    registry = MemoryRegistry()
    try:
        yield registry.register(np.zeros(4 * MiB, dtype=np.uint8))
    finally:
        registry.close()


def _pieces(region: MemoryRegion, sizes: list[int]) -> list[Slice]:
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    requests = [
        TransferRequest(region, at, "peer", 1, at, size)
        for at, size in zip(offsets, sizes, strict=True)
    ]
    batch = BatchState(
        TransferOp.READ, requests, time.monotonic() + 10, 4 * MiB, lambda: None, settle_grace=1
    )
    return [p for n, r in enumerate(requests) for p in make_slices(batch, n, r, 4 * MiB)]


def test_a_few_pieces_of_up_to_a_mib_of_host_memory_are_copied_inline(
    host: MemoryRegion,
) -> None:
    workers = CopyWorkers(2, 64 * MiB)
    try:
        assert workers.inline(_pieces(host, [MiB]))  # one coalesced batch of small objects
        assert workers.inline(_pieces(host, [4096] * 16))
        assert not workers.inline(_pieces(host, [4096] * 17))  # Python per piece: a worker's
        assert not workers.inline(_pieces(host, [MiB, 1]))  # memcpy long enough to hand off
    finally:
        workers.close()
    assert not workers.inline(_pieces(host, [4096]))  # closed: nothing runs inline
