"""The P2P store: large, read-mostly objects (model weights, checkpoints) published once and
fetched by many nodes from each other, with only metadata in etcd (docs/p2p.md).

Typical use::

    with P2PNode(P2PConfig(etcd="etcd://10.0.0.5:2379")) as node:
        manifest, stats = node.fetch("llama-70b", Files(Path("/cache/llama-70b")))
"""

from kvconnect.p2p.config import P2PConfig
from kvconnect.p2p.destination import Buffers, Destination, Files
from kvconnect.p2p.fetch import FetchStats
from kvconnect.p2p.manifest import FileEntry, Manifest
from kvconnect.p2p.node import Listing, P2PNode
from kvconnect.p2p.swarm import Proximity

__all__ = [
    "Buffers",
    "Destination",
    "FetchStats",
    "FileEntry",
    "Files",
    "Listing",
    "Manifest",
    "P2PConfig",
    "P2PNode",
    "Proximity",
]
