"""``kvconnect bench failover``: how long a store cluster is without a master after the leader
dies. Three masters (``--ha``), one store server and a client, all real processes, with a real
etcd. Each run SIGKILLs the current leader and times (a) until etcd names a new leader and (b)
until the client's next put and read-back succeed; the killed master is then restarted."""

from __future__ import annotations

import argparse
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
                leader = find_leader(coordinator)
                victim = next(m for m in masters if leader in m.args)
                victim.kill()
                killed = time.monotonic()
                while find_leader(coordinator) in (None, leader):
                    time.sleep(0.01)
                elected = time.monotonic() - killed
                _until_ok(client, f"run-{n}")
                served = time.monotonic() - killed
                runs.append({"elected_s": elected, "served_s": served})
                print(f"run {n + 1}: new leader {elected:.2f}s, client served {served:.2f}s")
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
    }
    print(
        f"median: new leader {report['elected_median_s']:.2f}s, "
        f"client served again {report['served_median_s']:.2f}s ({args.runs} runs)"
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


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
