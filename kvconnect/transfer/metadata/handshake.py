"""metadata="p2p": a segment's name is its listener's ``host:port``; lookups ask that listener."""

from __future__ import annotations

from collections.abc import Callable

from kvconnect.errors import ProtocolError
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.segment import SegmentDescriptor, decode_descriptor


class P2PMetadata:
    """Ask the peer's own listener (segment name = ``host:port``)."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def start(self, on_change: Callable[[str], None]) -> None:
        """Nothing to watch: peers are asked on demand."""

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Our listener serves the live descriptor itself."""

    def withdraw(self, name: str) -> None:
        """Closing the listener withdraws the segment."""

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        deadline = wire.deadline_after(timeout)  # bounds the connect, handshake and call
        sock, _engine_id = wire.open_connection(name, self._token, timeout)
        try:
            reply, _fds = wire.control_call(sock, wire.GetSegment(), deadline)
        finally:
            sock.close()
        if not isinstance(reply, wire.SegmentReply):
            raise ProtocolError(f"segment {name}: unexpected reply {reply!r}")
        return decode_descriptor(reply.descriptor)

    def close(self) -> None:
        """No resources are held between lookups."""
