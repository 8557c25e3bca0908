"""ShmTransport on its own: it maps a real memfd region of an engine in this process (through
that engine's fd socket) and copies, without the engine's routing in between."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvconnect.errors import AccessDenied
from kvconnect.testing.peer import pattern
from kvconnect.transfer import (
    MemoryRegion,
    TransferEngine,
    TransferOp,
    TransferStatus,
)
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.datapath.cuda import DeviceCopier
from kvconnect.transfer.datapath.iov import select_datapath
from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.transports import shm
from kvconnect.transfer.transports.shm import ShmTransport
from tests.support.slices import SLICE, MiB, done_in_submit, submit_request


def no_device() -> DeviceCopier:
    raise AssertionError("host memory needs no CUDA copier")


@contextlib.contextmanager
def shm_setup() -> Iterator[tuple[TransferEngine, MemoryRegion, MemoryRegion, ShmTransport]]:
    """An engine with 1 MiB of shared memory, a local region and a transport to map it (not a
    fixture: pytest would keep the allocated region, and so its memfd, alive past the module)."""
    registry = MemoryRegistry()
    workers = CopyWorkers(2, 4 * SLICE)
    with TransferEngine() as engine:
        remote = engine.allocate(MiB)
        remote.view[:] = pattern(7, MiB).data
        copier = Copier(select_datapath("auto"), no_device)
        transport = ShmTransport(engine.config, copier, workers, lambda _peer: None)
        try:
            yield engine, remote, registry.register(np.zeros(MiB, dtype=np.uint8)), transport
        finally:
            transport.close()
            workers.close()
            registry.close()


def test_read_and_write_through_the_mapping_are_byte_exact() -> None:
    with shm_setup() as (engine, remote, local, transport):
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert local.view == pattern(7, MiB).data
        local.view[:] = pattern(8, MiB).data
        batch = submit_request(transport, engine.segment, TransferOp.WRITE, local, remote.id)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert remote.view == pattern(8, MiB).data
        stats = transport.stats()
        assert (stats.bytes_read, stats.bytes_written, stats.errors, stats.peers) == (
            MiB,
            MiB,
            0,
            1,
        )


def test_an_unknown_region_is_refused() -> None:
    with shm_setup() as (engine, remote, local, transport):
        batch = submit_request(transport, engine.segment, TransferOp.READ, local, remote.id + 100)
        assert batch.wait(10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied)
        assert local.view == bytes(MiB), "a refused read wrote nothing"


def test_an_unregistered_region_is_refused_through_an_existing_mapping() -> None:
    with shm_setup() as (engine, remote, local, transport):
        peer = engine.segment
        assert submit_request(transport, peer, TransferOp.READ, local, remote.id).wait(10) == (
            TransferStatus.COMPLETED,
        )
        engine.unregister(remote)
        local.view[:] = bytes(MiB)
        batch = submit_request(
            transport, peer, TransferOp.READ, local, remote.id
        )  # the old descriptor
        assert batch.wait(10) == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied)


def test_forget_unmaps_the_peer() -> None:
    with shm_setup() as (engine, remote, local, transport):
        assert submit_request(transport, engine.segment, TransferOp.READ, local, remote.id).wait(
            10
        ) == (TransferStatus.COMPLETED,)
        assert transport.stats().peers == 1
        transport.forget(engine.segment.engine_id)
        assert transport.stats().peers == 0
        local.view[:] = bytes(MiB)
        batch = submit_request(
            transport, engine.segment, TransferOp.READ, local, remote.id, offset=4096
        )
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert local.view[: MiB - 4096] == pattern(7, MiB).data[4096:]


def test_forget_ends_a_handshake_with_a_peer_that_accepted_but_never_answers() -> None:
    # A stopped same-host process: its fd socket accepts, nobody answers the handshake. Forget
    # (and close) must end the call at once, not hold the peer's lock for connect_timeout.
    name = f"kvconnect-test-silent-{os.getpid()}"
    registry = MemoryRegistry()
    workers = CopyWorkers(2, 4 * SLICE)
    with (
        TransferEngine() as engine,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent,
    ):
        silent.bind("\0" + name)
        silent.listen()
        remote = engine.allocate(MiB)
        peer = msgspec.structs.replace(engine.segment, endpoints={"shm": f"@{name}"})
        config = engine.config.replace(connect_timeout=120.0)
        copier = Copier(select_datapath("auto"), no_device)
        transport = ShmTransport(config, copier, workers, lambda _peer: None)
        try:
            local = registry.register(np.zeros(MiB, dtype=np.uint8))
            batch = submit_request(transport, peer, TransferOp.READ, local, remote.id)
            accepted, _ = silent.accept()  # a copy worker is now in the handshake
            forgetting = threading.Thread(target=transport.forget, args=(peer.engine_id,))
            forgetting.start()
            forgetting.join(30)  # a quarter of connect_timeout
            assert not forgetting.is_alive(), "forget waited for the handshake's timeout"
            assert batch.wait(10) == (TransferStatus.FAILED,)
            accepted.close()
        finally:
            transport.close()
            workers.close()
            registry.close()


def test_a_small_copy_of_a_mapped_region_is_done_when_submit_returns() -> None:
    # No hand-off to a copy worker and back (two thread wake-ups) for a few KiB.
    with shm_setup() as (engine, remote, local, transport):
        peer = engine.segment
        assert submit_request(transport, peer, TransferOp.READ, local, remote.id).wait(10) == (
            TransferStatus.COMPLETED,
        )  # maps the region
        local.view[:] = bytes(MiB)
        batch = done_in_submit(
            lambda: submit_request(transport, peer, TransferOp.READ, local, remote.id, 4096, 4096)
        )
        assert batch.statuses == (TransferStatus.COMPLETED,)
        assert local.view[:4096] == pattern(7, MiB).data[4096:8192]
        local.view[:4096] = pattern(9, 4096).data
        batch = done_in_submit(
            lambda: submit_request(transport, peer, TransferOp.WRITE, local, remote.id, 0, 4096)
        )
        assert batch.statuses == (TransferStatus.COMPLETED,)
        assert remote.view[:4096] == pattern(9, 4096).data


def test_a_small_copy_never_waits_for_a_peer_busy_in_a_handshake() -> None:
    with shm_setup() as (engine, remote, local, transport):
        peer = engine.segment
        assert submit_request(transport, peer, TransferOp.READ, local, remote.id).wait(10) == (
            TransferStatus.COMPLETED,
        )
        state = transport._peers[peer.engine_id]
        local.view[:] = bytes(MiB)
        with state._lock:  # as while another thread maps a region (up to connect_timeout)
            batch = submit_request(transport, peer, TransferOp.READ, local, remote.id, 0, 4096)
            # submit returned although the peer is locked: the copy went to a worker, which
            # waits for the lock.
            assert not batch.done()
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        assert local.view[:4096] == pattern(7, MiB).data[:4096]


def test_a_small_copy_whose_owner_check_would_wait_completes_on_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The owner closed the control connection during the copy: telling whether it is alive
    # takes a fresh handshake, which the submitting thread leaves to a worker.
    asked: list[tuple[str, bool]] = []  # (thread, wait)
    check = shm._ShmPeer.check_alive

    def closed_meanwhile(self: shm._ShmPeer, *, wait: bool = True) -> bool:
        asked.append((threading.current_thread().name, wait))
        return check(self, wait=wait) if wait else False

    with shm_setup() as (engine, remote, local, transport):
        peer = engine.segment
        assert submit_request(transport, peer, TransferOp.READ, local, remote.id).wait(10) == (
            TransferStatus.COMPLETED,
        )
        monkeypatch.setattr(shm._ShmPeer, "check_alive", closed_meanwhile)
        local.view[:] = bytes(MiB)
        batch = submit_request(transport, peer, TransferOp.READ, local, remote.id, 8192, 4096)
        assert batch.wait(10) == (TransferStatus.COMPLETED,)
        # The submitting thread asked without waiting; then a copy worker, waiting (the
        # shared-memory watch thread may ask too, now and then).
        asked = [(thread, wait) for thread, wait in asked if "watch" not in thread]
        assert asked[0] == (threading.current_thread().name, False)
        assert asked[1][0].startswith("kvconnect-copy"), asked
        assert asked[1][1] is True
        assert local.view[:4096] == pattern(7, MiB).data[8192:12288]
        assert transport.stats().bytes_read == MiB + 4096
