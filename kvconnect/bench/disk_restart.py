"""A store with a disk tier in child processes, for ``kvconnect bench store --tier disk``: the
cluster and its per-tier stats, and the two restart phases.

* **restart** — ``objects`` 4 KiB objects written to a disk tier file by the real
  :class:`~kvconnect.store.disk.tier.DiskTier` in this process (its write path, not puts), its
  index recovered here (timed), then a real store server started on that disk with the same
  ``server_id`` and a running master: seconds from its process start to its banner, to its disk
  segment mounted with every object reported, and to the first get of a recovered object served
  (bytes checked); objects recovered / stored, and a sample read back byte for byte.
* **kill** — a live server demoting objects while a client puts, SIGKILLed mid-run and started
  again: objects readable (bytes checked) afterwards against the puts completed before the kill
  and the demotions the master had seen done.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.disk.tier import DiskTier
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.transfer import MemoryRegion, TransferConfig

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
SERVER_ID = "bench-disk"
SOURCE = 64 * MiB  # random bytes every object is cut from (a multiple of every object size)
POLL = 0.02  # seconds between polls of the master's stats
SETTLE = 0.5  # demotion counters unchanged this long: the store has settled
DEADLINE = 300.0  # seconds any wait of a phase may take before it gives up
REFUSED = (Code.BUSY, Code.NO_SPACE)  # a full store's answers to a put: not now, try again


def source_bytes(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The ``SOURCE`` random bytes objects are cut from (object ``i`` of ``size`` bytes is
    ``[i * size % SOURCE, +size)``, so every read can be checked)."""
    return np.random.default_rng(seed).integers(0, 256, SOURCE, dtype=np.uint8)


def object_offset(index: int, size: int) -> int:
    """Where object ``index`` of ``size`` bytes starts in the source bytes."""
    return index * size % SOURCE


def disk_flags(directory: Path, size: int) -> list[str]:
    """``kvconnect store`` flags of one disk tier of ``size`` bytes in ``directory``."""
    return [
        "--store-disk",
        str(directory),
        "--store-disk-size",
        str(size),
        "--store-server-id",
        SERVER_ID,
    ]


@contextmanager
def store(
    dram: int, server_args: Sequence[str], master_args: Sequence[str] = ()
) -> Iterator[tuple[Cluster, StoreClient]]:
    """A master, one store server of ``dram`` bytes (``server_args``: its disk) and a client
    here (transport auto: puts through shared memory, disk reads over TCP)."""
    with Cluster(
        servers=1, server_size=dram, master_args=master_args, server_args=server_args
    ) as cluster:
        config = StoreClientConfig(master=cluster.master_endpoint, io_timeout=30, rpc_timeout=10)
        client = StoreClient(config, TransferConfig.from_mapping({"transport": "auto"}))
        client.start()
        try:
            yield cluster, client
        finally:
            client.close()


def tier_stats(cluster: Cluster, tier: m.Tier) -> m.TierStats | None:
    """The master's counters of ``tier`` (None while no segment of it is mounted)."""
    return next((t for t in cluster.stats(timeout=10).tiers if t.tier == tier), None)


def disk_segment(cluster: Cluster) -> m.SegmentStats | None:
    """The mounted disk segment (one disk per server here), or None."""
    segments = cluster.stats(timeout=10).segments
    return next((s for s in segments if s.tier == m.Tier.DISK), None)


def settle_demotions(cluster: Cluster) -> tuple[int, float]:
    """Wait until the master's demotion counters stop moving (``SETTLE`` seconds unchanged);
    returns (demotions done, monotonic time of the last change seen)."""
    last, changed = -1, time.monotonic()
    deadline = changed + DEADLINE
    while time.monotonic() < deadline:
        disk = tier_stats(cluster, m.Tier.DISK)
        seen = -1 if disk is None else disk.demotions + disk.demotions_failed
        now = time.monotonic()
        if seen != last:
            last, changed = seen, now
        elif now - changed >= SETTLE:
            return (0 if disk is None else disk.demotions), changed
        time.sleep(POLL)
    raise RuntimeError("demotions did not settle")


def check_objects(
    client: StoreClient,
    keys: Sequence[str],
    indices: Sequence[int],
    size: int,
    source: np.ndarray[Any, np.dtype[np.uint8]],
    batch: int,
) -> tuple[int, int]:
    """Read ``keys`` (object ``indices[n]`` of ``size`` bytes each) in batches; returns
    (read with the right bytes, read with wrong bytes)."""
    dest = np.zeros(batch * size, dtype=np.uint8)
    region = client.register(dest)
    good = bad = 0
    try:
        for first in range(0, len(keys), batch):
            chunk = list(keys[first : first + batch])
            offsets = [n * size for n in range(len(chunk))]
            result = client.batch_get_into(chunk, region, offsets, [size] * len(chunk))
            for n, code in enumerate(result.codes):
                if code != Code.OK:
                    continue
                start = object_offset(indices[first + n], size)
                same = np.array_equal(dest[n * size : (n + 1) * size], source[start : start + size])
                good, bad = good + same, bad + (not same)
    finally:
        client.engine.unregister(region)
    return good, bad


