"""Mounted segments and where new objects go. Pure: no I/O, no clock.

Placement strategies (``MasterConfig.allocation``):

- ``local_first`` (default): the writer's own host first, then every other segment in an order
  fixed per writer and different between writers (rendezvous hashing of writer and segment).
  A writer fills its first choice before spilling to the next, so one request's pages land on
  few segments — a node failure loses whole suffixes, not holes in every prefix — while
  different writers start on different segments, which balances load.
- ``random``: a uniformly random segment with room, per object.
- ``free_ratio``: the segment with the largest free fraction.

Replicas always land on distinct segments; fewer than asked is success (best effort).

Each segment keeps a *journal* for its store server: objects committed there and object space
released there, in order, until the server acknowledges them (heartbeats). The server thus
always knows which objects it holds, and reports them to a new master (failover, restart).
Released space becomes allocatable only once acknowledged: were it reused earlier, a server
that missed the release would report the old object over the new object's bytes.

Released space on its way back — awaiting that acknowledgement, the end of a read lease (a
forced removal) or the put quarantine (a discarded put) — is *in transit*: still reserved in
the allocator, but counted apart from the space objects use (:attr:`Segment.used`), because it
returns by itself and nothing should be evicted for it.

Disk segments (``SegmentSpec.tier`` DISK, a file of a store server) are allocated with at least
:data:`DISK_ALIGNMENT` (direct I/O) and only by moves: puts never go there, and their space
is the disk tier's, apart from the DRAM tier's usage and watermarks.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from kvconnect.store.config import Strategy
from kvconnect.store.master.allocator import OffsetAllocator
from kvconnect.store.master.objects import Replica
from kvconnect.store.messages import Change, Changes, SegmentSpec, Tier

_CHANGES_PER_REPLY = 16384  # journal changes sent in one heartbeat reply
DISK_ALIGNMENT = 4096
"""Least alignment of objects in disk segments: the block size direct I/O needs."""


class InTransit(NamedTuple):
    """Released space of a segment waiting for a time before it is reusable (the end of a
    read lease, the put quarantine). Compared as a tuple: ``until`` first, so a heap of them
    yields the earliest due."""

    until: float  # not reusable before (seconds on the master's clock)
    segment: int  # index in SegmentTable.all
    offset: int
    size: int  # the object's size (the allocator rounds it to the alignment)


class _Release(NamedTuple):
    """A committed object's release, journaled but not acknowledged by its server yet."""

    seq: int  # the release's sequence number in the segment's journal
    offset: int
    size: int
    until: float  # not reusable before (a read lease), even once acknowledged


@dataclass(slots=True, eq=False)
class Segment:
    """One mounted block of store-server memory."""

    index: int
    spec: SegmentSpec
    server: str
    mount_id: str
    allocator: OffsetAllocator
    alive: bool = True
    objects: int = 0
    recovering: int | None = None  # while held objects are reported: the end of the last one
    journal: deque[Change] = field(default_factory=deque)  # not yet acknowledged by the server
    journal_base: int = 0  # sequence number of journal[0]
    journal_sent: int = 0  # changes before this one were sent to the server
    releasing: deque[_Release] = field(default_factory=deque)  # oldest first
    in_transit: int = 0  # bytes released but not allocatable yet (see the module docstring)
    demoting: int = 0  # disk: bytes of demotions under way into this segment
    _ranks: dict[str, int] = field(default_factory=dict)

    def rank(self, writer: str) -> int:
        """Rendezvous weight of this segment for ``writer`` (cached)."""
        weight = self._ranks.get(writer)
        if weight is None:
            digest = hashlib.blake2b(f"{writer}\0{self.spec.name}".encode(), digest_size=8)
            weight = self._ranks[writer] = int.from_bytes(digest.digest(), "little")
            if len(self._ranks) > 4096:  # writers come and go; keep the cache bounded
                self._ranks.clear()
        return weight

    @property
    def tier(self) -> Tier:
        return self.spec.tier

    @property
    def used(self) -> int:
        """Bytes of stored objects and pending puts; space in transit is not counted."""
        return self.allocator.used - self.in_transit

    def commit(self, key: str, offset: int, size: int) -> None:
        """Journal an object completed here."""
        self.journal.append(Change(key, offset, size))

    def move(self, key: str, offset: int, size: int, source_region: int, source: int) -> None:
        """Journal a move of the object at (``source_region``, ``source``) of this segment's
        server into ``offset`` here (see :class:`~kvconnect.store.messages.Change`)."""
        self.journal.append(Change(key, offset, size, source_region, source))

    def journal_release(self, offset: int, size: int, until: float) -> None:
        """Journal a committed object's release now — its server forgets the object at the
        next heartbeat, so no later master indexes it again — and keep its space in transit
        until the server acknowledges the release and ``until`` (a read lease) has passed."""
        self.releasing.append(_Release(self.journal_base + len(self.journal), offset, size, until))
        self.hold(size)
        self.journal.append(Change("", offset, size))

    def hold(self, size: int) -> None:
        """Count released space of ``size`` bytes as in transit (until :meth:`reuse`)."""
        self.in_transit += self.allocator.length(size)

    def unhold(self, size: int) -> None:
        """Count space of ``size`` bytes held by :meth:`hold` as used again (a move out of
        this segment ended without releasing it)."""
        self.in_transit -= self.allocator.length(size)

    def reuse(self, offset: int, size: int) -> None:
        """Space in transit at ``offset`` becomes allocatable."""
        self.in_transit -= self.allocator.length(size)
        self.allocator.free(offset, size)

    def forget(self, offset: int) -> None:
        """Journal that the server should drop what it holds at ``offset`` (a reported object
        the master could not adopt); no space changes hands."""
        self.journal.append(Change("", offset, 0))

    def acknowledge(self, applied: int) -> tuple[Changes, list[InTransit]]:
        """The server applied the journal up to sequence ``applied``: drop that part. Returns
        the changes it still lacks (a bounded batch) and the space of the releases it now
        knows; the caller makes that space reusable."""
        # Never past what was sent: a confused server must not make us drop unseen changes.
        count = max(min(applied, self.journal_sent) - self.journal_base, 0)
        for _ in range(count):
            self.journal.popleft()
        self.journal_base += count
        known = []
        while self.releasing and self.releasing[0].seq < self.journal_base:
            release = self.releasing.popleft()
            known.append(InTransit(release.until, self.index, release.offset, release.size))
        pending = list(itertools.islice(self.journal, _CHANGES_PER_REPLY))
        self.journal_sent = max(self.journal_sent, self.journal_base + len(pending))
        return Changes(self.mount_id, self.journal_base, pending), known


