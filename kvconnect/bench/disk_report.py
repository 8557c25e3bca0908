"""The pure parts of ``kvconnect bench store --tier disk`` (:mod:`kvconnect.bench.disk`): its
options, the Zipf workload, an ideal LRU for reference, the spread and ratio math over rounds
and the tables printed from a report. Importing it loads no store code (``bench store``
declares the options without loading the disk tier)."""

from __future__ import annotations

import argparse
import enum
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
TARGET_RAW = 0.8  # tier / baseline at 1 MiB
TARGET_HITS = 2.0  # hit rate with the disk / without


class DiskPhase(enum.Enum):
    """The phases of ``--tier disk``."""

    RAW = "raw"
    ZIPF = "zipf"
    RESTART = "restart"
    KILL = "kill"
    MOONCAKE = "mooncake"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--tier disk`` options of ``kvconnect bench store``."""
    parser.add_argument("--tier", choices=["dram", "disk"], default="dram")
    parser.add_argument("--disk-phases", default=",".join(p.value for p in DiskPhase))
    parser.add_argument("--disk-dir", default=".", help="where the bench makes its files")
    parser.add_argument("--disk-bytes", default="1G", help="bytes per raw measurement")
    parser.add_argument("--disk-depths", default="1,4", help="raw baseline concurrencies")
    parser.add_argument("--disk-dram", default="256M", help="the store's DRAM (raw phase)")
    parser.add_argument("--disk-heartbeat", type=float, default=0.05, help="raw phase: heartbeat s")
    parser.add_argument(
        "--disk-evict-fraction", type=float, default=0.25, help="raw phase: evict_fraction"
    )
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--zipf-dram", default="64M", help="the store's DRAM (zipf phase)")
    parser.add_argument("--zipf-accesses", type=int, default=6000)
    parser.add_argument("--restart-objects", type=int, default=1_000_000)
    parser.add_argument("--kill-objects", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)


def zipf_trace(keys: int, accesses: int, s: float, seed: int) -> list[int]:
    """``accesses`` key indices in [0, keys), index k drawn with probability ∝ 1/(k+1)^s
    (seeded: the same arguments give the same trace)."""
    weights = 1.0 / np.arange(1, keys + 1, dtype=np.float64) ** s
    cdf = np.cumsum(weights) / weights.sum()
    draws = np.random.default_rng(seed).random(accesses)
    return [int(k) for k in np.minimum(np.searchsorted(cdf, draws, side="right"), keys - 1)]


def lru_hit_rate(trace: Sequence[int], capacity: int, measured_from: int) -> float:
    """Hit rate of an LRU cache of ``capacity`` entries over ``trace[measured_from:]`` (the
    accesses before it only warm the cache); every miss inserts."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for n, key in enumerate(trace):
        if key in cache:
            cache.move_to_end(key)
            hits += n >= measured_from
            continue
        cache[key] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return hits / max(1, len(trace) - measured_from)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def ratio(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Per-round ratios ours[r] / theirs[r]: their median, min and max (the spread)."""
    ratios = [o / t for o, t in zip(ours, theirs, strict=True) if t > 0]
    if not ratios:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cell(summary: dict[str, float], scale: float = 1e-9) -> str:
    """``median (min-max)`` of a spread, scaled (default bytes/s → GB/s)."""
    lo, mid, hi = (summary[k] * scale for k in ("min", "median", "max"))
    return f"{mid:.2f} ({lo:.2f}-{hi:.2f})"


def raw_row(size: int, depths: Sequence[int], samples: dict[str, list[float]]) -> dict[str, Any]:
    """One object size's row of the raw phase from its per-round ``samples`` (bytes/s): each
    side's spread, and tier / baseline ratios against the best baseline concurrency of each
    round."""
    row: dict[str, Any] = {"object_bytes": size}
    for name, values in samples.items():
        row[name] = spread(values)
    for op in ("write", "read"):
        columns = [samples[f"baseline_{op}_d{d}"] for d in depths]
        best = [max(per_round) for per_round in zip(*columns, strict=True)]
        for side in ("tier", "store"):
            if f"{side}_{op}" in samples and len(samples[f"{side}_{op}"]) == len(best):
                row[f"{side}_{op}_ratio"] = ratio(samples[f"{side}_{op}"], best)
    return row


# -------------------------------------------------------------------------------- tables


def print_raw(rows: list[dict[str, Any]]) -> None:
    """The raw phase's table: GB/s median (min-max) per side, ratios tier / best baseline."""
    print("\ndisk GB/s, median (min-max) of rounds; ratio = tier / best raw baseline")
    for row in rows:
        size = row["object_bytes"]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        for op in ("write", "read"):
            baselines = "  ".join(
                f"d{name.rsplit('_d', 1)[1]} {cell(row[name])}"
                for name in row
                if name.startswith(f"baseline_{op}_d")
            )
            sides = "  ".join(
                f"{side} {cell(row[f'{side}_{op}'])} = {ratio_cell(row[f'{side}_{op}_ratio'])}"
                for side in ("tier", "store")
                if f"{side}_{op}_ratio" in row
            )
            print(f"{label:>7} {op:<5} raw {baselines}  |  {sides}")
    print(f"target: tier / raw >= {TARGET_RAW}x at 1 MiB (tier: DiskTier here; store: end to end)")


def ratio_cell(summary: dict[str, float]) -> str:
    """``0.85x (0.80-0.90)``: a ratio's median and spread over rounds."""
    return f"{summary['median']:.2f}x ({summary['min']:.2f}-{summary['max']:.2f})"


def print_zipf(result: dict[str, Any]) -> None:
    """The zipf phase's table: hit rate and get latency with and without the disk tier."""
    print(
        f"\nzipf s={result['s']} working set {result['working_set'] // MiB} MiB = 4x DRAM "
        f"({result['dram'] // MiB} MiB), {result['measured']} measured gets per round"
    )
    print(f"{'round':<6}{'side':<9}{'hit rate':>9}{'get p50 ms':>12}{'p99 ms':>9}{'wrong':>7}")
    for n, run in enumerate(result["rounds"]):
        for side in ("without", "with"):
            r = run[side]
            print(
                f"{n + 1:<6}{side:<9}{r['hit_rate']:>9.1%}{r['get_p50_ms']:>12.2f}"
                f"{r['get_p99_ms']:>9.2f}{r['wrong_bytes']:>7}"
            )
        print(
            f"{'':<6}{'LRU/max':<9}{run['lru_dram_hit_rate']:>9.1%} ideal LRU of DRAM's size, "
            f"{run['max_hit_rate']:.1%} at most (first touches miss)"
        )
    print(
        f"hit rate with / without: {ratio_cell(result['hit_rate_ratio'])} (target {TARGET_HITS}x)"
    )


def print_restart(result: dict[str, Any]) -> None:
    """The restart phase's lines."""
    print(
        f"\nrestart: {result['objects']} objects of {result['object_bytes']} B on disk "
        f"(written in {result['build_s']:.1f}s); index recovered in process in "
        f"{result['index_recovered_in_process_s']:.2f}s ({result['index_objects']} objects)"
    )
    print(
        f"server start -> banner {result['banner_s']:.2f}s, disk mounted with all reported "
        f"{_seconds(result['mounted_all_reported_s'])}, first recovered get served "
        f"{_seconds(result['first_get_served_s'])}; recovered {result['reported']}/"
        f"{result['objects']} ({result['recovered_fraction']:.1%}); sample "
        f"{result['sample_good']}/{result['sample']} right, {result['sample_wrong']} wrong"
    )


def print_kill(result: dict[str, Any]) -> None:
    """The kill phase's line."""
    print(
        f"\nkill -9 mid-demotion: {result['puts_completed_before_kill']} puts completed, "
        f"{result['demoted_before_kill']} demoted (as the master saw) before the kill; "
        f"{result['recovered']} read back right after the restart, {result['wrong_bytes']} wrong"
    )


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}s"
