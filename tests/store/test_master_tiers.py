"""The master's tiers over its real RPC port (a master process; this test plays a store server
with a DRAM and a disk segment): a demotion travels in the heartbeat's journal, its outcome in
the heartbeat's reports; Stats, ``kvconnect status`` and the metrics show the tiers."""

from __future__ import annotations

import urllib.request

import pytest

from kvconnect._config import cluster_token
from kvconnect.store import messages as m
from kvconnect.store.commands import run_status
from kvconnect.store.launch import Cluster, free_port
from kvconnect.store.rpc import RpcClient
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
KiB = 1 << 10
DRAM, DISK = "mount-dram", "mount-disk"


def _heartbeat(
    rpc: RpcClient, applied: dict[str, int], reports: list[m.TierReport]
) -> dict[str, m.Changes]:
    reply = rpc.call(m.Heartbeat("srv", list(applied), list(applied.values()), reports))
    assert isinstance(reply, m.HeartbeatReply)
    assert reply.unknown == []
    return {changes.mount_id: changes for changes in reply.changes}


def _fill(rpc: RpcClient) -> None:
    """Mount the segments, and put 16 KiB into the 16 KiB DRAM segment."""
    for mount_id, tier, size in ((DRAM, m.Tier.DRAM, 16 * KiB), (DISK, m.Tier.DISK, 64 * KiB)):
        name = "srv" if tier is m.Tier.DRAM else "srv/disk0"
        spec = m.SegmentSpec(name, "engine-srv", 1 + tier, size, "h1", tier)
        assert rpc.call(m.Mount("srv", mount_id, spec)) == m.CodesReply([m.Code.OK])
    for i in range(4):
        key = f"k{i}"
        start = rpc.call(m.PutStart("client", [m.PutItem(key, 4 * KiB)]))
        assert isinstance(start, m.PutStartReply)
        assert start.results[0].locations[0].region == 1, "puts go to DRAM"
        end = rpc.call(m.PutEnd("client", [key], [0], [start.results[0].put]))
        assert end == m.CodesReply([m.Code.OK])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def test_a_demotion_round_trips_through_heartbeats_and_stats_show_the_tiers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    metrics = free_port()
    args = ["--master-high-watermark", "0.8", "--master-metrics-port", str(metrics)]
    with Cluster(servers=0, master_args=args) as cluster:
        token = cluster_token(None, "", False)
        rpc = RpcClient(cluster.master_endpoint, 5.0, token=token)
        try:
            _fill(rpc)
            applied = {DRAM: 0, DISK: 0}
            moves: list[m.Change] = []

            def demoted() -> bool:  # eviction runs between requests, on its own
                changes = _heartbeat(rpc, applied, [])[DISK].changes
                moves[:] = [c for c in changes if c.source_region]
                return bool(moves)

            wait_for(demoted, "the master demoted nothing")
            assert {c.source_region for c in moves} == {1}
            done = m.TierReport(DISK, done=[m.Moved(c.key, c.offset) for c in moves])
            journals = _heartbeat(rpc, applied, [done])
            released = [c for c in journals[DRAM].changes if not c.key]
            assert sorted(c.offset for c in released) == sorted(c.source_offset for c in moves)
            reply = rpc.call(m.GetReplicas([moves[0].key]))
            assert isinstance(reply, m.ReplicasReply)
            assert reply.results[0].locations[0].region == 2, "now read from disk"
        finally:
            rpc.close()
        stats = cluster.stats()
        tiers = {t.tier: t for t in stats.tiers}
        demoted_bytes = len(moves) * 4 * KiB
        disk = tiers[m.Tier.DISK]
        assert (disk.capacity, disk.used, disk.objects) == (64 * KiB, demoted_bytes, len(moves))
        assert (disk.demotions, disk.hits) == (len(moves), 1)
        assert tiers[m.Tier.DRAM].capacity == 16 * KiB
        assert {s.name: s.tier for s in stats.segments} == {
            "srv": m.Tier.DRAM,
            "srv/disk0": m.Tier.DISK,
        }
        assert run_status(cluster.master_endpoint, 5.0, token) == 0
        table = capsys.readouterr().out.splitlines()
        row = next(line for line in table if line.startswith("disk ")).split()
        count = str(len(moves))
        # tier, capacity, used, objects, hits, demotions
        assert row[:6] == ["disk", str(64 * KiB), str(demoted_bytes), count, "1", count]
        assert any(line.split()[:2] == ["srv/disk0", "disk"] for line in table)
        demotions = f'kvconnect_tier_demotions_total{{tier="disk"}} {len(moves)}.0'
        wait_for(lambda: demotions in _scrape(metrics), "the metrics never showed the demotions")
        assert 'kvconnect_tier_capacity_bytes{tier="dram"} 16384.0' in _scrape(metrics)
