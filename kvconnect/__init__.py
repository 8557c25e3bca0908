"""kvconnect: share and move LLM KV cache across processes and machines.

Importing kvconnect imports no torch, sglang or vllm; optional dependencies load where used.
"""

import logging

from kvconnect.errors import (
    AccessDenied,
    AuthenticationError,
    BrokenError,
    ClosedError,
    ConfigError,
    InvalidRequest,
    KVConnectError,
    PeerUnreachable,
    ProtocolError,
    RegionBusy,
    RegistrationError,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
)
from kvconnect.transfer import (
    MemoryRegion,
    TransferBatch,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)

__version__ = "0.1.0"

logging.getLogger("kvconnect").addHandler(logging.NullHandler())

__all__ = [
    "AccessDenied",
    "AuthenticationError",
    "BrokenError",
    "ClosedError",
    "ConfigError",
    "InvalidRequest",
    "KVConnectError",
    "MemoryRegion",
    "PeerUnreachable",
    "ProtocolError",
    "RegionBusy",
    "RegistrationError",
    "SegmentNotFound",
    "TransferBatch",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferRequest",
    "TransferStatus",
    "TransferTimeout",
    "__version__",
]
