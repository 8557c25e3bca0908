"""A step's stats: how counters, series and gauges merge, their bounds, the measured lookup."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from kvconnect.vllm import stats
from kvconnect.vllm.lookup import PoolLookups
from kvconnect.vllm.stats import HeldBlocks, StepStats, merge
from tests.support.waiting import wait_for


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
    keys = None

    def __init__(self, hit: int) -> None:
        self.hit = hit

    def leading(self, hashes: Sequence[str], first: int) -> int:
        return min(self.hit, len(hashes))


def test_pool_lookups_count_blocks_asked_and_found() -> None:
    step = StepStats()
    ticks = itertools.count()
    index = _Index(2)
    lookups = PoolLookups(index, stats=step, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    try:
        for rid, hashes in (("r", ["a", "b", "c"]), ("s", ["d"])):
            assert lookups.ask(rid, 0, hashes) is None
            wait_for(lambda: not lookups.busy(), "the lookup did not finish")
        assert step.take() == {
            "pool_lookups": 2,
            "pool_lookup_blocks": 4,
            "pool_hit_blocks": 3,
            "pool_lookup_duration_seconds": [1.0, 1.0],
        }
    finally:
        lookups.close()


def test_held_blocks() -> None:
    held = HeldBlocks()
    held.hold("a", 3)
    held.hold("b", 5)
    held.release(["a", "unknown"])
    assert held.total == 5
