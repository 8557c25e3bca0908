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
import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect._config import parse_size
from kvconnect.bench.baselines import direct_io
from kvconnect.bench.baselines.mooncake_engine import find_mooncake_python
from kvconnect.bench.baselines.mooncake_store import MooncakeStoreBaseline
from kvconnect.bench.disk_raw import RawCase
from kvconnect.bench.disk_report import (
    DiskPhase,
    lru_hit_rate,
    percentile,
    print_kill,
    print_raw,
    print_restart,
    print_zipf,
    ratio,
    raw_row,
    zipf_trace,
)
from kvconnect.bench.disk_restart import (
    REFUSED,
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen disk phases; print tables; return the report (the caller writes it)."""
    phases = [DiskPhase(p) for p in args.disk_phases.split(",") if p]
    rounds = 1 if args.quick else args.rounds
    report: dict[str, Any] = {"benchmark": "store --tier disk", "baseline": direct_io.tool()}
    root = Path(tempfile.mkdtemp(prefix="kvconnect-bench-disk-", dir=args.disk_dir))
    try:
        if DiskPhase.RAW in phases:
            depths = [int(d) for d in args.disk_depths.split(",")]
            total, dram = parse_size(args.disk_bytes), parse_size(args.disk_dram)
            # demoted DRAM is reusable once the server acknowledged its release and eviction
            # frees evict_fraction a round: defaults (0.5 s, 5 %) would bound the demotion
            # rate, not the disk
            server = ["--store-heartbeat-interval", str(args.disk_heartbeat)]
            master = ["--master-evict-fraction", str(args.disk_evict_fraction)]
            report["raw_store_flags"] = [*server, *master]
            report["raw"] = [
                raw_row(
                    size,
                    depths,
                    RawCase(_fresh(root, "raw"), size, total, dram, depths, server, master).run(
                        rounds
                    ),
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
            report["kill"] = kill_phase(_fresh(root, "kill"), args.kill_objects, args.seed)
            print_kill(report["kill"])
        if DiskPhase.MOONCAKE in phases:
            python = find_mooncake_python(args.mooncake_python)
            objects = 128 if args.quick else 256  # 2x / 4x its store
            report["mooncake"] = mooncake_offload(python, _fresh(root, "mooncake"), objects)
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
            result[side] = _zipf_run(trace, measured_from, dram, flags, args)
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
    trace: Sequence[int],
    measured_from: int,
    dram: int,
    flags: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Replay ``trace`` on a fresh store of ``dram`` bytes (``flags``: its disk, if any): get
    each key, put it on a miss. Hits and get latencies of ``trace[measured_from:]``. Both sides
    run the eviction loop of the raw phase (``--disk-heartbeat``, ``--disk-evict-fraction``):
    with the defaults most puts into the full DRAM are refused BUSY while evicted space comes
    back, on both sides, and the loop rather than the tiers would be compared."""
    source = source_bytes(args.seed)
    size = ZIPF_OBJECT
    server = [*flags, "--store-heartbeat-interval", str(args.disk_heartbeat)]
    # reads lease what they read for lease-ttl: 0.5 s (default 10 s) lets a small DRAM evict
    master = ["--master-lease-ttl", "0.5", "--master-evict-fraction", str(args.disk_evict_fraction)]
    with store(dram, server, master) as (_cluster, client):
        src = client.register(source)
        dest = np.zeros(size, dtype=np.uint8)
        into = client.register(dest)
        gets: list[float] = []
        hit_gets: list[float] = []
        wrong = refused = 0
        for n, index in enumerate(trace):
            key = f"zipf-{index}"
            start = time.perf_counter()
            code = client.batch_get_into([key], into, [0], [size]).codes[0]
            seconds = time.perf_counter() - start
            if code == Code.OK:
                at = object_offset(index, size)
                wrong += not np.array_equal(dest, source[at : at + size])
            else:
                refused += not _put_one(client, src, key, object_offset(index, size), size)
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
        "puts_refused": refused,
    }


