"""``kvconnect bench failover``: how long a store cluster is without a master after the leader
dies. Three masters (``--ha``), one store server and a client, all real processes, with a real
etcd. Each run stores objects, SIGKILLs the current leader and times (a) until etcd names a new
leader and (b) until the client's next put and read-back succeed, then reads the stored objects
back through the new leader (how much of the cache survived, and that no byte is wrong); the
killed master is then restarted. ``--load N`` runs N busy processes throughout (a loaded host).

An object counts as *lost* only when the new leader does not know it (NOT_FOUND); a read that
fails for a while (the client's breaker, a timeout on a loaded host, the fenced region) is
retried, and one that never succeeds is counted apart as *unreadable*. Objects whose put ended
more than two heartbeat intervals before the kill must never be lost."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvconnect.bench.etcd import EtcdServer
from kvconnect.errors import StoreError
from kvconnect.etcd import Etcd
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Process, free_port
from kvconnect.store.messages import Code
from kvconnect.store.rpc import find_leader
from kvconnect.transfer.memory import MemoryRegion

_OBJECTS = 200  # stored before each kill, 4 KiB each
_HEARTBEAT = 0.2  # the store server's heartbeat interval (seconds)
_SETTLE = 1.0  # seconds between the last put and the kill: five store-server heartbeats
_READ_BACK = 10.0  # seconds to read one object back through transient failures
_TRANSIENT = (Code.UNAVAILABLE, Code.FAILED, Code.TIMEOUT, Code.STALE)


@dataclass(frozen=True, slots=True)
class ReadBack:
    """What became of one run's stored objects after the failover."""

    recovered: int  # read back byte-exact
    lost: int  # unknown to the new leader
    lost_durable: int  # of those, objects whose put ended > 2 heartbeats before the kill
    unreadable: int  # known, but never read back within the retry time
    corrupt: int  # read back with other bytes
    retried: int  # reads that failed transiently at first (a single read would miss them)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench failover``."""
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--ha-ttl", type=int, default=2, help="leader lease TTL (seconds)")
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    parser.add_argument("--out", default="bench-failover.json")


