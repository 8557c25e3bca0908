"""A step's stats: how counters, series and gauges merge, their bounds, the measured lookup."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from kvconnect.vllm import stats
from kvconnect.vllm.stats import HeldBlocks, MeasuredPoolIndex, StepStats, merge


def test_counters_add_series_concatenate_gauges_take_the_latest() -> None:
    workers = [{"pool_saves": 1, "pool_save_bytes": [10.0]}, {"pool_saves": 2.0}]
    scheduler = {"pool_lookups": 3, "prefill_held_blocks": 7, "pool_save_bytes": [5.0, 6.0]}
    merged = merge(merge(merge({}, workers[0]), workers[1]), scheduler)
    assert merged == {
        "pool_saves": 3.0,
        "pool_save_bytes": [10.0, 5.0, 6.0],
        "pool_lookups": 3,
        "prefill_held_blocks": 7,
    }
    assert merge(merged, {"prefill_held_blocks": 2})["prefill_held_blocks"] == 2


def test_series_are_bounded_and_the_excess_is_counted() -> None:
    big = [float(i) for i in range(stats.MAX_OBSERVATIONS - 10)]
    merged = merge({}, {"pd_load_bytes": big})
    merge(merged, {"pd_load_bytes": [1.0] * 25})
    assert len(merged["pd_load_bytes"]) == stats.MAX_OBSERVATIONS  # type: ignore[arg-type]
    assert merged["observations_dropped"] == 15


def test_step_stats_from_many_threads() -> None:
    step = StepStats()

    def work() -> None:
        for _ in range(1000):
            step.add(pool_loads=1)
            step.observe(pool_load_bytes=4.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken = step.take()
    assert taken["pool_loads"] == 4000
    assert taken["pool_load_bytes"] == [4.0] * 4000
    assert step.take() == {}


class _Index:
    def __init__(self, hit: int) -> None:
        self.hit = hit

    def leading(self, hashes: Sequence[str]) -> int:
        return min(self.hit, len(hashes))


def test_the_measured_lookup_counts_blocks_asked_and_found() -> None:
    step = StepStats()
    ticks = itertools.count()
    index = MeasuredPoolIndex(_Index(2), step, clock=lambda: float(next(ticks)))
    assert index.leading(["a", "b", "c"]) == 2
    assert index.leading(["d"]) == 1
    assert step.take() == {
        "pool_lookups": 2,
        "pool_lookup_blocks": 4,
        "pool_hit_blocks": 3,
        "pool_lookup_duration_seconds": [1.0, 1.0],
    }


def test_held_blocks() -> None:
    held = HeldBlocks()
    held.hold("a", 3)
    held.hold("b", 5)
    held.release(["a", "unknown"])
    assert held.total == 5
