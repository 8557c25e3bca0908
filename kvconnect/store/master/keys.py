"""The master's key index: str key ↔ int slot. The C table when built, pure Python otherwise.

Both implementations keep one contract (the master's tests run against both):

- ``get(key)`` is the key's slot, or -1; ``get_many(keys)`` the same for a batch (the C table
  overlaps the cache misses of the batch's lookups).
- ``live_many(keys, state, wanted, segment, alive)`` is, per key, False when it is absent or its
  slot's ``state`` is not ``wanted``, True when ``alive[segment[slot]]``, else None (the
  caller decides from the object's other replicas): the master's ``exists`` in one call (the
  C table overlaps the cache misses of the columns too).
- ``add(key, slot)`` indexes an absent key at a slot that has none; ValueError otherwise.
- ``remove(slot)`` forgets the slot's key (nothing if it has none); ``key(slot)`` is the
  slot's key, or None.
- ``len()`` counts the keys; ``nbytes`` is the index's own memory (the C table: buckets, slot
  words and key bytes; the Python one: its dict and list, not the str objects).

The C table (``kvconnect._native.KeyTable``) holds a key as its UTF-8 bytes in an arena rather
than a str object, 8-byte buckets in open addressing, and compacts the arena under churn; see
csrc/keytable.c. Pure data, called from the master's one thread.
"""

from __future__ import annotations

import secrets
import sys
from array import array
from collections.abc import Sequence
from typing import Protocol

from kvconnect.errors import ConfigError
from kvconnect.transfer.config import NativeMode


class KeyTable(Protocol):
    """key ↔ slot; see the module docstring."""

    @property
    def nbytes(self) -> int:
        """Memory the index holds."""

    def __len__(self) -> int:
        """Keys held."""

    def get(self, key: str, /) -> int:
        """The slot of ``key``, or -1."""

    def get_many(self, keys: Sequence[str], /) -> list[int]:
        """:meth:`get` of each key."""

    def live_many(
        self,
        keys: Sequence[str],
        state: array[int],
        wanted: int,
        segment: array[int],
        alive: bytearray,
        /,
    ) -> list[bool | None]:
        """Per key: in state ``wanted`` on a live primary segment; see the module docstring."""

    def add(self, key: str, slot: int, /) -> None:
        """Index ``key`` (absent) at ``slot`` (without a key)."""

    def remove(self, slot: int, /) -> None:
        """Forget the key of ``slot``, if any."""

    def key(self, slot: int, /) -> str | None:
        """The key of ``slot``, or None."""


class PythonKeyTable:
    """The reference implementation: a dict and a list."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._keys: list[str | None] = []

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._slots) + sys.getsizeof(self._keys)

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: str, /) -> int:
        return self._slots.get(key, -1)

    def get_many(self, keys: Sequence[str], /) -> list[int]:
        get = self._slots.get
        return [get(key, -1) for key in keys]

    def live_many(
        self,
        keys: Sequence[str],
        state: array[int],
        wanted: int,
        segment: array[int],
        alive: bytearray,
        /,
    ) -> list[bool | None]:
        found: list[bool | None] = []
        for slot in self.get_many(keys):
            if slot < 0 or state[slot] != wanted:
                found.append(False)
            else:
                found.append(True if alive[segment[slot]] else None)
        return found

    def add(self, key: str, slot: int, /) -> None:
        if slot < 0 or key in self._slots or self.key(slot) is not None:
            raise ValueError("KeyTable.add: the key or the slot is taken")
        if slot >= len(self._keys):
            self._keys.extend([None] * (slot + 1 - len(self._keys)))
        self._keys[slot] = key
        self._slots[key] = slot

    def remove(self, slot: int, /) -> None:
        key = self.key(slot)
        if key is not None:
            del self._slots[key]
            self._keys[slot] = None

    def key(self, slot: int, /) -> str | None:
        return self._keys[slot] if 0 <= slot < len(self._keys) else None


def native_key_table() -> KeyTable | None:
    """A new C table with a random seed (keys built to collide on one master do not on
    another), or None when the extension is not built."""
    try:
        from kvconnect._native import KeyTable as NativeKeyTable
    except ImportError:
        return None
    return NativeKeyTable(seed=secrets.randbits(64))


def new_key_table(mode: NativeMode) -> KeyTable:
    """The table ``MasterConfig.native`` asks for: ``on`` requires the C one, ``off`` never
    uses it, ``auto`` takes it when built."""
    native = None if mode == NativeMode.OFF else native_key_table()
    if native is None and mode == NativeMode.ON:
        raise ConfigError("native='on' but kvconnect._native is not built (see setup.py)")
    return PythonKeyTable() if native is None else native
