"""Store server: owns a block of memory, mounts it at the master, heartbeats, serves bytes.

The memory is shared memory from the transfer engine (``allocate``: pre-faulted, optionally
huge pages), so same-host clients copy straight from it and remote ones go through the engine's
listener. The master decides what lives where; the server follows the master's journal of its
segment (objects committed, space released — delivered with heartbeat replies and acknowledged
by the next heartbeat), so it always knows which objects it holds.

When the master answers that it does not know our mount (a master restart, a failover to a
standby, or heartbeats lost for ``heartbeat_ttl``), the server first *fences* its memory — the
engine publishes it under a new region id, so every transfer the old master arranged fails
from then on — waits for transfers in progress to end, and mounts again, reporting the objects
it holds. The new master indexes them: the cache survives, and no late write or read arranged
by the previous master can touch space the new one hands out.

With ``disk`` paths the server also owns a disk tier per path (kvconnect/store/disk/): each is
published as a read-only file region of the engine and mounted as a segment of its own, objects
the memory evicts are moved there, and after a restart with the same ``server_id`` the server
finds them again and reports them when it mounts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvconnect._config import tenant_token
from kvconnect.errors import DiskUnavailable, KVConnectError, StoreError
from kvconnect.lifecycle import Lifecycle
from kvconnect.store import messages as m
from kvconnect.store.config import StoreServerConfig
from kvconnect.store.disk.mounted import MountedDisk
from kvconnect.store.disk.tier import DiskTier
from kvconnect.store.held import HeldObjects
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.transfer.stats import LatencySnapshot

log = logging.getLogger(__name__)

_SYNC_INTERVAL = 0.05  # seconds between heartbeats while the journal has changes for us
_DRAIN_POLL = 0.01  # seconds between checks that transfers of a fenced region are over


class StoreServer(Lifecycle):
    """One store server; ``start()`` mounts, ``close()`` unmounts and releases the memory."""

    def __init__(self, config: StoreServerConfig, transfer: TransferConfig | None = None) -> None:
        self.config = config
        self.engine = TransferEngine(transfer or TransferConfig())
        self.server_id = (
            config.server_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.mount_id = uuid.uuid4().hex
        self.region: MemoryRegion | None = None
        self._rpc = RpcClient(config.master, config.rpc_timeout, token=self.engine.config.token)
        self._tenants: list[str] = []  # the tenants whose tokens the engine admits
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by disk tiers with outcomes to report
        self._thread: threading.Thread | None = None
        self._http: Any = None
        self._mounted = False
        self.held = HeldObjects()  # used by the heartbeat thread only
        """What this server holds, as the master's journal told it."""
        self.disks: list[MountedDisk] = []
        """The disk tiers in service (one taken out of service leaves the list)."""
        self.retired: list[MountedDisk] = []
        """Disk tiers taken out of service (their metrics stay, at ``up`` 0)."""

    @property
    def spec(self) -> m.SegmentSpec:
        """What this server mounts at the master."""
        assert self.region is not None
        # A configured server_id names the memory segment, so a restarted server's mount
        # replaces its predecessor's at once (the master would otherwise keep it while the
        # same server_id heartbeats).
        return m.SegmentSpec(
            name=self.config.server_id or self.engine.name,
            engine_segment=self.engine.name,
            region=self.region.id,
            size=self.region.length,
            host_id=self.engine.segment.host_id,
        )

    def start(self) -> None:
        """Allocate the memory, start the engine, mount (retried by the heartbeat thread)."""
        self.engine.start()
        self.region = self.engine.allocate(self.config.size, hugepages=self.config.hugepages)
        self._open_disks()
        try:
            self._mount()
            self._beat()  # the master's tenants are admitted before the server says it serves
        except KVConnectError as exc:
            log.warning("master not reachable yet (%s); heartbeats will keep trying", exc)
        self._thread = threading.Thread(
            target=self._heartbeats, name="kvconnect-store-heartbeat", daemon=True
        )
        self._thread.start()
        if self.config.metrics_port:
            registry = CollectorRegistry()
            registry.register(_ServerCollector(self))
            self._http, _ = start_http_server(
                self.config.metrics_port, addr="127.0.0.1", registry=registry
            )
        log.info(
            "store server %s serving %d bytes as %s",
            self.server_id,
            self.config.size,
            self.spec.name,
        )

    def close(self) -> None:
        """Unmount (best effort), stop heartbeats, release memory. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.rpc_timeout + self.config.heartbeat_interval + 1)
            self._thread = None
        mounts = [disk.mount_id for disk in self.disks if disk.mounted]
        if self._mounted:
            mounts.append(self.mount_id)
        if mounts:
            try:
                self._rpc.call(m.Unmount(self.server_id, mounts))
            except KVConnectError as exc:
                log.warning("unmount failed: %s", exc)
            self._mounted = False
        for disk in self.disks:
            disk.tier.close()
        self.disks.clear()
        self._rpc.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.engine.close()

    def _open_disks(self) -> None:
        """Open (or recover) each disk tier and publish it; a disk that cannot be used is
        left out with an error: the memory tier serves without it."""
        paths = self.config.disk_paths()
        if not paths:
            return
        each = self.config.disk_size // len(paths)
        for n, given in enumerate(paths):
            path = _data_file(Path(given), self.server_id, bool(self.config.server_id))
            tier = DiskTier(
                path,
                each,
                queue_bytes=self.config.disk_queue,
                timeout=self.config.disk_timeout,
                wake=self._wake.set,
            )
            try:
                held = tier.open()
            except DiskUnavailable as exc:
                log.error("disk %s is not used: %s", path, exc)
                tier.close()
                continue
            disk = MountedDisk(tier, f"{self.server_id}/disk{n}", path, held)
            disk.publish(self.engine)
            self.disks.append(disk)
            log.info("disk %s: %d bytes, %d objects recovered", path, tier.size, len(held))

    def _mount(self) -> None:
        """Mount (again, with the same mount ids, if a previous attempt broke off) the memory
        and each disk not mounted yet, reporting what they hold."""
        if not self._mounted:
            self._mount_one(self.mount_id, self.spec, self.held.report())
            self._mounted = True
        for disk in self.disks:
            if not disk.mounted:
                self._mount_one(disk.mount_id, disk.spec(self.engine), disk.held())
                disk.mounted = True

    def _mount_one(self, mount_id: str, spec: m.SegmentSpec, changes: list[m.Change]) -> None:
        """Mount one segment, reporting what it holds in offset order, in batches."""
        batches = [changes[i : i + m.MAX_BATCH] for i in range(0, len(changes), m.MAX_BATCH)]
        first = batches[0] if batches else []
        request: m.Request = m.Mount(self.server_id, mount_id, spec, first, more=len(batches) > 1)
        for n in range(len(batches) or 1):
            if n:
                more = n + 1 < len(batches)
                request = m.Report(self.server_id, mount_id, batches[n], more)
            reply = self._rpc.call(request)
            if not isinstance(reply, m.CodesReply) or reply.codes != [m.Code.OK]:
                raise StoreError(f"master refused the mount of {spec.name}: {reply!r}")
        if changes:
            log.info("mounted %s, reporting %d held objects", spec.name, len(changes))

    def _remount(self) -> None:
        """The master lost our mounts: fence, wait for old transfers to end, mount anew."""
        assert self.region is not None
        old = [self.region]
        self.region = self.engine.fence(self.region)
        self.mount_id = uuid.uuid4().hex
        self.held.new_mount()
        self._mounted = False
        old += [disk.fence(self.engine) for disk in self.disks]
        deadline = time.monotonic() + self.config.rpc_timeout
        while not self._stop.wait(_DRAIN_POLL):
            # Loads of promotions write our memory without the engine, and moves to disk in
            # flight would be held without the new master knowing: both end first too.
            busy = sum(self.engine.users(region) for region in old)
            busy += sum(disk.tier.busy() for disk in self.disks)
            if not busy:
                break
            if time.monotonic() > deadline:
                log.warning("waiting for %d transfer(s) of the fenced regions", busy)
                deadline = time.monotonic() + self.config.rpc_timeout
        self._mount()

    def _heartbeats(self) -> None:
        delay = self.config.heartbeat_interval
        while not self._stop.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            delay = self.config.heartbeat_interval
            try:
                if self._beat():
                    delay = _SYNC_INTERVAL  # acknowledge soon: the master waits to reuse
            except KVConnectError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _beat(self) -> bool:
        """One heartbeat; True if the master sent changes (acknowledge them soon)."""
        self._retire_failed_disks()
        if not self._mounted or not all(disk.mounted for disk in self.disks):
            self._mount()
        reports: list[m.TierReport] = []
        for disk in self.disks:
            disk.collect(self.mount_id, disk.tier.take_outcomes())
            reports += disk.reports()
        # A heartbeat waits no longer than its interval: a dead leader is then noticed, and
        # the new one found in etcd, within about one interval.
        heartbeat = m.Heartbeat(
            self.server_id,
            [self.mount_id, *(disk.mount_id for disk in self.disks)],
            [self.held.applied, *(disk.applied for disk in self.disks)],
            reports,
        )
        reply = self._rpc.call(heartbeat, timeout=self.config.heartbeat_interval)
        if not isinstance(reply, m.HeartbeatReply):
            raise StoreError(f"unexpected heartbeat reply {reply!r}")
        self._admit_tenants(reply.tenants)
        for disk in self.disks:
            disk.delivered()
        if reply.unknown:
            log.warning("master does not know our segments (restarted?): mounting again")
            self._remount()
            return False
        return self._apply(reply.changes)

    def _admit_tenants(self, names: list[str]) -> None:
        """Let the master's tenants' clients reach this server's memory: their tokens derive
        from the cluster token (docs/store.md, "Tenants")."""
        token = self.engine.config.token
        if token is not None and names != self._tenants:
            self._tenants = list(names)
            self.engine.accept_tokens([tenant_token(token, name) for name in names])

    def _apply(self, journals: list[m.Changes]) -> bool:
        """Apply each mount's journal changes; True if there were any."""
        assert self.region is not None
        disks = {disk.mount_id: disk for disk in self.disks}
        sources = {disk.region.id: disk for disk in self.disks if disk.region is not None}
        changed = False
        for changes in journals:
            if not changes.changes:
                continue
            changed = True
            disk = disks.get(changes.mount_id)
            if disk is not None:
                disk.apply(changes, self.region.view)
            elif changes.mount_id == self.mount_id:
                for move in self.held.apply(changes):
                    self._promote(move, sources.get(move.source_region))
        return changed

    def _promote(self, move: m.Change, disk: MountedDisk | None) -> None:
        """Load an object from a disk into the memory the master set aside for it."""
        assert self.region is not None
        if disk is None:  # that disk left service: the master learns it from our unmount
            return
        target = self.region.view[move.offset : move.offset + move.size]
        disk.tier.load(move.key, move.source_offset, move.size, target, token=move.offset)

    def _retire_failed_disks(self) -> None:
        """Unmount the disks taken out of service (the master forgets what only they held)."""
        for disk in [disk for disk in self.disks if not disk.tier.up]:
            self.disks.remove(disk)
            self.retired.append(disk)
            if disk.mounted:
                try:
                    self._rpc.call(m.Unmount(self.server_id, [disk.mount_id]))
                except KVConnectError as exc:
                    log.warning("unmount of failed disk %s: %s", disk.path, exc)
            disk.tier.close()


