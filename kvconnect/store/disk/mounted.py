"""A store server's disk tier as a mount at the master: its segment, journal and reports.

The master allocates disk space as it does memory and tells the server, through the disk
segment's journal, which objects to write there (moves from memory) and which to forget. The
server applies that journal in order through :class:`~kvconnect.store.disk.tier.DiskTier`,
which may refuse a change while a disk operation on its space is in flight: the server then
acknowledges only the changes before it, so the master never reuses space a late write could
still reach. Outcomes (moves done or failed, objects lost to checksum or read errors) go back
with the heartbeats, and are sent again until a heartbeat that carried them was answered.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from kvconnect.store import messages as m
from kvconnect.store.disk.tier import DiskOutcomes, DiskTier
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion


class MountedDisk:
    """One disk tier, its file region in the engine and its mount at the master."""

    def __init__(self, tier: DiskTier, name: str, path: Path, recovered: list[m.Change]) -> None:
        """``recovered``: what ``tier.open()`` found, reported by the first mount (listing a
        million objects again would cost a second at start-up)."""
        self.tier = tier
        self.name = name
        """The disk segment's name at the master: stable across restarts of the server."""
        self.path = path
        self.region: MemoryRegion | None = None
        self.mount_id = uuid.uuid4().hex
        self.applied = 0
        self.mounted = False
        self._unsent: list[m.TierReport] = []
        self._sending: list[m.TierReport] = []
        self._recovered: list[m.Change] | None = recovered

    def publish(self, engine: TransferEngine) -> None:
        """Serve the tier's bytes through the engine (reads only)."""
        self.region = engine.register_source(self.tier.source, self.tier.size)

    def spec(self, engine: TransferEngine) -> m.SegmentSpec:
        """What this disk mounts at the master."""
        assert self.region is not None
        return m.SegmentSpec(
            name=self.name,
            engine_segment=engine.name,
            region=self.region.id,
            size=self.tier.size,
            host_id=engine.segment.host_id,
            tier=m.Tier.DISK,
        )

    def held(self) -> list[m.Change]:
        """What a mount of this disk reports: what it holds, in offset order."""
        if self._recovered is not None:  # nothing moved in yet: the first mount
            held, self._recovered = self._recovered, None
            return held
        return self.tier.held()

    def fence(self, engine: TransferEngine) -> MemoryRegion:
        """A new mount: the region under a new id (reads the old master arranged fail), a new
        mount id, a journal from 0, and no reports for the old mount. Returns the old region."""
        assert self.region is not None
        old, self.region = self.region, engine.fence(self.region)
        self.mount_id = uuid.uuid4().hex
        self.applied = 0
        self.mounted = False
        self._unsent.clear()
        self._sending.clear()
        return old

    def apply(self, changes: m.Changes, dram: memoryview) -> None:
        """Apply the journal changes not applied yet, in order, stopping at the first the tier
        cannot apply now (retried with the next heartbeat's reply)."""
        skip = self.applied - changes.first
        if skip < 0:
            return  # cannot happen: the master keeps every change until acknowledged
        for change in changes.changes[skip:]:
            if not self.tier.apply(change, dram):
                break
            self.applied += 1

    def collect(self, dram_mount: str, outcomes: DiskOutcomes) -> None:
        """Queue the tier's outcomes as reports: its own (moves in, losses) and the memory
        mount's (loads for promotions)."""
        if outcomes.demoted or outcomes.demote_failed or outcomes.lost:
            self._unsent.append(
                m.TierReport(self.mount_id, outcomes.demoted, outcomes.demote_failed, outcomes.lost)
            )
        if outcomes.loaded or outcomes.load_failed:
            self._unsent.append(m.TierReport(dram_mount, outcomes.loaded, outcomes.load_failed))

    def reports(self) -> list[m.TierReport]:
        """Reports to send with the next heartbeat (those of an unanswered one included)."""
        self._sending.extend(self._unsent)
        self._unsent.clear()
        return list(self._sending)

    def delivered(self) -> None:
        """The heartbeat carrying :meth:`reports` was answered."""
        self._sending.clear()
