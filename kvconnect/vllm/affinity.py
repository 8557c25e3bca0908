"""Keep kvconnect's I/O threads off the core vLLM pinned its model thread to.

vLLM's CPU workers bind their OpenMP threads, and with them the worker's main thread, to
cores; threads the main thread starts inherit that one-core mask. kvconnect's transfer and
side-channel threads would then share a core with a busy model thread (and, with several
engines on a host, with each other), and a read could wait seconds for a handshake. These
helpers give kvconnect's threads every CPU the host offers this process instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

_CPUSETS = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online")


def host_cpus() -> set[int]:
    """The CPUs this process may use at all (its cgroup's, else every online one)."""
    for path in _CPUSETS:
        with contextlib.suppress(OSError, ValueError):
            return parse_cpu_list(Path(path).read_text())
    return set()


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` → ``{0, 1, 2, 3, 8, 10, 11}``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def unpin_this_thread() -> None:
    """Let the calling thread run on every CPU of :func:`host_cpus` (no-op where the
    platform cannot, or when nothing narrowed it)."""
    cpus = host_cpus()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside inherit every CPU; the calling thread's mask is restored."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    mask = os.sched_getaffinity(0)
    unpin_this_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mask)
