"""A store batch's arguments and outcome, for :class:`~kvconnect.store.client.StoreClient`:
checking what the caller passed (InvalidRequest), picking the keys the store can hold (the
others are answered INVALID), and the per-key result. Pure: no I/O.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from kvconnect.errors import InvalidRequest
from kvconnect.store.messages import MAX_BATCH, Code, check_key
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


class Span(NamedTuple):
    """A range of registered memory: ``size`` bytes of ``region`` at ``offset``."""

    region: MemoryRegion
    offset: int
    size: int


MAX_SPANS = MAX_BATCH
"""Most spans one batch may gather or scatter (a transfer request each)."""


@dataclass(frozen=True, slots=True)
class Ranges:
    """A batch's memory, checked: per key the spans its bytes go to or come from, in the order
    of the object's bytes (one span for the plain calls), and their total size.

    ``within`` (scattered reads only): per key the offset in the object of its first byte;
    such a read moves exactly ``sizes[i]`` bytes of the object, not the whole object."""

    spans: list[tuple[Span, ...]]
    sizes: list[int]
    within: list[int] | None = None

    def take(self, picked: list[int]) -> Ranges:
        """The same for the keys ``picked``."""
        within = take(self.within, picked) if self.within is not None else None
        return Ranges(take(self.spans, picked), take(self.sizes, picked), within)


def check_ranges(
    keys: list[str],
    region: Regions,
    offsets: Sequence[int],
    sizes: Sequence[int],
    owns: Callable[[MemoryRegion], bool],
) -> Ranges:
    """Each key's region, offset and size (as ints) as one span; raises InvalidRequest for a
    batch that cannot work (``owns``: whether a region is registered with the client's
    engine)."""
    same_length(keys, offsets=offsets, sizes=sizes)
    regions = [region] * len(keys) if isinstance(region, MemoryRegion) else list(region)
    if len(regions) != len(keys):
        raise InvalidRequest(f"{len(regions)} regions for {len(keys)} keys")
    _check_regions(regions, owns)
    spans = [
        Span(one, offset, size)
        for one, offset, size in zip(
            regions, integers(offsets, "offsets"), integers(sizes, "sizes"), strict=True
        )
    ]
    for span in spans:
        _check_span(span)
    return Ranges([(span,) for span in spans], [span.size for span in spans])


def check_spans(
    keys: list[str],
    spans: Sequence[Sequence[Span]],
    owns: Callable[[MemoryRegion], bool],
    within: Sequence[int] | None = None,
) -> Ranges:
    """Each key's spans (a non-empty list or tuple, sizes above 0, at most :data:`MAX_SPANS`
    in all), as checked :class:`Ranges`; ``within``: per key the object offset of a scattered
    read. Raises InvalidRequest like :func:`check_ranges`."""
    same_length(keys, spans=spans)
    checked: list[tuple[Span, ...]] = []
    total = 0
    for one in spans:
        if not isinstance(one, (list, tuple)) or not one:
            raise InvalidRequest(f"a key's spans must be a non-empty sequence, got {one!r}")
        total += len(one)
        if total > MAX_SPANS:
            raise InvalidRequest(f"more than {MAX_SPANS} spans in one batch")
        checked.append(tuple(_span(item) for item in one))
    _check_regions([span.region for key_spans in checked for span in key_spans], owns)
    for key_spans in checked:
        for span in key_spans:
            _check_span(span)
            if span.size == 0:
                raise InvalidRequest("a span of 0 bytes")
    offsets = None
    if within is not None:
        same_length(keys, object_offsets=within)
        offsets = integers(within, "object_offsets")
        if any(offset < 0 for offset in offsets):
            raise InvalidRequest("an object offset below 0")
    return Ranges(checked, [sum(span.size for span in one) for one in checked], offsets)


def _span(item: object) -> Span:
    if not isinstance(item, tuple) or len(item) != 3:
        raise InvalidRequest(f"a span is (region, offset, size), got {item!r}")
    region, offset, size = item
    return Span(region, integer(offset, "span offsets"), integer(size, "span sizes"))


def _check_regions(regions: Iterable[object], owns: Callable[[MemoryRegion], bool]) -> None:
    distinct: dict[int, object] = {id(one): one for one in regions}  # any object, hashable or not
    for one in distinct.values():
        if not isinstance(one, MemoryRegion) or not owns(one):
            raise InvalidRequest(f"region {one!r} is not registered with this client's engine")


def _check_span(span: Span) -> None:
    if span.offset < 0 or span.size < 0 or span.offset + span.size > span.region.length:
        raise InvalidRequest(
            f"range [{span.offset}, {span.offset + span.size}) is outside the "
            f"{span.region.length}-byte region"
        )


def joined(results: Sequence[BatchResult]) -> BatchResult:
    """The results of consecutive runs of one batch's keys, as the batch's."""
    if len(results) == 1:
        return results[0]
    return BatchResult(
        tuple(code for result in results for code in result.codes),
        tuple(size for result in results for size in result.sizes),
        tuple(batch for result in results for batch in result.unsettled),
    )


def runs(picked: list[int], run: int) -> list[list[int]]:
    """``picked`` in runs of at most ``run``, one master call each; a batch over
    ``MAX_BATCH`` stays whole, for the master to refuse (the documented INVALID)."""
    if len(picked) > MAX_BATCH:
        return [picked]
    return [picked[i : i + run] for i in range(0, len(picked), run)]


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
    try:
        return list(map(operator.index, values))  # type: ignore[arg-type]
    except TypeError:
        return [integer(value, name) for value in values]  # raises, naming the culprit


def same_length(keys: Sequence[object], **others: Sequence[object]) -> None:
    """InvalidRequest unless every one of ``others`` has an entry per key."""
    for name, values in others.items():
        if len(values) != len(keys):
            raise InvalidRequest(f"{name} has {len(values)} entries for {len(keys)} keys")
