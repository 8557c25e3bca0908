"""KV events of the shared pool: which blocks the store holds, for vLLM's KV-events publisher.

The pool tier announces a block (``BlockStored``) once every TP rank's save of it completed,
and withdraws it (``BlockRemoved``) once the store removed, evicted or lost any of its objects.
:class:`PoolEvents` is the bookkeeping (pure, thread-safe): the scheduler side records what a
planned save will store, the workers' completed saves arrive with each step's output, and the
:class:`RemovalPoller` thread feeds what the store master logged as removed. vLLM's scheduler
thread takes the records once per step (``take_events``); the facade turns them into vLLM's
event classes. Memory is bounded: past :data:`TRACKED` blocks the oldest are forgotten (a
forgotten announced block is never withdrawn; a forgotten planned one is announced without its
tokens).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvconnect.errors import KVConnectError
from kvconnect.store.client import StoreClient
from kvconnect.vllm.pool import PoolKeys

log = logging.getLogger(__name__)

TRACKED = 65536
"""Blocks each table of :class:`PoolEvents` keeps (planned, partly saved, announced)."""
_PAGES = 16  # removal-log pages one poll reads at most (a burst is drained over polls)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block the pool now holds whole (every rank's part), as a ``BlockStored`` carries it."""

    block_hash: str  # hex, as in pool keys
    parent: str | None  # the previous block of the prefix (None: the first, or unknown)
    token_ids: tuple[int, ...]  # empty when unknown
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Blocks the pool no longer holds whole."""

    block_hashes: tuple[str, ...]


PoolEvent = StoredBlock | RemovedBlocks
_V = TypeVar("_V")


class _Bounded(collections.OrderedDict[str, _V]):
    """Insertion-ordered, dropping the oldest entry past ``TRACKED``."""

    def put(self, key: str, value: _V) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > TRACKED:
            self.popitem(last=False)


class PoolEvents:
    """Blocks planned, partly saved and announced, and the events not taken yet.

    ``ranks``: the TP ranks that each save a part of every block (a block is stored once
    all have). Any thread may call any method (each holds a short lock)."""

    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._lock = threading.Lock()
        self._planned = _Bounded[StoredBlock]()  # until announced
        self._copies = _Bounded[int]()  # ranks that saved the block so far
        self._announced = _Bounded[bool]()  # until withdrawn
        self._pending: list[PoolEvent] = []

    def planned(self, blocks: Iterable[StoredBlock]) -> None:
        """Saves of these blocks were planned (scheduler thread)."""
        with self._lock:
            for block in blocks:
                self._planned.put(block.block_hash, block)

    def saved(self, hashes: Iterable[str]) -> None:
        """One rank's saves of these blocks completed (each hash once per rank)."""
        with self._lock:
            for block_hash in hashes:
                copies = self._copies.pop(block_hash, 0) + 1
                if copies < self._ranks:
                    self._copies.put(block_hash, copies)
                    continue
                block = self._planned.pop(block_hash, None) or StoredBlock(block_hash, None, ())
                self._announced.put(block_hash, True)
                self._pending.append(block)

    def removed(self, hashes: Iterable[str]) -> None:
        """The store no longer holds (all of) these blocks (the poller's thread)."""
        with self._lock:
            gone = tuple(h for h in dict.fromkeys(hashes) if self._announced.pop(h, False))
            if gone:
                self._pending.append(RemovedBlocks(gone))

    def take(self) -> list[PoolEvent]:
        """The events since the last call, in order (vLLM's scheduler thread, once a step)."""
        with self._lock:
            events, self._pending = self._pending, []
        return events


def stored_blocks(
    hashes: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    saved: Sequence[str],
    lora: tuple[int | None, str | None] = (None, None),
) -> list[StoredBlock]:
    """The :class:`StoredBlock` of each hex hash in ``saved``, which are consecutive blocks of
    the request whose block hashes are ``hashes`` and tokens ``token_ids``."""
    if not saved:
        return []
    hexes = [h.hex() for h in hashes]
    try:
        first = hexes.index(saved[0])
    except ValueError:
        return [StoredBlock(h, None, ()) for h in saved]
    blocks: list[StoredBlock] = []
    for index, block_hash in enumerate(saved, first):
        parent = hexes[index - 1] if index > 0 else None
        tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
        blocks.append(StoredBlock(block_hash, parent, tokens, *lora))
    return blocks


class RemovalPoller:
    """Asks the store master every ``interval`` seconds which pool objects went away, and
    reports their blocks to ``on_removed``. Its own thread; a failed poll is retried at the
    next interval (the master's log keeps the entries)."""

    def __init__(
        self,
        client: StoreClient,
        scheme: Callable[[], PoolKeys | None],
        on_removed: Callable[[list[str]], None],
        interval: float,
    ) -> None:
        self._client = client
        self._scheme = scheme
        self._on_removed = on_removed
        self._interval = interval
        self._epoch: int | None = None
        self._since = 0
        self.missed = 0
        """Log entries lost before this poller read them (it fell behind the ring)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvconnect-vllm-removals", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop polling; waits for a poll in flight (bounded by the client's RPC timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except KVConnectError as exc:
                log.debug("polling the store's removals failed (retrying): %s", exc)
            except Exception:  # a bug must not end the thread: the next poll may work
                log.exception("polling the store's removals failed")

    def poll(self) -> None:
        """One round: reads up to ``_PAGES`` pages of the master's removal log."""
        scheme = self._scheme()
        if scheme is None:
            return  # the workers have not described their KV cache yet
        for _ in range(_PAGES):
            reply = self._client.removals(scheme.prefix, self._since)
            if reply.epoch != self._epoch:  # first contact, or a fresh log
                restarted = self._epoch is not None
                self._epoch = reply.epoch
                if restarted:
                    log.warning("the store master restarted: removals in between are unknown")
                    if self._since:
                        self._since = 0  # read the new log from its start
                        continue
            elif reply.first > self._since + 1:
                self.missed += reply.first - self._since - 1
                log.warning(
                    "missed %d store removals (KV events may announce blocks the store "
                    "no longer holds)",
                    reply.first - self._since - 1,
                )
            blocks = [
                block
                for removal in reply.removed
                if (block := scheme.block_of(removal.key)) is not None
            ]
            if blocks:
                self._on_removed(blocks)
            if reply.next <= self._since:
                return
            self._since = reply.next