def _data_file(given: Path, server_id: str, named: bool) -> Path:
    """The data file of a ``disk`` path: the path itself, or a file named after the server in
    that directory (which needs a configured ``server_id`` to be found again)."""
    if not given.is_dir():
        return given
    if not named:
        raise StoreError(
            f"disk {given} is a directory: set server_id, which names the file in it "
            "(and lets a restarted server find its objects)"
        )
    return given / f"kvconnect-{server_id}.data"


class _ServerCollector(Collector):
    """Capacity and traffic of one store server, and of each of its disks."""

    def __init__(self, server: StoreServer) -> None:
        self._server = server

    def collect(self) -> Any:
        engine_stats = self._server.engine.stats()
        stats = engine_stats.listener
        labels = ["segment"]
        name = [self._server.spec.name]
        capacity = GaugeMetricFamily(
            "kvconnect_store_capacity_bytes", "Memory offered", labels=labels
        )
        capacity.add_metric(name, self._server.config.size)
        served = CounterMetricFamily(
            "kvconnect_store_served_bytes", "Bytes read by peers", labels=labels
        )
        served.add_metric(name, stats.bytes_served)
        received = CounterMetricFamily(
            "kvconnect_store_received_bytes", "Bytes written by peers", labels=labels
        )
        received.add_metric(name, stats.bytes_received)
        frames = _histogram(
            "kvconnect_store_transfer_seconds",
            "Time to serve one READ/WRITE frame over TCP",
            {self._server.spec.name: engine_stats.served_latency},
        )
        return [capacity, served, received, frames, *self._disks()]

    def _disks(self) -> list[Any]:
        mounted = [*self._server.disks, *self._server.retired]
        disks = {disk.name: disk.tier.stats() for disk in mounted}
        families = []
        for metric, field, kind, doc in _DISK_METRICS:
            family = kind(f"kvconnect_store_disk_{metric}", doc, labels=["segment"])
            for name, stats in disks.items():
                family.add_metric([name], float(getattr(stats, field)))
            families.append(family)
        families.append(
            _histogram(
                "kvconnect_store_disk_read_seconds",
                "Time of one read of a disk's data file",
                {name: stats.read_latency for name, stats in disks.items()},
            )
        )
        families.append(
            _histogram(
                "kvconnect_store_disk_write_seconds",
                "Time of one write of an object to a disk's data file",
                {name: stats.write_latency for name, stats in disks.items()},
            )
        )
        return families


