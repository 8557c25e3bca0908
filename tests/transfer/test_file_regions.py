"""FILE regions: bytes of a real file published with ``register_source`` and read by peers over
TCP (another process, and this one) and the local transport; failing sources, refused writes."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvconnect.errors import (
    InvalidRequest,
    RegionBusy,
    RegistrationError,
    SourceUnavailable,
    TransferError,
)
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import MemoryKind, TransferConfig, TransferEngine, TransferRequest
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.protocol.wire import FrameKind, Status
from kvconnect.transfer.types import TransferOp, TransferStatus
from tests.support.fakes import FakeCudaArray, HostCopier

KiB = 1 << 10
SIZE = 3 * (1 << 20) + 123  # not a multiple of any slice size
SEED = 61
SLICE = 64 * KiB  # small slices: a source sees many arbitrary sub-ranges


class PreadSource:
    """A FileSource over a real file: pread, refusing the byte range ``[bad, bad_end)``."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.bad = self.bad_end = 0
        self.reads: list[tuple[int, int]] = []

    def read_into(self, offset: int, view: memoryview) -> None:
        self.reads.append((offset, view.nbytes))
        if offset < self.bad_end and self.bad < offset + view.nbytes:
            raise SourceUnavailable(f"checksum mismatch at {offset}")
        got = os.preadv(self.fd, [view], offset)
        if got != view.nbytes:
            raise SourceUnavailable(f"short read at {offset}: {got} of {view.nbytes}")

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def source(tmp_path: Path) -> Iterator[PreadSource]:
    path = tmp_path / "tier.data"
    path.write_bytes(pattern(SEED, SIZE).tobytes())
    src = PreadSource(path)
    try:
        yield src
    finally:
        src.close()


def _bytes(start: int, length: int) -> bytes:
    return pattern(SEED, SIZE)[start : start + length].tobytes()


def _sha(start: int, length: int) -> str:
    return hashlib.sha256(_bytes(start, length)).hexdigest()


def test_a_file_region_is_published_read_only_and_fences_like_memory(
    source: PreadSource,
) -> None:
    with TransferEngine(TransferConfig()) as engine:
        region = engine.register_source(source, SIZE)
        assert (region.kind, region.writable, region.shareable) == (MemoryKind.FILE, False, False)
        assert region.source is source
        with pytest.raises(InvalidRequest):
            region.view  # noqa: B018 - the property raises
        info = engine.segment.region(region.id)
        assert info is not None
        assert (info.kind, info.length, info.writable, info.shareable) == (
            "file",
            SIZE,
            False,
            False,
        )
        fresh = engine.fence(region)
        assert fresh.source is source
        assert fresh.kind is MemoryKind.FILE
        assert engine.segment.region(region.id) is None
        assert engine.users(fresh) == 0
        engine.unregister(fresh)
        assert not engine.owns(fresh)
        with pytest.raises(RegistrationError):
            engine.register_source(source, 0)


def test_a_file_region_is_never_the_local_end_of_a_request(source: PreadSource) -> None:
    with TransferEngine(TransferConfig()) as engine:
        region = engine.register_source(source, SIZE)
        with pytest.raises(InvalidRequest, match="FILE region"):
            engine.submit(TransferOp.WRITE, [TransferRequest(region, 0, engine.name, 1, 0, 10)])


@pytest.mark.integration
def test_another_process_reads_a_file_region_over_tcp_byte_for_byte(
    source: PreadSource,
) -> None:
    config = {"slice_bytes": SLICE, "tcp_streams": 1}
    with (
        TransferEngine(TransferConfig()) as engine,
        PeerProcess(config=config, private=SIZE) as peer,
    ):
        region = engine.register_source(source, SIZE)
        ranges = [(0, 0, SIZE), (5, 7, 100_001)]  # (local, remote, length)
        assert peer.transfer("read", engine.name, region.id, ranges[:1]) == ["completed"]
        assert peer.sha256("private", 0, SIZE) == _sha(0, SIZE)
        assert peer.transfer("read", engine.name, region.id, ranges[1:]) == ["completed"]
        assert peer.sha256("private", 5, 100_001) == _sha(7, 100_001)
        peer_stats = peer.call({"cmd": "stats"})["transports"]
        served = engine.stats().listener
    assert peer_stats["tcp"]["bytes_read"] == SIZE + 100_001  # auto chose TCP: no shm, no local
    assert served.bytes_served == SIZE + 100_001
    assert max(length for _offset, length in source.reads) <= SLICE
    assert len(source.reads) >= SIZE // SLICE


