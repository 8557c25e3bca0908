"""Polling for state another process or thread updates (never a sleep as synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], message: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until true; fail with ``message`` after ``timeout`` seconds.

    For state another process or thread updates after the event the test observed (a
    listener counts a refusal after sending it).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)
