"""Polling for state another process or thread updates (never a sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], bool],
    message: str,
    timeout: float = 10.0,
    *,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` until true; fail with ``message`` after ``timeout`` seconds, and
    then with what ``detail`` tells (the state seen last, for a failure far from its logs).

    For state another process or thread updates after the event the test observed (a
    listener counts a refusal after sending it).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(message if detail is None else f"{message}\n{detail()}")
        time.sleep(0.01)


async def await_for(condition: Callable[[], bool], message: str, timeout: float = 10.0) -> None:
    """:func:`wait_for` inside an event loop: polls without blocking the loop, whose own tasks
    (servers, health loops) make ``condition`` true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.01)
