"""Waiting for a socket's next bytes: poll for a short window, then sleep.

A thread that sleeps until its answer arrives pays a wake-up when the answer comes: on a
virtual machine whose idle vCPUs halt, that is tens of microseconds on the receiving side and
as much again inside the sender's ``send`` (docs/benchmarks.md, "Store"), most of a
small request's round trip. A thread that expects an answer within microseconds therefore
first *polls* (asks without sleeping, yielding the CPU between asks) for up to a configured
window, and sleeps only after it. The window bounds the CPU one wait can burn; 0 turns polling
off.

Polling needs the C extension, which polls without the GIL so the process's other Python
threads go on; without it every wait sleeps at once.
"""

from __future__ import annotations

import errno
import select
from collections.abc import Callable


def _native_poll() -> Callable[[int, float, float], bool] | None:
    try:
        from kvconnect import _native
    except ImportError:  # no C extension: every wait sleeps
        return None
    return _native.wait_readable


_native_wait = _native_poll()


def wait_readable(fd: int, window: float, timeout: float) -> bool:
    """Whether ``fd`` became readable within ``timeout`` seconds (hung up or failed counts: the
    caller's read tells which), polling for the first ``window`` of them. Blocks the calling
    thread, without the GIL; raises OSError if the descriptor cannot be polled (-1, a closed
    socket's: poll() would skip it and sleep the whole timeout)."""
    if fd < 0:
        raise OSError(errno.EBADF, "not an open descriptor")
    timeout = max(0.0, timeout)
    if _native_wait is not None:
        return _native_wait(fd, max(0.0, window), timeout)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
