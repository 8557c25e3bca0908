"""Where, and how soon, kvconnect's threads run inside vLLM's processes.

By default they inherit the CPUs of the thread that starts them: on vLLM's CPU workers that is
the model thread's core, which vLLM chose for this instance. Threads widened to every CPU of the
host would land on other instances' cores too, where (with one scheduling group per server, as
autogroups and containers make them) they hold almost no weight: measured on two cores, 128 MiB
reads then took 41-260 ms instead of 41-70 ms. ``io_cpus`` gives them cores of their own.

How soon: a transfer thread whose socket call returned waits for the GIL, and vLLM's worker
holds it nearly without pause while requests wait for their KV (it steps every millisecond and
polls for the next step in between). Python hands the GIL over only after the switch interval
(5 ms), so a wake-up of a transfer thread could cost up to 5 ms; :func:`lower_switch_interval`
shortens it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from kvconnect.errors import ConfigError

log = logging.getLogger(__name__)


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


def lower_switch_interval(seconds: float) -> None:
    """Lower this process's GIL switch interval to ``seconds`` (0, or above the current one:
    no change). Process-wide: it only shortens how long a thread that wants the GIL waits for
    one that runs Python without pause."""
    current = sys.getswitchinterval()
    if 0 < seconds < current:
        sys.setswitchinterval(seconds)
        log.info("kvconnect lowered the GIL switch interval from %g s to %g s", current, seconds)
