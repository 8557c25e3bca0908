"""The master process: MasterState behind an RpcServer, plus Prometheus metrics.

One thread answers requests and runs the state's background ticks between them (no locks on
the state). Metrics are read from a snapshot the same thread refreshes, never from live state.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvconnect._config import tenant_token
from kvconnect.store import messages as m
from kvconnect.store.config import MasterConfig
from kvconnect.store.master import tenants
from kvconnect.store.master.ha import Leadership
from kvconnect.store.master.kvevents import KvEventPublisher, MasterEvents
from kvconnect.store.master.peers import PeerReports
from kvconnect.store.master.state import MasterState
from kvconnect.store.rpc import RpcServer

log = logging.getLogger(__name__)

_SNAPSHOT_EVERY = 1.0
_BULK_BYTES = 1 << 20
"""An answer that starts a transfer of more than this (a put's placements, a read's replicas)
brings its client back only after the transfer's milliseconds: the master does not poll for
it, and leaves the CPU to the transfer where they share a host."""


class MasterService:
    """Runs a master; ``start()`` returns once it answers, ``close()`` stops it."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.state = MasterState(config)
        self.peer_reports = PeerReports()  # not the state's: a new term keeps them
        self._leadership: Leadership | None = None
        self._term = 0  # the term the current state belongs to
        self._elected = 0  # the term Leadership reported last (applied by the service thread)
        self._t0 = time.monotonic()
        self._moving = 0  # bytes the last answer sends its client to move
        self._server = RpcServer(
            config.listen,
            self._handle,
            self._tick,
            token=config.cluster_token(),
            max_message_bytes=config.max_message_bytes,
            poll_window=config.poll_window,
            soon=lambda: self._moving <= _BULK_BYTES,
            tenants=_tenant_tokens(config),
        )
        self._tenant = tenants.NONE  # the tenant of the request being answered (one at a time)
        self._thread: threading.Thread | None = None
        self._http: Any = None
        self._events: MasterEvents | None = None
        if config.kv_events:
            publisher = KvEventPublisher(
                config.kv_events, config.kv_events_replay or None, config.kv_events_buffer
            )
            self._events = MasterEvents(publisher)
        self.registry = CollectorRegistry()
        self._latency = Histogram(
            "kvconnect_master_rpc_seconds",
            "Time to answer a request, by method",
            ["method"],
            registry=self.registry,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
        )
        self._snapshot: m.StatsReply = self._stats()
        self._snapshot_at = 0.0
        self.registry.register(_StateCollector(lambda: self._snapshot))
        self._handlers: dict[type, Callable[[Any], m.Reply]] = {
            m.Exists: self._exists,
            m.PutStart: self._put_start,
            m.PutEnd: self._put_end,
            m.PutRevoke: self._put_revoke,
            m.GetReplicas: self._get_replicas,
            m.Remove: self._remove,
            m.Mount: self._mount,
            m.Report: self._report,
            m.Unmount: self._unmount,
            m.Heartbeat: self._heartbeat,
            m.Stats: lambda _request: self._stats(),
            m.Removals: self._removals,
            m.PeerReport: self._peer_report,
        }

    @property
    def endpoint(self) -> str:
        """The bound ``tcp://`` endpoint (after start)."""
        return self._server.endpoint

    @property
    def crashed(self) -> BaseException | None:
        """Why the serving loop ended on its own (then the process should exit), or None."""
        return self._server.crashed

    def start(self) -> str:
        """Bind, start the service thread (and the metrics server); returns the endpoint."""
        endpoint = self._server.bind()
        if self._events is not None:
            self._events.start()
        if self.config.ha:
            advertise = self.config.advertise or endpoint
            self._leadership = Leadership(
                self.config.ha, advertise, self.config.ha_ttl, self._leader_changed
            )
            self._leadership.start()
        self._thread = threading.Thread(
            target=self._server.serve, name="kvconnect-master", daemon=True
        )
        self._thread.start()
        if self.config.metrics_port:
            self._http, _ = start_http_server(
                self.config.metrics_port, addr="127.0.0.1", registry=self.registry
            )
        log.info("store master listening on %s", endpoint)
        return endpoint

    def close(self) -> None:
        """Stop serving (a leader hands leadership over at once). Idempotent."""
        if self._leadership is not None:
            self._leadership.close()
            self._leadership = None
        self._server.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._events is not None:
            self._events.close()

    def now(self) -> float:
        """Seconds since this master started (small floats keep float32 columns precise)."""
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------------------ serving

    def _leader_changed(self, term: int) -> None:
        self._elected = term  # applied by the service thread, which owns the state

    def _tick(self) -> float:
        now = self.now()
        if self._elected != self._term:
            # A new term starts from an empty index: store servers mount again when their
            # heartbeat finds they are unknown, reporting what they hold. A standby keeps
            # nothing.
            self.state = MasterState(self.config)
            self._term = self._elected
            if self._events is not None:
                self._events.new_state()
        self.state.tick(now)
        if self._events is not None:
            self._events.changed(self.state)
        if now - self._snapshot_at >= _SNAPSHOT_EVERY:
            self._snapshot, self._snapshot_at = self._stats(), now
        return 0.0 if self.state.busy() else 0.05

    def _handle(self, request: m.Request, tenant: str | None) -> m.Reply:
        """A request of ``tenant`` (None: the cluster's own processes)."""
        if tenant is None:
            self._tenant = tenants.NONE
            return self._dispatch(request)
        scoped = tenants.scoped(request, tenant)
        if isinstance(scoped, m.Error):
            return scoped
        self._tenant = self.state.tenants.id(tenant)
        if isinstance(scoped, m.Stats):
            return self._stats(self._tenant)
        return tenants.unscoped(self._dispatch(scoped), tenant)

    def _dispatch(self, request: m.Request) -> m.Reply:
        if not self._serving() and not isinstance(request, m.Stats):
            return m.Error(m.Code.NOT_LEADER, "this master is a standby")
        start = time.perf_counter()
        keys = (
            getattr(request, "keys", None)
            or getattr(request, "items", None)
            or getattr(request, "held", None)
        )
        if keys is not None and len(keys) > m.MAX_BATCH:
            return m.Error(m.Code.INVALID, f"batch of {len(keys)} exceeds {m.MAX_BATCH}")
        events = self._events
        watch = events.watch(self.state, request) if events is not None else None
        self._moving = 0
        reply = self._handlers[type(request)](request)
        if events is not None:
            events.changed(self.state, watch)
        self._latency.labels(type(request).__name__).observe(time.perf_counter() - start)
        return reply

    def _serving(self) -> bool:
        """Without HA always; with HA only while leading and in the term of the state."""
        leadership = self._leadership
        if leadership is None:
            return self.config.ha == ""
        return leadership.leading() and self._term == leadership.term

    def _exists(self, request: m.Exists) -> m.Reply:
        return m.ExistsReply(self.state.exists(request.keys))

    def _put_start(self, request: m.PutStart) -> m.Reply:
        results = self.state.put_start(
            request.client,
            request.items,
            request.replicas,
            request.host_id,
            request.pin,
            self.now(),
            self._tenant,
        )
        placed = zip(request.items, results, strict=True)
        self._moving = request.replicas * sum(i.size for i, p in placed if p.code is m.Code.OK)
        return m.PutStartReply(results)

    def _put_end(self, request: m.PutEnd) -> m.Reply:
        if not len(request.parts) == len(request.puts) == len(request.keys):
            return m.Error(m.Code.INVALID, "put_end: keys, parts and puts differ in length")
        codes = self.state.put_end(request.keys, request.parts, request.puts, self.now())
        return m.CodesReply(codes)

    def _put_revoke(self, request: m.PutRevoke) -> m.Reply:
        if len(request.puts) != len(request.keys):
            return m.Error(m.Code.INVALID, "put_revoke: keys and puts differ in length")
        return m.CodesReply(self.state.put_revoke(request.keys, request.puts, self.now()))

    def _get_replicas(self, request: m.GetReplicas) -> m.Reply:
        results = self.state.get_replicas(request.keys, self.now(), request.host_id)
        self._moving = sum(replicas.size for replicas in results)
        return m.ReplicasReply(results, int(self.config.lease_ttl * 1000))

    def _remove(self, request: m.Remove) -> m.Reply:
        return m.CodesReply(self.state.remove(request.keys, request.force, self.now()))

    def _mount(self, request: m.Mount) -> m.Reply:
        code = self.state.mount(
            request.server,
            request.mount_id,
            request.segment,
            self.now(),
            request.held,
            request.more,
        )
        return m.CodesReply([code])

    def _report(self, request: m.Report) -> m.Reply:
        code = self.state.report(
            request.server, request.mount_id, request.held, request.more, self.now()
        )
        return m.CodesReply([code])

    def _unmount(self, request: m.Unmount) -> m.Reply:
        return m.CodesReply(self.state.unmount(request.server, request.mount_ids))

    def _heartbeat(self, request: m.Heartbeat) -> m.Reply:
        if len(request.applied) != len(request.mount_ids):
            return m.Error(m.Code.INVALID, "heartbeat: mount_ids and applied differ in length")
        unknown, changes = self.state.heartbeat(
            request.server, request.mount_ids, request.applied, self.now(), request.reports
        )
        return m.HeartbeatReply(unknown, changes, [t.name for t in self.config.tenants])

    def _removals(self, request: m.Removals) -> m.Reply:
        # A tenant's prefix was checked before its own prefix was put in front (tenants.py).
        limit = m.MAX_KEY_BYTES if self._tenant == tenants.NONE else m.MAX_STORED_KEY_BYTES
        if len(request.prefix.encode(errors="replace")) > limit:
            return m.Error(m.Code.INVALID, f"prefix longer than {m.MAX_KEY_BYTES} bytes")
        return self.state.removals.since(request.prefix, request.since, request.limit)

    def _peer_report(self, request: m.PeerReport) -> m.Reply:
        code = self.peer_reports.record(self._tenant, request, self.now())
        return code if isinstance(code, m.Error) else m.CodesReply([code])

    def _stats(self, tenant: int | None = None) -> m.StatsReply:
        """The cluster's stats; a tenant's (``tenant``): its own keys, usage and clients'
        peers only."""
        if tenant is not None:
            (own,) = self.state.tenant_stats(tenant)
            peers = self.peer_reports.summary(self.now(), tenant)
            return m.StatsReply(
                own.objects, 0, own.used, own.evictions, 0, [], tenants=[own], peers=peers
            )
        keys, pending, segments = self.state.stats()
        return m.StatsReply(
            keys=keys,
            pending=pending,
            bytes_stored=self.state.bytes_stored,
            evictions=self.state.evictions,
            evicted_bytes=self.state.evicted_bytes,
            segments=segments,
            term=self._term if self._serving() else 0,
            refused=self._server.refused,
            dropped=self._server.malformed,
            connections=self._server.connections,
            tiers=self.state.tier_stats(),
            tenants=self.state.tenant_stats(),
            peers=self.peer_reports.summary(self.now()),
        )