def run(args: argparse.Namespace) -> int:
    """Measure, print, write the JSON report; exit status 1 if an object older than two
    heartbeats was lost or any came back corrupt."""
    with EtcdServer() as etcd, busy_processes(args.load):
        ttl = ["--master-ha-ttl", str(args.ha_ttl)]
        masters = [
            Process(
                [
                    "master",
                    "--ha",
                    etcd.url,
                    "--master-listen",
                    f"tcp://127.0.0.1:{free_port()}",
                    *ttl,
                ],
                "listening",
            )
            for _ in range(3)
        ]
        server = Process(
            [
                "store",
                "--store-master",
                etcd.url,
                "--store-size",
                "16M",
                "--store-heartbeat-interval",
                str(_HEARTBEAT),
            ],
            "store server",
        )
        config = StoreClientConfig(
            master=etcd.url, rpc_timeout=0.3, io_timeout=0.5, breaker_cooldown=0.05
        )
        client = StoreClient(config)
        client.start()
        coordinator = Etcd(etcd.url)
        runs = []
        try:
            _until_ok(client, "warm-up")
            for n in range(args.runs):
                stored, ended = _store(client, n)
                time.sleep(_SETTLE)
                leader = find_leader(coordinator)
                victim = next(m for m in masters if leader in m.args)
                victim.kill()
                killed = time.monotonic()
                durable = {k for k, at in ended.items() if at < killed - 2 * _HEARTBEAT}
                while find_leader(coordinator) in (None, leader):
                    time.sleep(0.01)
                elected = time.monotonic() - killed
                _until_ok(client, f"run-{n}")
                served = time.monotonic() - killed
                back = _read_back(client, stored, durable)
                runs.append(
                    {"elected_s": elected, "served_s": served, "stored": len(stored)} | asdict(back)
                )
                print(
                    f"run {n + 1}: new leader {elected:.2f}s, client served {served:.2f}s, "
                    f"{back.recovered}/{len(stored)} objects recovered, {back.lost} lost "
                    f"({back.lost_durable} of them older than two heartbeats), "
                    f"{back.unreadable} unreadable, {back.corrupt} corrupt; "
                    f"{back.retried} read again after a transient failure"
                )
                victim.start()
        finally:
            client.close()
            coordinator.close()
            server.stop()
            for master in masters:
                master.stop()
    totals = ("stored", "recovered", "lost", "lost_durable", "unreadable", "corrupt", "retried")
    summed = {name: sum(int(r[name]) for r in runs) for name in totals}
    report: dict[str, object] = {
        "ha_ttl": args.ha_ttl,
        "load": args.load,
        "runs": runs,
        "elected_median_s": statistics.median(r["elected_s"] for r in runs),
        "served_median_s": statistics.median(r["served_s"] for r in runs),
        **summed,
    }
    print(
        f"median: new leader {report['elected_median_s']:.2f}s, "
        f"client served again {report['served_median_s']:.2f}s ({args.runs} runs); "
        f"{summed['recovered']}/{summed['stored']} objects recovered, {summed['lost']} lost "
        f"({summed['lost_durable']} older than two heartbeats), "
        f"{summed['unreadable']} unreadable, {summed['corrupt']} corrupt"
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 1 if summed["lost_durable"] or summed["corrupt"] else 0


@contextmanager
def busy_processes(processes: int) -> Iterator[None]:
    """``processes`` busy loops in child processes while the block runs."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def _store(client: StoreClient, run: int) -> tuple[dict[str, bytes], dict[str, float]]:
    """Put this run's objects; returns those stored (key → value) and when each put ended."""
    stored: dict[str, bytes] = {}
    ended: dict[str, float] = {}
    for i in range(_OBJECTS):
        key, value = f"stored-{run}-{i}", _value(run, i)
        if client.put(key, value) is Code.OK:
            stored[key] = value
            ended[key] = time.monotonic()
    return stored, ended


def _value(run: int, i: int) -> bytes:
    return hashlib.sha256(f"{run}/{i}".encode()).digest() * 128  # 4 KiB


def _read_back(client: StoreClient, stored: dict[str, bytes], durable: set[str]) -> ReadBack:
    """Read every stored object back through the new leader, retrying transient failures."""
    buffer = client.register(bytearray(max(map(len, stored.values()), default=1)))
    counts = dict.fromkeys(("recovered", "lost", "lost_durable", "unreadable", "corrupt"), 0)
    counts["retried"] = 0
    for key, value in stored.items():
        code, attempts = _read_one(client, key, buffer)
        counts["retried"] += attempts > 1
        if code is Code.OK:
            intact = bytes(buffer.view[: len(value)]) == value
            counts["recovered" if intact else "corrupt"] += 1
        elif code is Code.NOT_FOUND:
            counts["lost"] += 1
            counts["lost_durable"] += key in durable
        else:
            counts["unreadable"] += 1
    return ReadBack(**counts)


def _read_one(client: StoreClient, key: str, buffer: MemoryRegion) -> tuple[Code, int]:
    """The final code of reading ``key`` (transient failures are retried for a while) and
    the number of attempts."""
    deadline = time.monotonic() + _READ_BACK
    attempts = 0
    while True:
        attempts += 1
        code = client.batch_get_into([key], buffer, [0], [buffer.length]).codes[0]
        if code not in _TRANSIENT or time.monotonic() >= deadline:
            return code, attempts
        time.sleep(0.01)


def _until_ok(client: StoreClient, key: str, timeout: float = 30.0) -> None:
    """Put and read back ``key`` until both succeed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.put(key, b"v" * 4096) in (Code.OK, Code.EXISTS) and client.get(key):
                return
        except StoreError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"the cluster did not serve {key} within {timeout}s")
