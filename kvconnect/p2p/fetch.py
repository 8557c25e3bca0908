"""One fetch: worker threads take chunks from the :class:`~kvconnect.p2p.swarm.Swarm`, READ
each from its holder into a staging slot of this node's engine, verify its digest, store it
in the destination and announce it (this node serves it from then on).

Staging slots are reused only once the engine has let go of them: a READ that timed out but
may still land (the batch returned it PENDING) keeps its slot until it settles.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvconnect.errors import KVConnectError, P2PError
from kvconnect.p2p.config import P2PConfig
from kvconnect.p2p.destination import Destination
from kvconnect.p2p.manifest import Manifest, chunks_of, digest
from kvconnect.p2p.registry import HolderRecord, place_of
from kvconnect.p2p.swarm import Assignment, Failure, Place, Proximity, Swarm, proximity
from kvconnect.transfer import MemoryRegion, TransferEngine, TransferOp, TransferRequest
from kvconnect.transfer.types import TransferStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchStats:
    """What a fetch did. ``reused``: chunks found verified at the destination;
    ``by_proximity``: bytes moved from holders on the same host, place, or elsewhere;
    ``by_holder``: bytes moved from each holder (its segment)."""

    chunks: int = 0
    total_bytes: int = 0
    reused: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    corrupt: int = 0
    failures: int = 0
    seconds: float = 0.0
    holders: int = 0
    by_proximity: dict[Proximity, int] = field(default_factory=dict)
    by_holder: dict[str, int] = field(default_factory=dict)


Progress = Callable[[FetchStats], None]


class ChunkState(enum.Enum):
    """What a fetch tells its holder record about a chunk."""

    FETCHING = "fetching"  # a transfer of it started
    DROPPED = "dropped"  # that transfer failed: needed again
    STORED = "stored"  # verified and stored: served from now on


class _Slots:
    """Staging slots of one registered buffer; a slot is taken by one transfer at a time."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._ready = threading.Condition()

    def take(self) -> int:
        with self._ready:
            while not self._free:
                self._ready.wait()
            return self._free.pop()

    def give(self, slot: int) -> None:
        with self._ready:
            self._free.append(slot)
            self._ready.notify()


