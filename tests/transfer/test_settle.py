"""Settlement: a request's memory is let go promptly after its deadline, on every transport, and
memory a transport thread still holds is never reported free (nor unregistered).

The data paths are slowed or held by wrapping the Python data path's methods (the copies and
socket reads the transports really make); peers are real processes where a user has them.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvconnect.errors import RegionBusy
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.datapath.copying import _COPY_CHUNK as COPY_CHUNK
from kvconnect.transfer.datapath.iov import PythonDataPath
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MiB = 1 << 20
SIZE = 64 * MiB
STALL_AT = 2 * MiB  # the slow data path stalls once it has moved this much (within a chunk)


@dataclass
class _Slow:
    """Moves bytes like the data path, but once ``STALL_AT`` bytes have moved it stalls until
    the batch's request has ended (its deadline passed); counts what moved after that."""

    batch: list[TransferBatch] = field(default_factory=list)
    moved: int = 0
    after: int = 0  # bytes moved after the stall
    stalled: bool = False

    def moved_bytes(self, n: int) -> None:
        if self.stalled:
            self.after += n
            return
        self.moved += n
        if self.moved >= STALL_AT:
            self.stalled = True
            wait_for(self._ended, "the request did not end at its deadline", timeout=60)

    def _ended(self) -> bool:
        return bool(self.batch) and self.batch[0].errors[0] is not None  # final, maybe pinned

    def copy_many(self, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst[:] = src
            self.moved_bytes(dst.nbytes)

    def recvv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        sock.settimeout(timeout)
        for buffer in buffers:
            got = 0
            while got < buffer.nbytes:
                n = sock.recv_into(buffer[got : got + 256 * 1024])
                if n == 0:
                    raise ConnectionResetError("peer closed the connection")
                got += n
                if buffer.nbytes > 64:  # payload, not a response header
                    self.moved_bytes(n)


@dataclass
class _Setup:
    engine: TransferEngine
    segment: str
    region: int
    seed: int


@pytest.fixture(params=["local", "shm", "tcp"])
def setup(request: pytest.FixtureRequest) -> Iterator[_Setup]:
    """A reader engine (Python data path, one copy thread, one stream) and a 64 MiB source
    reached over ``request.param``."""
    transport = request.param
    config = TransferConfig.from_env(
        transport=transport, native="off", copy_threads=1, tcp_streams=1, settle_grace=2.0
    )
    with ExitStack() as stack:
        if transport == "local":
            owner = stack.enter_context(TransferEngine(TransferConfig.from_env(native="off")))
            source = owner.allocate(SIZE)
            source.view[:] = pattern(21, SIZE).data
            segment, region, seed = owner.name, source.id, 21
        else:
            peer = stack.enter_context(
                PeerProcess(config={"transport": transport}, shared=SIZE, private=SIZE, seed=20)
            )
            name = "shared" if transport == "shm" else "private"
            segment, region, seed = peer.name, peer.regions[name], 20 + (name == "private")
        engine = stack.enter_context(TransferEngine(config))
        yield _Setup(engine, segment, region, seed)


def _digest(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def test_a_slow_copy_is_cut_at_the_deadline_and_settles(
    setup: _Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = _Slow()
    method = "recvv" if setup.engine.config.transport == "tcp" else "copy_many"
    monkeypatch.setattr(PythonDataPath, method, lambda _self, *args: getattr(slow, method)(*args))
    local = setup.engine.register(np.zeros(SIZE, dtype=np.uint8))
    request = TransferRequest(local, 0, setup.segment, setup.region, 0, SIZE)
    batch = setup.engine.submit(TransferOp.READ, [request], timeout=3.0)
    slow.batch.append(batch)
    assert batch.wait() == (TransferStatus.TIMEOUT,), "not settled within settle_grace"
    assert slow.stalled
    settled = _digest(local.view)
    if method == "copy_many":  # memcpy stops at the first chunk boundary after the deadline
        assert slow.after == 0, f"{slow.after} bytes were copied after the deadline"
        assert local.view[: slow.moved] == pattern(setup.seed, SIZE)[: slow.moved].data
        assert not np.frombuffer(local.view[slow.moved :], dtype=np.uint8).any()
    setup.engine.close()  # every transport thread has ended: nothing can land any more
    assert _digest(local.view) == settled, "bytes landed after the request settled"


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_memory_held_past_the_grace_is_reported_pending_and_kept(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered = threading.Event()
    real = PythonDataPath.copy_many

    def held(self: PythonDataPath, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        entered.set()
        assert release.wait(60)
        real(self, dsts, srcs)

    monkeypatch.setattr(PythonDataPath, "copy_many", held)
    config = TransferConfig.from_env(
        transport=transport, native="off", copy_threads=1, settle_grace=0.2
    )
    with ExitStack() as stack:
        if transport == "local":
            owner = stack.enter_context(TransferEngine(TransferConfig.from_env(native="off")))
            segment, region = owner.name, owner.allocate(SIZE).id
        else:
            peer = stack.enter_context(PeerProcess(config={"transport": "shm"}, shared=SIZE))
            segment, region = peer.name, peer.regions["shared"]
        engine = stack.enter_context(TransferEngine(config))
        local = engine.register(np.full(SIZE, 0xAB, dtype=np.uint8))
        request = TransferRequest(local, 0, segment, region, 0, SIZE)
        batch = engine.submit(TransferOp.READ, [request], timeout=0.2)
        settled = threading.Event()
        batch.add_settled_callback(settled.set)
        assert entered.wait(30)
        assert batch.wait() == (TransferStatus.PENDING,), "reported final while memory is held"
        assert not settled.is_set()
        assert engine.users(local) == 1
        with pytest.raises(RegionBusy):
            engine.unregister(local)  # the memory is not handed back
        release.set()
        assert settled.wait(30), "the settled callback never ran"
        assert batch.wait() == (TransferStatus.TIMEOUT,)
        after_settle = _digest(local.view)
        # The held chunk finished; nothing after it was copied (the request had ended).
        assert np.all(np.frombuffer(local.view[COPY_CHUNK:], dtype=np.uint8) == 0xAB)
        engine.unregister(local)
        engine.close()
        assert _digest(local.view) == after_settle
