"""Driving one transport directly, without the engine's routing: a request cut into slices."""

from __future__ import annotations

import time

from kvconnect.transfer import MemoryRegion, SegmentDescriptor, TransferOp, TransferRequest
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