class Fetch:
    """Moves the chunks ``have`` lacks into ``destination``; ``note(chunk, state)`` is called
    as a chunk's transfer starts, fails, or it is stored. Run by :meth:`run` on the caller's
    thread (it blocks); holders arrive through :meth:`holder` from the holder view's
    thread."""

    def __init__(
        self,
        config: P2PConfig,
        engine: TransferEngine,
        manifest: Manifest,
        destination: Destination,
        have: np.ndarray,
        place: Place,
        note: Callable[[int, ChunkState], None],
    ) -> None:
        self._config = config
        self._engine = engine
        self._manifest = manifest
        self._chunks = chunks_of(manifest)
        self._destination = destination
        self._place = place
        self._note = note
        self._swarm = Swarm(len(self._chunks), config.per_holder, config.retry_after)
        for index in np.flatnonzero(have):
            self._swarm.have(int(index))
        self._records: dict[str, HolderRecord] = {}
        self._cond = threading.Condition()
        self._error: KVConnectError | None = None
        self._stats = FetchStats(
            chunks=len(self._chunks), total_bytes=manifest.total_bytes, reused=int(have.sum())
        )
        self._last_progress = time.monotonic()
        slots = max(1, config.parallel)
        self._staging: MemoryRegion = engine.register(
            bytearray(slots * manifest.chunk_bytes), private=True
        )
        self._slots = _Slots(slots)

    def holder(self, key: str, record: HolderRecord | None) -> None:
        """A holder appeared, changed (``record``) or went (None). Any thread."""
        with self._cond:
            if record is None:
                self._records.pop(key, None)
                self._swarm.drop(key)
            else:
                self._records[key] = record
                near = proximity(self._place, place_of(record))
                self._swarm.holder(key, near, *record.bits(len(self._chunks)))
            self._stats.holders = len(self._records)
            self._cond.notify_all()

    def run(self, progress: Progress | None, timeout: float | None) -> FetchStats:
        """Fetch until every chunk is here; raises P2PError if the deadline passes or the
        fetch stalls (``stall_timeout`` without a chunk and none in flight)."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        workers = [
            threading.Thread(target=self._work, name=f"kvconnect-p2p-fetch-{i}", daemon=True)
            for i in range(self._config.parallel)
        ]
        for worker in workers:
            worker.start()
        try:
            with self._cond:
                while not self._swarm.complete and self._error is None:
                    if deadline is not None and time.monotonic() >= deadline:
                        self._error = P2PError(f"fetch of {self._manifest.name} timed out")
                        break
                    self._cond.wait(0.5)
                    if progress is not None:
                        self._stats.seconds = time.monotonic() - started
                        progress(self._stats)
                self._cond.notify_all()
        finally:
            for worker in workers:
                worker.join()
            self._stats.seconds = time.monotonic() - started
        if self._error is not None:
            raise self._error
        return self._stats

    def close(self) -> None:
        """Release the staging buffer (once no READ can still land in it)."""
        self._engine.unregister(self._staging)

    # -------------------------------------------------------------------------- workers

    def _work(self) -> None:
        while True:
            assignment = self._next()
            if assignment is None:
                return
            self._note(assignment.chunk, ChunkState.FETCHING)
            outcome, moved = self._move(assignment)
            with self._cond:
                now = time.monotonic()
                if outcome is None:
                    self._swarm.done(assignment)
                    self._last_progress = now
                    self._count(assignment, moved)
                else:
                    self._swarm.failed(assignment, outcome, now)
                    self._stats.failures += 1
                    self._stats.corrupt += outcome is Failure.CORRUPT
                self._cond.notify_all()
            stored = ChunkState.STORED if outcome is None else ChunkState.DROPPED
            self._note(assignment.chunk, stored)

    def _next(self) -> Assignment | None:
        with self._cond:
            while self._error is None and not self._swarm.complete:
                now = time.monotonic()
                assignment = self._swarm.next(now)
                if assignment is not None:
                    return assignment
                idle = now - self._last_progress
                if idle > self._config.stall_timeout and not self._swarm.in_flight():
                    missing = self._swarm.unavailable()
                    self._error = P2PError(
                        f"fetch of {self._manifest.name} stalled: no chunk for {idle:.0f} s "
                        f"({self._swarm.missing} missing, {missing} with no holder)"
                    )
                    self._cond.notify_all()
                    return None
                self._cond.wait(0.1)
            return None

    def _count(self, assignment: Assignment, moved: int) -> None:
        stats = self._stats
        stats.fetched += 1
        stats.fetched_bytes += moved
        record = self._records.get(assignment.holder)
        if record is not None:
            near = proximity(self._place, place_of(record))
            stats.by_proximity[near] = stats.by_proximity.get(near, 0) + moved
            stats.by_holder[record.segment] = stats.by_holder.get(record.segment, 0) + moved

    def _move(self, assignment: Assignment) -> tuple[Failure | None, int]:
        """One chunk from its holder: None and its length when it arrived and verified."""
        chunk = self._chunks[assignment.chunk]
        with self._cond:
            record = self._records.get(assignment.holder)
        if record is None:
            return Failure.UNREACHABLE, 0
        slot = self._slots.take()
        offset = slot * self._manifest.chunk_bytes
        request = TransferRequest(
            self._staging,
            offset,
            record.segment,
            record.regions[chunk.file],
            chunk.offset,
            chunk.length,
        )
        try:
            batch = self._engine.submit(
                TransferOp.READ, [request], timeout=self._config.chunk_timeout
            )
        except KVConnectError as exc:
            self._slots.give(slot)
            log.info("chunk %d from %s: %s", chunk.index, record.segment, exc)
            return Failure.UNREACHABLE, 0
        (status,) = batch.wait()
        if status is TransferStatus.PENDING:  # may still land: the slot waits for it
            batch.add_settled_callback(lambda: self._slots.give(slot))
            return Failure.UNREACHABLE, 0
        try:
            if status is not TransferStatus.COMPLETED:
                log.info("chunk %d from %s: %s", chunk.index, record.segment, status.value)
                return Failure.UNREACHABLE, 0
            data = self._staging.view[offset : offset + chunk.length]
            if digest(data) != self._manifest.digests[chunk.index]:
                log.warning(
                    "chunk %d from %s does not match its digest: that holder is skipped",
                    chunk.index,
                    record.segment,
                )
                return Failure.CORRUPT, 0
            self._destination.store(chunk, data)
            return None, chunk.length
        finally:
            self._slots.give(slot)
