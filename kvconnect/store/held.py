"""What a store server holds, followed from the master's journal of its segment. Pure: no I/O.

The master journals every object committed in a segment and every release of one (see
kvconnect/store/master/segments.py); the server applies the journal in order and acknowledges
how far it got. After a master restart or failover it reports :meth:`HeldObjects.report` to the
new master, which indexes those objects again.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kvconnect.store.messages import Change, Changes

log = logging.getLogger(__name__)


class Held(NamedTuple):
    """Where a held object lies in its segment."""

    offset: int
    size: int


class HeldObjects:
    """key → where in one segment, and how many journal changes were applied."""

    def __init__(self) -> None:
        self._by_key: dict[str, Held] = {}
        self._by_offset: dict[int, str] = {}
        self.applied = 0
        """Journal changes of the current mount applied so far (the acknowledgement)."""

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Held | None:
        """Where a held object lies (None: not held)."""
        return self._by_key.get(key)

    def new_mount(self) -> None:
        """A new mount's journal starts at 0; what is held stays."""
        self.applied = 0

    def apply(self, changes: Changes) -> list[Change]:
        """Apply the changes not applied yet (a reply may repeat some we applied). Returns the
        new *moves* among them (``source_region`` set: load an object from a disk tier into
        this segment), which are not held until the master commits them after the load."""
        skip = self.applied - changes.first
        if skip < 0:  # cannot happen: the master keeps every change until acknowledged
            log.error("journal gap: applied %d, master sent from %d", self.applied, changes.first)
            return []
        moves = []
        for change in changes.changes[skip:]:
            if change.source_region:
                moves.append(change)
            else:
                self._apply(change)
        self.applied = max(self.applied, changes.first + len(changes.changes))
        return moves

    def report(self) -> list[Change]:
        """Every held object, in offset order (how the master adopts them)."""
        ordered = sorted(self._by_offset.items())
        return [Change(key, offset, self._by_key[key].size) for offset, key in ordered]

    def _apply(self, change: Change) -> None:
        # Whatever was at this offset is gone: released, or overwritten by the new object.
        key = self._by_offset.pop(change.offset, None)
        if key is not None:
            del self._by_key[key]
        if not change.key:
            return
        previous = self._by_key.pop(change.key, None)
        if previous is not None:
            del self._by_offset[previous.offset]
        self._by_key[change.key] = Held(change.offset, change.size)
        self._by_offset[change.offset] = change.key