def _put_one(client: StoreClient, region: MemoryRegion, key: str, offset: int, size: int) -> bool:
    """Put one object; False when the full store refused it for now (BUSY: its space still in
    transit; NO_SPACE: an eviction round started), which a cache takes as "not cached"; raises
    on anything else."""
    code = client.batch_put_from([key], region, [offset], [size]).codes[0]
    if code in REFUSED:
        return False
    if code not in (Code.OK, Code.EXISTS):
        raise RuntimeError(f"a put of the zipf phase failed: {code.name}")
    return True


# ------------------------------------------------------------------------ mooncake phase

# What Mooncake's SSD offload needs from its binaries (its master's and real client's flags).
MOONCAKE_MASTER_FLAGS = ("enable_offload", "offload_on_evict", "promotion_on_hit")
MOONCAKE_CLIENT_FLAGS = ("enable_offload", "start_offload_rpc_server")
MOONCAKE_SEGMENT = 64 * MiB
_MOONCAKE_PROBE = (
    "import importlib.metadata as md, json, mooncake, os; "
    "names = md.packages_distributions().get('mooncake', []); "
    "print(json.dumps({'dir': os.path.dirname(mooncake.__file__), "
    "'wheel': [f'{n} {md.version(n)}' for n in names]}))"
)


def mooncake_offload(python: str | None, directory: Path, objects: int) -> dict[str, Any]:
    """Mooncake's SSD offload, as far as its wheel gets: its distribution, which offload flags
    its ``mooncake_master`` and ``mooncake_client`` accept and, when they all are there, a run
    (``objects`` puts of 1 MiB into a 64 MiB store offloading to ``directory``: bytes on disk,
    write GB/s, early objects read back). ``reason`` says in words what happened."""
    if python is None:
        return {"available": False, "run": False, "reason": "no interpreter with mooncake"}
    probe = subprocess.run(
        [python, "-c", _MOONCAKE_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    info = json.loads(probe.stdout)
    package = Path(info["dir"])
    result: dict[str, Any] = {
        "available": True,
        "wheel": info["wheel"],
        "master_flags": _flags(package / "mooncake_master", MOONCAKE_MASTER_FLAGS),
        "client_flags": _flags(package / "mooncake_client", MOONCAKE_CLIENT_FLAGS),
    }
    missing = [f"master --{f}" for f in MOONCAKE_MASTER_FLAGS if f not in result["master_flags"]]
    missing += [f"client --{f}" for f in MOONCAKE_CLIENT_FLAGS if f not in result["client_flags"]]
    if missing:
        return {**result, "run": False, "reason": f"the wheel lacks {', '.join(missing)}"}
    runner = MooncakeStoreBaseline(
        python, "same-host", MOONCAKE_SEGMENT, 16 * MiB, ["--offload", str(directory)]
    )
    try:
        run = runner.call({"op": "offload", "size": MiB, "count": objects, "wait": 20.0})
    finally:
        runner.close()
    result.update(run, run=True)
    if run["disk_bytes"]:
        result["write_gbps"] = run["disk_bytes"] / run["seconds"] / 1e9
        result["reason"] = "offloaded (see disk_bytes, write_gbps, early_read_right)"
    else:
        result["reason"] = (
            f"offload on: master --enable_offload --offload_on_evict, mooncake_client "
            f"--enable_offload, bucket backend in the run's directory; {objects} puts of 1 MiB "
            f"into {MOONCAKE_SEGMENT // MiB} MiB (codes {run['put_codes']}) left 0 bytes on "
            f"disk within 20 s and {run['early_read_right']}/{run['early_checked']} of the "
            "first objects readable: nothing to measure"
        )
    return result


def _flags(binary: Path, wanted: Sequence[str]) -> list[str]:
    """Which of ``wanted`` the gflags ``--help`` of ``binary`` lists."""
    if not binary.exists():
        return []
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    text = out.stdout + out.stderr
    return [flag for flag in wanted if f"-{flag} " in text]
