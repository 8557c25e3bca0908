"""Pool lookups off vLLM's scheduler thread.

vLLM asks ``get_num_new_matched_tokens`` on its scheduler thread, which must never wait on a
master RPC. :class:`PoolLookups` answers at once: None while the request's lookup runs on a
background lane (vLLM then skips the request and asks again at a later step), the pooled
block count once it is in. Results are kept per request and first block looked up (past
the local prefix hit: vLLM asks again with the same one while it retries; a preempted
request asks with a new one), at most ``limit`` requests at a time (past it a request is a
miss, not a queue that grows); a failed lookup is a miss.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvconnect.errors import ClosedError
from kvconnect.vllm.lanes import Lanes
from kvconnect.vllm.pool import StorePoolIndex, Verdict
from kvconnect.vllm.stats import StepStats

log = logging.getLogger(__name__)

LIMIT = 4096
"""Requests whose lookup result is kept at once (vLLM forgets them as it schedules them)."""

SETTLE_SECONDS = 60.0
"""How long :meth:`PoolLookups.settle` keeps asking; past it lookups ask as they run."""

_LANE = "lookup"
_PROBE_LANE = "probe"
_FIRST_PAUSE, _LAST_PAUSE = 0.02, 2.0  # seconds between the background probe's asks


@dataclass(slots=True)
class _Entry:
    first: int
    blocks: int | None = None  # None: the lookup is still running


class PoolLookups:
    """The scheduler side's pool index: asks :class:`StorePoolIndex` in the background."""

    def __init__(
        self,
        index: StorePoolIndex,
        *,
        cpus: frozenset[int] = frozenset(),
        limit: int = LIMIT,
        stats: StepStats | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``stats``: where each lookup is counted: ``pool_lookups``, the blocks asked about
        (``pool_lookup_blocks``) and found (``pool_hit_blocks``), and its duration
        (``pool_lookup_duration_seconds``)."""
        self.index = index
        self._stats = stats
        self._clock = clock
        self._lanes = Lanes("pool", 1, cpus=cpus)
        self._limit = limit
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._stop = threading.Event()

    def ask(self, request_id: str, first: int, hashes: Sequence[str]) -> int | None:
        """How many of ``hashes`` (the request's block hashes from its block ``first`` on),
        from the first, the pool holds; None while that is being looked up. Never blocks."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.first == first:
                return entry.blocks
            if entry is None and len(self._entries) >= self._limit:
                return 0
            self._entries[request_id] = _Entry(first)
        job = functools.partial(self._look_up, request_id, first, tuple(hashes))
        try:
            self._lanes.submit(_LANE, job)
        except ClosedError:  # the engine shuts down: a miss
            self.forget(request_id)
            return 0
        return None

    def forget(self, request_id: str) -> None:
        """Drop what is known of ``request_id`` (scheduled, or finished)."""
        with self._lock:
            self._entries.pop(request_id, None)

    def busy(self) -> bool:
        """Whether a lookup is queued or running."""
        return self._lanes.busy(_LANE)

    @property
    def usable(self) -> bool:
        """Whether blocks may be saved: the workers' key scheme is known and the fleet probe
        agreed (never asks the store)."""
        return self.index.keys is not None and self.index.verdict is Verdict.AGREE

    def settle(self) -> None:
        """Ask the fleet probe in the background (its own lane: lookups never queue behind it)
        as soon as vLLM seeded its hashes, again after a failed ask with a growing pause, for
        at most :data:`SETTLE_SECONDS`: the verdict (and the first connection to the store) is
        then in before the first request, which would otherwise pay for both. Never blocks;
        raises ClosedError after :meth:`close`."""
        self._lanes.submit(_PROBE_LANE, self._settle)

    def close(self) -> None:
        """Stop the background probe; wait for a running lookup or probe (bounded by the store
        client's timeouts)."""
        self._stop.set()
        self._lanes.close()

    def _settle(self) -> None:
        deadline = self._clock() + SETTLE_SECONDS
        pause = _FIRST_PAUSE
        while self.index.verdict is Verdict.UNKNOWN and not self._stop.is_set():
            if self.index.check_fleet() or self._clock() + pause > deadline:
                return
            self._stop.wait(pause)
            pause = min(2 * pause, _LAST_PAUSE)

    def _look_up(self, request_id: str, first: int, hashes: tuple[str, ...]) -> None:
        started = self._clock()
        try:
            blocks = self.index.leading(hashes, first)
        except Exception:  # a bug, not the store (leading answers 0 for that): a miss
            log.exception("kvconnect pool lookup of %s failed", request_id)
            blocks = 0
        if self._stats is not None:
            self._stats.add(pool_lookups=1, pool_lookup_blocks=len(hashes), pool_hit_blocks=blocks)
            self._stats.observe(pool_lookup_duration_seconds=self._clock() - started)
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.first == first:
                entry.blocks = blocks
