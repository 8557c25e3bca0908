from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvconnect.errors import ConfigError
from kvconnect.store.master.allocator import OffsetAllocator

TIB = 1 << 40


def round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def gaps(live: dict[int, int], capacity: int) -> list[tuple[int, int]]:
    """Free ranges (start, size) of the reference model, computed by brute force."""
    result = []
    cursor = 0
    for offset in sorted(live):
        if offset > cursor:
            result.append((cursor, offset - cursor))
        cursor = offset + live[offset]
    if cursor < capacity:
        result.append((cursor, capacity - cursor))
    return result


def test_offsets_are_aligned_and_lengths_rounded() -> None:
    alloc = OffsetAllocator(1 << 20, alignment=64)
    offsets = [alloc.allocate(size) for size in (1, 63, 64, 65, 100, 4096)]
    assert all(o is not None and o % 64 == 0 for o in offsets)
    assert alloc.used == 64 + 64 + 64 + 128 + 128 + 4096
    sizes = (1, 63, 64, 65, 100, 4096)
    freed = [alloc.free(o, n) for o, n in zip(offsets, sizes, strict=True) if o is not None]
    assert freed == [64, 64, 64, 128, 128, 4096]


def test_alignment_one_packs_bytes_exactly() -> None:
    alloc = OffsetAllocator(10, alignment=1)
    assert [alloc.allocate(3), alloc.allocate(3), alloc.allocate(4)] == [0, 3, 6]
    assert alloc.allocate(1) is None


def test_exhaustion_returns_none_and_never_raises() -> None:
    alloc = OffsetAllocator(64 * 10)
    offsets = [alloc.allocate(64) for _ in range(10)]
    assert sorted(o for o in offsets if o is not None) == [64 * i for i in range(10)]
    assert alloc.free_bytes == 0
    assert alloc.largest_free() == 0
    assert alloc.allocate(1) is None
    assert alloc.allocate(10 * 64) is None
    assert alloc.allocate(1 << 50) is None


def test_fragmented_space_refuses_a_request_larger_than_every_block() -> None:
    alloc = OffsetAllocator(64 * 8)
    offsets = [alloc.allocate(64) for _ in range(8)]
    for offset in offsets[::2]:
        assert offset is not None
        alloc.free(offset, 64)
    assert alloc.free_bytes == 64 * 4
    assert alloc.largest_free() == 64
    assert alloc.allocate(65) is None
    assert alloc.allocate(64) is not None


def test_capacity_not_multiple_of_alignment_leaves_a_free_unusable_tail() -> None:
    alloc = OffsetAllocator(200, alignment=64)
    assert [alloc.allocate(64) for _ in range(3)] == [0, 64, 128]
    assert alloc.allocate(1) is None
    assert alloc.used == 192
    assert alloc.free_bytes == 8
    assert alloc.largest_free() == 8
    for offset in (64, 0, 128):
        alloc.free(offset, 64)
    assert alloc.largest_free() == 200


def test_alignment_larger_than_capacity_fits_nothing() -> None:
    alloc = OffsetAllocator(100, alignment=4096)
    assert alloc.allocate(1) is None
    assert alloc.largest_free() == 100


@pytest.mark.parametrize("seed", range(5))
def test_freeing_everything_in_random_order_coalesces_to_one_block(seed: int) -> None:
    rng = random.Random(seed)
    capacity = 1 << 24
    alloc = OffsetAllocator(capacity, alignment=64)
    offsets = []
    while (offset := alloc.allocate(size := rng.randint(1, 20_000))) is not None:
        offsets.append((offset, size))
    assert alloc.allocations == len(offsets) > 100
    rng.shuffle(offsets)
    for offset, size in offsets:
        alloc.free(offset, size)
    assert alloc.used == 0
    assert alloc.allocations == 0
    assert alloc.free_bytes == capacity
    assert alloc.largest_free() == capacity
    assert alloc.allocate(capacity) == 0


def test_certainly_wrong_frees_raise_key_error() -> None:
    # The caller (the master) owns the record of allocations; the allocator catches the frees
    # it can tell are wrong without a per-allocation table.
    alloc = OffsetAllocator(1 << 16)
    a, b, c = (alloc.allocate(1000) for _ in range(3))
    assert a is not None
    assert b is not None
    assert c is not None
    with pytest.raises(KeyError):
        alloc.free(b + 1, 999)  # not aligned
    with pytest.raises(KeyError):
        alloc.free(1 << 20, 10)  # beyond the segment
    with pytest.raises(KeyError):
        alloc.free(c, 0)
    assert alloc.free(b, 1000) == 1024
    with pytest.raises(KeyError):
        alloc.free(b, 1000)  # double free
    assert alloc.used == 2048


def test_used_and_free_bytes_accounting() -> None:
    alloc = OffsetAllocator(10_000, alignment=128)
    a = alloc.allocate(150)
    b = alloc.allocate(1)
    assert (alloc.used, alloc.free_bytes, alloc.allocations) == (384, 9_616, 2)
    assert a is not None
    assert b is not None
    assert alloc.free(a, 150) == 256
    assert (alloc.used, alloc.free_bytes, alloc.allocations) == (128, 9_872, 1)
    assert alloc.free(b, 1) == 128
    assert (alloc.used, alloc.free_bytes, alloc.allocations) == (0, 10_000, 0)
    assert alloc.capacity == 10_000


