"""``kvconnect bench store``: the store's data path, lookups and master scale, beside Mooncake.

Four phases:

* **data** — per mode (``tcp``: the client owns no memory and every byte crosses TCP to a store
  server process; ``same-host``: the same processes, bytes through shared memory), bytes-API
  ``put``/``get`` and zero-copy ``batch_put_from``/``batch_get_into`` for 4 KiB, 1 MiB and
  16 MiB values, and ``exists`` / ``batch_exists(128)`` latency. kvconnect and Mooncake Store
  (when an interpreter with ``mooncake`` is given) alternate round by round; ratios printed.
* **scale** — a master holding 10k → 10M objects (64-character keys, values 64 B to 64 KiB):
  resident bytes per object and ``batch_exists(128)`` p50 at each size, timed call by call
  beside a master kept at the first size (their ratio: the growth), per key index
  (``--scale-index``: the C table, the Python dict), and Mooncake's master (up to
  ``--scale-mooncake-max`` objects).
* **eviction** — ``exists`` latency while a writer fills a full store (eviction running all the
  time) against the same writer on a store with room (no eviction).
* **throughput** — calls/s the master serves to ``--throughput-processes`` client processes at
  once, beside Mooncake's (:mod:`kvconnect.bench.store_throughput`).

``--tier disk`` runs the disk tier's phases instead (:mod:`kvconnect.bench.disk`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvconnect._config import cluster_token, parse_size
from kvconnect.bench import disk_report, master_load, usage
from kvconnect.bench.baselines.mooncake_engine import find_mooncake_python
from kvconnect.bench.baselines.mooncake_store import MooncakeStoreBaseline
from kvconnect.bench.store_throughput import print_throughput, throughput_phase
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster, Process, free_port
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig

KiB, MiB = 1 << 10, 1 << 20
SLEEPING = "kvconnect-sleeping"  # --poll-ab: every poll window 0
# value size → (batch size, bytes-API ops per round, batch calls per round)
CASES = {4 * KiB: (128, 400, 40), 1 * MiB: (16, 100, 30), 16 * MiB: (4, 16, 8)}
BUFFER = 256 * MiB
SCALE_KEY = "kvconnect-scale-{:048d}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench store``."""
    parser.add_argument("--modes", default="tcp,same-host")
    parser.add_argument("--phases", default="data,scale,eviction,throughput")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds per case")
    parser.add_argument("--scale", default="10000,100000,1000000", help="object counts")
    parser.add_argument(
        "--scale-index", default="native", help="key indexes of the master: native,python"
    )
    parser.add_argument(
        "--scale-mooncake-max", type=int, default=0, help="Mooncake's largest count (0: all)"
    )
    parser.add_argument("--throughput-processes", type=int, default=8)
    parser.add_argument("--throughput-seconds", type=float, default=3.0)
    parser.add_argument("--segment", default="4G", help="store memory (Mooncake; kvconnect 2x)")
    parser.add_argument("--mooncake-python", help="interpreter with the mooncake package")
    parser.add_argument(
        "--poll-ab",
        action="store_true",
        help="data phase: also kvconnect with every poll window 0 (sleeping waits), same run",
    )
    parser.add_argument("--quick", action="store_true", help="a fraction of the work: a smoke run")
    parser.add_argument("--out", default="bench-store.json")
    disk_report.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the chosen phases; print tables; write the JSON report."""
    if args.tier == "disk":
        from kvconnect.bench import disk  # the disk tier's code loads only for --tier disk

        Path(args.out).write_text(json.dumps(disk.run(args), indent=2))
        print(f"\nresults written to {args.out}")
        return 0
    mooncake = find_mooncake_python(args.mooncake_python)
    phases = args.phases.split(",")
    report: dict[str, Any] = {"benchmark": "store", "mooncake": mooncake is not None}
    if "data" in phases:
        report["data"] = {m: _data_phase(m, mooncake, args) for m in args.modes.split(",")}
        _print_data(report["data"])
    if "scale" in phases:
        counts = [int(n) for n in args.scale.split(",") if n]
        indexes = args.scale_index.split(",")
        report["scale"] = _scale_phase(counts, indexes, mooncake, args.scale_mooncake_max)
        _print_scale(report["scale"], indexes)
    if "eviction" in phases:
        report["eviction"] = _eviction_phase(quick=args.quick)
        _print_eviction(report["eviction"])
    if "throughput" in phases:
        seconds = 1.0 if args.quick else args.throughput_seconds
        rounds = 1 if args.quick else args.rounds
        result = throughput_phase(mooncake, args.throughput_processes, seconds, rounds)
        report["throughput"] = result
        print_throughput(result)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nresults written to {args.out}")
    return 0


# ---------------------------------------------------------------------------- data phase


class _Kvconnect:
    """The kvconnect side of the data phase: a store server process, a client here.
    ``poll_window``: every process's poll window (None: the defaults). ``cpu_us`` collects,
    per round, the CPU time per timed call of this process and the store's."""

    def __init__(self, mode: str, segment: int, poll_window: float | None = None) -> None:
        # Twice Mooncake's segment and a short lease: the forced removals between rounds free
        # space only once leases lapse (correct for a cache, slow for back-to-back rounds).
        master_args, server_args = ["--master-lease-ttl", "0.5"], []
        client: dict[str, Any] = {"io_timeout": 60, "rpc_timeout": 10}
        transfer: dict[str, Any] = {"transport": "tcp" if mode == "tcp" else "auto"}
        if poll_window is not None:
            master_args += ["--master-poll-window", str(poll_window)]
            server_args += ["--transfer-poll-window", str(poll_window)]
            client["poll_window"] = transfer["poll_window"] = poll_window
        self.cluster = Cluster(
            servers=1, server_size=2 * segment, master_args=master_args, server_args=server_args
        )
        config = StoreClientConfig(master=self.cluster.master_endpoint, **client)
        self.client = StoreClient(config, TransferConfig.from_mapping(transfer))
        self.client.start()
        self.buffer = self.client.register(np.ones(BUFFER, dtype=np.uint8))
        self.cpu_us: list[float] = []
        self._pids = (self.cluster.master.pid, *(server.pid for server in self.cluster.servers))
        self._round = 0
        self._warm(2 * segment * 0.9)

    def _settle(self) -> None:
        """Wait until the space the last round force-removed is allocatable again (its
        readers' leases lapsed, its store server acknowledged the removals), as Mooncake's is
        at once: a round then never finds its puts answered BUSY."""
        deadline = time.monotonic() + 30
        while any(segment.in_transit for segment in self.client.stats().segments):
            if time.monotonic() > deadline:
                raise RuntimeError("kvconnect's removed space did not come back in 30 s")
            time.sleep(0.01)

    @contextlib.contextmanager
    def _metered(self, calls: int) -> Iterator[None]:
        """Add the CPU per call of the block (``calls`` timed calls) to ``cpu_us``."""
        start = usage.cpu_seconds(self._pids)
        yield
        self.cpu_us.append((usage.cpu_seconds(self._pids) - start) / calls * 1e6)

    def _warm(self, nbytes: float) -> None:
        """Write most of the store once and remove it, as the Mooncake runner's ``warm`` does:
        later timings then exclude first-touch costs on both sides."""
        chunk, count = 64 * MiB, int(nbytes) // (64 * MiB)
        keys = [f"warm-{i}" for i in range(count)]
        for key in keys:
            self.client.batch_put_from([key], self.buffer, [0], [chunk])
        self.client.batch_remove(keys, force=True)

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def run(self, command: dict[str, Any]) -> list[float]:
        op = command["op"]
        self._round += 1
        self._settle()
        prefix = f"r{self._round}-"
        if op in ("put", "get"):
            return self._bytes_api(op, command["size"], command["count"], prefix)
        if op in ("batch_put_from", "batch_get_into"):
            return self._zero_copy(op, command["size"], command["batch"], command["count"], prefix)
        return self._exists(op, command["batch"], command["count"], prefix)

    def _bytes_api(self, op: str, size: int, count: int, prefix: str) -> list[float]:
        value = np.ones(size, dtype=np.uint8).tobytes()
        keys = [f"{prefix}{i}" for i in range(count)]
        seconds = []
        if op == "get":
            for key in keys:
                self.client.put(key, value)
        with self._metered(count):
            for key in keys:
                start = time.perf_counter()
                if op == "put":
                    stored = self.client.put(key, value)
                    seconds.append(time.perf_counter() - start)
                    if stored not in (Code.OK, Code.EXISTS):
                        raise RuntimeError(f"kvconnect put of {size} bytes failed: {stored.name}")
                    continue
                read = self.client.get(key)
                seconds.append(time.perf_counter() - start)
                if read is None or bytes(read) != value:
                    raise RuntimeError(f"kvconnect get of {size} bytes returned wrong data")
        self.client.batch_remove(keys, force=True)
        return seconds

    def _zero_copy(self, op: str, size: int, batch: int, count: int, prefix: str) -> list[float]:
        offsets = [i * size for i in range(batch)]
        sizes = [size] * batch
        calls = [[f"{prefix}{c}-{i}" for i in range(batch)] for c in range(count)]
        if op == "batch_get_into":
            for keys in calls:
                self.client.batch_put_from(keys, self.buffer, offsets, sizes)
        seconds = []
        with self._metered(count):
            for keys in calls:
                start = time.perf_counter()
                if op == "batch_put_from":
                    result = self.client.batch_put_from(keys, self.buffer, offsets, sizes)
                else:
                    result = self.client.batch_get_into(keys, self.buffer, offsets, sizes)
                seconds.append(time.perf_counter() - start)
                if result.leading() != batch:
                    raise RuntimeError(f"kvconnect {op} failed: {set(result.codes)}")
        for keys in calls:
            self.client.batch_remove(keys, force=True)
        return seconds

    def _exists(self, op: str, batch: int, count: int, prefix: str) -> list[float]:
        keys = [f"{prefix}{i}" for i in range(batch)]
        self.client.batch_put_from(keys, self.buffer, [0] * batch, [4 * KiB] * batch)
        seconds = []
        with self._metered(count):
            for n in range(count):
                start = time.perf_counter()
                found = (
                    self.client.batch_exists(keys)
                    if op == "batch_exists"
                    else [self.client.exists(keys[n % batch])]
                )
                seconds.append(time.perf_counter() - start)
                if not all(found):
                    raise RuntimeError("kvconnect exists returned False for a stored key")
        self.client.batch_remove(keys, force=True)
        return seconds


