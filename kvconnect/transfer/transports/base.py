"""The one Protocol every transport implements.

A transport receives *slices* (pieces of requests, at most ``slice_bytes`` each) for one peer and
completes each through its batch (``Slice.done``). It never blocks the submitting thread: work
runs on the transport's own threads. Transports never import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvconnect.transfer.batch import Slice
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
        """Drop connections and mappings of a peer engine (it restarted or was withdrawn)."""

    def stats(self) -> TransportStats:
        """Counters since start."""

    def close(self) -> None:
        """Fail queued work with ClosedError, stop threads, release resources. Idempotent."""
