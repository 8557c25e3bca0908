"""Which object covers a byte of the data file: objects indexed by the 1 MiB buckets they touch.

A read may start inside an object (a part of a multi-part object, a window of a large read), so
the lookup is by containment, not by start offset. Each bucket keeps the sorted start offsets of
the objects overlapping it; objects never overlap, so the largest start at or before a byte is
the only candidate. Insert and remove cost one small list operation per bucket touched. Pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from kvconnect.store.disk.index import Record

_SHIFT = 20


class Extents:
    """Non-overlapping records by offset, with lookup by any byte they cover."""

    def __init__(self) -> None:
        self._by_offset: dict[int, Record] = {}
        self._buckets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._by_offset)

    def __iter__(self) -> Iterator[Record]:
        """The records, in no particular order."""
        return iter(self._by_offset.values())

    def at(self, offset: int) -> Record | None:
        """The record starting at ``offset``."""
        return self._by_offset.get(offset)

    def add(self, record: Record) -> None:
        """Index ``record``; the caller guarantees it overlaps no indexed record."""
        self._by_offset[record.offset] = record
        for bucket in _buckets(record):
            bisect.insort(self._buckets.setdefault(bucket, []), record.offset)

    def load(self, records: list[Record]) -> None:
        """Index ``records`` (in offset order, non-overlapping) into an empty table, in bulk."""
        assert not self._by_offset
        self._by_offset = {r.offset: r for r in records}
        buckets = self._buckets
        for r in records:  # appends keep each bucket sorted: the records come in offset order
            first, last = r.offset >> _SHIFT, (r.offset + r.size - 1) >> _SHIFT
            if first == last:  # the common case, without building a range
                starts = buckets.get(first)
                if starts is None:
                    buckets[first] = [r.offset]
                else:
                    starts.append(r.offset)
                continue
            for bucket in range(first, last + 1):
                buckets.setdefault(bucket, []).append(r.offset)

    def remove(self, offset: int) -> Record | None:
        """Forget the record starting at ``offset``; returns it (None: there was none)."""
        record = self._by_offset.pop(offset, None)
        if record is None:
            return None
        for bucket in _buckets(record):
            starts = self._buckets[bucket]
            del starts[bisect.bisect_left(starts, offset)]
            if not starts:
                del self._buckets[bucket]
        return record

    def overlapping(self, offset: int, size: int) -> list[Record]:
        """The records sharing a byte with [offset, offset+size)."""
        found: dict[int, Record] = {}
        first = self.covering(offset)
        if first is not None:
            found[first.offset] = first
        for bucket in range(offset >> _SHIFT, ((offset + size - 1) >> _SHIFT) + 1):
            starts = self._buckets.get(bucket, [])
            lo = bisect.bisect_left(starts, offset)
            for start in starts[lo : bisect.bisect_left(starts, offset + size)]:
                found[start] = self._by_offset[start]
        return list(found.values())

    def covering(self, offset: int) -> Record | None:
        """The record whose bytes include ``offset``."""
        starts = self._buckets.get(offset >> _SHIFT)
        if not starts:
            return None
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return None
        record = self._by_offset[starts[i]]
        return record if offset < record.offset + record.size else None


def _buckets(record: Record) -> range:
    return range(record.offset >> _SHIFT, ((record.offset + record.size - 1) >> _SHIFT) + 1)
