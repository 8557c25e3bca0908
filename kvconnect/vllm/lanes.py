"""Lanes: background jobs grouped by what they wait on, so one stuck peer delays only its own.

A lane is a key (one prefill's side channel, the pool's loads, the pool's saves, …). Its jobs
run in order on at most ``width`` threads of its own, started as jobs come and ended once the
lane has been idle for a while. A job that hangs — a SIGSTOPped prefill accepts connections and
answers nothing until the job's own timeout — holds its lane's threads only: other lanes keep
their threads and run at once.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnect.errors import ClosedError, ConfigError
from kvconnect.vllm.affinity import bind_this_thread

log = logging.getLogger(__name__)

_IDLE = 30.0  # seconds a lane's thread waits for more work before it ends

Job = Callable[[], None]


@dataclass(slots=True)
class _Lane:
    ready: threading.Condition
    jobs: collections.deque[Job] = field(default_factory=collections.deque)
    threads: int = 0
    running: int = 0


class Lanes:
    """Runs jobs on per-lane threads (see the module docstring). Thread-safe."""

    def __init__(
        self,
        name: str,
        width: int,
        *,
        cpus: frozenset[int] = frozenset(),
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """``name`` prefixes the threads' names; ``cpus``: where they run (empty: inherit from
        the submitting thread); ``on_exit`` runs on each thread as it ends (to release what the
        thread holds, e.g. its side-channel sockets). Starts no thread."""
        self._name = name
        self._width = width
        self._cpus = cpus
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, lane: str, job: Job) -> None:
        """Queue ``job`` on ``lane``; never blocks. Raises ClosedError after :meth:`close`.
        ``job`` must bound its own time (it holds a thread of the lane while it runs)."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._name} lanes are closed")
            state = self._lanes.get(lane)
            if state is None:
                state = self._lanes[lane] = _Lane(threading.Condition(self._lock))
            state.jobs.append(job)
            state.ready.notify()
            idle = state.threads - state.running
            if idle < len(state.jobs) and state.threads < self._width:
                state.threads += 1
                thread = threading.Thread(
                    target=self._run,
                    args=(lane, state),
                    name=f"kvconnect-{self._name}-{lane}",
                    daemon=True,
                )
                self._threads.add(thread)
                thread.start()

    def busy(self, lane: str) -> bool:
        """Whether ``lane`` has a job queued or running."""
        with self._lock:
            state = self._lanes.get(lane)
            return state is not None and bool(state.jobs or state.running)

    def close(self) -> None:
        """Drop queued jobs and wait for running ones (each bounds its own time). Idempotent."""
        with self._lock:
            self._closed = True
            for state in self._lanes.values():
                state.jobs.clear()
                state.ready.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def _run(self, lane: str, state: _Lane) -> None:
        try:
            bind_this_thread(self._cpus)
        except ConfigError as exc:  # register() checked io_cpus: only a changed host gets here
            log.warning("kvconnect %s thread keeps its CPUs: %s", self._name, exc)
        try:
            while (job := self._next(lane, state)) is not None:
                try:
                    job()
                except Exception:  # jobs report their own failures; this one is a bug
                    log.exception("kvconnect %s job on lane %s failed", self._name, lane)
                finally:
                    with self._lock:
                        state.running -= 1
        finally:
            if self._on_exit is not None:
                self._on_exit()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _next(self, lane: str, state: _Lane) -> Job | None:
        """The lane's next job, or None once this thread is to end (accounted for under the
        same lock as the check, so a job submitted meanwhile always finds a thread)."""
        with self._lock:
            if not state.jobs and not self._closed:
                state.ready.wait_for(lambda: state.jobs or self._closed, timeout=_IDLE)
            if state.jobs and not self._closed:
                state.running += 1
                return state.jobs.popleft()
            state.threads -= 1
            if not state.threads and self._lanes.get(lane) is state:
                del self._lanes[lane]
            return None
