"""The connector's statistics between two of vLLM's collections (pure, no vLLM imports).

vLLM collects a connector's stats once per step, from every worker (``get_kv_connector_stats``
in the worker processes, aggregated over TP ranks) and from the scheduler side (the same hook on
the scheduler's connector, merged in), and hands them to its Prometheus logger. A step's stats
are a plain dict: a counter is a number (summed when merged), an observation series for a
histogram a list (concatenated, at most :data:`MAX_OBSERVATIONS`), a gauge a number named in
:data:`GAUGES` (the latest wins).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

StatValue = float | list[float]

MAX_OBSERVATIONS = 4096
"""Observations of one series kept per collection (a step has far fewer; the bound keeps a
stuck collector's memory finite, the excess is counted in ``observations_dropped``)."""

GAUGES: frozenset[str] = frozenset({"prefill_held_blocks"})
"""Keys that are levels, not amounts: merging keeps the latest."""


def merge(into: dict[str, StatValue], other: Mapping[str, StatValue]) -> dict[str, StatValue]:
    """Merge ``other``'s stats into ``into`` (returned): counters add, series concatenate up
    to :data:`MAX_OBSERVATIONS`, gauges take ``other``'s value."""
    for key, value in other.items():
        mine = into.get(key)
        if isinstance(value, list):
            series = mine if isinstance(mine, list) else []
            room = MAX_OBSERVATIONS - len(series)
            series.extend(value[:room])
            into[key] = series
            if len(value) > room:
                dropped = into.get("observations_dropped", 0.0)
                assert not isinstance(dropped, list)
                into["observations_dropped"] = dropped + len(value) - room
        elif key in GAUGES or not isinstance(mine, int | float):
            into[key] = value
        else:
            into[key] = mine + value
    return into


@dataclass(slots=True)
class StepStats:
    """Stats since the last :meth:`take`; any thread may add (a short lock)."""

    data: dict[str, StatValue] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counters: float) -> None:
        """Add to counters."""
        with self._lock:
            merge(self.data, counters)

    def observe(self, **observations: float) -> None:
        """One observation of each series (a histogram's sample)."""
        with self._lock:
            merge(self.data, {name: [value] for name, value in observations.items()})

    def take(self) -> dict[str, StatValue]:
        """Everything since the last call."""
        with self._lock:
            data, self.data = self.data, {}
        return data


class HeldBlocks:
    """Prefill's blocks kept for decode (the ``prefill_held_blocks`` gauge): added when a
    finished request's blocks are held, dropped when the scheduler side releases them."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def hold(self, request_id: str, blocks: int) -> None:
        self._held[request_id] = blocks

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    @property
    def total(self) -> int:
        return sum(self._held.values())
