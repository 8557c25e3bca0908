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
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Literal

from kvconnect.store.master.allocator import OffsetAllocator
from kvconnect.store.messages import SegmentSpec

Strategy = Literal["local_first", "random", "free_ratio"]


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


class SegmentTable:
    """Every segment ever mounted, by index (indices are never reused: stale object entries
    must not point into a newer mount)."""

    def __init__(self, strategy: Strategy, alignment: int, seed: int | None = None) -> None:
        self.strategy = strategy
        self.alignment = alignment
        self.all: list[Segment] = []
        self.alive = bytearray()  # by segment index: 1 while mounted (the lookup fast path)
        self.by_name: dict[str, Segment] = {}
        self.by_mount: dict[str, Segment] = {}
        self._rng = random.Random(seed)

    def mount(self, server: str, mount_id: str, spec: SegmentSpec) -> Segment:
        """Add a live segment (the caller retired any previous mount of the same name)."""
        segment = Segment(
            index=len(self.all),
            spec=spec,
            server=server,
            mount_id=mount_id,
            allocator=OffsetAllocator(spec.size, self.alignment),
        )
        self.all.append(segment)
        self.alive.append(1)
        self.by_name[spec.name] = segment
        self.by_mount[mount_id] = segment
        return segment

    def retire(self, segment: Segment) -> None:
        """Stop allocating on and returning replicas of ``segment`` (synchronous invalidation)."""
        segment.alive = False
        self.alive[segment.index] = 0
        if self.by_name.get(segment.spec.name) is segment:
            del self.by_name[segment.spec.name]
        self.by_mount.pop(segment.mount_id, None)

    def live(self) -> list[Segment]:
        """Mounted segments, by index."""
        return [s for s in self.by_name.values() if s.alive]

    def capacity(self) -> tuple[int, int]:
        """(used, capacity) bytes over live segments."""
        used = capacity = 0
        for segment in self.by_name.values():
            used += segment.allocator.used
            capacity += segment.allocator.capacity
        return used, capacity

    def order(self, writer: str, host_id: str) -> list[Segment]:
        """Candidate segments for a writer, in the order the strategy prefers."""
        live = self.live()
        if self.strategy == "random":
            self._rng.shuffle(live)
            return live
        if self.strategy == "free_ratio":
            return sorted(live, key=_free_ratio, reverse=True)
        return sorted(live, key=lambda s: (s.spec.host_id != host_id, -s.rank(writer)))

    def place(self, order: list[Segment], size: int, replicas: int) -> list[tuple[int, int]]:
        """Allocate up to ``replicas`` copies on distinct segments; [] if none fits."""
        placed: list[tuple[int, int]] = []
        for segment in order:
            offset = segment.allocator.allocate(size)
            if offset is None:
                continue
            placed.append((segment.index, offset))
            segment.objects += 1
            if len(placed) == replicas:
                break
        return placed

    def place_run(
        self, segments: list[Segment], sizes: list[int]
    ) -> list[list[tuple[int, int]]] | None:
        """Place a whole batch contiguously, one replica of the run on each of ``segments``
        (all or nothing). Per object its placements, or None."""
        runs: list[tuple[int, list[int]]] = []
        for segment in segments:
            offsets = segment.allocator.allocate_run(sizes)
            if offsets is None:
                for index, taken in runs:
                    for offset, size in zip(taken, sizes, strict=True):
                        self.release(index, offset, size)
                return None
            segment.objects += len(sizes)
            runs.append((segment.index, offsets))
        return [[(index, offsets[n]) for index, offsets in runs] for n in range(len(sizes))]

    def release(self, segment_index: int, offset: int, size: int) -> int:
        """Free one replica's space; returns the bytes released (0 on a retired segment)."""
        segment = self.all[segment_index]
        segment.objects -= 1
        if not segment.alive:
            return 0
        return segment.allocator.free(offset, size)


def _free_ratio(segment: Segment) -> float:
    allocator = segment.allocator
    return allocator.free_bytes / allocator.capacity if allocator.capacity else 0.0
