"""Where kvconnect's threads run inside vLLM's processes.

By default they inherit the CPUs of the thread that starts them: on vLLM's CPU workers that is
the model thread's core, which vLLM chose for this instance. Threads widened to every CPU of the
host would land on other instances' cores too, where (with one scheduling group per server, as
autogroups and containers make them) they hold almost no weight: measured on two cores, 128 MiB
reads then took 41-260 ms instead of 41-70 ms. ``io_cpus`` gives them cores of their own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from kvconnect.errors import ConfigError


def bind_this_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread on ``cpus``; no change when empty (or where the platform cannot)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ConfigError(f"io_cpus {sorted(cpus)}: cannot run there: {exc}") from exc


@contextlib.contextmanager
def threads_on(cpus: frozenset[int]) -> Iterator[None]:
    """Threads started inside run on ``cpus`` (inherit as usual when empty); the calling
    thread's own CPUs are restored afterwards."""
    if not cpus or not hasattr(os, "sched_getaffinity"):
        yield
        return
    mask = os.sched_getaffinity(0)
    bind_this_thread(cpus)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mask)
