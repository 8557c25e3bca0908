"""A log throttle for faults a peer can repeat at will (hostile input, refused handshakes)."""

from __future__ import annotations

import time


class Throttle:
    """:meth:`ready` is true at most once every ``every`` seconds: a flood costs one log line
    per interval, not one per message. Not thread-safe (each user has one thread)."""

    def __init__(self, every: float = 10.0) -> None:
        self._every = every
        self._last = -every

    def ready(self) -> bool:
        """Whether a line may be logged now (then the interval starts again)."""
        now = time.monotonic()
        if now - self._last < self._every:
            return False
        self._last = now
        return True