def test_a_fitting_block_in_the_requests_own_size_class_is_found() -> None:
    # 1024 and 1088 share a size class: only the 1088-byte block can hold 1088 bytes, and a
    # search that only looked at classes above the request's would miss it.
    alloc = OffsetAllocator(1024 + 64 + 1088 + 64 + 4096)
    first, _, second, _, rest = (alloc.allocate(n) for n in (1024, 64, 1088, 64, 4096))
    assert first == 0
    assert second == 1088
    assert rest is not None
    assert first is not None
    alloc.free(first, 1024)
    alloc.free(second, 1088)
    assert alloc.largest_free() == 1088
    assert alloc.allocate(1089) is None
    assert alloc.allocate(1088) == second
    assert alloc.allocate(1000) == first


def test_lookups_do_not_grow_with_the_number_of_free_blocks() -> None:
    # Structural, not timed: count dict lookups while allocating among thousands of free blocks.
    alloc = OffsetAllocator(64 * 20_000)
    offsets = [alloc.allocate(64) for _ in range(10_000)]
    for offset in offsets[::2]:
        assert offset is not None
        alloc.free(offset, 64)
    lookups = 0

    class CountingDict(dict[int, int]):
        def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
            nonlocal lookups
            lookups += 1
            return super().get(key, default)

    alloc._free_by_start = CountingDict(alloc._free_by_start)
    assert alloc.allocate(128) == 64 * 10_000
    assert alloc.allocate(64) is not None
    assert lookups <= 4


def test_large_segment() -> None:
    alloc = OffsetAllocator(TIB, alignment=4096)
    big = alloc.allocate(TIB // 2 + 1)
    assert big == 0
    assert alloc.largest_free() == TIB // 2 - 4096
    small = alloc.allocate(1)
    assert small == TIB // 2 + 4096
    assert alloc.allocate(TIB // 2) is None
    assert small is not None
    alloc.free(big, TIB // 2 + 1)
    alloc.free(small, 1)
    assert alloc.largest_free() == TIB


def test_invalid_arguments_raise_config_error() -> None:
    with pytest.raises(ConfigError):
        OffsetAllocator(0)
    with pytest.raises(ConfigError):
        OffsetAllocator(1024, alignment=48)
    with pytest.raises(ConfigError):
        OffsetAllocator(1024, alignment=0)
    with pytest.raises(ConfigError):
        OffsetAllocator(1024).allocate(0)


def test_repr_shows_the_state() -> None:
    alloc = OffsetAllocator(4096)
    alloc.allocate(100)
    text = repr(alloc)
    assert text.startswith("OffsetAllocator(")
    for part in ("capacity=4096", "used=128", "allocations=1", "free_blocks=1"):
        assert part in text


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences checked against a brute-force model of the segment."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = OffsetAllocator(1)
        self.alignment = 1
        self.capacity = 1
        self.live: dict[int, int] = {}

    @initialize(
        capacity=st.one_of(st.integers(1, 1 << 14), st.just(TIB)),
        alignment=st.sampled_from([1, 8, 64, 512]),
    )
    def setup(self, capacity: int, alignment: int) -> None:
        self.alloc = OffsetAllocator(capacity, alignment)
        self.alignment = alignment
        self.capacity = capacity

    def _allocate(self, size: int) -> int | None:
        length = round_up(size, self.alignment)
        free_ranges = gaps(self.live, self.capacity)
        offset = self.alloc.allocate(size)
        if offset is None:
            assert all(gap < length for _, gap in free_ranges), "refused although a block fits"
            return None
        assert offset % self.alignment == 0
        assert any(s <= offset and offset + length <= s + g for s, g in free_ranges), "overlap"
        self.live[offset] = length
        return offset

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        small = st.integers(1, 4 * self.alignment)
        size = data.draw(st.one_of(small, st.integers(1, self.capacity + self.alignment)))
        self._allocate(size)

    @rule(data=st.data())
    def allocate_exact_fit(self, data: st.DataObject) -> None:
        # Ask for the whole usable part of some free range: the edge case of a good-fit search.
        usable = [g // self.alignment * self.alignment for _, g in gaps(self.live, self.capacity)]
        usable = [u for u in usable if u]
        if usable:
            size = data.draw(st.sampled_from(usable))
            assert self._allocate(size - data.draw(st.integers(0, self.alignment - 1))) is not None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        assert self.alloc.free(offset, self.live[offset]) == self.live.pop(offset)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        assert self.alloc.used == sum(self.live.values())
        assert self.alloc.used + self.alloc.free_bytes == self.capacity
        assert self.alloc.allocations == len(self.live)
        largest = max((g for _, g in gaps(self.live, self.capacity)), default=0)
        assert self.alloc.largest_free() == largest

    def teardown(self) -> None:
        offsets = list(self.live)
        random.Random(len(offsets)).shuffle(offsets)
        for offset in offsets:
            self.alloc.free(offset, self.live[offset])
        assert self.alloc.used == 0
        assert self.alloc.largest_free() == self.capacity


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None
)
test_allocator_matches_model = AllocatorMachine.TestCase
