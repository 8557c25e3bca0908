"""``kvconnect bench federation``: two complete store clusters (own masters, store servers and
tokens, real processes) serving two inference groups whose requests share prefixes — a set of
system prompts with Zipf popularity, each request routed to either group at random.

Each run, on the same clusters, in its own key namespace:

- **isolated**: each group's client knows only its home cluster; a request reads the leading
  pages of its prefix its home has (``batch_exists`` then ``batch_get_into``) and writes the
  rest home (as an engine does after computing them);
- **federated**: the same trace, each client with the other cluster as its peer;
- **one cache** (computed from the trace, no store): the hit rate of one never-evicting cache
  both groups share, the bound no federation of the two can pass;
- **faults**: the first group's client (peer: the second cluster) reads a prefix set stored
  half at home, half at the peer, while the peer is healthy, SIGSTOPped (its master and store
  server) and killed; the first read after each fault (the one bounded attempt) is reported
  apart.

Reported: the page hit rate of each mode and their ratio, read latency (lookup and read) p50
and p99, and the home-hit requests' latency with the peer healthy, stopped and killed. Every
page read is checked against the bytes its writer stored (derived from its key), untimed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import secrets
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconnect._config import parse_size
from kvconnect.bench.disk_report import percentile, ratio, spread
from kvconnect.store.client import StoreClient
from kvconnect.store.config import PeerConfig, StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.memory import MemoryRegion

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench federation``."""
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefixes", type=int, default=400, help="distinct shared prefixes")
    parser.add_argument("--requests", type=int, default=800, help="requests per mode")
    parser.add_argument("--pages", type=int, default=8, help="pages per prefix")
    parser.add_argument("--page-bytes", type=int, default=64 * 1024)
    parser.add_argument("--zipf", type=float, default=0.6, help="popularity exponent (0: flat)")
    parser.add_argument("--fault-requests", type=int, default=2000, help="reads per fault phase")
    parser.add_argument("--server-size", type=parse_size, default=2048 * MiB, help="e.g. 2G")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench-federation.json")


@dataclass(frozen=True, slots=True)
class Shape:
    """The workload's size."""

    prefixes: int
    requests: int
    pages: int
    page_bytes: int
    zipf: float


class _Group:
    """One inference group's client, with a buffer of one prefix registered."""

    def __init__(self, cluster: Cluster, peers: tuple[PeerConfig, ...], shape: Shape) -> None:
        config = StoreClientConfig(master=cluster.master_endpoint, peers=peers, io_timeout=2.0)
        self.client = StoreClient(config, TransferConfig(token_file=cluster.token_file))
        self.client.start()
        self.buffer = bytearray(shape.pages * shape.page_bytes)
        self.region: MemoryRegion = self.client.register(self.buffer)
        self.offsets = [i * shape.page_bytes for i in range(shape.pages)]
        self.sizes = [shape.page_bytes] * shape.pages

    def serve(self, keys: list[str], *, write: bool) -> tuple[int, float]:
        """One request: the leading pages found (and read), the seconds that took; the
        missing pages written home when ``write``."""
        started = time.perf_counter()
        found = self.client.batch_exists(keys)
        hits = found.index(False) if False in found else len(keys)
        if hits:
            got = self.client.batch_get_into(
                keys[:hits], self.region, self.offsets[:hits], self.sizes[:hits]
            )
            hits = got.leading()
        took = time.perf_counter() - started
        for key, offset, size in zip(keys[:hits], self.offsets, self.sizes, strict=False):
            if self.buffer[offset : offset + size] != _page(key, size):
                raise RuntimeError(f"page {key} came back with other bytes")
        if write and hits < len(keys):
            for key, offset, size in zip(
                keys[hits:], self.offsets[hits:], self.sizes[hits:], strict=True
            ):
                self.buffer[offset : offset + size] = _page(key, size)
            put = self.client.batch_put_from(
                keys[hits:], self.region, self.offsets[hits:], self.sizes[hits:]
            )
            if any(code not in (Code.OK, Code.EXISTS) for code in put.codes):
                raise RuntimeError(f"a put failed: {put.codes}")
        return hits, took

    def close(self) -> None:
        self.client.close()


