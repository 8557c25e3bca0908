"""The one lifecycle of kvconnect's long-lived objects: ``start()``, ``close()``, ``with``."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Closing:
    """``with obj:`` closes it at the end (for objects that start when built, such as child
    processes). Subclasses implement ``close`` (idempotent)."""

    __slots__ = ()

    def close(self) -> None:
        """Release everything the object holds."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Lifecycle(Closing):
    """``with obj:`` starts it and closes it. Subclasses implement both (idempotent)."""

    __slots__ = ()

    def start(self) -> None:
        """Acquire threads, sockets and memory."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self
