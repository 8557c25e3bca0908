"""Load on a store master: filling it, writing at a steady rate, timing lookups, and loader
processes that call it as fast as they can. Used by ``kvconnect bench store`` for the scale,
eviction and throughput phases; run as a module it is the background writer process, or with
``--load KIND`` one loader."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence

from kvconnect._config import cluster_token
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig

FILL_BATCH = 1000
SERVER = "bench-server"
MOUNT = "mount-virtual"


def mount_virtual(rpc: RpcClient, size: int) -> None:
    """Mount a segment the master only accounts for: the master never touches memory."""
    spec = m.SegmentSpec(name="virtual", engine_segment="virtual", region=1, size=size, host_id="b")
    reply = rpc.call(m.Mount(SERVER, MOUNT, spec))
    if reply != m.CodesReply([m.Code.OK]):
        raise RuntimeError(f"mount refused: {reply!r}")


def drain_journal(rpc: RpcClient) -> None:
    """Do what the virtual segment's store server would: take the journal and acknowledge it
    (the master reuses released space only then, and keeps changes until then)."""
    applied = 0
    while True:
        reply = rpc.call(m.Heartbeat(SERVER, [MOUNT], [applied]), timeout=30)
        if not isinstance(reply, m.HeartbeatReply) or not reply.changes:
            raise RuntimeError(f"heartbeat refused: {reply!r}")
        changes = reply.changes[0]
        if not changes.changes:
            return
        applied = changes.first + len(changes.changes)


def _put(rpc: RpcClient, client: str, items: list[m.PutItem]) -> None:
    reply = rpc.call(m.PutStart(client, items), timeout=30)
    if not isinstance(reply, m.PutStartReply):
        raise RuntimeError(f"put_start refused: {reply!r}")
    done = [(item.key, p.put) for item, p in zip(items, reply.results, strict=True) if p.put]
    keys = [key for key, _ in done]
    rpc.call(m.PutEnd(client, keys, [0] * len(keys), [put for _, put in done]), timeout=30)


def fill(
    rpc: RpcClient,
    start: int,
    count: int,
    rng: random.Random,
    low: int,
    high: int,
    key_format: str = "object-{:012d}",
) -> None:
    """Create ``count`` complete objects (sizes in [low, high]), keys ``key_format`` of
    ``start`` … ``start + count - 1``."""
    for base in range(start, start + count, FILL_BATCH):
        batch = [key_format.format(i) for i in range(base, min(base + FILL_BATCH, start + count))]
        _put(rpc, "bench", [m.PutItem(k, rng.randint(low, high)) for k in batch])
        drain_journal(rpc)


def lookup_latencies(
    targets: Sequence[tuple[RpcClient, range]],
    key_format: str,
    batch: int,
    calls: int,
    seed: int = 0,
) -> list[list[float]]:
    """Seconds per ``Exists`` of ``batch`` random keys (``key_format`` of an index in the
    target's range), ``calls`` times per target. The targets take turns, the order flipping
    every call, so that each call of one has a neighbour of the other in the same moment of
    the machine. Keys are formatted just before their call: fresh strings, as a client that
    has just hashed its tokens holds them (picked out of a list of millions, they would time
    this process's cache misses, not the master)."""
    rng = random.Random(seed)
    seconds: list[list[float]] = [[] for _ in targets]
    order = list(enumerate(targets))
    for _ in range(calls):
        for n, (rpc, indexes) in order:
            keys = [key_format.format(rng.choice(indexes)) for _ in range(batch)]
            start = time.perf_counter()
            rpc.call(m.Exists(keys))
            seconds[n].append(time.perf_counter() - start)
        order.reverse()
    return seconds


def summary(seconds: list[float]) -> dict[str, float]:
    """p50/p99 in microseconds."""
    ordered = sorted(seconds)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    }


def rss_bytes(pid: int) -> int:
    """Resident memory of a process."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _writer(endpoint: str, rate: float, seconds: float, size: int) -> None:
    """Put ``rate`` objects per second (in batches of 100) for ``seconds``, acknowledging the
    journal like a store server does (every 50 ms)."""
    rpc = RpcClient(endpoint, 10.0, token=cluster_token(None, "", False))
    end = time.monotonic() + seconds
    n = 0
    next_ack = 0.0
    while time.monotonic() < end:
        _put(rpc, "writer", [m.PutItem(f"writer-{n + i:012d}", size) for i in range(100)])
        n += 100
        if time.monotonic() >= next_ack:
            drain_journal(rpc)
            next_ack = time.monotonic() + 0.05
        time.sleep(max(0.0, 100 / rate - 0.001))
    rpc.close()


LOAD_KINDS = ("batch_exists", "put", "put_rpcs")
"""What a loader calls: ``batch_exists`` of the stored keys, ``put`` of a 64-byte value (the
bytes cross TCP to the store server), or the master's own ``put_start`` + ``put_end`` of one
key with no bytes moved (counted as one call: two RPCs)."""


def load_keys(batch: int) -> list[str]:
    """The keys a ``batch_exists`` loader asks for (stored before the loaders start)."""
    return [f"load-{j}" for j in range(batch)]


def _loader(endpoint: str, kind: str, batch: int, name: str) -> None:
    """Wait for ``{"seconds": S}`` on stdin, call ``kind`` as fast as possible for S seconds,
    print ``{"calls": n}``: the protocol of the Mooncake runner's loaders."""
    token = cluster_token(None, "", False)
    config = StoreClientConfig(master=endpoint, rpc_timeout=10)
    client = StoreClient(config, TransferConfig.from_mapping({"transport": "tcp"}))
    client.start()
    rpc = RpcClient(endpoint, 10.0, token=token)
    keys, value = load_keys(batch), b"y" * 64
    try:
        print(json.dumps({"ready": True}), flush=True)
        seconds = float(json.loads(sys.stdin.readline())["seconds"])
        calls = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            key = f"{name}-{calls}"
            if kind == "batch_exists":
                if not all(client.batch_exists(keys)):
                    raise RuntimeError("batch_exists missed a stored key")
            elif kind == "put":
                if client.put(key, value) is not m.Code.OK:
                    raise RuntimeError(f"put of {key} failed")
            else:
                _put(rpc, name, [m.PutItem(key, 64)])
            calls += 1
        print(json.dumps({"calls": calls}), flush=True)
    finally:
        rpc.close()
        client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--load", choices=LOAD_KINDS, help="be one loader of this kind")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--name", default="loader")
    parser.add_argument("--rate", type=float, default=5000)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--size", type=int, default=4096)
    options = parser.parse_args()
    if options.load:
        _loader(options.endpoint, options.load, options.batch, options.name)
    else:
        _writer(options.endpoint, options.rate, options.seconds, options.size)