def run(args: argparse.Namespace) -> int:
    """Measure, print, write the JSON report."""
    shape = Shape(args.prefixes, args.requests, args.pages, args.page_bytes, args.zipf)
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-federation-") as tmp:
        tokens = [_token(Path(tmp) / name) for name in ("a", "b")]
        with (
            Cluster(1, args.server_size, token_file=tokens[0]) as a,
            Cluster(1, args.server_size, token_file=tokens[1]) as b,
        ):
            for n in range(args.runs):
                trace = _trace(shape, rng)
                row = {
                    "one_cache_hit_rate": _one_cache(trace),
                    "isolated": _mode(a, b, shape, trace, f"r{n}-iso", federated=False),
                    "federated": _mode(a, b, shape, trace, f"r{n}-fed", federated=True),
                    "faults": _faults(a, b, shape, args.fault_requests, f"r{n}-fault", rng),
                }
                runs.append(row)
                print(json.dumps({"run": n, **row}), flush=True)
    report = _report(args, runs)
    Path(args.out).write_text(json.dumps(report, indent=2))
    _print(report)
    return 0


def _token(path: Path) -> str:
    path.write_text(secrets.token_hex(16) + "\n")
    path.chmod(0o600)
    return str(path)


def _trace(shape: Shape, rng: random.Random) -> list[tuple[int, int]]:
    """(group, prefix) per request: prefixes by Zipf popularity, groups at random."""
    weights = [1 / (rank + 1) ** shape.zipf for rank in range(shape.prefixes)]
    prefixes = rng.choices(range(shape.prefixes), weights, k=shape.requests)
    return [(rng.randrange(2), prefix) for prefix in prefixes]


def _one_cache(trace: list[tuple[int, int]]) -> float:
    """The hit rate of one cache both groups share, never evicting: what no federation of the
    two can exceed (a prefix is a miss the first time either group asks for it)."""
    seen: set[int] = set()
    hits = 0
    for _group, prefix in trace:
        hits += prefix in seen
        seen.add(prefix)
    return hits / len(trace)


@functools.lru_cache(maxsize=4096)
def _page(key: str, size: int) -> bytes:
    """A page's bytes, derived from its key (every read is checked against them)."""
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _keys(namespace: str, prefix: int, pages: int) -> list[str]:
    return [f"{namespace}/prompt{prefix}/page{page}" for page in range(pages)]


def _mode(
    a: Cluster, b: Cluster, shape: Shape, trace: list[tuple[int, int]], ns: str, *, federated: bool
) -> dict[str, Any]:
    """One mode over ``trace``: page hit rate, read latency of requests that found pages."""
    peers: list[tuple[PeerConfig, ...]] = [(), ()]
    if federated:
        peers = [(_peer("b", b),), (_peer("a", a),)]
    groups = [_Group(a, peers[0], shape), _Group(b, peers[1], shape)]
    try:
        hits, latencies = 0, []
        for group, prefix in trace:
            found, took = groups[group].serve(_keys(ns, prefix, shape.pages), write=True)
            hits += found
            if found:
                latencies.append(took)
        peer_hits = sum(s.counts.hits for g in groups for s in g.client.peers())
    finally:
        every = [key for prefix in range(shape.prefixes) for key in _keys(ns, prefix, shape.pages)]
        for g in groups:
            g.client.batch_remove(every, force=True)  # the next mode starts from empty stores
            g.close()
    return {
        "hit_rate": hits / (len(trace) * shape.pages),
        "recomputed": 1 - hits / (len(trace) * shape.pages),
        "peer_pages": peer_hits,
        "read_p50_us": percentile(latencies, 0.5) * 1e6,
        "read_p99_us": percentile(latencies, 0.99) * 1e6,
    }


def _peer(name: str, cluster: Cluster) -> PeerConfig:
    """A peer with the default settings (0.2 s lookups, 1 s probes, 2 s negative cache)."""
    return PeerConfig(name=name, master=cluster.master_endpoint, token_file=cluster.token_file)