@pytest.mark.integration
def test_a_failing_source_fails_only_its_requests_and_the_connection_keeps_serving(
    source: PreadSource,
) -> None:
    source.bad, source.bad_end = 200 * KiB, 200 * KiB + 1
    config = {"slice_bytes": SLICE, "tcp_streams": 1}
    with (
        TransferEngine(TransferConfig()) as engine,
        PeerProcess(config=config, private=SIZE) as peer,
    ):
        region = engine.register_source(source, SIZE)
        assert peer.transfer("read", engine.name, region.id, [(0, 0, 10)]) == ["completed"]
        connections = engine.stats().listener.connections  # the lookup's and the stream's
        # Small ranges of one batch share a frame: the bad one must not take the others along.
        batch = [(0, 0, 1000), (KiB, 199 * KiB, 2 * KiB), (4 * KiB, 300 * KiB, 1000)]
        statuses = peer.transfer("read", engine.name, region.id, batch)
        assert statuses == ["completed", "failed", "completed"]
        assert peer.sha256("private", 0, 1000) == _sha(0, 1000)
        assert peer.sha256("private", 4 * KiB, 1000) == _sha(300 * KiB, 1000)
        source.bad = source.bad_end = 0  # repaired: the same connection serves it now
        assert peer.transfer("read", engine.name, region.id, [(0, 0, SIZE)]) == ["completed"]
        assert peer.sha256("private", 0, SIZE) == _sha(0, SIZE)
        writes = peer.transfer("write", engine.name, region.id, [(0, 0, 10)])
        served = engine.stats().listener
    assert writes == ["failed"]
    assert served.unavailable == 2  # the shared frame, then the bad range asked alone
    assert served.connections == connections  # no reconnect: UNAVAILABLE kept the stream
    assert served.protocol_errors == 0


def test_a_source_error_reaches_the_initiator_as_source_unavailable_over_tcp(
    source: PreadSource,
) -> None:
    config = TransferConfig(transport="tcp", slice_bytes=SLICE)
    with TransferEngine(config) as target, TransferEngine(config) as engine:
        region = target.register_source(source, SIZE)
        local = engine.register(np.zeros(SIZE, dtype=np.uint8))
        source.bad, source.bad_end = SLICE, SLICE + 1
        requests = [
            TransferRequest(local, 0, target.name, region.id, 0, 3 * SLICE),
            TransferRequest(local, 3 * SLICE, target.name, region.id, 3 * SLICE, SLICE),
        ]
        batch = engine.submit(TransferOp.READ, requests)
        assert batch.wait() == (TransferStatus.FAILED, TransferStatus.COMPLETED)
        assert isinstance(batch.errors[0], SourceUnavailable)
        assert local.view[3 * SLICE : 4 * SLICE] == pattern(SEED, SIZE).data[3 * SLICE : 4 * SLICE]
        os.close(source.fd)  # an OSError of the source is an UNAVAILABLE answer too
        source.fd = os.open(os.devnull, os.O_WRONLY)  # pread fails with EBADF
        with pytest.raises(TransferError) as failed:
            engine.read(local, 0, target.name, region.id, 0, 10)
        assert isinstance(failed.value.__cause__, SourceUnavailable)
        assert target.stats().listener.protocol_errors == 0


