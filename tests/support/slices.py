"""Driving one transport directly, without the engine's routing: a request cut into slices."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvconnect.transfer import (
    MemoryRegion,
    SegmentDescriptor,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.batch import BatchState, TransferBatch, make_slices
from kvconnect.transfer.transports.base import Transport

MiB = 1 << 20
SLICE = 256 << 10


def submit_request(
    transport: Transport,
    peer: SegmentDescriptor,
    op: TransferOp,
    local: MemoryRegion,
    region: int,
    offset: int = 0,
    length: int | None = None,
) -> TransferBatch:
    """One request (``length`` bytes at ``offset`` of the peer's ``region``; default to the end
    of its first MiB) in ``SLICE``-sized slices, handed to ``transport``; a 10 s deadline."""
    size = MiB - offset if length is None else length
    request = TransferRequest(local, 0, peer.name, region, offset, size)
    state = BatchState(op, [request], time.monotonic() + 10, SLICE, lambda: None, settle_grace=1)
    transport.submit(peer, op, make_slices(state, 0, request, SLICE))
    return TransferBatch(state)


def done_in_submit(submit: Callable[[], TransferBatch]) -> TransferBatch:
    """A batch ``submit()`` returned done (a small same-host copy made by the submitting
    thread). That path only tries the shared-memory peer's lock, which its liveness watch
    takes now and then: a submit meeting it hands the copy to a worker, so a few tries are
    allowed; every one must complete."""
    for _ in range(20):
        batch = submit()
        if batch.done():
            return batch
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
    raise AssertionError("no copy completed in submit in 20 tries")
