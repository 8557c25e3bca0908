"""Engine API and lifecycle: registration, descriptors, metadata backends, invalid requests."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvconnect.errors import (
    AccessDenied,
    ClosedError,
    ConfigError,
    InvalidRequest,
    PeerUnreachable,
    RegistrationError,
    SegmentNotFound,
)
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    EmbeddedMetadata,
    SegmentRegistry,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.transfer.protocol import wire
from tests.support.leaks import kvconnect_threads, wait_no_kvconnect_threads
from tests.support.slices import done_in_submit

MiB = 1 << 20


def test_lifecycle_is_idempotent_and_close_joins_threads() -> None:
    before = set(kvconnect_threads())
    engine = TransferEngine()
    assert set(kvconnect_threads()) == before, "constructors must not start threads"
    engine.start()
    engine.start()
    region = engine.allocate(MiB)
    engine.read(region, 0, engine.name, region.id, 0, 10)  # spins up copy workers too
    engine.close()
    engine.close()
    assert set(wait_no_kvconnect_threads()) <= before
    with pytest.raises(ClosedError):
        engine.start()
    with pytest.raises(ClosedError):
        engine.submit(TransferOp.READ, [])
    with pytest.raises(ClosedError):
        engine.register(bytearray(10))


def test_submit_before_start_is_refused() -> None:
    engine = TransferEngine()
    with pytest.raises(ClosedError, match="not started"):
        engine.submit(TransferOp.READ, [])


def test_descriptor_lists_endpoints_and_regions(engine: TransferEngine) -> None:
    shared = engine.allocate(4096)
    private = engine.register(bytes(100))
    descriptor = engine.segment
    assert descriptor.name == engine.name == descriptor.endpoints["tcp"]
    assert descriptor.endpoints["shm"].startswith("@kvconnect-")
    assert [(r.id, r.length, r.shareable, r.writable) for r in descriptor.regions] == [
        (shared.id, 4096, True, True),
        (private.id, 100, False, False),
    ]
    engine.unregister(private)
    assert [r.id for r in engine.segment.regions] == [shared.id]


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_a_private_region_is_local_only(transport: str) -> None:
    config = TransferConfig(transport=transport, metadata="embedded")
    with TransferEngine(config) as owner, TransferEngine(config) as engine:
        served = owner.register(bytearray(pattern(3, 8192).tobytes()))
        hidden = owner.register(bytearray(8192), private=True)
        local = engine.register(bytearray(8192), private=True)
        assert [r.id for r in owner.segment.regions] == [served.id]
        assert [r.id for r in engine.segment.regions] == []
        engine.read(local, 0, owner.name, served.id, 0, 8192)  # the local side of a READ
        assert local.view == pattern(3, 8192).data
        for op in (TransferOp.READ, TransferOp.WRITE):
            batch = engine.submit(op, [TransferRequest(local, 0, owner.name, hidden.id, 0, 64)])
            assert batch.wait(timeout=10) == (TransferStatus.FAILED,)
            assert isinstance(batch.errors[0], AccessDenied)
        assert hidden.view == bytes(8192)
        engine.unregister(local)


class _Zeros:
    def read_into(self, offset: int, view: memoryview) -> None:
        view[:] = bytes(len(view))


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_an_alias_moves_bytes_of_another_engines_region(transport: str) -> None:
    """Federation's engines (one per cluster token) read into the home engine's buffers."""
    config = TransferConfig(transport=transport, metadata="embedded")
    with (
        TransferEngine(config) as owner,
        TransferEngine(config) as home,
        TransferEngine(config) as other,
    ):
        served = owner.register(bytearray(pattern(8, 8192).tobytes()))
        buffer = bytearray(8192)
        mine = home.register(buffer, private=True)
        alias = other.register_alias(mine)
        assert alias.private
        assert (alias.length, alias.address) == (8192, mine.address)
        other.read(alias, 0, owner.name, served.id, 0, 8192)
        assert buffer == pattern(8, 8192).tobytes()
        other.unregister(alias)
        assert home.owns(mine)  # the home engine's region is untouched
        home.unregister(mine)
        with pytest.raises(RegistrationError, match="file source"):
            other.register_alias(owner.register_source(_Zeros(), 64))


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_a_small_copy_in_memory_is_done_when_submit_returns(transport: str) -> None:
    """Same process or same host, a few KiB of host memory are copied by the submitting thread
    (no worker hand-off); a FILE region's source may wait on a disk, so it still goes to a
    worker, as does anything larger."""
    config = TransferConfig(transport=transport, metadata="embedded")
    with TransferEngine(config) as owner, TransferEngine(config) as engine:
        served = owner.allocate(1 << 20)
        served.view[:] = pattern(5, 1 << 20).data
        local = engine.register(bytearray(1 << 20), private=True)
        engine.read(local, 0, owner.name, served.id, 0, 1 << 20)  # first contact, mapping
        reading = TransferRequest(local, 0, owner.name, served.id, 4096, 4096)
        read = done_in_submit(lambda: engine.submit(TransferOp.READ, [reading]))
        assert read.statuses == (TransferStatus.COMPLETED,)
        assert local.view[:4096] == pattern(5, 1 << 20).data[4096:8192]
        local.view[:4096] = pattern(6, 4096).data
        writing = TransferRequest(local, 0, owner.name, served.id, 65536, 4096)
        write = done_in_submit(lambda: engine.submit(TransferOp.WRITE, [writing]))
        assert write.statuses == (TransferStatus.COMPLETED,)
        assert served.view[65536 : 65536 + 4096] == pattern(6, 4096).data


def test_listener_binds_only_the_configured_interface(engine: TransferEngine) -> None:
    other = _primary_address()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    port = int(engine.name.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError), socket.create_connection((other, port), timeout=1):
        pass


def _primary_address() -> str | None:
    """The address this host would use towards the outside (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        address: str = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_invalid_requests_raise_and_hold_nothing(engine: TransferEngine) -> None:
    local = engine.register(np.zeros(100, dtype=np.uint8))
    readonly = engine.register(bytes(100))
    stranger = TransferEngine()
    foreign = stranger.register(bytearray(100))  # registered with another engine
    cases = [
        (TransferRequest(local, 0, engine.name, local.id, 0, 0), "length must be > 0"),
        (TransferRequest(local, 90, engine.name, local.id, 0, 20), "outside region"),
        (TransferRequest(local, -1, engine.name, local.id, 0, 2), "outside region"),
        (TransferRequest(local, 0, engine.name, local.id, -5, 2), "remote_offset"),
        (TransferRequest(readonly, 0, engine.name, local.id, 0, 2), "read-only"),
        (TransferRequest(foreign, 0, engine.name, local.id, 0, 2), "not registered"),
    ]
    good = TransferRequest(local, 0, engine.name, local.id, 50, 10)
    for bad, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            engine.submit(TransferOp.READ, [good, bad])
    with pytest.raises(InvalidRequest, match="TransferOp"):
        engine.submit("read", [good])  # type: ignore[arg-type]
    engine.unregister(local)  # nothing was left holding it


def test_remote_refusals_known_from_the_descriptor_fail_fast(engine: TransferEngine) -> None:
    target = engine.allocate(100)
    readonly = engine.register(bytes(100))
    local = engine.register(bytearray(200))
    batch = engine.submit(
        TransferOp.WRITE,
        [
            TransferRequest(local, 0, engine.name, target.id, 50, 100),
            TransferRequest(local, 0, engine.name, readonly.id, 0, 10),
            TransferRequest(local, 0, engine.name, 999, 0, 10),
            TransferRequest(local, 0, engine.name, target.id, 0, 100),
        ],
    )
    assert batch.wait(5) == (
        TransferStatus.FAILED,
        TransferStatus.FAILED,
        TransferStatus.FAILED,
        TransferStatus.COMPLETED,
    )
    assert all(isinstance(e, AccessDenied) for e in batch.errors[:3])


def test_unreachable_segment_fails_each_request(engine: TransferEngine) -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    dead = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    local = engine.register(bytearray(10))
    batch = engine.submit(TransferOp.READ, [TransferRequest(local, 0, dead, 1, 0, 10)] * 3)
    assert batch.wait(10) == (TransferStatus.FAILED,) * 3
    assert all(isinstance(e, PeerUnreachable) for e in batch.errors)


def test_regions_registered_after_first_contact_are_found() -> None:
    with PeerProcess(shared=MiB, seed=1) as peer, TransferEngine() as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, 10)  # caches the descriptor
        other = TransferEngine()
        other.start()
        try:
            late = other.allocate(MiB)
            late.view[:] = pattern(3, MiB).data
            engine.read(local, 0, other.name, late.id, 0, MiB)
            fresh = other.allocate(MiB)  # registered after `engine` cached `other`
            fresh.view[:] = pattern(4, MiB).data
            engine.read(local, 0, other.name, fresh.id, 0, MiB)
            assert local.view == pattern(4, MiB).data
        finally:
            other.close()


