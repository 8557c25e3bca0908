"""The transfer engine: registered memory, segments, batched one-sided READ/WRITE.

Typical use::

    with TransferEngine(TransferConfig()) as engine:
        region = engine.register(buffer)
        batch = engine.submit(TransferOp.READ, [TransferRequest(region, 0, peer, 1, 0, n)])
        statuses = batch.wait(timeout=5)
"""

from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryKind, MemoryRegion
from kvconnect.transfer.metadata import (
    EmbeddedMetadata,
    MetadataBackend,
    P2PMetadata,
    SegmentRegistry,
)
from kvconnect.transfer.segment import RegionInfo, SegmentDescriptor
from kvconnect.transfer.source import FileSource
from kvconnect.transfer.stats import EngineStats, ListenerStats, TransportStats
from kvconnect.transfer.transports.base import Transport
from kvconnect.transfer.types import Capabilities, TransferOp, TransferRequest, TransferStatus

__all__ = [
    "Capabilities",
    "EmbeddedMetadata",
    "EngineStats",
    "FileSource",
    "ListenerStats",
    "MemoryKind",
    "MemoryRegion",
    "MetadataBackend",
    "P2PMetadata",
    "RegionInfo",
    "SegmentDescriptor",
    "SegmentRegistry",
    "TransferBatch",
    "TransferConfig",
    "TransferEngine",
    "TransferOp",
    "TransferRequest",
    "TransferStatus",
    "Transport",
    "TransportStats",
]