class SegmentTable:
    """Every segment ever mounted, by index (indices are never reused: stale object entries
    must not point into a newer mount)."""

    def __init__(self, strategy: Strategy, alignment: int, seed: int | None = None) -> None:
        self.strategy = strategy
        self.alignment = alignment
        self.all: list[Segment] = []
        self.alive = bytearray()  # by segment index: 1 while mounted (the lookup fast path)
        self.disk = bytearray()  # by segment index: 1 for a disk segment
        self.by_name: dict[str, Segment] = {}
        self.by_mount: dict[str, Segment] = {}
        self._by_server: dict[str, list[Segment]] = {}  # live segments of each server
        self._rng = random.Random(seed)
        self._waiting: list[InTransit] = []  # a heap: the earliest due first

    def mount(self, server: str, mount_id: str, spec: SegmentSpec, recovering: bool) -> Segment:
        """Add a live segment (the caller retired any previous mount of the same name).
        ``recovering``: it holds objects, reported next (see :meth:`recover`); nothing is
        allocated there until :meth:`recovered`."""
        disk = spec.tier is Tier.DISK
        alignment = max(self.alignment, DISK_ALIGNMENT) if disk else self.alignment
        segment = Segment(
            index=len(self.all),
            spec=spec,
            server=server,
            mount_id=mount_id,
            allocator=OffsetAllocator(spec.size, alignment, empty=not recovering),
            recovering=0 if recovering else None,
        )
        self.all.append(segment)
        self.alive.append(1)
        self.disk.append(disk)
        self.by_name[spec.name] = segment
        self.by_mount[mount_id] = segment
        self._by_server.setdefault(server, []).append(segment)
        return segment

    def retire(self, segment: Segment) -> None:
        """Stop allocating on and returning replicas of ``segment`` (synchronous invalidation)."""
        segment.alive = False
        self.alive[segment.index] = 0
        if self.by_name.get(segment.spec.name) is segment:
            del self.by_name[segment.spec.name]
        self.by_mount.pop(segment.mount_id, None)
        mounted = self._by_server.get(segment.server, [])
        if segment in mounted:
            mounted.remove(segment)
            if not mounted:
                del self._by_server[segment.server]

    def length(self, size: int) -> int:
        """Bytes an object of ``size`` takes in a DRAM segment (rounded up to the alignment;
        a segment's own is ``segment.allocator.length``)."""
        return -(-size // self.alignment) * self.alignment

    def dram_first(self, replicas: list[Replica]) -> list[Replica]:
        """``replicas`` with the DRAM ones first (stable): an object's primary replica tells
        its best tier."""
        disk = self.disk
        return sorted(replicas, key=lambda r: disk[r.segment])

    def live(self) -> list[Segment]:
        """Mounted segments, by index."""
        return [s for s in self.by_name.values() if s.alive]

    def of_server(self, server: str, tier: Tier) -> list[Segment]:
        """Mounted segments of ``server`` in ``tier`` that are open for allocation."""
        mounted = self._by_server.get(server, ())
        return [s for s in mounted if s.tier is tier and s.recovering is None]

    def adopt(self, segment: Segment, offset: int, size: int) -> bool:
        """Take a reported object's range into a recovering segment's books; False (and
        nothing changes) unless it is aligned, inside the segment and after the previous one."""
        cursor = segment.recovering
        if cursor is None or offset < cursor:
            return False
        try:
            segment.allocator.adopt(offset, size)
        except KeyError:
            return False
        if offset > cursor:
            segment.allocator.release_span(cursor, offset)  # the gap before it was free
        segment.recovering = offset + segment.allocator.length(size)
        segment.objects += 1
        return True

    def recovered(self, segment: Segment) -> None:
        """The report is complete: the rest of the segment is free, allocation may start."""
        cursor = segment.recovering
        if cursor is None:
            return
        if cursor < segment.allocator.capacity:
            segment.allocator.release_span(cursor, segment.allocator.capacity)
        segment.recovering = None

    def capacity(self, tier: Tier = Tier.DRAM) -> tuple[int, int]:
        """(used, capacity) bytes over live segments of ``tier``."""
        used = capacity = 0
        for segment in self.by_name.values():
            if segment.tier is tier:
                used += segment.used
                capacity += segment.allocator.capacity
        return used, capacity

    def order(self, writer: str, host_id: str) -> list[Segment]:
        """Candidate DRAM segments for a writer, in the order the strategy prefers."""
        live = [s for s in self.live() if s.recovering is None and s.tier is Tier.DRAM]
        if self.strategy is Strategy.RANDOM:
            self._rng.shuffle(live)
            return live
        if self.strategy is Strategy.FREE_RATIO:
            return sorted(live, key=_free_ratio, reverse=True)
        return sorted(live, key=lambda s: (s.spec.host_id != host_id, -s.rank(writer)))

    def place(self, order: list[Segment], size: int, replicas: int) -> list[Replica]:
        """Allocate up to ``replicas`` copies on distinct segments; [] if none fits."""
        placed: list[Replica] = []
        for segment in order:
            offset = segment.allocator.allocate(size)
            if offset is None:
                continue
            placed.append(Replica(segment.index, offset))
            segment.objects += 1
            if len(placed) == replicas:
                break
        return placed

    def place_run(self, segments: list[Segment], sizes: list[int]) -> list[list[Replica]] | None:
        """Place a whole batch contiguously, one replica of the run on each of ``segments``
        (all or nothing). Per object its placements, or None."""
        runs: list[tuple[int, list[int]]] = []
        for segment in segments:
            offsets = segment.allocator.allocate_run(sizes)
            if offsets is None:
                for index, taken in runs:
                    for offset, size in zip(taken, sizes, strict=True):
                        self.release(index, offset, size, committed=False)
                return None
            segment.objects += len(sizes)
            runs.append((segment.index, offsets))
        return [[Replica(index, offsets[n]) for index, offsets in runs] for n in range(len(sizes))]

    def release(
        self, segment_index: int, offset: int, size: int, committed: bool, until: float = 0.0
    ) -> None:
        """Give one replica's space back. A committed object's release goes through the
        journal (reusable once acknowledged and after ``until``); the space of an object that
        never completed (its server never heard of it) is reusable after ``until``, or at once
        for 0."""
        segment = self.all[segment_index]
        segment.objects -= 1
        if not segment.alive:
            return
        if committed:
            segment.journal_release(offset, size, until)
        elif until > 0:
            segment.hold(size)
            heapq.heappush(self._waiting, InTransit(until, segment_index, offset, size))
        else:
            segment.allocator.free(offset, size)

    def acknowledge(self, segment: Segment, applied: int, now: float) -> Changes:
        """:meth:`Segment.acknowledge`, making acknowledged space reusable (at once, or when
        its lease ends); returns the changes the server still lacks."""
        changes, known = segment.acknowledge(applied)
        for space in known:
            if space.until <= now:
                segment.reuse(space.offset, space.size)
            else:
                heapq.heappush(self._waiting, space)
        return changes

    def reuse_due(self, now: float) -> None:
        """Make space in transit reusable whose time has come (leases ended, quarantines)."""
        while self._waiting and self._waiting[0].until <= now:
            space = heapq.heappop(self._waiting)
            segment = self.all[space.segment]
            if segment.alive:
                segment.reuse(space.offset, space.size)

    def returning(self, length: int) -> bool:
        """Whether space in transit, once back, gives some DRAM segment ``length`` free
        bytes."""
        return any(
            s.in_transit and s.allocator.free_bytes + s.in_transit >= length
            for s in self.by_name.values()
            if s.recovering is None and s.tier is Tier.DRAM
        )


def _free_ratio(segment: Segment) -> float:
    allocator = segment.allocator
    return allocator.free_bytes / allocator.capacity if allocator.capacity else 0.0