def test_embedded_metadata_names_and_lookups() -> None:
    registry = SegmentRegistry()
    config = TransferConfig(metadata="embedded", transport="tcp")
    with (
        TransferEngine(config.replace(name="store-0"), metadata=EmbeddedMetadata(registry)) as a,
        TransferEngine(config.replace(name="client"), metadata=EmbeddedMetadata(registry)) as b,
    ):
        remote = a.allocate(MiB)
        remote.view[:] = pattern(6, MiB).data
        local = b.register(np.zeros(MiB, dtype=np.uint8))
        b.read(local, 0, "store-0", remote.id, 0, MiB)
        assert local.view == remote.view
        assert registry.get("store-0").engine_id == a.segment.engine_id
        clash = TransferEngine(config.replace(name="store-0"), metadata=EmbeddedMetadata(registry))
        with pytest.raises(ConfigError, match="already used"):
            clash.start()
        batch = b.submit(TransferOp.READ, [TransferRequest(local, 0, "nobody", 1, 0, 1)])
        assert batch.wait(5) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], SegmentNotFound)
    with pytest.raises(SegmentNotFound):
        registry.get("store-0")  # withdrawn on close


def test_p2p_segment_names_are_addresses() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        TransferEngine(TransferConfig(name="custom"))


def test_stats_count_bytes_per_transport(engine: TransferEngine) -> None:
    remote = engine.allocate(MiB)
    local = engine.register(bytearray(MiB))
    engine.write(local, 0, engine.name, remote.id, 0, MiB)
    engine.read(local, 0, engine.name, remote.id, 0, 1000)
    stats = engine.stats().transports["local"]
    assert (stats.bytes_written, stats.bytes_read, stats.errors) == (MiB, 1000, 0)


