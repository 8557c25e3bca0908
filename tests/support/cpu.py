"""CPU time of this process's threads (Linux /proc): what polling threads burn."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable


def thread_cpu(threads: Iterable[threading.Thread]) -> float:
    """CPU seconds (user and system) the ``threads`` of this process have used so far; a
    thread that ended counts 0."""
    ticks = 0
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")
