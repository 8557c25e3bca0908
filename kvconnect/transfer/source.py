"""FILE regions' bytes: the :class:`FileSource` the owner of a region supplies, and the one call
through which the engine reads it.

A FILE region (``TransferEngine.register_source``) has no memory a transport could touch: only
its owner's engine can produce its bytes, on demand, by asking the source. Peers read such
regions over TCP (the listener fills the frame from the source before answering) or, in the same
process, through the local transport; they never write them.
"""

from __future__ import annotations

from typing import Protocol

from kvconnect.errors import SourceUnavailable


class FileSource(Protocol):
    """Bytes ``[0, length)`` of something that is not memory (a file, a disk tier)."""

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with bytes ``[offset, offset + len(view))`` of the source, or raise
        SourceUnavailable; never return with partial or unverified bytes in ``view``.

        Called from engine threads (listener connections, copy workers), concurrently, for any
        sub-range of the region (requests are cut into slices of ``slice_bytes``); blocks until
        done. ``view`` is a writable, C-contiguous byte view owned by the caller; the range is
        within the length the source was registered with.
        """


def read_source(source: FileSource, offset: int, view: memoryview) -> None:
    """``source.read_into(offset, view)``, an OSError of the source raised as SourceUnavailable
    (the caller answers the access with an error either way, and keeps serving)."""
    try:
        source.read_into(offset, view)
    except OSError as exc:
        raise SourceUnavailable(f"cannot read {view.nbytes} bytes at {offset}: {exc}") from exc
