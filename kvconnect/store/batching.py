"""A store batch's arguments and outcome, for :class:`~kvconnect.store.client.StoreClient`:
checking what the caller passed (InvalidRequest), picking the keys the store can hold (the
others are answered INVALID), and the per-key result. Pure: no I/O.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvconnect.errors import InvalidRequest
from kvconnect.store.messages import Code, check_key
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.memory import MemoryRegion

STORED = (Code.OK, Code.EXISTS)
"""Codes that mean the object is stored (put) or was read (get)."""

Regions = MemoryRegion | Sequence[MemoryRegion]
"""One registered region for the whole batch, or one per key."""

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per-key outcome of a batch, and the bytes moved per key (0 where nothing was stored or
    read by this call).

    A key is UNSETTLED when its transfer could not be stopped by the deadline: a transport
    thread may still write (get) or read (put) its buffer range, so the caller must not reuse
    that range before :meth:`on_settled` runs its callback.
    """

    codes: tuple[Code, ...]
    sizes: tuple[int, ...]
    unsettled: tuple[TransferBatch, ...] = field(default=(), repr=False, compare=False)
    """The transfer batches still holding memory of UNSETTLED keys."""

    def on_settled(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no transfer of this batch touches its buffers any more: at
        once if none does (every key but UNSETTLED ones), else on a transport thread."""
        if not self.unsettled:
            callback()
            return
        lock, left = threading.Lock(), [len(self.unsettled)]

        def one_settled() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()

        for batch in self.unsettled:
            batch.add_settled_callback(one_settled)

    def leading(self) -> int:
        """How many keys from the start completed: the prefix a caller can use as is."""
        for n, code in enumerate(self.codes):
            if code not in STORED:
                return n
        return len(self.codes)

    def ok(self) -> list[bool]:
        """Per key: the object is now stored (put) or was read (get)."""
        return [code in STORED for code in self.codes]


@dataclass(frozen=True, slots=True)
class Part:
    """What one writer of a multi-part object writes: part ``index`` of ``count``, per key
    at ``object_offsets[i]`` of an object of ``object_sizes[i]`` bytes."""

    index: int
    count: int
    object_sizes: list[int]
    object_offsets: list[int]

    def take(self, picked: list[int]) -> Part:
        """The same for the keys ``picked``."""
        return Part(
            self.index,
            self.count,
            take(self.object_sizes, picked),
            take(self.object_offsets, picked),
        )


@dataclass(frozen=True, slots=True)
class Ranges:
    """A batch's memory, checked: per key its region, offset and size."""

    regions: list[MemoryRegion]
    offsets: list[int]
    sizes: list[int]

    def take(self, picked: list[int]) -> Ranges:
        """The same for the keys ``picked``."""
        return Ranges(
            take(self.regions, picked), take(self.offsets, picked), take(self.sizes, picked)
        )


def check_ranges(
    keys: list[str],
    region: Regions,
    offsets: Sequence[int],
    sizes: Sequence[int],
    owns: Callable[[MemoryRegion], bool],
) -> Ranges:
    """Each key's region, offset and size (as ints); raises InvalidRequest for a batch that
    cannot work (``owns``: whether a region is registered with the client's engine)."""
    same_length(keys, offsets=offsets, sizes=sizes)
    regions = [region] * len(keys) if isinstance(region, MemoryRegion) else list(region)
    if len(regions) != len(keys):
        raise InvalidRequest(f"{len(regions)} regions for {len(keys)} keys")
    for one in set(regions):
        if not isinstance(one, MemoryRegion) or not owns(one):
            raise InvalidRequest(f"region {one!r} is not registered with this client's engine")
    ranges = Ranges(regions, integers(offsets, "offsets"), integers(sizes, "sizes"))
    for one, offset, size in zip(regions, ranges.offsets, ranges.sizes, strict=True):
        if offset < 0 or size < 0 or offset + size > one.length:
            raise InvalidRequest(
                f"range [{offset}, {offset + size}) is outside the {one.length}-byte region"
            )
    return ranges


def all_codes(code: Code, count: int) -> BatchResult:
    """``count`` keys, each ``code``, nothing moved."""
    return BatchResult((code,) * count, (0,) * count)


def plain_keys(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list, with str subclasses (``numpy.str_``) as plain str: the wire encodes
    only str. Anything else stays as it is (an invalid key)."""
    return [str.__str__(key) if isinstance(key, str) else key for key in keys]


def valid_keys(keys: Sequence[object]) -> list[int]:
    """Indices of the keys the store can hold (:func:`~kvconnect.store.messages.check_key`)."""
    return [i for i, key in enumerate(keys) if check_key(key)]


def take(values: Sequence[_T], picked: list[int]) -> list[_T]:
    """``values`` at the indices ``picked``."""
    return [values[i] for i in picked]


def spread(result: BatchResult, picked: list[int], count: int) -> BatchResult:
    """The result of a batch of ``count`` keys from that of its keys ``picked``: the others
    are INVALID."""
    codes, sizes = [Code.INVALID] * count, [0] * count
    for i, code, size in zip(picked, result.codes, result.sizes, strict=True):
        codes[i], sizes[i] = code, size
    return BatchResult(tuple(codes), tuple(sizes), result.unsettled)


def integer(value: object, name: str) -> int:
    """``value`` as an int (numpy integers are); InvalidRequest otherwise."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequest(f"{name} must be an integer, got {value!r}") from None


def integers(values: Sequence[object], name: str) -> list[int]:
    """Each of ``values`` as an int (see :func:`integer`)."""
    return [integer(value, name) for value in values]


def same_length(keys: Sequence[object], **others: Sequence[object]) -> None:
    """InvalidRequest unless every one of ``others`` has an entry per key."""
    for name, values in others.items():
        if len(values) != len(keys):
            raise InvalidRequest(f"{name} has {len(values)} entries for {len(keys)} keys")
