"""What a FILE region reads its bytes from (a disk tier of the store server)."""

from __future__ import annotations

from typing import Protocol


class FileSource(Protocol):
    """The bytes behind a read-only FILE region."""

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with bytes [offset, offset+len(view)) of the source; raise
        SourceUnavailable (never return partial or unverified bytes)."""
