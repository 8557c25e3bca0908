"""The master's object table, stored by column to stay small at millions of keys.

A key maps to a *slot* through the key index (:mod:`kvconnect.store.master.keys`: the C
table holds the key's bytes and an 8-byte bucket, no Python object); per-slot facts live in
typed arrays (8-byte size and offset, 4-byte segment, 1-byte state, 8-byte lease deadline,
4-byte last access and pin deadline, 2-byte tenant), ~43 bytes; the bytes and objects of each
tenant are kept as slots come and go, and its bytes on disk as primaries change tier. Rare
facts live in side tables: extra replicas (``replicas > 1``), pending multi-part puts, and
moves between tiers under way (by target and by slot). Pure data, no I/O, no clock.
"""

from __future__ import annotations

import enum
from array import array
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvconnect.store.master.keys import new_key_table
from kvconnect.transfer.config import NativeMode


class State(enum.IntEnum):
    """Slot state."""

    FREE = 0
    PENDING = 1
    COMPLETE = 2


# Plain ints for the columns: storing an IntEnum member costs a conversion per element.
_FREE = int(State.FREE)
_PENDING = int(State.PENDING)


class Replica(NamedTuple):
    """Where one copy of an object lives."""

    segment: int  # index in SegmentTable.all
    offset: int  # bytes into that segment


class MoveKind(enum.Enum):
    """Which way a move goes."""

    DEMOTE = "demote"  # DRAM → disk: instead of dropping an object DRAM evicts
    PROMOTE = "promote"  # disk → DRAM: a disk-only object read again soon


@dataclass(slots=True, eq=False)
class Move:
    """A copy of object ``key`` (slot ``slot``) from ``source`` into ``target``, space
    allocated at the target, until the target's server reports it done or failed.
    ``cancelled``: the object stopped existing (or its source went) meanwhile; the target space
    stays allocated until that report, then goes back."""

    kind: MoveKind
    key: str
    slot: int
    size: int
    source: Replica
    target: Replica
    cancelled: bool = False
    holds_source: bool = False  # a demotion: the source's space is held (in transit) for it
    until: float = 0.0  # a cancelled demotion: the source's release waits for this lease


@dataclass(slots=True)
class Pending:
    """Bookkeeping of a put that is not complete yet."""

    client: str
    parts: int
    done_mask: int
    deadline: float
    put: int  # the put's identity (Placement.put)


