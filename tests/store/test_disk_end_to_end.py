"""The disk tier as users run it: a master and a store server with a small memory and a disk
(a real file; a loop-mounted file system for disk faults) in their own processes, clients in
this process. Objects the memory evicts move to the disk and are read back from there, survive
SIGKILLs of the server and restarts of the master, and a corrupt or failing disk never serves
a wrong byte. Every read is checked byte for byte."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect._config import cluster_token
from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster, Process, free_port
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.testing.peer import pattern
from tests.support.ha import leader_of, leader_stats
from tests.support.loopfs import fill, loop_fs
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
MiB = 1 << 20
OBJECT = MiB
MEMORY = 8 * MiB
DISK = 48 * MiB
COUNT = 24  # three times the memory: most objects end up on the disk only
FAST = ["--master-heartbeat-ttl", "3", "--master-lease-ttl", "2"]


def _server_args(disk: Path, *extra: str) -> list[str]:
    return [
        "--store-server-id",
        "disk-e2e",
        "--store-size",
        str(MEMORY),
        "--store-disk",
        str(disk),
        "--store-disk-size",
        str(DISK),
        "--store-heartbeat-interval",
        "0.2",
        *extra,
    ]


@contextlib.contextmanager
def _store(disk: Path, *extra: str) -> Iterator[tuple[Cluster, Process]]:
    cluster = Cluster(servers=0, master_args=FAST)
    try:
        yield cluster, cluster.add_server(*_server_args(disk, *extra))
    finally:
        cluster.close()


@contextlib.contextmanager
def _client(cluster: Cluster) -> Iterator[StoreClient]:
    config = {"master": cluster.master_endpoint, "negative_ttl": 0.0}
    client = StoreClient(StoreClientConfig.from_mapping(config))
    client.start()
    try:
        yield client
    finally:
        client.close()


def _value(n: int) -> bytes:
    return pattern(1000 + n, OBJECT).tobytes()


def _put_all(client: StoreClient, count: int = COUNT) -> None:
    """Put objects beyond the memory; a put finding it full retries while eviction (and
    demotion) makes room."""
    for n in range(count):
        wait_for(
            lambda n=n: client.put(f"obj-{n}", _value(n)) is Code.OK,
            "a put never found room",
            timeout=30,
        )


def _fill_disk(cluster: Cluster, client: StoreClient) -> None:
    """Put every object and wait until those the memory cannot hold are on the disk."""
    _put_all(client)
    wait_for(
        lambda: _disk_objects(cluster) >= COUNT - MEMORY // OBJECT,
        "evicted objects never reached the disk",
        timeout=30,
    )


def _tier(cluster: Cluster, tier: m.Tier) -> m.TierStats:
    (stats,) = [t for t in cluster.stats().tiers if t.tier is tier]
    return stats


def _disk_objects(cluster: Cluster) -> int:
    return _disk_objects_in(cluster.stats())


def _disk_objects_in(stats: m.StatsReply | None) -> int:
    """Objects on disk (0 while no master answers)."""
    tiers = [] if stats is None else stats.tiers
    return sum(t.objects for t in tiers if t.tier is m.Tier.DISK)


def _keys(stats: m.StatsReply | None) -> int:
    return 0 if stats is None else stats.keys


def _synced(stats: m.StatsReply | None) -> bool:
    """Whether the store servers know every object the master completed (after a master
    restart, objects completed within a heartbeat before it are otherwise lost)."""
    return stats is not None and not any(s.backlog for s in stats.segments)


def _read_back(client: StoreClient, count: int = COUNT) -> dict[int, bool]:
    """Per object: True if read byte for byte, False if missing. A wrong byte fails the test."""
    found = {}
    for n in range(count):
        value = client.get(f"obj-{n}")
        if value is not None:
            assert bytes(value) == _value(n), f"obj-{n} came back with other bytes"
        found[n] = value is not None
    return found


def _disk_location(cluster: Cluster, key: str) -> m.Location:
    """Where the master sends a reader of ``key``, which only the disk holds."""
    rpc = RpcClient(cluster.master_endpoint, 2.0, token=cluster_token(None, "", False))
    try:
        reply = rpc.call(m.GetReplicas([key]))
    finally:
        rpc.close()
    assert isinstance(reply, m.ReplicasReply), reply
    (location,) = reply.results[0].locations
    return location


def test_evicted_objects_move_to_disk_and_read_back(tmp_path: Path) -> None:
    with _store(tmp_path / "disk.data") as (cluster, _server), _client(cluster) as client:
        _fill_disk(cluster, client)
        found = _read_back(client)
        assert all(found.values()), f"missing: {[n for n, ok in found.items() if not ok]}"
        disk = _tier(cluster, m.Tier.DISK)
        assert disk.demotions >= COUNT - MEMORY // OBJECT
        assert disk.hits >= COUNT - MEMORY // OBJECT  # those reads were served by the disk
        assert disk.lost == 0


def test_adjacent_objects_on_disk_read_back_in_batches_byte_for_byte(tmp_path: Path) -> None:
    """Small objects written in runs lie side by side in memory and, once demoted, on the
    disk; a batch reading them into one contiguous buffer gets each one whole (the disk serves
    one verified object per read, so such reads are never merged across objects)."""
    size, count, run = 64 << 10, 256, 32  # twice the memory
    source = pattern(77, size * count)
    with _store(tmp_path / "disk.data") as (cluster, _server), _client(cluster) as client:
        region = client.register(source.copy())
        for first in range(0, count, run):
            keys = [f"small-{n}" for n in range(first, first + run)]
            offsets = [n * size for n in range(first, first + run)]
            wait_for(
                lambda keys=keys, offsets=offsets: (
                    client.batch_put_from(keys, region, offsets, [size] * run).leading() == run
                ),
                "a run never found room",
                timeout=30,
            )
        wait_for(lambda: _disk_objects(cluster) >= count // 2, "no objects reached the disk")
        target = client.register(bytearray(size * count))
        keys = [f"small-{n}" for n in range(count)]
        got = client.batch_get_into(keys, target, [n * size for n in range(count)], [size] * count)
        missing = [n for n, code in enumerate(got.codes) if code is not Code.OK]
        assert missing == [], f"not read: {missing[:10]}"
        assert bytes(target.view) == source.tobytes()
        assert _tier(cluster, m.Tier.DISK).hits > 0


def test_disk_objects_survive_a_killed_store_server(tmp_path: Path) -> None:
    with _store(tmp_path / "disk.data") as (cluster, server), _client(cluster) as client:
        _fill_disk(cluster, client)
        on_disk = _disk_objects(cluster)
        server.kill()  # SIGKILL: memory is gone, the disk and its index stay
        server.start()
        wait_for(
            lambda: _disk_objects(cluster) >= on_disk,
            "the restarted server did not report its disk objects",
            timeout=30,
        )
        found = _read_back(client)
        assert sum(found.values()) >= on_disk
        segments = [(s.name, s.tier) for s in cluster.stats().segments]
        assert segments == [("disk-e2e", m.Tier.DRAM), ("disk-e2e/disk0", m.Tier.DISK)], (
            "the restarted server's mounts replace its predecessor's"
        )


def test_a_restarted_master_finds_memory_and_disk_objects(tmp_path: Path) -> None:
    with _store(tmp_path / "disk.data") as (cluster, _server), _client(cluster) as client:
        _fill_disk(cluster, client)
        wait_for(lambda: _synced(cluster.stats()), "the journal was never acknowledged", 10)
        cluster.master.kill()
        cluster.restart_master()  # no HA: the new master knows nothing until servers report
        wait_for(
            lambda: cluster.stats().keys == COUNT,
            "the store server did not report its objects to the new master",
            timeout=30,
        )
        found = _read_back(client)
        assert all(found.values()), f"missing: {[n for n, ok in found.items() if not ok]}"


def test_a_kill_during_demotions_serves_only_whole_objects(tmp_path: Path) -> None:
    with _store(tmp_path / "disk.data") as (cluster, server), _client(cluster) as client:
        _put_all(client)
        # Killed while the last demotions may still be queued or half written.
        seen = _disk_objects(cluster)
        server.kill()
        server.start()
        wait_for(
            lambda: _disk_objects(cluster) >= seen,
            "the restarted server did not report its disk objects",
            timeout=30,
        )
        found = _read_back(client)  # every object read is whole: a torn one is never served
        assert sum(found.values()) >= seen


def test_a_corrupt_object_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    data = tmp_path / "disk.data"
    with _store(data) as (cluster, _server), _client(cluster) as client:
        _fill_disk(cluster, client)
        location = _disk_location(cluster, "obj-0")  # the oldest: on disk by now
        with data.open("r+b") as file:
            file.seek(location.offset + 12345)
            byte = file.read(1)
            file.seek(location.offset + 12345)
            file.write(bytes([byte[0] ^ 0xFF]))
        assert client.get("obj-0") is None
        wait_for(
            lambda: _tier(cluster, m.Tier.DISK).lost >= 1,
            "the corrupt object was not reported lost",
            timeout=10,
        )
        wait_for(
            lambda: not client.exists("obj-0"), "the corrupt object is still indexed", timeout=10
        )
        found = _read_back(client)
        assert sum(found.values()) == COUNT - 1


@pytest.mark.skipif(not etcd_available(), reason="etcd is not installed")
def test_disk_objects_survive_a_failover(tmp_path: Path) -> None:
    with EtcdServer() as etcd:
        masters = [
            Process(
                ["master", "--ha", etcd.url, "--master-listen", f"tcp://127.0.0.1:{free_port()}"],
                "listening on",
            )
            for _ in range(2)
        ]
        args = _server_args(tmp_path / "disk.data")
        server = Process(["store", "--store-master", etcd.url, *args], "kvconnect store server")
        try:
            config = {"master": etcd.url, "negative_ttl": 0.0, "rpc_timeout": 0.5}
            client = StoreClient(StoreClientConfig.from_mapping(config))
            client.start()
            try:
                _put_all(client)
                leader = leader_of(etcd.url)
                assert leader is not None
                wait_for(
                    lambda: _synced(leader_stats(etcd.url)),
                    "the journal was never acknowledged",
                    10,
                )
                wait_for(
                    lambda: _disk_objects_in(leader_stats(etcd.url)) >= COUNT - MEMORY // OBJECT,
                    "evicted objects never reached the disk",
                    timeout=30,
                )
                next(p for p in masters if leader in p.args).kill()
                wait_for(
                    lambda: leader_of(etcd.url) not in (None, leader), "no new leader", timeout=15
                )
                wait_for(
                    lambda: _keys(leader_stats(etcd.url)) == COUNT,
                    "the store server did not report its objects to the new leader",
                    timeout=30,
                )  # memory and disk reported
                found = _read_back(client)
                assert all(found.values()), f"missing: {[n for n, ok in found.items() if not ok]}"
            finally:
                client.close()
        finally:
            for process in (server, *masters):
                process.stop()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 24 MiB ext4 file system on a loop device: (its mount point, its image file)."""
    with loop_fs(tmp_path, "24M") as mounted:
        yield mounted


