"""``kvconnect bench p2p``: a checkpoint from one publisher to N peers, every node in its own
network namespace behind a link of the same rate (tbf, both directions): the swarm (every
peer serves what it has) against every peer pulling from the publisher alone (``--no-share``),
same run, same code, same links. Needs root, iproute2, tc and etcd.

Reported per peer count: the time until the last peer holds the whole object (processes
started together), its ratio to the single-source time and to the ideal (total bytes over the
aggregate rate of the peers' links: ``size / rate``), and how many copies the publisher sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconnect._config import parse_size
from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.bench.netns import Node, Star, unavailable
from kvconnect.store.launch import Process

_CLI = [sys.executable, "-m", "kvconnect.cli", "p2p"]
_MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="2G", help="checkpoint size (default 2G)")
    parser.add_argument("--files", type=int, default=4, help="files it is split into")
    parser.add_argument("--peers", default="4,8", help="peer counts (default 4,8)")
    parser.add_argument("--rate-mbit", type=float, default=400.0, help="every link's rate")
    parser.add_argument("--chunk", default="4M", help="chunk size (default 4M)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each mode")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per fetch")
    parser.add_argument("--json", dest="json_path", help="write the results here")


def run(args: argparse.Namespace) -> int:
    reason = unavailable() or (None if etcd_available() else "needs etcd")
    if reason:
        print(f"kvconnect bench p2p: {reason}", file=sys.stderr)
        return 2
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    counts = [int(p) for p in args.peers.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-p2p-bench-") as scratch:
        root = Path(scratch)
        source = root / "checkpoint"
        digests = write_checkpoint(source, size, args.files)
        token = root / "token"
        token.write_text(secrets.token_hex(32) + "\n")
        token.chmod(0o600)
        for peers in counts:
            with Star(peers + 1, args.rate_mbit) as star:
                bench = _Bench(star.nodes, root, source, digests, token, chunk, args.timeout)
                for number in range(args.runs):
                    for share in (True, False):
                        row = bench.once(peers, share, f"r{number}")
                        row.update(size=size, rate_mbit=args.rate_mbit, chunk=chunk)
                        results.append(row)
                        _print_row(row)
    summary = summarize(results)
    _print_summary(summary)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


def write_checkpoint(root: Path, size: int, files: int) -> dict[str, str]:
    """``files`` files of random bytes adding up to ``size``; their SHA-256 by name."""
    root.mkdir(parents=True)
    digests = {}
    piece = 64 * _MiB
    for index in range(files):
        name = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        left = size // files + (size % files if index == files - 1 else 0)
        hasher = hashlib.sha256()
        with open(root / name, "wb") as handle:
            while left:
                data = os.urandom(min(piece, left))
                hasher.update(data)
                handle.write(data)
                left -= len(data)
        digests[name] = hasher.hexdigest()
    return digests


def _file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while data := handle.read(16 * _MiB):
            hasher.update(data)
    return hasher.hexdigest()


@dataclass
class _Bench:
    nodes: list[Node]
    root: Path
    source: Path
    digests: dict[str, str]
    token: Path
    chunk: int
    timeout: float

    def once(self, peers: int, share: bool, tag: str) -> dict[str, Any]:
        """One distribution to ``peers`` peers; the row of results (files checked)."""
        name = f"ckpt-{tag}-{peers}-{'swarm' if share else 'single'}"
        with EtcdServer(host=self.nodes[0].gateway) as etcd:
            common = ["--etcd", etcd.url, "--token-file", str(self.token)]
            home = self.nodes[0]
            publish = ["p2p", "publish", str(self.source), "--name", name, "--json"]
            publish += ["--chunk-bytes", str(self.chunk), "--listen-host", home.address]
            publisher = Process([*publish, *common], '"version"', timeout=600, netns=home.netns)
            segment = json.loads(publisher.banner)["segment"]
            targets = [self.root / f"{name}-peer{i}" for i in range(1, peers + 1)]
            try:
                started = time.monotonic()
                reports = _fetch_all(
                    self.nodes[1 : peers + 1], targets, name, common, share, self.timeout
                )
                elapsed = time.monotonic() - started
            finally:
                publisher.stop()
        try:
            for target in targets:
                for file, expected in self.digests.items():
                    if _file_digest(target / file) != expected:
                        raise RuntimeError(f"{target / file} differs from the checkpoint")
        finally:
            for target in targets:
                shutil.rmtree(target, ignore_errors=True)
        total = sum(r["bytes"] for r in reports)
        from_publisher = sum(r["by_holder"].get(segment, 0) for r in reports)
        return {
            "peers": peers,
            "mode": "swarm" if share else "single",
            "seconds": elapsed,
            "fetch_seconds": [r["seconds"] for r in reports],
            "failures": sum(r["failures"] for r in reports),  # transfers that went elsewhere
            "publisher_copies": from_publisher / (total / peers),
        }


def _fetch_all(
    nodes: list[Node],
    targets: list[Path],
    name: str,
    common: list[str],
    share: bool,
    timeout: float,
) -> list[dict[str, Any]]:
    """Start one fetcher per node at once; their JSON reports once every one finished."""
    mode = ["--seed"] if share else ["--no-share"]
    procs = []
    for node, target in zip(nodes, targets, strict=True):
        fetch = ["fetch", name, str(target), "--json", "--listen-host", node.address]
        command = node.command([*_CLI, *fetch, "--timeout", str(timeout), *mode, *common])
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        )
    reports: list[dict[str, Any] | None] = [None] * len(procs)

    def read(index: int) -> None:
        stdout = procs[index].stdout
        assert stdout is not None
        line = stdout.readline()
        reports[index] = json.loads(line) if line.strip() else None

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    try:
        for reader in readers:
            reader.join(timeout + 60)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    done = [r for r in reports if r is not None]
    if len(done) != len(procs):
        raise RuntimeError(f"{len(procs) - len(done)} of {len(procs)} fetches did not complete")
    return done


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per peer count: median and range of swarm/single and swarm/ideal over the runs."""
    summary = []
    for peers in sorted({r["peers"] for r in rows}):
        swarm = [r for r in rows if r["peers"] == peers and r["mode"] == "swarm"]
        single = [r for r in rows if r["peers"] == peers and r["mode"] == "single"]
        first = swarm[0]
        ideal = first["size"] * 8 / (first["rate_mbit"] * 1e6)
        ratios = [s["seconds"] / b["seconds"] for s, b in zip(swarm, single, strict=True)]
        to_ideal = [s["seconds"] / ideal for s in swarm]
        summary.append(
            {
                "peers": peers,
                "ideal_seconds": ideal,
                "swarm_seconds": statistics.median(s["seconds"] for s in swarm),
                "single_seconds": statistics.median(b["seconds"] for b in single),
                "swarm_over_single": statistics.median(ratios),
                "swarm_over_single_range": [min(ratios), max(ratios)],
                "swarm_over_ideal": statistics.median(to_ideal),
                "swarm_over_ideal_range": [min(to_ideal), max(to_ideal)],
                "publisher_copies_swarm": statistics.median(s["publisher_copies"] for s in swarm),
            }
        )
    return summary


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"peers {row['peers']:2d} {row['mode']:6s} {row['seconds']:7.1f} s "
        f"(publisher sent {row['publisher_copies']:.2f} copies)",
        flush=True,
    )


def _print_summary(summary: list[dict[str, Any]]) -> None:
    print("\npeers  ideal s  swarm s  single s  swarm/single  swarm/ideal  publisher copies")
    for s in summary:
        low, high = s["swarm_over_single_range"]
        print(
            f"{s['peers']:5d}  {s['ideal_seconds']:7.1f}  {s['swarm_seconds']:7.1f}  "
            f"{s['single_seconds']:8.1f}  {s['swarm_over_single']:5.2f} ({low:.2f}-{high:.2f})"
            f"  {s['swarm_over_ideal']:5.2f}        {s['publisher_copies_swarm']:.2f}"
        )
