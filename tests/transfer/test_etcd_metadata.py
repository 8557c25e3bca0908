"""Segment descriptors in a real etcd: discovery across processes, leases, watches, restarts."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.errors import (
    BrokenError,
    ClosedError,
    ConfigError,
    CoordinationUnavailable,
    SegmentNotFound,
)
from kvconnect.etcd import Etcd
from kvconnect.store.launch import free_port
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.metadata.etcd import PREFIX, EtcdMetadata
from kvconnect.transfer.segment import decode_descriptor
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="etcd is not installed"),
    pytest.mark.skipif(
        importlib.util.find_spec("pyetcd") is None, reason="the etcd extra is not installed"
    ),
]

MiB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def _grpc_settled() -> Iterator[None]:
    """Before the module's leak check: grpc closes its process-wide poller fds on a thread of
    its own shortly after the last channel closed (later on a loaded machine)."""
    before = _poller_fds()
    yield
    deadline = time.monotonic() + 10
    while _poller_fds() - before and time.monotonic() < deadline:
        time.sleep(0.02)


def _poller_fds() -> set[tuple[str, str]]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in ("anon_inode:[eventpoll]", "anon_inode:[eventfd]"):
            found.add((fd, target))
    return found


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """A fresh etcd per test: no descriptor of one test is seen by another."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def checker(etcd: EtcdServer) -> Iterator[Etcd]:
    """The test's own etcd connection, to look at what the engines stored."""
    client = Etcd(etcd.url)
    yield client
    client.close()


def stored(client: Etcd, name: str) -> SegmentDescriptor | None:
    """The descriptor of ``name`` in etcd; None if absent or etcd does not answer yet."""
    try:
        value, _revision = client.get(PREFIX + name)
    except CoordinationUnavailable:
        return None
    return None if value is None else decode_descriptor(value)


def engine_config(etcd: EtcdServer, **extra: Any) -> TransferConfig:
    return TransferConfig(metadata=etcd.url, **extra)


def sha(seed: int, length: int) -> str:
    return hashlib.sha256(pattern(seed, length)).hexdigest()


