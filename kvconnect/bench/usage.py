"""CPU time of the benchmark's own process and of the store processes it started."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time so far of this process and of ``pids``, every thread of each (nanosecond
    precision: a small operation's CPU shows, where clock ticks are 10 ms)."""
    total = time.process_time()
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:  # the thread ended meanwhile
                continue
    return total
