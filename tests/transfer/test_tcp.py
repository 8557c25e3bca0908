"""TcpTransport on its own: slices to a real listener (an engine in this process) over a real
socket, without the engine's routing in between."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvconnect.errors import AccessDenied, PeerUnreachable
from kvconnect.testing.peer import pattern
from kvconnect.transfer import (
    MemoryRegion,
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferStatus,
)
from kvconnect.transfer.datapath.iov import select_datapath
from kvconnect.transfer.datapath.staging import StagingPool
from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.transports.tcp import TcpTransport
from tests.support.slices import MiB, submit_request


def no_staging() -> StagingPool:
    raise AssertionError("host memory is sent without staging")


@pytest.fixture
def target() -> Iterator[tuple[TransferEngine, MemoryRegion]]:
    with TransferEngine() as engine:
        remote = engine.register(np.zeros(MiB, dtype=np.uint8))
        remote.view[:] = pattern(5, MiB).data
        yield engine, remote


@pytest.fixture
def local() -> Iterator[MemoryRegion]:
    registry = MemoryRegistry()
    try:
        yield registry.register(np.zeros(MiB, dtype=np.uint8))
    finally:
        registry.close()


def _transport(engine: TransferEngine, lost: list[SegmentDescriptor]) -> TcpTransport:
    return TcpTransport(engine.config, select_datapath("auto"), no_staging, lost.append)


def test_read_and_write_are_byte_exact_and_counted(
    target: tuple[TransferEngine, MemoryRegion], local: MemoryRegion
) -> None:
    engine, remote = target
    transport = _transport(engine, [])
    try:
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert local.view == pattern(5, MiB).data
        local.view[:] = pattern(6, MiB).data
        batch = submit_request(transport, engine.segment, TransferOp.WRITE, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert remote.view == pattern(6, MiB).data
        stats = transport.stats()
        assert (stats.bytes_read, stats.bytes_written, stats.errors) == (MiB, MiB, 0)
        assert stats.peers == 1
    finally:
        transport.close()
    assert transport.stats().peers == 0


def test_a_refused_region_fails_with_access_denied_and_the_channel_stays(
    target: tuple[TransferEngine, MemoryRegion], local: MemoryRegion
) -> None:
    engine, remote = target
    transport = _transport(engine, [])
    try:
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id + 100)
        assert batch.wait(10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied)
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert local.view == pattern(5, MiB).data
    finally:
        transport.close()


def test_forget_drops_the_channel_and_a_later_submit_opens_a_new_one(
    target: tuple[TransferEngine, MemoryRegion], local: MemoryRegion
) -> None:
    engine, remote = target
    transport = _transport(engine, [])
    try:
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert transport.stats().peers == 1
        transport.forget(engine.segment.engine_id)
        assert transport.stats().peers == 0
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert transport.stats().peers == 1
    finally:
        transport.close()


def test_a_closed_peer_is_unreachable_and_reported_lost(local: MemoryRegion) -> None:
    with TransferEngine() as engine:
        remote = engine.register(np.zeros(MiB, dtype=np.uint8))
        peer = engine.segment
        config = engine.config
    lost: list[SegmentDescriptor] = []
    transport = TcpTransport(config, select_datapath("auto"), no_staging, lost.append)
    try:
        batch = submit_request(transport, peer, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], PeerUnreachable)
        assert lost == [peer]
        assert transport.stats().peers == 0
    finally:
        transport.close()


def test_close_ends_a_handshake_with_a_peer_that_accepted_but_never_answers(
    local: MemoryRegion,
) -> None:
    # A stopped process: the kernel accepts the connection, nobody answers the handshake.
    # close() must end it at once, not after connect_timeout, and leave no sender thread.
    with TransferEngine() as engine, socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        peer = msgspec.structs.replace(engine.segment, endpoints={"tcp": f"127.0.0.1:{port}"})
        config = engine.config.replace(connect_timeout=600.0)
        transport = TcpTransport(config, select_datapath("auto"), no_staging, [].append)
        try:
            batch = submit_request(transport, peer, TransferOp.READ, local, 1)
            accepted, _ = silent.accept()  # the sender thread is now in its handshake
        finally:
            transport.close()
        accepted.close()
        senders = [t for t in threading.enumerate() if t.name.startswith("kvconnect-tcp-send")]
        assert senders == []
        assert batch.wait(10) != (TransferStatus.COMPLETED,)


def test_small_requests_from_many_threads_are_byte_exact() -> None:
    """Submitting threads send small frames themselves on idle connections, racing the sender
    threads for the same sockets: every byte still lands where it belongs."""
    threads, rounds, size = 8, 60, 4096
    config = TransferConfig(transport="tcp")
    with TransferEngine(config) as owner, TransferEngine(config) as engine:
        remote = owner.register(np.zeros(MiB, dtype=np.uint8))
        remote.view[:] = pattern(7, MiB).data
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        errors: list[str] = []

        def work(t: int) -> None:
            base = t * (MiB // threads)
            for i in range(rounds):
                at = base + (i % 16) * size
                fresh = pattern(100 * t + i, size).data
                local.view[at : at + size] = fresh
                engine.write(local, at, owner.name, remote.id, at, size)
                local.view[at : at + size] = bytes(size)
                engine.read(local, at, owner.name, remote.id, at, size)
                if local.view[at : at + size] != fresh or remote.view[at : at + size] != fresh:
                    errors.append(f"thread {t} round {i}")

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert errors == []
        stats = engine.stats().transports["tcp"]
        assert (stats.ops, stats.errors) == (2 * threads * rounds, 0)
        assert stats.bytes_read == stats.bytes_written == threads * rounds * size