def test_two_processes_find_each_other_and_move_bytes(etcd: EtcdServer, checker: Etcd) -> None:
    config = {"metadata": etcd.url}
    with (
        PeerProcess(config=config, shared=MiB, private=MiB, seed=3) as target,
        PeerProcess(config=config, private=MiB, seed=10) as initiator,
    ):
        descriptor = stored(checker, target.name)
        assert descriptor is not None
        assert {r.id for r in descriptor.regions} == set(target.regions.values())
        read = initiator.transfer("read", target.name, target.regions["shared"], [(0, 0, MiB)])
        assert read == ["completed"]
        assert initiator.sha256("private", 0, MiB) == sha(3, MiB)
        write = initiator.transfer(
            "write", target.name, target.regions["private"], [(0, 0, MiB // 2)]
        )
        assert write == ["completed"]
        # what the initiator wrote is what it had read
        half = hashlib.sha256(pattern(3, MiB)[: MiB // 2]).hexdigest()
        assert target.sha256("private", 0, MiB // 2) == half
        target.close()  # a clean close withdraws at once, without waiting for the lease
        assert stored(checker, target.name) is None


def test_killed_peer_vanishes_within_its_ttl(etcd: EtcdServer, checker: Etcd) -> None:
    ttl = 1
    with (
        TransferEngine(engine_config(etcd)) as engine,
        PeerProcess(
            config={"metadata": etcd.url, "metadata_ttl": ttl}, shared=MiB, seed=4
        ) as victim,
    ):
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, victim.name, victim.regions["shared"], 0, MiB)
        assert engine._directory.cached(victim.name) is not None
        victim.kill()
        killed = time.monotonic()
        wait_for(lambda: stored(checker, victim.name) is None, "descriptor outlived its lease")
        # etcd expires leases on a 500 ms tick; generous slack for a loaded machine.
        assert time.monotonic() - killed < ttl + 2
        # The watch's delete event dropped the cached descriptor: the name is simply unknown.
        wait_for(lambda: engine._directory.cached(victim.name) is None, "cache not dropped")
        request = TransferRequest(local, 0, victim.name, victim.regions["shared"], 0, MiB)
        batch = engine.submit(TransferOp.READ, [request], timeout=5)
        assert batch.wait(timeout=10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], SegmentNotFound), batch.errors


def test_reregistering_memory_drops_peers_cached_descriptor(etcd: EtcdServer) -> None:
    with (
        TransferEngine(engine_config(etcd)) as owner,
        TransferEngine(engine_config(etcd)) as reader,
    ):
        first = owner.allocate(MiB)
        first.view[:] = pattern(1, MiB).data
        local = reader.register(np.zeros(MiB, dtype=np.uint8))
        reader.read(local, 0, owner.name, first.id, 0, MiB)
        assert reader._directory.cached(owner.name) is not None
        second = owner.register(pattern(2, MiB).copy())
        wait_for(lambda: reader._directory.cached(owner.name) is None, "register not seen")
        reader.read(local, 0, owner.name, second.id, 0, MiB)
        assert local.view == pattern(2, MiB).data
        owner.unregister(second)
        wait_for(lambda: reader._directory.cached(owner.name) is None, "unregister not seen")


def test_etcd_restart_during_use(etcd: EtcdServer, checker: Etcd) -> None:
    ttl = 2  # the keepalives notice a lost lease within ttl / 3
    config = {"metadata": etcd.url, "metadata_ttl": ttl}
    with (
        PeerProcess(config=config, shared=MiB, private=MiB, seed=5) as peer,
        TransferEngine(engine_config(etcd, metadata_ttl=ttl)) as engine,
        TransferEngine(engine_config(etcd)) as watcher,
    ):
        served = engine.allocate(MiB)
        served.view[:] = pattern(6, MiB).data
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        watcher_local = watcher.register(np.zeros(MiB, dtype=np.uint8))
        watcher.read(watcher_local, 0, engine.name, served.id, 0, MiB)

        etcd.kill()
        # Registering while etcd is down neither fails nor hangs; it is published later.
        during = engine.register(pattern(7, MiB).copy())
        etcd.start()

        wait_for(lambda: _has_region(checker, engine.name, during.id), "not republished")
        assert stored(checker, peer.name) is not None
        # The watch resumed: the change reached the other engine's cache.
        wait_for(lambda: watcher._directory.cached(engine.name) is None, "change not seen")
        watcher.read(watcher_local, 0, engine.name, during.id, 0, MiB)
        assert watcher_local.view == pattern(7, MiB).data
        # A change made after the restart is delivered too.
        after = engine.register(pattern(8, MiB).copy())
        wait_for(lambda: watcher._directory.cached(engine.name) is None, "change not seen")
        # The other process looks the engine up now, through the restarted etcd.
        reply = peer.transfer("read", engine.name, after.id, [(0, 0, MiB)])
        assert reply == ["completed"]
        assert peer.sha256("private", 0, MiB) == sha(8, MiB)
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        assert local.view == pattern(5, MiB).data
        # The keepalives still run in both processes: a lost lease is replaced.
        for name in (engine.name, peer.name):
            _revoke_lease_of(etcd, name)
        for name in (engine.name, peer.name):
            wait_for(lambda n=name: stored(checker, n) is not None, f"{name} not restored")


def test_lookup_errors_and_lifecycle(etcd: EtcdServer) -> None:
    metadata = EtcdMetadata(etcd.url, ttl=2)
    with pytest.raises(ClosedError):
        metadata.lookup("nobody", 1.0)
    changed: list[str] = []
    metadata.start(changed.append)
    try:
        with pytest.raises(SegmentNotFound):
            metadata.lookup("nobody", 1.0)
        etcd.kill()
        with pytest.raises(CoordinationUnavailable) as caught:
            metadata.lookup("nobody", 1.0)
        assert isinstance(caught.value, BrokenError)
        metadata.withdraw("nobody")  # nothing published, nothing to do, no error
        etcd.start()
    finally:
        metadata.close()
    metadata.close()  # idempotent
    with pytest.raises(ClosedError):
        metadata.start(changed.append)


def test_engine_reports_unreachable_etcd_per_request(etcd: EtcdServer) -> None:
    with TransferEngine(engine_config(etcd)) as engine:
        local = engine.register(np.zeros(16, dtype=np.uint8))
        etcd.kill()
        try:
            batch = engine.submit(
                TransferOp.READ, [TransferRequest(local, 0, "127.0.0.1:1", 1, 0, 16)], timeout=10
            )
            assert batch.wait(timeout=10) == (TransferStatus.FAILED,)
            assert isinstance(batch.errors[0], CoordinationUnavailable), batch.errors
        finally:
            etcd.start()


def test_a_name_held_by_another_live_engine_is_refused(etcd: EtcdServer, checker: Etcd) -> None:
    with TransferEngine(engine_config(etcd, name="prefill-0")) as first:
        duplicate = TransferEngine(engine_config(etcd, name="prefill-0"))
        with pytest.raises(ConfigError, match="already used by another engine"):
            duplicate.start()
        duplicate.close()
        # The refused engine's cleanup did not remove the first engine's descriptor.
        descriptor = stored(checker, "prefill-0")
        assert descriptor is not None
        assert descriptor.engine_id == first.segment.engine_id


def test_lost_changes_drop_every_name_looked_up(etcd: EtcdServer) -> None:
    """When etcd compacted what the watch missed, every name handed out may be stale."""
    with TransferEngine(engine_config(etcd)) as owner:
        metadata = EtcdMetadata(etcd.url)
        changed: list[str] = []
        metadata.start(changed.append)
        try:
            metadata.lookup(owner.name, 1.0)
            metadata._on_events(None)  # what the watch does after RevisionCompactedError
            assert changed == [owner.name]
        finally:
            metadata.close()


def test_engine_start_fails_cleanly_without_etcd() -> None:
    nobody = f"etcd://127.0.0.1:{free_port()}"
    engine = TransferEngine(TransferConfig(metadata=nobody))
    with pytest.raises(CoordinationUnavailable):
        engine.start()
    engine.close()


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="etcd"):
        EtcdMetadata("http://127.0.0.1:2379")
    with pytest.raises(ConfigError, match="ttl"):
        EtcdMetadata("etcd://127.0.0.1:2379", ttl=0)


# ------------------------------------------------------------------------------- helpers


def _has_region(client: Etcd, name: str, region_id: int) -> bool:
    descriptor = stored(client, name)
    return descriptor is not None and descriptor.region(region_id) is not None


def _revoke_lease_of(server: EtcdServer, name: str) -> None:
    """What etcd losing a lease looks like to its holder (the key vanishes with it)."""
    import pyetcd

    client = pyetcd.client(server.host, server.client_port, timeout=5)
    try:
        _value, meta = client.get(PREFIX + name)
        assert meta is not None, f"{name} is not in etcd"
        assert meta.lease_id, f"{name} has no lease"
        client.revoke_lease(meta.lease_id)
    finally:
        client.close()
