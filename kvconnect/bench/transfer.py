"""``kvconnect bench transfer``: engine throughput between two processes, beside baselines.

For each transport, op and (block, count) case, it alternates runs of kvconnect and of each
baseline (A/B, B/A, …) so drift on a shared machine hits both alike, and reports GB/s (median of
the runs), per-batch p50/p99 and ratios kvconnect / baseline. Bytes are verified once per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvconnect._config import parse_size
from kvconnect.bench.baselines import Baseline
from kvconnect.bench.baselines.memcpy import MemcpyBaseline
from kvconnect.bench.baselines.mooncake_engine import MooncakeBaseline, find_mooncake_python
from kvconnect.bench.baselines.socket_pair import SocketBaseline
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    MemoryRegion,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
)
from kvconnect.transfer.config import NativeMode
from kvconnect.transfer.datapath.iov import native_available

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_CASES = "64K:128,1M:64,16M:8"


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One measured configuration."""

    transport: str
    op: str
    block: int
    count: int

    @property
    def label(self) -> str:
        return f"{self.transport} {self.op} {_size(self.block)}x{self.count}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench transfer``."""
    parser.add_argument("--transports", default="tcp,shm", help="comma list of tcp, shm, rdma")
    parser.add_argument("--ops", default="read,write", help="comma list of read, write")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="block:count,… (K/M suffixes)")
    parser.add_argument("--runs", type=int, default=5, help="A/B rounds per case (median)")
    parser.add_argument("--batches", type=int, default=10, help="batches per run")
    parser.add_argument("--native", type=NativeMode, choices=list(NativeMode), default="auto")
    parser.add_argument("--streams", type=int, help="TCP streams per peer (config default)")
    parser.add_argument("--slice-bytes", type=parse_size, help="slice size (config default)")
    parser.add_argument(
        "--baselines",
        default="auto",
        help="auto or comma list: socket,memcpy,mooncake,perftest,none",
    )
    parser.add_argument("--mooncake-python", help="interpreter with the mooncake package")
    parser.add_argument("--quick", action="store_true", help="2 runs of 3 batches: a smoke run")
    parser.add_argument("--out", default="bench-transfer.json", help="JSON result file")
    parser.add_argument("--plot", nargs="?", const="bench-transfer.png", help="write a PNG chart")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status."""
    runs, batches = (2, 3) if args.quick else (args.runs, args.batches)
    cases = [
        Case(t, op, block, count)
        for t in _split(args.transports)
        for block, count in _parse_cases(args.cases)
        for op in _split(args.ops)
    ]
    overrides: dict[str, Any] = {"native": args.native}
    if args.streams:
        overrides["tcp_streams"] = args.streams
    if args.slice_bytes:
        overrides["slice_bytes"] = args.slice_bytes
    buffer_bytes = max(c.block * c.count for c in cases)
    progress = _Progress(len(cases) * runs)
    results = []
    with _Harness(buffer_bytes, overrides, args) as harness:
        for case in cases:
            results.append(harness.measure(case, runs, batches, progress))
    progress.finish()
    report: dict[str, Any] = {
        "benchmark": "transfer",
        "machine": {
            "python": platform.python_version(),
            "cpus": _cpus(),
            "native": native_available(),
        },
        "settings": {"runs": runs, "batches": batches, **overrides},
        "results": results,
    }
    if "rdma" in _split(args.transports):
        from kvconnect.bench.rdma import registration_seconds

        report["registration"] = registration_seconds([buffer_bytes, 1 << 30])
        for row in report["registration"]:
            print(f"MR registration of {_size(row['bytes'])}: {row['seconds'] * 1e3:.1f} ms")
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(format_table(results))
    print(f"\nresults written to {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"chart written to {args.plot}")
    return 0


class _Harness:
    """The target process, the initiator engine, and the baselines, for the whole run."""

    def __init__(self, buffer_bytes: int, overrides: dict[str, Any], args: argparse.Namespace):
        self.buffer_bytes = buffer_bytes
        self.overrides = overrides
        self.args = args
        self.engines: dict[str, TransferEngine] = {}
        self.locals: dict[str, MemoryRegion] = {}
        self.baselines: dict[str, Baseline] = {}
        self.peer: PeerProcess | None = None

    def __enter__(self) -> _Harness:
        peer_config = {"native": self.overrides["native"]}
        self.peer = PeerProcess(config=peer_config, shared=self.buffer_bytes, seed=1, timeout=120)
        for transport in _split(self.args.transports):
            engine = TransferEngine(
                TransferConfig.from_mapping({"transport": transport, **self.overrides})
            )
            engine.start()
            self.engines[transport] = engine
            self.locals[transport] = engine.register(np.ones(self.buffer_bytes, dtype=np.uint8))
        for name in _baseline_names(self.args):
            self.baselines[name] = self._baseline(name)
        return self

    def __exit__(self, *exc: object) -> None:
        for baseline in self.baselines.values():
            baseline.close()
        for engine in self.engines.values():
            engine.close()
        if self.peer is not None:
            self.peer.close()

    def _baseline(self, name: str) -> Baseline:
        if name == "socket":
            return SocketBaseline(self.buffer_bytes)
        if name == "memcpy":
            return MemcpyBaseline(self.buffer_bytes)
        if name == "perftest":
            from kvconnect.bench.baselines.perftest import PerftestBaseline

            return PerftestBaseline()
        python = find_mooncake_python(self.args.mooncake_python)
        assert python is not None
        return MooncakeBaseline(python, self.buffer_bytes)

    def measure(self, case: Case, runs: int, batches: int, progress: _Progress) -> dict[str, Any]:
        self._verify(case)
        relevant = [b for n, b in self.baselines.items() if _applies(n, case.transport)]
        ours: list[list[float]] = []
        theirs: dict[str, list[list[float]]] = {b.name: [] for b in relevant}
        for round_ in range(runs):
            progress.step(f"{case.label} round {round_ + 1}/{runs}")
            order: list[Callable[[], None]] = [lambda: ours.append(self._kvconnect(case, batches))]
            for baseline in relevant:
                order.append(
                    lambda b=baseline: theirs[b.name].append(
                        b.run(case.op, case.block, case.count, batches)
                    )  # type: ignore[misc]
                )
            for step in order if round_ % 2 == 0 else reversed(order):
                step()
        nbytes = case.block * case.count
        result: dict[str, Any] = {**dataclasses.asdict(case), "kvconnect": _summary(ours, nbytes)}
        result["baselines"] = {}
        for name, samples in theirs.items():
            summary = _summary(samples, nbytes)
            summary["ratio"] = result["kvconnect"]["gbps"] / summary["gbps"]
            result["baselines"][name] = summary
        return result

    def _requests(self, case: Case) -> list[TransferRequest]:
        assert self.peer is not None
        local = self.locals[case.transport]
        region = self.peer.regions["shared"]
        return [
            TransferRequest(
                local, i * case.block, self.peer.name, region, i * case.block, case.block
            )
            for i in range(case.count)
        ]

    def _kvconnect(self, case: Case, batches: int) -> list[float]:
        engine = self.engines[case.transport]
        requests = self._requests(case)
        op = TransferOp(case.op)
        seconds = []
        for _ in range(batches):
            start = time.perf_counter()
            engine.transfer(op, requests, timeout=120)
            seconds.append(time.perf_counter() - start)
        return seconds

    def _verify(self, case: Case) -> None:
        """Prove the bytes really move: read the seeded target, write a fresh pattern back."""
        assert self.peer is not None
        engine = self.engines[case.transport]
        local = self.locals[case.transport]
        nbytes = case.block * case.count
        self.peer.fill("shared", 1)
        engine.transfer(TransferOp.READ, self._requests(case), timeout=120)
        if local.view[:nbytes] != pattern(1, self.buffer_bytes)[:nbytes].data:
            raise RuntimeError(f"{case.label}: READ returned wrong bytes")
        local.view[:nbytes] = pattern(2, nbytes).data
        engine.transfer(TransferOp.WRITE, self._requests(case), timeout=120)
        if self.peer.sha256("shared", 0, nbytes) != hashlib.sha256(local.view[:nbytes]).hexdigest():
            raise RuntimeError(f"{case.label}: WRITE stored wrong bytes")


def _applies(baseline: str, transport: str) -> bool:
    return {"socket": "tcp", "mooncake": "tcp", "memcpy": "shm", "perftest": "rdma"}[
        baseline
    ] == transport


def _baseline_names(args: argparse.Namespace) -> list[str]:
    if args.baselines == "none":
        return []
    if args.baselines != "auto":
        return _split(args.baselines)
    names = ["socket", "memcpy"]
    if find_mooncake_python(args.mooncake_python) is not None:
        names.append("mooncake")
    if "rdma" in _split(args.transports):
        from kvconnect.bench.baselines.perftest import perftest_available

        if perftest_available():
            names.append("perftest")
    return names


def _summary(runs: list[list[float]], nbytes: int) -> dict[str, Any]:
    per_run = [nbytes * len(r) / sum(r) / 1e9 for r in runs]
    latencies = sorted(s for r in runs for s in r)
    return {
        "gbps": statistics.median(per_run),
        "gbps_runs": per_run,
        "p50_ms": _percentile(latencies, 50) * 1e3,
        "p99_ms": _percentile(latencies, 99) * 1e3,
    }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(sorted_values), q))


def format_table(results: list[dict[str, Any]]) -> str:
    """Human-readable result table with ratios."""
    lines = [
        f"{'case':<26}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}   baselines (GB/s, kvconnect/baseline)",
    ]
    for r in results:
        case = Case(r["transport"], r["op"], r["block"], r["count"])
        k = r["kvconnect"]
        extra = "  ".join(
            f"{name} {b['gbps']:.2f} ({b['ratio']:.2f}x)" for name, b in r["baselines"].items()
        )
        lines.append(
            f"{case.label:<26}{k['gbps']:>8.2f}{k['p50_ms']:>9.2f}{k['p99_ms']:>9.2f}   {extra}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Bar chart of GB/s per case, kvconnect beside each baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [Case(r["transport"], r["op"], r["block"], r["count"]).label for r in results]
    series = {"kvconnect": [r["kvconnect"]["gbps"] for r in results]}
    for name in sorted({n for r in results for n in r["baselines"]}):
        series[name] = [r["baselines"].get(name, {}).get("gbps", math.nan) for r in results]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.2), 5))
    for n, (name, values) in enumerate(series.items()):
        ax.bar([i + n * width for i in range(len(labels))], values, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s (median of runs)")
    ax.set_title("kvconnect bench transfer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class _Progress:
    """One status line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.tty = sys.stderr.isatty()

    def step(self, text: str) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for part in _split(text):
        block, _, count = part.partition(":")
        cases.append((parse_size(block), int(count or 1)))
    return cases


def _size(nbytes: int) -> str:
    for unit, size in (("M", MiB), ("K", KiB)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _cpus() -> int:
    import os

    return os.cpu_count() or 0
