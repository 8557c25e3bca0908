"""Moves of objects between tiers at the master. Pure: no I/O, no clock.

A *demotion* copies an object DRAM evicts into a disk segment of the same store server instead
of dropping it; a *promotion* copies a disk-only object read again soon back into that server's
DRAM. The master allocates the target, journals a move ``Change`` on the target's mount, and
the server reports the outcome (done, failed) in a later heartbeat. Meanwhile a demotion's DRAM
source stays readable, its space counted in transit.

An object that goes while it moves (removed, evicted, lost, written again) *cancels* its move:
the target space — and a demotion's source space — stay reserved until the outcome, because
the server may still be copying; then they go back through the journals. A lost segment ends
the moves into it and cancels those out of it. There is no master-side timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.store.config import MasterConfig
from kvconnect.store.master.objects import Move, MoveKind, ObjectTable, Replica
from kvconnect.store.master.segments import Segment, SegmentTable
from kvconnect.store.messages import Moved, Tier


@dataclass(slots=True)
class TierCounters:
    """Event counts of one tier (see :class:`~kvconnect.store.messages.TierStats`)."""

    hits: int = 0
    demotions: int = 0
    demotions_failed: int = 0
    promotions: int = 0
    evictions: int = 0
    lost: int = 0


class Mover:
    """Starts moves and applies their outcomes to the master's object and segment tables
    (shared with :class:`~kvconnect.store.master.state.MasterState`, which calls it)."""

    def __init__(
        self,
        config: MasterConfig,
        objects: ObjectTable,
        segments: SegmentTable,
        counters: list[TierCounters],
    ) -> None:
        self.config = config
        self.objects = objects
        self.segments = segments
        self.counters = counters  # by tier value

    def release_replicas(self, slot: int, replicas: list[Replica]) -> None:
        """Drop some (not all) replicas of a complete object; their space waits out its
        lease."""
        objects = self.objects
        for replica in replicas:
            self.release(slot, replica)
        objects.set_replicas(slot, [r for r in objects.replicas(slot) if r not in replicas])

    def release(self, slot: int, replica: Replica) -> None:
        """Release one replica of a complete object through its segment's journal (reused
        after the lease). The source of the object's move cancels the move; a demotion's
        source is only forgotten now, its space released at the move's outcome."""
        objects = self.objects
        move = objects.moving.get(slot)
        if move is not None and move.source == replica:
            objects.cancel_move(slot)
            if move.holds_source:
                self._detach_source(move, objects.lease[slot])
                return
        size = objects.size[slot]
        self.segments.release(*replica, size, committed=True, until=objects.lease[slot])

    def demote(self, slot: int, dram: list[Replica]) -> bool:
        """Start moving an object from DRAM (its live replicas ``dram``, all of them) to a
        disk segment of the server of the first one, if one has room and its demotions in
        flight allow; other DRAM copies go at once. False (nothing changed) if none can."""
        objects = self.objects
        source = dram[0]
        from_segment = self.segments.all[source.segment]
        size = objects.size[slot]
        limit = self.config.demotion_inflight
        disks = self.segments.of_server(from_segment.server, Tier.DISK)
        disks.sort(key=lambda d: d.allocator.free_bytes, reverse=True)
        for disk in disks:
            offset = disk.allocator.allocate(size) if disk.demoting < limit else None
            if offset is not None:
                break
        else:
            return False
        key = objects.index.key(slot)
        assert key is not None
        disk.demoting += disk.allocator.length(size)
        disk.move(key, offset, size, from_segment.spec.region, source.offset)
        if len(dram) > 1:
            self.release_replicas(slot, dram[1:])
        from_segment.hold(size)  # its bytes are on their way out of DRAM
        target = Replica(disk.index, offset)
        objects.start_move(
            Move(MoveKind.DEMOTE, key, slot, size, source, target, holds_source=True)
        )
        return True

    def promote(self, slot: int, source: Replica) -> None:
        """Start copying a disk-only object back into a DRAM segment of its server, if one has
        room below the high watermark (nothing is evicted for a promotion)."""
        objects = self.objects
        if slot in objects.moving:
            return
        from_segment = self.segments.all[source.segment]
        size = objects.size[slot]
        high = self.config.high_watermark
        for dram in self.segments.of_server(from_segment.server, Tier.DRAM):
            room = dram.used + dram.allocator.length(size) <= high * dram.allocator.capacity
            offset = dram.allocator.allocate(size) if room else None
            if offset is not None:
                break
        else:
            return
        key = objects.index.key(slot)
        assert key is not None
        dram.move(key, offset, size, from_segment.spec.region, source.offset)
        objects.start_move(
            Move(MoveKind.PROMOTE, key, slot, size, source, Replica(dram.index, offset))
        )

    def done(self, segment: Segment, moved: Moved) -> None:
        """The server of ``segment`` completed the move of ``moved`` into it: the object gets
        its replica there (a cancelled move's space goes back)."""
        objects = self.objects
        move = objects.end_move(Replica(segment.index, moved.offset), moved.key)
        if move is None:
            return
        self._moved(move)
        if move.cancelled:
            self._release_target(move)
            return
        slot, size = move.slot, move.size
        segment.objects += 1
        if move.kind is MoveKind.PROMOTE:
            objects.set_replicas(slot, [move.target, *objects.replicas(slot)])
            segment.commit(moved.key, moved.offset, size)
            self.counters[Tier.DRAM].promotions += 1
            return
        # A demotion: the disk copy replaces the DRAM one (whose reads are under lease).
        rest = [r for r in objects.replicas(slot) if r != move.source]
        self.segments.release(*move.source, size, committed=True, until=objects.lease[slot])
        objects.set_replicas(slot, self.segments.dram_first([*rest, move.target]))
        self.counters[Tier.DISK].demotions += 1

    def failed(self, segment: Segment, moved: Moved) -> int | None:
        """The server of ``segment`` gave up the move of ``moved`` into it: its space goes
        back. Returns the slot of an object whose demotion failed: the caller evicts it, as it
        would have without a disk."""
        move = self.objects.end_move(Replica(segment.index, moved.offset), moved.key)
        if move is None:
            return None
        self._moved(move)
        self._release_target(move)
        if move.kind is not MoveKind.DEMOTE:
            return None
        self.counters[Tier.DISK].demotions_failed += 1
        return None if move.cancelled else move.slot

    def _moved(self, move: Move) -> None:
        """Bookkeeping of a move whose outcome arrived: in-flight bytes, the source's hold."""
        if move.kind is MoveKind.DEMOTE:
            target = self.segments.all[move.target.segment]
            target.demoting -= target.allocator.length(move.size)
        self._let_go(move)

    def _release_target(self, move: Move) -> None:
        """Give back the target space of a move that did not add a replica. A disk server may
        hold it (a cancelled move it completed): released through the journal. In DRAM it
        holds nothing until the master commits it: free at once."""
        target = self.segments.all[move.target.segment]
        if target.tier is Tier.DISK:
            target.journal_release(move.target.offset, move.size, 0.0)
        else:
            target.allocator.free(move.target.offset, move.size)

    def _detach_source(self, move: Move, lease: float) -> None:
        """The object of a demotion under way goes: its server forgets the DRAM copy now, but
        the space stays held until the move's outcome (the server may still be copying it)."""
        source = self.segments.all[move.source.segment]
        source.objects -= 1
        if source.alive:
            source.forget(move.source.offset)
        move.until = lease

    def _let_go(self, move: Move) -> None:
        """The move no longer needs its DRAM source held; a detached one is released now."""
        if not move.holds_source:
            return
        move.holds_source = False
        source = self.segments.all[move.source.segment]
        source.unhold(move.size)
        if move.cancelled and source.alive:
            source.journal_release(move.source.offset, move.size, move.until)

    def drop(self, index: int) -> None:
        """Segment ``index`` is gone: moves into it end (their objects keep their replicas),
        moves out of it are cancelled (their target space waits for their outcome)."""
        objects = self.objects
        for move in list(objects.moves.values()):
            if move.target.segment == index:
                del objects.moves[move.target]
                if not move.cancelled:
                    del objects.moving[move.slot]
                self._let_go(move)
            elif move.source.segment == index:
                if not move.cancelled:
                    objects.cancel_move(move.slot)
                self._let_go(move)
