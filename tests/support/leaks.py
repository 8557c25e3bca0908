"""What a test module may not leave behind: kvconnect threads and open file descriptors."""

from __future__ import annotations

import os
import threading
import time


def kvconnect_threads() -> list[threading.Thread]:
    """Live threads started by kvconnect."""
    return [t for t in threading.enumerate() if t.name.startswith("kvconnect-")]


def wait_no_kvconnect_threads(timeout: float = 5.0) -> list[threading.Thread]:
    """Wait for kvconnect threads to end; returns the ones still alive."""
    end = time.monotonic() + timeout
    while kvconnect_threads() and time.monotonic() < end:
        time.sleep(0.02)
    return kvconnect_threads()


def open_fds() -> set[tuple[str, str]]:
    """This process's open file descriptors with what they point to."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            continue  # the descriptor listdir itself used
    return fds