def _faults(
    a: Cluster, b: Cluster, shape: Shape, requests: int, ns: str, rng: random.Random
) -> dict[str, Any]:
    """Group a's reads of prefixes stored half at home, half at the peer, while the peer is
    healthy, stopped and killed (then started again, empty)."""
    half = shape.prefixes // 2
    for cluster, prefixes in ((a, range(half)), (b, range(half, shape.prefixes))):
        writer = _Group(cluster, (), shape)
        try:
            for prefix in prefixes:
                writer.serve(_keys(ns, prefix, shape.pages), write=True)
        finally:
            writer.close()
    group = _Group(a, (_peer("b", b),), shape)
    out: dict[str, Any] = {}
    try:
        for prefix in (0, half):  # first contact with each cluster's server, unmeasured
            group.serve(_keys(ns, prefix, shape.pages), write=False)
        out["healthy"] = _phase(group, shape, requests, ns, rng)
        for fault in ("stopped", "killed"):
            if fault == "stopped":
                for process in (b.master, *b.servers):
                    process.signal(signal.SIGSTOP)
            else:
                b.master.kill()
            first = _first_attempt(group, ns, shape, half)
            out[fault] = {**_phase(group, shape, requests, ns, rng), "first_ms": first * 1e3}
            if fault == "stopped":
                for process in (b.master, *b.servers):
                    process.signal(signal.SIGCONT)
                _wait_closed(group)
        b.restart_master()
        _wait_mounted(b)
        every = [key for prefix in range(half) for key in _keys(ns, prefix, shape.pages)]
        group.client.batch_remove(every, force=True)
    finally:
        group.close()
    return out


def _first_attempt(group: _Group, ns: str, shape: Shape, half: int) -> float:
    """Seconds of the first read of a peer's prefix after the fault (the bounded attempt)."""
    _found, took = group.serve(_keys(ns, half, shape.pages), write=False)
    if group.client.peers()[0].breaker is BreakerState.CLOSED:
        raise RuntimeError("the peer's fault went unnoticed")
    return took


def _phase(
    group: _Group, shape: Shape, requests: int, ns: str, rng: random.Random
) -> dict[str, float]:
    """Read latency of the home-hit requests and of all requests (p50, p99, µs)."""
    home, every = [], []
    half = shape.prefixes // 2
    for _ in range(requests):
        prefix = rng.randrange(shape.prefixes)
        _found, took = group.serve(_keys(ns, prefix, shape.pages), write=False)
        every.append(took)
        if prefix < half:
            home.append(took)
    return {
        "home_p50_us": percentile(home, 0.5) * 1e6,
        "home_p99_us": percentile(home, 0.99) * 1e6,
        "all_p50_us": percentile(every, 0.5) * 1e6,
        "all_p99_us": percentile(every, 0.99) * 1e6,
    }


def _wait_closed(group: _Group, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while group.client.peers()[0].breaker is not BreakerState.CLOSED:
        if time.monotonic() > deadline:
            raise RuntimeError("the peer never answered a probe again")
        time.sleep(0.05)


def _wait_mounted(cluster: Cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cluster.stats().segments:
        if time.monotonic() > deadline:
            raise RuntimeError("the restarted master never saw its store server")
        time.sleep(0.05)


def _report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    iso = [r["isolated"]["hit_rate"] for r in runs]
    fed = [r["federated"]["hit_rate"] for r in runs]
    healthy = [r["faults"]["healthy"]["home_p99_us"] for r in runs]
    bound = [r["one_cache_hit_rate"] for r in runs]
    summary: dict[str, Any] = {
        "hit_rate_isolated": spread(iso),
        "hit_rate_federated": spread(fed),
        "hit_rate_one_cache": spread(bound),
        "hit_rate_ratio": ratio(fed, iso),
        "hit_rate_ratio_one_cache": ratio(bound, iso),
        "federated_vs_one_cache": ratio(fed, bound),
        "recomputed_ratio": ratio([1 - h for h in fed], [1 - h for h in iso]),
    }
    for mode in ("isolated", "federated"):
        for stat in ("read_p50_us", "read_p99_us"):
            summary[f"{mode}_{stat}"] = spread([r[mode][stat] for r in runs])
    for fault in ("stopped", "killed"):
        summary[f"home_p99_{fault}_vs_healthy"] = ratio(
            [r["faults"][fault]["home_p99_us"] for r in runs], healthy
        )
        summary[f"all_p99_{fault}_vs_healthy"] = ratio(
            [r["faults"][fault]["all_p99_us"] for r in runs],
            [r["faults"]["healthy"]["all_p99_us"] for r in runs],
        )
        summary[f"first_attempt_{fault}_ms"] = spread(
            [r["faults"][fault]["first_ms"] for r in runs]
        )
    return {
        "args": {k: v for k, v in vars(args).items() if k != "handler"},
        "runs": runs,
        "summary": summary,
    }


def _print(report: dict[str, Any]) -> None:
    print("federation: median (min-max) over runs")
    for name, value in report["summary"].items():
        print(f"  {name:34s} {value['median']:10.3f} ({value['min']:.3f}-{value['max']:.3f})")
