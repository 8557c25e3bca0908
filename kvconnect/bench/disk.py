"""``kvconnect bench store --tier disk``: the store's disk tier beside a raw disk baseline,
a working set larger than DRAM with and without the tier, restarts, and Mooncake's offload.

Phases (``--disk-phases``, each runnable alone; everything on the file system of
``--disk-dir``):

* **raw** — per object size (64 KiB, 1 MiB, 4 MiB), round by round: the raw baseline
  (:mod:`~kvconnect.bench.baselines.direct_io`: fio, or an O_DIRECT loop) writing and reading
  a file at each ``--disk-depths`` concurrency; the real ``DiskTier`` in this process writing
  (demotions from memory, until durable) and reading (verified) the same bytes; and a real
  store (small DRAM and a disk) taking puts beyond its DRAM: write GB/s = bytes the master saw
  demoted per second, read GB/s = ``batch_get_into`` of disk-resident objects (bytes checked).
  Ratios tier / best baseline.
* **zipf** — a working set 4x DRAM, keys drawn from a seeded Zipf(s) distribution, each access
  a get and, on a miss, a put (what an engine does after recomputing): hit rate and get
  latency p50/p99 of the second half of the trace, with the disk tier and without (same DRAM),
  beside an ideal LRU of DRAM's size on the same trace.
* **restart**, **kill** — :mod:`kvconnect.bench.disk_restart`.
* **mooncake** — what the Mooncake wheel offers for SSD offload (flags of its master and real
  client), recorded as data; Mooncake's offload is not run (see the report's ``reason``).
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect.bench.baselines import direct_io
from kvconnect.bench.baselines.mooncake_engine import find_mooncake_python
from kvconnect.bench.disk_raw import RawCase
from kvconnect.bench.disk_restart import (
    disk_flags,
    kill_phase,
    object_offset,
    restart_phase,
    source_bytes,
    store,
)
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import Code
from kvconnect.transfer import MemoryRegion

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
OBJECT_SIZES = (64 * KiB, 1 * MiB, 4 * MiB)
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
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--zipf-dram", default="64M", help="the store's DRAM (zipf phase)")
    parser.add_argument("--zipf-accesses", type=int, default=6000)
    parser.add_argument("--restart-objects", type=int, default=1_000_000)
    parser.add_argument("--kill-objects", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, parse_size: Callable[[str], int]) -> dict[str, Any]:
    """Run the chosen disk phases (``parse_size``: "1G" → bytes); print tables; return the
    report (the caller writes it)."""
    phases = [DiskPhase(p) for p in args.disk_phases.split(",") if p]
    rounds = 1 if args.quick else args.rounds
    report: dict[str, Any] = {"benchmark": "store --tier disk", "baseline": direct_io.tool()}
    root = Path(tempfile.mkdtemp(prefix="kvconnect-bench-disk-", dir=args.disk_dir))
    try:
        if DiskPhase.RAW in phases:
            depths = [int(d) for d in args.disk_depths.split(",")]
            total, dram = parse_size(args.disk_bytes), parse_size(args.disk_dram)
            report["raw"] = [
                raw_row(
                    size,
                    depths,
                    RawCase(_fresh(root, "raw"), size, total, dram, depths).run(rounds),
                )
                for size in OBJECT_SIZES
            ]
            print_raw(report["raw"])
        if DiskPhase.ZIPF in phases:
            report["zipf"] = _zipf_phase(root, args, parse_size(args.zipf_dram), rounds)
            print_zipf(report["zipf"])
        if DiskPhase.RESTART in phases:
            report["restart"] = restart_phase(
                _fresh(root, "restart"), args.restart_objects, 64 * MiB, args.seed
            )
            print_restart(report["restart"])
        if DiskPhase.KILL in phases:
            report["kill"] = kill_phase(
                _fresh(root, "kill"), args.kill_objects, 32 * MiB, args.seed
            )
            print_kill(report["kill"])
        if DiskPhase.MOONCAKE in phases:
            report["mooncake"] = mooncake_offload(find_mooncake_python(args.mooncake_python))
            print(f"\nmooncake SSD offload: {report['mooncake']['reason']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _fresh(root: Path, name: str) -> Path:
    """An empty directory ``root/name`` (what an earlier case left there removed)."""
    directory = root / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    return directory


# ------------------------------------------------------------------------ pure helpers


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


# ---------------------------------------------------------------------------- zipf phase


ZIPF_OBJECT = 256 * KiB


def _zipf_phase(root: Path, args: argparse.Namespace, dram: int, rounds: int) -> dict[str, Any]:
    """Per round (seed + round): the same Zipf trace against a store without and one with the
    disk tier (order alternating), and an ideal LRU of DRAM's size."""
    keys = 4 * dram // ZIPF_OBJECT
    accesses = max(40, args.zipf_accesses // (10 if args.quick else 1))
    measured_from = accesses // 2
    runs: list[dict[str, Any]] = []
    for n in range(rounds):
        trace = zipf_trace(keys, accesses, args.zipf_s, args.seed + n)
        sides = ["without", "with"] if n % 2 == 0 else ["with", "without"]
        result: dict[str, Any] = {
            "lru_dram_hit_rate": lru_hit_rate(trace, dram // ZIPF_OBJECT, measured_from),
            "max_hit_rate": 1
            - len(set(trace[measured_from:]) - set(trace[:measured_from]))
            / (accesses - measured_from),
        }
        for side in sides:
            log.info("zipf round %d/%d: %s the disk tier", n + 1, rounds, side)
            directory = _fresh(root, "zipf")
            flags = disk_flags(directory, 2 * keys * ZIPF_OBJECT) if side == "with" else []
            result[side] = _zipf_run(trace, measured_from, dram, flags, args.seed)
        runs.append(result)
    return {
        "object_bytes": ZIPF_OBJECT,
        "dram": dram,
        "working_set": keys * ZIPF_OBJECT,
        "s": args.zipf_s,
        "accesses": accesses,
        "measured": accesses - measured_from,
        "rounds": runs,
        "hit_rate_ratio": ratio(
            [r["with"]["hit_rate"] for r in runs], [r["without"]["hit_rate"] for r in runs]
        ),
    }


def _zipf_run(
    trace: Sequence[int], measured_from: int, dram: int, flags: list[str], seed: int
) -> dict[str, Any]:
    """Replay ``trace`` on a fresh store of ``dram`` bytes (``flags``: its disk, if any): get
    each key, put it on a miss. Hits and get latencies of ``trace[measured_from:]``."""
    source = source_bytes(seed)
    size = ZIPF_OBJECT
    with store(dram, flags) as (_cluster, client):
        src = client.register(source)
        dest = np.zeros(size, dtype=np.uint8)
        into = client.register(dest)
        gets: list[float] = []
        hit_gets: list[float] = []
        wrong = 0
        for n, index in enumerate(trace):
            key = f"zipf-{index}"
            start = time.perf_counter()
            code = client.batch_get_into([key], into, [0], [size]).codes[0]
            seconds = time.perf_counter() - start
            if code == Code.OK:
                at = object_offset(index, size)
                wrong += not np.array_equal(dest, source[at : at + size])
            else:
                _put_one(client, src, key, object_offset(index, size), size)
            if n >= measured_from:
                gets.append(seconds)
                if code == Code.OK:
                    hit_gets.append(seconds)
        client.engine.unregister(into)
        client.engine.unregister(src)
    return {
        "hit_rate": len(hit_gets) / max(1, len(gets)),
        "get_p50_ms": percentile(gets, 0.5) * 1e3,
        "get_p99_ms": percentile(gets, 0.99) * 1e3,
        "hit_p50_ms": percentile(hit_gets, 0.5) * 1e3,
        "hit_p99_ms": percentile(hit_gets, 0.99) * 1e3,
        "wrong_bytes": wrong,
    }


def _put_one(client: StoreClient, region: MemoryRegion, key: str, offset: int, size: int) -> None:
    code = client.batch_put_from([key], region, [offset], [size]).codes[0]
    if code not in (Code.OK, Code.EXISTS):
        raise RuntimeError(f"a put of the zipf phase failed: {code.name}")


# ------------------------------------------------------------------------ mooncake phase

# What Mooncake's SSD offload needs from its binaries (its master's and real client's flags).
MOONCAKE_MASTER_FLAGS = ("enable_offload", "offload_on_evict", "promotion_on_hit", "root_fs_dir")
MOONCAKE_CLIENT_FLAGS = ("enable_offload", "start_offload_rpc_server")
_MOONCAKE_PROBE = (
    "import importlib.metadata as md, json, mooncake, os; "
    "names = md.packages_distributions().get('mooncake', []); "
    "print(json.dumps({'dir': os.path.dirname(mooncake.__file__), "
    "'wheel': [f'{n} {md.version(n)}' for n in names]}))"
)


def mooncake_offload(python: str | None) -> dict[str, Any]:
    """What the Mooncake wheel of ``python`` offers for SSD offload, as data: its
    distribution, which offload flags its ``mooncake_master`` and ``mooncake_client`` accept,
    and why it is not run side by side (``reason``)."""
    if python is None:
        return {"available": False, "run": False, "reason": "no interpreter with mooncake"}
    probe = subprocess.run(
        [python, "-c", _MOONCAKE_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    info = json.loads(probe.stdout)
    package = Path(info["dir"])
    found = {
        "master": _flags(package / "mooncake_master", MOONCAKE_MASTER_FLAGS),
        "client": _flags(package / "mooncake_client", MOONCAKE_CLIENT_FLAGS),
    }
    missing = [f for f in MOONCAKE_MASTER_FLAGS[:2] if f not in found["master"]]
    missing += [f"client {f}" for f in MOONCAKE_CLIENT_FLAGS[:1] if f not in found["client"]]
    reason = (
        f"the wheel lacks {', '.join(missing)}"
        if missing
        else "the wheel has local-disk offload (master --enable_offload --offload_on_evict, "
        "mooncake_client --enable_offload, MOONCAKE_OFFLOAD_* environment); not run: "
        "kvconnect's Mooncake runner does not drive its offload yet"
    )
    return {
        "available": True,
        "wheel": info["wheel"],
        "master_flags": found["master"],
        "client_flags": found["client"],
        "run": False,
        "reason": reason,
    }


def _flags(binary: Path, wanted: Sequence[str]) -> list[str]:
    """Which of ``wanted`` the gflags ``--help`` of ``binary`` lists."""
    if not binary.exists():
        return []
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    text = out.stdout + out.stderr
    return [flag for flag in wanted if f"-{flag} " in text]


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
                f"{side} {cell(row[f'{side}_{op}'])} ({row[f'{side}_{op}_ratio']['median']:.2f}x)"
                for side in ("tier", "store")
                if f"{side}_{op}_ratio" in row
            )
            print(f"{label:>7} {op:<5} raw {baselines}  |  {sides}")


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
    ratios = result["hit_rate_ratio"]
    print(
        f"hit rate with / without: {ratios['median']:.2f}x "
        f"({ratios['min']:.2f}-{ratios['max']:.2f}; target {TARGET_HITS}x)"
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
