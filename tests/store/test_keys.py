"""The master's key index, both implementations, against a dict model: churn, growth, arena
compaction, hostile keys (empty, 1 byte, MAX_KEY_BYTES, non-ASCII, equal hash tags)."""

from __future__ import annotations

import itertools
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import _native
from kvconnect.store.master.keys import KeyTable, PythonKeyTable
from kvconnect.store.messages import MAX_KEY_BYTES
from tests.store.conftest import KEY_TABLES, make_key_table

SEED = 12345


def _tag_collisions(count: int) -> list[str]:
    """Keys whose tags (under SEED) equal another key's: ``count`` pairs, by brute force
    (a 32-bit tag repeats after ~2^16 keys)."""
    table = _native.KeyTable(seed=SEED)
    seen: dict[int, str] = {}
    found: list[str] = []
    for n in itertools.count():
        key = f"collide-{n}"
        other = seen.setdefault(table.tag(key), key)
        if other != key:
            found += [other, key]
            if len(found) >= 2 * count:
                return found
    raise AssertionError("unreachable")


COLLIDING = _tag_collisions(3)
HOSTILE = [
    "",
    "a",
    "b",
    "x" * MAX_KEY_BYTES,
    "x" * (MAX_KEY_BYTES - 1),
    "é" * (MAX_KEY_BYTES // 2),  # two bytes each: MAX_KEY_BYTES of UTF-8
    "日本語のキー",
    "🔑" * 3,
    "a\0b",
    *COLLIDING,
]
KEYS = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=40), st.integers(0, 500).map(str))


def _table(kind: str) -> KeyTable:
    # A fixed seed for the native table, so that COLLIDING really collide in it.
    return _native.KeyTable(seed=SEED) if kind == "native" else PythonKeyTable()


def test_colliding_keys_share_their_tag() -> None:
    table = _native.KeyTable(seed=SEED)
    for a, b in zip(COLLIDING[::2], COLLIDING[1::2], strict=True):
        assert a != b
        assert table.tag(a) == table.tag(b)
    assert len({table.tag(k) for k in COLLIDING}) == len(COLLIDING) // 2


@pytest.mark.parametrize("kind", KEY_TABLES)
@settings(max_examples=150)
@given(ops=st.lists(st.tuples(st.sampled_from("aarg"), KEYS), max_size=600))
def test_the_table_behaves_as_a_dict(kind: str, ops: list[tuple[str, str]]) -> None:
    table = _table(kind)
    model: dict[str, int] = {}
    free: list[int] = []
    slots = 0
    for op, key in ops:
        if op == "a" and key not in model:  # add, at a freed slot first (as ObjectTable does)
            slot = free.pop() if free else slots
            slots = max(slots, slot + 1)
            table.add(key, slot)
            model[key] = slot
        elif op == "a":
            with pytest.raises(ValueError, match="taken"):
                table.add(key, slots)
        elif op == "r" and model:  # remove the slot of some held key
            victim = sorted(model)[len(key) % len(model)]
            table.remove(model[victim])
            free.append(model.pop(victim))
        else:
            assert table.get(key) == model.get(key, -1)
    assert len(table) == len(model)
    probe = [*model, *HOSTILE, "absent"]
    assert table.get_many(probe) == [model.get(k, -1) for k in probe]
    by_slot = {slot: key for key, slot in model.items()}
    for slot in range(slots + 2):
        stored = table.key(slot)
        assert stored == by_slot.get(slot)
        if stored is not None:  # byte for byte
            assert stored.encode() == by_slot[slot].encode()


@pytest.mark.parametrize("kind", KEY_TABLES)
def test_a_taken_slot_or_key_is_refused_and_removal_of_nothing_is_harmless(kind: str) -> None:
    table = make_key_table(kind)
    table.add("k", 3)
    with pytest.raises(ValueError, match="taken"):
        table.add("other", 3)
    with pytest.raises(ValueError, match="taken"):
        table.add("k", 4)
    table.remove(7)
    table.remove(2)
    assert (table.key(2), table.key(99), table.get("k"), len(table)) == (None, None, 3, 1)
    table.remove(3)
    assert (table.get("k"), table.key(3), len(table)) == (-1, None, 0)


