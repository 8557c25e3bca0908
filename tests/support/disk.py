"""Driving a DiskTier from tests: moves of deterministic bytes, outcomes collected over time."""

from __future__ import annotations

import random
from pathlib import Path

from kvconnect.store.disk.tier import DiskOutcomes, DiskTier
from kvconnect.store.messages import Change, Moved
from tests.support.waiting import wait_for

SOURCE_REGION = 7  # any non-zero region id: what makes a Change a move


def payload(key: str, size: int) -> bytes:
    """The bytes of object ``key`` (the same in every process)."""
    return random.Random(key).randbytes(size)


def new_tier(
    path: Path, size: int = 16 << 20, queue: int = 8 << 20, timeout: float = 10.0
) -> DiskTier:
    """A tier on ``path`` (not opened)."""
    return DiskTier(path, size, queue_bytes=queue, timeout=timeout)


def demote(tier: DiskTier, key: str, offset: int, size: int) -> bool:
    """Apply the move of ``payload(key, size)`` to ``offset``, from a DRAM copy of its own."""
    data = b"\0" * 100 + payload(key, size)
    return tier.apply(Change(key, offset, size, SOURCE_REGION, 100), memoryview(data))


def release(tier: DiskTier, offset: int) -> bool:
    """Apply the release of ``offset``."""
    return tier.apply(Change("", offset, 0), memoryview(b""))


def read(tier: DiskTier, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` through the tier's FileSource."""
    view = memoryview(bytearray(size))
    tier.source.read_into(offset, view)
    return bytes(view)


class Collected:
    """Every outcome of one tier so far."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.all = DiskOutcomes([], [], [], [], [])

    def pull(self) -> DiskOutcomes:
        """Take the tier's new outcomes into ``all``; returns ``all``."""
        for mine, new in zip(self.all, self.tier.take_outcomes(), strict=True):
            mine.extend(new)
        return self.all

    def settled(self, moves: list[Moved]) -> bool:
        """Every one of ``moves`` (disk mount) is done or failed."""
        out = self.pull()
        return set(moves) <= set(out.demoted) | set(out.demote_failed)

    def wait_demoted(self, moves: list[Moved]) -> None:
        """Wait until every one of ``moves`` is done (failing the test if one failed)."""
        wait_for(lambda: self.settled(moves), f"moves not settled: {moves}")
        assert not set(moves) & set(self.all.demote_failed), self.all.demote_failed
