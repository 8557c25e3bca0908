"""The pure parts of ``kvconnect bench store --tier disk`` (kvconnect/bench/disk_report.py) and
its raw baseline's own O_DIRECT loop (kvconnect/bench/baselines/direct_io.py, on a real file)."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

import pytest

from kvconnect.bench import disk_report
from kvconnect.bench.baselines import direct_io


def test_the_zipf_trace_is_seeded_in_range_and_follows_its_exponent() -> None:
    trace = disk_report.zipf_trace(100, 20_000, 1.0, seed=3)
    assert trace == disk_report.zipf_trace(100, 20_000, 1.0, seed=3)
    assert trace != disk_report.zipf_trace(100, 20_000, 1.0, seed=4)
    assert min(trace) >= 0
    assert max(trace) <= 99
    counts = Counter(trace)
    harmonic = sum(1 / k for k in range(1, 101))
    assert counts[0] / len(trace) == pytest.approx(1 / harmonic, abs=0.02)
    assert counts[1] / len(trace) == pytest.approx(1 / 2 / harmonic, abs=0.02)
    flat = Counter(disk_report.zipf_trace(4, 20_000, 0.0, seed=0))
    assert all(n / 20_000 == pytest.approx(0.25, abs=0.02) for n in flat.values())


def test_lru_hit_rate_counts_only_accesses_after_the_warm_up() -> None:
    # capacity 2: 1 miss, 2 miss, 1 hit, 3 miss (evicts 2), 1 hit, 2 miss
    trace = [1, 2, 1, 3, 1, 2]
    assert disk_report.lru_hit_rate(trace, 2, 0) == pytest.approx(2 / 6)
    assert disk_report.lru_hit_rate(trace, 2, 3) == pytest.approx(1 / 3)
    assert disk_report.lru_hit_rate(trace, 3, 0) == pytest.approx(3 / 6)


def test_percentile_and_ratios_with_their_spread() -> None:
    assert disk_report.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0
    assert disk_report.percentile([5.0] * 99 + [9.0], 0.99) == 9.0
    assert math.isnan(disk_report.percentile([], 0.5))
    assert disk_report.ratio([2.0, 3.0, 8.0], [4.0, 3.0, 4.0]) == {
        "median": 1.0,
        "min": 0.5,
        "max": 2.0,
    }
    assert math.isnan(disk_report.ratio([1.0], [0.0])["median"]), "no baseline: no ratio"


def test_raw_rows_compare_each_round_with_its_best_baseline_depth() -> None:
    samples = {
        "baseline_write_d1": [1.0, 2.0],
        "baseline_write_d4": [2.0, 1.0],
        "baseline_read_d1": [4.0, 4.0],
        "baseline_read_d4": [2.0, 2.0],
        "tier_write": [1.0, 1.0],
        "tier_read": [3.0, 5.0],
        "store_write": [2.0, 1.0],
    }
    row = disk_report.raw_row(1 << 20, [1, 4], samples)
    assert row["object_bytes"] == 1 << 20
    assert row["tier_write_ratio"] == {"median": 0.5, "min": 0.5, "max": 0.5}
    assert row["tier_read_ratio"] == {"median": 1.0, "min": 0.75, "max": 1.25}
    assert row["store_write_ratio"]["median"] == pytest.approx(0.75)
    assert "store_read_ratio" not in row, "a side without reads gets no read ratio"
    assert row["baseline_write_d4"] == {"median": 1.5, "min": 1.0, "max": 2.0}


def test_the_tables_show_medians_spreads_ratios_and_targets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    samples = {
        "baseline_write_d1": [2e9, 2e9],
        "baseline_read_d1": [1e9, 1e9],
        "tier_write": [1.6e9, 1.8e9],
        "tier_read": [1e9, 1e9],
    }
    disk_report.print_raw([disk_report.raw_row(1 << 20, [1], samples)])
    side = {"hit_rate": 0.4, "get_p50_ms": 1.0, "get_p99_ms": 2.0, "wrong_bytes": 0}
    run = {"with": {**side, "hit_rate": 0.9}, "without": side}
    result = {
        "s": 1.0,
        "working_set": 256 << 20,
        "dram": 64 << 20,
        "measured": 10,
        "rounds": [{**run, "lru_dram_hit_rate": 0.45, "max_hit_rate": 0.95}],
        "hit_rate_ratio": disk_report.ratio([0.9], [0.4]),
    }
    disk_report.print_zipf(result)
    out = capsys.readouterr().out
    assert "1 MiB write raw d1 2.00 (2.00-2.00)" in out
    assert "tier 1.70 (1.60-1.80) = 0.85x (0.80-0.90)" in out
    assert "target: tier / raw >= 0.8x at 1 MiB" in out
    assert "2.25x (2.25-2.25) (target 2.0x)" in out
    assert "45.0% ideal LRU" in out


@pytest.mark.parametrize("depth", [1, 3])
def test_the_direct_io_loop_writes_and_reads_whole_stripes(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "raw.data"
    block = 64 << 10
    assert direct_io._loop(path, "write", block, 1 << 20, depth) > 0
    assert path.stat().st_size == (1 << 20) // depth // block * block * depth
    assert direct_io._loop(path, "read", block, 1 << 20, depth) > 0


def test_bench_store_keeps_its_phases_unless_the_disk_tier_is_asked_for() -> None:
    parser = argparse.ArgumentParser()
    disk_report.add_arguments(parser)
    assert parser.parse_args([]).tier == "dram"
    args = parser.parse_args(["--tier", "disk", "--disk-phases", "restart"])
    assert [disk_report.DiskPhase(p) for p in args.disk_phases.split(",")] == [
        disk_report.DiskPhase.RESTART
    ]
    every = parser.parse_args(["--tier", "disk"]).disk_phases.split(",")
    assert every == [p.value for p in disk_report.DiskPhase]
