"""The one lifecycle of kvconnect's long-lived objects: ``start()``, ``close()``, ``with``."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Lifecycle:
    """``with obj:`` starts it and closes it. Subclasses implement both (idempotent)."""

    __slots__ = ()

    def start(self) -> None:
        """Acquire threads, sockets and memory."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything ``start`` acquired."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
