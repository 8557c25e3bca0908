"""The master's Prometheus export of a stats snapshot: every labelled table (tiers, tenants,
peers) as families with one sample per row."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvconnect.store import messages as m
from kvconnect.store.master.service import _StateCollector


def _scrape(stats: m.StatsReply) -> str:
    registry = CollectorRegistry()
    registry.register(_StateCollector(lambda: stats))
    return generate_latest(registry).decode()


def test_tenants_and_peers_are_exported_a_sample_per_row() -> None:
    counts = m.PeerCounts(asked=9, hits=7, bytes_read=4096, failures=2, skipped=5, copied=3)
    stats = m.StatsReply(
        keys=1,
        pending=0,
        bytes_stored=10,
        evictions=0,
        evicted_bytes=0,
        segments=[],
        tiers=[m.TierStats(m.Tier.DRAM, 100, 10, 3, 0, 0, 0, 0, 0, 0)],
        tenants=[m.TenantStats("acme", 64, 128, 32, 16, 8, 2, 1)],
        peers=[m.PeerSummary("east", "tcp://e:1", clients=2, down=1, reads=11, counts=counts)],
    )
    text = _scrape(stats)
    wanted = [
        'kvconnect_tier_capacity_bytes{tier="dram"} 100.0',
        'kvconnect_tier_used_bytes{tier="dram"} 10.0',
        'kvconnect_tier_hits_total{tier="dram"} 0.0',
        'kvconnect_tenant_quota_bytes{tenant="acme"} 64.0',
        'kvconnect_tenant_disk_quota_bytes{tenant="acme"} 128.0',
        'kvconnect_tenant_share_bytes{tenant="acme"} 32.0',
        'kvconnect_tenant_used_bytes{tenant="acme"} 16.0',
        'kvconnect_tenant_disk_used_bytes{tenant="acme"} 8.0',
        'kvconnect_tenant_objects{tenant="acme"} 2.0',
        'kvconnect_tenant_evictions_total{tenant="acme"} 1.0',
        'kvconnect_peer_clients{peer="east"} 2.0',
        'kvconnect_peer_clients_down{peer="east"} 1.0',
        'kvconnect_peer_client_reads{peer="east"} 11.0',
        'kvconnect_peer_keys_asked{peer="east"} 9.0',
        'kvconnect_peer_keys_hit{peer="east"} 7.0',
        'kvconnect_peer_read_bytes{peer="east"} 4096.0',
        'kvconnect_peer_failures{peer="east"} 2.0',
        'kvconnect_peer_keys_skipped{peer="east"} 5.0',
        'kvconnect_peer_keys_copied{peer="east"} 3.0',
    ]
    assert [line for line in wanted if line not in text.splitlines()] == []
