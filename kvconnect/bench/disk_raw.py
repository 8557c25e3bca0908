"""The raw phase of ``kvconnect bench store --tier disk``: disk GB/s of the tier beside the raw
baseline on the same file system, object size and run (see :mod:`kvconnect.bench.disk`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect._config import cluster_token
from kvconnect.bench.baselines import direct_io
from kvconnect.bench.disk_restart import (
    build_disk,
    check_objects,
    disk_flags,
    object_offset,
    put_all,
    settle_demotions,
    source_bytes,
    store,
    tier_stats,
)
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.disk.tier import DiskTier
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import MemoryRegion

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
BATCH_BYTES = 16 * MiB  # bytes per batch_put_from / batch_get_into call


class RawCase:
    """One object size: a store (``dram`` bytes and a disk; ``server_args`` and
    ``master_args``: more flags of its processes) for the rounds, and the files of the baseline
    and of the in-process DiskTier beside it in ``directory``."""

    def __init__(
        self,
        directory: Path,
        size: int,
        total: int,
        dram: int,
        depths: Sequence[int],
        server_args: Sequence[str] = (),
        master_args: Sequence[str] = (),
    ) -> None:
        self.directory, self.size, self.depths = directory, size, list(depths)
        self._server_args, self._master_args = list(server_args), list(master_args)
        self.count = max(4, total // size)
        self.source = source_bytes(size)
        self.samples: dict[str, list[float]] = {}
        self._dram = dram

    def run(self, rounds: int) -> dict[str, list[float]]:
        """``rounds`` rounds, the order of the three sides reversed every other round."""
        (self.directory / "store").mkdir()
        flags = disk_flags(
            self.directory / "store", self._dram + (rounds + 1) * self.count * self.size
        )
        master = ["--master-promote-window", "0", *self._master_args]
        with store(self._dram, [*flags, *self._server_args], master) as (cluster, client):
            region = client.register(self.source)
            # DRAM filled first: from then on every put demotes an object
            self._put(client, region, "warm", self._dram // self.size)
            settle_demotions(cluster)
            steps: list[Callable[[int], None]] = [
                self._baseline,
                self._tier,
                lambda n: self._store(n, cluster, client, region),
            ]
            for n in range(rounds):
                log.info("raw %d KiB: round %d/%d", self.size // KiB, n + 1, rounds)
                for step in steps if n % 2 == 0 else steps[::-1]:
                    step(n)
        return self.samples

    def _add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def _baseline(self, _round: int) -> None:
        path = self.directory / "baseline.data"
        for depth in self.depths:
            for op in ("write", "read"):
                nbytes = direct_io.throughput(path, op, self.size, self.count * self.size, depth)
                self._add(f"baseline_{op}_d{depth}", nbytes)
            path.unlink()

    def _tier(self, _round: int) -> None:
        """The real DiskTier here: ``count`` demotions until durable, then the deepest
        baseline's concurrency of threads reading them back through its FileSource."""
        path = self.directory / "tier.data"
        nbytes = self.count * self.size
        self._add("tier_write", nbytes / build_disk(path, self.count, self.size, self.source))
        tier = DiskTier(path, nbytes, queue_bytes=64 * MiB, timeout=30.0)
        try:
            tier.open()
            self._add(
                "tier_read", nbytes / read_tier(tier, self.count, self.size, max(self.depths))
            )
            check_tier(tier, self.count, self.size, self.source)
        finally:
            tier.close()
            for leftover in self.directory.glob("tier.*"):
                leftover.unlink()

    def _store(
        self, round_: int, cluster: Cluster, client: StoreClient, region: MemoryRegion
    ) -> None:
        """``count`` puts into the full store: bytes demoted per second (first put to the last
        demotion the master saw), then batch reads of this round's disk-resident objects."""
        before = _demotions(cluster)
        start = time.monotonic()
        keys = self._put(client, region, f"r{round_}", self.count)
        done, last = settle_demotions(cluster)
        self._add("store_write", (done - before) * self.size / max(1e-9, last - start))
        on_disk = disk_resident(cluster, keys)
        if on_disk:
            self._add("store_read", self._read(client, on_disk))
        self._add("store_disk_objects", float(len(on_disk)))

    def _put(self, client: StoreClient, region: MemoryRegion, prefix: str, count: int) -> list[str]:
        """Put ``count`` objects ``prefix-i`` (object i of the source bytes); their keys."""
        batch = max(1, BATCH_BYTES // self.size)
        keys = []
        for first in range(0, count, batch):
            chunk = range(first, min(count, first + batch))
            names = [f"{prefix}-{i}" for i in chunk]
            put_all(client, region, names, [object_offset(i, self.size) for i in chunk], self.size)
            keys += names
        return keys

    def _read(self, client: StoreClient, keys: list[str]) -> float:
        """Bytes per second of batch_get_into over ``keys`` (summed call time), then every
        object checked against the bytes put."""
        batch = max(1, BATCH_BYTES // self.size)
        dest = np.zeros(batch * self.size, dtype=np.uint8)
        region = client.register(dest)
        seconds = 0.0
        try:
            for first in range(0, len(keys), batch):
                chunk = keys[first : first + batch]
                offsets = [n * self.size for n in range(len(chunk))]
                start = time.perf_counter()
                result = client.batch_get_into(chunk, region, offsets, [self.size] * len(chunk))
                seconds += time.perf_counter() - start
                if any(code != Code.OK for code in result.codes):
                    raise RuntimeError(
                        f"reads of disk-resident objects failed: {set(result.codes)}"
                    )
        finally:
            client.engine.unregister(region)
        indices = [int(key.rsplit("-", 1)[1]) for key in keys]
        good, bad = check_objects(client, keys, indices, self.size, self.source, batch)
        if bad or good != len(keys):
            raise RuntimeError(f"disk-resident objects read back: {good} right, {bad} wrong")
        return len(keys) * self.size / seconds


def _demotions(cluster: Cluster) -> int:
    disk = tier_stats(cluster, m.Tier.DISK)
    return 0 if disk is None else disk.demotions


def disk_resident(cluster: Cluster, keys: list[str]) -> list[str]:
    """Those of ``keys`` with no replica in DRAM. The DRAM region is the one holding the
    newest key (just put, never an eviction's pick); any other region is the disk's."""
    rpc = RpcClient(cluster.master_endpoint, 30.0, token=cluster_token(None, "", False))
    try:
        reply = rpc.call(m.GetReplicas(keys=keys))
    finally:
        rpc.close()
    if not isinstance(reply, m.ReplicasReply):
        raise RuntimeError(f"unexpected reply to get_replicas: {reply!r}")
    dram = reply.results[-1].locations[0].region
    return [
        key
        for key, replicas in zip(keys, reply.results, strict=True)
        if replicas.code == Code.OK and all(loc.region != dram for loc in replicas.locations)
    ]


def read_tier(tier: DiskTier, count: int, size: int, depth: int) -> float:
    """Seconds for ``depth`` threads to read objects 0..count-1 through ``tier.source``."""
    errors: list[BaseException] = []

    def stripe(first: int) -> None:
        buffer = np.empty(size, dtype=np.uint8)
        try:
            for index in range(first, count, depth):
                tier.source.read_into(index * size, buffer.data)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=stripe, args=(n,)) for n in range(depth)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def check_tier(
    tier: DiskTier, count: int, size: int, source: np.ndarray[Any, np.dtype[np.uint8]]
) -> None:
    """Read up to 64 objects back through ``tier.source``; raise if any differs from what was
    demoted."""
    buffer = np.empty(size, dtype=np.uint8)
    for index in range(0, count, max(1, count // 64)):
        tier.source.read_into(index * size, buffer.data)
        start = object_offset(index, size)
        if not np.array_equal(buffer, source[start : start + size]):
            raise RuntimeError(f"the disk tier returned wrong bytes for object {index}")