def test_same_process_reads_go_through_the_source_and_writes_are_refused(
    source: PreadSource,
) -> None:
    config = TransferConfig(transport="auto", slice_bytes=SLICE)
    with TransferEngine(config) as target, TransferEngine(config) as engine:
        region = target.register_source(source, SIZE)
        local = engine.register(np.zeros(SIZE, dtype=np.uint8))
        engine.read(local, 0, target.name, region.id, 0, SIZE)
        assert local.view == pattern(SEED, SIZE).data
        assert engine.stats().transports["local"].bytes_read == SIZE
        source.bad, source.bad_end = 10, 11
        with pytest.raises(TransferError) as failed:
            engine.read(local, 0, target.name, region.id, 0, 100)
        assert isinstance(failed.value.__cause__, SourceUnavailable)
        with pytest.raises(TransferError, match="read-only"):
            engine.write(local, 0, target.name, region.id, 0, 100)
        assert target.users(region) == 0


def test_same_process_reads_into_device_memory_through_a_bounce(source: PreadSource) -> None:
    copier = HostCopier()
    config = TransferConfig(transport="local", slice_bytes=SLICE)
    with (
        TransferEngine(config) as target,
        TransferEngine(config, device_copier=copier) as engine,
    ):
        region = target.register_source(source, SIZE)
        device = FakeCudaArray(np.zeros(SIZE, dtype=np.uint8))
        local = engine.register(device)
        engine.read(local, 0, target.name, region.id, 0, SIZE)
        assert device.host.tobytes() == pattern(SEED, SIZE).tobytes()
    assert copier.copies >= SIZE // SLICE


def test_an_unregister_waits_for_reads_that_use_the_source(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)

    class Held(PreadSource):
        def read_into(self, offset: int, view: memoryview) -> None:
            with pytest.raises(RegionBusy):
                target.unregister(region)  # a read is in progress: the region is held
            super().read_into(offset, view)

    held = Held(path)
    try:
        config = TransferConfig(transport="local")
        with TransferEngine(config) as target, TransferEngine(config) as engine:
            region = target.register_source(held, 4096)
            local = engine.register(np.zeros(4096, dtype=np.uint8))
            engine.read(local, 0, target.name, region.id, 0, 4096)
            assert local.view.tobytes() == b"x" * 4096
            target.unregister(region)
    finally:
        held.close()


def _frame(kind: FrameKind, frame_id: int, *entries: tuple[int, int, int]) -> bytes:
    flat = [value for entry in entries for value in entry]
    return wire.HEADER.pack(kind, 0, len(entries), 0, frame_id) + wire.pack_entries(flat)


def _response(sock: socket.socket) -> tuple[int, int]:
    kind, status, _count, _aux, frame_id = wire.HEADER.unpack(
        wire.recv_exact(sock, wire.HEADER.size)
    )
    assert kind == FrameKind.RESPONSE
    return status, frame_id


def test_the_listener_refuses_writes_and_answers_failed_reads_on_a_live_connection(
    source: PreadSource,
) -> None:
    with TransferEngine(TransferConfig()) as engine:
        region = engine.register_source(source, SIZE)
        memory = engine.register(pattern(7, 4096).copy())
        sock, _ = wire.open_connection(engine.segment.endpoints["tcp"], engine.config.token, 5)
        with sock:
            sock.sendall(_frame(FrameKind.WRITE, 1, (region.id, 0, 3000)) + b"w" * 3000)
            assert _response(sock) == (Status.READ_ONLY, 1)  # the payload was discarded
            source.bad, source.bad_end = 100, 101
            sock.sendall(_frame(FrameKind.READ, 2, (memory.id, 0, 10), (region.id, 0, 200)))
            assert _response(sock) == (Status.UNAVAILABLE, 2)  # and no payload follows
            mixed = ((memory.id, 5, 100), (region.id, 1000, 5000), (memory.id, 0, 1))
            sock.sendall(_frame(FrameKind.READ, 3, *mixed))
            assert _response(sock) == (Status.OK, 3)
            want = pattern(7, 4096)[5:105].tobytes() + _bytes(1000, 5000)
            want += pattern(7, 4096)[:1].tobytes()
            assert wire.recv_exact(sock, 5101) == want
        stats = engine.stats().listener
    assert (stats.refused, stats.unavailable, stats.protocol_errors) == (1, 1, 0)
    assert stats.bytes_served == 5101
