"""Per-segment space allocator of the store master: hands out byte ranges, never touches bytes.

``OffsetAllocator`` manages one segment of ``capacity`` bytes. It is pure bookkeeping (no threads,
no I/O); the master calls it under its own lock, so it is not thread-safe by itself.

Structure (a TLSF-like segregated fit):

- Free blocks are kept in ``_free_by_start`` {offset: size} and ``_free_by_end`` {end: offset}, so
  the neighbours of a freed range are found in O(1) and merged (coalescing): two free blocks are
  never adjacent.
- Each free block also sits in one *size class*. The class index is a tiny float: the bit length
  of the size gives the exponent, the next ``_SL_BITS`` bits a linear subdivision of that power of
  two. An int bitmap has bit ``c`` set iff class ``c`` holds a free block, so the first class that
  can hold a request is found with a shift and a lowest-set-bit, not a scan.
- Each class is a max-heap of its blocks (one int per entry, see ``_pack``) with lazy deletion:
  removing a specific block (a neighbour being merged) only drops it from the dicts; stale heap
  entries are discarded when they reach the top, and a heap is rebuilt when stale entries
  outnumber live ones. The heap top is the largest block of the class, which makes the search
  exact: a request that fits in some free block is never refused.

Complexity, with n free blocks: ``allocate`` and ``free`` are O(log n) amortized (a heap push;
pops of stale entries and rebuilds are paid for by the pushes and removals that made them);
``largest_free`` is O(1) amortized; class lookup is O(1) bit arithmetic on a bitmap of about
8 bits per power of two of ``capacity`` (some 330 bits for 1 TiB). No operation iterates over
the free blocks. Memory: nothing per live allocation (the caller remembers sizes), two dict
entries and about one heap int per free block (free blocks never outnumber allocations by more
than one).
"""

from __future__ import annotations

import heapq

from kvconnect.errors import ConfigError

# Linear subdivisions per power of two: 2**3 = 8 classes, so a block in the class just above a
# request's class wastes at most ~1/8 of itself more than the tightest fit would.
_SL_BITS = 3


def _size_class(size: int) -> int:
    """Class index of ``size`` bytes: monotonic in size, exact (one class per size) below 16."""
    shift = max(size.bit_length() - 1 - _SL_BITS, 0)
    return (shift << _SL_BITS) + (size >> shift)


