"""Client-side protection against a slow or failing store: pure logic, clock passed in.

- :class:`CircuitBreaker`: after ``failures`` consecutive failures the client fails fast for
  ``cooldown`` seconds, then lets one probe through; its success closes the circuit.
- :class:`NegativeCache`: keys whose last read failed are reported absent for ``ttl`` seconds,
  so a caller does not keep finding them and timing out on them.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict


class BreakerState(enum.StrEnum):
    """CLOSED: calls flow. OPEN: calls fail fast. HALF_OPEN: one probe is in flight.
    (A ``str``: adapters show it as is, e.g. SGLang's ``breaker_state``.)"""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker with a cool-down and single-probe recovery. Thread-safe."""

    def __init__(self, failures: int, cooldown: float) -> None:
        self._threshold = failures
        self._cooldown = cooldown
        self._lock = threading.Lock()
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self.trips = 0

    @property
    def state(self) -> BreakerState:
        """Current state (OPEN may already be due for a probe)."""
        with self._lock:
            return self._state

    def allow(self, now: float) -> bool:
        """Whether a call may go to the store now (a probe, after the cool-down)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and now - self._opened_at >= self._cooldown:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def success(self) -> None:
        """A call succeeded: close the circuit."""
        with self._lock:
            self._failures = 0
            self._state = BreakerState.CLOSED

    def failure(self, now: float) -> None:
        """A call failed: count it; open at the threshold or when a probe fails."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self._threshold
            ):
                self._state = BreakerState.OPEN
                self._opened_at = now
                self.trips += 1


class NegativeCache:
    """Keys recently failed, each forgotten after ``ttl`` seconds (at most ``limit`` kept)."""

    def __init__(self, ttl: float, limit: int) -> None:
        self._ttl = ttl
        self._limit = limit
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: list[str], now: float) -> None:
        """Remember ``keys`` as failing."""
        if self._ttl <= 0:
            return
        with self._lock:
            for key in keys:
                self._until.pop(key, None)
                self._until[key] = now + self._ttl
            while len(self._until) > self._limit:
                self._until.popitem(last=False)

    def discard(self, keys: list[str]) -> None:
        """Forget ``keys`` (they were written again)."""
        with self._lock:
            for key in keys:
                self._until.pop(key, None)

    def failing(self, keys: list[str], now: float) -> list[bool]:
        """For each key, whether it failed within the TTL."""
        with self._lock:
            if not self._until:
                return [False] * len(keys)
            out = []
            for key in keys:
                until = self._until.get(key)
                if until is not None and until <= now:
                    del self._until[key]
                    until = None
                out.append(until is not None)
            return out