def put_all(
    client: StoreClient,
    region: MemoryRegion,
    keys: Sequence[str],
    offsets: Sequence[int],
    size: int,
) -> None:
    """Put ``keys`` (``region[offsets[i]:+size]``), retrying those a full DRAM refuses for now
    (``REFUSED``: its space returns once demotions finish and the server acknowledged the
    release; NO_SPACE starts an eviction round) until ``DEADLINE``; raises RuntimeError for any
    other failure."""
    pending = list(zip(keys, offsets, strict=True))
    deadline = time.monotonic() + DEADLINE
    while pending:
        names, starts = [k for k, _ in pending], [o for _, o in pending]
        codes = client.batch_put_from(names, region, starts, [size] * len(names)).codes
        failed = {c for c in codes if c not in (Code.OK, Code.EXISTS, *REFUSED)}
        if failed:
            raise RuntimeError(f"puts into the disk store failed: {failed}")
        pending = [item for item, code in zip(pending, codes, strict=True) if code in REFUSED]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} puts still refused after {DEADLINE}s")
        if pending:
            time.sleep(POLL / 10)


# ------------------------------------------------------------------------- restart phase


def capacity(objects: int, size: int) -> int:
    """Disk bytes for ``objects`` of ``size`` that stay below the master's eviction watermark
    (95 %): a disk they filled would be evicted down to 90 % once mounted."""
    return objects * size * 5 // 4


def build_disk(
    path: Path, objects: int, size: int, source: np.ndarray[Any, np.dtype[np.uint8]]
) -> float:
    """Write ``objects`` objects of ``size`` bytes through a :class:`DiskTier` at ``path``
    (demotions from ``source``, as the server applies them, paced to its queue); returns
    seconds. Raises RuntimeError if a write fails."""
    queue = 64 * MiB
    woke = threading.Event()
    tier = DiskTier(path, capacity(objects, size), queue_bytes=queue, timeout=30.0, wake=woke.set)
    start = time.perf_counter()
    try:
        tier.open()
        dram = source.data
        sent = done = 0
        while done < objects:
            # half the queue in flight: staging never refuses for want of room
            while sent < objects and (sent - done) * size < queue // 2:
                change = m.Change(
                    key=f"restart-{sent}",
                    offset=sent * size,
                    size=size,
                    source_region=1,  # any region: non-zero marks a move; ``dram`` is given
                    source_offset=object_offset(sent, size),
                )
                if not tier.apply(change, dram):
                    if sent == done:  # nothing in flight could free that offset
                        raise RuntimeError(f"the disk tier refused a write at {change.offset}")
                    break
                sent += 1
            if not woke.wait(timeout=DEADLINE):
                raise RuntimeError(f"the disk tier reported nothing for {DEADLINE}s")
            woke.clear()
            outcomes = tier.take_outcomes()
            if outcomes.demote_failed:
                raise RuntimeError(f"{len(outcomes.demote_failed)} disk writes failed")
            done += len(outcomes.demoted)
    finally:
        tier.close()
    return time.perf_counter() - start


def recover_index(path: Path, objects: int, size: int) -> tuple[int, float]:
    """Open the disk tier at ``path`` again in this process: (objects found, seconds)."""
    tier = DiskTier(path, capacity(objects, size), queue_bytes=64 * MiB, timeout=30.0)
    start = time.perf_counter()
    try:
        held = tier.open()
        return len(held), time.perf_counter() - start
    finally:
        tier.close()


def restart_phase(directory: Path, objects: int, dram: int, seed: int) -> dict[str, Any]:
    """The restart phase (see the module docstring)."""
    size = 4 * KiB
    source = source_bytes(seed)
    path = directory / f"kvconnect-{SERVER_ID}.data"
    log.info("restart: writing %d objects to %s", objects, path)
    built = build_disk(path, objects, size, source)
    found, recovery = recover_index(path, objects, size)
    result: dict[str, Any] = {
        "objects": objects,
        "object_bytes": size,
        "build_s": built,
        "index_recovered_in_process_s": recovery,
        "index_objects": found,
    }
    flags = disk_flags(directory, capacity(objects, size))
    with Cluster(servers=0) as cluster:
        config = StoreClientConfig(master=cluster.master_endpoint, io_timeout=30, rpc_timeout=10)
        client = StoreClient(config, TransferConfig.from_mapping({"transport": "auto"}))
        client.start()
        try:
            start = time.monotonic()
            cluster.add_server("--store-size", str(dram), *flags)
            result["banner_s"] = time.monotonic() - start
            result.update(_watch_recovery(cluster, client, start, objects, size, source))
            rng = random.Random(seed)
            sample = sorted(rng.sample(range(objects), min(objects, 1000)))
            good, bad = check_objects(
                client, [f"restart-{i}" for i in sample], sample, size, source, 128
            )
            result.update(sample=len(sample), sample_good=good, sample_wrong=bad)
        finally:
            client.close()
    return result


