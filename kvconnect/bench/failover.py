"""``kvconnect bench failover``: how long a store cluster is without a master after the leader
dies. Three masters (``--ha``), one store server and a client, all real processes, with a real
etcd. Each run stores objects, SIGKILLs the current leader and times (a) until etcd names a new
leader and (b) until the client's next put and read-back succeed, then reads the stored objects
back through the new leader (how much of the cache survived, and that no byte is wrong); the
killed master is then restarted."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

from kvconnect.config import StoreClientConfig
from kvconnect.errors import StoreError
from kvconnect.etcd import Etcd
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import Code
from kvconnect.store.rpc import find_leader
from kvconnect.testing.cluster import Process, free_port
from kvconnect.testing.etcd import EtcdServer

_OBJECTS = 200  # stored before each kill, 4 KiB each
_SETTLE = 1.0  # seconds between the last put and the kill: five store-server heartbeats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench failover``."""
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--ha-ttl", type=int, default=2, help="leader lease TTL (seconds)")
    parser.add_argument("--out", default="bench-failover.json")


def run(args: argparse.Namespace) -> int:
    """Measure, print, write the JSON report."""
    with EtcdServer() as etcd:
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
                "0.2",
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
                stored = _store(client, n)
                time.sleep(_SETTLE)
                leader = find_leader(coordinator)
                victim = next(m for m in masters if leader in m.args)
                victim.kill()
                killed = time.monotonic()
                while find_leader(coordinator) in (None, leader):
                    time.sleep(0.01)
                elected = time.monotonic() - killed
                _until_ok(client, f"run-{n}")
                served = time.monotonic() - killed
                recovered, corrupt = _read_back(client, stored)
                runs.append(
                    {
                        "elected_s": elected,
                        "served_s": served,
                        "recovered": recovered,
                        "stored": len(stored),
                        "corrupt": corrupt,
                    }
                )
                print(
                    f"run {n + 1}: new leader {elected:.2f}s, client served {served:.2f}s, "
                    f"{recovered}/{len(stored)} objects recovered, {corrupt} corrupt"
                )
                victim.start()
        finally:
            client.close()
            coordinator.close()
            server.stop()
            for master in masters:
                master.stop()
    report = {
        "ha_ttl": args.ha_ttl,
        "runs": runs,
        "elected_median_s": statistics.median(r["elected_s"] for r in runs),
        "served_median_s": statistics.median(r["served_s"] for r in runs),
        "recovered": sum(r["recovered"] for r in runs),
        "stored": sum(r["stored"] for r in runs),
        "corrupt": sum(r["corrupt"] for r in runs),
    }
    print(
        f"median: new leader {report['elected_median_s']:.2f}s, "
        f"client served again {report['served_median_s']:.2f}s ({args.runs} runs); "
        f"{report['recovered']}/{report['stored']} objects recovered, "
        f"{report['corrupt']} corrupt"
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _store(client: StoreClient, run: int) -> dict[str, bytes]:
    """Put this run's objects; returns those stored (key → value)."""
    values = {f"stored-{run}-{i}": _value(run, i) for i in range(_OBJECTS)}
    return {k: v for k, v in values.items() if client.put(k, v) is Code.OK}


def _value(run: int, i: int) -> bytes:
    return hashlib.sha256(f"{run}/{i}".encode()).digest() * 128  # 4 KiB


def _read_back(client: StoreClient, stored: dict[str, bytes]) -> tuple[int, int]:
    """(objects read back intact, objects read back with other bytes)."""
    intact = corrupt = 0
    for key, value in stored.items():
        got = client.get(key)
        if got is not None:
            intact += got == value
            corrupt += got != value
    return intact, corrupt


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