def _commands(quick: bool) -> list[dict[str, Any]]:
    scale = 5 if quick else 1
    commands: list[dict[str, Any]] = []
    for size, (batch, ops, calls) in CASES.items():
        commands.append({"op": "put", "size": size, "count": max(2, ops // scale)})
        commands.append({"op": "get", "size": size, "count": max(2, ops // scale)})
        commands.append(
            {"op": "batch_put_from", "size": size, "batch": batch, "count": max(2, calls // scale)}
        )
        commands.append(
            {"op": "batch_get_into", "size": size, "batch": batch, "count": max(2, calls // scale)}
        )
    commands.append({"op": "exists", "batch": 128, "count": 2000 // scale})
    commands.append({"op": "batch_exists", "batch": 128, "count": 1000 // scale})
    return commands


def _data_phase(mode: str, mooncake: str | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    segment = parse_size(args.segment)
    systems: dict[str, Any] = {"kvconnect": _Kvconnect(mode, segment)}
    try:
        if args.poll_ab:
            systems[SLEEPING] = _Kvconnect(mode, segment, poll_window=0.0)
        if mooncake is not None:
            systems["mooncake"] = MooncakeStoreBaseline(mooncake, mode, segment, BUFFER)
            systems["mooncake"].call({"op": "warm", "fraction": 0.9})
        rounds = 1 if args.quick else args.rounds
        results = []
        for command in _commands(args.quick):
            samples: dict[str, list[list[float]]] = {name: [] for name in systems}
            for n in range(rounds):
                order = list(systems.items()) if n % 2 == 0 else list(reversed(systems.items()))
                for name, system in order:
                    print(
                        f"[{mode}] {name} {_label(command)} round {n + 1}/{rounds}",
                        file=sys.stderr,
                        flush=True,
                    )
                    samples[name].append(system.run(command))
            row = {**command, **{name: _summary(command, runs) for name, runs in samples.items()}}
            for name, system in systems.items():
                if isinstance(system, _Kvconnect):
                    row[name]["cpu_us"] = statistics.median(system.cpu_us)
                    system.cpu_us.clear()
            results.append(row)
        return results
    finally:
        for system in systems.values():
            system.close()


def _summary(command: dict[str, Any], runs: list[list[float]]) -> dict[str, float]:
    per_call = command.get("size", 0) * command.get("batch", 1)
    flat = sorted(s for run in runs for s in run)
    result = {
        "p50_ms": statistics.median(flat) * 1e3,
        "p99_ms": flat[min(len(flat) - 1, int(len(flat) * 0.99))] * 1e3,
    }
    if per_call:
        result["gbps"] = statistics.median(per_call * len(r) / sum(r) / 1e9 for r in runs)
    return result


def _label(command: dict[str, Any]) -> str:
    size = command.get("size")
    text = command["op"] if size is None else f"{command['op']} {_size(size)}"
    return text + (f" x{command['batch']}" if "batch" in command and size else "")


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB}M" if nbytes >= MiB else f"{nbytes // KiB}K"


def _print_data(data: dict[str, list[dict[str, Any]]]) -> None:
    for mode, rows in data.items():
        sleeping = any(SLEEPING in row for row in rows)
        print(f"\nmode {mode}")
        head = f"{'op':<24}{'kvconnect':>22}{'cpu/call':>10}{'mooncake':>22}{'ratio':>8}"
        print(head + (f"{'no polling':>22}{'cpu/call':>10}{'gain':>8}" if sleeping else ""))
        for row in rows:
            ours = row["kvconnect"]
            line = f"{_label(row):<24}{_cell(ours):>22}{_cpu(ours):>10}"
            line += f"{_cell(row.get('mooncake')):>22}{_speedup(ours, row.get('mooncake')):>8}"
            if sleeping:
                asleep = row.get(SLEEPING)
                line += f"{_cell(asleep):>22}{_cpu(asleep):>10}{_speedup(ours, asleep):>8}"
            print(line)


def _speedup(ours: dict[str, float], theirs: dict[str, float] | None) -> str:
    """How many times faster ``ours`` is (throughput, or latency for single calls)."""
    if not theirs:
        return ""
    if "gbps" in ours:
        return f"{ours['gbps'] / theirs['gbps']:.2f}x"
    return f"{theirs['p50_ms'] / ours['p50_ms']:.2f}x"


def _cpu(summary: dict[str, float] | None) -> str:
    if summary is None or "cpu_us" not in summary:
        return "-"
    return f"{summary['cpu_us']:.0f}us"


def _cell(summary: dict[str, float] | None) -> str:
    if summary is None:
        return "-"
    if "gbps" in summary:
        return f"{summary['gbps']:.2f} GB/s {summary['p50_ms']:.2f}ms"
    return f"p50 {summary['p50_ms'] * 1e3:.0f}us p99 {summary['p99_ms'] * 1e3:.0f}us"


# --------------------------------------------------------------------------- scale phase


# The report's name of each key index (``--scale-index``) and its ``MasterConfig.native``.
SCALE_INDEXES = {"native": ("kvconnect", "on"), "python": ("kvconnect-python", "off")}


def _scale_phase(
    counts: list[int], indexes: list[str], mooncake: str | None, mooncake_max: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"objects": n} for n in counts]
    for index in indexes:
        name, native = SCALE_INDEXES[index]
        for row, result in zip(rows, _scale_kvconnect(counts, native), strict=True):
            row[name] = result
    fits = [row for row in rows if not mooncake_max or row["objects"] <= mooncake_max]
    if mooncake is not None and fits:
        runner = MooncakeStoreBaseline(mooncake, "tcp", 256 * MiB, BUFFER)
        try:
            base = runner.call({"op": "master_rss"})["rss"]
            filled = 0
            for row in fits:
                print(f"[scale] mooncake filling to {row['objects']}", file=sys.stderr, flush=True)
                start = time.monotonic()
                runner.call(
                    {
                        "op": "fill",
                        "objects": row["objects"] - filled,
                        "min_size": 64,
                        "max_size": 64 * KiB,
                    }
                )
                filled = row["objects"]
                fill_seconds = time.monotonic() - start
                rss = runner.call({"op": "master_rss"})["rss"]
                seconds = runner.call({"op": "batch_exists_latency", "batch": 128, "count": 2000})[
                    "seconds"
                ]
                row["mooncake"] = {
                    "bytes_per_object": (rss - base) / filled,
                    "rss": rss,
                    "fill_seconds": fill_seconds,
                    **master_load.summary(seconds),
                }
        finally:
            runner.close()
    return rows


def _scale_kvconnect(counts: list[int], native: str) -> list[dict[str, float]]:
    """Fill one master (key index ``native``) to each count in turn and time its lookups
    beside a second master that stays at the first count, call by call in the same moments:
    their ratio is the growth with the object count, not the machine's drift between sizes
    (filling to 10M takes minutes)."""
    results = []
    with contextlib.ExitStack() as stack:
        grows = stack.enter_context(_virtual_master(1 << 50, native))
        stays = stack.enter_context(_virtual_master(1 << 50, native))
        rpc, pid = grows.rpc, grows.pid
        master_load.fill(stays.rpc, 0, counts[0], random.Random(1), 64, 64 * KiB, SCALE_KEY)
        base = master_load.rss_bytes(pid)
        rng = random.Random(0)
        filled = 0
        for count in counts:
            print(f"[scale] kvconnect ({native=}) filling to {count}", file=sys.stderr, flush=True)
            start = time.monotonic()
            master_load.fill(rpc, filled, count - filled, rng, 64, 64 * KiB, SCALE_KEY)
            filled = count
            fill_seconds = time.monotonic() - start
            rss = master_load.rss_bytes(pid)
            grown, same = master_load.lookup_latencies(
                [(rpc, range(count)), (stays.rpc, range(counts[0]))], SCALE_KEY, 128, 2000
            )
            latency = master_load.summary(grown)
            beside = master_load.summary(same)["p50_us"]
            results.append(
                {
                    "bytes_per_object": (rss - base) / count,
                    "rss": rss,
                    "fill_seconds": fill_seconds,
                    **latency,
                    "reference_p50_us": beside,
                    "growth": latency["p50_us"] / beside,
                }
            )
    return results


class _Master(NamedTuple):
    rpc: RpcClient
    pid: int
    endpoint: str


@contextlib.contextmanager
def _virtual_master(capacity: int, native: str | None = None) -> Iterator[_Master]:
    """A master process with a virtual segment of ``capacity`` bytes (key index ``native``,
    default the master's)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--master-listen", endpoint, "--master-heartbeat-ttl", "1e9"]
    if native is not None:
        flags += ["--master-native", native]
    process = Process(["master", *flags], "listening")
    rpc = RpcClient(endpoint, 30.0, token=cluster_token(None, "", False))
    try:
        master_load.mount_virtual(rpc, capacity)
        yield _Master(rpc, process.pid, endpoint)
    finally:
        rpc.close()
        process.stop()


def _print_scale(rows: list[dict[str, Any]], indexes: list[str]) -> None:
    """Per count and system: bytes per object and ``batch_exists(128)`` p50; for kvconnect
    also the p50 of the master kept at the first count, timed beside it, and their ratio."""
    ours = [SCALE_INDEXES[index][0] for index in indexes]
    header = "".join(f"{n + ' B/obj':>24}{'p50 us':>9}{'beside':>9}{'growth':>8}" for n in ours)
    print(f"\n{'objects':>10}{header}{'mooncake B/obj':>24}{'p50 us':>9}")
    nan = float("nan")
    for row in rows:
        line = f"{row['objects']:>10}"
        for name in ours:
            cell = row.get(name, {})
            line += f"{cell.get('bytes_per_object', nan):>24.0f}{cell.get('p50_us', nan):>9.0f}"
            line += f"{cell.get('reference_p50_us', nan):>9.0f}{cell.get('growth', nan):>7.2f}x"
        cell = row.get("mooncake", {})
        line += f"{cell.get('bytes_per_object', nan):>24.0f}{cell.get('p50_us', nan):>9.0f}"
        print(line)


# ------------------------------------------------------------------------ eviction phase


def _eviction_phase(*, quick: bool) -> dict[str, Any]:
    seconds = 3.0 if quick else 10.0
    result: dict[str, Any] = {}
    for label, capacity in (("no_eviction", 1 << 50), ("evicting", 64 * MiB)):
        with _virtual_master(capacity) as master:
            master_load.fill(master.rpc, 0, 14_000, random.Random(1), 4 * KiB, 4 * KiB, SCALE_KEY)
            recent = [(master.rpc, range(13_000, 14_000))]
            (idle,) = master_load.lookup_latencies(recent, SCALE_KEY, 1, 2000)
            writer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvconnect.bench.master_load",
                    master.endpoint,
                    "--seconds",
                    str(seconds),
                ]
            )
            time.sleep(0.5)
            busy: list[float] = []
            end = time.monotonic() + seconds - 1
            while time.monotonic() < end:
                busy += master_load.lookup_latencies(recent, SCALE_KEY, 1, 100, seed=len(busy))[0]
            writer.wait(timeout=60)
            stats = master.rpc.call(m.Stats())
            result[label] = {
                "idle": master_load.summary(idle),
                "with_writer": master_load.summary(busy),
                "evictions": getattr(stats, "evictions", 0),
            }
    return result


def _print_eviction(result: dict[str, Any]) -> None:
    print("\nexists latency (us): idle / while a writer puts (p50 / p99)")
    for label, row in result.items():
        idle, busy = row["idle"], row["with_writer"]
        print(
            f"{label:<12} idle {idle['p50_us']:.0f}/{idle['p99_us']:.0f}  with writer "
            f"{busy['p50_us']:.0f}/{busy['p99_us']:.0f}  evictions {row['evictions']}"
        )
    if {"no_eviction", "evicting"} <= set(result):
        ratio = (
            result["evicting"]["with_writer"]["p99_us"]
            / result["no_eviction"]["with_writer"]["p99_us"]
        )
        print(f"p99 while evicting / p99 with the same writer and no eviction: {ratio:.2f}x")