def _watch_recovery(
    cluster: Cluster,
    client: StoreClient,
    start: float,
    objects: int,
    size: int,
    source: np.ndarray[Any, np.dtype[np.uint8]],
) -> dict[str, Any]:
    """Poll the master and one get until the disk segment reports every object and a
    recovered object was served: seconds from ``start`` to each, and what was reported."""
    probe = objects - 1
    expected = bytes(source[object_offset(probe, size) : object_offset(probe, size) + size])
    mounted_s = served_s = None
    reported = 0
    deadline = start + DEADLINE
    while (mounted_s is None or served_s is None) and time.monotonic() < deadline:
        if mounted_s is None:
            segment = disk_segment(cluster)
            reported = 0 if segment is None else segment.objects
            if reported >= objects:
                mounted_s = time.monotonic() - start
        if served_s is None:
            value = client.get(f"restart-{probe}", timeout=5)
            if value is not None and bytes(value) == expected:
                served_s = time.monotonic() - start
        time.sleep(POLL)
    return {
        "mounted_all_reported_s": mounted_s,
        "first_get_served_s": served_s,
        "reported": reported,
        "recovered_fraction": reported / objects,
    }


# ---------------------------------------------------------------------------- kill phase


def kill_phase(directory: Path, objects: int, seed: int) -> dict[str, Any]:
    """The kill phase (see the module docstring): ``objects`` puts of 256 KiB are attempted
    into a store with a quarter of their bytes in DRAM; the server dies once a third of them
    were demoted, and starts again once the master has dropped it (heartbeat TTL 2 s)."""
    size, batch = 256 * KiB, 4
    dram = max(4 * MiB, objects * size // 4)
    source = source_bytes(seed)
    flags = disk_flags(directory, 2 * objects * size)
    master = ["--master-promote-window", "0", "--master-heartbeat-ttl", "2"]
    with store(dram, flags, master) as (cluster, client):
        region = client.register(source)
        stop = threading.Event()
        completed: list[int] = []
        writer = threading.Thread(
            target=_put_until_stopped,
            args=(client, region, objects, size, batch, stop, completed),
        )
        writer.start()
        try:
            demoted = _wait_demoted(cluster, objects // 3)
            cluster.servers[0].kill()
        finally:
            stop.set()
            writer.join(timeout=DEADLINE)
        puts = len(completed)
        _wait_until(lambda: disk_segment(cluster) is None, "the master never dropped the server")
        cluster.servers[0].start()
        _wait_until(lambda: disk_segment(cluster) is not None, "the disk was not mounted again")
        _wait_reported(cluster)
        keys = [f"kill-{i}" for i in completed]
        good, bad = check_objects(client, keys, completed, size, source, 16)
    return {
        "object_bytes": size,
        "dram": dram,
        "puts_completed_before_kill": puts,
        "demoted_before_kill": demoted,
        "recovered": good,
        "wrong_bytes": bad,
        "recovered_of_demoted": good / demoted if demoted else None,
        "recovered_of_puts": good / puts if puts else None,
    }


def _put_until_stopped(
    client: StoreClient,
    region: MemoryRegion,
    objects: int,
    size: int,
    batch: int,
    stop: threading.Event,
    completed: list[int],
) -> None:
    """Put objects ``kill-0``… in batches until ``stop`` or ``objects``, retrying those a full
    DRAM refuses for now (``REFUSED``); append the indices of those stored (Code.OK) to
    ``completed``."""
    for first in range(0, objects, batch):
        pending = list(range(first, min(objects, first + batch)))
        while pending and not stop.is_set():
            result = client.batch_put_from(
                [f"kill-{i}" for i in pending],
                region,
                [object_offset(i, size) for i in pending],
                [size] * len(pending),
                timeout=5,
            )
            codes = list(zip(pending, result.codes, strict=True))
            completed.extend(i for i, code in codes if code == Code.OK)
            pending = [i for i, code in codes if code in REFUSED]
            if pending:
                stop.wait(POLL / 10)
        if stop.is_set():
            return


def _wait_demoted(cluster: Cluster, count: int) -> int:
    """Wait until the master has seen ``count`` demotions done; returns how many it has."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        disk = tier_stats(cluster, m.Tier.DISK)
        if disk is not None and disk.demotions >= count:
            return disk.demotions
        time.sleep(POLL)
    raise RuntimeError(f"fewer than {count} demotions within {DEADLINE}s")


def _wait_reported(cluster: Cluster) -> None:
    """Wait until the disk segment's object count stops changing (``SETTLE`` seconds): every
    recovered object reported, however many messages that took."""
    last, changed = -1, time.monotonic()
    deadline = changed + DEADLINE
    while time.monotonic() - changed < SETTLE:
        segment = disk_segment(cluster)
        objects = -1 if segment is None else segment.objects
        if objects != last:
            last, changed = objects, time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError("the disk segment's object count never settled")
        time.sleep(POLL)


def _wait_until(condition: Callable[[], bool], failure: str) -> None:
    """Poll ``condition`` (the master's state) until true; RuntimeError(``failure``) after
    ``DEADLINE`` seconds."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(POLL)