def _tenant_tokens(config: MasterConfig) -> dict[str, str]:
    """Each tenant's token (derived from the cluster token) → its name."""
    token = config.cluster_token()
    if not config.tenants or token is None:
        return {}
    return {tenant_token(token, t.name): t.name for t in config.tenants}


class _StateCollector(Collector):
    """Exports the latest stats snapshot on scrape."""

    def __init__(self, snapshot: Callable[[], m.StatsReply]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        stats = self._snapshot()
        yield GaugeMetricFamily("kvconnect_master_keys", "Complete objects", value=stats.keys)
        yield GaugeMetricFamily(
            "kvconnect_master_pending_puts", "Puts in flight", value=stats.pending
        )
        yield GaugeMetricFamily(
            "kvconnect_master_stored_bytes", "Bytes of complete objects", value=stats.bytes_stored
        )
        yield CounterMetricFamily(
            "kvconnect_master_evictions", "Objects evicted", value=stats.evictions
        )
        yield CounterMetricFamily(
            "kvconnect_master_evicted_bytes", "Bytes evicted", value=stats.evicted_bytes
        )
        yield CounterMetricFamily(
            "kvconnect_master_refused_connections",
            "Connections refused for want of the cluster token",
            value=stats.refused,
        )
        yield GaugeMetricFamily(
            "kvconnect_master_connections", "Client connections open", value=stats.connections
        )
        yield CounterMetricFamily(
            "kvconnect_master_dropped_messages",
            "Messages dropped unanswered (malformed, too deep, reply not sendable)",
            value=stats.dropped,
        )
        used = GaugeMetricFamily(
            "kvconnect_segment_used_bytes",
            "Bytes of stored objects and pending puts per segment",
            labels=["segment"],
        )
        in_transit = GaugeMetricFamily(
            "kvconnect_segment_in_transit_bytes",
            "Released bytes per segment not allocatable yet (acknowledgement, lease, quarantine)",
            labels=["segment"],
        )
        capacity = GaugeMetricFamily(
            "kvconnect_segment_capacity_bytes", "Capacity per segment", labels=["segment"]
        )
        backlog = GaugeMetricFamily(
            "kvconnect_segment_journal_backlog",
            "Journal changes the segment's store server has not acknowledged",
            labels=["segment"],
        )
        for segment in stats.segments:
            used.add_metric([segment.name], segment.used)
            in_transit.add_metric([segment.name], segment.in_transit)
            capacity.add_metric([segment.name], segment.capacity)
            backlog.add_metric([segment.name], segment.backlog)
        yield used
        yield in_transit
        yield capacity
        yield backlog
        yield from _labelled(_TIER_SERIES, "tier", ((t.tier.name.lower(), t) for t in stats.tiers))
        yield from _labelled(_TENANT_SERIES, "tenant", ((t.name, t) for t in stats.tenants))
        yield from _labelled(_PEER_SERIES, "peer", ((p.peer, p) for p in stats.peers))


_Series = tuple[tuple[str, type[GaugeMetricFamily | CounterMetricFamily], str, str], ...]
"""Families of one labelled table: (attribute, kind, metric name, help)."""
_G, _C = GaugeMetricFamily, CounterMetricFamily

_TIER_SERIES: _Series = (
    ("capacity", _G, "kvconnect_tier_capacity_bytes", "Capacity of the tier's live segments"),
    ("used", _G, "kvconnect_tier_used_bytes", "Bytes of stored objects, pending puts and moves"),
    ("objects", _G, "kvconnect_tier_objects", "Replicas held in the tier"),
    ("hits", _C, "kvconnect_tier_hits", "Reads answered with a replica of the tier first"),
    ("demotions", _C, "kvconnect_tier_demotions", "Objects moved into the tier from DRAM"),
    ("demotions_failed", _C, "kvconnect_tier_demotions_failed", "Demotions into the tier failed"),
    ("promotions", _C, "kvconnect_tier_promotions", "Objects copied into the tier from disk"),
    ("evictions", _C, "kvconnect_tier_evictions", "Objects the tier's eviction took out of it"),
    ("lost", _C, "kvconnect_tier_lost", "Replicas of the tier lost (unreadable, segment gone)"),
)
_TENANT_SERIES: _Series = (
    ("quota", _G, "kvconnect_tenant_quota_bytes", "Its memory quota (0: none)"),
    ("disk_quota", _G, "kvconnect_tenant_disk_quota_bytes", "Its disk quota"),
    ("share", _G, "kvconnect_tenant_share_bytes", "Its share of a full store"),
    ("used", _G, "kvconnect_tenant_used_bytes", "Its bytes in memory, and puts"),
    ("disk_used", _G, "kvconnect_tenant_disk_used_bytes", "Its bytes on disk"),
    ("objects", _G, "kvconnect_tenant_objects", "Its objects and puts"),
    ("evictions", _C, "kvconnect_tenant_evictions", "Its objects evicted"),
)
# Sums over the clients that reported within the TTL (a client that goes takes its counts).
_PEER_SERIES: _Series = (
    ("clients", _G, "kvconnect_peer_clients", "Clients that reported using the peer cluster"),
    ("down", _G, "kvconnect_peer_clients_down", "Of them, those whose breaker for it is open"),
    ("counts.asked", _G, "kvconnect_peer_keys_asked", "Keys those clients looked up there"),
    ("counts.hits", _G, "kvconnect_peer_keys_hit", "Keys those clients read from there"),
    ("counts.bytes_read", _G, "kvconnect_peer_read_bytes", "Bytes those clients read from there"),
    ("counts.failures", _G, "kvconnect_peer_failures", "Calls of those clients to it that failed"),
    (
        "counts.skipped",
        _G,
        "kvconnect_peer_keys_skipped",
        "Keys not asked while their breaker was open",
    ),
    ("counts.copied", _G, "kvconnect_peer_keys_copied", "Keys copied between it and home"),
    ("reads", _G, "kvconnect_peer_client_reads", "Keys those clients read from anywhere"),
)


def _labelled(series: _Series, label: str, rows: Iterable[tuple[str, Any]]) -> Iterable[Any]:
    """One family per entry of ``series``, a sample per (label value, row) of ``rows`` (an
    attribute may be dotted: ``counts.hits``)."""
    rows = list(rows)
    for field, kind, name, text in series:
        family = kind(name, text, labels=[label])
        get = operator.attrgetter(field)
        for value, row in rows:
            family.add_metric([value], get(row))
        yield family
