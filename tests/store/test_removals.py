"""The master's removal log: the pure ring, what the state records in it, and the RPC on a
real master (bounds, hostile input, authentication)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect._config import MiB
from kvconnect.errors import MasterUnavailable, StoreError
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.master.removals import MAX_REMOVALS, REMOVAL_SCAN, RemovalLog
from kvconnect.store.messages import Code, PutItem, RemovalReason
from kvconnect.store.rpc import RpcClient
from kvconnect.testing.peer import pattern
from tests.store.test_state import _acknowledge, _mount, _put, _state


def _keys(reply: m.RemovalsReply) -> list[str]:
    return [r.key for r in reply.removed]


def test_the_log_pages_by_prefix_and_sequence_number() -> None:
    log = RemovalLog(capacity=100)
    for i in range(10):
        log.record(f"{'a' if i % 2 else 'b'}/{i}", RemovalReason.EVICTED)
    reply = log.since("a/", 0, 2)
    assert _keys(reply) == ["a/1", "a/3"]
    assert [r.seq for r in reply.removed] == [2, 4]
    assert (reply.first, reply.next) == (1, 4)
    rest = log.since("a/", reply.next, 100)
    assert _keys(rest) == ["a/5", "a/7", "a/9"]
    assert rest.next == 10
    assert log.since("a/", rest.next, 100) == m.RemovalsReply(log.epoch, 1, 10, [])
    assert _keys(log.since("", 8, 100)) == ["b/8", "a/9"]


def test_a_client_that_falls_behind_learns_what_it_missed() -> None:
    log = RemovalLog(capacity=4)
    for i in range(10):
        log.record(f"k{i}", RemovalReason.REMOVED)
    reply = log.since("", 0, 100)
    assert reply.first == 7, "entries 1..6 are gone: the client sees first > since + 1"
    assert _keys(reply) == ["k6", "k7", "k8", "k9"]


def test_hostile_arguments_are_bounded() -> None:
    log = RemovalLog(capacity=REMOVAL_SCAN * 2)
    for i in range(REMOVAL_SCAN * 2):
        log.record(f"k{i}", RemovalReason.REMOVED)
    huge = log.since("", 0, 10**9)
    assert len(huge.removed) == MAX_REMOVALS, "the limit is capped"
    assert len(log.since("", 0, -5).removed) == 1, "a limit below 1 means 1"
    scan = log.since("nothing matches", 0, 10)
    assert scan.removed == []
    assert scan.next == REMOVAL_SCAN, "one request scans a bounded run"
    assert log.since("nothing matches", scan.next, 10).next == 2 * REMOVAL_SCAN
    ahead = log.since("", 10**15, 10)
    assert ahead.removed == []
    assert ahead.next == 2 * REMOVAL_SCAN, "a future since is clamped"
    assert _keys(log.since("", -(10**15), 1)) == ["k0"]


def test_the_state_logs_removed_evicted_and_lost_objects_but_not_failed_puts() -> None:
    state = _state(high_watermark=0.5, evict_fraction=0.25, eviction_step=4)
    _mount(state, "a", size=64 * 1024)
    _mount(state, "b", size=64 * 1024, host="h2")
    assert _put(state, "removed", 1024) is Code.OK
    assert state.remove(["removed", "absent"], False, 1.0) == [Code.OK, Code.NOT_FOUND]
    pending = state.put_start("c", [PutItem("pending", 1024)], 1, "h1", False, 1.0)[0]
    assert pending.code is Code.OK
    assert state.put_revoke(["pending"], [pending.put], 1.0) == [Code.OK]
    for i in range(80):
        assert _put(state, f"e{i:02d}", 1024, now=2.0 + i) is Code.OK
    for step in range(50):
        state.tick(100.0 + step)
        _acknowledge(state, 100.0 + step)
    removed = state.removals.since("", 0, MAX_REMOVALS).removed
    assert removed[0] == m.Removal(1, "removed", RemovalReason.REMOVED)
    evicted = [r.key for r in removed if r.reason is RemovalReason.EVICTED]
    assert evicted
    assert not any(state.exists(evicted))
    assert "pending" not in [r.key for r in removed], "a put that never completed is no removal"
    survivors = [f"e{i:02d}" for i in range(80) if state.exists([f"e{i:02d}"])[0]]
    assert len(evicted) + len(survivors) == 80
    state.unmount("server-a", ["mount-a"])
    state.unmount("server-b", ["mount-b"])
    for step in range(10):
        state.tick(200.0 + step)
    lost = state.removals.since("e", removed[-1].seq, MAX_REMOVALS).removed
    assert sorted(r.key for r in lost) == sorted(survivors)
    assert {r.reason for r in lost} == {RemovalReason.LOST}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=16 * MiB) as c:
        yield c


@pytest.mark.integration
def test_removals_over_a_real_master(cluster: Cluster) -> None:
    client = StoreClient(StoreClientConfig(master=cluster.master_endpoint, rpc_timeout=2.0))
    client.start()
    try:
        start = client.removals("", 0).next  # earlier removals on this master, if any
        region = client.register(bytearray(pattern(3, 3 * 4096).tobytes()))
        keys = ["ev/a", "ev/b", "other/c"]
        assert client.batch_put_from(keys, region, [0, 4096, 8192], [4096] * 3).ok() == [True] * 3
        assert client.batch_remove(keys) == [Code.OK] * 3
        reply = client.removals("ev/", start)
        assert _keys(reply) == ["ev/a", "ev/b"]
        assert {r.reason for r in reply.removed} == {RemovalReason.REMOVED}
        assert client.removals("ev/", reply.next).removed == []
        with pytest.raises(StoreError, match="prefix longer"):
            client.removals("x" * (m.MAX_KEY_BYTES + 1), 0)
        assert client.batch_exists(["ev/a"]) == [False], "the master serves on after refusing"
    finally:
        client.close()


@pytest.mark.integration
def test_removals_need_the_cluster_token(cluster: Cluster) -> None:
    rpc = RpcClient(cluster.master_endpoint, 0.5, token="not-the-cluster-token")
    try:
        with pytest.raises(MasterUnavailable):
            rpc.call(m.Removals("", 0))
    finally:
        rpc.close()