class OffsetAllocator:
    """Allocates aligned byte ranges of one segment; see the module docstring for the structure.

    Offsets returned by ``allocate`` are multiples of ``alignment``; each allocation reserves its
    size rounded up to ``alignment``. A ``capacity`` that is not a multiple of ``alignment`` leaves
    an unusable tail, which still counts as free bytes.
    """

    __slots__ = (
        "_alignment",
        "_allocations",
        "_bitmap",
        "_capacity",
        "_counts",
        "_free_by_end",
        "_free_by_start",
        "_heaps",
        "_offset_bits",
        "_offset_mask",
        "_used",
    )

    def __init__(self, capacity: int, alignment: int = 64, *, empty: bool = True) -> None:
        """Raise ``ConfigError`` unless ``capacity >= 1`` and ``alignment`` is a power of two.

        ``empty=False`` starts with every byte in use and no allocation: recovery then adopts
        the objects a segment reports (:meth:`adopt`) and frees the gaps (:meth:`release_span`).
        """
        if capacity < 1:
            raise ConfigError(f"capacity must be at least 1 byte, got {capacity}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment}")
        self._capacity = capacity
        self._alignment = alignment
        self._used = 0
        self._allocations = 0
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        classes = _size_class(capacity) + 1
        self._heaps: list[list[int]] = [[] for _ in range(classes)]
        self._counts = [0] * classes
        self._bitmap = 0
        self._offset_bits = capacity.bit_length()
        self._offset_mask = (1 << self._offset_bits) - 1
        if empty:
            self._insert_free(0, capacity)
        else:
            self._used = capacity

    @property
    def capacity(self) -> int:
        """Size of the segment in bytes."""
        return self._capacity

    @property
    def used(self) -> int:
        """Bytes reserved by live allocations (each rounded up to the alignment)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not reserved: ``capacity - used``, possibly fragmented."""
        return self._capacity - self._used

    @property
    def allocations(self) -> int:
        """Number of live allocations."""
        return self._allocations

    def length(self, size: int) -> int:
        """Bytes an allocation of ``size`` reserves (``size`` rounded up to the alignment)."""
        return -(-size // self._alignment) * self._alignment

    def largest_free(self) -> int:
        """Size of the largest free block (0 when full); O(1) amortized."""
        if not self._bitmap:
            return 0
        top = self._bitmap.bit_length() - 1
        return self._top(top)[1]

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes (rounded up to the alignment) and return the aligned offset.

        Returns None when no single free block can hold the rounded size; never raises for
        exhaustion or fragmentation. Raises ``ConfigError`` if ``size < 1``.
        """
        if size < 1:
            raise ConfigError(f"allocation size must be at least 1 byte, got {size}")
        length = -(-size // self._alignment) * self._alignment
        block = self._find(length)
        if block is None:
            return None
        offset, block_size = block
        self._remove_free(offset, block_size)
        if block_size > length:
            self._insert_free(offset + length, block_size - length)
        self._allocations += 1
        self._used += length
        return offset

    def allocate_run(self, sizes: list[int]) -> list[int] | None:
        """Reserve consecutive ranges for ``sizes`` (each rounded up) as one block; their
        offsets, or None when no single free block holds them all. Each range is freed on its
        own later, like any allocation: one search for a whole batch of pages."""
        alignment = self._alignment
        lengths = [-(-size // alignment) * alignment for size in sizes]
        if not lengths or min(sizes) < 1:
            raise ConfigError("allocate_run needs sizes of at least 1 byte")
        start = self.allocate(sum(lengths))
        if start is None:
            return None
        self._allocations += len(lengths) - 1
        offsets = []
        for length in lengths:
            offsets.append(start)
            start += length
        return offsets

    def free(self, offset: int, size: int) -> int:
        """Release ``size`` bytes at ``offset`` (as allocated); return the rounded length.

        The caller owns the record of what it allocated (the master keeps each object's size
        anyway: no per-allocation table here, which saves ~100 bytes per object at millions of
        objects). Frees that are certainly wrong — size < 1, a range not aligned or beyond the
        segment, or one that starts at a free block or ends where one ends (e.g. a double free
        without coalescing) — raise ``KeyError``; others are the caller's responsibility.
        The range merges with free neighbours.
        """
        length = -(-size // self._alignment) * self._alignment
        end = offset + length
        if (
            size < 1
            or offset % self._alignment
            or end > self._capacity
            or offset in self._free_by_start
            or end in self._free_by_end
        ):
            raise KeyError(f"no allocation of {size} bytes at {offset}")
        self._allocations -= 1
        self._merge_free(offset, end)
        return length

    def adopt(self, offset: int, size: int) -> None:
        """Count an allocation of ``size`` bytes at ``offset`` that lies in space already in
        use (recovery, see ``empty=False``); it is freed like any allocation later. Raises
        ``KeyError`` for a range not aligned or beyond the segment."""
        length = -(-size // self._alignment) * self._alignment
        if size < 1 or offset % self._alignment or offset + length > self._capacity:
            raise KeyError(f"cannot adopt {size} bytes at {offset}")
        self._allocations += 1

    def release_span(self, start: int, end: int) -> None:
        """Return the in-use range [start, end) that no allocation covers (recovery: a gap
        between adopted objects) to the free space."""
        if not 0 <= start < end <= self._capacity or start % self._alignment:
            raise KeyError(f"cannot release [{start}, {end})")
        self._merge_free(start, end)

    def _merge_free(self, start: int, end: int) -> None:
        """Make [start, end) free, merged with free neighbours."""
        self._used -= end - start
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right_size = self._free_by_start.get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        self._insert_free(start, end - start)

    def __repr__(self) -> str:
        return (
            f"OffsetAllocator(capacity={self._capacity}, alignment={self._alignment}, "
            f"used={self._used}, allocations={self._allocations}, "
            f"free_blocks={len(self._free_by_start)}, largest_free={self.largest_free()})"
        )

    # -- internals -------------------------------------------------------------------------

    def _find(self, length: int) -> tuple[int, int] | None:
        """A free block of at least ``length`` bytes, as (offset, size), or None."""
        cls = _size_class(length)
        # The request's own class first: its largest block is the tightest fit we can find in
        # O(1), and it is the only class whose blocks may be smaller than the request.
        if self._bitmap >> cls & 1:
            block = self._top(cls)
            if block[1] >= length:
                return block
        # Every block of a higher class is larger than any size of class ``cls``: take the
        # lowest non-empty one (good fit) and leave larger blocks for larger requests.
        higher = self._bitmap >> (cls + 1)
        if not higher:
            return None
        return self._top(cls + (higher & -higher).bit_length())

    def _top(self, cls: int) -> tuple[int, int]:
        """The largest free block of non-empty class ``cls``, dropping stale heap entries."""
        heap = self._heaps[cls]
        while True:
            offset, size = self._unpack(heap[0])
            if self._free_by_start.get(offset) == size:
                return offset, size
            heapq.heappop(heap)

    def _pack(self, offset: int, size: int) -> int:
        # One negated int per heap entry: heapq is a min-heap, and an int is far smaller and
        # faster to compare than an (size, offset) tuple, which matters at millions of blocks.
        return -((size << self._offset_bits) | offset)

    def _unpack(self, packed: int) -> tuple[int, int]:
        """(offset, size) of a heap entry made by ``_pack``."""
        packed = -packed
        return packed & self._offset_mask, packed >> self._offset_bits

    def _insert_free(self, offset: int, size: int) -> None:
        self._free_by_start[offset] = size
        self._free_by_end[offset + size] = offset
        cls = _size_class(size)
        heapq.heappush(self._heaps[cls], self._pack(offset, size))
        self._counts[cls] += 1
        self._bitmap |= 1 << cls

    def _remove_free(self, offset: int, size: int) -> None:
        """Drop a free block; its heap entry goes stale and is discarded later (lazy delete)."""
        del self._free_by_start[offset]
        del self._free_by_end[offset + size]
        cls = _size_class(size)
        count = self._counts[cls] - 1
        self._counts[cls] = count
        heap = self._heaps[cls]
        if not count:
            self._bitmap &= ~(1 << cls)
            heap.clear()
        elif len(heap) > 2 * count + 16:
            self._rebuild(heap)

    def _rebuild(self, heap: list[int]) -> None:
        # Stale entries outnumber live ones: keep the live ones, once each (a block freed,
        # taken and freed again at the same place leaves duplicate entries). The cost is paid
        # for by the removals that made the entries stale.
        live: set[int] = set()
        for packed in heap:
            offset, size = self._unpack(packed)
            if self._free_by_start.get(offset) == size:
                live.add(packed)
        heap[:] = live
        heapq.heapify(heap)
