"""Tenants on a real cluster (master and store server in their own processes): each tenant's
clients hold only the tenant's token (derived from the cluster token) and reach only its own
keys, over the master and the store server's data path; a noisy tenant filling past its
quota evicts its own objects while another tenant's working set stays resident, byte for
byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest

from kvconnect._config import cluster_token, tenant_token
from kvconnect.errors import StoreError
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
KiB, MiB = 1 << 10, 1 << 20
TENANTS = [{"name": "noisy", "quota": 2 * MiB}, {"name": "calm", "quota": 4 * MiB}]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    master = ["--master-tenants", json.dumps(TENANTS), "--master-eviction-step", "64"]
    server = ["--store-heartbeat-interval", "0.3"]
    with Cluster(1, 16 * MiB, master_args=master, server_args=server) as c:
        yield c


def _root() -> str:
    token = cluster_token(None, "", False)
    assert token is not None
    return token


def _tenant(cluster: Cluster, name: str) -> StoreClient:
    client = StoreClient(
        StoreClientConfig(master=cluster.master_endpoint, breaker_cooldown=0.2),
        TransferConfig(token=tenant_token(_root(), name)),
    )
    client.start()
    return client


def _value(seed: int, size: int = 64 * KiB) -> bytes:
    return pattern(seed, size).tobytes()


def test_tenants_see_only_their_own_keys(cluster: Cluster) -> None:
    with _tenant(cluster, "noisy") as a, _tenant(cluster, "calm") as b:
        assert a.put("shared-name", _value(1)) is Code.OK
        assert b.put("shared-name", _value(2)) is Code.OK  # another object: no EXISTS
        assert a.put("only-a", _value(3)) is Code.OK
        assert a.get("shared-name") == _value(1)
        assert b.get("shared-name") == _value(2)
        assert b.batch_exists(["only-a", "shared-name"]) == [False, True]
        assert b.get("only-a") is None
        assert b.remove("only-a") is Code.NOT_FOUND
        assert a.get("only-a") == _value(3)
        assert b.remove("shared-name", force=True) is Code.OK
        assert a.get("shared-name") == _value(1)
        listing = b.removals("", 0)
        assert [r.key for r in listing.removed] == ["shared-name"]  # its own, unprefixed
        assert a.removals("", 0).removed == []
        mine = a.stats()
        assert (mine.keys, mine.segments, [t.name for t in mine.tenants]) == (2, [], ["noisy"])
    whole = cluster.stats()  # the cluster token sees every tenant
    assert {t.name: t.objects for t in whole.tenants} == {"noisy": 2, "calm": 0}
    command = [sys.executable, "-m", "kvconnect.cli", "status", "--master", cluster.master_endpoint]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["noisy"][1:3] == [str(2 * 64 * KiB), str(2 * MiB)]  # memory used, quota
    assert rows["calm"][1:3] == ["0", str(4 * MiB)]


def test_a_tenant_cannot_make_the_clusters_own_requests(cluster: Cluster) -> None:
    rpc = RpcClient(cluster.master_endpoint, 2.0, token=tenant_token(_root(), "noisy"))
    try:
        reply = rpc.call(m.Unmount("store-server", ["any"]))
        assert isinstance(reply, m.Error)
        assert reply.code is Code.DENIED
    finally:
        rpc.close()
    stranger = RpcClient(cluster.master_endpoint, 1.0, token=tenant_token(_root(), "absent"))
    try:
        with pytest.raises(StoreError):
            stranger.call(m.Stats())
    finally:
        stranger.close()


def test_peer_reports_are_shown_to_their_tenant_and_hostile_ones_refused(
    cluster: Cluster,
) -> None:
    use = m.PeerUse("east", "tcp://east:1", True, m.PeerCounts(asked=7, hits=5, bytes_read=500))
    rpc = RpcClient(cluster.master_endpoint, 2.0, token=tenant_token(_root(), "noisy"))
    try:
        assert rpc.call(m.PeerReport("c1", 3, [use])) == m.CodesReply([Code.OK])
        for hostile in (
            m.PeerReport("c2", -1, [use]),
            m.PeerReport("c2", 0, [use] * 2),
            m.PeerReport("c2", 0, [msgspec.structs.replace(use, peer=f"p{n}") for n in range(17)]),
            m.PeerReport("x" * 5000, 0, [use]),
        ):
            reply = rpc.call(hostile)
            assert isinstance(reply, m.Error)
            assert reply.code is Code.INVALID
    finally:
        rpc.close()
    with _tenant(cluster, "noisy") as noisy, _tenant(cluster, "calm") as calm:
        (east,) = noisy.stats().peers
        assert (east.peer, east.clients, east.counts, east.reads) == (
            "east",
            1,
            m.PeerCounts(asked=7, hits=5, bytes_read=500),
            8,
        )
        assert calm.stats().peers == []
    assert [p.clients for p in cluster.stats().peers] == [1]


def test_a_noisy_tenant_over_its_quota_evicts_only_its_own_objects(cluster: Cluster) -> None:
    with _tenant(cluster, "noisy") as noisy, _tenant(cluster, "calm") as calm:
        working = {f"calm-{i}": _value(100 + i) for i in range(32)}  # 2 MiB of its 4
        for key, value in working.items():
            assert calm.put(key, value) is Code.OK
        for i in range(160):  # 10 MiB into a 2 MiB quota
            key = f"noisy-{i}"

            def stored(key: str = key, value: bytes = _value(i)) -> bool:
                return noisy.put(key, value) in (Code.OK, Code.EXISTS)

            wait_for(stored, f"{key} stored once the tenant's eviction made room")
        usage = {t.name: t for t in cluster.stats().tenants}
        assert usage["noisy"].used <= 2 * MiB
        assert usage["noisy"].evictions >= 160 - 32
        assert usage["calm"].evictions == 0
        for key, value in working.items():
            assert calm.get(key) == value
        assert noisy.get("noisy-159") == _value(159)


def test_tenant_token_command_prints_the_derived_token() -> None:
    env = {**os.environ, "KVCONNECT_TOKEN": "root-of-the-cluster"}
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "tenant-token", "calm"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout.strip()
    assert out == tenant_token("root-of-the-cluster", "calm")