def _small_store(data: Path, memory: int, disk: int) -> tuple[Cluster, Process]:
    args = _server_args(data)
    args[args.index("--store-size") + 1] = str(memory)
    args[args.index("--store-disk-size") + 1] = str(disk)
    cluster = Cluster(servers=0, master_args=FAST)
    try:
        return cluster, cluster.add_server(*args)
    except BaseException:
        cluster.close()
        raise


def _disk_mounted(cluster: Cluster) -> bool:
    return any(s.tier is m.Tier.DISK for s in cluster.stats().segments)


def _assert_taken_out(cluster: Cluster, server: Process, data: Path) -> None:
    """The disk left service with one error line naming it; the memory tier still stores and
    serves."""
    wait_for(lambda: not _disk_mounted(cluster), "the failing disk stayed mounted", timeout=30)
    log = server.stderr()
    down = [line for line in log.splitlines() if f"{data} is down" in line]
    assert len(down) == 1, log[-3000:]
    with _client(cluster) as client:
        # BUSY while the memory of the moves the disk took with it comes back
        wait_for(lambda: client.put("after", b"y" * 4096) is Code.OK, "no put after", 10)
        assert client.get("after") == b"y" * 4096


def test_a_full_disk_is_taken_out_and_memory_keeps_serving(
    small_fs: tuple[Path, Path],
) -> None:
    mount, _image = small_fs
    data = mount / "disk.data"
    cluster, server = _small_store(data, memory=MiB, disk=8 * MiB)
    try:
        # Take what the preallocated data file left: the index soon cannot grow.
        fill(mount)
        small = 4096
        with _client(cluster) as client:
            for n in range(3000):
                value = pattern(n, small).tobytes()
                if client.put(_long_key(n), value) is not Code.OK:
                    continue
                if not _disk_mounted(cluster):
                    break
            _assert_taken_out(cluster, server, data)
            for n in range(0, 3000, 7):  # whatever is still found is whole
                value = client.get(_long_key(n))
                assert value is None or bytes(value) == pattern(n, small).tobytes()
    finally:
        cluster.close()


def test_a_failing_disk_serves_no_wrong_byte(small_fs: tuple[Path, Path]) -> None:
    mount, image = small_fs
    data = mount / "disk.data"
    cluster, server = _small_store(data, memory=MEMORY, disk=16 * MiB)
    try:
        with _client(cluster) as client:
            _put_all(client, 16)
            wait_for(
                lambda: _disk_objects(cluster) >= 16 - MEMORY // OBJECT,
                "evicted objects never reached the disk",
                timeout=30,
            )
            image.write_bytes(b"")  # the device under the file system is gone: reads fail
            found = _read_back(client, 16)  # no wrong byte (asserted inside)
            assert not all(found.values())
            _assert_taken_out(cluster, server, data)
    finally:
        cluster.close()


def _long_key(n: int) -> str:
    """A key of ~900 bytes: its index records fill the file system fast."""
    return f"{'k' * 900}-{n}"
