"""TcpTransport on its own: slices to a real listener (an engine in this process) over a real
socket, without the engine's routing in between."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence

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
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.datapath.iov import select_datapath
from kvconnect.transfer.datapath.staging import StagingPool
from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.transports.tcp import TcpTransport
from tests.support.slices import MiB, submit_request
from tests.support.waiting import wait_for


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


class _GatedSource:
    """A FileSource whose reads wait until the test opens the gate: a peer slow to answer."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked = threading.Event()
        self.gate = threading.Event()

    def read_into(self, offset: int, view: memoryview) -> None:
        self.asked.set()
        if not self.gate.wait(30):
            raise OSError("the test never opened the gate")
        view[:] = self.data[offset : offset + view.nbytes]


def test_small_requests_on_an_idle_connection_complete_on_the_submitting_thread(
    target: tuple[TransferEngine, MemoryRegion], local: MemoryRegion
) -> None:
    """With a poll window, the thread that sends a small frame reads its response itself:
    the batch is complete when submit returns, and the bytes are right."""
    engine, remote = target
    config = engine.config.replace(poll_window=30.0, tcp_streams=1)
    transport = TcpTransport(config, select_datapath("auto"), no_staging, [].append)
    try:
        warm = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert warm.wait(10) == (TransferStatus.COMPLETED,)
        expected = pattern(5, MiB).data
        for i in range(20):
            at = 4096 * (i + 1)
            if i % 2:
                local.view[:4096] = pattern(i, 4096).data
                op = TransferOp.WRITE
            else:
                op = TransferOp.READ
            batch = submit_request(transport, engine.segment, op, local, remote.id, at, 4096)
            assert batch.wait(10) == (TransferStatus.COMPLETED,)
            if op is TransferOp.READ:
                assert local.view[:4096] == expected[at : at + 4096]
            else:
                assert remote.view[at : at + 4096] == pattern(i, 4096).data
        # The first one may race the sender thread that sent the warm-up for the socket.
        assert transport.stats().inline >= 19
    finally:
        transport.close()


def test_a_response_slower_than_the_poll_window_is_left_to_the_receiver_thread(
    local: MemoryRegion,
) -> None:
    data = pattern(11, MiB).data
    source = _GatedSource(data)
    with TransferEngine() as engine:
        remote = engine.register_source(source, MiB)
        config = engine.config.replace(poll_window=0.05, tcp_streams=1)
        transport = TcpTransport(config, select_datapath("auto"), no_staging, [].append)
        try:
            source.gate.set()
            warm = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
            assert warm.wait(10) == (TransferStatus.COMPLETED,)
            source.gate.clear()
            source.asked.clear()
            batch = submit_request(
                transport, engine.segment, TransferOp.READ, local, remote.id, 8192, 4096
            )
            assert not batch.done()  # submit returned after its window, the read still due
            assert source.asked.wait(10)  # the peer has it, and holds its answer
            source.gate.set()
            assert batch.wait(10) == (TransferStatus.COMPLETED,)
            assert local.view[:4096] == data[8192 : 8192 + 4096]
            assert transport.stats().inline == 0
        finally:
            transport.close()


def test_closing_the_transport_ends_a_submitting_thread_waiting_for_its_response(
    local: MemoryRegion,
) -> None:
    """However long the poll window, a thread waiting for its own response is released (and
    its request failed) as soon as the transport closes."""
    source = _GatedSource(bytes(MiB))
    with TransferEngine() as engine:
        remote = engine.register_source(source, MiB)
        config = engine.config.replace(poll_window=600.0, request_timeout=600.0, tcp_streams=1)
        transport = TcpTransport(config, select_datapath("auto"), no_staging, [].append)
        source.gate.set()
        warm = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert warm.wait(10) == (TransferStatus.COMPLETED,)
        source.gate.clear()
        source.asked.clear()
        batches: list[TransferBatch] = []
        submitter = threading.Thread(
            target=lambda: batches.append(
                submit_request(
                    transport, engine.segment, TransferOp.READ, local, remote.id, 0, 4096
                )
            )
        )
        submitter.start()
        assert source.asked.wait(10)
        transport.close()
        submitter.join(5)  # the batch's deadline (10 s) would end the wait only later
        source.gate.set()
        assert not submitter.is_alive()
        assert batches[0].wait(10) == (TransferStatus.FAILED,)


class _HeldSend:
    """A data path whose next ``sendv`` from a chosen thread stops once it has the socket's
    descriptor, as a thread descheduled right before its send syscall would."""

    def __init__(self) -> None:
        self._real = select_datapath("auto")
        self.name = self._real.name
        self.thread: threading.Thread | None = None
        self.inside = threading.Event()
        self.release = threading.Event()
        self.sock: socket.socket | None = None

    def sendv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        if threading.current_thread() is self.thread and not self.inside.is_set():
            self.sock = sock
            self.inside.set()
            assert self.release.wait(30)
        self._real.sendv(sock, buffers, timeout)

    def recvv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        self._real.recvv(sock, buffers, timeout)

    def copy_many(self, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        self._real.copy_many(dsts, srcs)


def test_a_broken_connection_is_closed_only_once_a_submitting_thread_let_go_of_it(
    local: MemoryRegion,
) -> None:
    """The native loops send on the bare descriptor: a connection closed while a submitting
    thread is about to send would hand its number to the next connection, whose handshake
    would then carry the old frame's bytes. Its socket stays open until that thread is done."""
    datapath = _HeldSend()
    owner = TransferEngine()
    owner.start()
    remote = owner.register(np.zeros(MiB, dtype=np.uint8))
    peer = owner.segment
    # No poll window: the receiver thread, not the submitting one, reads the response.
    config = owner.config.replace(tcp_streams=1, io_timeout=30.0, poll_window=0.0)
    transport = TcpTransport(config, datapath, no_staging, [].append)
    try:
        first = submit_request(transport, peer, TransferOp.READ, local, remote.id, 0, 4096)
        assert first.wait(10) == (TransferStatus.COMPLETED,)
        owner.close()  # the peer goes: its end of the connection is closed
        batches: list[TransferBatch] = []
        datapath.thread = threading.Thread(
            target=lambda: batches.append(
                submit_request(transport, peer, TransferOp.READ, local, remote.id, 0, 4096)
            )
        )
        datapath.thread.start()
        assert datapath.inside.wait(10)
        sock = datapath.sock
        assert sock is not None
        # The receiver thread meets the end of the stream and requeues the frame; the sender
        # thread takes it up and reaps the connection, but must not close it under the held
        # send (a peer gone for good is then reported).
        wait_for(lambda: transport.stats().retries >= 1, "the frame was not requeued")
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert sock.fileno() != -1, "closed while a submitting thread still sends on it"
            time.sleep(0.01)
        datapath.release.set()
        datapath.thread.join(10)
        assert batches[0].wait(10) == (TransferStatus.FAILED,)
        wait_for(lambda: sock.fileno() == -1, "the broken connection was never closed")
    finally:
        datapath.release.set()
        transport.close()
        owner.close()
