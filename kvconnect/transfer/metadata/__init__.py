"""Where segment descriptors live: the MetadataBackend interface, its backends, the peer cache.

Backends, one module each:

- :mod:`.handshake`, :class:`P2PMetadata` (default): a segment's name is its listener's
  ``host:port``; lookups ask that listener directly. No service to run.
- :mod:`.embedded`, :class:`EmbeddedMetadata`: an in-process :class:`SegmentRegistry`, for
  all-in-one deployments and tests.
- :mod:`.etcd`, ``EtcdMetadata``: descriptors in etcd under leases, with watches.

:mod:`.directory` is the engine's cache in front of whichever backend is configured.

A backend that can push changes (etcd, with watches) calls the ``on_change`` callback given to
``start`` with a segment name whenever that segment's descriptor changed or vanished; the engine
then drops its cached copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvconnect.transfer.segment import SegmentDescriptor


class MetadataBackend(Protocol):
    """Publishes this engine's descriptor and finds peers' descriptors by segment name."""

    def start(self, on_change: Callable[[str], None]) -> None:
        """Begin; ``on_change(name)`` reports a peer descriptor that changed or vanished."""

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Make (a new version of) our descriptor visible to peers."""

    def withdraw(self, name: str) -> None:
        """Remove our descriptor; peers stop finding the segment."""

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        """The current descriptor of segment ``name``; SegmentNotFound if there is none.

        Blocks for at most ``timeout`` seconds. Raises PeerUnreachable for an unreachable peer.
        """

    def close(self) -> None:
        """Release connections and threads. Idempotent."""


from kvconnect.transfer.metadata.embedded import EmbeddedMetadata, SegmentRegistry  # noqa: E402
from kvconnect.transfer.metadata.handshake import P2PMetadata  # noqa: E402

__all__ = ["EmbeddedMetadata", "MetadataBackend", "P2PMetadata", "SegmentRegistry"]
