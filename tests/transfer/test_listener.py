"""The Listener on its own, in this process: frames from a raw, handshaken socket."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvconnect.errors import AuthenticationError
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.datapath.iov import select_datapath
from kvconnect.transfer.datapath.staging import StagingPool
from kvconnect.transfer.memory import MemoryRegion, MemoryRegistry
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.protocol.listener import Listener
from kvconnect.transfer.protocol.wire import FrameKind, Status
from kvconnect.transfer.segment import SegmentDescriptor
from tests.support.cpu import thread_cpu

ENGINE_ID = b"\x01" * 16
SIZE = 64 << 10


def no_staging() -> StagingPool:
    raise AssertionError("host memory is served without staging")


@pytest.fixture
def served() -> Iterator[tuple[Listener, MemoryRegion, str]]:
    with _serving(TransferConfig()) as served:
        yield served


@contextlib.contextmanager
def _serving(config: TransferConfig) -> Iterator[tuple[Listener, MemoryRegion, str]]:
    config = config.replace(token=config.cluster_token())
    registry = MemoryRegistry()
    region = registry.register(np.zeros(SIZE, dtype=np.uint8))
    region.view[:] = pattern(4, SIZE).data
    listener = Listener(
        config,
        registry,
        lambda: SegmentDescriptor("s", ENGINE_ID.hex(), "p", "h", {}),
        ENGINE_ID,
        select_datapath("auto"),
        no_staging,
    )
    listener.start()
    try:
        yield listener, region, config.token or ""
    finally:
        listener.close()
        registry.close()


def _read_frame(region: int, offset: int, length: int, frame_id: int) -> bytes:
    return wire.HEADER.pack(FrameKind.READ, 0, 1, 0, frame_id) + struct.pack(
        "<QQQ", region, offset, length
    )


def test_a_read_frame_is_answered_with_exact_bytes_and_counted(
    served: tuple[Listener, MemoryRegion, str],
) -> None:
    listener, region, token = served
    sock, engine_id = wire.open_connection(listener.endpoints["tcp"], token, 5)
    with sock:
        assert engine_id == ENGINE_ID
        sock.sendall(_read_frame(region.id, 100, 1000, 7))
        header = wire.recv_exact(sock, wire.HEADER.size)
        assert wire.HEADER.unpack(header) == (FrameKind.RESPONSE, Status.OK, 0, 0, 7)
        assert wire.recv_exact(sock, 1000) == pattern(4, SIZE).data[100:1100]
        sock.sendall(_read_frame(region.id, SIZE - 10, 20, 8))  # past the end: refused
        header = wire.recv_exact(sock, wire.HEADER.size)
        assert wire.HEADER.unpack(header)[1] == Status.OUT_OF_BOUNDS
    stats = listener.stats()
    assert (stats.frames, stats.bytes_served, stats.protocol_errors) == (2, 1000, 0)


def test_a_private_region_is_unknown_to_peers(
    served: tuple[Listener, MemoryRegion, str],
) -> None:
    listener, region, token = served
    private = listener._registry.register(bytearray(b"\x05" * 4096), private=True)
    sock, _ = wire.open_connection(listener.endpoints["tcp"], token, 5)
    with sock:
        sock.sendall(_read_frame(private.id, 0, 10, 1))
        assert wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))[1] == (
            Status.UNKNOWN_REGION
        )
        header = wire.HEADER.pack(FrameKind.WRITE, 0, 1, 0, 2)
        sock.sendall(header + struct.pack("<QQQ", private.id, 0, 4) + b"\xff" * 4)
        assert wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))[1] == (
            Status.UNKNOWN_REGION
        )
        sock.sendall(_read_frame(region.id, 0, 10, 3))  # the connection goes on
        assert wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))[1] == Status.OK
        assert wire.recv_exact(sock, 10) == pattern(4, SIZE).data[:10]
    assert private.view == b"\x05" * 4096


def test_an_oversized_frame_closes_only_that_connection(
    served: tuple[Listener, MemoryRegion, str],
) -> None:
    listener, region, token = served
    bad, _ = wire.open_connection(listener.endpoints["tcp"], token, 5)
    with bad:
        bad.sendall(_read_frame(region.id, 0, 1 << 40, 1))
        assert bad.recv(1) == b"", "the listener hangs up"
    good, _ = wire.open_connection(listener.endpoints["tcp"], token, 5)
    with good:
        good.sendall(_read_frame(region.id, 0, 10, 2))
        assert wire.HEADER.unpack(wire.recv_exact(good, wire.HEADER.size))[1] == Status.OK
        assert wire.recv_exact(good, 10) == pattern(4, SIZE).data[:10]
    assert listener.stats().protocol_errors == 1


def test_a_wrong_token_is_refused_and_counted(served: tuple[Listener, MemoryRegion, str]) -> None:
    listener, _region, token = served
    with pytest.raises(AuthenticationError):
        wire.open_connection(listener.endpoints["tcp"], token + "-wrong", 5)
    listener.close()  # joins the serving thread: it counts after answering the client
    assert listener.stats().auth_failures == 1


def _served_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvconnect-serve"]


def _answered_reads(
    listener: Listener, region: MemoryRegion, token: str, count: int
) -> list[socket.socket]:
    """``count`` connections that each had one READ frame answered (byte-exact)."""
    socks = []
    for n in range(count):
        sock, _ = wire.open_connection(listener.endpoints["tcp"], token, 5)
        socks.append(sock)
        sock.sendall(_read_frame(region.id, n, 100, n))
        assert wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))[1] == Status.OK
        assert wire.recv_exact(sock, 100) == pattern(4, SIZE).data[n : n + 100]
    return socks


def test_a_connection_thread_stops_polling_once_its_window_passes() -> None:
    with _serving(TransferConfig(poll_window=0.1)) as (listener, region, token):
        socks = _answered_reads(listener, region, token, 1)
        threads = _served_threads()
        before = thread_cpu(threads)
        time.sleep(1.0)  # the span measured: polling for 0.1 s of it at most
        assert thread_cpu(threads) - before < 0.3
        for sock in socks:
            sock.close()


def test_at_most_poll_threads_connection_threads_poll_at_once() -> None:
    """Three idle connections inside a long window: one polls (a CPU), two sleep. Three
    polling threads would take both CPUs of the machine for the whole span."""
    config = TransferConfig(poll_window=30.0, poll_threads=1)
    with _serving(config) as (listener, region, token):
        socks = _answered_reads(listener, region, token, 3)
        threads = _served_threads()
        assert len(threads) == 3
        before = thread_cpu(threads)
        time.sleep(1.0)
        assert thread_cpu(threads) - before < 1.5
        for n, sock in enumerate(socks):  # each still answers at once: polling or asleep
            sock.sendall(_read_frame(region.id, 10 + n, 10, 100 + n))
            assert wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))[1] == Status.OK
            assert wire.recv_exact(sock, 10) == pattern(4, SIZE).data[10 + n : 20 + n]
            sock.close()