def test_listener_answers_control_calls_over_tcp_but_refuses_fds(engine: TransferEngine) -> None:
    region = engine.allocate(4096)
    sock, engine_id = wire.open_connection(engine.name, engine.config.token, 5)
    with sock:
        assert engine_id.hex() == engine.segment.engine_id
        reply, fds = wire.control_call(sock, wire.GetSegment(), wire.deadline_after(5))
        assert isinstance(reply, wire.SegmentReply)
        reply, fds = wire.control_call(sock, wire.GetRegionFd(region.id), wire.deadline_after(5))
        assert isinstance(reply, wire.ErrorReply)
        assert fds == []


def test_close_without_start_releases_shared_memory() -> None:
    engine = TransferEngine()
    region = engine.allocate(MiB)
    fd = region.shared_fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvconnect-region")
    engine.close()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or not os.readlink(
        f"/proc/self/fd/{fd}"
    ).startswith("/memfd:kvconnect-region")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fence_refuses_the_old_region_id_and_keeps_the_bytes(transport: str) -> None:
    config = {"transport": transport}
    with (
        PeerProcess(config=config, shared=MiB, seed=5) as owner,
        TransferEngine(TransferConfig(transport=transport)) as engine,
    ):
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        old = owner.regions["shared"]
        engine.read(local, 0, owner.name, old, 0, MiB)  # connected / mapped under the old id
        new = owner.fence("shared")
        assert new != old
        for op in (TransferOp.READ, TransferOp.WRITE):
            request = TransferRequest(local, 0, owner.name, old, 0, 4096)
            batch = engine.submit(op, [request], timeout=5)
            assert batch.wait(timeout=10) == (TransferStatus.FAILED,)
            assert isinstance(batch.errors[0], AccessDenied), batch.errors
        assert owner.sha256("shared", 0, MiB) == hashlib.sha256(pattern(5, MiB)).hexdigest()
        local.view[:] = b"\0" * MiB
        engine.read(local, 0, owner.name, new, 0, MiB)
        assert local.view == pattern(5, MiB).data
        local.view[:4096] = b"\x07" * 4096
        engine.write(local, 0, owner.name, new, 100, 4096)
        expected = bytearray(pattern(5, MiB).tobytes())
        expected[100:4196] = b"\x07" * 4096
        assert owner.sha256("shared", 0, MiB) == hashlib.sha256(expected).hexdigest()