@pytest.mark.parametrize("kind", KEY_TABLES)
def test_churn_keeps_memory_bounded_and_growth_keeps_every_key(kind: str) -> None:
    table = make_key_table(kind)
    live = 20_000
    for slot in range(live):
        table.add(f"key-{slot:058d}", slot)
    settled = table.nbytes
    for generation in range(1, 8):  # replace every key, seven times over
        for slot in range(live):
            table.remove(slot)
            table.add(f"gen{generation}-{slot:055d}", slot)
    assert table.nbytes <= 2 * settled
    keys = [f"gen7-{slot:055d}" for slot in range(live)]
    assert table.get_many(keys) == list(range(live))
    assert table.get_many([f"key-{slot:058d}" for slot in range(0, live, 97)]) == [-1] * 207
    assert all(table.key(slot) == key for slot, key in enumerate(keys))


def test_the_native_table_counts_its_memory() -> None:
    table = _native.KeyTable(seed=1)
    empty = table.nbytes
    for slot in range(10_000):
        table.add(f"{slot:064d}", slot)
    # Buckets (8 B, at most 3/4 full), a slot word (8 B) and 64 key bytes per key, doubled
    # at most by the growth of each array.
    assert 10_000 * (64 + 8 + 8) < table.nbytes - empty < 2 * 10_000 * (64 + 8 + 8 * 4 / 3)


def test_keys_that_are_not_str_are_a_type_error_natively() -> None:
    table = _native.KeyTable(seed=1)
    with pytest.raises(TypeError):
        table.get(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.get_many(["ok", 5])  # type: ignore[list-item]
    assert table.get("\ud800") == -1  # a lone surrogate has no UTF-8: never a stored key


@pytest.mark.parametrize("kind", KEY_TABLES)
@settings(max_examples=100)
@given(
    slots=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=80),
    alive=st.lists(st.booleans(), min_size=4, max_size=4),
    probe=st.lists(st.integers(0, 100), max_size=100),
)
def test_live_many_reads_the_columns_of_each_found_key(
    kind: str, slots: list[tuple[int, int]], alive: list[bool], probe: list[int]
) -> None:
    """Every third slot has no key; the probe asks for held, free and never-added keys, more
    than one group of them."""
    table = _table(kind)
    state = array("b", [s for s, _ in slots])
    segment = array("i", [g for _, g in slots])
    for slot in range(len(slots)):
        if slot % 3:
            table.add(f"key-{slot}", slot)
    keys = [f"key-{n}" for n in probe]
    expected: list[bool | None] = []
    for n in probe:
        if n >= len(slots) or n % 3 == 0 or state[n] != 2:
            expected.append(False)
        else:
            expected.append(True if alive[segment[n]] else None)
    assert table.live_many(keys, state, 2, segment, bytearray(alive)) == expected


def test_live_many_refuses_columns_of_other_types_and_slots_beyond_them() -> None:
    table = _native.KeyTable(seed=1)
    table.add("k", 5)
    state, segment, alive = array("b", [2] * 6), array("i", [0] * 6), bytearray([1])
    assert table.live_many(["k", "x"], state, 2, segment, alive) == [True, False]
    with pytest.raises(TypeError, match="state"):
        table.live_many(["k"], array("q", [2] * 6), 2, segment, alive)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="segment"):
        table.live_many(["k"], state, 2, array("q", [0] * 6), alive)
    with pytest.raises(IndexError, match="beyond the columns"):
        table.live_many(["k"], array("b", [2] * 5), 2, segment, alive)
    with pytest.raises(IndexError, match="beyond alive"):
        table.live_many(["k"], state, 2, array("i", [1] * 6), alive)
    with pytest.raises(TypeError):
        table.live_many(["k", 3], state, 2, segment, alive)  # type: ignore[list-item]