_DISK_METRICS = (
    ("up", "up", GaugeMetricFamily, "1 while the disk is in service"),
    ("capacity_bytes", "capacity", GaugeMetricFamily, "Disk space offered"),
    ("used_bytes", "used", GaugeMetricFamily, "Bytes of the objects the disk holds"),
    ("objects", "objects", GaugeMetricFamily, "Objects the disk holds"),
    ("queue_bytes", "queue_bytes", GaugeMetricFamily, "Evicted bytes waiting to be written"),
    ("written_bytes", "bytes_written", CounterMetricFamily, "Bytes written to the data file"),
    ("read_bytes", "bytes_read", CounterMetricFamily, "Bytes read from the data file"),
    ("demotions", "demotions", CounterMetricFamily, "Objects moved in from memory (durable)"),
    (
        "demotions_failed",
        "demotions_failed",
        CounterMetricFamily,
        "Moves in given up (queue full, errors)",
    ),
    ("loads", "loads", CounterMetricFamily, "Objects read back into memory (promotions)"),
    ("loads_failed", "loads_failed", CounterMetricFamily, "Promotions given up"),
    (
        "checksum_failures",
        "checksum_failures",
        CounterMetricFamily,
        "Reads whose bytes failed their checksum",
    ),
    ("read_errors", "read_errors", CounterMetricFamily, "Reads that failed or came back short"),
    ("lost", "lost", CounterMetricFamily, "Objects dropped because they could not be served"),
    ("compactions", "compactions", CounterMetricFamily, "Rewrites of the index"),
)


def _histogram(name: str, doc: str, snapshots: dict[str, LatencySnapshot]) -> Any:
    """A Prometheus histogram per segment from latency snapshots."""
    family = HistogramMetricFamily(name, doc, labels=["segment"])
    for segment, latency in snapshots.items():
        buckets = []
        cumulative = 0
        for bound, count in zip((*latency.bounds, float("inf")), latency.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric([segment], buckets, latency.total)
    return family