def test_fence_in_process_waits_for_nothing_and_refuses_twice() -> None:
    with TransferEngine() as owner, TransferEngine() as reader:
        region = owner.allocate(MiB)
        region.view[:] = pattern(6, MiB).data
        local = reader.register(np.zeros(MiB, dtype=np.uint8))
        reader.read(local, 0, owner.name, region.id, 0, MiB)  # the local (memcpy) transport
        fresh = owner.fence(region)
        assert owner.users(region) == 0
        assert not owner.owns(region)
        assert owner.owns(fresh)
        assert [r.id for r in owner.segment.regions] == [fresh.id]
        request = TransferRequest(local, 0, owner.name, region.id, 0, 10)
        batch = reader.submit(TransferOp.READ, [request], timeout=5)
        assert batch.wait(timeout=10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied)
        del batch
        with pytest.raises(RegistrationError):
            owner.fence(region)
        reader.read(local, 0, owner.name, fresh.id, 0, MiB)
        assert local.view == pattern(6, MiB).data


class _HeldStart:
    """Hold every engine's start() in the middle (after the listener, before routing and
    the resolver exist) until released; ``fail`` makes the held start raise."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        original = TransferEngine._build_transports

        def held(engine: TransferEngine, *args: Any) -> None:
            self.entered.set()
            assert self.release.wait(30)
            if fail:
                raise OSError("the test failed this start")
            original(engine, *args)

        monkeypatch.setattr(TransferEngine, "_build_transports", held)


def test_calls_racing_start_wait_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with TransferEngine() as owner, ThreadPoolExecutor(4) as pool:
        remote = owner.allocate(MiB)
        remote.view[:] = pattern(3, MiB).data
        held = _HeldStart(monkeypatch)
        engine = TransferEngine()
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        request = TransferRequest(local, 0, owner.name, remote.id, 0, MiB)
        starting = pool.submit(engine.start)
        assert held.entered.wait(30)
        second_start = pool.submit(engine.start)
        submitted = pool.submit(lambda: engine.submit(TransferOp.READ, [request]))
        registered = pool.submit(lambda: engine.register(bytearray(4096)))
        region = registered.result(timeout=30)  # registering never needs the engine started
        assert not submitted.done()
        assert not second_start.done()
        held.release.set()
        try:
            batch = submitted.result(timeout=30)
            assert isinstance(batch, TransferBatch)
            assert batch.wait() == (TransferStatus.COMPLETED,), batch.errors
            assert local.view == remote.view
            starting.result(timeout=30)
            second_start.result(timeout=30)
            assert isinstance(region, MemoryRegion)
            assert region.id in [r.id for r in engine.segment.regions]
        finally:
            engine.close()


def test_a_start_that_fails_closes_the_engine_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = set(kvconnect_threads())
    held = _HeldStart(monkeypatch, fail=True)
    engine = TransferEngine()
    local = engine.register(np.zeros(16, dtype=np.uint8))
    request = TransferRequest(local, 0, "127.0.0.1:1", 1, 0, 16)
    with ThreadPoolExecutor(2) as pool:
        starting = pool.submit(engine.start)
        assert held.entered.wait(30)
        submitted = pool.submit(lambda: engine.submit(TransferOp.READ, [request]))
        held.release.set()
        with pytest.raises(OSError, match="the test failed this start"):
            starting.result(timeout=30)
        with pytest.raises(ClosedError, match="start failed: OSError: the test failed"):
            submitted.result(timeout=30)
    with pytest.raises(ClosedError, match="start failed"):
        engine.start()
    with pytest.raises(ClosedError, match="start failed"):
        engine.register(bytearray(16))
    engine.close()  # idempotent after a failed start
    assert set(wait_no_kvconnect_threads()) <= before
    with pytest.raises(RegistrationError):
        engine.unregister(local)  # the failed start released the memory registered before


def test_a_submit_during_a_start_that_takes_too_long_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = _HeldStart(monkeypatch)
    engine = TransferEngine(TransferConfig(connect_timeout=0.2))
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(engine.start)
        assert held.entered.wait(30)
        try:
            with pytest.raises(ClosedError, match="still starting"):
                engine.submit(TransferOp.READ, [])
        finally:
            held.release.set()
            starting.result(timeout=30)
            engine.close()
