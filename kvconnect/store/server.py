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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvconnect.errors import KVConnectError, StoreError
from kvconnect.lifecycle import Lifecycle
from kvconnect.store import messages as m
from kvconnect.store.config import StoreServerConfig
from kvconnect.store.held import HeldObjects
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion

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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: Any = None
        self._mounted = False
        self.held = HeldObjects()  # used by the heartbeat thread only
        """What this server holds, as the master's journal told it."""

    @property
    def spec(self) -> m.SegmentSpec:
        """What this server mounts at the master."""
        assert self.region is not None
        return m.SegmentSpec(
            name=self.engine.name,
            engine_segment=self.engine.name,
            region=self.region.id,
            size=self.region.length,
            host_id=self.engine.segment.host_id,
        )

    def start(self) -> None:
        """Allocate the memory, start the engine, mount (retried by the heartbeat thread)."""
        self.engine.start()
        self.region = self.engine.allocate(self.config.size, hugepages=self.config.hugepages)
        try:
            self._mount()
        except StoreError as exc:
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
        if self._thread is not None:
            self._thread.join(timeout=self.config.rpc_timeout + self.config.heartbeat_interval + 1)
            self._thread = None
        if self._mounted:
            try:
                self._rpc.call(m.Unmount(self.server_id, [self.mount_id]))
            except KVConnectError as exc:
                log.warning("unmount failed: %s", exc)
            self._mounted = False
        self._rpc.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.engine.close()

    def _mount(self) -> None:
        """Mount (again, with the same mount id, if a previous attempt broke off), reporting
        what we hold in offset order, in batches."""
        changes = self.held.report()
        batches = [changes[i : i + m.MAX_BATCH] for i in range(0, len(changes), m.MAX_BATCH)]
        first = batches[0] if batches else []
        request: m.Request = m.Mount(
            self.server_id, self.mount_id, self.spec, first, more=len(batches) > 1
        )
        for n in range(len(batches) or 1):
            if n:
                more = n + 1 < len(batches)
                request = m.Report(self.server_id, self.mount_id, batches[n], more)
            reply = self._rpc.call(request)
            if not isinstance(reply, m.CodesReply) or reply.codes != [m.Code.OK]:
                raise StoreError(f"master refused the mount: {reply!r}")
        self._mounted = True
        if changes:
            log.info("mounted %s, reporting %d held objects", self.spec.name, len(changes))

    def _remount(self) -> None:
        """The master lost our mount: fence, wait for old transfers to end, mount anew."""
        assert self.region is not None
        old, self.region = self.region, self.engine.fence(self.region)
        self.mount_id = uuid.uuid4().hex
        self.held.new_mount()
        self._mounted = False
        deadline = time.monotonic() + self.config.rpc_timeout
        while self.engine.users(old) and not self._stop.wait(_DRAIN_POLL):
            if time.monotonic() > deadline:
                log.warning(
                    "waiting for %d transfer(s) of the fenced region", self.engine.users(old)
                )
                deadline = time.monotonic() + self.config.rpc_timeout
        self._mount()

    def _heartbeats(self) -> None:
        delay = self.config.heartbeat_interval
        while not self._stop.wait(delay):
            delay = self.config.heartbeat_interval
            try:
                if not self._mounted:
                    self._mount()
                # A heartbeat waits no longer than its interval: a dead leader is then noticed,
                # and the new one found in etcd, within about one interval.
                heartbeat = m.Heartbeat(self.server_id, [self.mount_id], [self.held.applied])
                reply = self._rpc.call(heartbeat, timeout=self.config.heartbeat_interval)
                if not isinstance(reply, m.HeartbeatReply):
                    raise StoreError(f"unexpected heartbeat reply {reply!r}")
                if reply.unknown:
                    log.warning("master does not know our segment (restarted?): mounting again")
                    self._remount()
                for changes in reply.changes:
                    if changes.mount_id == self.mount_id and changes.changes:
                        self.held.apply(changes)
                        delay = _SYNC_INTERVAL  # acknowledge soon: the master waits to reuse
            except KVConnectError as exc:
                log.warning("heartbeat failed: %s", exc)


class _ServerCollector(Collector):
    """Capacity and traffic of one store server."""

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
        latency = engine_stats.served_latency
        buckets = []
        cumulative = 0
        for bound, count in zip((*latency.bounds, float("inf")), latency.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        frames = HistogramMetricFamily(
            "kvconnect_store_transfer_seconds",
            "Time to serve one READ/WRITE frame over TCP",
            labels=labels,
        )
        frames.add_metric(name, buckets, latency.total)
        return [capacity, served, received, frames]
