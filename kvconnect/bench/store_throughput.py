"""``kvconnect bench store --phases throughput``: calls per second a master serves to many
client processes at once, kvconnect beside Mooncake in the same run.

Each system gets a master and one store server (a Mooncake holder); ``--throughput-processes``
loader processes, each its own client, call as fast as they can for a few seconds, all started
together: ``batch_exists`` of 128 stored keys, ``put`` of 64-byte values (bytes over TCP to the
store server), and for kvconnect also the master's bare ``put_start`` + ``put_end`` (no bytes).
Systems alternate round by round; the report gives the median calls/s and the spread.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

import numpy as np

from kvconnect.bench import master_load
from kvconnect.bench.baselines.mooncake_store import MooncakeStoreBaseline
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.transfer import TransferConfig

BATCH = 128
SEGMENT = 1 << 30
KINDS = ("batch_exists", "put", "put_rpcs")  # put_rpcs: kvconnect only


class _Kvconnect:
    """A master and a store server; loaders are ``python -m kvconnect.bench.master_load``."""

    def __init__(self) -> None:
        self.cluster = Cluster(servers=1, server_size=SEGMENT)
        config = StoreClientConfig(master=self.cluster.master_endpoint, rpc_timeout=10)
        self.client = StoreClient(config, TransferConfig.from_mapping({"transport": "tcp"}))
        self.client.start()
        keys = master_load.load_keys(BATCH)
        source = self.client.register(np.ones(64 * BATCH, dtype=np.uint8))
        stored = self.client.batch_put_from(
            keys, source, [64 * i for i in range(BATCH)], [64] * BATCH
        )
        if not all(stored.ok()):
            raise RuntimeError(f"storing the lookup keys failed: {set(stored.codes)}")
        self._round = 0

    def run(self, kind: str, processes: int, seconds: float) -> int:
        self._round += 1
        loaders = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvconnect.bench.master_load",
                    self.cluster.master_endpoint,
                    "--load",
                    kind,
                    "--batch",
                    str(BATCH),
                    "--name",
                    f"r{self._round}l{n}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in range(processes)
        ]
        try:
            for loader in loaders:
                _reply(loader)  # set up and waiting
            for loader in loaders:  # all start together
                assert loader.stdin is not None
                loader.stdin.write(json.dumps({"seconds": seconds}) + "\n")
                loader.stdin.flush()
            return sum(int(_reply(loader)["calls"]) for loader in loaders)
        finally:
            for loader in loaders:
                if loader.stdin is not None:
                    loader.stdin.close()
                loader.wait(timeout=60)
                if loader.stdout is not None:
                    loader.stdout.close()

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def _reply(loader: subprocess.Popen[str]) -> dict[str, Any]:
    assert loader.stdout is not None
    line = loader.stdout.readline()
    if not line:
        raise RuntimeError(f"a loader exited (rc={loader.wait()})")
    reply: dict[str, Any] = json.loads(line)
    return reply


def throughput_phase(
    mooncake: str | None, processes: int, seconds: float, rounds: int
) -> dict[str, Any]:
    """Calls/s per kind and system: median and (min, max) over ``rounds`` rounds."""
    ours = _Kvconnect()
    theirs: MooncakeStoreBaseline | None = None
    samples: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    try:
        if mooncake is not None:
            theirs = MooncakeStoreBaseline(mooncake, "tcp", SEGMENT, 64 << 20)
        for kind in KINDS:
            for n in range(rounds):
                order = ["kvconnect", "mooncake"] if n % 2 == 0 else ["mooncake", "kvconnect"]
                for name in order:
                    if name == "mooncake" and (theirs is None or kind == "put_rpcs"):
                        continue
                    print(f"[throughput] {name} {kind} round {n + 1}/{rounds}", file=sys.stderr)
                    if name == "kvconnect":
                        calls = ours.run(kind, processes, seconds)
                    else:
                        assert theirs is not None
                        request = {"op": "throughput", "kind": kind, "processes": processes}
                        request.update(seconds=seconds, batch=BATCH)
                        calls = int(theirs.call(request)["calls"])
                    samples[kind].setdefault(name, []).append(calls / seconds)
    finally:
        ours.close()
        if theirs is not None:
            theirs.close()
    return {
        "processes": processes,
        "seconds": seconds,
        "rows": {
            kind: {
                name: {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}
                for name, runs in systems.items()
            }
            for kind, systems in samples.items()
        },
    }


def print_throughput(result: dict[str, Any]) -> None:
    """The phase's table: calls/s (median, min-max) and kvconnect / Mooncake."""
    print(f"\nmaster throughput, {result['processes']} client processes (calls/s)")
    print(f"{'call':<16}{'kvconnect':>26}{'mooncake':>26}{'ratio':>8}")
    for kind, row in result["rows"].items():
        cells = []
        for name in ("kvconnect", "mooncake"):
            stats = row.get(name)
            cells.append(
                f"{stats['median']:.0f} ({stats['min']:.0f}-{stats['max']:.0f})" if stats else "-"
            )
        ratio = ""
        if "mooncake" in row:
            ratio = f"{row['kvconnect']['median'] / row['mooncake']['median']:.2f}x"
        print(f"{kind:<16}{cells[0]:>26}{cells[1]:>26}{ratio:>8}")