class ObjectTable:
    """key → slot → columns. Times are seconds on the caller's monotonic clock.

    ``index`` maps keys to slots (``native``: which table, see ``MasterConfig.native``);
    slots run from 0 to :attr:`capacity`, freed ones reused.
    """

    def __init__(self, native: NativeMode = NativeMode.AUTO) -> None:
        self.index = new_key_table(native)
        self.size = array("q")
        self.segment = array("i")
        self.offset = array("q")
        self.state = array("b")
        self.lease = array("d")
        self.access = array("f")
        self.pin = array("f")
        self.tenant = array("H")  # kvconnect.store.master.tenants ids (0: none)
        self.tenant_bytes: Counter[int] = Counter()  # by tenant: sizes of its slots
        self.tenant_disk: Counter[int] = Counter()  # of those, slots whose primary is on disk
        self.tenant_objects: Counter[int] = Counter()
        self.disk_segments = bytearray()
        """By segment index, 1 for a disk segment (the segment table's, shared)."""
        self.extra: dict[int, list[Replica]] = {}  # replicas after the primary
        self.pending: dict[int, Pending] = {}
        self.moves: dict[Replica, Move] = {}  # by target (segment index, offset)
        self.moving: dict[int, Move] = {}  # by slot: the one move of a stored object, if any
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.index)

    @property
    def capacity(self) -> int:
        """Slots in the columns, free ones included."""
        return len(self.state)

    def items(self) -> Iterator[tuple[str, int]]:
        """Every (key, slot), by slot: a scan of the whole table."""
        key = self.index.key
        for slot in range(len(self.state)):
            name = key(slot)
            if name is not None:
                yield name, slot

    def add(
        self, key: str, size: int, segment: int, offset: int, pin: float, tenant: int = 0
    ) -> int:
        """A new PENDING slot for ``key`` (which must be absent) of tenant ``tenant``."""
        if self._free:
            slot = self._free.pop()
            self.size[slot] = size
            self.segment[slot] = segment
            self.offset[slot] = offset
            self.state[slot] = _PENDING
            self.lease[slot] = 0.0
            self.access[slot] = 0.0
            self.pin[slot] = pin
            self.tenant[slot] = tenant
        else:
            slot = len(self.state)
            self.size.append(size)
            self.segment.append(segment)
            self.offset.append(offset)
            self.state.append(_PENDING)
            self.lease.append(0.0)
            self.access.append(0.0)
            self.pin.append(pin)
            self.tenant.append(tenant)
        self.index.add(key, slot)
        if tenant:
            self.tenant_bytes[tenant] += size
            self.tenant_objects[tenant] += 1
            if self._on_disk(segment):
                self.tenant_disk[tenant] += size
        return slot

    def add_many(
        self, keys: list[str], sizes: list[int], placed: list[Replica], pin: float, tenant: int = 0
    ) -> list[int]:
        """:meth:`add` for a batch of one tenant (free slots first, then columns extended at
        once)."""
        reuse = min(len(keys), len(self._free))
        head = zip(keys[:reuse], sizes[:reuse], placed[:reuse], strict=True)
        slots = [self.add(key, size, at.segment, at.offset, pin, tenant) for key, size, at in head]
        rest = len(keys) - reuse
        if rest:
            first = len(self.state)
            new = range(first, first + rest)
            self.size.extend(sizes[reuse:])
            self.segment.extend([where.segment for where in placed[reuse:]])
            self.offset.extend([where.offset for where in placed[reuse:]])
            self.state.frombytes(bytes((_PENDING,)) * rest)
            self.lease.extend(array("d", (0.0,)) * rest)
            self.access.extend(array("f", (0.0,)) * rest)
            self.pin.extend(array("f", (pin,)) * rest)
            self.tenant.extend(array("H", (tenant,)) * rest)
            if tenant:
                self.tenant_bytes[tenant] += sum(sizes[reuse:])
                self.tenant_objects[tenant] += rest
                for size, where in zip(sizes[reuse:], placed[reuse:], strict=True):
                    if self._on_disk(where.segment):
                        self.tenant_disk[tenant] += size
            add = self.index.add
            for key, slot in zip(keys[reuse:], new, strict=True):
                add(key, slot)
            slots.extend(new)
        return slots

    def drop(self, slot: int) -> None:
        """Forget a slot (its key becomes absent); the caller freed its space."""
        self.index.remove(slot)
        tenant = self.tenant[slot]
        if tenant:
            self.tenant_bytes[tenant] -= self.size[slot]
            self.tenant_objects[tenant] -= 1
            if self._on_disk(self.segment[slot]):
                self.tenant_disk[tenant] -= self.size[slot]
        self.state[slot] = _FREE
        self.extra.pop(slot, None)
        self.pending.pop(slot, None)
        self._free.append(slot)

    def replicas(self, slot: int) -> list[Replica]:
        """Every replica, primary first."""
        first = Replica(self.segment[slot], self.offset[slot])
        more = self.extra.get(slot)
        return [first, *more] if more else [first]

    def set_replicas(self, slot: int, replicas: list[Replica]) -> None:
        """Replace the replica list (non-empty)."""
        tenant = self.tenant[slot]
        if tenant:
            moved = self._on_disk(replicas[0].segment) - self._on_disk(self.segment[slot])
            self.tenant_disk[tenant] += moved * self.size[slot]
        self.segment[slot], self.offset[slot] = replicas[0]
        if len(replicas) > 1:
            self.extra[slot] = replicas[1:]
        else:
            self.extra.pop(slot, None)

    def tenant_memory(self, tenant: int) -> int:
        """Bytes of ``tenant``'s slots whose primary replica is in memory."""
        return self.tenant_bytes[tenant] - self.tenant_disk[tenant]

    def _on_disk(self, segment: int) -> int:
        disk = self.disk_segments
        return disk[segment] if segment < len(disk) else 0

    def start_move(self, move: Move) -> None:
        """Record a move under way (its slot has none)."""
        self.moves[move.target] = move
        self.moving[move.slot] = move

    def cancel_move(self, slot: int) -> Move | None:
        """Detach the move of ``slot`` from it (the object goes, or its source did); the move
        stays known by its target until its outcome arrives. Returns it, or None."""
        move = self.moving.pop(slot, None)
        if move is not None:
            move.cancelled = True
        return move

    def end_move(self, target: Replica, key: str) -> Move | None:
        """Forget the move into ``target`` of ``key`` (its outcome arrived); None if there is
        none (a repeated or stray report)."""
        move = self.moves.get(target)
        if move is None or move.key != key:
            return None
        del self.moves[target]
        if not move.cancelled:
            del self.moving[move.slot]
        return move

    @contextmanager
    def columns(self) -> Iterator[dict[str, np.ndarray]]:
        """Zero-copy numpy views of the columns, valid only inside the block.

        (A view pins the arrays' buffers: nothing may be added while it is open.)
        """
        views: dict[str, np.ndarray] = {
            "segment": np.frombuffer(self.segment, dtype=np.int32),
            "state": np.frombuffer(self.state, dtype=np.int8),
            "lease": np.frombuffer(self.lease, dtype=np.float64),
            "access": np.frombuffer(self.access, dtype=np.float32),
            "pin": np.frombuffer(self.pin, dtype=np.float32),
            "size": np.frombuffer(self.size, dtype=np.int64),
            "tenant": np.frombuffer(self.tenant, dtype=np.uint16),
        }
        try:
            yield views
        finally:
            views.clear()
