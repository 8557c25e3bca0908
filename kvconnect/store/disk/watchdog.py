"""Disk operations in flight and their age, so a stuck one can be noticed by another thread."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class OpsInFlight:
    """Thread-safe registry of the disk operations running now."""

    def __init__(self) -> None:
        self._ops: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @contextmanager
    def track(self, what: str) -> Iterator[None]:
        """Count the block as operation ``what`` in flight from now until it ends."""
        op = next(self._ids)
        with self._lock:
            self._ops[op] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                del self._ops[op]

    def stuck(self, timeout: float) -> str | None:
        """An operation running for longer than ``timeout`` seconds (None: none is)."""
        limit = time.monotonic() - timeout
        with self._lock:
            return next((what for what, start in self._ops.values() if start < limit), None)
